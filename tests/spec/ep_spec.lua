-- tests/spec/ep_spec.lua - expert parallelism (moelua.zero's ep, the MoE
-- layer's token exchange): the tiny model of tests/tools/zero_run.lua
-- under `mpiexec -n N`, one OpenMP and one OpenBLAS thread per rank.
local support = require "tests.support"
local zero = require "moelua.zero"
local fs = require "moelua.fs"
local mio = require "moelua.io"

local tmpdir, corpus

local function mpirun(n, out, opts) return support.zero_run(n, out, corpus, opts) end

local function rel(a, b) return math.abs(a - b) / math.abs(b) end

-- The relative loss differences of two runs' rank 0, step by step, within tol.
local function same_losses(a, b, steps, tol, what)
  for s = 0, steps - 1 do
    assert.is_true(rel(a.loss[s], b.loss[s]) <= tol,
                   string.format("%s, step %d: %.17g vs %.17g", what, s, a.loss[s], b.loss[s]))
  end
end

describe("expert parallelism options", function()
  it("--ep must divide the ranks: an error naming --ep before anything is allocated", function()
    support.raises("--ep 3: the expert-parallel size must divide the number of ranks (1)", zero.new, {ep = 3})
    support.raises("option 'ep' must be an integer >= 1, got 1.5", zero.new, {ep = 1.5})
    local p = assert(io.popen(support.host_command({"recipes/longctx.lua", "--ep", "2"}) .. " 2>&1"))
    local code, out = support.finish_child(p)
    assert.are.equal(1, code)
    support.has(out, "--ep 2: the expert-parallel size must divide the number of ranks (1)")
    assert.is_nil(out:find("memory plan", 1, true), "nothing was planned or allocated: " .. out)
    assert.is_nil(out:find("traceback", 1, true), out)
  end)
end)

if support.mpiexec_missing() then
  describe("expert parallelism under mpiexec", function() pending(support.mpiexec_missing()) end)
  return
end

describe("expert parallelism under mpiexec", function()
  setup(function()
    tmpdir = support.make_tmpdir()
    corpus = support.write_corpus(tmpdir .. "/corpus.txt", 7, 4000)
  end)
  teardown(function() support.remove_dir(tmpdir) end)

  it("--ep must divide --experts: the recipe stops before anything is allocated, naming --ep", function()
    local cmd = support.mpiexec_command(2, {"recipes/longctx.lua", "--ep", "2", "--experts", "3",
                                            "--data", corpus, "--steps", "1"})
    local code, out = support.finish_child(assert(io.popen(cmd .. " 2>&1")))
    assert.are_not.equal(0, code)
    support.has(out, "--ep 2: the expert-parallel size must divide --experts (3)")
    assert.is_nil(out:find("memory plan", 1, true), "nothing was planned or allocated: " .. out)
  end)

  it("ep = 1, 2, 4 at N = 4, stages 0 and 3: the same losses (10 AdamW steps), 1/ep of the experts " ..
     "per rank, the plan exact", function()
    for _, stage in ipairs{0, 3} do
      local runs = {}
      for _, ep in ipairs{1, 2, 4} do
        runs[ep] = mpirun(4, string.format("%s/s%de%d", tmpdir, stage, ep), {stage = stage, ep = ep, steps = 10})
        for r = 0, 3 do   -- the exchange buffers are in the plan: planned = measured, to the byte
          assert.are.equal(runs[ep][r].plan.total_peak, runs[ep][r].run.total_peak,
                           string.format("stage %d ep %d rank %d", stage, ep, r))
        end
      end
      for _, ep in ipairs{2, 4} do same_losses(runs[ep][0], runs[1][0], 10, 2e-4, "stage " .. stage .. " ep " .. ep) end
      -- a rank's experts unit holds E / ep experts, sharded over world / ep ranks
      local function experts_numel(rk)
        for _, u in ipairs(rk.units) do if u.name == "layers.0.experts" then return u.numel, u.shard end end
      end
      local n1, s1 = experts_numel(runs[1][0])
      local n2, s2 = experts_numel(runs[2][0])
      local n4, s4 = experts_numel(runs[4][0])
      assert.are.same({n1 // 2, n1 // 4}, {n2, n4})
      if stage == 3 then assert.are.same({s1, s1, s1}, {s1, s2, s4}) end   -- N / ep ranks share E / ep experts
      if stage == 0 then
        assert.is_true(runs[4][0].cur.params < runs[2][0].cur.params and runs[2][0].cur.params < runs[1][0].cur.params)
      end
    end
  end)

  it("adversarial routing (rank 0 to expert 0, the others to the last): some ranks receive nothing, " ..
     "no hang, the losses of ep = 1", function()
    local opts = {adversarial = true, topk = 1, steps = 4, stage = 0}
    local base, ranks = mpirun(4, tmpdir .. "/adv1", opts)[0], nil
    for _, ep in ipairs{2, 4} do
      opts.ep = ep
      ranks = mpirun(4, tmpdir .. "/adv" .. ep, opts)
      same_losses(ranks[0], base, 4, 2e-4, "ep " .. ep)
    end
    -- the case happened: each rank routed only to expert 0 or to the last, so at
    -- ep = 4 the ranks holding experts 1 and 2 received nothing
    for r = 0, 3 do assert.are.equal(r == 0 and "1000" or "0001", ranks[r].mask[1], "rank " .. r) end
  end)

  it("capacity counts every rank's tokens, kept in global token order, whatever ep", function()
    -- every token of both ranks to expert 0, top-1, T = 32 per rank, E = 4, factor 1:
    -- the capacity is ceil(1 * 32 * 1 * 2 / 4) = 16 over both ranks: rank 0 keeps 16, rank 1 none
    local opts = {["route-all"] = 0, topk = 1, ["capacity-factor"] = 1.0, steps = 2}
    for _, ep in ipairs{1, 2} do
      opts.ep = ep
      local ranks = mpirun(2, tmpdir .. "/cap" .. ep, opts)
      assert.are.same({16, 32}, {ranks[0].dropped[1], ranks[1].dropped[1]}, "ep " .. ep)
    end
    -- under ordinary routing the drops and losses do not depend on ep
    opts["route-all"], opts.topk, opts.steps = nil, 2, 4
    local base
    for _, ep in ipairs{1, 2, 4} do
      opts.ep = ep
      local ranks = mpirun(4, tmpdir .. "/capr" .. ep, opts)
      local drops = {}
      for r = 0, 3 do drops[r + 1] = ranks[r].dropped[1] + ranks[r].dropped[2] end
      if not base then
        base = {drops = drops, r0 = ranks[0]}
        local any = 0
        for _, d in ipairs(drops) do any = any + d end
        assert.is_true(any > 0, "no assignment was dropped: the test proves nothing")
      else
        assert.are.same(base.drops, drops, "ep " .. ep)
        same_losses(ranks[0], base.r0, 4, 2e-4, "ep " .. ep)
      end
    end
  end)

  it("an expert no rank routes to: zero-size exchanges, no optimizer states, never updated (lazy Adam)", function()
    local root = tmpdir .. "/dead"
    mpirun(2, tmpdir .. "/deadout", {ep = 2, sparse = true, topk = 1, steps = 3, ["dead-expert"] = 1,
                                     ["run-dir"] = root, ["ckpt-every"] = 1})
    local first = mio.load(root .. "/ckpt/step-000000/model.safetensors")
    local last = mio.load(root .. "/ckpt/step-000002/model.safetensors")
    local states = mio.open(root .. "/ckpt/step-000002/optim/exp_avg.safetensors"):entries()
    local w = "model.layers.%d.block_sparse_moe.experts.%d.%s.weight"
    for layer = 0, 1 do
      for _, k in ipairs{"w1", "w2", "w3"} do
        local dead, live = w:format(layer, 1, k), w:format(layer, 0, k)
        assert.are.equal(0, first[dead]:sub(last[dead]):abs():max():item(), dead)
        assert.is_true(first[live]:sub(last[live]):abs():max():item() > 0, live)
        assert.is_nil(states[dead], dead)
        assert.is_not_nil(states[live], live)
      end
    end
  end)

  it("the aux-loss-free router bias after 10 steps is bitwise equal on all ranks", function()
    local out = tmpdir .. "/bias"
    mpirun(4, out, {ep = 2, stage = 3, steps = 10, ["bias-rate"] = 0.01})
    local b0 = support.zero_params(out, 0)
    assert.is_true(b0["bias.1"]:abs():max():item() > 0)
    for r = 1, 3 do
      local br = support.zero_params(out, r)
      for _, k in ipairs{"bias.1", "bias.2"} do assert.are.equal(0, b0[k]:sub(br[k]):abs():max():item(), k) end
    end
  end)

  it("a checkpoint saved at N = 4, ep = 2 resumes at N = 2, ep = 1 and at N = 1 with the same tensors", function()
    local root = tmpdir .. "/ck"
    local ref = mpirun(4, tmpdir .. "/ckout", {ep = 2, stage = 3, steps = 4, ["ckpt-every"] = 3, ["run-dir"] = root})[0]
    local saved = root .. "/ckpt/step-000002"
    -- the loads in the metrics are every rank's together, each rank's own beside them
    local ld
    for line in io.lines(root .. "/metrics.jsonl") do
      local m = require("dkjson").decode(line)
      ld = m.loads and m.loads[1] or ld   -- (checkpoint events have none)
    end
    assert.are.equal(4, #ld.ranks)
    for e = 1, #ld.counts do
      local sum = 0
      for r = 1, 4 do sum = sum + ld.ranks[r][e] end
      assert.are.equal(ld.counts[e], sum, "expert " .. (e - 1))
    end
    local files = {"model.safetensors", "optim/exp_avg.safetensors", "optim/exp_avg_sq.safetensors"}
    for _, n in ipairs{2, 1} do
      local dir = string.format("%s/re%d", tmpdir, n)
      -- a resume that takes no step saves what it loaded: the same bytes
      mpirun(n, dir .. "out", {stage = n == 2 and 1 or 0, steps = 3, ["run-dir"] = dir, resume = saved})
      for _, f in ipairs(files) do
        assert.are.equal(fs.sha256(saved .. "/" .. f), fs.sha256(dir .. "/ckpt/step-000002/" .. f), n .. ": " .. f)
      end
      local nxt = mpirun(n, dir .. "next", {stage = 0, accum = 4 // n, steps = 4, resume = saved})[0]
      assert.is_true(rel(nxt.loss[3], ref.loss[3]) <= 2e-4,
                     string.format("N=%d: step 3 loss %.17g vs %.17g", n, nxt.loss[3], ref.loss[3]))
    end
    -- and back: saved at N = 2, ep = 1, resumed at N = 4, ep = 4
    local dir = tmpdir .. "/re4"
    mpirun(4, dir .. "out", {ep = 4, stage = 2, steps = 3, ["run-dir"] = dir, resume = tmpdir .. "/re2/ckpt/step-000002"})
    for _, f in ipairs(files) do
      assert.are.equal(fs.sha256(saved .. "/" .. f), fs.sha256(dir .. "/ckpt/step-000002/" .. f), "ep 4: " .. f)
    end
  end)

  it("a rank stopped mid all-to-all: the others exit within timeout + 2 s, naming the exchange", function()
    local out = tmpdir .. "/stop"
    os.execute("mkdir -p " .. out)
    local args = {"tests/tools/zero_run.lua", "--corpus", corpus, "--out", out, "--ep", "2", "--steps", "3",
                  "--timeout", "2", "--stop-rank", "1", "--stop-at", "tokens of MoE layer 1"}
    local p = assert(io.popen(support.mpiexec_command(2, args, 30) .. " 2>&1; date +%s.%N"))
    local code, text = support.finish_child(p)
    local ended = tonumber(text:match("([%d%.]+)%s*$"))
    local stopped = tonumber(support.read_file(out .. "/stopped_at"))
    assert.are.equal(0, code)   -- (the shell's: date ran last)
    assert.is_true(ended - stopped < 2 + 2, string.format("took %.2f s", ended - stopped))
    support.has(text, "rank 0: ")
    support.has(text, "moelua.dist.Group:all_to_all_v: all-to-all-v of tokens of MoE layer 1 " ..
                      "(group expert-parallel(color 0), step 0, collective #")
    support.has(text, "did not complete within 2 s")
  end)
end)
