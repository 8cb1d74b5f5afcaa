-- moelua.zero: where each flat unit's parameters, gradients and optimizer
-- states live on the ranks of a data-parallel group (ZeRO stages 0-3), and
-- the unit lifecycle the model walks (DESIGN.md, Parameters: flat units;
-- One training step; Distribution).
--
--   local z = zero.new{stage = 3, prefetch = 1, reduce_every = "micro", ep = 2}   -- rank, world: moelua.dist
--   local model = nn.Transformer.new{..., zero = z}                        -- one process: zero.new{}
--
-- A unit of n elements is cut into world equal shards of s = ceil(n / world)
-- elements (moelua.unit's partition; the last shards are padded); rank r
-- owns [r s, r s + s). Per stage, on each rank:
--
--   stage  parameters                 gradients                      optimizer states
--     0    whole                      whole, all-reduced             whole
--     1    whole                      whole, reduce-scattered into   the shard
--                                     this rank's slice of it
--     2    whole                      the shard (+ one unit's whole  the shard
--                                     gradient during its backward)
--     3    the shard (+ the units in  as stage 2                     the shard
--          use, gathered just in time)
-- (With reduce_every "step", stages 2-3 keep whole gradients as stage 1
-- does and reduce them once per step.)
--
-- Lifecycle (the model calls it; one process at stage 0 does nothing):
-- z:begin(phase, units) names the order of a forward or backward, z:acquire(u)
-- before a unit is used (ZeRO-3 all-gathers it, waiting for a prefetch, then
-- prefetches the next `prefetch` units of the order), z:release(u) after
-- (ZeRO-3 returns the gathered bytes: a view used later is an error naming
-- the unit), z:after_backward(u) once u's gradient of a micro-batch is final
-- (ZeRO-2/3 with reduce_every "micro": reduce-scatter into the shard, then
-- the whole gradient is returned). Gathered parameters and the whole
-- gradients of stages 2-3 (reduction buckets) are charged to the ledger's
-- `comm` while held.
--
-- Expert parallelism (ep > 1, DESIGN.md Distribution): the ranks form
-- world / ep expert-parallel groups of ep consecutive ranks (z.ep_group;
-- rank r is z.ep_rank = r % ep in its group and holds experts
-- [ep_rank E/ep, (ep_rank + 1) E/ep) of every block) and ep
-- expert-data-parallel groups of the world / ep ranks that hold the same
-- experts (z.edp_group). Dense units shard over the world, experts units
-- (of the E/ep local experts) over the expert-data-parallel group: each
-- unit's collectives run on its own group (u.group, u.world, u.rank).
--
-- Mixed precision (dtype "bf16", DESIGN.md Numerics): a unit's params are
-- the bf16 compute copy the kernels read; its gradients, AdamW states and
-- u.master, the f32 master weights, are f32 and cover the optimizer's range
-- (whole at stage 0, the shard above). The optimizer steps the masters and
-- rounds them into the compute copy (its groups' `compute`); a load does
-- that in Zero:gather_params(true). Checkpoints hold the masters. With
-- `offload` (the optimizer keeps its states off the device: moelua.optim's
-- offload, DeepSpeed's offload_optimizer) the masters live in host memory
-- (the cpu book, under optim) and the optimizer stages them to the device
-- chunk by chunk.
--
-- Every reduction is moelua.dist's (a sum in rank order), so stages 0-3 at
-- one world size give bitwise equal parameters (with reduce_every "micro"
-- and accumulation > 1, stages 2-3 sum micro-batches after ranks; "step"
-- keeps stage 0-1's order). The gradient norm is a sum over ranks in rank
-- order of each rank's shard's squares, at every stage.
local tensor = require "moelua.tensor"
local mem = require "moelua.mem"
local dist = require "moelua.dist"
local errors = require "moelua.errors"
local options = require "moelua.options"
local C = require "moelua.optim_c"
local now = require("moelua.bench").now

local zero = {}

-- The dtype of gradients, optimizer states and masters for parameters of dtype dt.
function zero.grad_dtype(dt) return dt == "bf16" and "f32" or dt end

local Zero = {}
Zero.__index = Zero

local OPTIONS = {stage = {"integer", 0, min = 0}, prefetch = {"integer", 1, min = 0},
                 reduce_every = {"string", "micro"}, ep = {"integer", 1, min = 1}, offload = {"boolean", false}}

local function fail(fmt, ...) errors.user("moelua.zero.new: " .. string.format(fmt, ...)) end

-- z = zero.new{stage = 0..3, prefetch = N >= 0, reduce_every = "micro"|"step",
-- ep = expert-parallel size (divides the world; the model checks that it
-- divides the experts), offload = false (bf16's masters in host memory)}:
-- checked before anything is allocated (a recipe's options are checked
-- before they come here; --ep's division, which needs the world, names
-- the recipe's option).
function zero.new(o)
  o = options.check(o, OPTIONS, fail)
  local stage, prefetch, every, ep = o.stage, o.prefetch, o.reduce_every, o.ep
  if stage > 3 then fail("option 'stage' must be 0, 1, 2 or 3, got %d", stage) end
  if every ~= "micro" and every ~= "step" then
    fail("option 'reduce_every' must be \"micro\" or \"step\", got %q", every)
  end
  if dist.launched() and not dist.initialized() then
    errors.user("moelua.zero.new: launched by mpiexec: call moelua.dist.init first (the ranks are not known yet)")
  end
  local rank, world = dist.rank(), dist.world()
  if world % ep ~= 0 then
    errors.user(string.format("--ep %d: the expert-parallel size must divide the number of ranks (%d)", ep, world))
  end
  local z = setmetatable({
    stage = stage, prefetch = prefetch, reduce_every = every, dist = dist, offload = o.offload,
    rank = rank, world = world, ep = ep, ep_rank = rank % ep,
    -- stages 2-3 reduce each unit right after its backward ("micro")
    per_unit = stage >= 2 and every == "micro",
    units = {}, order = {}, pos = {}, pending = {}, waits = {}, sent = 0,
  }, Zero)
  if world > 1 then z.world_group = dist.world_group() end
  if ep > 1 and dist.planned() then   -- moelua plan --world: the groups' shapes, no split
    z.ep_group = dist.planned_group(rank % ep, ep, "expert-parallel")
    z.edp_group = dist.planned_group(rank // ep, world // ep, "expert-data-parallel")
  elseif ep > 1 then   -- every rank splits, in the same order
    z.ep_group = dist.split(rank // ep, rank, "expert-parallel")
    z.edp_group = dist.split(rank % ep, rank, "expert-data-parallel")
  end
  return z
end

-- The group an experts unit or a dense unit is sharded over, with this
-- rank's place in it (group nil: one rank).
function Zero:_group_of(kind)
  if kind == "experts" and self.ep > 1 then
    return self.edp_group, self.rank // self.ep, self.world // self.ep
  end
  return self.world_group, self.rank, self.world
end

-- A unit's shard of a flat buffer: elements [offset, offset + shard).
local function shard_of(u, flat) return flat:view_at(u.part.offset, {u.part.shard}) end

local function released(u, what)
  return string.format("unit %s is released (ZeRO-3 holds its %s only while in use)", u.name, what)
end

-- u = z:unit(name, kind, layout, {dtype =, device =, init = function(params)})
-- where layout is a moelua.unit; init fills the unit's whole parameters
-- (a view of n elements), the same on every rank. Returns {name, kind,
-- layout, numel, part, params, grads [, shard_params, shard_grads]}:
-- params and grads are the whole buffers (padded) that module views point
-- into; at stage 3, params holds memory only between acquire and release.
-- With dtype "bf16", u.master too (the header).
function Zero:unit(name, kind, layout, o)
  local group, rank, world = self:_group_of(kind)
  local n, part = layout:numel(), layout:partition(rank, world)
  local u = {name = name, kind = kind, layout = layout, numel = n, part = part,
             group = group, rank = rank, world = world}
  local dt = {dtype = o.dtype, device = o.device}
  local gdt = {dtype = zero.grad_dtype(o.dtype), device = o.device}
  local function zeros(cat, count, d) return mem.scope(cat, tensor.zeros, {count}, d or dt) end
  local init = o.init
  if gdt.dtype ~= dt.dtype then   -- drawn whole in f32 (the masters at stage 0), rounded into params
    local mdt = self.offload and {dtype = gdt.dtype, device = "cpu"} or gdt
    u.master = zeros("optim", self.stage == 0 and part.padded or part.shard, mdt)
    init = function(params)
      local whole = self.stage == 0 and u.master or zeros("comm", part.padded, gdt)
      o.init(whole:view_at(0, {n}))
      params:copy_(whole:view_at(0, {n}))
      if whole ~= u.master then
        u.master:copy_(shard_of(u, whole))
        whole:free()
      end
    end
  end
  if self.stage < 3 then
    u.params = zeros("params", part.padded)
    init(u.params:view_at(0, {n}))
  else   -- drawn whole (one unit at a time), then only the shard is kept
    u.shard_params = zeros("params", part.shard)
    u.params = zeros("comm", part.padded)
    init(u.params:view_at(0, {n}))
    u.shard_params:copy_(shard_of(u, u.params))
    u.params:release_storage(released(u, "parameters"))
  end
  -- per unit, the whole gradient is a reduction bucket held only during the
  -- unit's backward (ledger `comm`), the shard is the gradient kept
  u.grads = zeros(self.per_unit and "comm" or "grads", part.padded, gdt)
  if self.per_unit then
    u.shard_grads = zeros("grads", part.shard, gdt)
    u.grads:release_storage(released(u, "whole gradient"))
  elseif self.stage >= 1 then   -- reduced in place, into this rank's slice of the whole
    u.shard_grads = shard_of(u, u.grads)
  end
  self.units[#self.units + 1] = u
  return u
end

-- u = z:stored_unit(name, layout, es, layer): an experts unit whose
-- parameters, gradients and AdamW states live in the expert store es
-- (moelua.expert_store) as layer `layer` of it: no buffer here, no
-- optimizer group (the store updates its experts: step), its gradient
-- norm's parts from the store. One process only, for now.
function Zero:stored_unit(name, layout, es, layer)
  self:check_store()
  local u = {name = name, kind = "experts", layout = layout, numel = layout:numel(),
             part = layout:partition(0, 1), rank = 0, world = 1, stored = es, layer = layer}
  self.units[#self.units + 1] = u
  self.expert_store = es
  return u
end

-- An expert store needs one process at stage 0 (an error otherwise).
function Zero:check_store()
  if self.world > 1 or self.stage > 0 then
    errors.user(string.format("--expert-budget: the expert store is not built for sharded training yet " ..
                              "(--zero %d on %d rank%s): use it with one process at --zero 0", self.stage, self.world,
                              self.world == 1 and "" or "s"))
  end
end

-- ---- the lifecycle ----------------------------------------------------------

function Zero:begin(phase, units)
  self.phase, self.order, self.pos = phase, units, {}
  for i, u in ipairs(units) do self.pos[u] = i end
end

-- ZeRO-3: start gathering u's parameters (its storage taken now).
function Zero:_gather(u, blocking)
  if not u.params:storage_released() or self.pending[u] then return end
  u.params:acquire_storage()
  local what = "unit " .. u.name
  if u.world == 1 then
    u.params:copy_(u.shard_params)
  elseif blocking then
    self:_timed("all_gather", u.group.all_gather, u.group, u.shard_params, u.params, what)
  else
    self.pending[u] = u.group:iall_gather(u.shard_params, u.params, what)
  end
end

-- ZeRO-3: u's parameters whole, from its prefetch or gathered now.
function Zero:_ready(u)
  local req = self.pending[u]
  if req then
    self.pending[u] = nil
    self:_timed("all_gather", req.wait, req)
  else
    self:_gather(u, true)
  end
end

function Zero:acquire(u)
  if self.stage == 3 then
    self:_ready(u)
    local at = self.pos[u]
    for k = 1, at and self.prefetch or 0 do
      local nxt = self.order[at + k]
      if nxt then self:_gather(nxt, false) end
    end
  end
  if self.per_unit and self.phase == "backward" and u.grads:storage_released() then
    u.grads:acquire_storage()
    u.grads:zero_()
  end
end

function Zero:release(u)
  if self.stage == 3 and not u.params:storage_released() then
    local req = self.pending[u]   -- a prefetch still in flight completes first
    if req then self.pending[u] = nil; self:_timed("all_gather", req.wait, req) end
    u.params:release_storage(released(u, "parameters"))
  end
end

function Zero:after_backward(u)
  if self.per_unit then
    if u.world == 1 then
      u.shard_grads:add_(u.grads)
    else
      self:_timed("reduce_scatter", u.group.reduce_scatter, u.group, u.grads, u.shard_grads,
                  "gradient of unit " .. u.name, true)
    end
    u.grads:release_storage(released(u, "whole gradient"))
  end
  self:release(u)
end

-- z:edit(u, fn): fn() writes u's whole parameters outside a step (a
-- recipe's reinit); at stage 3 the shard then takes them, and the masters
-- their range of them.
function Zero:edit(u, fn)
  if self.stage == 3 then self:_ready(u) end
  fn()
  if self.stage == 3 then u.shard_params:copy_(shard_of(u, u.params)) end
  if u.master then u.master:copy_(self.stage == 0 and u.params or shard_of(u, u.params)) end
  self:release(u)
end

-- Gradients to zero (the start of a step, or a skipped step).
function Zero:zero_grad()
  for _, u in ipairs(self.units) do
    if u.stored then
      u.stored:zero_grads()
    else
      if not u.grads:storage_released() then u.grads:zero_() end
      if self.per_unit then u.shard_grads:zero_() end   -- otherwise a slice of grads
    end
  end
end

-- Before each micro-batch's backward: whether it is the step's last, with
-- the gradients' scale (1 / micro-batches of all ranks): an expert store
-- finishes each expert's gradient at its last backward use then.
function Zero:begin_backward(last, scale)
  if self.expert_store then self.expert_store.final_scale = last and scale or nil end
end

-- ---- collectives ------------------------------------------------------------

-- z.waits: seconds this rank spent in each kind of collective (all_gather,
-- reduce_scatter, all_reduce, numbers) since take_waits(); on one host
-- most of it is waiting for the slowest rank.
function Zero:_timed(kind, fn, ...)
  local t0 = now()
  local r = fn(...)
  self.waits[kind] = (self.waits[kind] or 0) + now() - t0
  return r
end

function Zero:take_waits()
  local w = self.waits
  self.waits = {}
  return w
end

-- A few numbers summed (in rank order) or maxed over the ranks.
function Zero:all_reduce_numbers(v, op, what)
  return self:_timed("numbers", self.dist.all_reduce_numbers, v, op, what)
end

local ELEMENT_BYTES = {f32 = 4, f64 = 8, bf16 = 2, f16 = 2, i32 = 4, i64 = 8, u8 = 1}

-- Expert parallelism's exchange: rows of send to the ranks of this rank's
-- expert-parallel group (send_rows / recv_rows: one count per rank of the
-- group), timed under "all_to_all"; z.sent counts the bytes that left
-- this rank (rows to itself excluded) since take_sent().
function Zero:all_to_all(send, send_rows, recv, recv_rows, what)
  local row = send:size(1) > 0 and send:numel() // send:size(1) or 0
  for d, n in ipairs(send_rows) do
    if d ~= self.ep_rank + 1 then self.sent = self.sent + n * row * ELEMENT_BYTES[send:dtype()] end
  end
  return self:_timed("all_to_all", self.ep_group.all_to_all_v, self.ep_group, send, send_rows, recv,
                     recv_rows, what)
end

-- shard gathered from every rank of the world into full (rank order).
function Zero:all_gather(shard, full, what)
  return self:_timed("all_gather", self.world_group.all_gather, self.world_group, shard, full, what)
end

function Zero:take_sent()
  local n = self.sent
  self.sent = 0
  return n
end

-- Every rank's values[k] for k in keys (0 where absent), as {[rank + 1] =
-- {[k] = value}}: one sum over ranks of vectors in which each rank fills
-- only its own slots.
function Zero:gather_numbers(values, keys, what)
  local mine = {}
  for r = 0, self.world - 1 do
    for i, k in ipairs(keys) do mine[r * #keys + i] = r == self.rank and (values[k] or 0) or 0 end
  end
  local all = self:all_reduce_numbers(mine, "sum", what)
  local out = {}
  for r = 0, self.world - 1 do
    local one = {}
    for i, k in ipairs(keys) do one[k] = all[r * #keys + i] end
    out[r + 1] = one
  end
  return out
end

-- ---- the step ---------------------------------------------------------------

-- After the last micro-batch: every gradient summed over its unit's ranks
-- (whole at stage 0, into the shard at 1-3) and scaled by `scale` (1 / the
-- number of micro-batches of all ranks). An expert's gradient already holds
-- the tokens of its expert-parallel group, so summing it over the
-- expert-data-parallel group covers every rank's tokens once.
function Zero:reduce_grads(scale)
  for _, u in ipairs(self.units) do
    local what = "gradient of unit " .. u.name
    local g = u.grads
    if u.stored then   -- scaled expert by expert as each became final
      u.stored:finish_grads(scale)
    elseif self.stage == 0 then
      if u.world > 1 then self:_timed("all_reduce", u.group.all_reduce, u.group, g, what) end
    else
      if not self.per_unit and u.world > 1 then   -- (per unit: after each unit's backward)
        self:_timed("reduce_scatter", u.group.reduce_scatter, u.group, g, u.shard_grads, what)
      end
      g = u.shard_grads
    end
    if scale ~= 1 and not u.stored then C.scale_(g, scale) end
  end
end

-- The groups' ranges of unit u over [off, off + len): consecutive segments
-- with one group label merged (moelua.unit pieces), as {group, unit offset, n}.
local function ranges(u, off, len)
  local out = {}
  if len <= 0 then return out end
  for _, p in ipairs(u.layout:pieces(off, len)) do
    local g = u.groups[p.segment]
    local last = out[#out]
    if last and last.group == g and last.offset + last.n == p.offset then
      last.n = last.n + p.n
    else
      out[#out + 1] = {group = g, offset = p.offset, n = p.n, segment = p.segment,
                       seg_start = p.offset - p.seg_offset}
    end
  end
  return out
end

-- A range of a per-expert segment (one per label) cut at its experts'
-- boundaries: {offset, n, expert (0-based)}. The expert's slice is S
-- elements from seg_start + expert * S.
local function by_expert(r, S)
  local out, lo = {}, r.offset
  while lo < r.offset + r.n do
    local e = (lo - r.seg_start) // S
    local hi = math.min(r.offset + r.n, r.seg_start + (e + 1) * S)
    out[#out + 1] = {offset = lo, n = hi - lo, expert = e}
    lo = hi
  end
  return out
end

-- Optimizer groups in moelua.optim's format for the units, from each
-- unit's u.groups (segment name -> {name, weight_decay, lr_mult, frozen,
-- experts}, set by the model): stage 0 over the whole buffers, stages 1-3
-- over this rank's shard, AdamW's states as views of the unit's flat
-- state buffers. A lazy-Adam group (experts = E) of a shard, which may cut
-- experts anywhere, becomes one group per expert slice (experts = 1;
-- group_at[i].expert says which expert, for its activity mask and step
-- count). z.group_at[i] = {unit, offset (in the unit), n [, expert,
-- experts]}. AdamW's two states are one flat buffer each per unit over
-- this rank's optimizer range (whole at stage 0, the shard above),
-- reserved at the first call: address space until the optimizer commits a
-- group's (or an active expert's) slice on the CPU, allocated on CUDA.
-- With o.states == false (an optimizer that keeps its states elsewhere:
-- moelua.optim's offload) the groups carry none and nothing is reserved.
function Zero:groups(o)
  local states = not (o and o.states == false)
  local out = {}
  self.group_at = {}
  local function add(u, g, off, r, experts)
    local whole = self.stage == 0
    if states and not u.exp_avg then
      local d = {dtype = zero.grad_dtype(u.params:dtype()), device = u.params:device()}
      local n = whole and u.numel or u.part.shard
      u.exp_avg = mem.scope("optim", tensor.reserve, {n}, d)
      u.exp_avg_sq = mem.scope("optim", tensor.reserve, {n}, d)
    end
    local at = r.offset - off
    local own = whole and u.params or self.stage == 3 and u.shard_params or shard_of(u, u.params)
    local params = u.master or own   -- with masters, own is their compute copy
    out[#out + 1] = {name = g.name, params = params:view_at(at, {r.n}),
                     compute = u.master and own:view_at(at, {r.n}) or nil,
                     grads = (whole and u.grads or u.shard_grads):view_at(at, {r.n}),
                     exp_avg = states and u.exp_avg:view_at(at, {r.n}) or nil,
                     exp_avg_sq = states and u.exp_avg_sq:view_at(at, {r.n}) or nil,
                     weight_decay = g.weight_decay, lr_mult = g.lr_mult, frozen = g.frozen, experts = experts}
    self.group_at[#out] = {unit = u, offset = r.offset, n = r.n, expert = r.expert, experts = experts}
  end
  for _, u in ipairs(self.units) do
    local off, len = 0, u.stored and 0 or u.numel
    if self.stage > 0 then off, len = u.part.offset, math.max(0, math.min(u.part.shard, u.numel - u.part.offset)) end
    for _, r in ipairs(ranges(u, off, len)) do
      local g = r.group
      if g.experts and self.stage > 0 then
        local S = u.layout:segment(r.segment).numel // g.experts   -- (one segment per expert label)
        for _, piece in ipairs(by_expert(r, S)) do add(u, g, off, piece, 1) end
      else
        add(u, g, off, r, g.experts)
      end
    end
  end
  return out
end

-- mask (u8 [E], this rank's activity): with several ranks, an expert
-- active on any rank is active on all (in place). Returns mask.
function Zero:agree_active(mask, what)
  if self.world == 1 then return mask end
  local v = self:all_reduce_numbers(mask:totable(), "max", what)
  return mask:copy_(tensor.tensor(v, {dtype = "u8"}))
end

-- The parts of group i's gradient [lo, hi) (unit offsets) the norm sums:
-- cut at segment ends and, in a per-expert segment, at every expert (so
-- the experts' parts are the ones an expert store sums, expert by expert).
function Zero:_norm_parts(i, g, lo, hi, out)
  local at = self.group_at[i]
  local u = at.unit
  for _, p in ipairs(u.layout:pieces(lo, hi - lo)) do
    local seg = u.layout:segment(p.segment)
    local S = seg.experts and seg.numel // seg.experts   -- one expert's elements
    local a, b, start = p.offset, p.offset + p.n, p.offset - p.seg_offset
    while a < b do   -- up to the end of a's expert (or of the piece)
      local cut = S and math.min(b, start + ((a - start) // S + 1) * S) or b
      out[#out + 1] = g.grads:view_at(a - at.offset, {cut - a})
      a = cut
    end
  end
end

-- The global gradient norm (squares of each rank's shard, summed over
-- ranks in rank order), and the clip of every group's gradient to max_norm
-- (torch.nn.utils.clip_grad_norm_'s factor). groups: Zero:groups()'s. On
-- a rank the squares are summed part by part in unit order (f64, one
-- part after another: an expert is a part of its own), an expert store's
-- units from the store's parts; z.clip_coef is the factor applied (1: none).
function Zero:clip_grad_norm(groups, max_norm)
  local parts = {}
  for i, g in ipairs(groups) do
    if not g.frozen then
      local at = self.group_at[i]
      local u, lo, hi = at.unit, at.offset, at.offset + g.grads:numel()
      if self.stage == 0 and u.world > 1 then   -- whole gradients: count the shard's part only
        lo, hi = math.max(lo, u.part.offset), math.min(hi, u.part.offset + u.part.shard)
      end
      if hi > lo then
        parts[u] = parts[u] or {}
        self:_norm_parts(i, g, lo, hi, parts[u])
      end
    end
  end
  local sum = 0
  for _, u in ipairs(self.units) do
    if u.stored then
      if not (u.groups and u.groups.gate_up.frozen) then   -- (experts.gate_up and .down share attributes)
        for _, v in ipairs(u.stored:grad_sumsq_parts(u.layer)) do sum = sum + v end
      end
    else
      for _, t in ipairs(parts[u] or {}) do sum = sum + C.grad_sumsq({t}) end
    end
  end
  if self.world > 1 then sum = self:all_reduce_numbers({sum}, "sum", "gradient norm")[1] end
  local total = math.sqrt(sum)
  local coef = max_norm / (total + 1e-6)
  self.clip_coef = 1
  if total == total and total < math.huge and coef < 1 then
    self.clip_coef = coef
    for _, g in ipairs(groups) do
      if not g.frozen then C.scale_(g.grads, coef) end
    end
  end
  return total
end

-- After the optimizer's step (opt, at lr, with the model's per-layer
-- activity masks for lazy Adam): an expert store updates its experts
-- (with the clip of clip_grad_norm); stages 1-2 all-gather the updated shards.
function Zero:after_step(opt, lr, masks)
  for _, u in ipairs(self.units) do
    if u.stored and u.layer == 0 then   -- (one pass over every layer's experts)
      u.stored:step(opt, lr, self.clip_coef or 1, u.groups and u.groups.gate_up or {}, masks)
    end
  end
  if self.stage == 1 or self.stage == 2 then self:gather_params() end
end

-- Mixed precision: u's compute parameters over its masters' range, rounded from them.
function Zero:_from_master(u)
  if not u.master then return end
  local dst = self.stage == 0 and u.params or self.stage == 3 and u.shard_params or shard_of(u, u.params)
  dst:copy_(u.master)
end

-- Every rank's whole parameters from each rank's shard (stages 0-2). After
-- a load (`loaded`: a sharded checkpoint load reads only the shards, and
-- only into the masters where there are some) the compute copies are first
-- rounded from the masters; at stage 0 the masters, whole on every rank,
-- are what is gathered, and rounded after.
function Zero:gather_params(loaded)
  for _, u in ipairs(self.units) do
    local whole = loaded and self.stage == 0 and u.master
    if loaded and not whole then self:_from_master(u) end
    if self.stage < 3 and u.world > 1 then
      local flat = whole or u.params
      local mine = mem.scope("comm", shard_of(u, flat).clone, shard_of(u, flat))
      self:_timed("all_gather", u.group.all_gather, u.group, mine, flat, "parameters of unit " .. u.name)
      mine:free()
    end
    if whole then self:_from_master(u) end
  end
end

-- ---- checkpoints (DESIGN.md, Files and formats) ------------------------------
-- A checkpoint holds whole tensors under Hugging Face names; each rank
-- writes and reads only the elements of its own shards.

-- Where named parameter p starts in its unit (elements; its view is of the
-- masters at stage 0 with mixed precision, model:named_parameters()).
local function start_of(p)
  local u = p.unit
  local home = u.master and p.tensor:same_storage(u.master) and u.master or u.params
  return p.tensor:storage_offset() - home:storage_offset()
end

-- This rank's pieces of the named parameters (model:named_parameters():
-- {name, tensor = a view of its unit's params, unit}): {name, at (elements
-- into the named tensor), n, unit, lo (offset in the unit)}; an expert
-- store's parameter is one piece {name, at = 0, n, unit, stored, shape}.
function Zero:pieces(named)
  local out = {}
  for _, p in ipairs(named) do
    if p.stored then   -- an expert store's: whole, read and written through the store
      local n = p.shape[1] * p.shape[2]
      out[#out + 1] = {name = p.name, at = 0, n = n, unit = p.unit, stored = p.stored, shape = p.shape,
                       frozen = self:frozen(p)}
    else
      out[#out + 1] = self:_piece(p)
    end
  end
  return out
end

-- This rank's part of named parameter p (a view of its unit), or nil.
function Zero:_piece(p)
  local u, start = p.unit, start_of(p)
  local lo = math.max(start, u.part.offset)
  local hi = math.min(start + p.tensor:numel(), u.part.offset + u.part.shard)
  if hi > lo then
    return {name = p.name, at = lo - start, n = hi - lo, unit = u, lo = lo, frozen = self:frozen(p)}
  end
end

-- A piece's parameters on this rank (a view of the shard at stage 3; of
-- the f32 masters with mixed precision).
function Zero:param_view(pc)
  local u = pc.unit
  if u.master then return u.master:view_at(self.stage == 0 and pc.lo or pc.lo - u.part.offset, {pc.n}) end
  if self.stage == 3 then return u.shard_params:view_at(pc.lo - u.part.offset, {pc.n}) end
  return u.params:view_at(pc.lo, {pc.n})
end

-- The optimizer group (Zero:groups()'s index) holding a piece, and the
-- piece's offset in it.
function Zero:group_of(pc)
  for i, at in ipairs(self.group_at) do
    if at.unit == pc.unit and pc.lo >= at.offset and pc.lo + pc.n <= at.offset + at.n then
      return i, pc.lo - at.offset
    end
  end
end

-- Where a piece's optimizer states are: its group (Zero:groups()'s index),
-- its expert in that group (1-based; nil in a dense group) and its offset
-- in the state tensor (the group's, or that expert's).
function Zero:state_slot(pc)
  local gi, off = self:group_of(pc)
  local at = self.group_at[gi]
  if not at.experts then return gi, nil, off end
  local S = at.n // at.experts
  local e = off // S
  return gi, e + 1, off - e * S
end

-- Is the named parameter p in a frozen group (param_groups' attributes)?
-- (p.segment names the segment of another rank's expert.)
function Zero:frozen(p)
  local u = p.unit
  if not u.groups then return false end   -- before param_groups: nothing is frozen
  return u.groups[p.segment or u.layout:pieces(start_of(p), 1)[1].segment].frozen or false
end

return zero
