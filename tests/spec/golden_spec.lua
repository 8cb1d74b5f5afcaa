-- The tiny-model golden test (STYLE.md, Tests): a fixed seed, a generated
-- corpus and a short loss trajectory, checked against figures recorded
-- before the op-layer refactor (issue 10), so that no change of numerics
-- passes unseen. The tolerance is normwise, 2e-5 relative on the loss: the
-- trajectory goes through OpenBLAS, whose results depend on its thread
-- count (DESIGN.md, Tensors), and through the optimizer for 8 steps. A
-- numerics change (a different summation, a lost bias, a wrong gradient)
-- moves these figures by 1e-3 or more.
local m = require "moelua"
local nn = require "moelua.nn"
local optim = require "moelua.optim"
local sched = require "moelua.sched"
local data = require "moelua.data"
local train = require "moelua.train"
local support = require "tests.support"

local SEQ = 32

-- Recorded on the CPU (f32) at commit dddfec9, before the refactor.
local GOLDEN = {5.5917890, 5.5050578, 5.3058093, 5.3097683, 5.1596015, 5.0505278, 4.9509629, 5.0078742}

describe("golden tiny-model trajectory", function()
  local dir
  before_each(function() dir = support.make_tmpdir() end)
  after_each(function() support.remove_dir(dir) end)

  it("repeats the recorded losses of 8 AdamW steps", function()
    support.write_corpus(dir .. "/corpus.txt", 12345, 3000)   -- the same on every machine
    m.manual_seed(7)
    local model = nn.Transformer.new{vocab = 256, dim = 32, layers = 2, heads = 4, kv_heads = 2,
                                     ffn = 48, experts = 4, topk = 2, seed = 7, checkpoint = "moe"}
    local ds = data.open{paths = {dir .. "/corpus.txt"}, seq_len = SEQ, seed = 3}
    local groups = model:param_groups{weight_decay = 0.1}
    local opt = optim.AdamW(groups, {lr = 3e-3, beta2 = 0.95})
    local r = train.run{model = model, data = ds, optimizer = opt, groups = groups, seq_len = SEQ,
                        steps = 8, clip = 1.0, aux_weight = 0.01, z_weight = 1e-3,
                        lr = sched.warmup_cosine{peak = 3e-3, warmup = 2, total = 8},
                        run_dir = dir .. "/run"}
    for i, want in ipairs(GOLDEN) do
      local have = r.losses[i - 1]
      assert.is_true(math.abs(have - want) <= 2e-5 * math.abs(want),
                     string.format("step %d: loss %.7f, golden %.7f", i - 1, have, want))
    end
  end)
end)
