-- moelua.nn.Attention: causal grouped-query self-attention with RoPE, HF
-- MixtralAttention semantics: q = x Wq^T, k = x Wk^T, v = x Wv^T (Linear
-- weights [out, in], no bias), rotate-half RoPE on q and k with angles in
-- f64 (theta configurable), query head h reads kv head floor(h / (H/KV)),
-- tiled flash attention (moelua.ops: online softmax, lse saved, never a
-- T x T matrix), out = o Wo^T.
--
--   local att = Attention.new{dim =, heads =, kv_heads =, head_dim =, theta =,
--                             params = {q =, k =, v =, o =}, grads = {...}, pool = p}
--   local y, ctx = att:forward(x)        -- x [S, D] -> y [S, D] (a pool view)
--   local dx = att:backward(dy, ctx)     -- weight grads accumulate (+=)
--   att:release(ctx)                     -- frees ctx's non-pool tensors
--   local y = att:decode(x, kv, pos)     -- inference: x [n, D] at positions pos.. (below)
--
-- Projections and outputs are views into the caller's stack pool (the
-- caller marks and rewinds, LIFO); RoPE rotates q and k there, in place
-- (and the gradients of the attention's q and k the same way), so no
-- buffer is made for it; attention outputs come from
-- moelua.ops as tensors and are freed by release(). Weights are views
-- into the model's flat dense unit: q [H*hd, D], k, v [KV*hd, D], o [D, H*hd].
-- profile (optional): a table whose `attention` (seconds) and
-- `attention_flop` (matmul FLOPs) each call adds to (the model's profile).
local tensor = require "moelua.tensor"
local ops = require "moelua.ops"
local now = require("moelua.bench").now

local Attention = {}
Attention.__index = Attention

function Attention.new(o)
  local self = setmetatable({}, Attention)
  self.D, self.H, self.KV = o.dim, o.heads, o.kv_heads
  self.hd = o.head_dim or o.dim // o.heads
  self.theta = o.theta or 1e6
  self.params, self.grads, self.pool, self.profile = o.params, o.grads, o.pool, o.profile
  return self
end

-- proj, core = att:flops(S): forward matmul FLOPs for S tokens: the four
-- projections and causal Q K^T and P V (S (S + 1) / 2 scores per head).
function Attention:flops(S)
  local proj = 2 * S * self.D * (2 * self.H * self.hd + 2 * self.KV * self.hd)
  local core = 2 * self.H * self.hd * S * (S + 1)
  return proj, core
end

local function account(self, t0, flops, dev)
  local pf = self.profile
  if pf then
    pf.attention = pf.attention + (now(dev) - t0)
    pf.attention_flop = pf.attention_flop + flops
  end
end

-- x rotated in place by RoPE (inverse: the backward's), positions from offset
local function rope_(self, x, offset, inverse)
  local f = inverse and ops.rope_backward or ops.rope_forward
  return f(x, {theta = self.theta, offset = offset, out = x})
end

local function linear(pool, x, w)            -- x [S, in] . w[out, in]^T -> pool [S, out]
  local y = pool:tensor({x:size(1), w:size(1)}, {dtype = x:dtype()})
  return tensor.matmul(x, w:t(), {out = y})
end

-- gw += dy2^T x. The transpose is freed at once: a view holds its storage
-- until freed or collected, and the trainer holds the collector through a
-- step, so an [S, out] gradient would outlive its :free() by the step.
local function add_wgrad(gw, dy2, x)
  local t = dy2:t()
  tensor.matmul(t, x, {out = gw, beta = 1})
  t:free()
end

function Attention:forward(x)
  local t0 = self.profile and now(x:device())
  local S, H, KV, hd, p = x:size(1), self.H, self.KV, self.hd, self.params
  local q = linear(self.pool, x, p.q)                              -- [S, H*hd]
  local k = linear(self.pool, x, p.k)                              -- [S, KV*hd]
  local v = linear(self.pool, x, p.v):view({S, KV, hd})
  local qr = rope_(self, q:view({S, H, hd}))
  local kr = rope_(self, k:view({S, KV, hd}))
  local o, lse = ops.attention_forward(qr, kr, v)                  -- [S, H, hd], [H, S] f64
  local o2 = o:view({S, H * hd})
  local y = linear(self.pool, o2, p.o)                             -- [S, D]
  o2:free()   -- (views hold their storage until freed: see add_wgrad)
  if t0 then
    local proj, core = self:flops(S)
    account(self, t0, proj + core, x:device())
  end
  return y, {x = x, qr = qr, kr = kr, v = v, o = o, lse = lse}
end

-- y = att:decode(x, kv, pos): the forward of x [n, D] at positions
-- [pos, pos + n) against a KV cache's layer kv = {k =, v =} (moelua.nn.KVCache)
-- that holds the keys (after RoPE) and values of positions [0, pos): the
-- new keys and values are written to rows [pos, pos + n), the queries
-- attend to rows [0, pos + n) (attention_forward with fewer queries than
-- keys). Nothing is saved for a backward; y [n, D] is a pool view.
function Attention:decode(x, kv, pos)
  local n, H, KV, hd, p = x:size(1), self.H, self.KV, self.hd, self.params
  local qr = rope_(self, linear(self.pool, x, p.q):view({n, H, hd}), pos)
  ops.rope_forward(linear(self.pool, x, p.k):view({n, KV, hd}),
                   {theta = self.theta, offset = pos, out = kv.k:narrow(1, pos + 1, n)})
  kv.v:narrow(1, pos + 1, n):copy_(linear(self.pool, x, p.v):view({n, KV, hd}))
  local o, lse = ops.attention_forward(qr, kv.k:narrow(1, 1, pos + n), kv.v:narrow(1, 1, pos + n))
  lse:free()
  local o2 = o:view({n, H * hd})
  local y = linear(self.pool, o2, p.o)
  o:free(); o2:free()
  return y
end

function Attention:backward(dy, c)
  local t0 = self.profile and now(dy:device())
  local S, H, KV, hd, p, g = dy:size(1), self.H, self.KV, self.hd, self.params, self.grads
  local dt = {dtype = dy:dtype()}
  local o2 = c.o:view({S, H * hd})
  local dout = tensor.matmul(dy, p.o, {out = self.pool:tensor({S, H * hd}, dt)})
  add_wgrad(g.o, dy, o2)                                           -- dWo += dy^T o
  o2:free()
  local dq, dk, dv = ops.attention_backward(dout:view({S, H, hd}), c.qr, c.kr, c.v, c.o, c.lse)
  rope_(self, dq, 0, true)
  rope_(self, dk, 0, true)
  local dq2, dk2, dv2 = dq:view({S, H * hd}), dk:view({S, KV * hd}), dv:view({S, KV * hd})
  add_wgrad(g.q, dq2, c.x)
  add_wgrad(g.k, dk2, c.x)
  add_wgrad(g.v, dv2, c.x)
  local dx = tensor.matmul(dq2, p.q, {out = self.pool:tensor({S, self.D}, dt)})
  tensor.matmul(dk2, p.k, {out = dx, beta = 1})
  tensor.matmul(dv2, p.v, {out = dx, beta = 1})
  dq:free(); dk:free(); dv:free(); dq2:free(); dk2:free(); dv2:free()
  if t0 then   -- projections: 2x forward; flash backward: 5 matmuls (Q K^T recomputed) vs 2
    local proj, core = self:flops(S)
    account(self, t0, 2 * proj + 2.5 * core, dy:device())
  end
  return dx
end

function Attention:release(c)
  c.o:free(); c.lse:free()
end

return Attention
