-- tests/spec/zero_spec.lua - ZeRO stages 0-3 over MPI (moelua.zero, the
-- distributed trainer): a tiny model trained by tests/tools/zero_run.lua
-- under `mpiexec -n N`, one OpenMP and one OpenBLAS thread per rank.
local support = require "tests.support"
local zero = require "moelua.zero"
local fs = require "moelua.fs"
local mio = require "moelua.io"

local tmpdir, corpus

local function mpirun(n, out, opts) return support.zero_run(n, out, corpus, opts) end
local params, max_diff = support.zero_params, support.max_diff

describe("moelua.zero.new", function()
  it("checks its options before anything is allocated, naming them", function()
    local fn = "moelua.zero.new: "
    support.raises(fn .. "option 'stage' must be 0, 1, 2 or 3, got 4", zero.new, {stage = 4})
    support.raises(fn .. "option 'prefetch' must be an integer >= 0, got -1", zero.new, {prefetch = -1})
    support.raises(fn .. "option 'reduce_every' must be \"micro\" or \"step\", got \"sometimes\"", zero.new,
                   {reduce_every = "sometimes"})
    support.raises(fn .. "unknown option 'stages' (expected one of: ep, offload, prefetch, reduce_every, stage)",
                   zero.new, {stages = 1})
    support.raises(fn .. "option 'offload' must be a boolean, got string", zero.new, {offload = "yes"})
    support.raises(fn .. "option 'ep' must be an integer >= 1, got 0", zero.new, {ep = 0})
  end)

  it("a recipe refuses a wrong or unused --zero, --prefetch or --reduce-every before anything is allocated", function()
    for _, case in ipairs{{{"--zero", "4"}, "option --zero must be at most 3, got 4"},
                          {{"--prefetch", "-1"}, "option --prefetch must be at least 0, got -1"},
                          {{"--reduce-every", "always"}, "option --reduce-every must be one of micro, step, got 'always'"},
                          -- given, but unused at the stage
                          {{"--prefetch", "2"}, "--prefetch: ZeRO-3 gathers units ahead of use; --zero 0 gathers none"},
                          {{"--reduce-every", "step"}, "--reduce-every: when ZeRO-2 and 3 reduce-scatter gradients; " ..
                                                       "--zero 0 reduces them once per step"}} do
      local p = assert(io.popen(support.host_command({"recipes/longctx.lua", case[1][1], case[1][2]}) .. " 2>&1"))
      local code, out = support.finish_child(p)
      assert.are.equal(1, code)
      support.has(out, case[2])
      assert.is_nil(out:find("memory plan", 1, true), "nothing was planned or allocated: " .. out)
    end
  end)
end)

if support.mpiexec_missing() then
  describe("moelua.zero under mpiexec", function() pending(support.mpiexec_missing()) end)
  return
end

