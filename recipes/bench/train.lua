-- recipes/bench/train.lua: training throughput and peak memory of one model
-- configuration (issue 4, "Benchmark"). The model, data and optimizer are
-- recipes/longctx.lua's (nn.Transformer, byte-level /usr/include text,
-- AdamW lr 3e-3, betas 0.9/0.95, weight decay 0.1 except norms and
-- embeddings, global clip 1.0, HF aux loss 0.02 + z-loss 1e-3); the step is
-- moelua.train's (zero_grad, data, forward, backward, clip, optimizer step
-- with the experts' active masks). The router runs plain Mixtral (temperature
-- 1, no gate noise, no eps) so the PyTorch baseline computes the same thing.
--
--   ./moelua recipes/bench/train.lua --seq-len 4096 --dim 256 --layers 4 --heads 4 \
--       --kv-heads 2 --experts 8 --topk 2 --ffn 512 --steps 3
--   ./moelua recipes/bench/train.lua --help
--
-- First a memory plan of the same code (moelua.mem.plan). Then one warm-up
-- step (--warmup), mem.reset_peak() and `steps` timed steps. Prints one JSON
-- line: the config, tokens_per_s and step_ms (medians over the timed
-- steps), the phases (data/fwd/bwd/optim, medians, ms), model_ms (the
-- model's own timers inside fwd + bwd: attention, router, dispatch, experts,
-- ce; medians, ms), the ledger's peak
-- (total, per category, acts+pool) over the timed steps, the ledger's
-- current optim bytes, the optimizer's skipped_expert_steps and the process's
-- peak RSS (VmHWM, warm-up included, as for the PyTorch baseline), and the
-- plan's predicted ledger peak and acts+pool peak.
-- With --device cuda the model, its pool and activations live on the GPU
-- (the data loader's tokens are copied over), every clock read waits for
-- the GPU's queued work, and the peaks and plan are the cuda ledger's; the
-- line then also holds "device":"cuda", "dtype" (--dtype bf16: mixed
-- precision) and device_untracked_bytes (the device memory outside the
-- ledger, from cudaMemGetInfo). Every line holds params and
-- active_params (the experts counted at topk/experts) and
-- model_flop_per_token (3x model:flops(S)'s forward), for MFU.
-- The baseline is train_torch.py beside it; train_compare.sh interleaves both.
local moelua = require "moelua"
local nn = require "moelua.nn"
local optim = require "moelua.optim"
local sched = require "moelua.sched"
local data = require "moelua.data"
local options = require "moelua.options"
local errors = require "moelua.errors"
local json = require "dkjson"
local measure = require "moelua.measure"
local mem, bench = moelua.mem, moelua.bench
local median, peak_rss = measure.median, measure.peak_rss

local opts = options.parse(arg, {
  {"seq-len", 1024, "tokens per sequence"},
  {"dim", 64, "model width D"},
  {"layers", 2, "transformer blocks"},
  {"heads", 4, "attention heads"},
  {"kv-heads", 2, "key/value heads"},
  {"ffn", 128, "expert hidden width F"},
  {"experts", 4, "experts per MoE layer"},
  {"topk", 2, "experts per token"},
  {"checkpoint", "moe", "activation checkpointing: none, attention, moe, full"},
  {"save", "recompute", "expert pre-activations: save or recompute"},
  {"sparse", false, "lazy Adam for the experts (param_groups{sparse = true})"},
  {"steps", 3, "timed steps (after the warm-up steps)", min = 1},
  {"warmup", 1, "untimed warm-up steps before mem.reset_peak() (0: the peak includes the first step)"},
  {"lr", 3e-3, "learning rate (constant)"},
  {"aux-weight", 0.02, "HF aux loss weight"},
  {"z-weight", 1e-3, "router z-loss weight"},
  {"clip", 1.0, "global gradient-norm clip"},
  {"data", "/usr/include/**/*.h", "corpus glob"},
  {"seed", 0, "seed"},
  {"threads", 2, "CPU threads", min = 1, max = 1024},
  {"device", "cpu", "where the model trains: cpu or cuda"},
  {"dtype", "f32", "f32, or bf16 on cuda (mixed precision)"},
}, "usage: moelua recipes/bench/train.lua [options]")

local device = options.need_device(opts.device)
if opts.dtype ~= "f32" and not (opts.dtype == "bf16" and device == "cuda") then
  errors.user(string.format("--dtype %s: f32, or bf16 with --device cuda", opts.dtype))
end

moelua.threads(opts.threads)
moelua.manual_seed(opts.seed)

local ds = data.open{glob = opts.data, seq_len = opts.seq_len, seed = opts.seed, holdout = 0.01}
local lr = sched.constant(opts.lr)
local function now() return bench.now(device) end

local function build()
  local model = nn.Transformer.new{
    vocab = 256, dim = opts.dim, layers = opts.layers, heads = opts.heads, kv_heads = opts.kv_heads,
    ffn = opts.ffn, experts = opts.experts, topk = opts.topk, seed = opts.seed,
    checkpoint = opts.checkpoint, max_position = math.max(opts.seq_len, 131072),
    moe = {save = opts.save}, device = device, dtype = opts.dtype,
  }
  local groups = model:param_groups{weight_decay = 0.1, router_lr_mult = 1.0, sparse = opts.sparse}
  local opt = optim.AdamW(groups, {lr = opts.lr, beta1 = 0.9, beta2 = 0.95, weight_decay = 0.1})
  model:set_router{temperature = 1.0, noise = 0.0, eps = 0.0}
  return model, groups, opt
end

-- One step as moelua.train's Trainer:step does it (accum = 1), the
-- collector too: a full collection at the step's start, then held until
-- its end (the ledger's peaks repeat from step to step, and the collector
-- is not stepped by each tensor allocation). The collection is in the
-- step's time (total), not in a phase.
local function step(model, groups, opt, i)
  local t = {}
  local tc = now()
  collectgarbage()
  collectgarbage("stop")
  local _ <close> = setmetatable({}, {__close = function() collectgarbage("restart") end})   -- also on a raise
  model:zero_grad()
  local t0 = now()
  local tokens = ds:batch(i)
  local t1 = now()
  local loss, st = model:forward(tokens, i)
  local t2 = now()
  model:backward{aux_weight = opts.aux_weight, z_weight = opts.z_weight}
  local t3 = now()
  local norm = optim.clip_grad_norm(opt, opts.clip)
  opt:step(lr(i), model:active_masks(groups))
  local t4 = now()
  t.data, t.fwd, t.bwd, t.optim = t1 - t0, t2 - t1, t3 - t2, t4 - t3
  t.total = t4 - tc
  return t, loss, st, norm
end

-- The warm-up steps (pools grow, optimizer states appear), mem.reset_peak(),
-- then `steps` timed steps.
local function run(model, groups, opt, steps)
  local w = {total = 0}
  for i = 1, opts.warmup do w = step(model, groups, opt, i - 1) end
  if opts.warmup > 0 then collectgarbage(); mem.reset_peak() end
  local times, phases, losses = {}, {data = {}, fwd = {}, bwd = {}, optim = {}}, {}
  local parts = {}   -- the model's own timers (model.profile), per step
  for i = 1, steps do
    local t, loss = step(model, groups, opt, opts.warmup + i - 1)
    times[i] = t.total
    for k, v in pairs(phases) do v[#v + 1] = t[k] end
    for k, v in pairs(model:profile_summary().seconds) do
      parts[k] = parts[k] or {}
      parts[k][i] = v
    end
    losses[i] = loss
  end
  return w, times, phases, losses, parts
end

-- The ledger's peak predicted by a dry run of the same code (moelua.mem.plan:
-- nothing allocated, kernels skipped), then measured.
local books, why, _, raised = mem.plan(function()
  local model, groups, opt = build()
  run(model, groups, opt, 1)
end)
if not books then error(errors.is_user(raised) and raised or why, 0) end   -- a refused option: its message alone
local plan = books[device]
local model, groups, opt = build()
local w, times, phases, losses, parts = run(model, groups, opt, opts.steps)

local st = mem.stats()[device]
local peak = {total = st.total_peak}
for k, v in pairs(st.peak) do peak[k] = v end
local at_peak = {}
for k, v in pairs(st.at_peak or {}) do at_peak[k] = v end
local S = opts.seq_len
local step_s = median(times)
local ph = {}
for k, v in pairs(phases) do ph[k] = median(v) * 1e3 end
local model_ms = {}
for k, v in pairs(parts) do model_ms[k] = median(v) * 1e3 end
-- parameters, and those a token uses (topk of the experts)
local params, active = 0, 0
for _, u in ipairs(model.units) do
  local n = u.params:numel()
  params = params + n
  active = active + (u.kind == "experts" and n * opts.topk / opts.experts or n)
end

local out = {
  impl = "moelua", device = device ~= "cpu" and device or nil, dtype = device ~= "cpu" and opts.dtype or nil,
  seq_len = S, dim = opts.dim, layers = opts.layers, heads = opts.heads,
  kv_heads = opts.kv_heads, experts = opts.experts, topk = opts.topk, ffn = opts.ffn,
  checkpoint = opts.checkpoint, save = opts.save, sparse = opts.sparse, threads = moelua.threads(),
  steps = opts.steps, warmup = opts.warmup, warmup_ms = w.total * 1e3,
  tokens_per_s = S / step_s, step_ms = step_s * 1e3, step_ms_all = {},
  phases_ms = ph, model_ms = model_ms, loss_first = losses[1], loss_last = losses[#losses],
  peak_ledger_bytes = peak, ledger_at_peak_bytes = at_peak,
  peak_acts_pool_bytes = (st.peak.acts or 0) + (st.peak.pool or 0),
  optim_bytes = (st.current or {}).optim, skipped_expert_steps = opt.skipped_expert_steps,
  peak_rss_bytes = peak_rss(), params = params, active_params = math.floor(active + 0.5),
  model_flop_per_token = 3 * model:flops(S).forward / S,   -- forward + backward, recomputes not counted
  planned_peak_ledger_bytes = plan.total_peak,
  planned_peak_acts_pool_bytes = plan.peak.acts + plan.peak.pool,
  -- cuda: the device memory in use (cudaMemGetInfo) beyond the allocator's
  -- reservations: the CUDA context, cuBLAS's workspace, other processes
  device_untracked_bytes = device ~= "cpu" and st.untracked or nil,
  -- the ledger charges the pool's capacity (blocks grow geometrically);
  -- high_water is the most bytes the model's pool ever had in use
  pool_capacity_bytes = model.pool:stats().capacity, pool_high_water_bytes = model.pool:stats().high_water,
  pool_blocks = model.pool:stats().blocks, gemm = moelua.bench.gemm_libraries(),
}
for i, v in ipairs(times) do out.step_ms_all[i] = v * 1e3 end
print(json.encode(out))
