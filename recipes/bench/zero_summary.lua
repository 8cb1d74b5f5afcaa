-- recipes/bench/zero_summary.lua OUT_DIR: the table of recipes/bench/zero.sh
-- (BENCHMARKS.md): per run (N ranks, ZeRO stage) and rank, the ledger's
-- peak by category, the total, tokens/s (the job's) and the rank's seconds
-- per step in each kind of collective, from the last step of each
-- OUT_DIR/n<N>_zero<S>/metrics.jsonl.
local json = require "dkjson"
local dir = arg[1]
if not (dir and require("moelua.fs").stat(dir)) then   -- a user error: no traceback
  require("moelua.errors").user("usage: moelua recipes/bench/zero_summary.lua OUT_DIR (the directory of zero.sh; got "
                                .. tostring(dir) .. ")")
end

local function last_step(path)
  local f = io.open(path)
  if not f then return nil end
  local m
  for line in f:lines() do
    local o = json.decode(line)
    if o and o.step and o.loss and not o.event then m = o end
  end
  f:close()
  return m
end

local cpu = require("moelua.measure").cpu()
print(string.format("CPU: %s, flags %s; one OpenMP and one OpenBLAS thread per rank", cpu.model,
                    table.concat(cpu.flags, " ")))
print()
local cats = {"params", "grads", "optim", "acts", "pool", "comm"}
local MiB = 2^20
print("| N | ZeRO | rank | " .. table.concat(cats, " | ") .. " | total | tok/s | all-gather s | reduce-scatter s | all-reduce s | numbers s |")
print("|---:|---:|---:|" .. string.rep("---:|", #cats) .. "---:|---:|---:|---:|---:|---:|")
for _, n in ipairs{1, 2, 4} do
  for stage = 0, 3 do
    local m = last_step(string.format("%s/n%d_zero%d/metrics.jsonl", dir, n, stage))
    if m then
      local ranks = m.ledger_peak.ranks or {m.ledger_peak}
      for r, p in ipairs(ranks) do
        local w = m.comm_seconds and m.comm_seconds[r] or {}
        local cells = {}
        for i, c in ipairs(cats) do cells[i] = string.format("%.2f", (p[c] or 0) / MiB) end
        local tail = string.format("%s | %.3f | %.3f | %.3f | %.3f",
                                   r == 1 and string.format("%.0f", m.tokens_per_s) or "",
                                   w.all_gather or 0, w.reduce_scatter or 0, w.all_reduce or 0, w.numbers or 0)
        print(string.format("| %d | %d | %d | %s | %.2f | %s |", n, stage, r - 1, table.concat(cells, " | "),
                            p.total / MiB, tail))
      end
    else
      print(string.format("| %d | %d | - | no result |", n, stage))
    end
  end
end
print()
print("MiB: each category's own peak and the total peak of the ledger, per rank.")