describe("moelua.zero under mpiexec", function()
  setup(function()
    tmpdir = support.make_tmpdir()
    corpus = support.write_corpus(tmpdir .. "/corpus.txt", 7, 4000)
  end)
  teardown(function() support.remove_dir(tmpdir) end)

  it("stages 0, 1, 2, 3 at N = 4 give bitwise equal losses and parameters (5 AdamW steps)", function()
    local runs = {}
    for stage = 0, 3 do
      local out = string.format("%s/stage%d", tmpdir, stage)
      runs[stage] = {ranks = mpirun(4, out, {stage = stage, steps = 5}), out = out}
    end
    for stage = 1, 3 do
      for s = 0, 4 do
        assert.are.equal(runs[0].ranks[0].loss[s], runs[stage].ranks[0].loss[s],
                         string.format("stage %d, step %d", stage, s))
      end
      assert.are.equal(0, max_diff(params(runs[0].out, 0), params(runs[stage].out, 0)), "stage " .. stage)
    end
    for stage = 0, 3 do   -- and every rank holds the same model
      for r = 1, 3 do
        assert.are.equal(0, max_diff(params(runs[stage].out, 0), params(runs[stage].out, r)))
      end
    end
  end)

  it("lazy Adam: an expert with tokens on one rank only is updated the same on every rank, at every stage", function()
    local opts = {sparse = true, experts = 8, topk = 1, steps = 3, ["seq-len"] = 8}
    local runs = {}
    for _, stage in ipairs{0, 3} do
      opts.stage = stage
      local out = string.format("%s/lazy%d", tmpdir, stage)
      runs[stage] = {ranks = mpirun(4, out, opts), out = out}
    end
    -- the case happened: in the last step some expert ran tokens on some ranks only
    local partial = false
    for layer = 1, 2 do
      for e = 1, 8 do
        local on = 0
        for r = 0, 3 do on = on + (runs[0].ranks[r].mask[layer]:sub(e, e) == "1" and 1 or 0) end
        partial = partial or (on > 0 and on < 4)
      end
    end
    assert.is_true(partial, "no expert was active on only some ranks: the test proves nothing")
    for r = 0, 3 do
      assert.are.equal(0, max_diff(params(runs[0].out, 0), params(runs[0].out, r)), "rank " .. r)
    end
    assert.are.equal(0, max_diff(params(runs[0].out, 0), params(runs[3].out, 0)), "stage 3 vs 0")
    for s = 0, 2 do assert.are.equal(runs[0].ranks[0].loss[s], runs[3].ranks[0].loss[s]) end
  end)

  it("lazy Adam's states and step counts reshard; an expert never routed to has none", function()
    local root = tmpdir .. "/lazyck"
    local opts = {sparse = true, experts = 4, topk = 1, steps = 3, ["ckpt-every"] = 3, ["run-dir"] = root,
                  ["dead-expert"] = 2, stage = 3}
    mpirun(4, tmpdir .. "/lazyckout", opts)
    local saved = root .. "/ckpt/step-000002"
    local states = mio.open(saved .. "/optim/exp_avg.safetensors"):entries()
    local counts = mio.load(saved .. "/optim/steps.safetensors")
    local w2 = "model.layers.0.block_sparse_moe.experts.%d.w2.weight"
    assert.is_nil(states[w2:format(2)])                  -- never active: no states
    assert.is_not_nil(states[w2:format(1)])
    assert.are.equal(0, counts[w2:format(2)]:item())     -- its count is 0
    local most = 0
    for _, e in ipairs{0, 1, 3} do most = math.max(most, counts[w2:format(e)]:item()) end
    assert.are.equal(3, most)                            -- a busy expert took all 3 steps
    local files = {"model.safetensors", "optim/exp_avg.safetensors", "optim/exp_avg_sq.safetensors",
                   "optim/steps.safetensors"}
    for _, n in ipairs{2, 1} do   -- a resume that takes no step saves what it loaded
      local dir = string.format("%s/lazyre%d", tmpdir, n)
      mpirun(n, dir .. "out", {sparse = true, experts = 4, topk = 1, steps = 3, ["run-dir"] = dir, resume = saved,
                               stage = n == 2 and 2 or 0, ["dead-expert"] = 2})
      for _, f in ipairs(files) do
        assert.are.equal(fs.sha256(saved .. "/" .. f), fs.sha256(dir .. "/ckpt/step-000002/" .. f), n .. ": " .. f)
      end
    end
  end)

  it("the aux-loss-free router bias moves from the loads of all ranks, the same on each", function()
    local out = tmpdir .. "/bias"
    mpirun(4, out, {stage = 1, steps = 3, ["bias-rate"] = 0.01})
    local p0 = params(out, 0)
    assert.is_true(p0["bias.1"]:abs():max():item() > 0)
    for r = 1, 3 do assert.are.equal(0, max_diff(p0, params(out, r))) end
  end)

  it("N = 1, 2, 4 with N x accumulation = 4 train the same model", function()
    for _, o in ipairs{{optim = "sgd", steps = 10, tol = 1e-5}, {optim = "adamw", steps = 10, tol = 2e-4}} do
      local base
      for _, n in ipairs{1, 2, 4} do
        local out = string.format("%s/%s_n%d", tmpdir, o.optim, n)
        local r0 = mpirun(n, out, {stage = n == 4 and 3 or 1, accum = 4 // n, steps = o.steps, optim = o.optim})[0]
        if not base then
          base = r0
        else
          for s = 0, o.steps - 1 do
            local rel = math.abs(r0.loss[s] - base.loss[s]) / math.abs(base.loss[s])
            assert.is_true(rel <= o.tol, string.format("%s N=%d step %d: %.3g", o.optim, n, s, rel))
          end
        end
      end
    end
    -- one step: parameters within 1e-6
    local one = {}
    for _, n in ipairs{1, 4} do
      local out = string.format("%s/one_n%d", tmpdir, n)
      mpirun(n, out, {stage = 2, accum = 4 // n, steps = 1})
      one[n] = params(out, 0)
    end
    assert.is_true(max_diff(one[1], one[4]) <= 1e-6)
  end)

  it("at stage 3 a rank holds 1/N of parameters, gradients and optimizer states, and gathers only units in use", function()
    local out1, out4 = tmpdir .. "/mem1", tmpdir .. "/mem4"
    local one = mpirun(1, out1, {stage = 0, steps = 2})[0]
    local ranks = mpirun(4, out4, {stage = 3, steps = 2, prefetch = 1})
    local pad, largest = 0, 0
    for _, u in ipairs(ranks[0].units) do
      pad = pad + (u.shard * 4 - u.numel)
      largest = math.max(largest, u.numel)
    end
    for r = 0, 3 do
      local c = ranks[r].cur
      for _, k in ipairs{"params", "grads", "optim"} do
        assert.is_true(c[k] <= one.cur[k] / 4 + pad * 4 * (k == "optim" and 2 or 1),
                       string.format("rank %d %s: %d vs %d / 4", r, k, c[k], one.cur[k]))
      end
      -- the plan is this rank's memory, to the byte
      assert.are.equal(ranks[r].plan.total_peak, ranks[r].run.total_peak, "rank " .. r)
      -- gathered parameters: the units in use (a block's two) + the prefetched one
      assert.is_true(ranks[r].peak.comm <= 3 * (largest + 4) * 4 + 2 * largest * 4,
                     string.format("rank %d comm peak %d", r, ranks[r].peak.comm))
    end
  end)

  it("a checkpoint saved at N = 4, stage 3 resumes at N = 2 and N = 1 with the same tensors", function()
    local root = tmpdir .. "/ck4"
    local ref = mpirun(4, tmpdir .. "/ck4out", {stage = 3, steps = 4, ["ckpt-every"] = 3, ["run-dir"] = root})[0]
    local saved = root .. "/ckpt/step-000002"
    local files = {"model.safetensors", "optim/exp_avg.safetensors", "optim/exp_avg_sq.safetensors"}
    for _, n in ipairs{2, 1} do
      -- a resume that takes no step saves what it loaded: the same bytes
      local dir = string.format("%s/re%d", tmpdir, n)
      mpirun(n, dir .. "out", {stage = n == 2 and 1 or 0, steps = 3, ["run-dir"] = dir, resume = saved})
      for _, f in ipairs(files) do
        assert.are.equal(fs.sha256(saved .. "/" .. f), fs.sha256(dir .. "/ckpt/step-000002/" .. f), n .. ": " .. f)
      end
      -- and the next step's loss is the one the saving run took
      local nxt = mpirun(n, dir .. "next", {stage = n == 2 and 2 or 0, accum = 4 // n, steps = 4, resume = saved})[0]
      local rel = math.abs(nxt.loss[3] - ref.loss[3]) / math.abs(ref.loss[3])
      assert.is_true(rel <= 2e-4, string.format("N=%d: step 3 loss %.17g vs %.17g", n, nxt.loss[3], ref.loss[3]))
    end
  end)

  it("Ctrl-C on one rank: every rank stops after the same step, saved; one message, no MPI_Abort", function()
    local dir = tmpdir .. "/int"
    local script = tmpdir .. "/int.lua"
    support.write_file(script, string.format([[
      local dist = require "moelua.dist"
      local pid = math.tointeger(io.open("/proc/self/stat"):read("n"))
      arg = {[0] = "recipes/tiny.lua", "--steps", "30", "--seq-len", "64", "--run-dir", %q, "--zero", "1",
             "--data", %q}
      local train = require "moelua.train"
      local run = train.run
      train.run = function(cfg)   -- rank 1 alone presses Ctrl-C at step 3's start
        local hook = cfg.hook
        cfg.hook = function(step, state, ctl)
          if step == 3 and dist.rank() == 1 then io.popen("kill -INT " .. pid):close() end
          return hook(step, state, ctl)
        end
        return run(cfg)
      end
      dofile("recipes/tiny.lua")
    ]], dir, corpus))
    local code, out = support.finish_child(assert(io.popen(support.mpiexec_command(2, {script}, 60) .. " 2>&1")))
    assert.are.equal(1, code, out)
    local _, n = out:gsub("interrupted at step 4; saved [^\n]*step%-000003", "")
    assert.are.equal(1, n, out)
    assert.is_nil(out:find("Abort", 1, true), out)
    assert.is_nil(out:find("rank 1: ", 1, true), out)
    assert.is_nil(out:find("interrupt held", 1, true), out)   -- said by rank 0 alone, which got none
    assert.are.equal(3, require("moelua.ckpt").load(dir .. "/ckpt").trainer.step)
  end)
end)
