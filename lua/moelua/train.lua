-- moelua.train: the training loop a recipe hands its pieces to. Every number
-- is computed in C by the model, the optimizer and the kernels; this module
-- orders the work of a step, watches for trouble, logs, and checkpoints.
--
--   local result = train.run{
--     model = model, data = ds, optimizer = opt, groups = groups, seq_len = S, steps = 200, accum = 1,
--     lr = sched.warmup_cosine{...}, clip = 1.0,
--     hook = function(step, state, ctl) ctl.temperature = ... end,  -- per step
--     state = {},                    -- the recipe's own state: saved in checkpoints
--     aux_weight = 0.01, z_weight = 0,   -- the losses' weights (a hook's ctl may change them per step)
--     run_dir = "runs/x", ckpt_every = 50, keep = 3,
--     rollback = {spike_sigma = 6, window = 50, max_skipped = 3, collapse_steps = 20, max_rollbacks = 5},
--     alarms = {hot = nil, collapse = nil, hot_steps = 5, dead_steps = 20},   -- balance alarms (below)
--     on_rollback = function(state, event) ... end,
--     on_alarm = function(state, alarm, model) ... end,
--     attach = moelua.remote.listen(run_dir),   -- optional: answer `moelua attach RUN_DIR` at the
--                                               -- step's start, after each block's forward and backward
--                                               -- (model.safe_point) and after each micro-batch
--     val_every = 50, val_batches = 4,
--     tty = true, log_every = 10,    -- progress: one line redrawn on a terminal, else every 10 steps
--     progress_after = 3,            -- a step running longer shows its layer (forward/backward)
--     init_from = "ckpt/dir",        -- start from a Mixtral-format checkpoint's weights (fine-tune)
--     resume = "runs/x/ckpt",        -- continue a run (its metrics.jsonl is appended to)
--     overwrite = false,             -- true: replace the run in run_dir (see Run directories)
--     plan = train.plan{...},        -- the model's stack pool taken at the planned size (below)
--     provenance = {recipe = arg[0], options = opts},   -- saved in checkpoints as it is
--     reload = {file = "recipes/x.lua", names = {"hook", "on_rollback", "on_alarm"}},   -- hooks edited live
--   }
--
-- An option not listed here, or of the wrong type, is refused by name
-- before anything runs (train.plan takes the same table, with build).
--
-- One step: the hook sets this step's router and loss settings (ctl) ->
-- `accum` micro-batches of forward + backward (gradients accumulate, then
-- are summed over ranks and scaled by 1/(accum * ranks)) -> global gradient
-- norm (clipped when `clip`) -> a non-finite loss or norm, or on one rank
-- a kernel's NaN error (Trainer:guarded), skips the step (counted) -> the
-- optimizer step, with each experts group's active mask
-- (lazy Adam) -> the router biases -> metrics.
--
-- Ranks (mpiexec; the model's moelua.zero places its units): every
-- decision a rank could take differently is taken from values all ranks
-- share (moelua.zero, README "Sharded training"): the data order is
-- global, the loss and the balance statistics are reduced over ranks, the
-- gradient norm is summed over ranks in rank order, Ctrl-C is held
-- through a step and agreed after it, and rank 0's attach requests hold
-- for all. Rank 0 alone writes metrics and the progress line. With several
-- ranks or a ZeRO stage, a checkpoint is written and read by ranges (each
-- rank its shards), in the files and under the names of one process; so
-- is one of an expert store or an offloaded optimizer (moelua.optim's
-- offload: its states by range through its staging, read_state /
-- write_state).
--
-- Rollbacks. A loss spike (a loss above its EMA by `spike_sigma` EMA
-- standard deviations after `window` steps), `max_skipped` skipped steps in
-- a row, or a router collapse alarm held `collapse_steps` steps in a row
-- goes back to the last good checkpoint and moves the data past the
-- offending batches: the skip is cumulative, so a second rollback to the
-- same checkpoint skips the batches of both (never the same bad batch
-- again). The recipe's state is NOT restored on a rollback: `on_rollback`
-- gets the live state, so a back-off it applies (state.lr_scale = 0.5 *
-- ...) compounds; the weights, optimizer, RNG, data cursor and spike EMA
-- are the checkpoint's. The rollback event in metrics.jsonl is written
-- when the replay starts, with the lr_scale and lr the hook then gives.
-- More than `max_rollbacks` rollbacks to one checkpoint stop the run: an
-- event {event = "stopped"} and a user error naming the last good
-- checkpoint, which stays on disk (keep-K never removes it). A checkpoint
-- is good once the step after it stands: that step asked for no rollback,
-- no layer was collapsed and it was not skipped (a spike shows in the loss
-- of the step after the update that caused it, so the checkpoint holding
-- that update is never good; the last step's checkpoint is judged by the
-- first step of a run resumed from it in the same run directory). `max_skipped`
-- skipped steps before any good checkpoint stop it too (nothing to go back
-- to). A run resumed from its own checkpoints takes ckpt/last_good back.
--
-- Balance alarms (moelua.balance: loads against the even share, per
-- layer): "hot" (an expert at >= alarms.hot times the even share for
-- hot_steps steps in a row), "collapse" (the k busiest experts together
-- at >= alarms.collapse times their even share, for hot_steps steps) and
-- "dead" (an expert with no tokens for dead_steps steps). The defaults
-- of hot and collapse depend on E and k (moelua.balance). An alarm fires
-- once when its condition has held long enough and again only after the
-- condition cleared: an event {event = "alarm", kind, step, layer, expert
-- (0-based, not for collapse), ratio, threshold, steps} in metrics.jsonl,
-- the list `alarms` in that step's metrics (what `moelua attach` shows as
-- stats.alarms), and a call on_alarm(state, alarm, model): the recipe may
-- reset a layer's balancing bias or reinitialise a dead expert from a
-- live one (model:reinit_expert(layer, dead, from, noise_std)).
--
-- Run directories. One job at a time: the first write claims
-- RUN_DIR/lock (flock, dropped when the process ends; under mpiexec rank
-- 0's, agreed by every rank), and a second job is refused while the first
-- lives. A run_dir that holds anything but an idle attach/ directory (or
-- the lock) is refused before anything is written, unless `resume` names
-- a checkpoint inside it (the run continues and metrics.jsonl is appended
-- to) or `overwrite` is true (the previous run's metrics.jsonl, ckpt/ and
-- plots/ are removed, each named on stdout; other files stay).
--
-- metrics.jsonl in run_dir: one JSON object per step (loss, ce, aux, z, lr,
-- every control the step ran with: temperature, noise, eps, aux_weight,
-- z_weight, lr_scale, capacity_factor (a "drop" policy's only), and
-- `overrides` when `moelua attach` set any; tokens/s, ledger peaks by category, per-layer expert loads,
-- active alarms, skipped steps, phase times) and events as their own lines.
-- With cfg.plan (train.plan's book), the run starts with the event
-- {event = "plan", step, planned_peak = {total, each category, ranks},
-- phase, budget}: what the run was admitted on, in the form of the steps'
-- ledger_peak, so a reader compares the two to the byte. On cuda a step
-- also logs device_untracked: the device memory in use outside the ledger
-- (cudaMemGetInfo's used less the allocator's reservations: the CUDA
-- context, cuBLAS, NCCL).
-- phases (seconds): data, fwd, bwd, optim (the step's wall time is their
-- sum, `step_seconds`), and inside fwd + bwd the model's profile: attention, router,
-- dispatch, experts, ce; `gflops` = {attention, experts, ce} (model FLOPs
-- per second of that phase).
--
-- init_from (when not resuming): the weights of a Mixtral-format checkpoint
-- (model.safetensors or a sharded index, F32/BF16/F16), every tensor's
-- name, shape and dtype checked against the model before anything changes
-- (model:load_named, which resume uses too); the optimizer starts fresh.
-- Ctrl-C or SIGTERM during a step's forward or backward (a kernel's
-- "interrupted" error) abandons the step, saves a checkpoint of the last
-- completed step and raises a user error naming it. Everything else in the
-- loop runs under moelua.host.hold_interrupts: the step's update, every
-- save and the bookkeeping between steps (alarms, a rollback's restore, the
-- metrics line). A signal there waits for that work to finish (then counts
-- as Ctrl-C after the step: an update always stands with its checkpoint),
-- and only a second one aborts it. Validation is interrupted like a step's
-- forward (the step before it is saved). With several ranks the whole step
-- is held, and the ranks agree on stopping after it. On one rank an error
-- raised before a step's update (its hook, its lr, a bad control, a bug
-- in the forward) saves the step before it too, logs {event = "stopped",
-- reason = "error", checkpoint} and names the checkpoint in the error.
--
-- reload = {file = F, names = {...}, arg = {...}}: the named hooks ("hook",
-- "on_rollback") are re-read from F while the job runs. At the start of
-- every step F is stat'ed (size, mtime); when they change, its content's
-- sha256 decides. New content is run as a chunk in a sandbox: its globals
-- are its own (reads fall through to _G), `arg` is a copy of the arguments
-- the run started with (reload.arg, default the global arg), `require`
-- gives the same modules, and the global MOELUA_RELOAD is true. The chunk
-- returns a table of its hooks instead of starting a training:
--
--   local function hook(step, state, ctl) ... end
--   if MOELUA_RELOAD then return {hook = hook, on_rollback = on_rollback} end
--   ... build the model, train.run{..., reload = {file = <this file>, names = {"hook", "on_rollback"}}}
--
-- so side effects (seeding, allocation) belong after that line. They
-- replace the current hooks for this step on; metrics.jsonl gets
-- {event = "reload", step, file, hash}. A syntax error (a half-written
-- file) is retried at the next step; it, an error while running the chunk,
-- a missing hook, or a reloaded hook that raises when called keeps (or
-- restores) the previous hooks, training goes on, and the error is written
-- to stderr and as {event = "reload_error", step, file, hash, phase =
-- "syntax" | "load" | "call", error} (once per content of the file).
local tensor = require "moelua.tensor"
local mem = require "moelua.mem"
local mio = require "moelua.io"
local bench = require "moelua.bench"
local fs = require "moelua.fs"
local measure = require "moelua.measure"
local ckpt = require "moelua.ckpt"
local balance = require "moelua.balance"
local errors = require "moelua.errors"
local options = require "moelua.options"
local attach_env = require "moelua.attach_env"
local zero = require "moelua.zero"
local dist = require "moelua.dist"
local host = require "moelua.host"
local json = require "dkjson"

local train = {}

-- The rollback and alarm settings (moelua.options.check's spec). A ratio
-- of 1 is the even share: an alarm there fires on every step (above E/k,
-- never: math.huge turns it off); a spike_sigma of 0 calls any loss above
-- the mean a spike (math.huge: no spike rollbacks).
local ROLLBACK = {spike_sigma = {"number", 6, above = 0, inf = true}, window = {"integer", 50, min = 1},
                  max_skipped = {"integer", 3, min = 1}, collapse_steps = {"integer", 20, min = 1},
                  max_rollbacks = {"integer", 5, min = 0}}
local ALARMS = {hot = {"number", false, above = 1, inf = true},   -- none given: balance's default
                collapse = {"number", false, above = 1, inf = true},
                hot_steps = {"integer", 5, min = 1}, dead_steps = {"integer", 20, min = 1}}

local function now(device) return bench.now(device) end

-- A book's peaks (mem.stats()'s format): total and each category's; with
-- more ranks, ranks = every rank's, rank 0 first (rank 0's log carries
-- them all).
local function book_peaks(z, book, what)
  local peaks = {total = book.total_peak}
  for k, v in pairs(book.peak) do peaks[k] = v end
  if z.world > 1 then
    local keys = {"total"}
    for k in pairs(book.peak) do keys[#keys + 1] = k end
    table.sort(keys)
    peaks.ranks = z:gather_numbers(peaks, keys, what)
    for _, one in ipairs(peaks.ranks) do
      for k, v in pairs(one) do one[k] = math.tointeger(v) end
    end
  end
  return peaks
end

-- Every rank's seconds in each kind of collective during the step (this
-- exchange's own wait counts in the next step's), rank 0 first.
local COLLECTIVES = {"all_gather", "reduce_scatter", "all_reduce", "all_to_all", "numbers"}
local function comm_seconds(z)
  return z:gather_numbers(z:take_waits(), COLLECTIVES, "collective seconds")
