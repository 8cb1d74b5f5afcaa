-- ZeRO and expert parallelism with CUDA tensors in mixed precision (bf16
-- weights and activations, f32 gradients, masters and AdamW states): the
-- tiny model of tests/tools/zero_run.lua under `mpiexec -n 2`, its
-- collectives over NCCL. Every reduction is moelua.dist's (a sum in rank
-- order), so the stages give bitwise equal losses and weights, as on the
-- CPU (zero_spec), and expert parallelism the same losses within the
-- CPU's tolerance (ep_spec: 2e-4 relative).
--
-- NCCL refuses two ranks on one GPU ("Duplicate GPU detected"): with
-- fewer than two devices the runs pend. Without a CUDA device or without
-- MPICH's mpiexec (a GPU bundle's machine has none) the file is one
-- pending test. The emulated CUDA build
-- (tests/tools/cuda_emu/moelua.sh, with its NCCL stand-in) runs it in
-- make test.
local m = require "moelua"
local support = require "tests.support"

local cuda, devices = m.cuda_available()
local why = not cuda and "no CUDA device: GPU specs skipped" or support.mpiexec_missing()
if why then
  describe("GPU sharded training", function() pending(why) end)
  return
end

describe("GPU sharded training (bf16 on cuda, 2 ranks)", function()
  local tmpdir, corpus
  setup(function()
    tmpdir = support.make_tmpdir()
    corpus = support.write_corpus(tmpdir .. "/corpus.txt", 7, 4000)
  end)
  teardown(function() support.remove_dir(tmpdir) end)

  local function run(name, opts)
    opts.device, opts.dtype, opts.steps = "cuda", "bf16", 3
    local out = tmpdir .. "/" .. name
    return {ranks = support.zero_run(2, out, corpus, opts), out = out}
  end

  if devices < 2 then
    pending(string.format("2 ranks need 2 GPUs (NCCL runs one rank per GPU), this machine has %d", devices))
    return
  end

  it("stages 0, 1, 2, 3 give bitwise equal losses and bf16 weights on every rank", function()
    local runs = {}
    for stage = 0, 3 do runs[stage] = run("stage" .. stage, {stage = stage}) end
    for stage = 1, 3 do
      for s = 0, 2 do
        assert.are.equal(runs[0].ranks[0].loss[s], runs[stage].ranks[0].loss[s],
                         string.format("stage %d, step %d", stage, s))
      end
      assert.are.equal(0, support.max_diff(support.zero_params(runs[0].out, 0), support.zero_params(runs[stage].out, 0)),
                       "stage " .. stage)
    end
    for stage = 0, 3 do
      assert.are.equal(0, support.max_diff(support.zero_params(runs[stage].out, 0),
                                           support.zero_params(runs[stage].out, 1)), "ranks of stage " .. stage)
    end
  end)

  it("expert parallelism (--ep 2), stages 0 and 3: the losses of ep 1 (2e-4 relative)", function()
    for _, stage in ipairs{0, 3} do
      local one, two = run("ep1s" .. stage, {stage = stage}), run("ep2s" .. stage, {stage = stage, ep = 2})
      for s = 0, 2 do
        local a, b = one.ranks[0].loss[s], two.ranks[0].loss[s]
        assert(math.abs(a - b) <= 2e-4 * math.abs(a), string.format("stage %d step %d: ep 1 %.9g, ep 2 %.9g",
                                                                     stage, s, a, b))
      end
    end
  end)
end)
