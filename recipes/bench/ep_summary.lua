-- recipes/bench/ep_summary.lua OUT_DIR: the tables of recipes/bench/ep.sh
-- (BENCHMARKS.md): per run (N = 4 ranks, ep, ZeRO stage) and rank, the
-- ledger's peak by category, the total, tokens/s (the job's), the rank's
-- seconds in all-to-all and the bytes it sent to the other ranks of its
-- expert-parallel group in the step, against the analytic count; from the
-- last step of each OUT_DIR/n4_ep<P>_zero<S>/metrics.jsonl and the model
-- options of the run's final checkpoint (trainer.json's provenance).
--
-- Analytic bytes (lua/moelua/moe.lua _forward_ep / _backward_ep; f32 rows,
-- i64 ids and counts). In one MoE layer and one micro-batch, rank r sends
-- S_r kept assignments to experts on the other ranks of its group and
-- receives R_r from them. One forward sends the counts (one row of E/ep
-- i64 to each of the ep - 1 others), then per row sent its x (4D bytes),
-- its weight (4) and its expert id (8), and per row received the expert's
-- output back (4D). Backward sends dy per row sent (4D), dx and dw per row
-- received (4D + 4). With f forwards per micro-batch (2 when the MoE half
-- is recomputed in backward: --checkpoint moe or full; else 1), per step
-- (L layers, A micro-batches):
--   B_r = A L 8 f (E/ep) (ep - 1) + sum over layers and micro-batches of
--         S_r (f (4D + 12) + 4D) + R_r (f 4D + 4D + 4)
-- (checkpoint moe, D = 256: S_r 3096 + R_r 3076 bytes per row). With T =
-- seq_len tokens per rank, all T k assignments kept (dropless), and p_r the
-- share of the layer's assignments that go to rank r's E/ep experts:
-- S_r = T k (1 - p_r), R_r = (ep - 1) T k p_r when every rank of the group
-- routes the same shares (the routing does not depend on the source rank).
-- "uniform": p_r = 1/ep, S_r = R_r = T k (ep - 1) / ep. "loads": p_r from
-- the step's loads (counts per expert summed over all ranks; the last
-- micro-batch's, taken A times). The metrics hold all_to_all_bytes per rank
-- but S_r and R_r only through those sums, so a rank's own split cannot be
-- checked; since sum S_r = sum R_r = X, the job's total gives X exactly:
-- sum B_r = N A L 8 f (E/ep)(ep - 1) + X ((8f + 8) D + 12 f + 4). The
-- second table checks that the remainder is 0 and sets X against its value
-- under source-independent routing, N T k L A (ep - 1) / ep, whatever the
-- loads.
local json = require "dkjson"
local dir = arg[1]
if not (dir and require("moelua.fs").stat(dir)) then   -- a user error: no traceback
  require("moelua.errors").user("usage: moelua recipes/bench/ep_summary.lua OUT_DIR (the directory of ep.sh; got "
                                .. tostring(dir) .. ")")
end
local N = 4

-- The last step's metrics and the final checkpoint's directory.
local function last_step(path)
  local f = io.open(path)
  if not f then return nil end
  local m, ck
  for line in f:lines() do
    local o = json.decode(line)
    if o and o.step and o.loss and not o.event then m = o end
    if o and o.event == "checkpoint" then ck = o.dir end
  end
  f:close()
  return m, ck
end

local function run_options(ck)
  local f = ck and io.open(ck .. "/trainer.json")
  if not f then return nil end
  local t = json.decode(f:read("a"))
  f:close()
  return t and t.provenance and t.provenance.options
end

local cpu = require("moelua.measure").cpu()
print(string.format("CPU: %s, flags %s; one OpenMP and one OpenBLAS thread per rank", cpu.model,
                    table.concat(cpu.flags, " ")))
print()

