-- recipes/bench/store_summary.lua OUT_DIR: the tables of recipes/bench/store.sh
-- (BENCHMARKS.md). Training, per run (budget, --expert-prefetch): tokens/s
-- and seconds per step (medians over the steps after the first), the
-- store's traffic in the last step (the deltas of its cumulative counters
-- between the last two steps of OUT_DIR/<run>/metrics.jsonl), the ledger's
-- `cache` peak against the budget, and the seconds that traffic needs at the
-- measured page-cache and disk bandwidths (OUT_DIR/bandwidth.txt) against
-- the step. Generation: bytes/s, hit rate and MiB read per budget, and
-- whether every budget generated the same text as all experts resident.
local json = require "dkjson"
local measure = require "moelua.measure"
local dir = arg[1]
if not (dir and require("moelua.fs").stat(dir)) then   -- a user error: no traceback
  require("moelua.errors").user("usage: moelua recipes/bench/store_summary.lua OUT_DIR (the directory of store.sh; got "
                                .. tostring(dir) .. ")")
end
local MiB = 2^20

local function pairs_file(path)   -- "key number" lines
  local t = {}
  local f = io.open(path)
  if not f then return t end
  for line in f:lines() do
    local k, v = line:match("^(%S+)%s+(.*)$")
    if k then t[k] = tonumber(v) or v end
  end
  f:close()
  return t
end

