-- recipes/longctx.lua: train a small Mixtral-style MoE language model at long
-- context on real text (the C headers under /usr/include, read as bytes),
-- on the CPU or a GPU (--device cuda), within a memory budget. Everything a
-- researcher tunes is here: edit this file and run it again, no rebuild;
-- the per-step hooks below
-- can even be edited while it runs (taken at the next step).
--
--   ./moelua recipes/longctx.lua                       # defaults below
--   ./moelua recipes/longctx.lua --seq-len 32768 --steps 50
--   ./moelua recipes/longctx.lua --resume runs/longctx/ckpt
--   ./moelua recipes/longctx.lua --init-from path/to/mixtral-ckpt   # fine-tune its weights
--   mpiexec -n 4 ./moelua recipes/longctx.lua --zero 3   # 4 processes, ZeRO-3
--   ./moelua recipes/longctx.lua --help
local moelua = require "moelua"
local nn = require "moelua.nn"
local optim = require "moelua.optim"
local sched = require "moelua.sched"
local data = require "moelua.data"
local train = require "moelua.train"
local options = require "moelua.options"
local errors = require "moelua.errors"
local dist = require "moelua.dist"
local zero = require "moelua.zero"
local mem = moelua.mem
local function say(...) if dist.rank() == 0 then print(...) end end   -- rank 0 speaks for the job

local spec = {
  -- the model
  {"vocab", 256, "vocabulary size (the data are bytes: ids 0-255; a larger vocabulary only adds rows)", min = 256},
  {"dim", 64, "model width D", min = 1},
  {"layers", 2, "transformer blocks", min = 1},
  {"heads", 4, "attention heads", min = 1},
  {"kv-heads", 2, "key/value heads (grouped-query attention)", min = 1},
  {"ffn", 128, "expert hidden width F", min = 1},
  {"experts", 4, "experts per MoE layer", min = 1},
  {"topk", 2, "experts per token", min = 1},
  {"checkpoint", "moe", "activation checkpointing per layer: none, attention, moe, full",
   choices = {"none", "attention", "moe", "full"}},
  {"save", "recompute", "expert pre-activations: save or recompute (a layer whose MoE half is checkpointed " ..
                        "recomputes them either way)", choices = {"save", "recompute"}},
  -- the data
  {"data", "/usr/include/**/*.h", "corpus: a glob of text files, read as bytes"},
  {"seq-len", 8192, "tokens per sequence", min = 1},
  {"accum", 1, "micro-batches per optimizer step", min = 1},
  -- the optimizer and schedules
  {"steps", 50, "optimizer steps", min = 1},
  {"lr", 3e-3, "peak learning rate", min = 0},
  {"warmup", 4, "warmup steps", min = 0},
  {"clip", 1.0, "global gradient-norm clip (0: none)", min = 0},
  {"aux-weight", 0.02, "load-balancing (HF aux) loss weight", min = 0},
  {"z-weight", 1e-3, "router z-loss weight", min = 0},
  {"temperature", 1.0, "router temperature at step 0 (x0.99 every 1000 steps)", min = 1e-6},
  {"noise", 0.1, "gate noise at step 0, decayed with the temperature", min = 0},
  {"eps", 0.05, "uniform share mixed into router probabilities at step 0, decayed to 0.01", min = 0, below = 1},
  -- the run
  {"seed", 0, "seed of the model, the data order and the gate noise", min = 0},
  {"device", "cpu", "where the model trains: cpu or cuda"},
  {"dtype", "", "f32, or bf16 on cuda: mixed precision (bf16 weights and activations; f32 gradients, " ..
                "optimizer states and master weights, which checkpoints hold); default: bf16 on cuda, f32 on cpu"},
  {"threads", 2, "CPU threads", min = 1, max = 1024},
  {"budget-gib", 0.0, "memory budget in GiB (0: 90% of available)", min = 0},
  {"force-budget", false, "accept a --budget-gib above the memory available (the OOM killer, not an error, " ..
                          "then ends a run that needs it)"},
  {"run-dir", "runs/longctx", "metrics.jsonl and checkpoints go here (must be empty, or --resume / --overwrite)"},
  {"overwrite", false, "replace the run in --run-dir (its metrics.jsonl, ckpt/ and plots/; nothing else)"},
  {"ckpt-every", 10, "checkpoint every N steps (0: only at the end)", min = 0},
  {"keep", 2, "checkpoints to keep", min = 1},
  {"max-rollbacks", 5, "rollbacks to one checkpoint before the run stops", min = 0},
  {"resume", "", "continue from a checkpoint (a directory or the ckpt root)"},
  {"attach", false, "listen on RUN_DIR/attach/sock for `moelua attach RUN_DIR` (moelua.remote)"},
  {"init-from", "", "start from a Mixtral-format checkpoint's weights: a directory holding model.safetensors " ..
                    "or a sharded index (F32/BF16/F16; shapes must match the model options)"},
  -- several processes (mpiexec -n N ./moelua recipes/longctx.lua ...)
  {"zero", 0, "ZeRO stage: 0 replicates, 1 shards optimizer states, 2 also gradients, 3 also parameters",
   min = 0, max = 3},
  {"prefetch", 1, "ZeRO-3: units gathered ahead of use", min = 0},
  {"reduce-every", "micro", "ZeRO-2/3: reduce-scatter gradients every micro-batch or once per step (micro, step)",
   choices = {"micro", "step"}},
  {"ep", 1, "expert parallelism: ranks that split each block's experts (divides the ranks and --experts)", min = 1},
  -- bounded expert memory (one process)
  {"expert-budget", "", "keep at most this many bytes of experts (parameters, gradients, AdamW states) " ..
                        "resident, e.g. 64MiB; the rest in --expert-store on cpu, in pinned host memory on " ..
                        "cuda (copied to GPU memory on a copy stream; f32 or bf16)"},
  {"expert-store", "", "the expert store's backing file on cpu (default RUN_DIR/experts.store; a disk, not tmpfs)"},
  {"expert-prefetch", 2, "experts the store hints ahead of use", min = 0},
  {"offload-optimizer", false, "keep AdamW's states in RUN_DIR/optim.store (a disk, not tmpfs) on cpu, in " ..
                               "pinned host memory on cuda (with --dtype bf16 the f32 master weights in host " ..
                               "memory too), updated chunk by chunk through at most 4 MiB of staging (5 MiB " ..
                               "with bf16's masters; one process)"},
  {"comm-timeout", 60.0, "seconds a collective may wait before the job stops, naming it", min = 0.1},
  {"comm-debug", false, "check before every collective that all ranks call the same one"},
}
-- A recipe that runs this one with other defaults (recipes/tiny.lua) sets
-- arg.defaults: they replace these, in --help too.
for _, o in ipairs(spec) do
  if arg.defaults and arg.defaults[o[1]] ~= nil then o[2] = arg.defaults[o[1]] end