end

-- The means over ranks of a step's numbers (each rank's over its micro-batches).
local function mean_over_ranks(z, ...)
  if z.world == 1 then return ... end
  local v = z:all_reduce_numbers({...}, "sum", "losses")
  for i = 1, #v do v[i] = v[i] / z.world end
  return table.unpack(v)
end

-- Each MoE layer's load of the last micro-batch, over all ranks: counts
-- summed, max_share of the summed counts, entropy averaged, drops summed;
-- with several ranks also ranks = each rank's own counts (rank 0 first,
-- the tokens it routed, wherever their experts ran).
local function expert_loads(z, stats)
  local layers = stats.layers or {}
  if z.world == 1 then
    local loads = {}
    for i, l in ipairs(layers) do
      loads[i] = {counts = l.counts:totable(), max_share = l.max_share, entropy = l.entropy, dropped = l.dropped}
    end
    return loads
  end
  local mine = {}   -- per layer its counts, entropy and drops: every rank's in one collective
  for _, l in ipairs(layers) do
    for _, c in ipairs(l.counts:totable()) do mine[#mine + 1] = c end
    mine[#mine + 1], mine[#mine + 2] = l.entropy / z.world, l.dropped or 0
  end
  local keys = {}
  for j = 1, #mine do keys[j] = j end
  local ranks = #mine > 0 and z:gather_numbers(mine, keys, "expert loads") or {}
  local loads, at = {}, 0
  for i, l in ipairs(layers) do
    local E = l.counts:numel()
    local ld = {counts = {}, entropy = 0, dropped = 0, ranks = {}}
    for r, v in ipairs(ranks) do   -- sums in rank order
      local one = {}
      for e = 1, E do
        one[e] = math.tointeger(v[at + e])
        ld.counts[e] = (ld.counts[e] or 0) + one[e]
      end
      ld.ranks[r] = one
      ld.entropy, ld.dropped = ld.entropy + v[at + E + 1], ld.dropped + math.tointeger(v[at + E + 2])
    end
    local total, most = 0, 0
    for e = 1, E do total, most = total + ld.counts[e], math.max(most, ld.counts[e]) end
    ld.max_share = total > 0 and most / total or 0
    loads[i], at = ld, at + E + 2
  end
  return loads
end

-- The aux-loss-free router biases (moe.bias_rate > 0) after the step, from
-- the loads of every rank: bitwise the same bias on each.
local function update_router_biases(self, loads)
  for i, layer in ipairs(self.model:moe_layers()) do
    if layer.bias then
      local counts
      if self.model.zero.world > 1 then
        counts = tensor.tensor(loads[i].counts, {dtype = "i64"}):to(layer.bias:device())
      end
      layer:update_bias(counts)
    end
  end
end

-- Which optimizer group holds view t, and where (elements from the group's start).
local function locate(t, groups)
  for gi, g in ipairs(groups) do
    if t:same_storage(g.params) then
      local off = t:storage_offset() - g.params:storage_offset()
      if off >= 0 and off + t:numel() <= g.params:numel() then return gi, off end
    end
  end
end

-- AdamW's per-group states keyed by the parameters' Hugging Face names
-- (DESIGN.md: optim/*.safetensors keyed by the model's names): exp_avg and
-- exp_avg_sq as views of each parameter's slice, and for lazy-Adam groups
-- the step count of the parameter's expert as an i64 [1]. A lazy-Adam
-- group's states are per expert (moelua.optim): an expert that never
-- received tokens has none, so its w1/w2/w3 names are absent from
-- optim/exp_avg*.safetensors (its count, 0, is saved once the group has
-- counts). Loading reads an absent name of a sparse group as "no states",
-- so a resumed run holds exactly the states the saved one held (and, as a
-- zero state with count 0 is where lazy Adam starts, takes the same steps).
local function optim_by_name(self)
  local sd = self.optimizer:state_dict()
  local named, steps = {}, {}
  for _, p in ipairs(self.model:named_parameters()) do
    local gi, off = locate(p.tensor, self.groups)
    local gs, g = gi and sd.groups[gi], gi and self.groups[gi]
    local m, v, at = gs and gs.exp_avg, gs and gs.exp_avg_sq, off
    if m and g.experts then                       -- the expert's own states, or none
      local S = g.params:numel() // g.experts
      local e = off // S
      m, v, at = m[e + 1], v[e + 1], off - e * S
    end
    if m then
      named[p.name] = {exp_avg = m:view_at(at, p.tensor:shape()),
                       exp_avg_sq = v:view_at(at, p.tensor:shape())}
    end
    if gs and gs.steps then
      local e = off // (g.params:numel() // g.experts)
      steps[p.name] = gs.steps:narrow(1, e + 1, 1)
    end
  end
  local meta = {t = sd.t, skipped_expert_steps = sd.skipped_expert_steps, group_steps = {}}
  for gi, gs in ipairs(sd.groups) do meta.group_steps[gi] = gs.step end
  return named, next(steps) and steps or nil, meta
end

-- The expert of a named parameter (0-based), or nil.
local function expert_of(name)
  return tonumber(name:match("%.block_sparse_moe%.experts%.(%d+)%."))
end

-- The inverse: rebuild the per-group state_dict from a checkpoint's named
-- states (a sparse group's per expert: only the experts named get states),
-- read straight from the files into state tensors on the parameters'
-- device: the optimizer's own where it has them (a rollback), new ones
-- under "optim" that load_state_dict adopts otherwise, so no state is ever
-- held twice or staged through a host copy.
-- Every named state of checkpoint c fits its parameter: the shape, and a
-- step count beside a sparse group's states. Checked before load_optim
-- changes anything, since it reads into the optimizer's live states.
local function check_optim(self, c)
  local function shape(t) return "[" .. table.concat(t, ",") .. "]" end
  for _, p in ipairs(self.model:named_parameters()) do
    local o = c.optim and c.optim[p.name]
    if o then
      local want = p.shape or p.tensor:shape()   -- (an expert store's parameter has no tensor)
      for _, k in ipairs({"exp_avg", "exp_avg_sq"}) do
        if shape(o[k]:shape()) ~= shape(want) then
          errors.user(string.format("moelua.train: %s: optim %s of '%s' has shape %s, the parameter %s", c.dir,
                                    k, p.name, shape(o[k]:shape()), shape(want)))
        end
      end
      -- a lazy-Adam expert's states come with its count
      if self.model.sparse and expert_of(p.name) and not (c.optim_steps and c.optim_steps[p.name]) then
        errors.user(string.format("moelua.train: %s: '%s' has optimizer states but no step count in " ..
                                  "optim/steps.safetensors", c.dir, p.name))
      end
    end
  end
end

local function load_optim(self, c, meta)
  check_optim(self, c)
  local function receiver(gi, k, e)   -- the live state (made now), zeroed: what no name covers stays 0
    return self.optimizer:state_tensor(gi, k, e):zero_()
  end
  local sd = {kind = self.optimizer.kind, t = meta.t, skipped_expert_steps = meta.skipped_expert_steps,
              groups = {}}
  for gi, g in ipairs(self.groups) do   -- a sharded save keeps only t: every unfrozen dense group's count
    sd.groups[gi] = {step = meta.group_steps and meta.group_steps[gi] or (g.frozen and 0 or meta.t)}
    if g.experts then sd.groups[gi].exp_avg, sd.groups[gi].exp_avg_sq = {}, {} end
  end
  for _, p in ipairs(self.model:named_parameters()) do
    local gi, off = locate(p.tensor, self.groups)
    local g, gs = self.groups[gi], sd.groups[gi]
    local S = g.experts and g.params:numel() // g.experts
    local o = c.optim and c.optim[p.name]
    if o then
      for _, k in ipairs({"exp_avg", "exp_avg_sq"}) do
        local dst, at = gs, off
        if S then dst, at = gs[k], off - (off // S) * S end   -- expert off // S + 1's own
        local key = S and off // S + 1 or k
        dst[key] = dst[key] or receiver(gi, k, S and key)
        o[k]:read_into(dst[key]:view_at(at, p.tensor:shape()))
      end
    end
    local st = c.optim_steps and c.optim_steps[p.name]
    if st and g.experts then
      gs.steps = gs.steps or receiver(gi, "steps")
      st:read_into(gs.steps:narrow(1, off // S + 1, 1))
    end
  end
  self.optimizer:load_state_dict(sd, {adopt = true})
end

-- ---- checkpoints of sharded units (moelua.zero; several ranks or a ZeRO stage) ----
-- The same files as one process writes, under the same names: each rank
-- writes the ranges of its shards (moelua.zero pieces) and reads only
-- those back, so a checkpoint saved at any world size and stage resumes at
-- any other. Frozen parameters have no optimizer states.

-- The same path serves an expert store and an offloaded optimizer, whose
-- states are read and written by range through its staging, never whole.
local function sharded(self)
  local z = self.model.zero
  return z.world > 1 or z.stage >= 1 or z.expert_store ~= nil or self.optimizer.offload ~= nil
end

-- A stored piece's tensor of kind "params", "exp_avg" or "exp_avg_sq":
-- fn(view) with its expert's slab resident (dirty: fn wrote it).
local function with_stored(pc, kind, dirty, fn)
  local st = pc.stored
  st.es:with(st.layer, st.expert, dirty, function(v) fn(v[kind]:view_at(st.at, pc.shape)) end)
end

-- Which experts hold lazy-Adam states on any rank: {[unit] = {[e] = true}}
-- for the experts units of a sparse model (the others are nil), e the
-- model's expert id (with expert parallelism a unit holds experts
-- [first, first + E/ep)). Every rank takes part (one collective), whatever
-- it holds.
local function experts_with_states(self, sd)
  local z, out, flags = self.model.zero, {}, {}
  if not self.model.sparse then return out end
  local E = self.model.opts.experts
  local units = {}
  for _, u in ipairs(z.units) do
    if u.kind == "experts" then units[#units + 1] = u end
  end
  for i = 1, #units * E do flags[i] = 0 end
  local row = {}
  for i, u in ipairs(units) do row[u] = (i - 1) * E end
  local first = self.model.first_expert
  for gi, at in ipairs(z.group_at) do
    local gs = sd.groups[gi]
    if row[at.unit] and type(gs.exp_avg) == "table" then
      for e, t in pairs(gs.exp_avg) do
        if t then flags[row[at.unit] + first + (at.expert or e - 1) + 1] = 1 end
      end
    end
  end
  for _, u in ipairs(units) do   -- an expert store's: the experts with a step count
    for e = 0, u.stored and E - 1 or -1 do
      if u.stored.steps[u.stored:slab(u.layer, e)] then flags[row[u] + e + 1] = 1 end
    end
  end
  if z.world > 1 then flags = z:all_reduce_numbers(flags, "max", "experts with optimizer states") end
  for i, u in ipairs(units) do
    out[u] = {}
    for e = 0, E - 1 do out[u][e] = flags[(i - 1) * E + e + 1] > 0 or nil end
  end
  return out
end

local function sharded_state(self)
  local z, model = self.model.zero, self.model
  local named = model:named_parameters()
  local sd = self.optimizer:state_dict()
  local active = experts_with_states(self, sd)
  local entries, stated, counted = {}, {}, {}
  for _, p in ipairs(model:parameter_entries()) do   -- every rank's: one header on all ranks
    entries[#entries + 1] = {name = p.name, dtype = zero.grad_dtype(model.opts.dtype), shape = p.shape}   -- (masters)
    local e, experts = expert_of(p.name), active[p.unit]
    if not p.frozen then
      if not experts or experts[e] then stated[#stated + 1] = entries[#entries] end
      -- a sparse unit's step counts, once any of its experts has states (0: none yet)
      if experts and next(experts) then counted[#counted + 1] = {name = p.name, dtype = "i64", shape = {1}} end
    end
  end
  local has_states = sd.t > 0 and #stated > 0   -- AdamW: every unfrozen dense group has states after a step
  local files = {["model.safetensors"] = entries}
  if has_states then
    files["optim/exp_avg.safetensors"], files["optim/exp_avg_sq.safetensors"] = stated, stated
  end
  if #counted > 0 then files["optim/steps.safetensors"] = counted end
  local function write_piece(w, pc)
    w.model:write_range(pc.name, pc.at, z:param_view(pc))
    if has_states and not pc.frozen then
      local gi, e, off = z:state_slot(pc)
      local gs = sd.groups[gi]
      for _, k in ipairs{"exp_avg", "exp_avg_sq"} do
        if e and gs[k][e] or not e and gs[k] then   -- the state exists: its range, part by part
          self.optimizer:read_state(gi, k, e, off, pc.n, function(v, at) w[k]:write_range(pc.name, pc.at + at, v) end)
        end
      end
      -- an expert's count, by the rank that holds the tensor's first element
      if e and w.steps and gs.steps and pc.at == 0 then w.steps:write_range(pc.name, 0, gs.steps:narrow(1, e, 1)) end
    end
  end
  local function write_stored(w, pc)   -- an expert store's parameter (moelua.expert_store), states, count
    local st = pc.stored
    with_stored(pc, "params", false, function(t) w.model:write_range(pc.name, 0, t) end)
    local count = st.es.steps[st.es:slab(st.layer, st.expert)]
    if has_states and not pc.frozen and (not model.sparse or count) then
      for _, k in ipairs{"exp_avg", "exp_avg_sq"} do
        with_stored(pc, k, false, function(t) w[k]:write_range(pc.name, 0, t) end)
      end
      if count and w.steps then w.steps:write_range(pc.name, 0, tensor.tensor({count}, {dtype = "i64"})) end
    end
  end
  local function write(dir)
    local w = {model = mio.open_writer(dir .. "/model.safetensors")}
    for _, k in ipairs{"exp_avg", "exp_avg_sq", "steps"} do
      if files["optim/" .. k .. ".safetensors"] then w[k] = mio.open_writer(dir .. "/optim/" .. k .. ".safetensors") end
    end
    for _, pc in ipairs(z:pieces(named)) do
      if pc.stored then write_stored(w, pc) else write_piece(w, pc) end
    end
    for _, f in pairs(w) do f:sync(); f:close() end
  end
  local function barrier(what) if z.world > 1 then z.dist.barrier(what) end end
  return {rank = z.rank, files = files, write = write, barrier = barrier},
         {t = sd.t, skipped_expert_steps = sd.skipped_expert_steps}
end

local function load_sharded(self, c, meta)
  local z, model, opt = self.model.zero, self.model, self.optimizer
  local named = model:check_named(c.model, {config = c.config, source = c.dir})
  check_optim(self, c)
  local sd = {kind = opt.kind, t = meta.t, skipped_expert_steps = meta.skipped_expert_steps, groups = {}}
  -- offloaded states: all zero first (what no name covers stays 0), then
  -- each named range written through the optimizer's staging (write_state)
  local offloaded = opt.offload ~= nil
  if offloaded then opt:zero_states() end
  for gi, g in ipairs(self.groups) do
    local gs = {step = (g.frozen or not c.optim) and 0 or meta.t}
    if g.experts then
      gs.exp_avg, gs.exp_avg_sq = {}, {}   -- the experts the checkpoint names, below
    elseif gs.step > 0 and offloaded then
      gs.exp_avg, gs.exp_avg_sq = true, true
    elseif gs.step > 0 then   -- the live states (made now), zeroed: what no name covers stays 0
      for _, k in ipairs{"exp_avg", "exp_avg_sq"} do gs[k] = opt:state_tensor(gi, k):zero_() end
    end
    sd.groups[gi] = gs
  end
  local function read_stored(pc)   -- an expert store's parameter, its states and count (absent: zero)
    local st, o = pc.stored, c.optim and not pc.frozen and c.optim[pc.name]
    st.es:edit_params(st.layer, st.expert, function(v)
      c.model[pc.name]:read_range(0, v.params:view_at(st.at, pc.shape))
      for _, k in ipairs{"exp_avg", "exp_avg_sq"} do
        local t = v[k]:view_at(st.at, pc.shape)
        if o then o[k]:read_range(0, t) else t:zero_() end
      end
    end)
    local count, slab = o and c.optim_steps and c.optim_steps[pc.name], st.es:slab(st.layer, st.expert)
    st.es.steps[slab] = nil
    if count then
      local n <close> = tensor.zeros({1}, {dtype = "i64"})
      count:read_into(n)
      st.es.steps[slab] = n:item() > 0 and n:item() or nil
    end
  end
  local function read_piece(pc)
    c.model[pc.name]:read_range(pc.at, z:param_view(pc))
    local o = c.optim and c.optim[pc.name]
    if pc.frozen then return end
    local gi, e, off = z:state_slot(pc)
    local gs = sd.groups[gi]
    for _, k in ipairs(o and {"exp_avg", "exp_avg_sq"} or {}) do
      local st = gs[k]
      if offloaded then
        if e then st[e] = true end
        opt:write_state(gi, k, e, off, pc.n, function(v, at) o[k]:read_range(pc.at + at, v) end)
      else
        if e then
          st[e] = st[e] or opt:state_tensor(gi, k, e):zero_()
          st = st[e]
        end
        o[k]:read_range(pc.at, st:view_at(off, {pc.n}))
      end
    end
    local count = e and c.optim_steps and c.optim_steps[pc.name]
    if count then
      gs.steps = gs.steps or opt:state_tensor(gi, "steps"):zero_()
      count:read_into(gs.steps:narrow(1, e, 1))
    end
  end
  for _, pc in ipairs(z:pieces(named)) do
    if pc.stored then read_stored(pc) else read_piece(pc) end
  end
  z:gather_params(true)
  opt:load_state_dict(sd, {adopt = true})
end

-- The trainer's state in checkpoints: everything a resumed run needs to
-- take the same next step.
local function trainer_state(self, step, optim_meta)
  return {
    step = step, data_offset = self.data_offset, skipped = self.skipped,
    -- micro-batches per step, all ranks': the stride of the data's windows
    -- (a resume that took no step keeps the one it loaded)
    micro_batches = self.resumed_micro_batches or self.accum * self.model.zero.world,
    rng = tensor.rng_state(), data = self.data:state(), recipe_state = self.state,
    ema = self.ema, threads = tensor.threads(), machine = self.machine, optim = optim_meta,
    provenance = self.provenance, rollbacks_to = self.rollbacks_to, skip_to = self.skip_to,
    alarm_runs = self.alarm_runs,
  }
end

local Trainer = {}
Trainer.__index = Trainer

function Trainer:log(obj)
  if not self.metrics then return end
  self.metrics:write(json.encode(obj), "\n")
  self.metrics:flush()
end

-- Save step's checkpoint (good: true, false or nil, as ckpt.save takes it); returns its
-- directory and the number of interrupts that arrived during the save
-- (held until it was written).
function Trainer:save(step, tag, good)
  if not self.run_dir then return nil, 0 end
  local t0 = now()
  local state
  if sharded(self) then
    local sh, meta = sharded_state(self)
    state = {sharded = sh, config = self.model:config(), trainer = trainer_state(self, step, meta)}
  else
    local named, steps, meta = optim_by_name(self)
    state = {model = self.model:named_parameters(), config = self.model:config(),
             optim = next(named) and named or nil, optim_steps = steps, trainer = trainer_state(self, step, meta)}
  end
  local held, dir = host.hold_interrupts(ckpt.save, self.run_dir .. "/ckpt", step, state,
                                         {keep = self.keep, good = good})
  self:log({event = "checkpoint", step = step, dir = dir, reason = tag, seconds = now() - t0})
  return dir, held
end

-- The model's weights from checkpoint c (ckpt.load's table), all checked first.
local function load_weights(model, c)
  model:load_named(c.model, {config = c.config, source = c.dir})
end

-- train.init_from(model, dir): load a Mixtral-format checkpoint's weights
-- into model (what train.run's init_from does); returns the checkpoint dir
-- and whether it has a config.json (checked against the model).
function train.init_from(model, dir)
  local c = ckpt.load(dir)
  load_weights(model, c)
  return c.dir, c.config ~= nil
end

-- trainer.json is read like every checkpoint file, as untrusted: each
-- field the restore uses is checked before anything is loaded (a sum in
-- MANIFEST.sha256 proves the file whole, not sound).
local function check_trainer(self, c)
  local tr, where = c.trainer, c.dir .. "/trainer.json"
  local function bad(field, want, v)
    errors.user(string.format("moelua.train: %s: %s must be %s, got %s", where, field, want,
                              type(v) == "string" and string.format("%q", v) or tostring(v)))
  end
  local function int(field, v, min, optional)
    if v == nil and optional then return end
    if math.type(v) ~= "integer" or v < min then
      bad(field, min == math.mininteger and "an integer" or "an integer >= " .. min, v)
    end
  end
  local function tbl(field, v, optional)
    if not (v == nil and optional) and type(v) ~= "table" then bad(field, "an object", v) end
  end
  tbl("the file", tr)
  int("step", tr.step, 0)
  int("data_offset", tr.data_offset, 0, true)
  int("skipped", tr.skipped, 0, true)
  int("micro_batches", tr.micro_batches, 1, true)
  int("threads", tr.threads, 1, true)
  local function finite(field, v, min)
    if not (type(v) == "number" and v >= min and math.abs(v) < math.huge) then
      bad(field, min == -math.huge and "a finite number" or "a finite number >= " .. min, v)
    end
  end
  tbl("ema", tr.ema, true)   -- the loss's running mean and variance (spike rollbacks)
  if tr.ema then
    finite("ema.mean", tr.ema.mean, -math.huge)
    finite("ema.var", tr.ema.var, 0)
    int("ema.n", tr.ema.n, 1)
  end
  if tr.machine ~= nil and type(tr.machine) ~= "string" then bad("machine", "a string", tr.machine) end
  tbl("rng", tr.rng)
  int("rng.seed", tr.rng.seed, math.mininteger)
  int("rng.offset", tr.rng.offset, math.mininteger)
  tbl("data", tr.data)
  for _, k in ipairs({"recipe_state", "rollbacks_to", "skip_to", "alarm_runs"}) do tbl(k, tr[k], true) end
  for dir, n in pairs(tr.rollbacks_to or {}) do int("rollbacks_to[" .. tostring(dir) .. "]", n, 1) end
  for dir, n in pairs(tr.skip_to or {}) do int("skip_to[" .. tostring(dir) .. "]", n, 0) end
  local o = tr.optim
  tbl("optim", o)
  int("optim.t", o.t, 0)
  int("optim.skipped_expert_steps", o.skipped_expert_steps, 0, true)
  tbl("optim.group_steps", o.group_steps, true)
  if o.group_steps and next(o.group_steps) ~= nil then   -- (an empty list: a sharded save's, t alone)
    if #o.group_steps ~= #self.groups then
      bad("optim.group_steps", string.format("a list of %d step counts, one per group", #self.groups),
          string.format("%d", #o.group_steps))
    end
    for gi = 1, #self.groups do int(string.format("optim.group_steps[%d]", gi), o.group_steps[gi], 0) end
  end
end

-- Load checkpoint dir into the trainer; returns its step. A rollback
-- keeps the recipe's live state (its back-off compounds) and moves the
-- data past every batch skipped since that checkpoint (cumulative).
function Trainer:restore(dir, rollback)
  local c = ckpt.load(dir)
  if not c.trainer then
    errors.user("moelua.train: " .. c.dir .. " has no trainer.json: not a moelua training checkpoint " ..
                "(use init_from / --init-from to start from its weights)")
  end
  check_trainer(self, c)
  local tr = c.trainer
  if sharded(self) then
    load_sharded(self, c, tr.optim)
  else
    load_weights(self.model, c)
    load_optim(self, c, tr.optim)
  end
  tensor.rng_state(tr.rng)
  self.data:set_state(tr.data)
  self.data_offset, self.skipped, self.ema = tr.data_offset or 0, tr.skipped or 0, tr.ema
  self.alarm_runs = tr.alarm_runs or {}   -- how long each balance condition had held then
  if rollback then
    self.data_offset = self.data_offset + (self.skip_to[c.dir] or 0)
  else
    for k in pairs(self.state) do self.state[k] = nil end
    for k, v in pairs(tr.recipe_state or {}) do self.state[k] = v end
    self.rollbacks_to, self.skip_to = tr.rollbacks_to or {}, tr.skip_to or {}
    self.resumed_micro_batches = tr.micro_batches
  end
  if tr.threads ~= tensor.threads() then
    self:message(string.format("moelua.train: warning: checkpoint was written with %d thread%s, running %d: " ..
                               "results will not be bit-identical", tr.threads, tr.threads == 1 and "" or "s",
                               tensor.threads()), io.stderr)
  end
  if tr.machine and tr.machine ~= self.machine then
    self:message("moelua.train: warning: checkpoint was written on another machine (" .. tr.machine .. ")",
                 io.stderr)
  end
  return tr.step, c.dir
end

-- Live-reloadable hooks (reload = {...}; see the header).
local RELOADABLE = {hook = true, on_rollback = true, on_alarm = true}

-- A copy of a plain-data value (the recipe's arguments, its state).
local function deep_copy(v)
  if type(v) ~= "table" then return v end
  local c = {}
  for k, x in pairs(v) do c[k] = deep_copy(x) end
  return c
end

local function read_file(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local s = f:read("a")
  f:close()
  return s
end

local RELOAD_KEYS = {file = true, names = true, arg = true}

-- Checked by new_trainer, so train.plan refuses what train.run would.
local function setup_reload(self, r)
  if type(r) ~= "table" or type(r.file) ~= "string" or r.file == "" then
    error("moelua.train.run: reload needs {file = PATH, names = {...}}", 4)
  end
  for k in pairs(r) do
    if not RELOAD_KEYS[k] then error("moelua.train.run: reload: " .. options.unknown(k, RELOAD_KEYS), 4) end
  end
  local names = r.names or {"hook"}
  if type(names) ~= "table" or #names == 0 then
    error("moelua.train.run: reload.names must be a list of hook names, e.g. {\"hook\", \"on_rollback\"}", 4)
  end
  for i, n in pairs(names) do
    if math.type(i) ~= "integer" or not RELOADABLE[n] then
      error("moelua.train.run: reload.names: '" .. tostring(n) .. "' is not a reloadable hook " ..
            "(hook, on_rollback, on_alarm)", 4)
    end
  end
  if r.arg ~= nil and type(r.arg) ~= "table" then
    error("moelua.train.run: reload.arg must be a table (the recipe's arg), got " .. type(r.arg), 4)
  end
  local st = fs.stat(r.file)
  local content = st and read_file(r.file)
  if not content then error("moelua.train.run: reload.file '" .. r.file .. "' cannot be read", 4) end
  local reloadable = {}
  for _, n in ipairs(names) do reloadable[n] = true end
  self.reload = {file = r.file, names = names, reloadable = reloadable,
                 arg = deep_copy(r.arg or rawget(_G, "arg") or {}), size = st.size, mtime = st.mtime,
                 hash = fs.sha256_string(content), failed = nil, previous = nil}
end

function Trainer:reload_error(step, hash, phase, msg)
  local rl = self.reload
  rl.failed = hash
  io.stderr:write(string.format("moelua.train: reload of %s at step %d failed (%s): %s; keeping the previous hooks\n",
                                rl.file, step, phase, msg))
  self:log({event = "reload_error", step = step, file = rl.file, hash = hash, phase = phase, error = msg})
end

-- Has the recipe file changed? Then load its hooks (before this step's hook runs).
function Trainer:check_reload(step)
  local rl = self.reload
  local st = fs.stat(rl.file)
  if not st or (st.size == rl.size and st.mtime == rl.mtime) then return end
  local content = read_file(rl.file)
  if not content then return end                        -- being replaced: next step
  local hash = fs.sha256_string(content)
  if hash == rl.hash then rl.size, rl.mtime = st.size, st.mtime return end
  if hash == rl.failed then return end                  -- reported already; wait for another edit
  local env = setmetatable({MOELUA_RELOAD = true, arg = deep_copy(rl.arg)}, {__index = _G})
  local chunk, err = load(content, "@" .. rl.file, "t", env)
  if not chunk then return self:reload_error(step, hash, "syntax", tostring(err)) end
  local ok, hooks = pcall(chunk)
  if not ok and host.is_interrupt(hooks) then error(hooks, 0) end   -- Ctrl-C, not the edit's fault
  if ok and type(hooks) ~= "table" then
    ok, hooks = false, "the file returned " .. type(hooks) .. ", not its hooks (return them when MOELUA_RELOAD is set)"
  end
  if ok then
    for _, n in ipairs(rl.names) do
      if type(hooks[n]) ~= "function" then
        ok, hooks = false, "the returned table has no function '" .. n .. "'"
        break
      end
    end
  end
  if not ok then return self:reload_error(step, hash, "load", tostring(hooks)) end
  local previous = {}
  for _, n in ipairs(rl.names) do previous[n], self[n] = self[n], hooks[n] end
  rl.previous, rl.size, rl.mtime, rl.hash, rl.failed = previous, st.size, st.mtime, hash, nil
  self:log({event = "reload", step = step, file = rl.file, hash = hash})
end

-- Call hook `name`. A reloaded hook that raises is reported and every
-- reloaded hook goes back to its version from before the reload; returns
-- false then, and the caller calls the restored one.
function Trainer:call_hook(step, name, ...)
  local f = self[name]
  if not f then return end
  local rl = self.reload
  if not (rl and rl.previous and rl.reloadable[name]) then f(...) return end   -- what f returns means nothing
  local ok, err = pcall(f, ...)
  if ok then return end
  local msg = tostring(err)
  if msg:find("interrupted") then error(err, 0) end
  self:reload_failed(step, name, msg)
  return false
end

-- A reloaded hook failed while it ran: every reloaded hook goes back to
-- its version from before the reload, reported as a "call" reload_error.
function Trainer:reload_failed(step, name, msg)
  local rl = self.reload
  for n, g in pairs(rl.previous) do self[n] = g end
  rl.previous = nil
  self:reload_error(step, rl.hash, "call", name .. ": " .. msg)
end

-- The collector runs only where the trainer says: a full collection at
-- each step's and validation's start, and at each micro-batch's and
-- validation batch's, returns the last one's garbage tensors to the
-- ledger; between, the collector is stopped (until the closer returned is
-- closed, by return or error), and a tensor allocation does not step it
-- (host/bindings/l_util.c). A tensor left to the collector then lives
-- to the same point in every process, whatever its Lua heap holds (a
-- corpus's file list, a plan's books), so the ledger's peaks repeat from
-- step to step and a plan of the same code in another process (train.plan,
-- `moelua plan`) predicts them to the byte. Incremental collections ran
-- when the heap's growth said so: two processes differed.
local function hold_collector()
  local was = collectgarbage("isrunning")
  collectgarbage()
  collectgarbage("stop")
  return setmetatable({}, {__close = function() if was then collectgarbage("restart") end end})
end

function Trainer:validate()
  local gc <close> = hold_collector()
  local n = math.min(self.val_batches, self.data:n_validation())
  if n == 0 then return nil end
  local sum = 0
  for i = 1, n do
    if i > 1 then collectgarbage() end   -- the last batch's garbage (hold_collector)
    local ok, loss = self:guarded(self.model.forward, self.model, self.data:validation(i), 0)
    self.model:release()   -- its window too, before the next step's collection
    if not ok then return 0 / 0 end   -- a kernel met a NaN: the validation loss is NaN
    sum = sum + loss
  end
  return sum / n
end

-- The controls a step runs with, before the hook sets them (all logged).
local CONTROLS = {"temperature", "noise", "eps", "aux_weight", "z_weight", "lr_scale", "capacity_factor"}

-- What an attached REPL set (overrides of the controls), at a step's
-- start. With several ranks, only rank 0 listens (moelua.remote): its
-- requests hold for every rank.
local function attach_overrides(self)
  local srv, z = self.attach, self.model.zero
  local ov = srv and srv.overrides or {}
  if z.world == 1 then return ov end
  local v = {}
  for i, k in ipairs(CONTROLS) do v[2 * i - 1], v[2 * i] = ov[k] ~= nil and 1 or 0, ov[k] or 0 end
  v = z:all_reduce_numbers(v, "sum", "attach overrides")   -- the others send zeros
  local out = {}
  for i, k in ipairs(CONTROLS) do
    if v[2 * i - 1] > 0 then out[k] = v[2 * i] end
  end
  return out
end

-- Did an attached REPL ask for a checkpoint (after a step)?
local function attach_wants_checkpoint(self)
  local srv, z = self.attach, self.model.zero
  local want = srv and srv.want_checkpoint and 1 or 0
  if srv then srv.want_checkpoint = false end
  if z.world > 1 then want = z:all_reduce_numbers({want}, "max", "attach checkpoint request")[1] end
  return want > 0
end

local function fresh_ctl(self)
  return {temperature = 1.0, noise = 0.0, eps = 0.0, aux_weight = self.aux_weight,
          z_weight = self.z_weight, capacity_factor = nil, lr_scale = 1.0}
end

-- nil when every control the hook set is one (attach_env.SETTABLE) and in
-- its range, else the first wrong one's message (by name). A dropless
-- model's capacity_factor is 0 (moelua.moe's default), a "drop" one's > 0.
local function ctl_error(ctl, policy)
  local keys = {}
  for k in pairs(ctl) do keys[#keys + 1] = k end
  table.sort(keys, function(a, b) return tostring(a) < tostring(b) end)
  for _, k in ipairs(keys) do
    local v = ctl[k]
    if k == "capacity_factor" and policy ~= "drop" then
      if v ~= 0 then return "capacity_factor must be 0 (no capacity) for a model with moe policy \"" ..
                            tostring(policy) .. "\", got " .. tostring(v) end
    else
      local why = attach_env.check(k, v)
      if why then return why end
    end
  end
end

-- The step's controls: the hook's, checked. A reloaded hook that raises or
-- sets a wrong control gives way to the hooks from before the reload
-- (whose controls are taken afresh); the recipe's own hook setting one is
-- a user error, before the step computes anything.
function Trainer:step_controls(step)
  local mo = self.model.opts and self.model.opts.moe_opts
  local policy = mo and mo.policy or "dropless"
  local function hooked()
    local ctl = fresh_ctl(self)
    local failed = self:call_hook(step, "hook", step, self.state, ctl) == false
    for k, v in pairs(fresh_ctl(self)) do if ctl[k] == nil then ctl[k] = v end end   -- a nil: the default
    return ctl, failed
  end
  local ctl, failed = hooked()
  local bad = not failed and ctl_error(ctl, policy)
  if bad and self.reload and self.reload.previous and self.reload.reloadable.hook then
    self:reload_failed(step, "hook", bad)
    failed = true
  end
  if failed then
    ctl = hooked()
    bad = ctl_error(ctl, policy)
  end
  if bad then errors.user(string.format("moelua.train: step %d: the hook's ctl: %s", step, bad)) end
  return ctl
end

-- Before a message or a recipe callback that may print: the progress
-- line is cleared, so nothing is glued to it (redraw() shows it again).
-- keep: end it with a newline instead (the run ends; its last line stays).
function Trainer:end_line(keep)
  if self.line_open and not self.silent then
    io.stdout:write(keep and "\n" or "\r\27[K")
    io.stdout:flush()
    self.line_open = false
  end
end

-- The progress line (a terminal's) as last drawn, on a line of its own.
function Trainer:draw(line)
  if self.silent then return end
  self.shown = line
  io.stdout:write("\r", line, "\27[K")
  io.stdout:flush()
  self.line_open = true
end

function Trainer:redraw()
  if self.tty and self.shown and not self.line_open then self:draw(self.shown) end
end

-- A line of text on its own line (out: default stdout).
function Trainer:message(text, out)
  if self.silent then return end
  self:end_line()
  out = out or io.stdout
  out:write(text, "\n")
  out:flush()
end

-- Where a long step is: after each block's forward and backward (the
-- model's safe point), once the step has run `progress_after` s: the
-- progress line on a terminal, else a line at most every IN_STEP_EVERY s.
local IN_STEP_EVERY = 30
function Trainer:in_step(step, phase, layer)
  if self.silent then return end
  local t = now()
  local started = self.step_started
  if t - started < self.progress_after then return end
  if not self.tty and t - (self.in_step_said or 0) < IN_STEP_EVERY then return end
  self.in_step_said = t
  local line = string.format("step %d/%d  %s, layer %d of %d  (%.0f s into the step)", step, self.steps - 1,
                             phase, layer, self.model.opts.layers, t - started)
  if self.tty then
    self:draw(line)
  else
    io.stdout:write(line, "\n")
    io.stdout:flush()
  end
end

-- Is e a kernel's NaN error ("<fn>: NaN in ...": the router's logits, the
-- LM head's)?
local function kernel_nan(e)
  return type(e) == "string" and e:find(": NaN in ", 1, true) ~= nil
end

-- A step's error, caught and raised again after the bookkeeping (train.run,
-- Trainer:guarded): a bug's keeps the traceback of where it was raised
-- (the host prints a message that holds one as it is); user errors,
-- interrupts and a kernel's NaN stay as they are.
local function with_traceback(e)
  if type(e) ~= "string" or e:find("interrupted") or kernel_nan(e) or
     e:find("\nstack traceback:\n", 1, true) then
    return e
  end
  return debug.traceback(e, 2)
end

-- true and fn(...)'s results; or, on one rank, false and the message
-- (without its Lua position) when fn met a kernel's NaN error: the caller
-- ends the micro-batches like a NaN loss, and the step is skipped and
-- counted. With several ranks it raises: one rank cannot skip alone while
-- the others wait for it in a collective; so it does at ZeRO stage 3,
-- whose units an error leaves gathered.
function Trainer:guarded(fn, ...)
  local z = self.model.zero
  if z.world > 1 or z.stage == 3 then return true, fn(...) end
  local r = table.pack(xpcall(fn, with_traceback, ...))
  if r[1] then return table.unpack(r, 1, r.n) end
  if not kernel_nan(r[2]) then error(r[2], 0) end
  return false, (r[2]:gsub("^[^\n]-:%d+: ", ""))
end

-- A step up to its update (Trainer:step): the controls, then the forward
-- and backward of every micro-batch. Nothing but the gradients has changed
-- when it ends, so on one rank a Ctrl-C may cut it short. Returns what the
-- update needs.
local function forward_backward(self, step)
  self.step_started, self.in_step_said = now(), nil
  if self.reload then self:check_reload(step) end
  local srv = self.attach
  if srv then srv:poll(step) end                -- attached clients: at the step's start (set{} takes effect here)
  self:end_line()
  local ctl = self:step_controls(step)
  local unsaved = self.run_dir and ckpt.json_error(self.state, "state")
  if unsaved then   -- now, not at the next checkpoint: the steps between would be lost
    errors.user(string.format("moelua.train: step %d: the recipe's state cannot be saved in a checkpoint (%s)",
                              step, (unsaved:gsub("^moelua%.ckpt%.save: ", ""))))
  end
  self:redraw()                                 -- below whatever the hook printed
  local set = attach_overrides(self)
  local overrides = next(set) and {} or nil
  if overrides then                             -- values set from an attached REPL win over the hook's
    for k, v in pairs(set) do ctl[k], overrides[k] = v, v end
  end
  local base = self.lr(step)
  if math.type(base) == nil or not (base >= 0 and base < math.huge) then
    errors.user(string.format("moelua.train: step %d: the lr schedule returned %s, not a finite number >= 0", step,
                              math.type(base) and tostring(base) or type(base)))
  end
  local lr = base * ctl.lr_scale
  if self.pending_rollback then                 -- logged now: with the lr scale the replay runs at
    local ev = self.pending_rollback
    ev.lr_scale, ev.lr = ctl.lr_scale, lr
    self:log(ev)
    self.pending_rollback = nil                 -- (after the line: a Ctrl-C between the two logs it twice, not never)
  end
  self.model:set_router{temperature = ctl.temperature, noise = ctl.noise, eps = ctl.eps,
                        capacity_factor = ctl.capacity_factor}
  local t = {data = 0, fwd = 0, bwd = 0, optim = 0}
  self.model:zero_grad()
  local loss, ce, aux, zl, last, nonfinite = 0, 0, 0, 0, nil, nil
  local on_layer = srv and srv.on_layer
  self.model.safe_point = function(phase, layer)   -- between layers (set{} staged for the next step)
    self:in_step(step, phase, layer)
    if on_layer then on_layer(phase, layer) end
  end
  local dev = self.model.opts and self.model.opts.device   -- a phase ends when its device work does
  local z = self.model.zero
  if z.world > 1 then z.dist.set_context("step " .. step) end   -- in every collective's error
  local per_step = self.accum * z.world   -- micro-batches of all ranks
  for micro = 1, self.accum do
    if micro > 1 then collectgarbage() end   -- the last micro-batch's garbage (hold_collector)
    if srv then srv:position(micro, self.accum) end
    local t0 = now(dev)
    -- one global data order: rank r's micro-batches follow rank r-1's, so
    -- N ranks x A micro-batches see the batches of 1 rank x N A
    local at = z.rank * self.accum + micro - 1
    local tokens = self.data:batch((step + self.data_offset) * per_step + at)
    local t1 = now(dev)
    -- the gate noise is keyed by (seed, step, layer, token): give each
    -- micro-batch its own key, or they would all draw the same noise
    local ok, l, st = self:guarded(self.model.forward, self.model, tokens, step * per_step + at)
    local t2 = now(dev)
    if not ok then nonfinite = l; break end
    z:begin_backward(micro == self.accum, 1 / per_step)
    local bok, nan = self:guarded(self.model.backward, self.model,
                                  {aux_weight = ctl.aux_weight, z_weight = ctl.z_weight})
    if not bok then nonfinite = nan; break end
    local t3 = now(dev)
    t.data, t.fwd, t.bwd = t.data + t1 - t0, t.fwd + t2 - t1, t.bwd + t3 - t2
    ce, aux, zl = ce + st.ce / self.accum, aux + st.aux / self.accum, zl + st.z / self.accum
    loss = loss + (l + ctl.aux_weight * st.aux + ctl.z_weight * st.z) / self.accum
    last = st
    if srv then srv:safe_point("micro-batch") end
  end
  self.model.safe_point = nil
  if nonfinite then   -- a kernel met a NaN: the step is skipped as for a NaN loss
    loss = 0 / 0
    self.model:release()
  end
  return {ctl = ctl, lr = lr, overrides = overrides, t = t, loss = loss, ce = ce, aux = aux, zl = zl,
          last = last, nonfinite = nonfinite, dev = dev, per_step = per_step}
end

-- One training step: forward_backward, then the update (or the skip) and
-- the step's metrics. On one rank a Ctrl-C may stop the first part only
-- (host.interruptible: train.run holds the rest), so an update never stands
-- without the bookkeeping that records it.
function Trainer:step(step)
  local gc <close> = hold_collector()
  local z = self.model.zero
  local ok, s
  if z.world > 1 then
    ok, s = true, forward_backward(self, step)
  else   -- traceback taken where a bug is raised, not where interruptible raises it again
    ok, s = host.interruptible(xpcall, forward_backward, with_traceback, self, step)
  end
  if not ok then
    self.failed_before_update = true   -- the weights and optimizer are still the last step's (train.run saves them)
    error(s, 0)
  end
  local ctl, lr, t, dev, per_step = s.ctl, s.lr, s.t, s.dev, s.per_step
  local loss, ce, aux, zl, last = s.loss, s.ce, s.aux, s.zl, s.last
  local t4 = now(dev)
  -- the model's phase timers, read before a skipped step's zero_grad resets them
  local prof = self.model.profile_summary and self.model:profile_summary()
  mem.phase("optimizer")
  z:reduce_grads(1 / per_step)
  local norm = z:clip_grad_norm(self.optimizer.groups, self.clip or math.huge)
  loss, ce, aux, zl = mean_over_ranks(z, loss, ce, aux, zl)
  local loads = expert_loads(z, last or {})
  local max_share = 0
  for _, l in ipairs(loads) do max_share = math.max(max_share, l.max_share) end
  local m = {step = step, loss = loss, ce = ce, aux = aux, z = zl, lr = lr, grad_norm = norm,
             loads = loads, max_share = max_share, overrides = s.overrides, nonfinite = s.nonfinite}
  for _, k in ipairs(CONTROLS) do m[k] = ctl[k] end
  if loss ~= loss or norm ~= norm or math.abs(loss) == math.huge or norm == math.huge then
    self.skipped, self.skipped_run = self.skipped + 1, self.skipped_run + 1
    m.skipped = true
    self.model:zero_grad()
  else
    self.skipped_run = 0
    self.optimizer:step(lr, self.model:active_masks(self.groups))
    z:after_step(self.optimizer, lr, z.expert_store and self.model.sparse and self.model:layer_masks())
    update_router_biases(self, loads)
  end
  t.optim = now(dev) - t4
  if prof then
    for k, v in pairs(prof.seconds) do t[k] = v end
    m.gflops = prof.gflops
  end
  m.phases, m.skipped_total = t, self.skipped
  local seconds = t.data + t.fwd + t.bwd + t.optim
  m.step_seconds = seconds
  m.tokens_per_s = self.tokens_per_step / seconds
  -- this rank's measured ledger peaks on the model's device (every rank's
  -- with more ranks): the book its plan is of; on cuda also the device
  -- memory outside the ledger (this rank's)
  local book = mem.stats()[dev or "cpu"]
  m.ledger_peak = book_peaks(z, book, "ledger peaks")
  if dev == "cuda" then m.device_untracked = book.untracked end
  if z.expert_store then m.expert_store = z.expert_store:stats() end   -- counters since the start
  if self.optimizer.offload then m.optim_store = self.optimizer:offload_stats() end
  if z.world > 1 then m.comm_seconds = comm_seconds(z) end
  if z.ep > 1 then   -- bytes each rank sent to the others in expert parallelism's exchanges
    m.all_to_all_bytes = {}
    for r, v in ipairs(z:gather_numbers({bytes = z:take_sent()}, {"bytes"}, "all-to-all bytes")) do
      m.all_to_all_bytes[r] = math.tointeger(v.bytes)
    end
  end
  return m
end

-- Is this step's loss a spike against the running mean and variance?
function Trainer:spike(loss)
  local e = self.ema
  if not e then
    self.ema = {mean = loss, var = 0, n = 1}
    return false
  end
  local r = self.rollback
  local spike = e.n >= r.window and loss > e.mean + r.spike_sigma * math.sqrt(e.var)
  if not spike then
    local a = 2 / (r.window + 1)
    local d = loss - e.mean
    e.mean = e.mean + a * d
    e.var = (1 - a) * (e.var + a * d * d)
    e.n = e.n + 1
  end
  return spike
end

-- A condition held for `need` steps in a row: runs[key] counts them; true
-- exactly once per episode, at the step it reaches need.
local function held(runs, key, on, need)
  runs[key] = on and (runs[key] or 0) + 1 or nil
  return on and runs[key] == need
end

-- The balance alarms of step m (see the header): fills m.alarms with the
-- conditions active now, returns the alarms that fire at this step,
-- whether a collapse has held collapse_steps steps (a rollback), and
-- whether any layer is collapsed now (its checkpoint is then not good).
function Trainer:check_balance(m)
  local a, k, fired, collapsed, collapsing = self.alarms, self.model.opts.topk, {}, false, false
  local runs = self.alarm_runs
  m.alarms = {}
  for l, load in ipairs(m.loads) do
    local b = balance.layer(load.counts, k, a)   -- a.hot, a.collapse: nil takes balance's default
    -- one condition of this layer: counted, listed while on, fired once per episode; returns its run
    local function note(kind, expert, ratio, threshold, on, need)
      local key = kind .. ":" .. l .. ":" .. (expert or "")
      local fire = held(runs, key, on, need)
      if on then
        m.alarms[#m.alarms + 1] = {kind = kind, layer = l, expert = expert, ratio = ratio, steps = runs[key]}
      end
      if fire then   -- busiest: the layer's busiest expert, a source to reinitialise a dead one from
        fired[#fired + 1] = {event = "alarm", kind = kind, step = m.step, layer = l, expert = expert,
                             ratio = ratio, threshold = threshold, steps = need, busiest = b.busiest}
      end
      return runs[key] or 0
    end
    local hot, dead = {}, {}
    for _, e in ipairs(b.hot) do hot[e] = true end
    for _, e in ipairs(b.dead) do dead[e] = true end
    for e, r in ipairs(b.ratios) do
      note("hot", e - 1, r, b.thresholds.hot, hot[e - 1], a.hot_steps)
      note("dead", e - 1, r, 0, dead[e - 1], a.dead_steps)
    end
    local run = note("collapse", nil, b.topk_ratio, b.thresholds.collapse, b.collapsed, a.hot_steps)
    collapsed = collapsed or run >= self.rollback.collapse_steps
    collapsing = collapsing or b.collapsed
  end
  return fired, collapsed, collapsing
end

function Trainer:progress(m, step, last_step, t_start)
  if self.silent then return end
  local elapsed = now() - t_start
  local done = step - self.first_step + 1
  local eta = elapsed / done * (last_step - step)
  local peak = string.format("%.1f MiB", m.ledger_peak.total / 2^20)
  if m.ledger_peak.ranks then   -- every rank's, rank 0 first
    local each = {}
    for r, v in ipairs(m.ledger_peak.ranks) do each[r] = string.format("%.1f", v.total / 2^20) end
    peak = "per rank " .. table.concat(each, "/") .. " MiB"
  end
  local line = string.format("step %d/%d  loss %.4f%s  aux %.3f  lr %.2e  %.0f tok/s  eta %.0fs  peak %s%s",
                             step, last_step, m.loss, self.val_loss and string.format("  val %.4f", self.val_loss) or "",
                             m.aux, m.lr, m.tokens_per_s, eta, peak, m.skipped and "  (skipped)" or "")
  if self.tty then
    self:draw(line)
  elseif (step + 1) % self.log_every == 0 or step == last_step then
    io.stdout:write(line, "\n")
    io.stdout:flush()
  end
end

-- cfg[name] with the defaults of `spec` (ROLLBACK, ALARMS), checked.
local function settings(cfg, name, spec)
  local given = cfg[name]   -- (a table: check_options)
  -- raised at train.run's caller: past this closure, options.check, settings, new_trainer and train.run
  local function fail(fmt, ...) error("moelua.train.run: " .. fmt:format(...), 6) end
  local out = options.check(given, spec, fail, name .. ".")
  return out
end

-- train.run's and train.plan's options and what each must be
-- (moelua.options.check's spec; none has a default here: new_trainer
-- gives them): a misspelt or mistyped one is refused by name before
-- anything runs (a misspelt ckpt_every saved nothing; a number for a hook
-- failed at its first call).
local function opt(kind, min) return {kind, false, min = min} end
local RUN_OPTIONS = {
  model = opt"table", data = opt"table", optimizer = opt"table", groups = opt"table", build = opt"function",
  seq_len = opt("integer", 1), steps = opt("integer", 1), accum = opt("integer", 1), lr = opt"function",
  clip = opt"number", hook = opt"function", state = opt"table", run_dir = opt"string",
  ckpt_every = opt("integer", 0), keep = opt("integer", 1), rollback = opt"table", alarms = opt"table",
  on_rollback = opt"function", on_alarm = opt"function", attach = opt"table", val_every = opt("integer", 0),
  val_batches = opt("integer", 1), tty = opt"boolean", log_every = opt("number", 1),
  progress_after = opt("number", 0), init_from = opt"string", resume = opt"string", overwrite = opt"boolean",
  plan = opt"table", reload = opt"table", provenance = opt"table", aux_weight = opt("number", 0),
  z_weight = opt("number", 0),
}

local ATTACH_METHODS = {"poll", "position", "safe_point", "finish"}

-- cfg checked: a copy, whole floats as integers and a false option (`x
-- and {...}`) left out.
local function check_options(cfg, fn)
  local name = "moelua.train." .. fn
  if cfg == nil then error(name .. ": options must be a table, got nil", 3) end
  -- raised at the caller of train.run / train.plan: past this closure, options.check and this function
  local c = options.check(cfg, RUN_OPTIONS, function(fmt, ...) error(name .. ": " .. fmt:format(...), 5) end)
  if c.attach then   -- moelua.remote.listen's server, or one that answers as it does
    for _, method in ipairs(ATTACH_METHODS) do
      if type(c.attach[method]) ~= "function" then
        error(string.format("%s: attach must be what moelua.remote.listen(run_dir) returns (this one has no %s)",
                            name, method), 3)
      end
    end
  end
  -- train.plan's build makes model, optimizer and groups
  for _, k in ipairs(fn == "run" and {"model", "data", "optimizer", "groups"} or {"data", "build"}) do
    if c[k] == nil then
      error(string.format("%s: %s is required%s", name, k, k == "groups" and " (the optimizer's param groups)" or
                          k == "build" and " (a function returning model, optimizer, groups)" or ""), 3)
    end
  end
  if c.clip and not (c.clip > 0) then   -- a norm clipped to 0 zeroes every update
    error(string.format("%s: clip must be > 0 (leave it out for no clipping), got %s", name, tostring(c.clip)), 3)
  end
  return c
end

-- A trainer from run's cfg, touching no file (train.run's and train.plan's).
local function new_trainer(cfg)
  local self = setmetatable({
    model = cfg.model, data = cfg.data, optimizer = cfg.optimizer, groups = cfg.groups,   -- (check_options)
    attach = cfg.attach,
    provenance = cfg.provenance,
    steps = cfg.steps or 100, accum = cfg.accum or 1, clip = cfg.clip,
    lr = cfg.lr or function() return 1e-3 end, hook = cfg.hook, state = cfg.state or {},
    run_dir = cfg.run_dir, keep = cfg.keep or 3, ckpt_every = cfg.ckpt_every or 0,
    aux_weight = cfg.aux_weight or 0.01, z_weight = cfg.z_weight or 0.0,
    val_every = cfg.val_every or 0, val_batches = cfg.val_batches or 4, log_every = cfg.log_every or 10,
    on_rollback = cfg.on_rollback, on_alarm = cfg.on_alarm, data_offset = 0, skipped = 0, skipped_run = 0,
    rollbacks_to = {}, skip_to = {}, alarm_runs = {},
    machine = measure.cpu().model, tty = cfg.tty, progress_after = cfg.progress_after or 3,
  }, Trainer)
  local unsaved = cfg.run_dir and cfg.provenance and ckpt.json_error(cfg.provenance, "provenance")
  if unsaved then   -- now, not at the first checkpoint: the steps before it would be lost
    error("moelua.train.run: provenance cannot be saved in a checkpoint (" ..
          unsaved:gsub("^moelua%.ckpt%.save: ", "") .. ")", 3)
  end
  if self.run_dir and self.optimizer.kind ~= "AdamW" then
    error("moelua.train.run: checkpoints carry AdamW states; use AdamW or no run_dir", 3)
  end
  if cfg.reload then setup_reload(self, cfg.reload) end
  self.rollback = settings(cfg, "rollback", ROLLBACK)
  self.alarms = settings(cfg, "alarms", ALARMS)
  local z = self.model.zero
  if not z then error("moelua.train.run: the model has no units placement (model.zero; nn.Transformer has one)", 3) end
  self.silent = z.rank > 0   -- metrics, messages and the progress line come from rank 0
  self.tokens_per_step = cfg.seq_len * self.accum * z.world
  -- a plan's high-water mark for the model's stack pool: taken at once, so
  -- the first step does not grow it (growth overshoots: blocks double)
  if cfg.plan and cfg.plan.pool_bytes and self.model.pool then self.model.pool:reserve(cfg.plan.pool_bytes) end
  return self
end

-- plan, why, book = train.plan(cfg): the memory a run of cfg needs, before
-- anything is allocated. cfg is train.run's, with build (a function
-- returning model, optimizer, groups) in place of those three. A dry run
-- (moelua.mem.plan: the same code, kernels skipped, sizes and lifetimes
-- exact, lazy optimizer states taken as all present) builds them and takes
-- two training steps (the optimizer states appear in the first, and the
-- second is the peak of every later step) and, when cfg.val_every > 0, a
-- validation. It runs twice:
-- the first learns the high-water mark of the model's stack pool
-- (plan.pool_bytes), the second takes it at once, as train.run{plan =
-- plan} does, so that no step grows the pool and the plan is exactly what
-- every step of the run charges the ledger.
-- Returns the planned account book of the model's device (model.opts.device;
-- mem.stats().cpu's fields: peak, at_peak, total_peak, budget_total, ...; a
-- CUDA run plans on any machine) and pool_bytes; with expert parallelism
-- also expert_exchange, the rows an MoE layer's receive buffers are planned
-- for on this rank (moelua.moe's recv_rows: {worst, capacity, bound}), and
-- per_step: what the second planned step does, {micro_batches, seq_len,
-- forward_flop, recompute_flop (model:flops of each micro-batch), experts =
-- and optim = {read, written, hits, misses, prefetches}: the expert store's and the
-- offloaded optimizer's traffic, a plan's counters being a run's (every
-- expert routed: a plan's routing is the worst case)}. When an
-- allocation would cross a budget: nil, the budget error (with the planned
-- ledger), and the book of the same plan with the budgets lifted (its
-- total_peak is what the run needs at most: under a budget the allocator
-- collects garbage before it refuses). Any other failure raises. Under
-- `moelua plan RECIPE` (train.plan_only, moelua.plan_cli) a plan that fits
-- is printed and the program ends. The recipe's state table, the data cursor, the host's RNG and the budgets are
-- left as they were; the hooks run inside the plans (four steps), so what
-- they do outside their state table (upvalues, files) happens then too.
function train.plan(cfg)
  cfg = check_options(cfg, "plan")
  -- a run that would be refused is refused before it is planned; `moelua plan` runs nothing
  if not train.plan_only then train.check_run_dir(cfg) end
  local pool_bytes, device, exchange, nparams, per_step = nil, "cpu", nil, nil, nil
  -- batch() moves a moelua.data's cursor (its state() would also read the corpus for its fingerprint)
  local cursor = cfg.data.cursor
  local function restore_cursor() if cursor ~= nil then cfg.data.cursor = cursor end end
  -- the stores' counters (moelua.store's stats): the expert store's, the offloaded optimizer's
  local function store_counters(c)
    local es = c.model.zero and c.model.zero.expert_store
    return {experts = es and es:stats(), optim = c.optimizer.offload and c.optimizer:offload_stats()}
  end
  local function step(plan)
    local c = {}
    for k, v in pairs(cfg) do c[k] = v end
    c.model, c.optimizer, c.groups = cfg.build()
    if not (c.model and c.optimizer and c.groups) then
      error("moelua.train.plan: build returned no " .. (not c.model and "model" or not c.optimizer and "optimizer"
            or "groups") .. " (it returns model, optimizer, groups)", 0)
    end
    device = c.model.opts and c.model.opts.device or "cpu"
    c.state, c.attach, c.plan = deep_copy(cfg.state or {}), nil, plan
    local t = new_trainer(c)
    t:step(0)
    local before = store_counters(c)
    t:step(1)
    -- per step (the second: the first has cold caches): store traffic and matmul FLOPs
    per_step = {micro_batches = t.accum, seq_len = cfg.seq_len}
    for k, now_ in pairs(store_counters(c)) do
      local b = before[k]
      per_step[k] = {read = now_.bytes_read - b.bytes_read, written = now_.bytes_written - b.bytes_written,
                     hits = now_.hits - b.hits, misses = now_.misses - b.misses,
                     prefetches = now_.prefetches - b.prefetches}
    end
    if c.model.flops and cfg.seq_len then
      local f = c.model:flops(cfg.seq_len)
      per_step.forward_flop, per_step.recompute_flop = t.accum * f.forward, t.accum * f.recompute
    end
    if t.val_every > 0 then t:validate() end
    pool_bytes = c.model.pool and c.model.pool:stats().high_water
    local layers = c.model.moe_layers and c.model:moe_layers() or {}
    exchange = layers[1] and layers[1].recv_rows
    if c.model.parameter_entries then   -- the whole model's (every rank's)
      nparams = 0
      for _, p in ipairs(c.model:parameter_entries()) do
        local n = 1
        for _, s in ipairs(p.shape) do n = n * s end
        nparams = nparams + n
      end
    end
  end
  local user_error   -- a user error of the build (a bad option) is raised as such, not as a failed plan
  local function guarded(plan)
    local ok, err = pcall(step, plan)
    if not ok then
      if errors.is_user(err) then user_error = err end
      error(err, 0)
    end
  end
  -- fn(...) with every budget of every book lifted (as they were after)
  local function unbudgeted(fn, ...)
    local old = {}
    for _, d in ipairs{"cpu", "cuda", "pinned", "file"} do
      local lift = {total = 0, device = d}
      for k in pairs(mem.stats()[d].budget) do lift[k] = 0 end
      old[#old + 1] = mem.budget(lift)
    end
    local r = table.pack(pcall(fn, ...))
    for _, b in ipairs(old) do
      b.force = true   -- the budgets as they were: not a new request to check against the machine now
      mem.budget(b)
    end
    if not r[1] then error(r[2], 0) end
    return table.unpack(r, 2, r.n)
  end
  -- The first plan only learns the pool's high-water mark: its pool grows
  -- block after block, which the run's (reserved at that mark) never does,
  -- so no budget applies to it; the second is the run's.
  local function plan_twice()
    local books, why, failed = unbudgeted(mem.plan, guarded)
    if books then books, why, failed = mem.plan(guarded, {pool_bytes = pool_bytes}) end
    if user_error then error(user_error, 0) end
    return books, why, failed
  end
  local ok, books, why, failed = pcall(plan_twice)
  restore_cursor()
  if not ok then error(books, 0) end
  if books then
    books[device].pool_bytes, books[device].expert_exchange, books[device].parameters = pool_bytes, exchange, nparams
    books[device].per_step = per_step
    -- `moelua plan RECIPE`: the book is the answer, the run is not made
    if train.plan_only then require("moelua.plan_cli").finish(train.plan_only, device, books[device], books) end
    return books[device]
  end
  for d, book in pairs(failed) do   -- a refusal while building: the book that refused
    if book.refused > 0 then device = d end
  end
  if failed[device].refused == 0 then error(why, 0) end
  -- What the run needs: the same plan with the budgets lifted.
  local need, why2
  ok, need, why2 = pcall(unbudgeted, mem.plan, guarded, {pool_bytes = pool_bytes})
  restore_cursor()
  if not ok then error(need, 0) end
  if not need then error(why2, 0) end
  need[device].pool_bytes, need[device].expert_exchange, need[device].parameters = pool_bytes, exchange, nparams
  need[device].per_step = per_step
  -- `moelua plan RECIPE`: the book of what it needs, then the recipe's refusal
  if train.plan_only then require("moelua.plan_cli").over_budget(train.plan_only, device, need[device], need) end
  -- the refusal and its ledger, not the stack a step's guard took on the way
  return nil, (tostring(why):gsub("\n*stack traceback:\n.*$", "")), need[device]
end

-- ---- run directories ---------------------------------------------------------

-- What a run writes in its run_dir; --overwrite removes these and nothing else.
local RUN_FILES = {"metrics.jsonl", "ckpt", "plots"}
-- The backing files of an expert store (train.expert_store_path) and of
-- an offloaded optimizer (train.optim_store_path) while the job runs.
local STORE_FILE, OPTIM_STORE_FILE, LOCK_FILE = "experts.store", "optim.store", "lock"

local function normal_path(p)
  p = p:gsub("/+", "/"):gsub("/%./", "/"):gsub("^%./", ""):gsub("/%.?$", "")
  return p
end

-- Is checkpoint path `resume` (a ckpt root or a step directory) inside run_dir?
local function inside(run_dir, resume)
  local root = normal_path(run_dir) .. "/ckpt"
  local r = normal_path(resume)
  return r == root or r:sub(1, #root + 1) == root .. "/"
end

-- The names in run_dir that make it "not empty": an attach/ directory with
-- no live socket is left by a job and holds no run.
local function run_contents(run_dir)
  local st = fs.stat(run_dir)
  if not st then return {} end
  if st.type ~= "dir" then errors.user("moelua.train: run directory '" .. run_dir .. "' is not a directory") end
  local names = {}
  for _, n in ipairs(fs.listdir(run_dir)) do
    if n ~= "attach" and n ~= STORE_FILE and n ~= OPTIM_STORE_FILE and n ~= LOCK_FILE then names[#names + 1] = n end
  end
  return names
end

-- One job per run directory: the first write into run_dir claims
-- RUN_DIR/lock (moelua.fs.lock), held until train.run returns or raises
-- (or the process ends). Returns nil, or the message refusing the
-- directory because another job holds it.
local claimed = {}
local function claim_run_dir(run_dir)
  local key = normal_path(run_dir)
  if claimed[key] then return nil end
  local ok, lock, pid = pcall(fs.lock, run_dir .. "/" .. LOCK_FILE)
  if not ok then   -- the disk, not moelua: full, read-only
    return "moelua.train: run directory '" .. run_dir .. "' cannot be claimed: " .. tostring(lock)
  end
  if lock == false then   -- a file system without flock (Lustre without -o flock): run, unguarded
    io.stderr:write("moelua.train: warning: ", run_dir, "/", LOCK_FILE, " cannot be locked here (", pid,
                    "): nothing stops a second job on this run directory\n")
    claimed[key] = true
    return nil
  end
  if not lock then
    return string.format("moelua.train: run directory '%s' is in use by another job (process %s holds %s/%s): " ..
                         "two jobs would write one metrics.jsonl and prune each other's checkpoints. Wait for " ..
                         "it to end or stop it, or choose another --run-dir; nothing was written",
                         run_dir, pid > 0 and tostring(pid) or "?", run_dir, LOCK_FILE)
  end
  claimed[key] = lock
end

local function release_run_dir(run_dir)
  local key = normal_path(run_dir)
  if claimed[key] and claimed[key] ~= true then claimed[key]:release() end
  claimed[key] = nil
end

-- train.expert_store_path(run_dir): where a run's expert store
-- (moelua.expert_store) keeps its backing file by default, with the run
-- directory made. A file found there was left by a job that was killed:
-- a store removes its file when it closes, and a run resumes from its
-- checkpoints, never from the store; it is removed, saying so.
local function store_path(run_dir, file, what)
  local path = run_dir .. "/" .. file
  if train.plan_only then return path end   -- `moelua plan`: nothing is written
  if dist.rank() > 0 then return path end   -- rank 0 claims the directory, as train.run does
  local ok, err = pcall(fs.mkdir_p, run_dir)
  if not ok then errors.user("moelua.train: the run directory cannot be created: " .. tostring(err)) end
  local refused = claim_run_dir(run_dir)
  if refused then errors.user(refused) end
  if fs.stat(path) then
    os.remove(path)
    io.stdout:write("moelua.train: removed ", path, ", the ", what, " of a job that did not end\n")
  end
  return path
end

function train.expert_store_path(run_dir) return store_path(run_dir, STORE_FILE, "expert store") end

-- train.optim_store_path(run_dir): the same for an offloaded optimizer's
-- store (moelua.optim's offload option): RUN_DIR/optim.store.
function train.optim_store_path(run_dir) return store_path(run_dir, OPTIM_STORE_FILE, "optimizer store") end

-- train.check_run_dir(cfg): the run directory may be written (see the
-- header's Run directories); raises a user error before anything is
-- written, else returns "new", "resume" (append to its metrics) or
-- "overwrite". train.plan and train.run call it.
function train.check_run_dir(cfg)
  if type(cfg.resume) == "string" and cfg.resume ~= "" and not fs.stat(cfg.resume) then   -- said before the plan
    errors.user(string.format("moelua.train: --resume %s: no such checkpoint (it does not exist); nothing was " ..
                              "written", cfg.resume))
  end
  local dir = cfg.run_dir
  if not dir then return "new" end
  if type(dir) ~= "string" then error("moelua.train.run: run_dir must be a path", 3) end
  if dir == "" then errors.user("moelua.train: the run directory is an empty path (--run-dir '')") end
  local names = run_contents(dir)
  local resuming = cfg.resume and cfg.resume ~= ""
  if #names == 0 then return resuming and "resume" or "new" end
  if cfg.overwrite and resuming and inside(dir, cfg.resume) then
    errors.user(string.format("moelua.train: --overwrite would remove the checkpoint --resume %s continues from " ..
                              "(and the run's metrics.jsonl): give one of them; nothing was written", cfg.resume))
  end
  if cfg.overwrite then return "overwrite" end
  if resuming and inside(dir, cfg.resume) then return "resume" end
  local what = table.concat(names, ", ")
  local a_run = false
  for _, n in ipairs(names) do
    for _, f in ipairs(RUN_FILES) do a_run = a_run or n == f end
  end
  if not a_run then   -- the user's own files: no run to continue or replace
    errors.user(string.format("moelua.train: run directory '%s' holds other files (%s), not a run; nothing was " ..
                              "written. Choose a new or empty --run-dir (--overwrite would write metrics.jsonl, " ..
                              "ckpt and plots beside them)", dir, what))
  end
  if resuming then
    errors.user(string.format("moelua.train: run directory '%s' already holds a run (%s), and --resume %s is " ..
                              "not one of its checkpoints: resuming there would append to it and prune its " ..
                              "checkpoints. Choose another --run-dir, or --overwrite to replace it; nothing " ..
                              "was written", dir, what, cfg.resume))
  end
  local ok, latest = pcall(ckpt.latest, dir .. "/ckpt")
  local continue = ok and latest and string.format("Continue it with --resume %s/ckpt, replace", dir)
                   or "It holds no checkpoint to continue from: replace"
  errors.user(string.format("moelua.train: run directory '%s' already holds a run (%s); nothing was written. " ..
                            "%s it with --overwrite (removes %s only), or choose another --run-dir", dir, what,
                            continue, table.concat(RUN_FILES, ", ")))
end

-- --overwrite: remove what an earlier run wrote there, saying what.
local function clear_run_dir(dir)
  for _, n in ipairs(RUN_FILES) do
    local p = dir .. "/" .. n
    if fs.stat(p) then
      fs.remove_tree(p)
      io.stdout:write("moelua.train: --overwrite: removed ", p, "\n")
    end
  end
end

function train.run(cfg)
  cfg = check_options(cfg, "run")
  local mode = train.check_run_dir(cfg)
  local self = new_trainer(cfg)
  local z = self.model.zero
  -- every rank has checked the run directory before rank 0 changes it
  if z.world > 1 then z.dist.barrier("run directory check") end
  local resuming = cfg.resume and cfg.resume ~= ""
  local init_dir   -- loaded (and checked) before the run directory is touched
  if cfg.init_from and cfg.init_from ~= "" and not resuming then
    local configured
    init_dir, configured = train.init_from(self.model, cfg.init_from)
    if not configured then
      self:message("moelua.train: warning: " .. init_dir .. " has no config.json: its weights' names, shapes " ..
                   "and dtypes were checked, not the math they were trained with (rope_theta, rms_norm_eps, ...)",
                   io.stderr)
    end
  end
  local first = 0
  local resumed_from
  if resuming then   -- loaded before the run directory is touched: a bad checkpoint writes nothing
    local back
    back, resumed_from = self:restore(cfg.resume)
    first = back + 1
    -- a resume that takes no step saves what it loaded (at another world
    -- size: a resharded checkpoint); one past the last step would save it
    -- under an earlier step than it holds
    if first > self.steps then
      errors.user(string.format("moelua.train: %s holds step %d, past the last step of steps = %d (step %d): " ..
                                "steps (a recipe's --steps) must be at least %d", resumed_from, back, self.steps,
                                self.steps - 1, first))
    end
    -- a step reads the windows (step + offset) * micro-batches + i: another
    -- count would read trained windows again and change the batch
    local was, now_ = self.resumed_micro_batches, self.accum * z.world
    if first < self.steps and was and was ~= now_ then
      errors.user(string.format("moelua.train: %s was trained with %d micro-batches per step (ranks x accum), " ..
                                "this run takes %d (%d rank%s x accum %d): the batch would change and the data " ..
                                "would be read again from an earlier window; keep ranks x accum at %d%s",
                                resumed_from, was, now_, z.world, z.world == 1 and "" or "s", self.accum, was,
                                was % z.world == 0 and string.format(" (here: --accum %d)", was // z.world) or
                                string.format(" (a number of ranks that divides %d)", was)))
    end
  end
  local refused   -- rank 0 claims the run directory for every rank
  if self.run_dir and not self.silent then
    local ok, err = pcall(fs.mkdir_p, self.run_dir)
    if ok then
      refused = claim_run_dir(self.run_dir)
    else
      refused = "moelua.train: the run directory cannot be created: " .. tostring(err)
    end
  end
  if z.world > 1 and z:all_reduce_numbers({refused and 1 or 0}, "max", "run directory lock")[1] > 0 then
    refused = refused or string.format("moelua.train: run directory '%s' cannot be used: rank 0 says why",
                                       self.run_dir)
  end
  if refused then errors.user(refused) end
  local _ <close> = self.run_dir and setmetatable({}, {__close = function() release_run_dir(self.run_dir) end})
  if self.run_dir and not self.silent then
    if mode == "overwrite" then clear_run_dir(self.run_dir) end
    local f, why = io.open(self.run_dir .. "/metrics.jsonl", mode == "resume" and "a" or "w")
    if not f then errors.user("moelua.train: cannot write the run's metrics: " .. why) end
    self.metrics = f
  end
  if init_dir then self:log({event = "init_from", from = init_dir}) end
  if resuming then self:log({event = "resume", step = first, from = resumed_from}) end
  if cfg.plan then   -- what the run was admitted on, beside what its steps measure (ledger_peak)
    self:log({event = "plan", step = first, planned_peak = book_peaks(z, cfg.plan, "planned peaks"),
              phase = cfg.plan.peak_phase, budget = cfg.plan.budget_total})
  end
  self.first_step = first
  -- last_good: the checkpoint a rollback goes back to; candidate: the
  -- newest checkpoint, judged by the step after it (a spike shows in the
  -- loss of the step after the update that caused it, so a checkpoint is
  -- good only once that step stands)
  local last_good, last_good_step, candidate = nil, nil, nil
  -- a resume from the run's own checkpoints: its last good one, at or before the resumed step
  if resuming and self.run_dir and inside(self.run_dir, resumed_from) then
    local ok, dir = pcall(ckpt.last_good, self.run_dir .. "/ckpt")
    local at = ok and dir and tonumber(dir:match("step%-(%d+)$"))
    if at and at < first then last_good, last_good_step = dir, at end
    if first - 1 ~= last_good_step then   -- spelt as the run's saves spell it (rollbacks key on it)
      candidate = {dir = string.format("%s/ckpt/step-%06d", self.run_dir, first - 1), step = first - 1}
    end
  end
  local t_start, last_step = now(), self.steps - 1
  local step = first
  local result = {skipped = 0, rollbacks = 0, losses = {}}
  -- agreed: every rank stops here (the interrupts' all-reduce below)
  local function interrupted(at, dir, during, agreed)
    self:end_line(true)
    if self.pending_rollback then   -- stopped before its replay: the rollback is logged all the same
      self:log(self.pending_rollback)
      self.pending_rollback = nil
    end
    self:log({event = "interrupted", step = at, checkpoint = dir})
    local what
    if dir then
      what = "; saved " .. dir
    elseif not self.run_dir then
      what = "; no run directory, nothing saved"
    elseif resumed_from then
      what = "; no step completed since the resume, nothing saved (" .. resumed_from .. " is as it was)"
    else
      what = "; no step completed, nothing saved"
    end
    local msg = string.format("moelua.train: interrupted at step %d%s%s", at, during or "", what)
    if agreed then errors.agreed(msg) end
    errors.user(msg)
  end
  -- After a step: its alarms, and a rollback when one is due. Returns the
  -- step to replay from after a rollback; else nil, why and collapsing.
  local function judge(step, m)
    local fired, collapsed, collapsing = self:check_balance(m)
    local why = (not m.skipped and self:spike(m.loss)) and "loss spike"
             or (self.skipped_run >= self.rollback.max_skipped and "skipped steps")
             or (collapsed and "router collapse") or nil
    for _, a in ipairs(fired) do
      self:log(a)
      self:end_line()
      self:call_hook(step, "on_alarm", self.state, a, self.model)
    end
    if why == "skipped steps" and not last_good then
      -- max_skipped in a row and nothing to go back to: the policy stops here
      self:end_line(true)
      local latest = self.run_dir and ckpt.latest(self.run_dir .. "/ckpt")
      self:log(m)   -- the step that stopped it has its line, as a rollback's does
      self:log({event = "stopped", step = step, reason = why, rollbacks = 0})
      errors.user(string.format("moelua.train: %d steps skipped in a row at step %d (%s), and no good checkpoint " ..
                                "to roll back to: stopping. %s; start again (or resume from an earlier " ..
                                "checkpoint) with a lower learning rate, a longer warmup or clipping",
                                self.skipped_run, step, m.nonfinite or "a non-finite loss or gradient norm",
                                latest and ("The run's latest checkpoint is " .. latest) or "Nothing was saved"))
    end
    if not (why and last_good) then return nil, why, collapsing end
    self:log(m)
    self:progress(m, step, last_step, t_start)
    local n = (self.rollbacks_to[last_good] or 0) + 1
    if n > self.rollback.max_rollbacks then
      self:end_line(true)
      self:log({event = "stopped", step = step, reason = why, rollbacks = n - 1, last_good = last_good})
      errors.user(string.format("moelua.train: %s at step %d, and %d rollbacks to %s did not get past it " ..
                                "(max_rollbacks %d): stopping. The last good checkpoint is %s; resume from it " ..
                                "(resume = it; a recipe's --resume %s) after changing what fails (a lower " ..
                                "learning rate, a longer warmup, clipping)", why, step, n - 1, last_good,
                                self.rollback.max_rollbacks, last_good, last_good))
    end
    self.rollbacks_to[last_good] = n
    local back = last_good_step
    -- past the offending batches, and past those of every earlier rollback to this checkpoint
    self.skip_to[last_good] = (self.skip_to[last_good] or 0) + (step - back)
    self:restore(last_good, true)
    self.skipped_run = 0
    result.rollbacks = result.rollbacks + 1
    local event = {event = "rollback", step = step, reason = why, to = last_good, resume_step = back + 1,
                   data_offset = self.data_offset, rollbacks_to = n, overrides = m.overrides}
    self:end_line()
    if self:call_hook(step, "on_rollback", self.state, event) == false then
      self:call_hook(step, "on_rollback", self.state, event)
    end
    self.pending_rollback = event    -- logged when the replay starts, with its lr scale
    return back + 1
  end
  local function validate(step)
    local v = self:validate()
    if v then
      self.val_loss = v
      self:log({event = "validation", step = step, loss = v})
    end
  end
  -- stood: a step was recorded, or a rollback restored one (a Ctrl-C then
  -- has a step before it to save); saved: the step a save in record wrote,
  -- so the final save is not a second one of it. A save is the new
  -- candidate, not good yet (last_good, if it named the step, is dropped),
  -- unless it saves last_good's own step again (a Ctrl-C right after a
  -- rollback).
  local stood, saved = false, {}
  local function save(at, tag)
    local dir, held = self:save(at, tag, at == last_good_step)
    if dir and at ~= last_good_step then candidate = {dir = dir, step = at} end
    saved.step, saved.dir = at, dir
    return dir, held
  end
  -- After a step that stands: its checkpoints, metrics line and progress.
  -- Returns the checkpoint written, if any, and the signals held in its save.
  local function record(step, m, why, collapsing)
    local dir, held = nil, 0
    -- good: not a step that asked for a rollback it could not take, nor one inside a
    -- collapse, nor a skipped one (the weights before it made it non-finite)
    local good = not why and not collapsing and self.skipped_run == 0
    stood = true
    if candidate then   -- the checkpoint before this step is good when this step is
      if good then
        if not self.silent then ckpt.mark_good(self.run_dir .. "/ckpt", candidate.dir) end
        last_good, last_good_step = candidate.dir, candidate.step
      end
      candidate = nil
    end
    -- the line first: a kill during a save below leaves it (the resume logs the
    -- steps it replays again, after its resume event); the saves' events follow it
    self:log(m)
    if attach_wants_checkpoint(self) and self.run_dir then   -- asked for from `moelua attach`
      dir, held = save(step, "attach")
    end
    if self.ckpt_every > 0 and (step + 1) % self.ckpt_every == 0 then
      local h
      dir, h = save(step, "every")
      held = held + h
    end
    self:progress(m, step, last_step, t_start)
    return dir, held
  end
  -- The loop and the final save run with Ctrl-C held: only a step's
  -- forward and backward (on one rank, Trainer:step) and validation are
  -- interruptible (host.interruptible), so no signal lands between an
  -- update and the checkpoint and metrics line that record it.
  local late = host.hold_interrupts(function()
    while step <= last_step do
      -- what a step abandoned by Ctrl-C (one rank) leaves to the save of the step before: its hook ran
      local state, rng = z.world == 1 and self.run_dir and deep_copy(self.state), tensor.rng_state()
      -- held through the step's update; with several ranks through all of
      -- it: every rank stops at the same step (mpiexec passes Ctrl-C to
      -- each), and the ranks agree on it after
      self.failed_before_update = false
      local held, ok, m = host.hold_interrupts(xpcall, self.step, with_traceback, self, step)
      if not ok then
        self.model.safe_point = nil                -- set during the step
        local interrupt = tostring(m):find("interrupted")
        if interrupt or self.failed_before_update then
          if state then
            for k in pairs(self.state) do self.state[k] = nil end
            for k, v in pairs(state) do self.state[k] = v end
          end
          tensor.rng_state(rng)
        end
        if interrupt then interrupted(step, stood and (save(step - 1, "interrupt")) or nil) end
        -- an error before the update (a hook's, the lr schedule's, a bug's)
        -- loses no step that stood: the one before it is saved, as for Ctrl-C
        local note
        if self.failed_before_update and stood and self.run_dir and z.world == 1 then
          -- (a save that fails too must not hide the error that stopped the run)
          local ok, dir = true, saved.step == step - 1 and saved.dir
          if not dir then ok, dir = pcall(save, step - 1, "error") end
          self:end_line(true)
          self:log({event = "stopped", step = step, reason = "error", checkpoint = ok and dir or nil})
          note = ok and string.format("step %d is saved in %s", step - 1, dir)
                    or string.format("saving step %d failed too: %s", step - 1, tostring(dir))
        end
        if note and errors.is_user(m) then errors.user(tostring(m) .. "; " .. note) end
        error(note and tostring(m) .. "\n(" .. note .. ")" or m, 0)
      end
      result.losses[step] = m.loss
      -- Between steps a signal is held until the bookkeeping is done (none
      -- of a rollback's restore, a checkpoint or a metrics line is cut in
      -- half), then stops the run as after a step. Validation, which can
      -- take as long as a step, is interrupted like one on a single rank.
      local h, replay, why, collapsing = host.hold_interrupts(judge, step, m)
      held = held + h
      local dir, in_save
      if replay then   -- the weights are last_good's now
        step, stood, saved, candidate = replay, true, {}, nil
      else
        if self.val_every > 0 and (step + 1) % self.val_every == 0 then
          if z.world > 1 then
            held = held + host.hold_interrupts(validate, step)
          else
            local vok, err = pcall(host.interruptible, validate, step)
            if not vok and not tostring(err):find("interrupted") then error(err, 0) end
            held = held + (vok and 0 or 1)
          end
        end
        h, dir, in_save = host.hold_interrupts(record, step, m, why, collapsing)
        held = held + h
        step = step + 1
      end
      if host.take_interrupt() then held = held + 1 end   -- one that came between the holds above
      if z.world > 1 then held = z:all_reduce_numbers({held}, "max", "interrupts")[1] end
      if held > 0 then
        host.take_interrupt()   -- acted on here: a Ctrl-C during the save below is held by it
        if dir then
          interrupted(step, dir, in_save > 0 and " (during the checkpoint save, which finished)" or nil, true)
        end
        interrupted(step, (save(step - 1, "interrupt")), nil, true)
      end
    end
    result.skipped = self.skipped
    result.first_step, result.first_loss = first, result.losses[first]
    result.final_loss = result.losses[last_step]
    local held = host.hold_interrupts(function()
      self:end_line(true)
      if self.run_dir then
        result.checkpoint = saved.step == last_step and saved.dir or save(last_step, "final")
      end
    end)
    if held > 0 then interrupted(last_step + 1, result.checkpoint, " (during the final save, which finished)") end
    if self.attach then   -- the last step's stats for attached clients; a client's pause here ends at Ctrl-C
      local ok, err = pcall(host.interruptible, self.attach.finish, self.attach, self.steps)
      if not ok and host.is_interrupt(err) then interrupted(last_step + 1, result.checkpoint) end
      if not ok then error(err, 0) end
    end
  end)
  -- a signal held by none of the holds inside (it came between them): the run is whole and saved
  if late > 0 then interrupted(last_step + 1, result.checkpoint) end
  if self.metrics then self.metrics:close() end
  return result
end

return train
