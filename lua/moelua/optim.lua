-- moelua.optim: optimizers over flat parameter units (DESIGN.md, Parameters:
-- flat units) as Torch7 / PyTorch-style classes. Every number is computed in
-- C (moelua.optim_c, kernels/optim.c); this module keeps parameter groups,
-- allocates states lazily under the ledger category "optim", and makes one C
-- call per step (moelua.optim_c.step_all updates every group).
--
--   local optim = require "moelua.optim"
--   local opt = optim.AdamW({
--     {params = unit.flat, grads = unit.grad_flat},                    -- dense
--     {params = norms.flat, grads = norms.grad_flat, weight_decay = 0},
--     {params = router.flat, grads = router.grad_flat, lr_mult = 0.1},
--     {params = experts.flat, grads = experts.grad_flat, experts = 8}, -- lazy Adam
--     {params = attn.flat, grads = attn.grad_flat, frozen = true},
--   }, {lr = 3e-4, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1})
--   local norm = optim.clip_grad_norm(opt, 1.0)
--   opt:step(lr, {[4] = active_mask})     -- active_mask: u8 [8], nonzero = got tokens
--   opt:state_tensor(4, "exp_avg", 2)      -- expert 2's live state (made now if absent)
--   opt:zero_grad()
--
-- Groups: params and grads are flat contiguous tensors (f32 or f64) of one
-- dtype, size and device; the states live on that device. lr_mult scales the step's lr; weight_decay overrides
-- the optimizer's (which groups get none, e.g. norms and embeddings, is the
-- recipe's choice); a frozen group is never touched and gets no state.
--
-- AdamW is torch.optim.AdamW (decoupled weight decay, bias correction, fp32
-- states exp_avg / exp_avg_sq); SGD is torch.optim.SGD (momentum, dampening,
-- nesterov, L2 weight decay added to the gradient).
--
-- Sparse mode (opt-in, AdamW only; it is not AdamW): a group with
-- `experts = E` is E equal slices (one expert each) updated by lazy Adam.
-- step() then needs active_masks[i], a u8 tensor [E] for that group (the
-- all-reduced "received tokens" mask): an inactive expert is neither updated
-- nor decayed and its step count does not advance; bias correction uses
-- the expert's own count (state.steps, i64 [E], saved by state_dict).
-- Dense AdamW, by contrast, still moves an expert whose gradient is zero.
-- Gradient contract: the caller zeroes gradients after every step
-- (opt:zero_grad()); expert backward skips experts without tokens, so an
-- untouched expert's gradient slice is zero, never a stale value from an
-- earlier step. The mask, not the gradient, decides what is updated: a
-- stale gradient of an inactive expert is never applied.
-- State allocation, per expert: state.exp_avg and state.exp_avg_sq of a
-- sparse group are tables {[e] = tensor [n/E]}; expert e's pair is
-- allocated under "optim" the first time e is active (a zero state with
-- count 0 is what lazy Adam starts from, so allocating late changes no
-- number), and an expert that never receives tokens has none. The group's
-- i64 [E] step counts (8 bytes per expert) appear with its first active
-- expert. So the ledger's "optim" bytes of a sparse group are exactly
-- 2 * (n/E) * dtype size per expert ever active, plus 8 E once any is; and
-- opt.skipped_expert_steps counts the expert-steps skipped.
--
-- Mixed precision: a group may carry `compute`, the bf16 copy of its
-- params (f32 masters) that the kernels read (contiguous, params' numel and
-- device); each step rounds the updated params into it (to nearest even),
-- as moelua.zero's groups of a bf16 model do.
--
-- Given states (AdamW): a group may carry exp_avg and exp_avg_sq, views
-- (contiguous, params' numel, dtype and device) that the caller owns,
-- typically views of reserved flat buffers laid out like its unit
-- (tensor.reserve: on the CPU the ledger is charged only for committed
-- elements). The optimizer then allocates neither: a dense group commits
-- its two views at its first step; in a sparse group slice e of each view
-- (view_at((e-1) * n/E, {n/E})) is expert e's state, committed the first
-- time e is active, so an expert that never had tokens still costs no
-- committed byte and the "optim" bytes are those above. A view the caller
-- committed already is zeroed instead. SGD ignores them. state_dict() returns the committed
-- views; load_state_dict copies into them (committing them first), keeping
-- a source that is a view of the same elements. The step counts are
-- allocated as without given states.
--
-- A warmed-up step() (every active expert already has states) makes no
-- ledger allocation; an expert's first activity allocates its two states
-- before the update starts. Under moelua.mem.plan (a dry run, masks
-- meaningless) every expert gets states: the worst case. The step cannot be
-- interrupted (DESIGN.md, Layers): the kernels ignore Ctrl-C and every group
-- is updated by one C call, so Ctrl-C takes effect after the whole step.
--
-- Offload (AdamW, one process, f32): optim.AdamW(groups, {...,
-- offload = {path =, chunk = 262144, slots = 2}}) keeps exp_avg and
-- exp_avg_sq of every unfrozen group in a moelua.store backing file at path
-- (created, fallocated, never on tmpfs, removed by opt:close() or when the
-- optimizer is collected) for groups on the cpu, and in the store's pinned
-- host memory (no path) for groups on cuda, its slots then GPU memory;
-- none of them resident: the groups are laid end
-- to end in one state space of N elements, cut in chunks of `chunk`
-- elements (default 1 MiB of f32 per state; at most N), and slab c holds
-- chunk c of exp_avg then of exp_avg_sq (8 chunk bytes). step() runs
-- C.adamw_step on each chunk's part of each group (a lazy group: each
-- active expert's slice, with its own count) through `slots` store slots
-- (the staging: slots x 8 chunk bytes, 64-byte aligned, charged by the
-- store to the ledger's `optim`; the file to the `file` book under
-- "optim"), with the same hp and t as resident states: the update is
-- elementwise, so the result is bitwise the same. Mixed precision (groups
-- with `compute`): each chunk's compute copy is rounded from its updated
-- masters there and then; masters in host memory (params on the cpu, the
-- grads and compute copy on cuda: moelua.zero's `offload`) are staged
-- through one more device chunk (4 chunk bytes under "optim"), copied in
-- before the chunk's update and back after it. Given states are
-- ignored (never committed; on CUDA, where a reservation is allocated,
-- model:param_groups{offload = true} reserves none); a sparse group's i64 step counts stay
-- resident under "optim". A step's pass runs with interrupts held
-- (moelua.host.hold_interrupts): opt.held_interrupts counts the signals
-- held, for the caller to act on once the step is complete. States cannot
-- be handed out as tensors: state_dict() gives `true` for each state that
-- exists (a sparse group: {[e] = true}) and the live step counts;
-- read_state / write_state stream a range through the staging;
-- state_tensor gives only "steps"; load_state_dict takes markers (the
-- values written with write_state) or tensors (copied in), and zeroes the
-- states sd does not have; zero_states() makes every state zero and absent.
--
-- Clipping: optim.clip_expert_norms(grads_flat, E, bounds) clips each
-- expert's gradient slice to its bound (computed by the recipe, e.g. from
-- its load); optim.clip_grad_norm(groups, max_norm) clips the global norm.
-- Order: per-expert first, then global.
local tensor = require "moelua.tensor"
local mem = require "moelua.mem"
local C = require "moelua.optim_c"
local store = require "moelua.store"
local host = require "moelua.host"
local options = require "moelua.options"

local optim = {}

local GROUP_KEYS = {params = true, grads = true, lr_mult = true, weight_decay = true,
                    frozen = true, experts = true, name = true, exp_avg = true, exp_avg_sq = true,
                    compute = true}
local GIVEN_STATES = {"exp_avg", "exp_avg_sq"}   -- states a caller may lay out (AdamW)

-- The level, for error() called from the function that calls this one,
-- of the first caller outside this file (and moelua.options.check, which
-- check_opts calls): however deep a check sits (check_groups, check_opts,
-- step_lr), its error names the line that called moelua.optim.
local HERE, CHECKER = debug.getinfo(1, "S").source, debug.getinfo(options.check, "S").source
local function caller_level()
  local level = 3   -- the caller of the function that asks
  while true do
    local info = debug.getinfo(level, "S")
    if not info or info.source ~= HERE and info.source ~= CHECKER then return level - 1 end
    level = level + 1
  end
end

local function fail(fn, fmt, ...)
  error(string.format("moelua.optim." .. fn .. ": " .. fmt, ...), caller_level())
end

local function check_number(fn, what, v, lo, hi)
  if type(v) ~= "number" or v ~= v or v < lo or (hi and v >= hi) then
    error(string.format("moelua.optim.%s: %s must be a number in [%g, %s, got %s", fn, what,
                        lo, hi and (tostring(hi) .. ")") or "inf)", tostring(v)), caller_level())
  end
  return v
end

-- Group i's given states (AdamW): both or neither, contiguous views of
-- params' numel, dtype and device; returned flat (1-D views). Another
-- optimizer has no such states and leaves them (a model's groups say where
-- AdamW's states live, whichever optimizer the recipe takes).
local function check_given(fn, i, g, p, adamw)
  if not adamw or (g.exp_avg == nil and g.exp_avg_sq == nil) then return nil, nil end
  local out = {}
  for _, k in ipairs(GIVEN_STATES) do
    local v = g[k]
    if not tensor.is_tensor(v) then
      fail(fn, "group %d: '%s' must be a tensor when %s is given, got %s", i, k,
           k == "exp_avg" and "exp_avg_sq" or "exp_avg", type(v))
    end
    if not v:is_contiguous() or v:numel() ~= p:numel() or v:dtype() ~= p:dtype()
       or v:device() ~= p:device() then
      fail(fn, "group %d: '%s' must be contiguous, %s on %s with %d elements like params, got %s%s " ..
           "on %s with %d", i, k, p:dtype(), p:device(), p:numel(),
           v:is_contiguous() and "" or "non-contiguous ", v:dtype(), v:device(), v:numel())
    end
    out[k] = v:view({v:numel()})
  end
  return out.exp_avg, out.exp_avg_sq
end

local function check_groups(fn, groups, allow_experts, offload)
  if type(groups) ~= "table" or #groups == 0 then
    fail(fn, "groups must be a non-empty list of tables, got %s", type(groups))
  end
  local n, last = 0, 0   -- a group past a hole or under a name would never be stepped
  for k in pairs(groups) do
    if math.type(k) ~= "integer" or k < 1 then fail(fn, "groups must be a list 1..n, got the key %s", tostring(k)) end
    n, last = n + 1, math.max(last, k)
  end
  if n ~= last then
    local hole = 1
    while groups[hole] ~= nil do hole = hole + 1 end
    fail(fn, "groups must be a list 1..n, got a hole: group %d is nil", hole)
  end
  local out = {}
  for i, g in ipairs(groups) do
    if type(g) ~= "table" then fail(fn, "group %d must be a table, got %s", i, type(g)) end
    for k in pairs(g) do
      if not GROUP_KEYS[k] then
        fail(fn, "group %d: unknown key '%s' (expected one of: compute, exp_avg, exp_avg_sq, experts, " ..
             "frozen, grads, lr_mult, name, params, weight_decay)", i, tostring(k))
      end
    end
    local p, gr = g.params, g.grads
    if not tensor.is_tensor(p) then fail(fn, "group %d: 'params' must be a tensor, got %s", i, type(p)) end
    if not tensor.is_tensor(gr) then fail(fn, "group %d: 'grads' must be a tensor, got %s", i, type(gr)) end
    local cp = g.compute
    -- (masters in host memory beside a device's compute copy: only offloaded, which stages them)
    local host_masters = offload and tensor.is_tensor(cp) and p:device() == "cpu" and cp:device() == gr:device()
    if p:device() ~= gr:device() and not host_masters then
      fail(fn, "group %d: params are on %s but grads on %s (one device expected%s)", i, p:device(), gr:device(),
           cp and ", or f32 masters on the cpu with option 'offload'" or "")
    end
    if not p:is_contiguous() or not gr:is_contiguous() then
      fail(fn, "group %d: params and grads must be contiguous (flat units)", i)
    end
    if p:dtype() ~= gr:dtype() or (p:dtype() ~= "f32" and p:dtype() ~= "f64") then
      fail(fn, "group %d: params (%s) and grads (%s) must share dtype f32 or f64", i,
           p:dtype(), gr:dtype())
    end
    if p:numel() ~= gr:numel() then
      fail(fn, "group %d: params has %d elements, grads %d", i, p:numel(), gr:numel())
    end
    local lr_mult = g.lr_mult == nil and 1 or g.lr_mult
    if type(lr_mult) ~= "number" or not (lr_mult >= 0 and lr_mult < math.huge) then
      fail(fn, "group %d: 'lr_mult' must be a finite number >= 0, got %s", i, tostring(g.lr_mult))
    end
    if g.weight_decay ~= nil and (type(g.weight_decay) ~= "number" or
                                  not (g.weight_decay >= 0 and g.weight_decay < math.huge)) then
      fail(fn, "group %d: 'weight_decay' must be a finite number >= 0, got %s", i, tostring(g.weight_decay))
    end
    if g.frozen ~= nil and type(g.frozen) ~= "boolean" then
      fail(fn, "group %d: 'frozen' must be a boolean, got %s", i, type(g.frozen))
    end
    local E = g.experts
    if E ~= nil then
      if not allow_experts then
        fail(fn, "group %d: 'experts' (sparse mode) is lazy Adam; use optim.AdamW", i)
      end
      if math.type(E) ~= "integer" or E < 1 or p:numel() % E ~= 0 then
        fail(fn, "group %d: 'experts' must be an integer >= 1 dividing %d elements, got %s", i,
             p:numel(), tostring(E))
      end
    end
    if cp ~= nil and not (tensor.is_tensor(cp) and cp:is_contiguous() and cp:numel() == p:numel()
                          and cp:device() == gr:device() and (cp:dtype() == "bf16" or cp:dtype() == p:dtype())) then
      fail(fn, "group %d: 'compute' must be a contiguous bf16 (or %s) tensor on %s with %d elements like params", i,
           p:dtype(), gr:device(), p:numel())
    end
    local exp_avg, exp_avg_sq = check_given(fn, i, g, p, allow_experts)
    out[i] = {params = p, grads = gr, lr_mult = lr_mult, weight_decay = g.weight_decay,
              frozen = g.frozen or false, experts = E, name = g.name,
              exp_avg = exp_avg, exp_avg_sq = exp_avg_sq, compute = cp}
  end
  return out
end

local function check_opts(fn, opts, spec)
  return options.check(opts, spec, function(fmt, ...) fail(fn, fmt, ...) end)
end

-- States live with their parameters (device); per-expert step counts are
-- host counters (device "cpu").
local function zeros_optim(n, dtype, device)
  return mem.scope("optim", tensor.zeros, {n}, {dtype = dtype, device = device})
end

-- The part of group g's given state k (the whole view, or expert e's
-- slice), nil when g has no given states.
local function given_part(g, k, e)
  local v = g[k]
  if v == nil or e == nil then return v end
  local S = v:numel() // g.experts
  return v:view_at((e - 1) * S, {S})
end

-- A new zero state k of group g (of expert e in a sparse group): its given
-- part committed now (zeroed when the caller committed it already), else
-- allocated under "optim".
local function new_state(g, k, e)
  local v = given_part(g, k, e)
  if v == nil then
    return zeros_optim(e and g.params:numel() // g.experts or g.params:numel(), g.params:dtype(),
                       g.params:device())
  end
  if v:committed() then
    v:zero_()
    return v
  end
  return v:commit_()
end

-- Are a and b views of the same elements?
local function same_view(a, b)
  return rawequal(a, b) or (a:same_storage(b) and a:storage_offset() == b:storage_offset() and
                            a:numel() == b:numel() and a:is_contiguous() and b:is_contiguous())
end

-- After a step: every unfrozen group's compute copy rounded from its params.
local function round_compute(self)
  for _, g in ipairs(self.groups) do
    if g.compute and not g.frozen then g.compute:copy_(g.params) end
  end
end

local function step_lr(fn, self, lr)
  if lr == nil then return self.opts.lr end
  return check_number(fn, "lr", lr, 0, math.huge)   -- (an infinite lr is no step)
end

-- ---- shared methods -----------------------------------------------------------

local Base = {}
Base.__index = Base

-- self must be an optimizer (opt.step(lr), a dot for the colon, names
-- itself); returns the name of method for messages ("AdamW:step").
local function check_self(self, method)
  if type(self) ~= "table" or getmetatable(getmetatable(self) or {}) ~= Base then
    error(string.format("moelua.optim: opt:%s is a method: call it with a colon, got a %s for self", method,
                        type(self)), caller_level())
  end
  return self.kind .. ":" .. method
end

-- Group gi of the optimizer, which has it (fn names the caller).
local function group_of(self, fn, gi)
  if math.type(gi) ~= "integer" then fail(fn, "argument #1 (group) must be an integer, got %s", type(gi)) end
  local g = self.groups[gi]
  if g == nil then fail(fn, "no group %d (the optimizer has %d)", gi, #self.groups) end
  return g, self.state[gi]
end

function Base:zero_grad()
  check_self(self, "zero_grad")
  for _, g in ipairs(self.groups) do g.grads:zero_() end
end

local STATE_TENSORS = {"exp_avg", "exp_avg_sq", "steps", "momentum_buffer"}
local KIND_STATES = {AdamW = {exp_avg = true, exp_avg_sq = true, steps = true, list = "exp_avg, exp_avg_sq, steps"},
                     SGD = {momentum_buffer = true, list = "momentum_buffer"}}
local EXPERT_STATES = {exp_avg = true, exp_avg_sq = true}   -- per expert in sparse groups

-- Tables of tensors (the live states, not copies) and counts, for checkpoints:
-- {kind =, t =, skipped_expert_steps =, groups = {[i] = {step =, exp_avg =,
-- exp_avg_sq =, steps = i64 [E], momentum_buffer =}}}; absent states are nil.
-- In a sparse group exp_avg and exp_avg_sq are tables {[e] = tensor [n/E]}
-- holding only the experts that have states (a new table, the live tensors).
function Base:state_dict()
  check_self(self, "state_dict")
  local sd = {kind = self.kind, t = self.t, skipped_expert_steps = self.skipped_expert_steps,
              groups = {}}
  for i, st in ipairs(self.state) do
    local gs = {step = st.step}
    for _, k in ipairs(STATE_TENSORS) do
      local v = st[k]
      if EXPERT_STATES[k] and st.experts then
        v = {}
        for e = 1, st.experts do v[e] = st[k][e] end
      end
      gs[k] = v
    end
    sd.groups[i] = gs
  end
  return sd
end

-- A state tensor of sd (what: its name in messages) must be dt with n elements.
local function check_state(fn, i, what, src, dt, n)
  if not tensor.is_tensor(src) then fail(fn, "group %d: '%s' must be a tensor", i, what) end
  if src:numel() ~= n or src:dtype() ~= dt then
    fail(fn, "group %d: '%s' must be %s with %d elements, got %s with %d", i, what, dt, n,
         src:dtype(), src:numel())
  end
end

-- The per-expert states of sparse group i: tables keyed by experts 1..E;
-- exp_avg and exp_avg_sq name the same experts, and steps is given if any.
local function check_expert_states(fn, i, g, gs)
  local S, dt = g.params:numel() // g.experts, g.params:dtype()
  for _, k in ipairs({"exp_avg", "exp_avg_sq"}) do
    local t = gs[k]
    if t ~= nil and (type(t) ~= "table" or tensor.is_tensor(t)) then
      fail(fn, "group %d: '%s' must be a table {[expert] = tensor} (sparse group), got %s", i, k,
           tensor.is_tensor(t) and "a tensor" or type(t))
    end
    for e, src in pairs(t or {}) do
      if math.type(e) ~= "integer" or e < 1 or e > g.experts then
        fail(fn, "group %d: '%s' keys must be experts 1..%d, got %s", i, k, g.experts, tostring(e))
      end
      check_state(fn, i, string.format("%s[%d]", k, e), src, dt, S)
    end
  end
  local any = false
  for e = 1, g.experts do
    local a, b = gs.exp_avg and gs.exp_avg[e], gs.exp_avg_sq and gs.exp_avg_sq[e]
    if (a == nil) ~= (b == nil) then
      fail(fn, "group %d: expert %d has %s but not %s", i, e, a and "exp_avg" or "exp_avg_sq",
           a and "exp_avg_sq" or "exp_avg")
    end
    any = any or a ~= nil
  end
  if any and gs.steps == nil then fail(fn, "group %d: experts have states but no 'steps'", i) end
end

-- Copies sd's tensor src (any device) into st[k] (when absent: the given
-- view `given`, committed if it is not yet, or allocated under "optim" on
-- `device`; with adopt and no given view, src itself becomes st[k] when it
-- is a flat, contiguous tensor of that dtype and device), or drops st[k]
-- when src is nil (freed unless it is a given view, whose bytes stay
-- committed). A src that is a view of st[k]'s elements is not copied.
local function load_state(st, k, src, dt, device, adopt, given)
  if src ~= nil then
    local n = src:numel()
    if st[k] == nil and given then
      st[k] = given:committed() and given or given:commit_()
    end
    if st[k] == nil and adopt and src:dim() == 1 and src:is_contiguous() and src:dtype() == dt
       and src:device() == device then
      st[k] = src
    end
    if st[k] == nil then st[k] = zeros_optim(n, dt, device) end
    if not same_view(st[k], src) then st[k]:copy_(src:reshape({n})) end
  elseif st[k] ~= nil then
    if not given then st[k]:free() end
    st[k] = nil
  end
end

-- The optimizer's own counts from a state_dict.
local function restore_counts(self, sd)
  self.t = math.tointeger(sd.t) or 0
  self.skipped_expert_steps = math.tointeger(sd.skipped_expert_steps) or 0
end

-- sd is a state_dict() of this kind of optimizer with one entry per group
-- (the checks every load_state_dict makes first), and every group's step
-- an integer.
local function check_state_dict(fn, self, sd)
  if type(sd) ~= "table" or type(sd.groups) ~= "table" then
    fail(fn, "expected a table from state_dict(), got %s", type(sd))
  end
  if sd.kind ~= self.kind then
    fail(fn, "state of a %s optimizer, this is %s", tostring(sd.kind), self.kind)
  end
  if #sd.groups ~= #self.groups then
    fail(fn, "state has %d groups, optimizer has %d", #sd.groups, #self.groups)
  end
  local own = KIND_STATES[self.kind]
  for i, gs in ipairs(sd.groups) do
    if type(gs) ~= "table" or math.type(gs.step) ~= "integer" then
      fail(fn, "group %d: 'step' must be an integer", i)
    end
    for k, v in pairs(gs) do
      if k ~= "step" and own[k] ~= true then
        fail(fn, "group %d: '%s' is not a state of %s (expected step, %s)", i, tostring(k), self.kind, own.list)
      end
      -- (a sparse group's empty tables say "no expert has states": state_dict writes them frozen or not)
      if k ~= "step" and self.groups[i].frozen and not (type(v) == "table" and next(v) == nil) then
        fail(fn, "group %d is frozen: it has no states, got '%s'", i, k)
      end
    end
    if self.kind == "AdamW" and not self.groups[i].experts and (gs.exp_avg == nil) ~= (gs.exp_avg_sq == nil) then
      fail(fn, "group %d: %s without %s (a dense group's states are both or neither)", i,
           gs.exp_avg and "exp_avg" or "exp_avg_sq", gs.exp_avg and "exp_avg_sq" or "exp_avg")
    end
  end
end

-- Copies sd's states into this optimizer's (allocating them under "optim"
-- where needed); states absent from sd are freed. sd is checked whole before
-- anything changes. opts.adopt: where this optimizer has no state yet, take
-- sd's tensor itself when it fits (no copy: a loader that built sd for
-- this call hands its tensors over instead of holding them twice).
function Base:load_state_dict(sd, opts)
  local fn = check_self(self, "load_state_dict")
  local adopt = check_opts(fn, opts, {adopt = {"boolean", false}}).adopt
  check_state_dict(fn, self, sd)
  for i, gs in ipairs(sd.groups) do     -- check everything before changing anything
    local g = self.groups[i]
    if g.experts then check_expert_states(fn, i, g, gs) end
    for _, k in ipairs(STATE_TENSORS) do
      local src = gs[k]
      if src ~= nil and not (g.experts and EXPERT_STATES[k]) then
        local n = k == "steps" and g.experts or g.params:numel()
        if not n then fail(fn, "group %d: '%s' given for a dense group", i, k) end
        check_state(fn, i, k, src, k == "steps" and "i64" or g.params:dtype(), n)
      end
    end
  end
  for i, gs in ipairs(sd.groups) do
    local g, st = self.groups[i], self.state[i]
    local dt, dev = g.params:dtype(), g.params:device()
    for _, k in ipairs(STATE_TENSORS) do
      if g.experts and EXPERT_STATES[k] then
        for e = 1, g.experts do
          load_state(st[k], e, gs[k] and gs[k][e], dt, dev, adopt, given_part(g, k, e))
        end
      elseif k == "steps" then
        load_state(st, k, gs[k], "i64", "cpu", adopt)
      else
        load_state(st, k, gs[k], dt, dev, adopt, given_part(g, k))
      end
    end
    st.step = gs.step
  end
  restore_counts(self, sd)
end

-- ---- AdamW ----------------------------------------------------------------------

local AdamW = setmetatable({}, Base)
AdamW.__index = AdamW

local ADAMW_OPTS = {lr = {"number", 1e-3}, beta1 = {"number", 0.9}, beta2 = {"number", 0.999},
                    eps = {"number", 1e-8}, weight_decay = {"number", 1e-2}, offload = {"table", false}}

-- ---- offload: the states in a store (see the header) -----------------------------

local OFFLOAD_CHUNK = 1 << 18   -- elements of each state per slab: 1 MiB of f32

local function offload_fail(fmt, ...)
  error(string.format("moelua.optim.AdamW: option 'offload': " .. fmt, ...), 4)
end

-- The store of the unfrozen groups' states: {s, chunk, base = {[group] =
-- its first element in the state space}, n, views}. Checked before the
-- file is made.
local function open_offload(groups, oo)
  for k in pairs(oo) do
    if k ~= "path" and k ~= "chunk" and k ~= "slots" then
      offload_fail("unknown key '%s' (expected one of: chunk, path, slots)", tostring(k))
    end
  end
  local chunk, slots = oo.chunk or OFFLOAD_CHUNK, oo.slots or 2
  if math.type(chunk) ~= "integer" or chunk < 1 then
    offload_fail("'chunk' must be an integer >= 1 (elements), got %s", tostring(chunk))
  end
  if math.type(slots) ~= "integer" or slots < 1 then
    offload_fail("'slots' must be an integer >= 1, got %s", tostring(slots))
  end
  local base, n, device, staged = {}, 0, nil, false
  for i, g in ipairs(groups) do
    if not g.frozen then
      device = device or g.grads:device()
      if g.params:dtype() ~= "f32" or g.grads:device() ~= device then
        offload_fail("group %d is %s on %s, offloaded states are f32 on the device of every group (%s)", i,
                     g.params:dtype(), g.grads:device(), device)
      end
      staged = staged or g.params:device() ~= device
      base[i], n = n, n + g.params:numel()
    end
  end
  device = device or "cpu"
  if device == "cpu" and (type(oo.path) ~= "string" or oo.path == "") then
    offload_fail("'path' (the backing file) must be a file name, got %s", type(oo.path))
  elseif device ~= "cpu" and oo.path ~= nil then
    offload_fail("'path': on %s the states live in pinned host memory, not in a file (leave it out)", device)
  end
  chunk = math.max(1, math.min(chunk, n))
  local function refusals()   -- every book's: the slots on the device, the slabs in the file or pinned tier
    local n = 0
    for _, book in pairs(mem.stats()) do n = n + book.refused end
    return n
  end
  local refused = refusals()
  local ok, s = pcall(store.open, {device = device, path = oo.path, slabs = math.max(1, (n + chunk - 1) // chunk),
                                   slab_bytes = 8 * chunk, slots = slots, prefetch = 2, category = "optim",
                                   slot_category = "optim"})
  if not ok and refusals() > refused then error(s, 0) end   -- a budget's refusal: not the option's
  if not ok then offload_fail("%s", (tostring(s):gsub("^moelua%.store%.open: ", ""))) end
  -- masters in host memory: one chunk of them at a time on the device
  local stage = staged and mem.scope("optim", tensor.zeros, {chunk}, {dtype = "f32", device = device})
  return {s = s, chunk = chunk, base = base, n = n, views = {}, stage = stage or nil}
end

-- Slot i's chunk of exp_avg and of exp_avg_sq (views made once).
local function slot_views(of, i)
  local v = of.views[i]
  if not v then
    local t = of.s:slot(i)
    v = {t:view_at(0, {of.chunk}), t:view_at(of.chunk, {of.chunk})}
    of.views[i] = v
  end
  return v[1], v[2]
end

-- fn(m, v, at, len) for each chunk's part of the state space [lo, lo + n)
-- in turn, its slab acquired (released dirty when `dirty`, also when fn
-- raises); m and v: the part's exp_avg and exp_avg_sq, at: its offset from lo.
local function each_chunk(of, lo, n, dirty, fn)
  local C, s, a = of.chunk, of.s, lo
  while a < lo + n do
    local c = a // C
    local hi = math.min(lo + n, (c + 1) * C)
    local m, v = slot_views(of, (s:acquire(c)))
    local ok, err = pcall(fn, m:view_at(a - c * C, {hi - a}), v:view_at(a - c * C, {hi - a}), a - lo, hi - a)
    s:release(c, dirty)
    if not ok then error(err, 0) end
    a = hi
  end
end

-- Where group gi's state range starts in the state space: its expert e's
-- slice (sparse) at offset off.
local function offload_lo(self, gi, e, off)
  local g = self.groups[gi]
  return self.offload.base[gi] + (e and (e - 1) * (g.params:numel() // g.experts) or 0) + off
end

function optim.AdamW(groups, opts)
  local o = check_opts("AdamW", opts, ADAMW_OPTS)
  check_number("AdamW", "option 'lr'", o.lr, 0)
  check_number("AdamW", "option 'beta1'", o.beta1, 0, 1)
  check_number("AdamW", "option 'beta2'", o.beta2, 0, 1)
  check_number("AdamW", "option 'eps'", o.eps, 0)
  check_number("AdamW", "option 'weight_decay'", o.weight_decay, 0)
  local self = setmetatable({kind = "AdamW", opts = o, groups = check_groups("AdamW", groups, true, o.offload),
                             state = {}, t = 0, skipped_expert_steps = 0}, AdamW)
  if o.offload then
    for _, g in ipairs(self.groups) do g.exp_avg, g.exp_avg_sq = nil, nil end   -- given states: ignored
    self.offload = open_offload(self.groups, o.offload)
  end
  for i, g in ipairs(self.groups) do
    -- the state is also the job moelua.optim_c.step_all reads (and whose
    -- step count it advances); hp is reused every step (no table per step)
    self.state[i] = {op = g.experts and "lazy_adamw" or "adamw", params = g.params,
                     grads = g.grads, experts = g.experts, step = 0,
                     exp_avg = g.experts and {}, exp_avg_sq = g.experts and {},  -- per expert
                     hp = {lr = 0, beta1 = o.beta1, beta2 = o.beta2, eps = o.eps,
                           weight_decay = g.weight_decay or o.weight_decay}}
  end
  self.jobs, self.fresh = {}, {}
  return self
end

-- The states of sparse group g's experts fresh[1..k] (active, none yet),
-- and the group's step counts with its first active expert. Cold path.
local function add_expert_states(st, g, fresh, k)
  if not st.steps then st.steps = zeros_optim(g.experts, "i64", "cpu") end
  for j = 1, k do
    local e = fresh[j]
    st.exp_avg[e], st.exp_avg_sq[e] = new_state(g, "exp_avg", e), new_state(g, "exp_avg_sq", e)
  end
end

-- The states of dense group g, with its first step. Cold path.
local function add_dense_states(st, g)
  st.exp_avg, st.exp_avg_sq = new_state(g, "exp_avg"), new_state(g, "exp_avg_sq")
end

-- opt:step([lr [, active_masks]]): lr defaults to opts.lr; active_masks[i]
-- is the u8 [E] mask of sparse group i (required for those groups). Lua only
-- checks masks and allocates states; the update of every group is one C call
-- (moelua.optim_c.step_all), so Ctrl-C cannot cut a step between groups.
-- Sparse group i's mask from active_masks (checked; level: the caller's, for error).
local function group_mask(i, g, active_masks, level)
  local mask = active_masks and active_masks[i]
  if not tensor.is_tensor(mask) or mask:dtype() ~= "u8" or mask:numel() ~= g.experts then
    error(string.format("moelua.optim.AdamW:step: group %d has experts = %d and needs active_masks[%d] " ..
                        "(u8 [%d]), got %s", i, g.experts, i, g.experts,
                        tensor.is_tensor(mask) and (mask:dtype() .. " [" .. mask:numel() .. "]") or type(mask)), level)
  end
  return mask
end

-- The offloaded step: the same updates as step_all's jobs (t = the
-- group's count + 1, a lazy group's active experts with their own), each
-- group's range chunk by chunk in state-space order (the store's
-- schedule), with interrupts held; then the counts, as step_all.
local function offloaded_step(self, lr, active_masks)
  local of, planning = self.offload, mem.planning()
  local runs, seq, skipped = {}, {}, 0
  local function add(i, g, st, at, n, t, e)   -- elements [at, at + n) of group i, at count t
    local lo = of.base[i] + at
    runs[#runs + 1] = {lo = lo, n = n, at = at, g = g, st = st, t = t, e = e}
    for c = lo // of.chunk, (lo + n - 1) // of.chunk do seq[#seq + 1] = c end
  end
  for i, g in ipairs(self.groups) do
    if not g.frozen then
      local st = self.state[i]
      st.hp.lr = lr * g.lr_mult
      if g.experts then
        local mask, S = group_mask(i, g, active_masks, 4), g.params:numel() // g.experts
        -- in a plan the mask means nothing: every expert, the worst case
        local active, counts = not planning and mask:totable()
        for e = 1, g.experts do
          if planning or active[e] ~= 0 then
            if not st.steps then st.steps = zeros_optim(g.experts, "i64", "cpu") end
            counts = counts or planning or st.steps:totable()
            st.exp_avg[e], st.exp_avg_sq[e] = true, true
            add(i, g, st, (e - 1) * S, S, planning and 1 or counts[e] + 1, e)
          else
            skipped = skipped + 1
          end
        end
      else
        st.exp_avg, st.exp_avg_sq = true, true
        add(i, g, st, 0, g.params:numel(), st.step + 1)
      end
    end
  end
  of.s:schedule(seq)
  self.held_interrupts = host.hold_interrupts(function()
    for _, r in ipairs(runs) do
      local g, hp = r.g, r.st.hp
      hp.step = r.t
      each_chunk(of, r.lo, r.n, true, function(m, v, at, len)
        local p = g.params:view_at(r.at + at, {len})
        local dp = p:device() == m:device() and p or of.stage:view_at(0, {len}):copy_(p)
        C.adamw_step(dp, g.grads:view_at(r.at + at, {len}), m, v, hp)
        if not rawequal(dp, p) then p:copy_(dp) end
        if g.compute then g.compute:view_at(r.at + at, {len}):copy_(dp) end
      end)
    end
  end)
  for _, r in ipairs(runs) do
    if r.e then r.st.steps:narrow(1, r.e, 1):fill_(r.t) else r.st.step = r.t end
  end
  self.t, self.skipped_expert_steps = self.t + 1, self.skipped_expert_steps + skipped
end

function AdamW:step(lr, active_masks)
  lr = step_lr(check_self(self, "step"), self, lr)
  if active_masks ~= nil and type(active_masks) ~= "table" then
    fail("AdamW:step", "active_masks must be a table {[group] = u8 tensor}, got %s",
         type(active_masks))
  end
  if self.offload then
    offloaded_step(self, lr, active_masks)   -- (not a tail call: errors name the caller of step)
    return
  end
  local jobs, n, idle = self.jobs, 0, 0
  for i, g in ipairs(self.groups) do
    if not g.frozen then
      local st = self.state[i]
      st.hp.lr = lr * g.lr_mult
      local run = true
      if g.experts then
        local mask = group_mask(i, g, active_masks, 3)
        st.active = mask
        -- experts active for the first time (in a plan: every expert without states, the worst case)
        local k = C.unstated(mask, st.exp_avg, self.fresh)
        if k > 0 then add_expert_states(st, g, self.fresh, k) end
        if not st.steps then
          run, idle = false, idle + g.experts                  -- no expert ever active
        end
      elseif not st.exp_avg then
        add_dense_states(st, g)
      end
      if run then
        n = n + 1
        jobs[n] = st
      end
    end
  end
  for k = n + 1, #jobs do jobs[k] = nil end
  C.step_all(jobs, self, idle)      -- advances the counts, self.t, self.skipped_expert_steps
  round_compute(self)
end

-- opt:state_tensor(gi, k [, e]): the live state tensor k of group gi (of
-- expert e in a sparse group), made now when absent, as the first step
-- would (zeros: the given view committed, or allocated under "optim";
-- an expert's or a dense group's pair is made together, with the group's
-- step counts): loaders read checkpoint ranges straight into it. k:
-- "exp_avg", "exp_avg_sq", "steps" (sparse groups).
function AdamW:state_tensor(gi, k, e)
  local fn = check_self(self, "state_tensor")
  local g, st = group_of(self, fn, gi)
  if k ~= "exp_avg" and k ~= "exp_avg_sq" and k ~= "steps" then
    fail(fn, "state must be \"exp_avg\", \"exp_avg_sq\" or \"steps\", got %s", tostring(k))
  end
  if self.offload and k ~= "steps" then
    fail(fn, "the states of group %d are offloaded (option 'offload'): read and write them with " ..
         "read_state / write_state", gi)
  end
  if not g.experts then
    if e ~= nil or k == "steps" then
      fail(fn, "group %d is dense: it has no %s", gi, k == "steps" and "per-expert steps" or "experts")
    end
    if not st.exp_avg then add_dense_states(st, g) end
    return st[k]
  end
  if k == "steps" then
    if e ~= nil then fail(fn, "group %d: 'steps' is one tensor [%d], not per expert", gi, g.experts) end
    if not st.steps then st.steps = zeros_optim(g.experts, "i64", "cpu") end
    return st.steps
  end
  if math.type(e) ~= "integer" or e < 1 or e > g.experts then
    fail(fn, "group %d has experts 1..%d, got %s", gi, g.experts, tostring(e))
  end
  if not st[k][e] then add_expert_states(st, g, {e}, 1) end
  return st[k][e]
end

-- Group gi, state k (exp_avg or exp_avg_sq), expert e (sparse groups) and
-- elements [off, off + n) of that state, checked for read_state / write_state.
local function check_range(self, fn, gi, k, e, off, n)
  check_self(self, fn:match(":(.*)"))
  local g = group_of(self, fn, gi)
  if k ~= "exp_avg" and k ~= "exp_avg_sq" then
    fail(fn, "state must be \"exp_avg\" or \"exp_avg_sq\", got %s", tostring(k))
  end
  if g.frozen then fail(fn, "group %d is frozen: it has no states", gi) end
  if g.experts and (math.type(e) ~= "integer" or e < 1 or e > g.experts) then
    fail(fn, "group %d has experts 1..%d, got %s", gi, g.experts, tostring(e))
  elseif not g.experts and e ~= nil then
    fail(fn, "group %d is dense: it has no experts", gi)
  end
  local size = g.experts and g.params:numel() // g.experts or g.params:numel()
  if math.type(off) ~= "integer" or math.type(n) ~= "integer" or off < 0 or n < 0 or off + n > size then
    fail(fn, "elements [%s, %s + %s) are outside the state's %d", tostring(off), tostring(off), tostring(n), size)
  end
  return g, self.state[gi]
end

-- opt:read_state(gi, k, e, off, n, fn): elements [off, off + n) of state k
-- ("exp_avg" or "exp_avg_sq") of group gi (of expert e, 1-based, in a
-- sparse group; e = nil in a dense one) as calls fn(view, at) over
-- consecutive parts (at: the part's offset from off): one call with a
-- view of the live tensor when the states are resident, one per chunk
-- through the staging when they are offloaded. The state must exist
-- (state_dict() names it). For checkpoint writers: fn reads the view.
function AdamW:read_state(gi, k, e, off, n, fn)
  local _, st = check_range(self, "AdamW:read_state", gi, k, e, off, n)
  local t = st[k]
  if e then t = t[e] end
  if not t then fail("AdamW:read_state", "group %d has no %s%s yet", gi, k, e and (" for expert " .. e) or "") end
  if not self.offload then return fn(t:view_at(off, {n}), 0) end
  each_chunk(self.offload, offload_lo(self, gi, e, off), n, false, function(m, v, at)
    fn(k == "exp_avg" and m or v, at)
  end)
end

-- opt:write_state(gi, k, e, off, n, fn): as read_state, but fn fills the
-- views (a checkpoint loader): the state is made first when absent, as
-- state_tensor does (resident: the live tensor; offloaded: the pair marked
-- present), and offloaded parts are written back.
function AdamW:write_state(gi, k, e, off, n, fn)
  local g, st = check_range(self, "AdamW:write_state", gi, k, e, off, n)
  if not self.offload then return fn(self:state_tensor(gi, k, e):view_at(off, {n}), 0) end
  if e then
    st.exp_avg[e], st.exp_avg_sq[e] = true, true
    if not st.steps then st.steps = zeros_optim(g.experts, "i64", "cpu") end   -- with its first pair, as resident
  else
    st.exp_avg, st.exp_avg_sq = true, true
  end
  each_chunk(self.offload, offload_lo(self, gi, e, off), n, true, function(m, v, at)
    fn(k == "exp_avg" and m or v, at)
  end)
end

-- Offloaded: zeroes group gi's states (expert e's, or the group's whole
-- range) in the store.
local function zero_offloaded(self, gi, e)
  local g = self.groups[gi]
  local n = e and g.params:numel() // g.experts or g.params:numel()
  each_chunk(self.offload, offload_lo(self, gi, e, 0), n, true, function(m, v) m:zero_(); v:zero_() end)
end

-- opt:zero_states(): every state zero and absent (offloaded states: a
-- loader's clean slate; the counts are load_state_dict's).
function AdamW:zero_states()
  if not self.offload then fail("AdamW:zero_states", "the states are resident: load_state_dict replaces them") end
  for i, g in ipairs(self.groups) do
    if not g.frozen then
      local st = self.state[i]
      zero_offloaded(self, i)
      if g.experts then st.exp_avg, st.exp_avg_sq = {}, {} else st.exp_avg, st.exp_avg_sq = nil, nil end
    end
  end
end

-- load_state_dict of offloaded states: sd as Base:load_state_dict's, but a
-- state may be `true` (present, its values written with write_state) as
-- well as a tensor (copied in, chunk by chunk); a state sd lacks is zeroed
-- and absent. The step counts are resident (load_state).
local function load_offloaded(self, sd, adopt)
  local fn = "AdamW:load_state_dict"
  check_state_dict(fn, self, sd)
  local function check(i, what, v, n)
    if v ~= nil and v ~= true then check_state(fn, i, what, v, "f32", n) end
  end
  for i, gs in ipairs(sd.groups) do   -- everything checked before anything changes
    local g = self.groups[i]
    if g.experts then
      local S = g.params:numel() // g.experts
      for _, k in ipairs(GIVEN_STATES) do
        if gs[k] ~= nil and (type(gs[k]) ~= "table" or tensor.is_tensor(gs[k])) then
          fail(fn, "group %d: '%s' must be a table {[expert] = true or tensor} (sparse group)", i, k)
        end
        for e = 1, g.experts do check(i, string.format("%s[%d]", k, e), gs[k] and gs[k][e], S) end
      end
      for e = 1, g.experts do
        if (gs.exp_avg and gs.exp_avg[e] ~= nil) ~= (gs.exp_avg_sq and gs.exp_avg_sq[e] ~= nil) then
          fail(fn, "group %d: expert %d has one of exp_avg and exp_avg_sq, not both", i, e)
        end
      end
      if gs.steps ~= nil then check_state(fn, i, "steps", gs.steps, "i64", g.experts) end
    else
      for _, k in ipairs(GIVEN_STATES) do check(i, k, gs[k], g.params:numel()) end
      if (gs.exp_avg == nil) ~= (gs.exp_avg_sq == nil) then
        fail(fn, "group %d has one of exp_avg and exp_avg_sq, not both", i)
      end
    end
    for _, k in ipairs(GIVEN_STATES) do
      if gs[k] ~= nil and g.frozen then fail(fn, "group %d is frozen: it has no %s", i, k) end
    end
  end
  for i, gs in ipairs(sd.groups) do
    local g, st = self.groups[i], self.state[i]
    local function take(e, src_m, src_v)   -- one pair (expert e's, or the group's): copied, kept or dropped
      local had = e and st.exp_avg[e] or not e and st.exp_avg
      if src_m == nil and had then zero_offloaded(self, i, e) end
      for k, src in pairs{exp_avg = src_m, exp_avg_sq = src_v} do
        if tensor.is_tensor(src) then
          local flat = src:reshape({src:numel()})
          each_chunk(self.offload, offload_lo(self, i, e, 0), src:numel(), true, function(m, v, at, len)
            (k == "exp_avg" and m or v):copy_(flat:view_at(at, {len}))
          end)
        end
      end
      local has = src_m ~= nil or nil
      if e then st.exp_avg[e], st.exp_avg_sq[e] = has, has else st.exp_avg, st.exp_avg_sq = has, has end
    end
    if g.experts then
      for e = 1, g.experts do take(e, gs.exp_avg and gs.exp_avg[e], gs.exp_avg_sq and gs.exp_avg_sq[e]) end
      load_state(st, "steps", gs.steps, "i64", "cpu", adopt)
    elseif not g.frozen then
      take(nil, gs.exp_avg, gs.exp_avg_sq)
    end
    st.step = gs.step
  end
  restore_counts(self, sd)
end

function AdamW:load_state_dict(sd, opts)
  local fn = check_self(self, "load_state_dict")
  if not self.offload then return Base.load_state_dict(self, sd, opts) end
  load_offloaded(self, sd, check_opts(fn, opts, {adopt = {"boolean", false}}).adopt)
end

-- opt:close(): an offloaded optimizer's store closed (its file removed);
-- the optimizer cannot step afterwards. Resident: nothing to do.
function AdamW:close()
  if self.offload then
    self.offload.s:close()
    if self.offload.stage then self.offload.stage:free() end
  end
end

-- An offloaded optimizer's store counters (moelua.store's stats), or nil.
function AdamW:offload_stats()
  return self.offload and self.offload.s:stats()
end

-- ---- SGD ------------------------------------------------------------------------

local SGD = setmetatable({}, Base)
SGD.__index = SGD

local SGD_OPTS = {lr = {"number", 1e-3}, momentum = {"number", 0}, dampening = {"number", 0},
                  weight_decay = {"number", 0}, nesterov = {"boolean", false}}

function optim.SGD(groups, opts)
  local o = check_opts("SGD", opts, SGD_OPTS)
  check_number("SGD", "option 'lr'", o.lr, 0)
  check_number("SGD", "option 'momentum'", o.momentum, 0)
  check_number("SGD", "option 'dampening'", o.dampening, 0)
  check_number("SGD", "option 'weight_decay'", o.weight_decay, 0)
  if o.nesterov and (o.momentum <= 0 or o.dampening ~= 0) then
    fail("SGD", "nesterov needs momentum > 0 and dampening = 0")
  end
  local self = setmetatable({kind = "SGD", opts = o, groups = check_groups("SGD", groups, false),
                             state = {}, t = 0, skipped_expert_steps = 0}, SGD)
  for i, g in ipairs(self.groups) do
    self.state[i] = {op = "sgd", params = g.params, grads = g.grads, step = 0,
                     hp = {lr = 0, momentum = o.momentum, dampening = o.dampening,
                           nesterov = o.nesterov, weight_decay = g.weight_decay or o.weight_decay}}
  end
  self.jobs = {}
  return self
end

function SGD:step(lr)
  lr = step_lr(check_self(self, "step"), self, lr)
  local jobs, n = self.jobs, 0
  for i, g in ipairs(self.groups) do
    if not g.frozen then
      local st = self.state[i]
      st.hp.lr = lr * g.lr_mult
      if st.hp.momentum ~= 0 and not st.momentum_buffer then
        st.momentum_buffer = zeros_optim(g.params:numel(), g.params:dtype(), g.params:device())
        st.step = 0     -- a new buffer is initialised from the gradient
      end
      n = n + 1
      jobs[n] = st
    end
  end
  for k = n + 1, #jobs do jobs[k] = nil end
  C.step_all(jobs, self)
  round_compute(self)
end

-- ---- clipping -------------------------------------------------------------------

-- total = optim.clip_grad_norm(groups_or_optimizer, max_norm): the global L2
-- norm of every non-frozen group's gradients (f64, fixed order, thread-count
-- invariant); when it exceeds max_norm, all are scaled by
-- max_norm / (total + 1e-6) (torch.nn.utils.clip_grad_norm_). A non-finite
-- total is returned without scaling: the caller skips the step.
function optim.clip_grad_norm(groups, max_norm)
  if type(groups) == "table" and groups.groups then groups = groups.groups end
  if type(groups) ~= "table" then
    fail("clip_grad_norm", "expected a list of groups or an optimizer, got %s", type(groups))
  end
  check_number("clip_grad_norm", "max_norm", max_norm, 0)
  local list = {}
  for i, g in ipairs(groups) do
    if type(g) ~= "table" or not tensor.is_tensor(g.grads) then
      fail("clip_grad_norm", "group %d has no 'grads' tensor", i)
    end
    local dt = g.grads:dtype()
    if dt ~= "f32" and dt ~= "f64" then fail("clip_grad_norm", "group %d: grads must be f32 or f64, got %s", i, dt) end
    if not g.frozen then list[#list + 1] = g.grads end
  end
  local total = C.grad_norm(list)
  if total == total and total < math.huge then
    local coef = max_norm / (total + 1e-6)
    if coef < 1 then
      for _, t in ipairs(list) do C.scale_(t, coef) end
    end
  end
  return total
end

-- norms = optim.clip_expert_norms(grads_flat, E, bounds [, out]): grads_flat
-- is E equal expert slices; slice e is scaled by min(1, bounds[e] /
-- (norm_e + 1e-6)). bounds: a Lua table or a tensor of E numbers. Returns
-- the per-expert norms before clipping (f64 [E], or `out`). Call it before
-- clip_grad_norm (per-expert first, then global).
-- (The C functions themselves: their errors name these and the caller's line.)
optim.clip_expert_norms = C.clip_slices_

-- optim.expert_norms(grads_flat, E [, out]): per-expert gradient norms
-- without clipping (f64 [E]).
optim.expert_norms = C.slice_norms

return optim
