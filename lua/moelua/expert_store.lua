-- moelua.expert_store: a model's experts under a byte budget (DESIGN.md,
-- Bounded expert memory). Every expert of every MoE block is one slab of a
-- backing tier (moelua.store) and only `slots` of them are resident at
-- once, in cache slots charged to the ledger's `cache` on the device; the
-- store's policy evicts the expert needed furthest ahead in the step's
-- known order, LRU across steps. On the cpu the tier is a file
-- (fallocated, pread/pwrite, never mapped); on cuda it is pinned host
-- memory (the `pinned` book), copied to and from the slots in GPU memory
-- on a copy stream of its own, ordered against the kernels by events.
--
--   local es = expert_store.new{path =, budget = bytes, layers = L, experts = E,
--                               dim = D, ffn = F [, device = "cpu", prefetch = 2,
--                               inference = false, dtype = "f32"]}   -- path: the cpu's file
--   local v = es:acquire(l, e)    -- slot views of layer l's (0-based) expert e
--   ... v.gate_up [2F, D], v.down [D, F], v.dgate_up, v.ddown ...
--   es:release(l, e, dirty)
--   es:with(l, e, dirty, fn)      -- fn(v) between the two, released also when fn raises
--   es:edit_params(l, e, fn)      -- fn(v) writes v.params (a load): see below
--
-- A slab holds everything of one expert that a step touches, in the layout
-- of its unit (gate_up then down, so one expert is 3 D F contiguous
-- elements), four times: parameters, gradients, AdamW's exp_avg and
-- exp_avg_sq. So the budget bounds the resident parameters, gradients and
-- optimizer states of experts together, and a slot is the unit of I/O.
-- With dtype "bf16" (mixed precision on cuda, as moelua.zero's units) the
-- four are f32 (v.params are the master weights, which the optimizer steps
-- and checkpoints hold) and a fifth part, v.compute, is their bf16 copy
-- that the kernels read (v.gate_up and v.down view it): 18 bytes per
-- parameter, on the ledger as zero's (compute: params, gradients: grads,
-- masters and states: optim). Whatever writes v.params rounds v.compute
-- from them: an update (at the expert's acquire), fill, and edit_params
-- (loads).
--
-- A step (the model and the trainer drive it; moelua.moe runs the experts
-- one at a time, ascending, so y and dx sum as one call does):
--   forward and backward   each layer's experts with tokens, acquired in turn
--   the last micro-batch   an expert's gradient is final after its backward:
--                          it is scaled (1 / micro-batches) and its squares
--                          summed (the gradient norm's per-expert parts) before
--                          its slot is released
--   the optimizer          after the global norm (which may skip the step or
--                          clip): every expert's update is queued (step),
--                          not run: it runs at the expert's next acquire,
--                          before anything reads its slot (the next step's
--                          forward, a checkpoint), with the gradient, clip
--                          coefficient, lr and step count of its own step,
--                          then its gradient is zeroed and the slab is dirty
-- So a step reads and writes each expert's slab in its forward and its
-- backward only: the optimizer's pass over every slab is gone, and the
-- results are bitwise the eager pass's (the update is elementwise on the
-- same inputs). The update cannot run earlier, at the expert's last
-- backward use: the step's norm is not known then (a non-finite norm
-- skips the step, a clip scales every gradient). An expert without tokens
-- in later steps keeps its updates queued, in order (dense AdamW moves it
-- every step), until it is next acquired.
--
-- Inference (inference = true: generation, evaluation): a slab is the
-- expert's parameters alone, and only the routed layer's order is known
-- (a token's next layer routes after this one has run), so its experts are
-- kept and hinted, and eviction beyond them is least recently used: the
-- field report's LRU with prefetch, which fits decoding.
--
-- The backing tier is mutated in place and dropped on close: it is never a
-- recovery source (checkpoints hold every expert's bytes).
local store = require "moelua.store"
local mem = require "moelua.mem"
local C = require "moelua.optim_c"
local errors = require "moelua.errors"
local options = require "moelua.options"

local expert_store = {}

local ES = {}
ES.__index = ES

local size = mem.format_bytes

-- slots, slot_bytes = expert_store.check{budget = bytes, layers =, experts =,
-- dim =, ffn =}: how many experts the budget keeps resident (at most all
-- of them) and a slot's bytes; a budget below one expert is a user error
-- naming --expert-budget. Nothing is created.
function expert_store.check(o)
  local n = 3 * o.dim * o.ffn
  local slab_bytes = (o.inference and 1 or 4) * n * 4     -- f32 copies of 3 D F
  if o.dtype == "bf16" then   -- and the bf16 compute copy (padded: a slab is whole f32 elements)
    slab_bytes = (slab_bytes + 2 * n + 3) // 4 * 4
  end
  local slot_bytes = (slab_bytes + 63) // 64 * 64
  local slots = math.min(o.budget // slot_bytes, o.layers * o.experts)
  if slots < 1 then
    local a, b = size(o.budget), size(slot_bytes)
    if a == b then a, b = o.budget .. " B", slot_bytes .. " B" end   -- one byte short reads alike rounded
    errors.user(string.format("--expert-budget %s is smaller than one expert (%s: %s)", a, b,
                              o.inference and "its parameters" or o.dtype == "bf16" and
                              "its f32 masters, gradients and AdamW states and its bf16 copy" or
                              "its parameters, gradients and AdamW states"))
  end
  return slots, slot_bytes, slab_bytes
end

-- expert_store.new's options (moelua.options.check's spec). USER: what
-- nn.Transformer's `store` option takes (the model gives the rest).
local OPTIONS = {path = {"string", false}, budget = {"integer", min = 1}, layers = {"integer", min = 1},
                 experts = {"integer", min = 1}, dim = {"integer", min = 1}, ffn = {"integer", min = 1},
                 prefetch = {"integer", false, min = 0}, inference = {"boolean", false},
                 dtype = {"string", false}, device = {"string", false}}
expert_store.USER = {path = true, budget = true, prefetch = true, inference = true}
local USER_OPTIONS = {}
for k in pairs(expert_store.USER) do USER_OPTIONS[k] = OPTIONS[k] end

-- expert_store.check_options(o, fn, level [, prefix]) -> o with integers as
-- such: an unknown key, a wrong type, a missing or non-positive size (a
-- negative prefetch) is an error "fn: ..." at `level` (the caller's
-- caller's line for level 3; 0: no position); prefix names the keys
-- ("store." for the model's option), and only USER keys are known with it.
function expert_store.check_options(o, fn, level, prefix)
  -- level + 2: past this closure and options.check
  local function fail(fmt, ...) error(fn .. ": " .. string.format(fmt, ...), level > 0 and level + 2 or 0) end
  local r = options.check(o, prefix and USER_OPTIONS or OPTIONS, fail, prefix)
  return r   -- not a tail call: `level` counts this function
end

-- es = expert_store.new{...}: checked (expert_store.check) before the
-- store's file is made; the errors name the recipe's options
-- (--expert-budget, --expert-store).
function expert_store.new(o)
  o = expert_store.check_options(o, "moelua.expert_store.new", 3)
  local L, E, D, F = o.layers, o.experts, o.dim, o.ffn
  local dtype, device = o.dtype or "f32", o.device or "cpu"
  if dtype ~= "f32" and (dtype ~= "bf16" or device ~= "cuda" or o.inference) then
    error(string.format("moelua.expert_store.new: dtype %s: the store holds f32 experts, or bf16 ones " ..
                        "with f32 masters for training on cuda (got device %s%s)", tostring(dtype), device,
                        o.inference and ", inference" or ""), 2)
  end
  local slots, slot_bytes, slab_bytes = expert_store.check(o)
  local b = 3 * D * F * 4   -- a slab's parameters (f32), then gradients and AdamW's two states
  local category = o.inference and "params" or {params = b, grads = b, optim = 2 * b}
  if dtype == "bf16" then   -- (the masters are optimizer state, as in moelua.zero)
    category = {params = slab_bytes - 4 * b, grads = b, optim = 3 * b}
  end
  local ok, s = pcall(store.open, {device = device, path = device == "cpu" and o.path or nil,
                                   slabs = L * E, slab_bytes = slab_bytes, slots = slots,
                                   prefetch = o.prefetch or 2, category = category})
  if not ok then
    if mem.planning() then error(s, 0) end   -- (in a plan only a budget refuses: train.plan's to report)
    errors.user((device == "cpu" and "--expert-store: " or "--expert-budget: ") ..
                tostring(s):gsub("^moelua%.store%.open: ", ""))
  end
  local self = setmetatable({s = s, L = L, E = E, D = D, F = F, n = 3 * D * F, slots = slots, slot_bytes = slot_bytes,
                             inference = o.inference, dtype = dtype, views_of = {}, touched = {}, sumsq = {}, steps = {},
                             routed = {}, queued = {}, updated = {}}, ES)
  return self
end

-- The slab of expert e of layer l (both 0-based); out of range is an
-- error at error()'s `level`: by default 3, the line that called the
-- method asking (acquire, release, fill, with; edit_params passes its own).
function ES:slab(l, e, level)
  if math.type(l) ~= "integer" or l < 0 or l >= self.L or math.type(e) ~= "integer" or e < 0 or e >= self.E then
    error(string.format("moelua.expert_store: no expert (layer %s, expert %s): layers 0..%d, experts 0..%d",
                        tostring(l), tostring(e), self.L - 1, self.E - 1), level or 3)
  end
  return l * self.E + e
end

-- v.compute rounded from v.params (mixed precision; nothing with f32).
local function round_compute(v)
  if v.compute then v.compute:copy_(v.params) end
end

-- The views of slot i (made once): the expert's parameters, gradients and
-- states, each 3 D F elements, and the weight matrices the kernels take
-- (of the bf16 compute copy after the four, with dtype "bf16").
function ES:views(i)
  local v = self.views_of[i]
  if v then return v end
  local t, n, D, F = self.s:slot(i), self.n, self.D, self.F
  local w = t
  v = {params = t:view_at(0, {n})}
  if self.dtype == "bf16" then
    v.compute = self.s:slot(i, "bf16"):view_at(8 * n, {n})   -- (bf16 elements after 4 n f32 ones)
    w = v.compute
  end
  v.gate_up, v.down = w:view_at(0, {2 * F, D}), w:view_at(2 * F * D, {D, F})
  if not self.inference then
    v.grads, v.exp_avg, v.exp_avg_sq = t:view_at(n, {n}), t:view_at(2 * n, {n}), t:view_at(3 * n, {n})
    v.dgate_up, v.ddown = t:view_at(n, {2 * F, D}), t:view_at(n + 2 * F * D, {D, F})
  end
  self.views_of[i] = v
  return v
end

-- The views of expert e of layer l, resident and pinned; its queued
-- updates (step) run first, in order.
function ES:acquire(l, e)
  local slab = self:slab(l, e)
  local v = self:views((self.s:acquire(slab)))
  local q = self.queued[slab]
  if q then
    self.queued[slab] = nil
    for _, u in ipairs(q) do
      if u.coef < 1 then C.scale_(v.grads, u.coef) end
      u.hp.step = u.step
      C.adamw_step(v.params, v.grads, v.exp_avg, v.exp_avg_sq, u.hp)
      v.grads:zero_()
    end
    round_compute(v)   -- (once: nothing reads the copy between the updates)
    self.updated[slab] = true
  end
  return v
end

-- Unpin expert e of layer l; dirty: the caller wrote its slot (an update
-- that ran at its acquire makes it dirty too).
function ES:release(l, e, dirty)
  local slab = self:slab(l, e)
  self.s:release(slab, dirty or self.updated[slab] or false)
  self.updated[slab] = nil
end

-- es:with(l, e, dirty, fn) -> fn's results: fn(v) with expert e of layer l
-- acquired, then released (dirty: fn wrote its slot) also when fn raises,
-- so a Ctrl-C or a NaN in a kernel leaves no slot pinned (with one slot,
-- the save that follows would find none free).
function ES:with(l, e, dirty, fn, level)
  self:slab(l, e, level or 3)   -- (checked here: an error names with's caller, or edit_params')
  local r = table.pack(pcall(fn, self:acquire(l, e)))
  self:release(l, e, dirty)
  if not r[1] then error(r[2], 0) end
  return table.unpack(r, 2, r.n)
end

-- es:fill(l, e, fn): expert e of layer l starts as fn(v) writes v.params
-- (the rest zero), written straight to its slab (before the first step).
function ES:fill(l, e, fn)
  local v = self:views(0)
  if not self.inference then v.grads:zero_(); v.exp_avg:zero_(); v.exp_avg_sq:zero_() end
  fn(v)
  round_compute(v)
  self.s:write(0, self:slab(l, e))
end

-- es:edit_params(l, e, fn): fn(v) with expert e of layer l resident, where
-- fn writes v.params (and may write its states): a load. The slab is then
-- dirty, and its compute copy rounded from the new parameters, also when
-- fn raises (so what the kernels read is what the slab holds).
function ES:edit_params(l, e, fn)
  self:with(l, e, true, function(v)
    local ok, err = pcall(fn, v)
    round_compute(v)
    if not ok then error(err, 0) end
  end, 4)
end

-- Layer l's forward has routed: `has` = {[e] = true} for its experts with
-- tokens. The store's schedule becomes the order the step will touch the
-- slabs in from here on: layer l's experts, the later layers' (taken
-- whole), then backward from the last layer down (as routed; a
-- checkpointed layer's forward in backward routes again but runs no expert:
-- moelua.moe's route_only).
function ES:routed_layer(l, has)
  local seq, E = {}, self.E
  local function layer(i, which)
    for e = 0, E - 1 do
      if not which or which[e] then seq[#seq + 1] = i * E + e end
    end
  end
  if self.inference then   -- no backward, no step: this layer's order, LRU beyond it
    layer(l, has)
    self.s:schedule(seq)
    return
  end
  self.routed[l] = has
  layer(l, has)
  for i = l + 1, self.L - 1 do layer(i) end
  for i = self.L - 1, 0, -1 do layer(i, i <= l and self.routed[i] or nil) end
  self.s:schedule(seq)
end

-- After an expert's backward: its gradient is dirty until the step; in the
-- last micro-batch it is final, scaled and its squares summed.
function ES:after_backward(l, e, v, scale)
  local slab = self:slab(l, e)
  self.touched[slab] = true
  if scale then self:_finish(slab, v, scale) end
end

function ES:_finish(slab, v, scale)
  if scale ~= 1 then C.scale_(v.grads, scale) end
  self.sumsq[slab] = {C.grad_sumsq({v.grads:narrow(1, 1, 2 * self.F * self.D)}),
                      C.grad_sumsq({v.grads:narrow(1, 2 * self.F * self.D + 1, self.D * self.F)})}
end

-- After the last micro-batch: the experts whose gradient an earlier
-- micro-batch made and the last did not finish (scale as there).
function ES:finish_grads(scale)
  for slab = 0, self.L * self.E - 1 do   -- (in slab order: the same I/O every run)
    if self.touched[slab] and not self.sumsq[slab] then
      local l, e = slab // self.E, slab % self.E
      self:_finish(slab, self:acquire(l, e), scale)
      self:release(l, e, true)
    end
  end
end

-- The squares of layer l's experts' gradients, in the order of its unit's
-- layout (every expert's gate_up, then every expert's down: the parts the
-- resident unit's norm sums), 0 for an expert without gradient.
function ES:grad_sumsq_parts(l)
  local out, E = {}, self.E
  for k = 1, 2 do
    for e = 0, E - 1 do
      local p = self.sumsq[l * E + e]
      out[#out + 1] = p and p[k] or 0
    end
  end
  return out
end

-- Gradients back to zero without a step (a skipped step): the experts
-- that have one.
function ES:zero_grads()
  for slab = 0, self.L * self.E - 1 do
    if self.touched[slab] then
      local l, e = slab // self.E, slab % self.E
      self:acquire(l, e).grads:zero_()
      self:release(l, e, true)
    end
  end
  self.touched, self.sumsq = {}, {}
end

-- The optimizer's step (AdamW, after opt:step): every expert of every
-- layer gets its update queued (the header: it runs at the expert's next
-- acquire): gradient times coef (a clip, when < 1), then AdamW like the
-- resident unit's groups (attrs: the experts group's weight_decay,
-- lr_mult, frozen; opt: the optimizer), the gradient zeroed. Lazy Adam
-- (attrs.experts): only active experts (masks[l + 1], u8 [E]), each with
-- its own step count. The gradients of the experts not updated (frozen,
-- inactive) are zeroed now.
function ES:step(opt, lr, coef, attrs, masks)
  if opt.kind ~= "AdamW" then
    errors.user("--expert-budget: the expert store updates its experts with AdamW (the optimizer is " ..
                tostring(opt.kind) .. ")")
  end
  local o, E = opt.opts, self.E
  local hp = {lr = lr * (attrs.lr_mult or 1), beta1 = o.beta1, beta2 = o.beta2, eps = o.eps,
              weight_decay = attrs.weight_decay or o.weight_decay}
  if not attrs.frozen then
    for l = 0, self.L - 1 do
      local active = attrs.experts and masks[l + 1]:totable()
      for e = 0, E - 1 do
        if not active or active[e + 1] ~= 0 then
          local slab, step = self:slab(l, e), opt.t
          if active then
            self.steps[slab] = (self.steps[slab] or 0) + 1
            step = self.steps[slab]
          end
          local q = self.queued[slab] or {}
          q[#q + 1] = {hp = hp, coef = coef, step = step}
          self.queued[slab] = q
          self.touched[slab] = nil
        end
      end
    end
  end
  self:zero_grads()   -- what was not updated (frozen, inactive)
end

function ES:stats() return self.s:stats() end

function ES:close() self.s:close() end

return expert_store