-- The analytic pieces of one run: the counts' bytes per rank, the bytes of
-- a row sent (S) and of a row received (R), summed over both ends, and the
-- job's rows to other ranks under source-independent routing; bytes(r, p)
-- is rank r's count (0-based) with p(layer, g) the share of group rank g's
-- experts in that layer.
local function analytic(o, ep)
  local f = (o.checkpoint == "moe" or o.checkpoint == "full") and 2 or 1
  local D, L, A, Tk = o.dim, o.layers, o.accum, o.seq_len * o.topk
  local a = {counts = A * L * 8 * f * (o.experts // ep) * (ep - 1), rows = N * A * L * Tk * (ep - 1) / ep,
             sent = f * (4 * D + 12) + 4 * D, received = f * 4 * D + 4 * D + 4}
  a.per_row = a.sent + a.received
  function a.bytes(r, p)
    local b = a.counts
    for l = 1, L do
      local share = p(l, r % ep)
      b = b + A * Tk * ((1 - share) * a.sent + (ep - 1) * share * a.received)
    end
    return b
  end
  return a
end

-- p(layer, g) from a step's loads: the share of the layer's counts that go
-- to group rank g's experts.
local function load_shares(loads, ep)
  return function(l, g)
    local c, all, own = loads[l].counts, 0, 0
    local El = #c // ep
    for e, n in ipairs(c) do
      all = all + n
      if (e - 1) // El == g then own = own + n end
    end
    return all > 0 and own / all or 1 / ep
  end
end

local runs = {}
for _, ep in ipairs{1, 2, 4} do
  for _, stage in ipairs{0, 3} do
    local m, ck = last_step(string.format("%s/n4_ep%d_zero%d/metrics.jsonl", dir, ep, stage))
    runs[#runs + 1] = {ep = ep, stage = stage, m = m, o = run_options(ck)}
  end
end

local cats = {"params", "grads", "optim", "acts", "pool", "comm"}
local MiB = 2^20
print("| ep | ZeRO | rank | " .. table.concat(cats, " | ") ..
      " | total | tok/s | all-to-all s | sent MiB | uniform MiB | loads MiB | sent / loads |")
print("|---:|---:|---:|" .. string.rep("---:|", #cats) .. "---:|---:|---:|---:|---:|---:|---:|")
for _, run in ipairs(runs) do
  local m, o = run.m, run.o
  if m and o then
    local a = analytic(o, run.ep)
    local uniform, shares = function() return 1 / run.ep end, load_shares(m.loads, run.ep)
    for r, p in ipairs(m.ledger_peak.ranks or {m.ledger_peak}) do
      local w = m.comm_seconds and m.comm_seconds[r] or {}
      local sent = m.all_to_all_bytes and m.all_to_all_bytes[r] or 0
      local by_loads = a.bytes(r - 1, shares)
      local cells = {}
      for i, c in ipairs(cats) do cells[i] = string.format("%.2f", (p[c] or 0) / MiB) end
      print(string.format("| %d | %d | %d | %s | %.2f | %s | %.3f | %.2f | %.2f | %.2f | %s |", run.ep, run.stage,
                          r - 1, table.concat(cells, " | "), p.total / MiB,
                          r == 1 and string.format("%.0f", m.tokens_per_s) or "", w.all_to_all or 0,
                          sent / MiB, a.bytes(r - 1, uniform) / MiB, by_loads / MiB,
                          by_loads > 0 and string.format("%.3f", sent / by_loads) or "-"))
    end
  else
    print(string.format("| %d | %d | - | no result |", run.ep, run.stage))
  end
end
print()
print("MiB: each category's own peak and the total peak of the ledger, per rank; all-to-all s: the")
print("rank's seconds in all-to-all during the step, waiting included; sent: bytes the rank sent to")
print("the other ranks of its group in the step; uniform, loads: the analytic count when every")
print("expert gets the same share, and when every rank routes with the shares of the step's loads.")
print()
print("| ep | ZeRO | sent, all ranks (B) | counts (B) | rows to other ranks X | remainder | X if source-independent | ratio |")
print("|---:|---:|---:|---:|---:|---:|---:|---:|")
for _, run in ipairs(runs) do
  local m, o = run.m, run.o
  if m and o and run.ep > 1 then
    local a = analytic(o, run.ep)
    local total = 0
    for _, b in ipairs(m.all_to_all_bytes or {}) do total = total + b end
    local rows_bytes = total - N * a.counts
    print(string.format("| %d | %d | %d | %d | %d | %d | %.0f | %.4f |", run.ep, run.stage, total, N * a.counts,
                        rows_bytes // a.per_row, rows_bytes % a.per_row, a.rows,
                        (rows_bytes / a.per_row) / a.rows))
  end
end
print()
print("X: the job's rows to other ranks over the step's layers and micro-batches (each also comes")
print("back), from the sum of all_to_all_bytes; remainder: bytes the formula leaves unexplained;")
print("source-independent: N T k L A (ep - 1) / ep, whatever the loads.")