end
local opts, given = options.parse(arg, spec, "usage: moelua " .. (arg[0] or "recipes/longctx.lua") .. " [options]")

-- Per-step settings. Temperature and eps preserve the order of the router
-- scores, so on their own they never change which experts are chosen: they
-- reshape the combine weights and the aux loss's probabilities. The gate
-- noise is what explores, so it anneals together with the temperature.
local temperature = sched.exponential{start = opts.temperature, factor = 0.99, every = 1000}
local noise = sched.exponential{start = opts.noise, factor = 0.99, every = 1000}
local eps = sched.piecewise_linear{{0, opts.eps}, {opts.steps, math.min(opts.eps, 0.01)}}
local function hook(step, state, ctl)
  ctl.temperature, ctl.noise, ctl.eps = temperature(step), noise(step), eps(step)
  ctl.aux_weight, ctl.z_weight = opts.aux_weight, opts.z_weight
  ctl.lr_scale = state.lr_scale or 1.0
end

-- After a rollback (loss spike, skipped steps or router collapse), train
-- more gently from the restored checkpoint.
local function on_rollback(state, event)
  state.lr_scale = (state.lr_scale or 1.0) * 0.5
  local set = event.overrides and event.overrides.lr_scale   -- `moelua attach`'s set{} wins over the hook
  say(string.format("rollback at step %d (%s): lr scale now %.3g%s", event.step, event.reason, state.lr_scale,
                    set and string.format(" (an attached client's lr_scale = %g holds until it unsets it)", set) or ""))
