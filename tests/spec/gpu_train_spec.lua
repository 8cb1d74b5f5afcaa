-- A whole training step on the GPU against the CPU (issue 10): the tiny
-- model trained 5 steps on each device, routing compared where it is
-- decided by a margin, checkpoints resumed across devices, and the planned
-- CUDA peak against the measured one.
--
-- Tolerances. The CPU sums GEMMs in OpenBLAS's order, the GPU in cuBLAS's,
-- and the dense and MoE kernels in their own fixed orders (kernels/*.cu):
-- one step's loss agrees to ~1e-6 relative in f32. Over 5 AdamW steps the
-- differences grow through the updates (Adam divides by sqrt(v), so a
-- gradient near zero moves a weight by up to lr whichever its rounding):
-- losses agree to 1e-3 relative. Expert selection is compared only where
-- the CPU's k-th and (k+1)-th routing probabilities differ by more than
-- 1e-4, far above f32 rounding of a softmax over 4 logits; below that the
-- order is decided by rounding and may differ.
--
-- Mixed precision (dtype "bf16" on the GPU: bf16 weights and activations,
-- f32 gradients, masters and AdamW states) against the CPU's f32: every
-- activation is rounded to 8 significant bits (2^-8 relative), so a
-- step's loss moves by about that much times the depth of the sums that
-- feed it; 2e-2 relative over 5 steps (LOSS_TOL_BF16) bounds the drift
-- with room. A bf16 run's checkpoint holds the f32 masters, so it resumes
-- on the CPU as an f32 model and back.
--
-- Without a CUDA device the file is one pending test. With
-- MOELUA_GPU_SPEC_DEVICE=cpu it runs CPU against CPU (checks the spec).
local m = require "moelua"
local nn = require "moelua.nn"
local optim = require "moelua.optim"
local sched = require "moelua.sched"
local data = require "moelua.data"
local train = require "moelua.train"
local support = require "tests.support"

local DEV = os.getenv("MOELUA_GPU_SPEC_DEVICE") or "cuda"

if DEV == "cuda" and not m.cuda_available() then
  describe("GPU training", function()
    pending("no CUDA device: GPU specs skipped")
  end)
  return
end

local SEQ, STEPS, LOSS_TOL, MARGIN, LOSS_TOL_BF16 = 64, 5, 1e-3, 1e-4, 2e-2

local function corpus(dir)
  return support.write_corpus(dir .. "/corpus.txt", 4242, 4000)
end

local function build(device, checkpoint, dtype)
  return function()
    local model = nn.Transformer.new{vocab = 256, dim = 32, layers = 2, heads = 4, kv_heads = 2, ffn = 48,
                                     experts = 4, topk = 2, seed = 5, checkpoint = checkpoint or "moe",
                                     device = device, dtype = dtype}
    local groups = model:param_groups{weight_decay = 0.1}
    return model, optim.AdamW(groups, {lr = 3e-3, beta2 = 0.95}), groups
  end
end

local function cfg(path, device, over, dtype)
  local model, opt, groups = build(device, nil, dtype)()
  local c = {model = model, optimizer = opt, groups = groups, seq_len = SEQ, steps = STEPS, clip = 1.0,
             data = data.open{paths = {path}, seq_len = SEQ, seed = 1},
             lr = sched.warmup_cosine{peak = 3e-3, warmup = 2, total = STEPS}, aux_weight = 0.01,
             z_weight = 1e-3}
  for k, v in pairs(over or {}) do c[k] = v end
  return c
end

-- A 2-step run on DEV (of dtype) measures the peak train.plan predicted, per
-- category. On cuda the device's used memory (cudaMemGetInfo) is the
-- allocator's reservations plus what lies outside the ledger: the CUDA
-- context and cuBLAS, 595 MiB on an H200 (gpu_memory_spec; the plan quotes
-- it), so under 1 GiB here (no NCCL in one process).
local function planned_is_measured(dir, dtype)
  local c = cfg(corpus(dir), DEV, {run_dir = dir .. "/p", steps = 2}, dtype)
  c.model, c.optimizer, c.groups = nil, nil, nil
  c.build = build(DEV, nil, dtype)
  local plan = assert(train.plan(c))
  c.model, c.optimizer, c.groups = c.build()
  c.build, c.plan = nil, plan
  m.mem.reset_peak(DEV)
  train.run(c)
  local s = m.mem.stats()[DEV]
  assert.are.equal(plan.total_peak, s.total_peak)
  for k, v in pairs(plan.at_peak) do assert.are.equal(v, s.at_peak[k], k) end
  if DEV == "cuda" then   -- what the plan cannot book (issue 14): measured here, for the plan to quote
    assert.is_true(s.untracked ~= nil and s.untracked < 1 << 30, "device memory outside the allocator")
    print(string.format("# %s: device memory outside the ledger (CUDA context, cuBLAS, " ..
                        "other processes): %.1f MiB", dtype or "f32", s.untracked / 2^20))
  end
end

-- The tiny model's logits on `device` (of dtype) for a prefill of 10
-- tokens and then 6 decoded one at a time against a KV cache (as f32 on the cpu).
local function decode_logits(dir, device, dtype)
  local toks = data.open{paths = {corpus(dir)}, seq_len = SEQ, seed = 1}:batch(0):totable()
  local model = build(device, nil, dtype)()
  local cache = model:kv_cache(16)
  local out = {model:decode(m.tensor({table.unpack(toks, 1, 10)}):to("i64"), cache):to("cpu")}
  for p = 11, 16 do out[#out + 1] = model:decode(m.tensor({toks[p]}):to("i64"), cache):to("cpu") end
  cache:free()
  return out
end

-- DEV's decoded logits (in dtype) against the CPU's f32 ones, normwise within tol.
local function decodes_like_cpu(dir, dtype, tol)
  local cpu, dev = decode_logits(dir, "cpu"), decode_logits(dir, DEV, dtype)
  for i = 1, #cpu do
    support.assert_close(support.values(dev[i]:to("f32")), support.values(cpu[i]), tol, "logits of decode " .. i)
  end
end

describe("GPU training (" .. DEV .. ")", function()
  local dir
  before_each(function() dir = support.make_tmpdir() end)
  after_each(function() support.remove_dir(dir) end)

  it("trains 5 steps with the CPU's losses (1e-3 relative)", function()
    local path = corpus(dir)
    local cpu = train.run(cfg(path, "cpu", {run_dir = dir .. "/cpu"}))
    local gpu = train.run(cfg(path, DEV, {run_dir = dir .. "/gpu"}))
    for step = 0, STEPS - 1 do
      local a, b = cpu.losses[step], gpu.losses[step]
      assert(math.abs(a - b) <= LOSS_TOL * math.abs(a),
             string.format("step %d: cpu loss %.7f, %s %.7f", step, a, DEV, b))
    end
  end)

  it("selects the CPU's experts wherever the top-k margin exceeds 1e-4", function()
    local path = corpus(dir)
    local tokens = data.open{paths = {path}, seq_len = SEQ, seed = 1}:batch(0)
    local models = {cpu = build("cpu", "none")(), dev = build(DEV, "none")()}   -- the router inputs kept
    for _, model in pairs(models) do model:forward(tokens, 0) end
    local compared = 0
    for i, layer in ipairs(models.cpu:moe_layers()) do
      local c, g = layer.ctx, models.dev:moe_layers()[i].ctx
      local probs = m.matmul(c.x, layer.params.wg:t()):softmax()   -- [S, E] routing probabilities
      local top = probs:topk(3)                                      -- k + 1 = 3 largest per token
      local p, ci, gi = top:totable(), c.idx:totable(), g.idx:to("cpu"):totable()
      for t = 1, SEQ do
        if p[t][2] - p[t][3] > MARGIN then
          compared = compared + 1
          local a, b = {ci[t][1], ci[t][2]}, {gi[t][1], gi[t][2]}
          table.sort(a); table.sort(b)
          assert.are.same(a, b, string.format("layer %d token %d (margin %.2e)", i, t, p[t][2] - p[t][3]))
        end
      end
    end
    assert.is_true(compared > SEQ, "too few decided tokens to compare: " .. compared)
  end)

  it("resumes a checkpoint across devices, both ways", function()
    local path = corpus(dir)
    local base = train.run(cfg(path, DEV, {run_dir = dir .. "/a", ckpt_every = 2, keep = 5}))
    local on_cpu = train.run(cfg(path, "cpu", {run_dir = dir .. "/b", resume = dir .. "/a/ckpt/step-000001"}))
    assert.are.equal(2, on_cpu.first_step)
    local back = train.run(cfg(path, DEV, {run_dir = dir .. "/c", resume = dir .. "/b/ckpt/step-000004"}))
    assert.are.equal(5, back.first_step)
    for step = 2, STEPS - 1 do
      local a, b = base.losses[step], on_cpu.losses[step]
      assert(math.abs(a - b) <= LOSS_TOL * math.abs(a),
             string.format("step %d: %s run %.7f, resumed on cpu %.7f", step, DEV, a, b))
    end
  end)

  it("measures the peak that train.plan predicts, per category", function()
    planned_is_measured(dir)
  end)

  it("decodes with a KV cache: a prefill, then a token at a time, with the CPU's logits (1e-5 relative)", function()
    decodes_like_cpu(dir, nil, 1e-5)
  end)
end)

describe("GPU training in mixed precision (bf16 on " .. DEV .. ")", function()
  if DEV ~= "cuda" then   -- the CPU's kernels are f32 and f64
    pending("bf16 runs on cuda only")
    return
  end
  local dir
  before_each(function() dir = support.make_tmpdir() end)
  after_each(function() support.remove_dir(dir) end)

  local function close(a, b, what)
    assert(math.abs(a - b) <= LOSS_TOL_BF16 * math.abs(a), string.format("%s: %.7f against %.7f", what, b, a))
  end

  it("trains 5 steps near the CPU's f32 losses (2e-2 relative), its masters f32", function()
    local path = corpus(dir)
    local cpu = train.run(cfg(path, "cpu", {run_dir = dir .. "/cpu"}))
    local c = cfg(path, DEV, {run_dir = dir .. "/bf16"}, "bf16")
    for _, p in ipairs(c.model:named_parameters()) do assert.are.equal("f32", p.tensor:dtype(), p.name) end
    local gpu = train.run(c)
    for step = 0, STEPS - 1 do close(cpu.losses[step], gpu.losses[step], "step " .. step) end
  end)

  it("resumes its checkpoint (f32 masters) on the CPU and back", function()
    local path = corpus(dir)
    local base = train.run(cfg(path, DEV, {run_dir = dir .. "/a", ckpt_every = 2, keep = 5}, "bf16"))
    local on_cpu = train.run(cfg(path, "cpu", {run_dir = dir .. "/b", resume = dir .. "/a/ckpt/step-000001"}))
    assert.are.equal(2, on_cpu.first_step)
    local back = train.run(cfg(path, DEV, {run_dir = dir .. "/c", resume = dir .. "/b/ckpt/step-000004"}, "bf16"))
    assert.are.equal(5, back.first_step)
    for step = 2, STEPS - 1 do close(base.losses[step], on_cpu.losses[step], "step " .. step .. " resumed on cpu") end
  end)

  it("measures the peak that train.plan predicts, per category", function()
    planned_is_measured(dir, "bf16")
  end)

  it("decodes with a KV cache near the CPU's f32 logits (2e-2 relative)", function()
    decodes_like_cpu(dir, "bf16", LOSS_TOL_BF16)
  end)
end)
