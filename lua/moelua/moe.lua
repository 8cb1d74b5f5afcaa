-- moelua.moe: the MoE layer as a Torch7-style class. Every number is
-- computed in C (moelua.router, moelua.experts); this module only wires the
-- router, dispatch, experts and combine together, owns the layer's memory,
-- and forms the losses' coefficients.
--
--   local moe = require "moelua.moe"
--   local layer = moe.new{dim = 512, ffn = 1408, experts = 8, topk = 2}
--   local y, stats = layer:forward(x, step)     -- x [T, dim]
--   local dx = layer:backward(dy)                -- grads land in layer.grads
--
-- Memory (DESIGN.md, Parameters and Pools): the parameters are one flat
-- buffer under `params` (wg [E, D], gate_up [E, 2F, D], down [E, D, F] are
-- views into it), the gradients one flat buffer under `grads`, and every
-- transient of a step (router outputs, the dispatch plan, saved
-- pre-activations, y, dx, scratch) is a view into the layer's own stack pool.
-- The pool is reset at the start of each forward: y and dx are valid until
-- the next forward. The first step grows the pool to what a step needs; the
-- second step's reset replaces its blocks by one block of that high-water
-- mark (host/runtime/pool.c); from then on a step makes no ledger allocation.
--
-- Device: `device = "cuda"` puts the flat buffers, the bias and the pool on
-- the GPU (x and dy must be there too); the router, dispatch and experts
-- then run their CUDA kernels. Parameters are drawn on the CPU and copied,
-- so a layer starts from the same weights on every device.
--
-- Aux loss (DESIGN.md, Numerics): by default Hugging Face's
-- load_balancing_loss_func, aux = E * sum_e (C_e/N) (P_e/N), with N the
-- tokens of all MoE layers of the micro-batch, C_e the top-k assignments
-- (counted before capacity drops) and P_e the summed routing probabilities.
-- It equals k under uniform routing; Megatron's form divides by k. The model
-- forms it from every layer's (C_e, P_e): moe.aux_loss(layers) returns the
-- loss and each layer's coefficient for backward. aux_scope = "layer"
-- averages the per-layer losses instead. The router z-loss (ST-MoE) is the
-- mean over (layer, token) of logsumexp(raw logits)^2.
--
-- Ranks (units.zero, a moelua.zero of world > 1): capacity applies per
-- expert to the count of all ranks' tokens, kept in global token order
-- (rank-major), so which assignments drop does not depend on how experts
-- are placed. With expert parallelism (zero.ep > 1) the layer holds only
-- its rank's E/ep experts (gate_up [E/ep, 2F, D], down [E/ep, D, F]; the
-- router's wg stays [E, D]) and a forward exchanges tokens over the
-- expert-parallel group (DESIGN.md, Distribution):
--   local router, counting sort over all E experts (the plan)
--   all-to-all of per-expert counts, then of the kept assignments' x rows,
--   routing weights and expert ids, in plan order (rows, never bytes)
--   the local experts on the rows received (a k = 1 plan over E/ep experts:
--   source rank ascending, then the sender's plan order), each row already
--   scaled by its weight
--   the reverse all-to-all, and the combine at the origin in plan order
--   (experts ascending per token: the order of one process's combine)
-- Backward sends dy rows the same way and brings back dx rows and dL/dw.
-- Which exchanges run never depends on routing: a rank with nothing to send
-- or receive takes part in every one. Receive buffers are sized by what
-- arrives; inside a memory plan by their bound (every token of the group to
-- this rank's experts, or the capacity of its experts when tokens drop),
-- which layer.recv_rows reports.
--
-- Expert store (units.store = {es = a moelua.expert_store, layer = l}):
-- the layer holds no expert weights; after routing it runs its experts with
-- tokens one at a time, ascending, each from the cache slot the store gives
-- it (experts.forward on one expert's tensors, adding into y), so y, dx and
-- every gradient are bitwise those of one call over resident experts.
--
-- Profile: when layer.profile is a table (a model's), forward and backward
-- add their seconds to its router, dispatch and experts fields and the
-- expert GEMMs' FLOPs to experts_flop (one bench.now() per phase).
local tensor = require "moelua.tensor"
local router = require "moelua.router"
local experts = require "moelua.experts"
local pool = require "moelua.pool"
local mem = require "moelua.mem"
local unit = require "moelua.unit"
local zero = require "moelua.zero"
local options = require "moelua.options"
local mem_planning = mem.planning
local now = require("moelua.bench").now

local moe = {}

local Layer = {}
Layer.__index = Layer

local function ones(n)
  local t = {}
  for i = 1, n do t[i] = 1 end
  return t
end

-- option = {kind, default (nil: required) [, min =]}: moelua.options.check's
local OPTIONS = {
  dim = {"integer", min = 1}, ffn = {"integer", min = 1}, experts = {"integer", min = 1}, topk = {"integer", 2},
  -- router
  chunk = {"integer", 2048, min = 1}, mode = {"string", "softmax_topk"}, renorm = {"boolean", true},
  temperature = {"number", 1.0}, eps = {"number", 0.0}, noise = {"number", 0.0, min = 0},
  gumbel = {"boolean", false}, seed = {"integer", 0}, layer = {"integer", 0},
  bias_rate = {"number", 0.0, min = 0},
  -- dispatch and experts
  capacity_factor = {"number", 0.0}, policy = {"string", "dropless"}, tile = {"integer", 256, min = 1},
  save = {"string", "save"}, partial_recompute = {"number", -1.0},
  -- losses
  aux_weight = {"number", 0.0, min = 0}, z_weight = {"number", 0.0, min = 0}, aux_scope = {"string", "model"},
  -- parameters
  dtype = {"string", "f32"}, init_std = {"number", 0.02, min = 0}, init_seed = {"integer", 0},
  device = {"string", "cpu"},
}

local function check_options(opts)
  if opts == nil then error("moelua.moe.new: options must be a table, got nil", 3) end
  -- raised at moe.new's caller: this closure, options.check, check_options, moe.new, the caller
  local o = options.check(opts, OPTIONS, function(fmt, ...) error("moelua.moe.new: " .. fmt:format(...), 5) end)
  local function need(cond, msg) if not cond then error("moelua.moe.new: " .. msg, 4) end end   -- moe.new's caller
  need(o.topk >= 1 and o.topk <= o.experts,
       string.format("option 'topk' = %d must be in 1..experts (%d)", o.topk, o.experts))
  need(o.policy == "dropless" or o.policy == "drop", "option 'policy' must be \"dropless\" or \"drop\"")
  need((o.policy == "drop") == (o.capacity_factor > 0),
       "policy \"drop\" needs capacity_factor > 0, and capacity_factor needs policy \"drop\"")
  need(o.aux_scope == "model" or o.aux_scope == "layer", "option 'aux_scope' must be \"model\" or \"layer\"")
  need(o.save == "save" or o.save == "recompute",
       string.format("option 'save' must be \"save\" or \"recompute\", got %s", o.save))
  need(o.dtype == "f32" or o.dtype == "f64" or o.dtype == "bf16", "option 'dtype' must be \"f32\", \"f64\" or \"bf16\"")
  need(o.device == "cpu" or o.device == "cuda", "option 'device' must be \"cpu\" or \"cuda\"")
  if o.device == "cuda" and not mem_planning() then   -- (a plan of a cuda run needs no GPU)
    local ok, why_not = tensor.cuda_available()
    need(ok, "option 'device' \"cuda\": no usable GPU (" .. tostring(why_not) .. ")")
  end
  need(o.dtype ~= "bf16" or o.device == "cuda",
       "option 'dtype' \"bf16\" (mixed precision) runs on cuda: the CPU's kernels are f32 and f64")
  -- the router's and the experts' own checks (ops_moe.c, l_experts.c), here before any allocation
  need(o.mode == "softmax_topk" or o.mode == "topk_softmax",
       string.format("option 'mode' must be \"softmax_topk\" or \"topk_softmax\", got %s", o.mode))
  need(o.temperature > 0, string.format("option 'temperature' must be finite and > 0, got %s", o.temperature))
  need(o.eps >= 0 and o.eps < 1, string.format("option 'eps' must be in [0, 1), got %s", o.eps))
  need(o.partial_recompute == -1 or (o.partial_recompute >= 0 and o.partial_recompute <= 1),
       string.format("option 'partial_recompute' must be in [0, 1] (-1: off), got %s", o.partial_recompute))
  return o
end

-- moe.check_options(opts): validates moe.new's options (the same errors)
-- without allocating anything, so a model can fail before its allocations.
function moe.check_options(opts)
  local o = check_options(opts)   -- not a tail call: its errors blame this function's caller, as moe.new's do
  return o
end

-- The experts' segments of the Parameters layout (DESIGN.md): gate_up
-- [E, 2F, D] (per expert the F rows of w1, then the F rows of w3) and down
-- [E, D, F], one contiguous slice per expert each. A model's experts unit
-- is these two; a stand-alone layer puts the router's wg [E, D] first.
function moe.expert_segments(E, D, F)
  return {{name = "gate_up", shape = {E, 2 * F, D}, experts = E},
          {name = "down", shape = {E, D, F}, experts = E}}
end

-- The layer's parameters as given views ({wg, gate_up, down} of params and
-- of grads, checked against the options), so a model can place them in its
-- own flat units (DESIGN.md: the router in the block's dense unit, gate_up
-- and down in its experts unit).
local function check_views(views, what, o, El, router_only, dtype)
  local want = {wg = {o.experts, o.dim}, gate_up = not router_only and {El, 2 * o.ffn, o.dim} or nil,
                down = not router_only and {El, o.dim, o.ffn} or nil}
  for name, shape in pairs(want) do
    local t = views[name]
    if not tensor.is_tensor(t) then
      error(string.format("moelua.moe.new: %s.%s must be a tensor, got %s", what, name, type(t)), 4)
    end
    local got = t:shape()
    if table.concat(got, ",") ~= table.concat(shape, ",") or t:dtype() ~= dtype or t:device() ~= o.device then
      error(string.format("moelua.moe.new: %s.%s is [%s] %s %s, expected [%s] %s %s", what, name,
                          table.concat(got, ","), t:dtype(), t:device(), table.concat(shape, ","),
                          dtype, o.device), 4)
    end
  end
  return views
end

-- layer = moe.new(opts [, units]): units = {params = {wg =, gate_up =, down =},
-- grads = {...}} are views the caller owns (and initialises); without
-- units the layer allocates one flat buffer of each and draws the weights.
-- units.zero (optional) is the model's moelua.zero: its ranks share
-- capacity and, with ep > 1, the experts (gate_up and down then hold the
-- rank's E/ep experts).
-- units.pool (optional) is a stack pool the caller owns (a model's): the
-- layer then never resets it; the caller marks and rewinds around forward
-- and backward (LIFO), and outputs live until the caller rewinds.
function moe.new(opts, units)
  local o = check_options(opts)
  local E, D, F = o.experts, o.dim, o.ffn
  local self = setmetatable({opts = o}, Layer)
  local z = units and units.zero
  if z and z.world > 1 then self.zero = z end
  if z and z.ep > 1 then
    if E % z.ep ~= 0 then
      error(string.format("moelua.moe.new: --ep %d must divide the number of experts (%d)", z.ep, E), 2)
    end
    self.ep = z
  end
  self.local_experts = E // (self.ep and self.ep.ep or 1)
  self.store = units and units.store
  local gdt = zero.grad_dtype(o.dtype)   -- (f32 for bf16: mixed precision)
  if self.store then
    self.params = {wg = check_views({wg = units.params.wg}, "units.params", o, 0, true, o.dtype).wg}
    self.grads = {wg = check_views({wg = units.grads.wg}, "units.grads", o, 0, true, gdt).wg}
  elseif units then
    self.params = check_views(units.params or {}, "units.params", o, self.local_experts, false, o.dtype)
    self.grads = check_views(units.grads or {}, "units.grads", o, self.local_experts, false, gdt)
  else
    local layout = unit.new("moe", {{name = "wg", shape = {E, D}}, table.unpack(moe.expert_segments(E, D, F))})
    local n = layout:numel()
    local draw = {dtype = o.dtype, std = o.init_std, seed = o.init_seed, offset = 0}
    if o.device == "cpu" then
      self.flat = mem.scope("params", tensor.randn, {n}, draw)
    else   -- drawn on the cpu (normals differ by an ulp across devices), then copied
      local init = tensor.randn({n}, draw)
      self.flat = mem.scope("params", init.to, init, o.device)
      init:free()
    end
    self.grad_flat = mem.scope("grads", tensor.zeros, {n}, {dtype = gdt, device = o.device})
    self.params = layout:views(self.flat)
    self.grads = layout:views(self.grad_flat)
  end
  if o.bias_rate > 0 then   -- aux-loss-free balancing: trainer state, not a weight
    self.bias = mem.scope("optim", tensor.zeros, {E}, {dtype = gdt, device = o.device})
  end
  if units and units.pool ~= nil then
    self.pool, self.shared_pool = units.pool, true
  else
    self.pool = pool.new(1 << 20, {grow = true, device = o.device})
  end
  self.router_opts = {k = o.topk, chunk = o.chunk, mode = o.mode, renorm = o.renorm,
                      temperature = o.temperature, eps = o.eps, noise = o.noise, gumbel = o.gumbel,
                      seed = o.seed, layer = o.layer, step = 0, bias = self.bias, pool = self.pool}
  self.expert_opts = {tile = o.tile, policy = o.policy, pool = self.pool}
  if o.partial_recompute >= 0 then
    self.expert_opts.partial_recompute = o.partial_recompute
  else
    self.expert_opts.save = o.save
  end
  return self
end

function Layer:zero_grad()
  for _, g in pairs(self.grads) do g:zero_() end
end

-- A layer's input or output gradient t: a [T, dim] tensor (T = rows, when
-- given) of the layer's dtype on its device; else an error at the line
-- that called forward or backward.
local function check_rows(self, fn, name, t, rows)
  local o = self.opts
  local function fail(fmt, ...) error(string.format("moelua.moe: layer:%s: " .. fmt, fn, ...), 4) end
  if not tensor.is_tensor(t) then fail("%s must be a tensor, got %s", name, type(t)) end
  if t:dim() ~= 2 or t:size(2) ~= o.dim or rows and t:size(1) ~= rows then   -- (no shape table per forward)
    fail("%s is [%s]: it must be [%s, %d]", name, table.concat(t:shape(), ","), rows or "T", o.dim)
  end
  if t:dtype() ~= o.dtype or t:device() ~= o.device then
    fail("%s is %s on %s: the layer's are %s on %s", name, t:dtype(), t:device(), o.dtype, o.device)
  end
end

-- y, stats = layer:forward(x [, step [, route_only]]): step keys the gate
-- noise. route_only (a checkpointed layer's forward run again in backward):
-- the routing, plan and context backward needs, but no expert runs and y is
-- nil; backward recomputes each tile's h (bitwise the saved one,
-- kernels/experts.h) and needs no expert output (dw = <W2ᵀ·dy, act>), so
-- the experts' forward GEMMs would be thrown away.
function Layer:forward(x, step, route_only)
  local o = self.opts
  check_rows(self, "forward", "x", x)
  if step ~= nil then
    local n = math.type(step) and math.tointeger(step)
    if not n or n < 0 then
      error(string.format("moelua.moe: layer:forward: step must be a whole number >= 0, got %s", tostring(step)), 2)
    end
    step = n
  end
  if route_only ~= nil and type(route_only) ~= "boolean" then
    error("moelua.moe: layer:forward: route_only must be a boolean, got " .. type(route_only), 2)
  end
  local T = x:size(1)
  if not self.shared_pool then
    self.pool:reset()                       -- the previous step's transients end here
  end
  self.router_opts.step = step or 0
  local pf = self.profile
  local dev = o.device   -- timed when the device's queued work is done (bench.now)
  local t0 = pf and now(dev)
  local idx, w, rs = router.forward(x, self.params.wg, self.router_opts)
  local t1 = pf and now(dev)
  local eo = self.expert_opts
  self:_set_capacity(T, rs.counts)
  local plan = experts.dispatch(idx, o.experts, eo)
  local t2 = pf and now(dev)
  local y, saved
  if self.ep then
    y, saved = self:_forward_ep(x, idx, w, plan, route_only)
  elseif self.store then
    y, saved = self:_forward_stored(x, idx, w, plan, route_only)
  elseif not route_only then
    y, saved = experts.forward(x, self.params.gate_up, self.params.down, idx, w, plan, eo)
  end
  if route_only then saved = {tile = eo.tile, nsaved = 0} end   -- backward recomputes every tile's h
  self.ctx = {x = x, idx = idx, w = w, plan = plan, saved = saved, rstats = rs}
  if pf then   -- seconds per phase; expert FLOPs: 3 GEMMs of 2 D F per row this rank's experts ran
    local t3 = now(dev)
    pf.router, pf.dispatch, pf.experts = pf.router + (t1 - t0), pf.dispatch + (t2 - t1), pf.experts + (t3 - t2)
    if not route_only then pf.experts_flop = pf.experts_flop + 6 * o.dim * o.ffn * self:_rows_run() end
  end
  local Tn = math.max(T, 1)
  local mean_prob = self.pool:tensor({o.experts}, {dtype = "f64"}):copy_(rs.psum):div_(Tn)
  local stats = {
    tokens = T,
    counts = rs.counts,                     -- C_e, before capacity drops (i64 [E])
    psum = rs.psum,                         -- P_e (f64 [E])
    kept = plan.counts,                     -- assignments each expert ran
    dropped = plan.ndropped,
    mean_prob = mean_prob,                  -- mean router probability per expert
    entropy = rs.entropy / Tn,              -- mean router entropy (nats)
    max_share = rs.max_count / (Tn * o.topk),
    aux = o.experts * rs.cp / (Tn * Tn),    -- this layer's HF aux loss (unweighted)
    z = rs.z / Tn,                          -- this layer's z-loss (unweighted)
  }
  self.stats = stats
  return y, stats
end

-- Capacity for this forward (policy "drop"): ceil(cf T k / E) per expert
-- of one process; over ranks, ceil(cf T k world / E) per expert for all
-- ranks' tokens together, of which rank r keeps what the ranks before it
-- left (one all-gather of the counts C_e; inside a plan nothing is read).
function Layer:_set_capacity(T, counts)
  local o, eo, z = self.opts, self.expert_opts, self.zero
  if o.policy ~= "drop" then return end
  local world = z and z.world or 1
  local cap = math.ceil(o.capacity_factor * T * o.topk * world / o.experts)
  self.capacity = cap
  if world == 1 then eo.capacity = cap; return end
  eo.capacity = nil
  local E = o.experts
  local all = self.pool:tensor({world * E}, {dtype = "i64"})
  z:all_gather(counts, all, "expert counts of MoE layer " .. (o.layer + 1))
  local caps = self.pool:tensor({E}, {dtype = "i64"})
  if not mem_planning() then
    local n, left = all:totable(), {}
    for e = 1, E do
      local before = 0
      for r = 0, z.rank - 1 do before = before + n[r * E + e] end
      left[e] = math.max(0, cap - before)
    end
    caps:copy_(tensor.tensor(left, {dtype = "i64"}))
  end
  eo.capacities = caps
end

-- Rows this rank sends to each rank of its expert-parallel group (kept
-- assignments of that rank's experts) and receives from each (the group's
-- kept assignments of this rank's experts), from the plan's per-expert
-- counts; inside a plan, all rows from one source up to the bound.
function Layer:_exchange_rows(plan)
  local z, o = self.ep, self.opts
  local ep, El = z.ep, self.local_experts
  local T, k = plan.T, plan.k
  local worst = ep * T * math.min(k, El)
  local bound = self.capacity and math.min(worst, El * self.capacity) or worst
  self.recv_rows = {worst = worst, capacity = self.capacity and El * self.capacity or nil, bound = bound}
  local counts = self.pool:tensor({ep, El}, {dtype = "i64"})
  z:all_to_all(plan.counts:view({ep, El}), ones(ep), counts, ones(ep), "expert counts of MoE layer " .. (o.layer + 1))
  local send, recv = {}, {}
  if mem_planning() then
    for d = 1, ep do send[d], recv[d] = 0, 0 end
    return send, recv, T * k, bound
  end
  local mine, theirs = plan.counts:totable(), counts:view({ep * El}):totable()
  local kept, got = 0, 0
  for d = 1, ep do
    send[d], recv[d] = 0, 0
    for e = 1, El do
      send[d] = send[d] + mine[(d - 1) * El + e]
      recv[d] = recv[d] + theirs[(d - 1) * El + e]
    end
    kept, got = kept + send[d], got + recv[d]
  end
  return send, recv, kept, got
end

function Layer:_forward_ep(x, idx, w, plan, route_only)
  local z, o, pool, eo = self.ep, self.opts, self.pool, self.expert_opts
  local T, D, k, El = x:size(1), o.dim, o.topk, self.local_experts
  local dt = {dtype = x:dtype()}
  local what = " of MoE layer " .. (o.layer + 1)
  local send, recv, kept, got = self:_exchange_rows(plan)
  local y = not route_only and pool:tensor({T, D}, dt):zero_() or nil
  local xr, wr = pool:tensor({got, D}, dt), pool:tensor({got, 1}, dt)
  local ids = pool:tensor({got, 1}, {dtype = "i64"})
  local m = pool:mark()
  local po = {pool = pool}
  z:all_to_all(experts.pack(x, plan, po), send, xr, recv, "tokens" .. what)
  z:all_to_all(experts.pack(w:view({T * k, 1}), plan, po), send, wr, recv, "routing weights" .. what)
  z:all_to_all(experts.pack(idx:view({T * k, 1}), plan, po), send, ids, recv, "expert ids" .. what)
  pool:rewind(m)
  ids:sub_(z.ep_rank * El)   -- the local experts' ids
  local rplan = experts.dispatch(ids, El, {pool = pool})
  self.ep_ctx = {send = send, recv = recv, kept = kept, got = got, xr = xr, wr = wr, ids = ids, rplan = rplan}
  if route_only then return end
  local yr, saved = experts.forward(xr, self.params.gate_up, self.params.down, ids, wr, rplan, eo)
  m = pool:mark()
  local ys = pool:tensor({kept, D}, dt)
  z:all_to_all(yr, recv, ys, send, "expert outputs" .. what)
  experts.unpack(ys, plan, y)
  pool:rewind(m)
  return y, saved
end

function Layer:_backward_ep(dy)
  local z, c, e, pool = self.ep, self.ctx, self.ep_ctx, self.pool
  local T, D, k = dy:size(1), self.opts.dim, self.opts.topk
  local dt = {dtype = dy:dtype()}
  local what = " of MoE layer " .. (self.opts.layer + 1)
  local dx, dw = pool:tensor({T, D}, dt):zero_(), pool:tensor({T, k}, dt):zero_()
  local m = pool:mark()
  local dyr = pool:tensor({e.got, D}, dt)
  z:all_to_all(experts.pack(dy, c.plan, {pool = pool}), e.send, dyr, e.recv, "output gradients" .. what)
  local p, g = self.params, self.grads
  local dxr, _, _, dwr = experts.backward(dyr, e.xr, p.gate_up, p.down, e.ids, e.wr, e.rplan, c.saved,
                                         self.expert_opts, {dgate_up = g.gate_up, ddown = g.down})
  local dxs, dws = pool:tensor({e.kept, D}, dt), pool:tensor({e.kept, 1}, dt)
  z:all_to_all(dxr, e.recv, dxs, e.send, "input gradients" .. what)
  z:all_to_all(dwr, e.recv, dws, e.send, "routing weight gradients" .. what)
  experts.unpack(dxs, c.plan, dx)
  experts.unpack(dws, c.plan, dw:view({T * k, 1}))
  pool:rewind(m)
  return dx, dw
end

-- The experts of a plan with rows ({[e] = true}; inside a memory plan,
-- where nothing is counted, all of them).
local function experts_with_rows(plan, E)
  local has = {}
  local counts = not mem_planning() and plan.counts:totable()
  for e = 0, E - 1 do has[e] = not counts or counts[e + 1] > 0 or nil end
  return has
end

-- The options of one expert's call: the layer's, with out / saved /
-- accumulate of this call.
function Layer:_call_opts()
  local c = self.call_opts
  if not c then
    c = {}
    for k, v in pairs(self.expert_opts) do c[k] = v end
    c.E = self.opts.experts
    self.call_opts = c
  end
  c.capacity, c.capacities = self.expert_opts.capacity, self.expert_opts.capacities
  return c
end

function Layer:_forward_stored(x, idx, w, plan, route_only)
  local st, o = self.store, self.opts
  local es, l = st.es, st.layer
  local has = experts_with_rows(plan, o.experts)
  self.stored_has = has
  if route_only then return end
  es:routed_layer(l, has)
  local y = self.pool:tensor({x:size(1), o.dim}, {dtype = x:dtype()}):zero_()
  local c = self:_call_opts()
  c.out, c.saved, c.accumulate = y, nil, nil
  for e = 0, o.experts - 1 do
    if has[e] then
      local _
      _, c.saved = es:with(l, e, false, function(v)
        return experts.forward(x, {[e + 1] = v.gate_up}, {[e + 1] = v.down}, idx, w, plan, c)
      end)
    end
  end
  return y, c.saved
end

-- Backward one expert at a time, ascending (dx and dw add up as one call's);
-- each expert's gradient stays in its slab (dirty), and in the last
-- micro-batch it is final (es.final_scale set by the trainer: moelua.zero).
function Layer:_backward_stored(dy)
  local st, c, o = self.store, self.ctx, self.opts
  local es, l = st.es, st.layer
  local T = dy:size(1)
  local dx = self.pool:tensor({T, o.dim}, {dtype = dy:dtype()}):zero_()
  local g = {dx = dx}
  local co = self:_call_opts()
  co.out, co.saved, co.accumulate = nil, nil, false
  for e = 0, o.experts - 1 do
    if self.stored_has[e] then
      es:with(l, e, true, function(v)
        g.dgate_up, g.ddown = {[e + 1] = v.dgate_up}, {[e + 1] = v.ddown}
        local _
        _, _, _, g.dw, g.touched = experts.backward(dy, c.x, {[e + 1] = v.gate_up}, {[e + 1] = v.down}, c.idx,
                                                    c.w, c.plan, c.saved, co, g)
        co.accumulate = true
        es:after_backward(l, e, v, es.final_scale)
      end)
    end
  end
  return dx, g.dw or self.pool:tensor({T, o.topk}, {dtype = dy:dtype()}):zero_()
end

-- The rows this rank's experts ran in the last forward: the kept
-- assignments, or with expert parallelism the rows received.
function Layer:_rows_run()
  if self.ep then return self.ep_ctx.got end
  local c = self.ctx
  return c.x:size(1) * self.opts.topk - c.plan.ndropped
end

-- The aux and z coefficients of one layer as its own model (N = T), in
-- the layer's pool: dL/dp'_te = aux_weight * E * C_e / N^2, dL/dzsum = z_weight / N.
local function own_coefficients(self)
  local o, s = self.opts, self.stats
  local T = math.max(s.tokens, 1)
  local aux = self.pool:tensor({o.experts}, {dtype = "f64"}):copy_(s.counts)
  aux:mul_(o.aux_weight * o.experts / (T * T))
  return aux, o.z_weight / T
end

-- dx = layer:backward(dy [, coef]): coef = {aux = f64 [E], z = number} from
-- moe.aux_loss when the layer is part of a model; without it the layer's own
-- aux_weight and z_weight apply with N = its tokens. Gradients accumulate
-- into layer.grads (call zero_grad between steps).
function Layer:backward(dy, coef)
  local c = self.ctx
  if not c then error("moelua.moe: layer:backward: no forward to go back through", 2) end
  check_rows(self, "backward", "dy", dy, c.x:size(1))
  if coef ~= nil and not (type(coef) == "table" and tensor.is_tensor(coef.aux) and type(coef.z) == "number") then
    error("moelua.moe: layer:backward: coef must be moe.aux_loss's {aux = tensor, z = number}, got " ..
          (type(coef) == "table" and "another table" or type(coef)), 2)
  end
  local p, g = self.params, self.grads
  local pf = self.profile
  local dev = self.opts.device   -- timed when the device's queued work is done (bench.now)
  local t0 = pf and now(dev)
  local dx, dw
  if self.ep then
    dx, dw = self:_backward_ep(dy)
  elseif self.store then
    dx, dw = self:_backward_stored(dy)
  else
    local _
    dx, _, _, dw = experts.backward(dy, c.x, p.gate_up, p.down, c.idx, c.w, c.plan, c.saved,
                                    self.expert_opts, {dgate_up = g.gate_up, ddown = g.down})
  end
  local t1 = pf and now(dev)
  local aux, z
  if coef then
    aux, z = coef.aux, coef.z
  elseif self.opts.aux_weight > 0 or self.opts.z_weight > 0 then
    aux, z = own_coefficients(self)
  end
  router.backward(dw, c.x, p.wg, c.idx, self.router_opts, {aux = aux, z = z, dx = dx, dwg = g.wg})
  if pf then   -- expert backward: dgate_up, ddown and dx GEMMs, 2x the forward's (recompute not counted)
    pf.experts, pf.router = pf.experts + (t1 - t0), pf.router + (now(dev) - t1)
    pf.experts_flop = pf.experts_flop + 12 * self.opts.dim * self.opts.ffn * self:_rows_run()
  end
  return dx
end

-- After the optimizer step: the aux-loss-free bias moves toward balance,
-- from the last forward's counts or the given ones (i64 [E]: every rank's).
function Layer:update_bias(counts)
  if self.bias then
    router.update_bias(self.bias, counts or self.stats.counts, self.opts.bias_rate)
  end
end

-- The balancing bias back to zero (a recipe's answer to a balance alarm).
function Layer:reset_bias()
  if self.bias then self.bias:zero_() end
end

-- layer:reinit_expert(dead, from, noise_std): expert `dead` (0-based)
-- becomes a copy of expert `from` plus N(0, noise_std^2) noise drawn from
-- the host's generator (so a resumed run draws the same), router row
-- and bias included: a dead expert restarts beside a live one, and the
-- noise breaks the tie between their scores. Optimizer states are left:
-- a dead expert's moments have decayed toward zero.
-- moe.check_reinit(fn, first, E, dead, from, std): reinit_expert's
-- arguments, numbered from `first` (a model's come after its layer), in
-- fn's name; raises at the caller of fn's caller.
function moe.check_reinit(fn, first, E, dead, from, std)
  for i, v in ipairs({dead, from}) do
    if math.type(v) ~= "integer" or v < 0 or v >= E then
      error(string.format("%s: argument #%d (%s): expected an expert id in 0..%d, got %s", fn, first + i - 1,
                          i == 1 and "dead" or "from", E - 1, tostring(v)), 3)
    end
  end
  if dead == from then error(fn .. ": dead and from are the same expert", 3) end
  if type(std) ~= "number" or not (std >= 0) then
    error(string.format("%s: argument #%d (noise_std): expected a number >= 0, got %s", fn, first + 2,
                        tostring(std)), 3)
  end
end

function Layer:reinit_expert(dead, from, std)
  moe.check_reinit("moelua.moe.reinit_expert", 1, self.opts.experts, dead, from, std)
  local views = {self.params.wg, self.params.gate_up, self.params.down}
  if self.bias then views[#views + 1] = self.bias end
  for _, v in ipairs(views) do
    local dst = v:select(1, dead + 1)
    dst:copy_(v:select(1, from + 1))
    if std > 0 and v ~= self.bias then
      local noise <close> = tensor.randn(dst:shape(), {dtype = dst:dtype(), device = dst:device(), std = std})
      dst:add_(noise)
    end
  end
end

-- loss, coefs = moe.aux_loss(layers, aux_weight, z_weight [, scope]): the
-- model's load-balancing and z losses from every layer's last forward, and
-- each layer's coefficients for backward (coefs[i] = {aux =, z =}). Over
-- ranks each rank's micro-batch keeps its own aux and z losses (C_e and
-- P_e of the tokens it routed, whichever rank runs the experts), as one
-- process accumulating micro-batches does.
function moe.aux_loss(layers, aux_weight, z_weight, scope)
  local function fail(fmt, ...) error("moelua.moe.aux_loss: " .. string.format(fmt, ...), 3) end
  if type(layers) ~= "table" or #layers == 0 then fail("layers must be a non-empty list of MoE layers") end
  for i, l in ipairs(layers) do
    if getmetatable(l) ~= Layer then fail("layers[%d] is not an MoE layer (moe.new)", i) end
    if not l.stats then fail("layers[%d] has no forward to take its routing from", i) end
    if l.opts.experts ~= layers[1].opts.experts then
      fail("layers[%d] has %d experts, layers[1] %d", i, l.opts.experts, layers[1].opts.experts)
    end
  end
  for _, w in ipairs{{"aux_weight", aux_weight}, {"z_weight", z_weight}} do
    if type(w[2]) ~= "number" or not (w[2] >= 0 and w[2] < math.huge) then
      fail("%s must be a finite number >= 0, got %s", w[1], tostring(w[2]))
    end
  end
  scope = scope or "model"
  if scope ~= "model" and scope ~= "layer" then
    fail("scope must be \"model\" or \"layer\", got %s", tostring(scope))
  end
  local L = #layers
  local E = layers[1].opts.experts
  local N = 0
  for _, l in ipairs(layers) do N = N + l.stats.tokens end
  local coefs, aux, z = {}, 0, 0
  if scope == "layer" then
    for i, l in ipairs(layers) do
      local T = l.stats.tokens
      aux = aux + l.stats.aux / L
      coefs[i] = {aux = l.stats.counts:to("f64"):mul(aux_weight * E / (L * T * T))}
    end
  else
    local on = {dtype = "f64", device = layers[1].opts.device}
    local C, P = tensor.zeros({E}, on), tensor.zeros({E}, on)
    for _, l in ipairs(layers) do
      C:add_(l.stats.counts:to("f64"))
      P:add_(l.stats.psum)
    end
    aux = E * C:mul(P):sum():item() / (N * N)
    local g = C:mul(aux_weight * E / (N * N))
    for i = 1, L do coefs[i] = {aux = g} end
  end
  for i, l in ipairs(layers) do
    z = z + l.stats.z * l.stats.tokens / N
    coefs[i].z = z_weight / N
  end
  return aux_weight * aux + z_weight * z, coefs, {aux = aux, z = z}
end

return moe