end

-- A balance alarm (moelua.train: hot, collapse, dead; loads against the
-- even share). A dead expert restarts as a noisy copy of the layer's
-- busiest one; a collapse is reported (one that lasts rolls back on its
-- own). Hot experts are frequent at 4 experts top-2 (3000 steps of the
-- tiny model: 156 hot alarms, 10 collapses), so they stay in
-- metrics.jsonl and `moelua attach` (stats.alarms), off the console.
local function on_alarm(state, alarm, model)
  if alarm.kind == "dead" and opts.ep > 1 then   -- the two experts may live on different ranks
    say(string.format("step %d: expert %d of layer %d had no tokens for %d steps (not restarted: --ep %d)",
                      alarm.step, alarm.expert, alarm.layer, alarm.steps, opts.ep))
  elseif alarm.kind == "dead" then
    model:reinit_expert(alarm.layer, alarm.expert, alarm.busiest, 1e-3)
    say(string.format("step %d: expert %d of layer %d had no tokens for %d steps: restarted from expert %d",
                        alarm.step, alarm.expert, alarm.layer, alarm.steps, alarm.busiest))
  elseif alarm.kind == "collapse" then
    say(string.format("step %d: router collapse in layer %d: its %d busiest experts hold %.2f x their even " ..
                        "share (threshold %.2f)", alarm.step, alarm.layer, opts.topk, alarm.ratio, alarm.threshold))
  end
end

-- The hooks above can be edited while the job runs: at the start of each
-- step the trainer re-reads this file when it changed, with MOELUA_RELOAD
-- set, and takes the hooks returned here (a broken edit keeps the old ones).
if MOELUA_RELOAD then return {hook = hook, on_rollback = on_rollback, on_alarm = on_alarm} end
local this_file = debug.getinfo(1, "S").source:match("^@(.*)$")

options.device(opts.device)
if opts.dtype == "" then opts.dtype = opts.device == "cuda" and "bf16" or "f32" end   -- DESIGN.md: GPU runs are bf16
if opts.dtype ~= "f32" and opts.dtype ~= "bf16" then
  errors.user(string.format("--dtype %s: must be f32 or bf16", opts.dtype))
elseif opts.dtype == "bf16" and opts.device ~= "cuda" then
  errors.user("--dtype bf16: mixed precision runs on --device cuda (the CPU's kernels are f32)")
end
if opts.expert_store ~= "" and opts.device ~= "cpu" then
  errors.user("--expert-store: on --device " .. opts.device .. " the expert store keeps its experts in pinned " ..
              "host memory, not in a file (leave it out)")
end
dist.init{timeout = opts.comm_timeout, debug = opts.comm_debug}
local zero_opts = {stage = opts.zero, prefetch = opts.prefetch, reduce_every = opts.reduce_every, ep = opts.ep,
                   offload = opts.offload_optimizer}   -- (with bf16: the f32 masters in host memory)
zero.new(zero_opts)   -- its errors before anything is allocated
options.refuse_unused(given, {
  {"expert-store", opts.expert_budget == "", "the expert store's file is used only with --expert-budget " ..
                                             "(give both, or neither)"},
  {"expert-prefetch", opts.expert_budget == "", "the expert store's hints are used only with --expert-budget"},
  {"prefetch", opts.zero < 3, "ZeRO-3 gathers units ahead of use; --zero " .. opts.zero .. " gathers none"},
  {"reduce-every", opts.zero < 2, "when ZeRO-2 and 3 reduce-scatter gradients; --zero " .. opts.zero ..
                                  " reduces them once per step"},
})
if opts.offload_optimizer and (opts.zero > 0 or dist.world() > 1) then
  errors.user(string.format("--offload-optimizer: not built for sharded training yet (--zero %d on %d rank%s): " ..
                            "use one process at --zero 0", opts.zero, dist.world(), dist.world() == 1 and "" or "s"))
end
if opts.experts % opts.ep ~= 0 then
  errors.user(string.format("--ep %d: the expert-parallel size must divide --experts (%d)", opts.ep, opts.experts))
