-- moelua.nn.Transformer: a Mixtral-style decoder (HF MixtralForCausalLM
-- semantics) assembled from the nn modules.
--
--   h0 = embed(tokens[1..S])
--   for each layer: h1 = h + o_proj(attn(rope(q), rope(k), v)) of rmsnorm1(h)
--                   h2 = h1 + block_sparse_moe(rmsnorm2(h1))
--   loss = mean CE of lm_head(rmsnorm_f(hL)) against tokens[2..S+1]
--
--   local model = nn.Transformer.new{vocab = 256, dim = 64, layers = 2, heads = 4, ...}
--   local loss, stats = model:forward(tokens, step)      -- tokens i64 [S+1]
--   model:backward{aux_weight = 0.01, z_weight = 1e-3}    -- grads accumulate
--
-- Parameters (DESIGN.md, Parameters: flat units): model.units lists
-- {name, kind, layout, params, grads, ...} (moelua.zero's units, laid out by
-- a moelua.unit each): "embed" [V*D]; per layer i (0-based)
-- "layers.i.dense" = q, k, v, o projections | input and post-attention norms
-- | router wg, and "layers.i.experts" = gate_up [E, 2F, D] | down [E, D, F];
-- "final" = lm_head [V, D] | norm [D]. Module weights are views.
--
-- Sharding: `zero = moelua.zero.new{...}` places the units on the ranks
-- (ZeRO stages 0-3); forward and backward walk each unit through it
-- (acquire before use, release after, after_backward once its gradient is
-- final). Without it the model is one process at stage 0, where the walk
-- does nothing.
--
-- Device: `device = "cuda"` puts the units, the pool and every activation on
-- the GPU (initial weights are drawn on the CPU and copied, as moelua.moe
-- does, so a model starts from the same weights on every device); tokens
-- may come from the CPU (the data loader's) and are copied over.
-- `dtype = "bf16"` (cuda only) is mixed precision: bf16 weights and
-- activations, f32 gradients, optimizer states and master weights
-- (moelua.zero); named_parameters() and checkpoints are the f32 masters.
--
-- Memory: every matmul output and the residual stream live in the model's
-- stack pool (ledger "pool"; RoPE rotates q and k there, in place);
-- moelua.ops outputs (norm, attention, CE) are tensors under "acts", freed
-- explicitly. Forward pushes one frame
-- per layer: [h1, h2 | attention saved | moe saved]; activation checkpointing
-- per layer ("none", "attention", "moe", "full") rewinds the part it does not
-- keep right after computing it, and backward recomputes it (same inputs,
-- same kernels, same routing keys: the gradients are bitwise those of
-- "none" at a fixed thread count); of a MoE half only its norm and routing,
-- as the experts' backward recomputes each tile's h (moelua.moe's
-- route_only). "full" keeps [h2] alone (the next
-- layer's input): backward recomputes the attention half first, which
-- gives h1 again, and keeps its context through the MoE half's backward.
-- Backward walks the layers in reverse and rewinds each frame (LIFO); the
-- residual gradient is one [S, D] buffer.
local tensor = require "moelua.tensor"
local mem = require "moelua.mem"
local pool = require "moelua.pool"
local moe = require "moelua.moe"
local ckpt = require "moelua.ckpt"
local Embedding = require "moelua.nn.embedding"
local RMSNorm = require "moelua.nn.rmsnorm"
local Attention = require "moelua.nn.attention"
local MoEBlock = require "moelua.nn.moe_block"
local LMHead = require "moelua.nn.lm_head"
local KVCache = require "moelua.nn.kv_cache"
local unit = require "moelua.unit"
local zero = require "moelua.zero"
local errors = require "moelua.errors"
local options = require "moelua.options"
local expert_store = require "moelua.expert_store"

local Transformer = {}
Transformer.__index = Transformer

local FN = "moelua.nn.Transformer.new"

-- option = {kind, default (nil: required; false: none) [, min =]}: moelua.options.check's
local OPTIONS = {
  vocab = {"integer", min = 1}, dim = {"integer", min = 1}, layers = {"integer", min = 1},
  heads = {"integer", min = 1}, kv_heads = {"integer", false, min = 1}, head_dim = {"integer", false},
  ffn = {"integer", min = 1}, experts = {"integer", min = 1}, topk = {"integer", 2},
  rope_theta = {"number", 1e6}, norm_eps = {"number", 1e-5}, init_std = {"number", 0.02}, seed = {"integer", 0},
  dtype = {"string", "f32"}, device = {"string", "cpu"}, checkpoint = {"string|table", "none"}, moe = {"table", false},
  zero = {"table", false}, store = {"table", false},
  aux_weight = {"number", 0.02}, max_position = {"integer", 131072, min = 1},
  ce_rows = {"integer", 256, min = 1}, ce_chunk = {"integer", 4096, min = 1},
}
-- moe sub-options the model passes through (the rest are the model's own)
local MOE_KEYS = {chunk = true, mode = true, renorm = true, temperature = true, eps = true,
                  noise = true, gumbel = true, capacity_factor = true, policy = true, save = true,
                  tile = true, bias_rate = true, partial_recompute = true}
local CHECKPOINT = {none = {false, false}, attention = {true, false}, moe = {false, true},
                    full = {true, true}}

-- A bad option: a user error (a recipe prints it without a traceback).
local function fail(fmt, ...) errors.user(FN .. ": " .. string.format(fmt, ...)) end

local function check_options(opts)
  if opts == nil then fail("options must be a table, got nil") end
  local o = options.check(opts, OPTIONS, fail)
  local function need(cond, fmt, ...) if not cond then fail(fmt, ...) end end
  o.kv_heads = o.kv_heads or o.heads
  need(o.heads % o.kv_heads == 0,
       "option 'kv_heads' = %d must divide heads = %d", o.kv_heads, o.heads)
  if not o.head_dim then
    need(o.dim % o.heads == 0, "option 'heads' = %d must divide dim = %d (or give head_dim)",
         o.heads, o.dim)
    o.head_dim = o.dim // o.heads
  end
  need(o.head_dim >= 2 and o.head_dim % 2 == 0 and o.head_dim <= 256,
       "option 'head_dim' = %d%s must be even and in [2, 256]", o.head_dim,
       opts.head_dim and "" or string.format(" (dim %d / heads %d)", o.dim, o.heads))
  need(o.topk >= 1 and o.topk <= o.experts, "option 'topk' = %d must be in 1..experts (%d)",
       o.topk, o.experts)
  need(o.rope_theta > 1, "option 'rope_theta' must be > 1, got %g", o.rope_theta)
  need(o.norm_eps >= 0, "option 'norm_eps' must be >= 0, got %g", o.norm_eps)
  need(o.init_std > 0, "option 'init_std' must be > 0, got %g", o.init_std)
  need(o.aux_weight >= 0, "option 'aux_weight' must be >= 0, got %g", o.aux_weight)
  need(o.dtype == "f32" or o.dtype == "f64" or o.dtype == "bf16",
       "option 'dtype' must be \"f32\", \"f64\" or \"bf16\", got %q", o.dtype)
  need(o.device == "cpu" or o.device == "cuda", "option 'device' must be \"cpu\" or \"cuda\", got %q",
       o.device)
  need(o.dtype ~= "bf16" or o.device == "cuda", "option 'dtype' \"bf16\" (mixed precision) runs on " ..
       "cuda: the CPU's kernels are f32 and f64")
  -- checkpoint: one mode or one per layer
  local per = {}
  if type(o.checkpoint) == "string" then
    for i = 1, o.layers do per[i] = o.checkpoint end
  else
    need(#o.checkpoint == o.layers, "option 'checkpoint' has %d entries, expected one per layer (%d)",
         #o.checkpoint, o.layers)
    for i = 1, o.layers do per[i] = o.checkpoint[i] end
  end
  for i, c in ipairs(per) do   -- the entry of a per-layer list is named as given (1-based)
    need(CHECKPOINT[c], "option 'checkpoint'%s must be \"none\", \"attention\", \"moe\" or \"full\", got %s",
         type(o.checkpoint) == "table" and string.format("[%d]", i) or "", tostring(c))
  end
  o.checkpoint_per_layer = per
  if o.store then   -- {path =, budget = bytes [, prefetch = 2, inference]}: the experts in a moelua.expert_store
    local ok, st = pcall(expert_store.check_options, o.store, FN, 0, "store.")
    if not ok then errors.user(st) end
    need(st.path or o.device == "cuda", "option 'store.path' is required on the cpu (the store's file)")
    o.store = st
  end
  -- moe sub-options, checked by moelua.moe without allocating
  local mo = {dim = o.dim, ffn = o.ffn, experts = o.experts, topk = o.topk, dtype = o.dtype,
              device = o.device}
  for k, v in pairs(o.moe or {}) do
    need(MOE_KEYS[k], "unknown option 'moe.%s'", tostring(k))
    mo[k] = v
  end
  local ok, err = pcall(moe.check_options, mo)
  if not ok then fail("option 'moe': %s", tostring(err)) end
  o.moe_opts = mo
  return o
end

-- The units' layouts (DESIGN.md, Parameters: flat units), written once.
-- Each segment carries its optimizer group's label (param_groups):
-- consecutive segments of one label form one group.
local LABELS = {q = "attention", k = "attention", v = "attention", o = "attention",
                input_layernorm = "norms", post_attention_layernorm = "norms", wg = "router",
                gate_up = "experts.gate_up", down = "experts.down", embed = "embed",
                lm_head = "lm_head", norm = "norm"}

local function layouts(o, i, El)
  local D, H, KV, hd = o.dim, o.heads, o.kv_heads, o.head_dim
  local p = "layers." .. i .. "."
  return unit.new(p .. "dense", {
    {name = "q", shape = {H * hd, D}}, {name = "k", shape = {KV * hd, D}},
    {name = "v", shape = {KV * hd, D}}, {name = "o", shape = {D, H * hd}},
    {name = "input_layernorm", shape = {D}}, {name = "post_attention_layernorm", shape = {D}},
    {name = "wg", shape = {o.experts, D}},
  }), unit.new(p .. "experts", moe.expert_segments(El, D, o.ffn))
end

function Transformer.new(opts)
  local o = check_options(opts)       -- every check before any allocation
  local self = setmetatable({opts = o}, Transformer)
  local D, V, dt = o.dim, o.vocab, o.dtype
  local draw_dt = zero.grad_dtype(dt)   -- initial weights: the masters' dtype
  self.zero = o.zero or zero.new{}
  local ep = self.zero.ep
  if o.experts % ep ~= 0 then
    errors.user(string.format("--ep %d: the expert-parallel size must divide the number of experts (%d)",
                              ep, o.experts))
  end
  -- this rank's experts: [first, first + El) of every block (all of them without expert parallelism)
  self.local_experts, self.first_expert = o.experts // ep, self.zero.ep_rank * (o.experts // ep)
  if o.store then   -- every check before the store's file is made
    if ep > 1 then
      errors.user(string.format("--expert-budget: the expert store is not built for expert parallelism yet " ..
                                "(got --ep %d; it needs --ep 1)", ep))
    end
    self.zero:check_store()
    self.expert_store = expert_store.new{path = o.store.path, budget = o.store.budget, prefetch = o.store.prefetch,
                                         inference = o.store.inference, layers = o.layers, experts = o.experts,
                                         dim = D, ffn = o.ffn, device = o.device, dtype = dt}
  end
  local draw_offset = 0
  -- a unit of the layout, drawn N(0, init_std) from the model's seed at
  -- the next offset of its stream (the same weights at any sharding and on
  -- any device: drawn on the cpu, then copied), its norms set to 1
  -- A segment's elements are elements [g, g + numel) of the unit's stream
  -- (counter offset + i / 4, lane i mod 4). An experts unit of expert
  -- parallelism holds El of the E experts: its segment at local offset s
  -- starts at s ep + first (numel / El) of the whole unit's stream.
  local function draw_into(view, g)
    local draw, lead = {std = o.init_std, seed = o.seed, offset = draw_offset + g // 4}, g % 4
    if o.device == "cpu" and lead == 0 then
      view:normal_(draw)
    else   -- from the counter holding element g; on the cpu (normals differ by an ulp across devices)
      local drawn <close> = tensor.empty({lead + view:numel()}, {dtype = draw_dt})
      view:copy_(drawn:normal_(draw):narrow(1, lead + 1, view:numel()))
    end
  end
  local function new_unit(name, kind, layout, ep_whole)
    local n = layout:numel()
    local function init(params)
      for _, seg in ipairs(layout:segments()) do
        local view = params:view_at(seg.offset, {seg.numel})
        if LABELS[seg.name] == "norms" or seg.name == "norm" then
          view:fill_(1)
        else
          draw_into(view, ep_whole and seg.offset * ep + self.first_expert * (seg.numel // self.local_experts)
                            or seg.offset)
        end
      end
    end
    local u = self.zero:unit(name, kind, layout, {dtype = dt, device = o.device, init = init})
    draw_offset = draw_offset + ((ep_whole and n * ep or n) + 3) // 4
    return u
  end
  -- An experts unit in the expert store: each expert's slab drawn from its
  -- elements of the unit's stream (gate_up at e 2 F D, down at E 2 F D + e D F).
  local function stored_unit(name, layout, layer)
    local E, F = o.experts, o.ffn
    local u = self.zero:stored_unit(name, layout, self.expert_store, layer)
    for e = 0, E - 1 do
      self.expert_store:fill(layer, e, function(v)
        draw_into(v.params:view_at(0, {2 * F * D}), e * 2 * F * D)
        draw_into(v.params:view_at(2 * F * D, {D * F}), E * 2 * F * D + e * D * F)
      end)
    end
    draw_offset = draw_offset + (layout:numel() + 3) // 4
    return u
  end
  self.units = self.zero.units
  self.pool = pool.new(1 << 20, {grow = true, device = o.device})
  self.profile = {}
  self:reset_profile()
  -- embedding
  local ue = new_unit("embed", "embed", unit.new("embed", {{name = "embed", shape = {V, D}}}))
  local pe, ge = ue.layout:views(ue.params), ue.layout:views(ue.grads)
  self.embed = Embedding.new{weight = pe.embed, grad = ge.embed}
  -- blocks
  self.blocks = {}
  for i = 1, o.layers do
    local ldense, lexperts = layouts(o, i - 1, self.local_experts)
    local ud = new_unit("layers." .. (i - 1) .. ".dense", "dense", ldense)
    local name = "layers." .. (i - 1) .. ".experts"
    local ux = self.expert_store and stored_unit(name, lexperts, i - 1) or new_unit(name, "experts", lexperts, ep > 1)
    local p, g = ldense:views(ud.params), ldense:views(ud.grads)
    local xp, xg = {}, {}
    if not ux.stored then xp, xg = lexperts:views(ux.params), lexperts:views(ux.grads) end
    local mo = {}
    for k, v in pairs(o.moe_opts) do mo[k] = v end
    mo.seed, mo.layer = o.seed, i - 1
    local ck = CHECKPOINT[o.checkpoint_per_layer[i]]
    if ck[2] then   -- a checkpointed MoE half keeps nothing for backward, its h neither
      mo.save, mo.partial_recompute = "recompute", nil
    end
    self.blocks[i] = {
      dense = ud, experts = ux, params = p, xparams = xp, grads = g, xgrads = xg,
      ck_attn = ck[1], ck_moe = ck[2],
      norm1 = RMSNorm.new{weight = p.input_layernorm, grad = g.input_layernorm, eps = o.norm_eps},
      norm2 = RMSNorm.new{weight = p.post_attention_layernorm, grad = g.post_attention_layernorm,
                          eps = o.norm_eps},
      attn = Attention.new{dim = D, heads = o.heads, kv_heads = o.kv_heads, head_dim = o.head_dim,
                           theta = o.rope_theta, pool = self.pool, profile = self.profile,
                           params = {q = p.q, k = p.k, v = p.v, o = p.o},
                           grads = {q = g.q, k = g.k, v = g.v, o = g.o}},
      moe = MoEBlock.new(mo, {params = {wg = p.wg, gate_up = xp.gate_up, down = xp.down},
                              grads = {wg = g.wg, gate_up = xg.gate_up, down = xg.down},
                              pool = self.pool, zero = self.zero,
                              store = ux.stored and {es = ux.stored, layer = i - 1}}),
    }
    self.blocks[i].moe.layer.profile = self.profile
  end
  -- final norm + head
  local uf = new_unit("final", "final", unit.new("final", {{name = "lm_head", shape = {V, D}},
                                                            {name = "norm", shape = {D}}}))
  self.final_params, self.final_grads = uf.layout:views(uf.params), uf.layout:views(uf.grads)
  self.head = LMHead.new{weight = self.final_params.lm_head, grad = self.final_grads.lm_head,
                         rows = o.ce_rows, chunk = o.ce_chunk, profile = self.profile}
  self.norm = RMSNorm.new{weight = self.final_params.norm, grad = self.final_grads.norm,
                          eps = o.norm_eps}
  -- the units in the order backward uses them
  self.backward_order = {uf}
  for i = o.layers, 1, -1 do
    local b = self.blocks[i]
    table.insert(self.backward_order, b.dense)
    table.insert(self.backward_order, b.experts)
  end
  table.insert(self.backward_order, ue)
  self.layer_stats = {}
  return self
end

function Transformer:moe_layers()
  local ls = {}
  for i, b in ipairs(self.blocks) do ls[i] = b.moe.layer end
  return ls
end

-- ---- forward ---------------------------------------------------------------

-- The attention half of block b: out = x + attn(norm1(x)); returns its ctx.
local function attn_part(b, x, out)
  local a, r1 = b.norm1:forward(x)
  local y, actx = b.attn:forward(a)
  out:copy_(x):add_(y)
  return {a = a, r1 = r1, actx = actx}
end

local function attn_release(b, c)
  b.attn:release(c.actx); c.a:free(); c.r1:free()
end

-- The MoE half: out = h1 + moe(norm2(h1)).
local function moe_part(b, h1, out, step)
  local m, r2 = b.norm2:forward(h1)
  local y, stats = b.moe:forward(m, step)
  out:copy_(h1):add_(y)
  return {m = m, r2 = r2}, stats
end

-- A checkpointed MoE half in backward: its input and routing again, no
-- expert (moelua.moe's route_only); the forward's stats stay.
local function moe_reroute(b, h1, step)
  local m, r2 = b.norm2:forward(h1)
  local kept = b.moe.layer.stats
  b.moe:forward(m, step, true)
  b.moe.layer.stats = kept
  return {m = m, r2 = r2}
end

-- The layer's stats with model-owned copies of the per-expert tensors, so
-- they outlive the pool frames (and checkpoint rewinds); `ran` sums the
-- kept assignments of every forward since zero_grad (a step's micro-batches).
function Transformer:_keep_stats(i, stats)
  local keep = self.layer_stats[i]
  if not keep then
    keep = {}
    for _, k in ipairs{"counts", "psum", "kept", "mean_prob", "ran"} do
      local like = stats[k] or stats.kept
      keep[k] = mem.scope("acts", tensor.zeros, {like:numel()}, {dtype = like:dtype(), device = like:device()})
    end
    self.layer_stats[i] = keep
  end
  keep.ran:add_(stats.kept)
  local s = {}
  for k, v in pairs(stats) do s[k] = v end
  for _, k in ipairs{"counts", "psum", "kept", "mean_prob"} do s[k] = keep[k]:copy_(stats[k]) end
  self.blocks[i].moe.layer.stats = s
  return s
end

-- model:release(): frees what the last forward saved for backward, when
-- no backward will consume it (a validation forward; forward and decode
-- call it first).
function Transformer:release()
  local st = self.state
  if not st then self.pool:reset(); return end
  for i = #st.frames, 1, -1 do
    local f, b = st.frames[i], self.blocks[i]
    if f.moe then f.moe.m:free(); f.moe.r2:free() end
    if f.attn then attn_release(b, f.attn) end
  end
  st.hf:free(); st.rf:free(); st.lse:free()
  self.state = nil
  self.pool:reset()
end

-- loss, stats = model:forward(tokens [, step]): tokens i64 [S+1]; loss is the
-- mean CE over the S predictions (f64). stats = {ce, aux, z, tokens = S,
-- layers = {per-layer moe stats}}; aux and z unweighted (HF aux over all layers).
function Transformer:forward(tokens, step)
  if not tensor.is_tensor(tokens) or tokens:dim() ~= 1 or tokens:dtype() ~= "i64" or tokens:numel() < 2 then
    error("moelua.nn.Transformer:forward: tokens must be an i64 tensor [S+1] with S >= 1", 2)
  end
  self:release()
  step = step or 0
  return mem.scope("acts", function()
    local S, D, dt = tokens:numel() - 1, self.opts.dim, {dtype = self.opts.dtype}
    if tokens:device() ~= self.opts.device then tokens = tokens:to(self.opts.device) end
    local ids, targets = tokens:narrow(1, 1, S), tokens:narrow(1, 2, S)
    local st = {ids = ids, targets = targets, frames = {}, step = step, S = S}
    local z, units, L = self.zero, self.units, #self.blocks
    z:begin("forward", units)
    mem.phase("forward, embedding")
    z:acquire(units[1])
    local e = self.embed:forward(ids)
    z:release(units[1])
    local h = self.pool:tensor({S, D}, dt):copy_(e)
    e:free()
    st.h0 = h
    local lstats = {}
    for i, b in ipairs(self.blocks) do
      mem.phase(string.format("forward, layer %d of %d", i, L))
      local f = {mark = self.pool:mark(), x = h}
      local full = b.ck_attn and b.ck_moe   -- the frame keeps h2 alone: backward recomputes h1 too
      if not full then f.h1 = self.pool:tensor({S, D}, dt) end
      f.h2 = self.pool:tensor({S, D}, dt)
      local kept = self.pool:mark()
      local h1 = f.h1 or self.pool:tensor({S, D}, dt)
      f.amark = self.pool:mark()
      z:acquire(b.dense)
      local ac = attn_part(b, h, h1)
      if b.ck_attn then attn_release(b, ac); self.pool:rewind(f.amark) else f.attn = ac end
      f.mmark = self.pool:mark()
      z:acquire(b.experts)
      local mc, s = moe_part(b, h1, f.h2, step)
      z:release(b.experts)
      z:release(b.dense)
      lstats[i] = self:_keep_stats(i, s)
      if b.ck_moe then mc.m:free(); mc.r2:free(); self.pool:rewind(full and kept or f.mmark) else f.moe = mc end
      st.frames[i] = f
      h = f.h2
      -- an optional self.safe_point(phase, layer) after each block (the trainer's attach polls)
      if self.safe_point then self.safe_point("forward", i) end
    end
    st.hL = h
    mem.phase("forward, loss")
    local uf = units[#units]
    z:acquire(uf)
    st.hf, st.rf = self.norm:forward(h)
    local ce, lse = self.head:forward(st.hf, targets)
    z:release(uf)
    st.lse = lse
    self.state = st
    local _, _, parts = moe.aux_loss(self:moe_layers(), 0, 0)
    return ce, {ce = ce, aux = parts.aux, z = parts.z, tokens = S, layers = lstats}
  end)
end

-- ---- backward --------------------------------------------------------------

-- model:backward{aux_weight =, z_weight = [, ce_weight = 1]}: gradients of
-- ce_weight * ce + aux_weight * aux + z_weight * z accumulate into every
-- unit's grads (ce_weight = 0 isolates the router losses, for checks).
function Transformer:backward(w)
  w = w or {}
  for k, v in pairs(w) do
    if (k ~= "aux_weight" and k ~= "z_weight" and k ~= "ce_weight") or type(v) ~= "number"
       or v < 0 then
      error(string.format("moelua.nn.Transformer:backward: option '%s' must be aux_weight, " ..
                          "z_weight or ce_weight, a number >= 0", tostring(k)), 2)
    end
  end
  local st = assert(self.state, "moelua.nn.Transformer:backward: no forward to differentiate")
  mem.scope("acts", function()
    local S, D, dt = st.S, self.opts.dim, {dtype = self.opts.dtype}
    local layers = self:moe_layers()
    local _, coefs = moe.aux_loss(layers, w.aux_weight or 0, w.z_weight or 0)
    local z, units = self.zero, self.units
    z:begin("backward", self.backward_order)
    mem.phase("backward, loss")
    z:acquire(units[#units])
    local dhf = self.head:backward(st.hf, st.targets, st.lse, w.ce_weight or 1.0)
    local dx = self.norm:backward(dhf, st.hL, st.rf)
    z:after_backward(units[#units])
    dhf:free(); st.hf:free(); st.rf:free(); st.lse:free()
    if not (self.dh and self.dh:size(1) == S) then
      if self.dh then self.dh:free() end
      self.dh = tensor.empty({S, D}, {dtype = self.opts.dtype, device = self.opts.device})
    end
    local dh = self.dh:copy_(dx)
    dx:free()
    for i = #self.blocks, 1, -1 do
      mem.phase(string.format("backward, layer %d of %d", i, #self.blocks))
      local b, f = self.blocks[i], st.frames[i]
      z:acquire(b.dense)
      z:acquire(b.experts)
      -- full checkpointing: the attention half again first, for h1 (its
      -- context then waits, on top of the pool, for its backward)
      local h1, ac = f.h1, f.attn
      if not h1 then
        h1 = self.pool:tensor({S, D}, dt)
        ac = attn_part(b, f.x, h1)
      end
      local mmark = f.h1 and f.mmark or self.pool:mark()
      -- moe half: dh is dL/dh2; dh1 = dh + norm2'(moe'(dh))
      local mc = f.moe or moe_reroute(b, h1, st.step)
      local dm = b.moe:backward(dh, coefs[i])
      z:after_backward(b.experts)
      dx = b.norm2:backward(dm, h1, mc.r2)
      dh:add_(dx)
      dx:free(); mc.m:free(); mc.r2:free()
      self.pool:rewind(mmark)
      -- attention half
      if not ac then ac = attn_part(b, f.x, self.pool:tensor({S, D}, dt)) end
      local da = b.attn:backward(dh, ac.actx)
      dx = b.norm1:backward(da, f.x, ac.r1)
      z:after_backward(b.dense)
      dh:add_(dx)
      dx:free(); attn_release(b, ac)
      self.pool:rewind(f.mark)
      if self.safe_point then self.safe_point("backward", i) end
    end
    mem.phase("backward, embedding")
    z:acquire(units[1])
    self.embed:backward(dh, st.ids)
    z:after_backward(units[1])
  end)
  self.state = nil
  self.pool:reset()
end

-- model:zero_grad(): gradients to 0 and a new profile (one step's worth).
function Transformer:zero_grad()
  self.zero:zero_grad()
  for _, keep in pairs(self.layer_stats) do keep.ran:zero_() end
  self:reset_profile()
end

-- ---- per-phase profile ---------------------------------------------------------
-- model.profile accumulates, from the last reset (zero_grad or
-- reset_profile), the seconds spent in attention (projections, RoPE, flash
-- attention, forward and backward), router, dispatch, experts (grouped
-- SwiGLU and combine) and ce (LM head + chunked cross-entropy), recomputes
-- included, and the model FLOPs of attention, experts and ce in *_flop
-- (matmul FLOPs: a recompute's forward counts again; the experts' own
-- pre-activation recompute does not). One bench.now() pair per module call.
local PROFILE_KEYS = {"attention", "router", "dispatch", "experts", "ce",
                      "attention_flop", "experts_flop", "ce_flop"}

function Transformer:reset_profile()
  for _, k in ipairs(PROFILE_KEYS) do self.profile[k] = 0 end
end

-- model:profile_summary() -> {seconds = {attention =, ...}, gflops = {attention =, experts =, ce =}}
function Transformer:profile_summary()
  local p = self.profile
  local out = {seconds = {}, gflops = {}}
  for _, k in ipairs{"attention", "router", "dispatch", "experts", "ce"} do out.seconds[k] = p[k] end
  for _, k in ipairs{"attention", "experts", "ce"} do
    out.gflops[k] = p[k] > 0 and p[k .. "_flop"] / p[k] / 1e9 or 0
  end
  return out
end

-- f = model:flops(S): the matmul FLOPs (2 per multiply-add) of one
-- micro-batch of S tokens, every token running its k experts (none
-- dropped): f.forward (attention's projections and causal core, router,
-- experts, LM head) and f.recompute, what backward computes again: the
-- forward of a checkpointed attention half, a checkpointed MoE half's
-- router, and the experts' pre-activations (x gate_up^T, 4 D F per row)
-- where the layer saves none (save = "recompute", which a checkpointed MoE
-- half always runs).
function Transformer:flops(S)
  if math.type(S) ~= "integer" or S < 1 then
    error("moelua.nn.Transformer:flops: argument #1 (seq_len): expected an integer >= 1, got " .. tostring(S), 2)
  end
  local o = self.opts
  local rows = S * o.topk
  local router, experts = 2 * S * o.dim * o.experts, 6 * rows * o.dim * o.ffn
  local f = {forward = 2 * S * o.dim * o.vocab, recompute = 0}
  for _, b in ipairs(self.blocks) do
    local proj, core = b.attn:flops(S)
    f.forward = f.forward + proj + core + router + experts
    if b.ck_attn then f.recompute = f.recompute + proj + core end
    if b.ck_moe then f.recompute = f.recompute + router end
    if b.moe.layer.opts.save == "recompute" then f.recompute = f.recompute + 4 * rows * o.dim * o.ffn end
  end
  return f
end

-- ---- settings, parameters, config -------------------------------------------

local ROUTER_KEYS = {temperature = "number", noise = "number", eps = "number", capacity_factor = "number"}

-- model:reinit_expert(layer, dead, from, noise_std): expert `dead` of MoE
-- layer `layer` (1-based) restarts as a noisy copy of expert `from`
-- (0-based ids; moelua.moe Layer:reinit_expert).
function Transformer:reinit_expert(layer, dead, from, std)
  local b = self.blocks[layer]
  if not b then
    error(string.format("moelua.nn.Transformer:reinit_expert: no layer %s (the model has %d)", tostring(layer),
                        #self.blocks), 2)
  end
  if self.zero.ep > 1 or self.expert_store then   -- the two experts may live on different ranks, or in the store
    error("moelua.nn.Transformer:reinit_expert: not with expert parallelism (--ep > 1) or an expert store", 2)
  end
  moe.check_reinit("moelua.nn.Transformer:reinit_expert", 2, self.opts.experts, dead, from, std)
  local z = self.zero
  z:edit(b.dense, function() z:edit(b.experts, function() b.moe.layer:reinit_expert(dead, from, std) end) end)
end

-- model:set_router{temperature =, noise =, eps =, capacity_factor =}: the
-- per-step router settings (a recipe hook's), applied to every layer.
function Transformer:set_router(s)
  for k, v in pairs(s) do
    if ROUTER_KEYS[k] ~= type(v) then
      error(string.format("moelua.nn.Transformer:set_router: option '%s' must be one of " ..
                          "temperature, noise, eps, capacity_factor (a number), got %s = %s",
                          tostring(k), tostring(k), tostring(v)), 2)
    end
  end
  local function need(c, msg) if not c then error("moelua.nn.Transformer:set_router: " .. msg, 2) end end
  need(not s.temperature or s.temperature > 0, "option 'temperature' must be > 0")
  need(not s.noise or s.noise >= 0, "option 'noise' must be >= 0")
  need(not s.eps or (s.eps >= 0 and s.eps < 1), "option 'eps' must be in [0, 1)")
  if s.capacity_factor then
    need(s.capacity_factor >= 0, "option 'capacity_factor' must be >= 0")
    need((self.opts.moe_opts.policy == "drop") == (s.capacity_factor > 0),
         "option 'capacity_factor' must be > 0 exactly when moe.policy is \"drop\"")
  end
  for _, l in ipairs(self:moe_layers()) do
    for _, k in ipairs{"temperature", "noise", "eps"} do
      if s[k] then l.router_opts[k] = s[k]; l.opts[k] = s[k] end
    end
    if s.capacity_factor then l.opts.capacity_factor = s.capacity_factor end
  end
end

-- mask = model:active_experts(i) (or model.active_experts(i)): u8 [E], 1 for
-- the experts of layer i (1-based) that ran tokens in a forward since the
-- last zero_grad (any micro-batch of the step).
function Transformer.active_experts(a, b)
  local self, i = a, b
  if getmetatable(a) ~= Transformer then
    error("moelua.nn.Transformer: call model:active_experts(i)", 2)
  end
  local s = self.layer_stats[i]
  if not s then error("moelua.nn.Transformer:active_experts: no forward for layer " .. tostring(i), 2) end
  local mask = tensor.zeros({self.opts.experts}, {dtype = "u8"})
  local one = s.ran:minimum(1)
  mask:copy_(one)
  one:free()
  return mask
end

local FREEZE_KEYS = {router = true, experts = true, attention = true}

-- groups = model:param_groups{weight_decay =, router_lr_mult =, freeze = {router
-- =, experts =, attention =}, sparse =, offload =}: groups in moelua.optim's format.
-- Norms and embeddings get weight_decay = 0; the router gets lr_mult; with
-- sparse = true, expert groups (gate_up, down of each layer) carry experts = the
-- experts this rank holds (E, or E/ep with expert parallelism)
-- for lazy Adam (then pass model:active_masks(groups) to AdamW:step). With
-- offload = true (for AdamW's offload) the groups carry no state buffers and
-- none is reserved (moelua.zero's groups).
local GROUP_OPTIONS = {weight_decay = {"number", false, min = 0}, router_lr_mult = {"number", false, min = 0},
                       freeze = {"table", false}, sparse = {"boolean", false}, offload = {"boolean", false}}

function Transformer:param_groups(o)
  local fn = "moelua.nn.Transformer:param_groups"
  o = options.check(o, GROUP_OPTIONS, function(fmt, ...) error(fn .. ": " .. fmt:format(...), 4) end)
  local fr = o.freeze or {}
  for k, v in pairs(fr) do
    if not FREEZE_KEYS[k] or type(v) ~= "boolean" then
      error(string.format("%s: bad option 'freeze.%s' (router, experts, attention: booleans)", fn,
                          tostring(k)), 2)
    end
  end
  local wd = o.weight_decay
  local attrs = {   -- per group label: weight_decay, lr_mult, frozen, experts
    embed = {weight_decay = 0}, attention = {weight_decay = wd, frozen = fr.attention or false},
    norms = {weight_decay = 0}, router = {weight_decay = wd, lr_mult = o.router_lr_mult, frozen = fr.router or false},
    lm_head = {weight_decay = wd}, norm = {weight_decay = 0},
  }
  attrs["experts.gate_up"] = {weight_decay = wd, frozen = fr.experts or false,
                              experts = o.sparse and self.local_experts or nil}
  attrs["experts.down"] = attrs["experts.gate_up"]
  for _, u in ipairs(self.units) do
    local prefix = u.name:match("^(layers%.%d+%.)") or ""
    local by_label = {}
    u.groups = {}
    for _, seg in ipairs(u.layout:segments()) do
      local label = LABELS[seg.name]
      if not by_label[label] then
        by_label[label] = {name = prefix .. label}
        for k, v in pairs(attrs[label]) do by_label[label][k] = v end
      end
      u.groups[seg.name] = by_label[label]
    end
  end
  self.sparse = o.sparse or false
  return self.zero:groups{states = not o.offload}
end

-- masks = model:layer_masks(): {[i] = u8 [E]}, every MoE layer's active
-- experts (model:active_experts), agreed over ranks.
function Transformer:layer_masks()
  local layer = {}
  for i = 1, #self.blocks do
    layer[i] = self.zero:agree_active(self:active_experts(i), "active experts of layer " .. (i - 1))
  end
  return layer
end

-- masks = model:active_masks(groups): {[gi] = u8 [experts of the group]}
-- for the groups of param_groups{sparse = true} that carry experts
-- (AdamW:step's argument). With several ranks every layer's mask is first
-- agreed (an expert active on any rank is active on all); a group of one
-- expert's slice of a shard (moelua.zero) gets that expert's entry.
function Transformer:active_masks(groups)
  local masks = {}
  if not self.sparse then return masks end
  local z, layer = self.zero, self:layer_masks()
  for gi, g in ipairs(groups) do
    local i = g.experts and tonumber(g.name:match("^layers%.(%d+)%.experts"))
    if i then
      local e, first = z.group_at[gi] and z.group_at[gi].expert, self.first_expert
      masks[gi] = e and layer[i + 1]:narrow(1, first + e + 1, 1) or layer[i + 1]:narrow(1, first + 1, self.local_experts)
    end
  end
  return masks
end

-- The model's tensors under Hugging Face Mixtral names, from the params
-- (which = "params") or the gradients ("grads") of the flat units.
-- With expert parallelism the experts of other ranks are listed only when
-- `all` is given, as {name, shape, remote = true, unit, segment} without a
-- tensor (unit: this rank's experts unit of the same layer).
local function named(self, which, all)
  local out = {}
  local u
  local function add(n, t)
    if which == "params" and u.master and self.zero.stage == 0 then   -- the whole f32 masters
      t = u.master:view_at(t:storage_offset() - u.params:storage_offset(), t:shape())
    end
    out[#out + 1] = {name = n, tensor = t, unit = u}
  end
  local F, D, grads = self.opts.ffn, self.opts.dim, which == "grads"
  local first, El = self.first_expert, self.local_experts
  u = self.units[1]
  add("model.embed_tokens.weight", grads and self.embed.grad or self.embed.weight)
  for i, b in ipairs(self.blocks) do
    local p, xp = grads and b.grads or b.params, grads and b.xgrads or b.xparams
    local pre = "model.layers." .. (i - 1) .. "."
    u = b.dense
    add(pre .. "input_layernorm.weight", p.input_layernorm)
    for _, k in ipairs{"q", "k", "v", "o"} do add(pre .. "self_attn." .. k .. "_proj.weight", p[k]) end
    add(pre .. "post_attention_layernorm.weight", p.post_attention_layernorm)
    add(pre .. "block_sparse_moe.gate.weight", p.wg)
    u = b.experts
    for e = 0, self.opts.experts - 1 do
      local ep = pre .. "block_sparse_moe.experts." .. e .. "."
      local l = e - first + 1   -- the expert's place in this rank's unit
      if u.stored then   -- in the store: where in expert e's slab (its parameters: gate_up, then down)
        for _, w in ipairs{{"w1", 0, {F, D}, "gate_up"}, {"w2", 2 * F * D, {D, F}, "down"},
                           {"w3", F * D, {F, D}, "gate_up"}} do
          out[#out + 1] = {name = ep .. w[1] .. ".weight", shape = w[3], unit = u, segment = w[4],
                           stored = {es = u.stored, layer = i - 1, expert = e, at = w[2], which = which}}
        end
      elseif l >= 1 and l <= El then
        local gu = xp.gate_up:select(1, l)
        add(ep .. "w1.weight", gu:narrow(1, 1, F))
        add(ep .. "w2.weight", xp.down:select(1, l))
        add(ep .. "w3.weight", gu:narrow(1, F + 1, F))
      elseif all then
        for _, w in ipairs{{"w1", {F, D}}, {"w2", {D, F}}, {"w3", {F, D}}} do
          out[#out + 1] = {name = ep .. w[1] .. ".weight", shape = w[2], remote = true, unit = u,
                           segment = w[1] == "w2" and "down" or "gate_up"}
        end
      end
    end
  end
  local f = grads and self.final_grads or self.final_params
  u = self.units[#self.units]
  add("model.norm.weight", f.norm)
  add("lm_head.weight", f.lm_head)
  return out
end

-- model:named_parameters(): ordered {name = HF Mixtral name, tensor = view}
-- of the parameters this rank holds (with expert parallelism: its experts;
-- with dtype "bf16" at ZeRO stage 0, views of the f32 masters).
function Transformer:named_parameters() return named(self, "params") end

-- model:parameter_entries(): every parameter of the whole model in the
-- same order as {name, shape, unit, frozen} (a checkpoint's header, the
-- same on every rank; another rank's expert names this rank's experts unit
-- of its layer).
function Transformer:parameter_entries()
  local out = {}
  for i, p in ipairs(named(self, "params", true)) do
    out[i] = {name = p.name, shape = p.shape or p.tensor:shape(), unit = p.unit, frozen = self.zero:frozen(p)}
  end
  return out
end

-- model:named_gradients(): the same names, with views of the gradients.
function Transformer:named_gradients() return named(self, "grads") end

local LOAD_DTYPES = {f32 = true, bf16 = true, f16 = true, f64 = true}
-- The options config.json holds: {option, config.json's key, read as an
-- "int" (>= 1; optional: may be absent) or a "num" (default when absent)};
-- shape: it fixes the parameters' shapes and routing. model:config(),
-- options_from_config, load_named and from_config's errors read this one list.
local CONFIG = {
  {"vocab", "vocab_size", "int", shape = true}, {"dim", "hidden_size", "int", shape = true},
  {"ffn", "intermediate_size", "int", shape = true}, {"layers", "num_hidden_layers", "int", shape = true},
  {"heads", "num_attention_heads", "int", shape = true},
  {"kv_heads", "num_key_value_heads", "int", shape = true, optional = true},
  {"head_dim", "head_dim", "int", shape = true, optional = true},
  {"experts", "num_local_experts", "int", shape = true}, {"topk", "num_experts_per_tok", "int", shape = true},
  {"max_position", "max_position_embeddings", "int", optional = true},
  {"rope_theta", "rope_theta", "num", default = 1e6}, {"norm_eps", "rms_norm_eps", "num", default = 1e-5},
  {"aux_weight", "router_aux_loss_coef", "num", default = 0.02},
  {"init_std", "initializer_range", "num", default = 0.02},
}

-- config.json keys that change the math with the same shapes (the weights
-- were trained with them): compared as the shape keys are
local MATH_KEYS = {"rope_theta", "rms_norm_eps", "tie_word_embeddings", "hidden_act"}

local function shape_str(s) return "[" .. table.concat(s, ", ") .. "]" end

-- check_named's per-tensor checks: every parameter present with its shape
-- and a floating dtype, and no other tensor; each problem goes to bad.
local function check_tensors(model, tensors, bad)
  local want = {}
  for _, p in ipairs(named(model, "params", true)) do
    want[p.name] = true
    local t, exp = tensors[p.name], p.shape or p.tensor:shape()
    if t == nil then
      bad("missing tensor '%s' (shape %s)", p.name, shape_str(exp))
    elseif not (tensor.is_tensor(t) or ckpt.is_source(t)) then
      bad("'%s' is a %s, not a tensor", p.name, type(t))
    else
      local dt = t:dtype()
      if not LOAD_DTYPES[dt] then
        bad("'%s' has dtype %s, expected a floating type (F32, BF16, F16, F64)", p.name, dt:upper())
      end
      local got = t:shape()
      if shape_str(got) ~= shape_str(exp) then
        bad("'%s' has shape %s, the model expects %s", p.name, shape_str(got), shape_str(exp))
      end
    end
  end
  local extra = {}
  for name in pairs(tensors) do
    if not want[name] then extra[#extra + 1] = tostring(name) end
  end
  table.sort(extra)
  for _, name in ipairs(extra) do bad("unexpected tensor '%s' (the model has no such parameter)", name) end
end

-- model:load_named(tensors [, opts]): copy a checkpoint's tensors
-- {HF name -> tensor or moelua.ckpt source} into the parameters (a source
-- is read straight into the parameter's view, on the model's device).
-- Everything is checked before anything is copied: opts.config (a
-- MixtralConfig table, when given) against the model's shape keys and
-- those that change its math (rope_theta, rms_norm_eps, tied embeddings,
-- the activation); every
-- parameter present, no other tensor, equal shapes, floating dtypes (F32,
-- BF16, F16, F64).
-- opts.source names the checkpoint in errors. One error lists every
-- mismatch (the first 8). Used by --init-from and by resume.
function Transformer:load_named(tensors, opts)
  local params = self:check_named(tensors, opts, "load_named")
  local z = self.zero
  if self.opts.dtype == "bf16" then   -- into this rank's f32 masters, then the bf16 copies from them
    for _, pc in ipairs(z:pieces(params)) do
      local t, into = tensors[pc.name], z:param_view(pc)
      if ckpt.is_source(t) then
        t:read_range(pc.at, into)
      else
        into:copy_(t:contiguous():view({t:numel()}):narrow(1, pc.at + 1, pc.n))
      end
    end
    z:gather_params(true)
    return
  end
  local by_unit = {}
  for _, p in ipairs(params) do
    by_unit[p.unit] = by_unit[p.unit] or {}
    table.insert(by_unit[p.unit], p)
  end
  local function load(p, into)
    local t = tensors[p.name]
    if ckpt.is_source(t) then t:read_into(into) else into:copy_(t) end
  end
  for _, u in ipairs(self.units) do   -- one unit's whole parameters at a time (ZeRO-3)
    if u.stored then   -- an expert store's: each into its expert's slab
      for _, p in ipairs(by_unit[u]) do
        local st = p.stored
        st.es:edit_params(st.layer, st.expert, function(v) load(p, v.params:view_at(st.at, p.shape)) end)
      end
    else
      self.zero:edit(u, function()
        for _, p in ipairs(by_unit[u]) do load(p, p.tensor) end
      end)
    end
  end
end

-- params = model:check_named(tensors [, opts]): load_named's checks alone
-- (a sharded resume reads each rank's ranges itself); returns
-- named_parameters().
function Transformer:check_named(tensors, opts, caller)
  local fn = "moelua.nn.Transformer:" .. (caller or "check_named")
  local level = caller and 3 or 2
  opts = opts or {}
  if type(tensors) ~= "table" then error(fn .. ": argument #1: expected a table {name -> tensor}", level) end
  local src = opts.source and (" (" .. opts.source .. ")") or ""
  local problems = {}
  local function bad(fmt, ...) problems[#problems + 1] = string.format(fmt, ...) end
  local reshaped = false   -- a shape key differs: every tensor's shape follows, so they go unlisted
  if opts.config then
    local mine = self:config()
    for _, c in ipairs(CONFIG) do
      local v = c.shape and opts.config[c[2]]
      if v and v ~= mine[c[2]] then
        bad("config.json has %s = %s, the model has %s (option %s)", c[2], tostring(v), tostring(mine[c[2]]), c[1])
        reshaped = true
      end
    end
    for _, k in ipairs(MATH_KEYS) do
      local v = opts.config[k]
      if v ~= nil and v ~= mine[k] then
        bad("config.json has %s = %s, the model has %s (the same shapes, other math)", k, tostring(v),
            tostring(mine[k]))
      end
    end
  end
  if not reshaped then check_tensors(self, tensors, bad) end
  if #problems > 0 then
    local shown = {}
    for i = 1, math.min(#problems, 8) do shown[i] = problems[i] end
    local more = #problems > 8 and string.format("; and %d more", #problems - 8) or ""
    if reshaped then
      more = more .. " (the tensors' shapes follow from these: build the model with the checkpoint's options)"
    end
    errors.user(string.format("%s: the checkpoint%s does not match the model: %s%s", fn, src,
                              table.concat(shown, "; "), more))
  end
  return self:named_parameters()
end

-- model:config(): a MixtralConfig table (config.json's keys).
function Transformer:config()
  local o = self.opts
  local cfg = {model_type = "mixtral", architectures = {"MixtralForCausalLM"}, tie_word_embeddings = false,
               hidden_act = "silu", torch_dtype = o.dtype == "f64" and "float64" or "float32"}
  for _, c in ipairs(CONFIG) do cfg[c[2]] = o[c[1]] end
  return cfg
end

-- opts = Transformer.options_from_config(cfg): nn.Transformer options from a
-- MixtralConfig table (config.json), every key checked; the inverse of
-- model:config(). Transformer.from_config(cfg [, extra]) builds the model
-- (extra: options such as checkpoint, moe, ce_rows).
function Transformer.options_from_config(cfg)
  local fn = "moelua.nn.Transformer.from_config"
  if type(cfg) ~= "table" then error(fn .. ": expected a config table, got " .. type(cfg), 2) end
  -- a file's content: a user error (a checkpoint's config.json), printed without a traceback
  local function need(c, fmt, ...) if not c then errors.user(fn .. ": config.json: " .. string.format(fmt, ...)) end end
  local function shown(v) return type(v) == "string" and string.format("%q (a string)", v) or tostring(v) end
  local function int(key, optional)
    local v = cfg[key]
    if v == nil and optional then return nil end
    need(v ~= nil, "'%s' is missing", key)
    need(math.type(v) == "integer" and v >= 1 and v <= 0x7fffffff, "'%s' must be an integer in [1, 2147483647], got %s",
         key, shown(v))
    return v
  end
  local function num(key, default)
    local v = cfg[key]
    if v == nil then return default end
    need(type(v) == "number", "'%s' must be a number, got %s", key, shown(v))
    return v + 0.0
  end
  need(cfg.model_type == nil or cfg.model_type == "mixtral", "model_type is '%s', expected 'mixtral'",
       tostring(cfg.model_type))
  need(not cfg.tie_word_embeddings, "tie_word_embeddings = true is not supported (moelua has a separate lm_head)")
  need(cfg.hidden_act == nil or cfg.hidden_act == "silu", "hidden_act '%s' is not supported (silu only)",
       tostring(cfg.hidden_act))
  local o = {}
  for _, c in ipairs(CONFIG) do
    if c[3] == "int" then o[c[1]] = int(c[2], c.optional) else o[c[1]] = num(c[2], c.default) end
  end
  local sw = cfg.sliding_window
  need(sw == nil or (type(sw) == "number" and sw >= (o.max_position or 131072)),
       "sliding_window = %s is not supported (full causal attention only)", tostring(sw))
  return o
end

-- config.json's key of each option options_from_config sets, for
-- Transformer.new's errors about them
local CONFIG_KEY = {}
for _, c in ipairs(CONFIG) do CONFIG_KEY[c[1]] = c[2] end

function Transformer.from_config(cfg, extra)
  local o = Transformer.options_from_config(cfg)
  for k, v in pairs(extra or {}) do o[k] = v end
  local ok, err = pcall(check_options, o)   -- (checks only: Transformer.new checks again)
  local name = not ok and errors.is_user(err) and tostring(err):match("option '([%w_]+)'")
  if name and CONFIG_KEY[name] and (extra or {})[name] == nil then   -- named as the file names it
    errors.user(string.format("%s (config.json's %s)", tostring(err), CONFIG_KEY[name]))
  end
  return Transformer.new(o)
end

-- model, c = Transformer.from_checkpoint(dir [, extra]): the model of a
-- checkpoint (ckpt.load: a step directory, a root with `latest`, or a
-- Mixtral directory) rebuilt from its config.json (from_config, extra as
-- there) with its weights loaded by name (load_named). c is ckpt.load's
-- table without c.model (dir, config, trainer, ...).
function Transformer.from_checkpoint(dir, extra)
  local c = ckpt.load(dir)
  if not c.config then errors.user("moelua.nn.Transformer.from_checkpoint: " .. c.dir .. " has no config.json") end
  local model = Transformer.from_config(c.config, extra)
  model:load_named(c.model, {source = c.dir})
  c.model = nil
  collectgarbage()
  return model, c
end

-- logits = model:last_logits(): f32 [V] (a new tensor), the LM head's logits
-- at the last position of the last forward (rmsnorm_f(hL)[S] . lm_head^T), for
-- generation: forward(context .. any one token) then sample from these.
function Transformer:last_logits()
  local st = self.state
  if not st then error("moelua.nn.Transformer:last_logits: no forward (or backward consumed it)", 2) end
  local h = st.hf:narrow(1, st.S, 1)
  local uf = self.units[#self.units]
  self.zero:acquire(uf)
  local out = tensor.matmul(h, self.final_params.lm_head:t())
  self.zero:release(uf)
  return out:view({self.opts.vocab})
end

-- ---- decoding with a KV cache -----------------------------------------------

-- cache = model:kv_cache(positions): a moelua.nn.KVCache for this model's
-- layers and kv heads, in its dtype on its device, holding up to
-- `positions` positions.
function Transformer:kv_cache(positions)
  local o = self.opts
  return KVCache.new{layers = o.layers, positions = positions, kv_heads = o.kv_heads, head_dim = o.head_dim,
                     dtype = o.dtype, device = o.device}
end

-- logits = model:decode(ids, cache [, route]): inference, nothing saved for
-- a backward. ids i64 [n] are the tokens at positions [cache.len, cache.len
-- + n) (a prompt to prefill, then one generated token at a time); each
-- layer's attention adds their keys and values to the cache and attends
-- over all its positions (Attention:decode), its MoE block routes the n
-- tokens only; cache.len advances by n. Returns the LM head's logits at
-- the last of them, f32 [V] (a new tensor). With route = {}, route.layers[l]
-- and route.weights[l] become that position's top-k experts (0-based ids)
-- and combine weights in layer l. Each layer's activations end with it
-- (the pool is rewound per layer): memory is the cache and one layer of n
-- tokens.
function Transformer:decode(ids, cache, route)
  local FNd = "moelua.nn.Transformer:decode: "
  if not tensor.is_tensor(ids) or ids:dim() ~= 1 or ids:dtype() ~= "i64" or ids:numel() < 1 then
    error(FNd .. "ids must be an i64 tensor [n] with n >= 1", 2)
  end
  if getmetatable(cache) ~= KVCache or #cache.layers ~= #self.blocks then
    error(FNd .. "argument #2: expected this model's KV cache (model:kv_cache(positions))", 2)
  end
  local n, pos = ids:numel(), cache.len
  if pos + n > cache.positions then
    error(string.format("%s%d positions cached and %d new exceed the cache's %d", FNd, pos, n, cache.positions), 2)
  end
  self:release()
  local out = mem.scope("acts", function()
    local D, dt, z, units, p = self.opts.dim, {dtype = self.opts.dtype}, self.zero, self.units, self.pool
    if ids:device() ~= self.opts.device then ids = ids:to(self.opts.device) end
    z:begin("forward", units)
    z:acquire(units[1])
    local e = self.embed:forward(ids)
    z:release(units[1])
    local h, h1 = p:tensor({n, D}, dt):copy_(e), p:tensor({n, D}, dt)
    e:free()
    for i, b in ipairs(self.blocks) do
      local mark = p:mark()
      z:acquire(b.dense)
      local a, r1 = b.norm1:forward(h)
      h1:copy_(h):add_(b.attn:decode(a, cache.layers[i], pos))
      a:free(); r1:free()
      z:acquire(b.experts)
      local mc = moe_part(b, h1, h, 0)   -- h = h1 + moe(norm2(h1)): this layer's input is spent
      mc.m:free(); mc.r2:free()
      z:release(b.experts)
      z:release(b.dense)
      if route then
        local c = b.moe.layer.ctx
        local row = c.idx:select(1, n):totable()
        for j = 1, #row do row[j] = math.tointeger(row[j]) end
        route.layers = route.layers or {}
        route.weights = route.weights or {}
        route.layers[i], route.weights[i] = row, c.w:select(1, n):to("f64"):totable()
      end
      p:rewind(mark)
    end
    local uf = units[#units]
    z:acquire(uf)
    local hf, rf = self.norm:forward(h:narrow(1, n, 1))
    local lg = tensor.matmul(hf, self.final_params.lm_head:t())
    z:release(uf)
    hf:free(); rf:free()
    return lg
  end)
  self.pool:reset()
  cache.len = pos + n
  return out:view({self.opts.vocab})
end

return Transformer