local function steps(path)
  local f = io.open(path)
  if not f then return nil end
  local out = {}
  for line in f:lines() do
    local o = json.decode(line)
    if o and o.step and o.loss and not o.event then out[#out + 1] = o end
  end
  f:close()
  return #out >= 2 and out or nil
end

local bw = pairs_file(dir .. "/bandwidth.txt")
local cpu = measure.cpu()
print(string.format("CPU: %s, flags %s; 2 threads", cpu.model, table.concat(cpu.flags, " ")))
print(string.format("Bandwidth (dd, %s-byte blocks): disk read %.0f MiB/s, disk write %.0f MiB/s (O_DIRECT); " ..
                    "page cache read %.0f MiB/s, write %.0f MiB/s (buffered, file cached); MemAvailable %.1f GiB",
                    bw.slab_bytes, bw.disk_read / MiB, bw.disk_write / MiB, bw.cache_read / MiB,
                    bw.cache_write / MiB, bw.mem_available / 2^30))
-- load.txt: per run, the load before it and the machine's disk KiB read and
-- written while it ran (/proc/vmstat's pgpgin, pgpgout: the next line's less this one's)
local loads, disk, prev = {}, {}, nil
for line in io.lines(dir .. "/load.txt") do
  local name, l1, pin, pout = line:match("^(%S+)%s+(%S+)%s+(%d+)%s+(%d+)")
  if name then
    loads[#loads + 1] = l1
    if prev then disk[prev[1]] = {(pin - prev[2]) / 1024, (pout - prev[3]) / 1024} end
    prev = {name, tonumber(pin), tonumber(pout)}
  end
end
print("Load average (1 min) before each run, then at the end: " .. table.concat(loads, ", "))
local function disk_cells(name)
  local d = disk[name]
  return d and string.format("%.0f / %.0f", d[1], d[2]) or "-"
end
print()

local all_bytes = bw.slabs * bw.slab_bytes
local runs = {{"all", "resident", 0}}
for _, b in ipairs{{"100", 1}, {"50", 2}, {"25", 4}, {"two", 0}} do
  local budget = b[2] > 0 and all_bytes // b[2] or 2 * bw.slab_bytes
  for _, pf in ipairs{2, 0} do
    runs[#runs + 1] = {string.format("b%s_pf%d", b[1], pf), b[2] > 0 and (b[1] .. "%") or "two slabs", budget, pf}
  end
end

local trained = false   -- (store.sh's part "generate" runs no training)
for _, r in ipairs(runs) do trained = trained or steps(string.format("%s/%s/metrics.jsonl", dir, r[1])) ~= nil end
if trained then
  print("| budget | prefetch | slots | tok/s | step s | fastest step s | experts s | optim s | read MiB | written MiB | hits | misses | "
        .. "cache peak MiB | budget MiB | page-cache s | disk s | page-cache / step | disk / step | loss | disk MiB in / out |")
  print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
  for _, r in ipairs(runs) do
    local ss = steps(string.format("%s/%s/metrics.jsonl", dir, r[1]))
    if ss then
      local tps, secs, ex, opt = {}, {}, {}, {}
      for i = 2, #ss do
        tps[#tps + 1], secs[#secs + 1] = ss[i].tokens_per_s, ss[i].step_seconds
        ex[#ex + 1], opt[#opt + 1] = ss[i].phases.experts, ss[i].phases.optim
      end
      local last, prev = ss[#ss], ss[#ss - 1]
      local a, b = last.expert_store or {}, prev.expert_store or {}
      local function d(k) return (a[k] or 0) - (b[k] or 0) end
      local rd, wr = d("bytes_read"), d("bytes_written")
      local step = measure.median(secs)
      local tcache = rd / bw.cache_read + wr / bw.cache_write
      local tdisk = rd / bw.disk_read + wr / bw.disk_write
      print(string.format("| %s | %s | %s | %.0f | %.3f | %.3f | %.3f | %.3f | %.1f | %.1f | %d | %d | %.1f | %s | %.3f | %.3f | %.2f | %.2f | %.6f | %s |",
                          r[2], r[4] or "-", a.slots and tostring(a.slots) or "-", measure.median(tps), step,
                          math.min(table.unpack(secs)), measure.median(ex), measure.median(opt), rd / MiB, wr / MiB, d("hits"), d("misses"),
                          (last.ledger_peak.cache or 0) / MiB, r[3] > 0 and string.format("%.1f", r[3] / MiB) or "-",
                          tcache, tdisk, tcache / step, tdisk / step, last.loss, disk_cells(r[1])))
    else
      print(string.format("| %s | %s | no result |", r[2], r[4] or "-"))
    end
  end
  print()
  print(string.format("tok/s, step s, experts s, optim s: medians over steps 2-%d (the phases' seconds per step); " ..
                      "fastest step s: the least of those steps' seconds; " ..
                      "read, written, hits, misses: the store's counters in the last step; page-cache s, disk s: " ..
                      "read / read bandwidth + written / write bandwidth; disk MiB in / out: the whole machine's " ..
                      "reads from and writes to its disks while the run ran (/proc/vmstat; other jobs included).",
                      bw.steps))
  print()
end

local function gen(name)   -- the text and the statistics line of OUT_DIR/gen_<name>.log
  local f = io.open(string.format("%s/gen_%s.log", dir, name))
  if not f then return nil end
  local lines = {}
  for line in f:lines() do lines[#lines + 1] = line end
  f:close()
  local stat = table.remove(lines)
  if not stat or not stat:match("bytes/s") then return nil end
  return {text = table.concat(lines, "\n"), stat = stat, bps = tonumber(stat:match("([%d%.]+) bytes/s"))}
end
local base = gen("all_1")
print("| budget | slots | bytes/s (median) | bytes/s (3 runs) | hit rate % | hits | misses | MiB read | prefetch hints | " ..
      "text as resident | disk MiB in / out |")
print("|---|---:|---:|---|---:|---:|---:|---:|---:|---|---:|")
for _, g in ipairs{{"all", "resident"}, {"100", "100%"}, {"50", "50%"}, {"25", "25%"}, {"one", "one slab"}} do
  local rs, bps, same = {}, {}, true
  for i = 1, 3 do
    local r = gen(g[1] .. "_" .. i)
    if r then
      rs[#rs + 1], bps[#bps + 1] = r, r.bps
      same = same and base ~= nil and r.text == base.text
    end
  end
  local r = rs[1]
  if r then
    local slots = r.stat:match("experts: (%d+) of") or "-"
    local rate, hits, misses = r.stat:match("hit rate ([%d%.]+)%% %((%d+) hits, (%d+) misses%)")
    local read, hints = r.stat:match("([%d%.]+) MiB read, (%d+) prefetch hints")
    local each = {}
    for j, v in ipairs(bps) do each[j] = string.format("%.1f", v) end
    print(string.format("| %s | %s | %.1f | %s | %s | %s | %s | %s | %s | %s | %s |", g[2], slots, measure.median(bps),
                        table.concat(each, ", "), rate or "-", hits or "-", misses or "-", read or "-", hints or "-",
                        (same and #rs == 3) and "identical" or "DIFFERENT", disk_cells("gen_" .. g[1])))
  else
    print(string.format("| %s | no result |", g[2]))
  end
end
print()
print("hits, misses, MiB read, prefetch hints: the first run's (every run's are the same); text as resident: all three " ..
      "runs' output equals the first resident run's; disk MiB: the three runs together.")
if base then
  print()
  print("Generated (every budget): " .. string.format("%q", base.text))
end