end
moelua.threads(opts.threads)
moelua.manual_seed(opts.seed)
if opts.budget_gib > 0 then
  local bytes = math.floor(opts.budget_gib * 2^30)   -- a float when past the integers
  if math.type(bytes) ~= "integer" or bytes < 1 then   -- 0 bytes would remove every budget
    errors.user(string.format("--budget-gib %g is %s: give a budget in GiB, or 0 for 90%% of the memory available",
                              opts.budget_gib, bytes < 1 and "less than one byte" or "out of range"))
  end
  local ok, err = pcall(mem.budget, {total = bytes, force = opts.force_budget, device = opts.device})
  if not ok then
    -- the ledger names the API's `force = true`: the command line's is --force-budget
    errors.user(string.format("--budget-gib %g: %s", opts.budget_gib,
                              (tostring(err):gsub("mem%.budget{[^}]*force = true}",
                                                  "--force-budget"))))
  end
elseif opts.force_budget then
  errors.user("--force-budget accepts a --budget-gib above the memory available: give it with --budget-gib")
end

-- --expert-budget: the experts in an expert store (moelua.expert_store)
-- under that many resident bytes, its file in the run directory by default.
local store
if opts.expert_budget ~= "" then
  store = {budget = options.bytes("expert-budget", opts.expert_budget), prefetch = opts.expert_prefetch,
           path = opts.expert_store ~= "" and opts.expert_store or train.expert_store_path(opts.run_dir)}
end

-- --offload-optimizer: AdamW's states in a file of the run directory on the
-- cpu, in pinned host memory on cuda (moelua.optim's offload: 2 staging
-- slots of 2^18 elements of each state).
local offload = opts.offload_optimizer
  and {path = opts.device == "cpu" and train.optim_store_path(opts.run_dir) or nil} or nil

-- The model and its optimizer, built twice: once in the memory plan below
-- (address space only), then for real.
local function build()
  local model = nn.Transformer.new{
    vocab = opts.vocab, dim = opts.dim, layers = opts.layers, heads = opts.heads, kv_heads = opts.kv_heads,
    ffn = opts.ffn, experts = opts.experts, topk = opts.topk, seed = opts.seed,
    checkpoint = opts.checkpoint, max_position = math.max(opts.seq_len, 131072),
    moe = {save = opts.save}, device = opts.device, dtype = opts.dtype, zero = zero.new(zero_opts), store = store,
  }
  local groups = model:param_groups{weight_decay = 0.1, router_lr_mult = 1.0, offload = offload ~= nil}
  local o = {lr = opts.lr, beta1 = 0.9, beta2 = 0.95, weight_decay = 0.1, offload = offload}
  if not offload then return model, optim.AdamW(groups, o), groups end
  local ok, opt = pcall(optim.AdamW, groups, o)
  local why = not ok and tostring(opt):match("moelua%.optim%.AdamW: option 'offload': (.*)")
  if why then   -- the offload's store could not be made (tmpfs, a full disk): the option's error
    errors.user("--offload-optimizer: " .. why)
  elseif not ok then   -- a budget's refusal, or a bug: as it was raised
    error(opt, 0)
  end
  return model, opt, groups
end
local ds = data.open{glob = opts.data, seq_len = opts.seq_len, seed = opts.seed, holdout = 0.01}

local run = {
  build = build, data = ds, seq_len = opts.seq_len,
  steps = opts.steps, accum = opts.accum, clip = opts.clip > 0 and opts.clip or nil,
  lr = sched.warmup_cosine{peak = opts.lr, warmup = opts.warmup, total = math.max(opts.steps, opts.warmup + 1),
                           min = opts.lr / 10},
  hook = hook, state = {}, on_rollback = on_rollback, on_alarm = on_alarm,
  run_dir = opts.run_dir, ckpt_every = opts.ckpt_every, keep = opts.keep, resume = opts.resume,
  overwrite = opts.overwrite,
  init_from = opts.init_from,
  val_every = opts.ckpt_every, val_batches = 2, tty = moelua.fs.isatty(1),
  provenance = {recipe = arg[0], options = opts},
  reload = this_file and {file = this_file, names = {"hook", "on_rollback", "on_alarm"}},   -- edit them live
  rollback = {spike_sigma = 6, window = 20, max_skipped = 3, collapse_steps = 10, max_rollbacks = opts.max_rollbacks},
  alarms = {hot_steps = 5, dead_steps = 20},   -- hot and collapse thresholds: moelua.balance's defaults for E, k
}

