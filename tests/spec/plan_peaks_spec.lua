-- tests/spec/plan_peaks_spec.lua - the memory plan is exact (issue 14's
-- first test): for recipes/tiny.lua and recipes/longctx.lua at three
-- sequence lengths, in one process, on each rank of `mpiexec -n 2` with
-- ZeRO-3, and with an expert budget (one process: the store refuses ZeRO),
-- and on a GPU (the device memory outside the ledger under 1 GiB there),
-- the ledger peak of every category and the total that the run measures
-- (the last step's ledger_peak in its metrics.jsonl) equal to the byte both
-- plans of it: `moelua plan` with the same options (--world 2 --rank R for
-- a rank: a planned world, no mpiexec) and the plan the recipe makes of
-- itself before training (train.plan, the run's `plan` event in its
-- metrics.jsonl). Two steps a run, no validation
-- (--ckpt-every 0: neither the plans nor the steps validate).
local support = require "tests.support"
local json = require "dkjson"

local SEQS = {64, 128, 256}
-- Each recipe's model at test size, and an expert budget that holds two
-- of its experts' slabs (parameters, gradients, AdamW states): the store
-- evicts.
local RECIPES = {
  {file = "recipes/tiny.lua", args = {}, budget = "256KiB"},   -- D 32, F 64: 96 KiB an expert
  {file = "recipes/longctx.lua", args = {"--dim", "64", "--layers", "2", "--experts", "4", "--ffn", "128"},
   budget = "1MiB"},                                           -- 384 KiB an expert
}

-- How each recipe runs: its options beyond the recipe's, and what shows
-- that the mode is in force.
local MODES = {
  {name = "one process", tag = "one", ranks = 1, options = function() return {} end},
  {name = "mpiexec -n 2, --zero 3", tag = "zero3", ranks = 2,
   options = function() return {"--zero", "3", "--threads", "1", "--comm-timeout", "10"} end,
   check = function(p) assert.is_true(p.measured.comm > 0, "ZeRO-3 gathers through comm buffers") end},
  {name = "--expert-budget", tag = "budget", ranks = 1,
   options = function(recipe) return {"--expert-budget", recipe.budget} end,
   check = function(p) assert.is_true(p.measured.cache > 0, "the experts are in the store's cache") end},
  -- on a GPU (bf16, mixed precision): the device's used memory is the
  -- ledger's reservations and what lies outside it, the CUDA context and
  -- cuBLAS (595 MiB on an H200: gpu_memory_spec; the plan quotes it):
  -- under 1 GiB
  {name = "--device cuda", tag = "cuda", ranks = 1, cuda = true,
   options = function() return {"--device", "cuda"} end,
   check = function(p)
     assert.is_true(p.untracked ~= nil and p.untracked > 0 and p.untracked < 1 << 30,
                    "device memory outside the ledger: " .. tostring(p.untracked))
   end},
}

local base   -- build/plan_peaks: an expert store's file must be on a disk

-- The output of a child run by `command` (the shell's words); asserts
-- that it exited 0.
local function child(command)
  local code, out = support.finish_child(assert(io.popen(command .. " 2>&1")))
  assert.are.equal(0, code, out)
  return out
end

-- A book's peaks in the form of metrics.jsonl's ledger_peak: each category
-- and the total.
local function peaks_of(book)
  local peaks = {total = book.total_peak}
  for c, v in pairs(book.peak) do peaks[c] = v end
  return peaks
end

-- Plans (`moelua plan --json`, each rank) and then trains `recipe` for two
-- steps at seq_len in `mode`, on one process or under `mpiexec -n
-- mode.ranks`; returns per rank (1-based) the peaks of both plans (the
-- command's, and the recipe's own from the run's `plan` event) and the
-- measured ones (the last step's ledger_peak).
local function train(recipe, seq_len, mode)
  local ranks = mode.ranks
  local name = string.format("%s-%d-%s", recipe.file:match("([^/]+)%.lua$"), seq_len, mode.tag)
  local run_dir = base .. "/" .. name
  local opts = {"--steps", "2", "--ckpt-every", "0", "--seq-len", tostring(seq_len), "--run-dir", run_dir}
  for _, list in ipairs{recipe.args, mode.options(recipe)} do
    for _, a in ipairs(list) do opts[#opts + 1] = a end
  end
  local cli = {}
  for r = 0, ranks - 1 do
    local args = {"plan", recipe.file, "--json", table.unpack(opts)}
    if ranks > 1 then   -- a rank of a planned world
      for _, a in ipairs{"--world", tostring(ranks), "--rank", tostring(r)} do args[#args + 1] = a end
    end
    local out = child(support.host_command(args))
    local book = assert(json.decode(out), out)
    cli[r + 1] = peaks_of(book.books[book.device])
  end
  local args = {recipe.file, table.unpack(opts)}
  local out = child(ranks > 1 and support.mpiexec_command(ranks, args) or support.host_command(args))
  local last, plan, untracked
  for _, m in ipairs(support.metrics(run_dir)) do
    if m.ledger_peak then last, untracked = m.ledger_peak, m.device_untracked end
    if m.event == "plan" then plan = m.planned_peak end
  end
  assert.is_not_nil(last, "no step logged its ledger peak: " .. out)
  assert.is_not_nil(plan, "the run logged no plan event: " .. out)
  local measured = ranks > 1 and last.ranks or {last}
  local planned = ranks > 1 and plan.ranks or {plan}
  assert.are.equal(ranks, #measured, "ranks in the log")
  assert.are.equal(ranks, #planned, "ranks in the plan event")
  local per_rank = {}
  for r = 1, ranks do
    per_rank[r] = {cli = cli[r], run = planned[r], measured = measured[r], untracked = untracked}
  end
  return per_rank
end

-- Every category either side names (and the total): equal to the byte.
local function same_peaks(planned, measured, what)
  local seen = {}
  for _, side in ipairs{planned, measured} do
    for c in pairs(side) do
      if not seen[c] then
        seen[c] = true
        assert.are.equal(planned[c], measured[c], string.format("%s: %s peak, planned vs measured", what, c))
      end
    end
  end
  assert.is_true(seen.total and seen.params and seen.acts and seen.pool, what .. ": the categories are missing")
end

describe("the plans of a run equal its measured ledger peaks, per category, to the byte", function()
  setup(function() base = support.disk_dir("plan_peaks") end)
  teardown(function() support.remove_dir(base) end)

  for _, recipe in ipairs(RECIPES) do
    for _, mode in ipairs(MODES) do
      it(string.format("%s, %s, --seq-len %s", recipe.file, mode.name, table.concat(SEQS, ", ")), function()
        if mode.ranks > 1 and support.mpiexec_missing() then return pending(support.mpiexec_missing()) end
        if mode.cuda and not require("moelua").cuda_available() then return pending("no CUDA device") end
        for _, seq_len in ipairs(SEQS) do
          for r, p in ipairs(train(recipe, seq_len, mode)) do
            local what = string.format("--seq-len %d, rank %d", seq_len, r - 1)
            same_peaks(p.cli, p.measured, "moelua plan, " .. what)
            same_peaks(p.run, p.measured, "the recipe's plan, " .. what)
            if mode.check then mode.check(p) end
          end
        end
      end)
    end
  end
end)