-- Plan before allocating: a dry run of build() and one step against the
-- budget (moelua.train.plan), so a seq_len that cannot fit fails here.
local plan, why, need = train.plan(run)
if not plan then
  -- the budget's refusal as the ledger words it, without the Lua position of the op that met it
  io.stderr:write((tostring(why):gsub("(: the planned run failed %(nothing was allocated%): )[^\n]-%.lua:%d+: ", "%1")),
                  "\n")
  -- MiB with as many decimals as tell the two apart (at least the ledger's two)
  local peak, budget = need.total_peak / 2^20, mem.stats()[opts.device].budget_total / 2^20
  local digits = 2
  while digits < 4 and string.format("%." .. digits .. "f", peak) == string.format("%." .. digits .. "f", budget) do
    digits = digits + 1
  end
  errors.user(string.format("--seq-len %d needs up to %." .. digits .. "f MiB at its peak (memory plan), over the " ..
                            "budget of %." .. digits .. "f MiB (--budget-gib %g%s): lower --seq-len, raise " ..
                            "--budget-gib%s", opts.seq_len, peak, budget, opts.budget_gib,
                            opts.budget_gib == 0 and ", 0: 90% of the memory available at start" or "",
                            opts.checkpoint == "full" and "" or ", or recompute more (--checkpoint full)"))
end
say(string.format("memory plan (%s): peak %.2f MiB%s (params %.1f, grads %.1f, optim %.1f, " ..
                    "acts %.1f, pool %.1f MiB at the peak, in %s)", opts.device, plan.total_peak / 2^20,
                    plan.budget_total > 0 and string.format(" of a %s budget", mem.format_bytes(plan.budget_total))
                      or ", no budget",
                    plan.at_peak.params / 2^20, plan.at_peak.grads / 2^20, plan.at_peak.optim / 2^20,
                    plan.at_peak.acts / 2^20, plan.at_peak.pool / 2^20, plan.peak_phase))

local ex = plan.expert_exchange
if ex then
  say(string.format("expert exchange: each MoE layer's receive buffers planned for %d rows (%s; every token " ..
                    "of the group to this rank's experts: %d rows)", ex.bound,
                    ex.capacity and string.format("the capacity of this rank's experts: %d rows", ex.capacity)
                      or "dropless: the worst case", ex.worst))
end
options.need_device(opts.device, "; the plan above is what the run needs")
run.model, run.optimizer, run.groups = build()
run.plan = plan   -- the model's pool is taken at the planned size: the first step grows nothing
-- --attach: answer `moelua attach RUN_DIR` at the job's safe points.
-- With several ranks, rank 0 listens and its requests hold for all (moelua.train).
local attached = opts.attach and dist.rank() == 0
  and require("moelua.remote").listen(opts.run_dir, {steps = opts.steps, model = run.model}) or nil
run.attach = attached

say(string.format("moelua %s: %d layers, D=%d, %d experts (top-%d), seq_len %d, %d steps, corpus %s",
                  tostring(arg[0]):match("([^/]+)%.lua$") or "longctx",   -- tiny.lua runs this file too
                  opts.layers, opts.dim, opts.experts, opts.topk, opts.seq_len, opts.steps, opts.data))
local result = train.run(run)

if result.first_step == opts.steps then   -- resumed from the last step: nothing trained, what was loaded saved
  say(string.format("no step left to train: the checkpoint holds step %d, the last of --steps %d",
                    opts.steps - 1, opts.steps))
else
  say(string.format("loss %.4f -> %.4f over steps %d..%d (%d skipped, %d rollbacks)",
                      result.first_loss, result.final_loss, result.first_step, opts.steps - 1,
                      result.skipped, result.rollbacks))
end
if attached then attached:close() end
say(mem.report())
say("checkpoint: " .. tostring(result.checkpoint))
