-- moelua.ops (host/bindings/l_ops.c; kernels/rmsnorm.c, embedding.c, crossentropy.c,
-- rope.c, attention.c): each forward against a float64 reference written
-- here in plain Lua loops, finite-difference gradient checks in f64 for
-- every input and weight, and bad-input messages.
--
-- Tolerances (normwise relative error ||x - ref|| / ||ref||):
--   f64 forwards: 1e-12
--   f32 forwards: 1e-6 (rmsnorm, rope: f64 inside, one rounding of
--                 inputs/outputs; attention: sgemm tiles, f32 softmax);
--                 1e-5 for cross-entropy (sgemm logits)
--   f32 attention against the f64 path, outputs and gradients: 1e-5
--   gradients: central differences in f64, h = 1e-5, normwise 1e-6, on the
--              scalar L = sum(out * R) with a fixed random R
-- Bitwise across thread counts (compared exactly, 1 vs 4 threads): rmsnorm
-- forward/backward, embedding forward/backward, rope, attention
-- forward/backward (f32 and f64; f32 attention's 1- and 4-thread backwards
-- take different schemes that must give the same bits). Cross-entropy goes through BLAS and is compared to a
-- tolerance across chunk sizes (chunk-size invariance, 1e-12 in f64).
local m = require "moelua"
local ops = require "moelua.ops"
local support = require "tests.support"

local THREADS0 = m.threads()
local H_FD, GRAD_TOL = 1e-5, 1e-6

-- ---- helpers ---------------------------------------------------------------

local vals = support.values
local assert_close, errmsg, has = support.assert_close, support.errmsg, support.has

local function assert_same(a, b, what)
  local x, y = vals(a), vals(b)
  assert.are.equal(#x, #y, what)
  for i = 1, #x do
    if x[i] ~= y[i] then error(string.format("%s: element %d differs: %.17g vs %.17g", what, i, x[i], y[i])) end
  end
end

local seed = 777
local function randflat(n, scale)
  seed = seed + 1
  local v = vals(m.randn({n}, {dtype = "f64", seed = seed}))
  for i = 1, n do v[i] = v[i] * (scale or 1) end
  return v
end

-- a tensor of dtype dt and the given shape from a flat Lua array
local function T(flat, shape, dt)
  return m.tensor(flat, {dtype = dt or "f64"}):reshape(shape)
end

local function ids(list, n)
  return m.tensor(list, {dtype = "i64"}):reshape({n or #list})
end

local function dot(a, b)
  local s = 0
  for i = 1, #a do s = s + a[i] * b[i] end
  return s
end

-- central differences of f() with respect to every entry of flat
local function fd(f, flat)
  local g = {}
  for i = 1, #flat do
    local x0 = flat[i]
    flat[i] = x0 + H_FD
    local lp = f()
    flat[i] = x0 - H_FD
    local lm = f()
    flat[i] = x0
    g[i] = (lp - lm) / (2 * H_FD)
  end
  return g
end

local function with_threads(n, f)
  m.threads(n)
  local ok, a, b, c, d = pcall(f)
  m.threads(THREADS0)
  assert(ok, a)
  return a, b, c, d
end

-- ---- references (plain Lua, f64) ---------------------------------------------

local function ref_rmsnorm(x, w, N, D, eps)
  local y = {}
  for n = 0, N - 1 do
    local ss = 0
    for d = 1, D do ss = ss + x[n * D + d] ^ 2 end
    local r = 1 / math.sqrt(ss / D + eps)
    for d = 1, D do y[n * D + d] = x[n * D + d] * r * w[d] end
  end
  return y
end

local function ref_ce(h, W, tg, S, V, D)
  local total = 0
  for s = 0, S - 1 do
    local lg, mx = {}, -math.huge
    for v = 0, V - 1 do
      local z = 0
      for d = 1, D do z = z + h[s * D + d] * W[v * D + d] end
      lg[v] = z
      mx = math.max(mx, z)
    end
    local sum = 0
    for v = 0, V - 1 do sum = sum + math.exp(lg[v] - mx) end
    total = total + (mx + math.log(sum)) - lg[tg[s + 1]]
  end
  return total / S
end

local function ref_rope(x, S, NH, hd, offset, theta, dt)
  local y, half = {}, hd // 2
  local function round(c)
    if dt == "f32" then return string.unpack("f", string.pack("f", c)) end
    return c
  end
  for s = 0, S - 1 do
    for i = 0, half - 1 do
      local a = (offset + s) * theta ^ (-(2 * i) / hd)
      local c, sn = round(math.cos(a)), round(math.sin(a))
      for h = 0, NH - 1 do
        local b = (s * NH + h) * hd
        local x0, x1 = x[b + i + 1], x[b + i + half + 1]
        y[b + i + 1] = x0 * c - x1 * sn
        y[b + i + half + 1] = x1 * c + x0 * sn
      end
    end
  end
  return y
end

-- naive softmax(Q K^T / sqrt(hd)) V with the causal mask, GQA; the S
-- queries sit at positions P.. (P > 0: a KV cache holds P + S keys)
local function ref_attention(q, k, v, S, H, KV, hd, P)
  local out, G, scale = {}, H // KV, 1 / math.sqrt(hd)
  P = P or 0
  for h = 0, H - 1 do
    local g = h // G
    for i = 0, S - 1 do
      local sc, mx, last = {}, -math.huge, P + i
      for j = 0, last do
        local z = 0
        for d = 1, hd do z = z + q[(i * H + h) * hd + d] * k[(j * KV + g) * hd + d] end
        sc[j] = z * scale
        mx = math.max(mx, sc[j])
      end
      local sum = 0
      for j = 0, last do sc[j] = math.exp(sc[j] - mx); sum = sum + sc[j] end
      for d = 1, hd do
        local o = 0
        for j = 0, last do o = o + sc[j] / sum * v[(j * KV + g) * hd + d] end
        out[(i * H + h) * hd + d] = o
      end
    end
  end
  return out
end

-- ---- rmsnorm -------------------------------------------------------------------

describe("moelua.ops rmsnorm", function()
  local N, D, eps = 5, 12, 1e-5

  it("matches the f64 reference in f64 and f32, for any leading shape", function()
    local x, w = randflat(N * D), randflat(D)
    local ref = ref_rmsnorm(x, w, N, D, eps)
    local y, r = ops.rmsnorm_forward(T(x, {N, D}), T(w, {D}), eps)
    assert_close(y, ref, 1e-12, "f64")
    assert.are.same({N}, r:shape())
    local y3 = ops.rmsnorm_forward(T(x, {1, N, D}, "f32"), T(w, {D}, "f32"), eps)
    assert.are.same({1, N, D}, y3:shape())
    assert_close(y3, ref, 1e-6, "f32")
  end)

  it("gradients of x and w match finite differences", function()
    local x, w, R = randflat(N * D), randflat(D), randflat(N * D)
    local function loss()
      return dot(vals(ops.rmsnorm_forward(T(x, {N, D}), T(w, {D}), eps)), R)
    end
    local y, r = ops.rmsnorm_forward(T(x, {N, D}), T(w, {D}), eps)
    local dw0 = T(randflat(D), {D})
    local dw0v = vals(dw0)
    local dx, dw = ops.rmsnorm_backward(T(R, {N, D}), T(x, {N, D}), T(w, {D}), r, dw0)
    assert.are.equal(dw0, dw)   -- accumulated in place
    local gx, gw = fd(loss, x), fd(loss, w)
    assert_close(dx, gx, GRAD_TOL, "dx")
    local acc = {}
    for i = 1, D do acc[i] = dw0v[i] + gw[i] end
    assert_close(dw, acc, GRAD_TOL, "dw (+=)")
  end)

  it("is bitwise identical for 1 and 4 threads", function()
    local NN, DD = 512, 64
    local x, w = m.randn({NN, DD}, {seed = 5}), m.randn({DD}, {seed = 6})
    local dy = m.randn({NN, DD}, {seed = 7})
    local function run()
      local y, r = ops.rmsnorm_forward(x, w)
      local dx, dw = ops.rmsnorm_backward(dy, x, w, r)
      return y, dx, dw
    end
    local y1, dx1, dw1 = with_threads(1, run)
    local y4, dx4, dw4 = with_threads(4, run)
    assert_same(y1, y4, "y")
    assert_same(dx1, dx4, "dx")
    assert_same(dw1, dw4, "dw")
  end)

  it("rejects bad arguments with messages naming them", function()
    local x, w = m.randn({3, 4}), m.randn({4})
    has(errmsg(ops.rmsnorm_forward, x, m.randn({5})), "moelua.ops.rmsnorm_forward: w is [5] but must be [4]")
    has(errmsg(ops.rmsnorm_forward, x, w:to("f64")), "same dtype expected")
    has(errmsg(ops.rmsnorm_forward, x:to("i32"), w), "moelua.ops.rmsnorm_forward: x must be f32 or f64, got i32")
    has(errmsg(ops.rmsnorm_forward, m.randn({4, 3}):t(), w), "x must be contiguous")
    has(errmsg(ops.rmsnorm_forward, x, w, -1), "eps must be finite and >= 0, got -1")
    has(errmsg(ops.rmsnorm_forward, x, w, "a"), "argument #3 (eps) must be a number, got string")
    has(errmsg(ops.rmsnorm_forward, "x", w), "argument #1 (x): expected a tensor, got string")
    has(errmsg(ops.rmsnorm_forward, m.tensor(3), m.randn({1})), "x must have at least 1 dim, got 0")
    local freed = m.randn({3, 4})
    freed:free()
    has(errmsg(ops.rmsnorm_forward, freed, w), "moelua.ops.rmsnorm_forward")
    local _, r = ops.rmsnorm_forward(x, w)
    has(errmsg(ops.rmsnorm_backward, x, x, w, m.zeros({2}, {dtype = "f64"})), "rstd is [2] but must be [3]")
    has(errmsg(ops.rmsnorm_backward, x, x, w, r, m.zeros({3})), "dw is [3] but must be [4]")
  end)
end)

-- ---- embedding -------------------------------------------------------------------

describe("moelua.ops embedding", function()
  local V, D = 7, 5
  local list = {3, 0, 6, 3, 3, 1}

  it("forward gathers rows exactly", function()
    local W = randflat(V * D)
    for _, dt in ipairs({"f32", "f64"}) do
      local out = vals(ops.embedding_forward(ids(list), T(W, {V, D}, dt)))
      local Wr = vals(T(W, {V, D}, dt))
      for t, v in ipairs(list) do
        for d = 1, D do assert.are.equal(Wr[v * D + d], out[(t - 1) * D + d]) end
      end
    end
  end)

  it("gradient of W matches finite differences and accumulates", function()
    local W, R = randflat(V * D), randflat(#list * D)
    local function loss() return dot(vals(ops.embedding_forward(ids(list), T(W, {V, D}))), R) end
    local g = fd(loss, W)
    local dW = ops.embedding_backward(T(R, {#list, D}), ids(list), V)
    assert_close(dW, g, GRAD_TOL, "dW")
    local again = ops.embedding_backward(T(R, {#list, D}), ids(list), dW)
    assert.are.equal(dW, again)
    local twice = {}
    for i = 1, #g do twice[i] = 2 * g[i] end
    assert_close(dW, twice, GRAD_TOL, "dW += dW")
  end)

  it("backward is bitwise identical for 1 and 4 threads", function()
    local TT, VV, DD = 3000, 97, 16
    local l = {}
    local r = vals(m.rand({TT}, {dtype = "f64", seed = 9}))
    for i = 1, TT do l[i] = math.floor(r[i] * VV) end
    local id, dout = ids(l), m.randn({TT, DD}, {seed = 10})
    local a = with_threads(1, function() return ops.embedding_backward(dout, id, VV) end)
    local b = with_threads(4, function() return ops.embedding_backward(dout, id, VV) end)
    assert_same(a, b, "dW")
  end)

  it("rejects bad ids and shapes", function()
    local W = m.randn({V, D})
    has(errmsg(ops.embedding_forward, ids({1, 7}), W),
        "moelua.ops.embedding_forward: ids[2] = 7 is out of range [0, 7)")
    has(errmsg(ops.embedding_forward, ids({-1}), W), "ids[1] = -1 is out of range")
    has(errmsg(ops.embedding_forward, m.tensor({1, 2}, {dtype = "i32"}), W), "moelua.ops.embedding_forward: ids must be i64, got i32")
    has(errmsg(ops.embedding_backward, m.randn({2, D}), ids({1, 2, 3}), V), "dout is [2,5] but must be [3,5]")
    has(errmsg(ops.embedding_backward, m.randn({1, D}), ids({9}), V), "ids[1] = 9 is out of range [0, 7)")
    has(errmsg(ops.embedding_backward, m.randn({1, D}), ids({1}), m.zeros({V, D}, {dtype = "f64"})), "same dtype expected")
    has(errmsg(ops.embedding_backward, m.randn({1, D}), ids({1}), "x"),
        "moelua.ops.embedding_backward: argument #3 (dW): expected a tensor or a vocabulary size, got string")
    has(errmsg(ops.embedding_backward, m.randn({1, D}), ids({1}), 0),
        "moelua.ops.embedding_backward: V must be a positive integer, got 0")
    has(errmsg(ops.embedding_backward, m.randn({1, D}), ids({1}), m.zeros({V, D - 1})),
        "moelua.ops.embedding_backward: dW is [7,4] but must be [7,5]")
    has(errmsg(ops.embedding_backward, m.randn({1, D}), ids({V}), m.zeros({V, D})),
        "moelua.ops.embedding_backward: ids[1] = 7 is out of range [0, 7)")
  end)
end)

-- ---- cross-entropy ---------------------------------------------------------------

describe("moelua.ops cross_entropy", function()
  local S, V, D = 6, 11, 4
  local tl = {0, 10, 3, 3, 7, 5}

  it("loss matches the f64 reference in f64 and f32", function()
    local h, W = randflat(S * D), randflat(V * D)
    local ref = ref_ce(h, W, tl, S, V, D)
    local loss, lse = ops.cross_entropy_forward(T(h, {S, D}), T(W, {V, D}), ids(tl), {chunk = 4, rows = 4})
    assert(math.abs(loss - ref) <= 1e-12 * math.abs(ref), string.format("f64 loss %.17g vs %.17g", loss, ref))
    assert.are.same({S}, lse:shape())
    local l32 = ops.cross_entropy_forward(T(h, {S, D}, "f32"), T(W, {V, D}, "f32"), ids(tl), {chunk = 3})
    assert(math.abs(l32 - ref) <= 1e-5 * math.abs(ref), string.format("f32 loss %.9g vs %.9g", l32, ref))
  end)

  it("gradients of h and W match finite differences (dW accumulates)", function()
    local h, W = randflat(S * D), randflat(V * D)
    local dloss = 1.7
    local function loss()
      return dloss * ops.cross_entropy_forward(T(h, {S, D}), T(W, {V, D}), ids(tl), {chunk = 4, rows = 4})
    end
    local _, lse = ops.cross_entropy_forward(T(h, {S, D}), T(W, {V, D}), ids(tl))
    local base = randflat(V * D)
    local dW0 = T(base, {V, D})
    local dh, dW = ops.cross_entropy_backward(dloss, T(h, {S, D}), T(W, {V, D}), ids(tl), lse,
                                              {chunk = 4, rows = 4, dW = dW0})
    assert.are.equal(dW0, dW)
    local gh, gW = fd(loss, h), fd(loss, W)
    assert_close(dh, gh, GRAD_TOL, "dh")
    for i = 1, #gW do gW[i] = gW[i] + base[i] end
    assert_close(dW, gW, GRAD_TOL, "dW (+=)")
  end)

  it("is invariant to the row and vocabulary chunk sizes", function()
    local h, W = T(randflat(S * D), {S, D}), T(randflat(V * D), {V, D})
    local l0, lse0 = ops.cross_entropy_forward(h, W, ids(tl), {chunk = V, rows = S})
    local dh0, dW0 = ops.cross_entropy_backward(1, h, W, ids(tl), lse0, {chunk = V, rows = S})
    for _, c in ipairs({{1, 1}, {3, 2}, {7, 5}, {100, 1024}}) do
      local o = {chunk = c[1], rows = c[2]}
      local l, lse = ops.cross_entropy_forward(h, W, ids(tl), o)
      assert(math.abs(l - l0) <= 1e-12 * math.abs(l0), "loss chunk " .. c[1] .. "x" .. c[2])
      assert_close(lse, vals(lse0), 1e-12, "lse")
      local dh, dW = ops.cross_entropy_backward(1, h, W, ids(tl), lse, o)
      assert_close(dh, vals(dh0), 1e-12, "dh chunk " .. c[1])
      assert_close(dW, vals(dW0), 1e-12, "dW chunk " .. c[1])
    end
  end)

  it("rejects bad arguments", function()
    local h, W = m.randn({S, D}), m.randn({V, D})
    local fn = "moelua.ops.cross_entropy_forward: "
    has(errmsg(ops.cross_entropy_forward, h, W, ids({0, 1})), fn .. "targets is [2] but must be [6]")
    has(errmsg(ops.cross_entropy_forward, h, W, ids({0, 1, 2, 3, 4, 11})), "targets[6] = 11 is out of range [0, 11)")
    has(errmsg(ops.cross_entropy_forward, h, m.randn({V, D + 1}), ids(tl)), "W is [11,5] but must be [11,4]")
    has(errmsg(ops.cross_entropy_forward, h, W, ids(tl), {rows = 0}), "option 'rows' must be in [1, 1024]")
    has(errmsg(ops.cross_entropy_forward, h, W, ids(tl), {chunk = 1.5}), "option 'chunk' must be an integer")
    has(errmsg(ops.cross_entropy_forward, h, W, ids(tl), {chunks = 4}), "chunks")
    has(errmsg(ops.cross_entropy_forward, h * (0 / 0), W, ids(tl)), fn .. "NaN in the logits")
    has(errmsg(ops.cross_entropy_forward, m.randn({2, 0}), m.randn({5, 0}), ids({0, 1})), "hidden size must be >= 1")
    local _, lse = ops.cross_entropy_forward(h, W, ids(tl))
    has(errmsg(ops.cross_entropy_backward, "1", h, W, ids(tl), lse), "argument #1 (dloss) must be a number")
    has(errmsg(ops.cross_entropy_backward, 1, h, W, ids(tl), m.zeros({S})), "moelua.ops.cross_entropy_backward: lse must be f64, got f32")
    has(errmsg(ops.cross_entropy_backward, 1, h, W, ids(tl), lse, {dW = m.zeros({V, D + 1})}),
        "moelua.ops.cross_entropy_backward: dW is [11,5] but must be [11,4]")
    has(errmsg(ops.cross_entropy_backward, 1, h, W, ids(tl), lse, {dW = m.zeros({V, D}, {dtype = "f64"})}),
        "moelua.ops.cross_entropy_backward: dW is f64 but h is f32 (same dtype expected)")
    has(errmsg(ops.cross_entropy_backward, 1 / 0, h, W, ids(tl), lse),
        "moelua.ops.cross_entropy_backward: dloss must be finite, got inf")
    has(errmsg(ops.cross_entropy_backward, 1, h, W, ids({0, 1, 2, 3, 4, -2}), lse),
        "moelua.ops.cross_entropy_backward: targets[6] = -2 is out of range [0, 11)")
    has(errmsg(ops.cross_entropy_forward, h, W, ids(tl), {dW = W}),
        "moelua.ops.cross_entropy_forward: option 'dW' belongs to cross_entropy_backward")
    has(errmsg(ops.cross_entropy_forward, h, W, ids(tl), 3), fn .. "options must be a table, got number")
    has(errmsg(ops.cross_entropy_forward, m.randn({0, D}), m.randn({0, D}), ids({}, 0)),
        fn .. "W is empty: at least one vocabulary row expected")
  end)
end)

-- ---- rope --------------------------------------------------------------------------

describe("moelua.ops rope", function()
  local S, NH, hd = 5, 3, 8

  it("matches the rotate-half reference with fp64 angles (f64, f32)", function()
    local x = randflat(S * NH * hd)
    for _, c in ipairs({{0, 10000}, {1000, 500000}}) do
      local o = {offset = c[1], theta = c[2]}
      assert_close(ops.rope_forward(T(x, {S, NH, hd}), o), ref_rope(x, S, NH, hd, c[1], c[2], "f64"), 1e-12, "f64")
      assert_close(ops.rope_forward(T(x, {S, NH, hd}, "f32"), o), ref_rope(x, S, NH, hd, c[1], c[2], "f32"), 1e-6, "f32")
    end
  end)

  it("keeps that accuracy on every row of a 16-row tile (angles stepped from the tile's first)", function()
    -- 40 rows: tiles of 16, 16, 8; hd 130: a block of 32 pairs and a partial one.
    -- f32 against the reference on the f32 inputs, its outputs rounded to f32:
    -- equal but for rare 1-ulp ties (cos and sin rounded to f32 too late or
    -- not at all is 1e-8 off)
    local function f32(v)
      local r = {}
      for i, c in ipairs(v) do r[i] = string.unpack("f", string.pack("f", c)) end
      return r
    end
    local n, o = 40, {offset = 3000, theta = 10000}
    for _, d in ipairs({hd, 130}) do
      local x = randflat(n * NH * d)
      assert_close(ops.rope_forward(T(x, {n, NH, d}), o), ref_rope(x, n, NH, d, 3000, 10000, "f64"), 1e-12,
                   "f64 hd " .. d)
      local xf = f32(x)
      assert_close(ops.rope_forward(T(xf, {n, NH, d}, "f32"), o), f32(ref_rope(xf, n, NH, d, 3000, 10000, "f32")),
                   1e-9, "f32 hd " .. d)
    end
  end)

  it("backward is the inverse rotation and matches finite differences", function()
    local x, R = randflat(S * NH * hd), randflat(S * NH * hd)
    local o = {offset = 17, theta = 1000}
    local function loss() return dot(vals(ops.rope_forward(T(x, {S, NH, hd}), o)), R) end
    assert_close(ops.rope_backward(T(R, {S, NH, hd}), o), fd(loss, x), GRAD_TOL, "dx")
    local y = ops.rope_forward(T(x, {S, NH, hd}), o)
    assert_close(ops.rope_backward(y, o), x, 1e-14, "inverse")
  end)

  it("is bitwise identical for 1 and 4 threads", function()
    local x = m.randn({300, 4, 64}, {seed = 3})
    local a = with_threads(1, function() return ops.rope_forward(x, {offset = 5}) end)
    local b = with_threads(4, function() return ops.rope_forward(x, {offset = 5}) end)
    assert_same(a, b, "rope")
  end)

  it("writes into opts.out, also x itself (in place), with the same bits", function()
    for _, dt in ipairs{"f32", "f64"} do
      local x = m.randn({37, 3, 10}, {seed = 4}):to(dt)
      for _, f in ipairs{ops.rope_forward, ops.rope_backward} do
        local want = f(x, {offset = 7, theta = 500})
        local out = m.zeros({37, 3, 10}, {dtype = dt})
        assert.are.equal(out, f(x, {offset = 7, theta = 500, out = out}))
        assert_same(want, out, "out " .. dt)
        local y = x:clone()
        assert.are.equal(y, f(y, {offset = 7, theta = 500, out = y}))
        assert_same(want, y, "in place " .. dt)
      end
    end
  end)

  it("rejects bad arguments", function()
    local x = m.randn({4, 2, 6})
    has(errmsg(ops.rope_forward, x, {out = x:narrow(1, 2, 3)}),
        "moelua.ops.rope_forward: option 'out' is [3,2,6] but must be [4,2,6]")
    local big = m.randn({5, 2, 6})
    has(errmsg(ops.rope_forward, big:narrow(1, 1, 4), {out = big:narrow(1, 2, 4)}),
        "moelua.ops.rope_forward: option 'out' overlaps x but is not x itself")
    has(errmsg(ops.rope_backward, x, {out = x:to("f64")}),
        "moelua.ops.rope_backward: option 'out' must be f32, got f64")
    has(errmsg(ops.rope_forward, x, {out = 3}), "moelua.ops.rope_forward: option 'out'")
    has(errmsg(ops.rope_forward, m.randn({2, 3, 5})), "moelua.ops.rope_forward: x: head dim 5 must be even and >= 2")
    has(errmsg(ops.rope_forward, m.randn({2, 6})), "moelua.ops.rope_forward: x must have 3 dims, got 2")
    has(errmsg(ops.rope_forward, m.randn({2, 1, 4}), {offset = -1}), "option 'offset' must be in [0,")
    has(errmsg(ops.rope_backward, m.randn({2, 1, 4}), {theta = 0.5}), "moelua.ops.rope_backward: theta must be finite and > 1, got 0.5")
    has(errmsg(ops.rope_forward, m.randn({2, 1, 4}), {thetta = 2}), "thetta")
    has(errmsg(ops.rope_backward, m.randn({2, 1, 4}):to("i32")),
        "moelua.ops.rope_backward: dy must be f32 or f64, got i32")
  end)
end)

-- ---- attention ---------------------------------------------------------------------

describe("moelua.ops attention", function()
  it("matches naive causal GQA softmax(QK^T)V (f64, f32), several head layouts", function()
    for _, c in ipairs({{7, 4, 2, 4}, {5, 3, 3, 2}, {70, 2, 1, 8}, {9, 4, 1, 6}}) do
      local S, H, KV, hd = c[1], c[2], c[3], c[4]
      local q, k, v = randflat(S * H * hd), randflat(S * KV * hd), randflat(S * KV * hd)
      local ref = ref_attention(q, k, v, S, H, KV, hd)
      local out, lse = ops.attention_forward(T(q, {S, H, hd}), T(k, {S, KV, hd}), T(v, {S, KV, hd}))
      assert_close(out, ref, 1e-12, "f64 S=" .. S)
      assert.are.same({H, S}, lse:shape())
      local o32 = ops.attention_forward(T(q, {S, H, hd}, "f32"), T(k, {S, KV, hd}, "f32"), T(v, {S, KV, hd}, "f32"))
      assert_close(o32, ref, 1e-6, "f32 S=" .. S)
    end
  end)

  it("decodes against a KV cache: q the last Sq of Sk positions (f64: bitwise the square call's rows)", function()
    -- Sk past the f64 path's 64-key block and the f32 path's 128-key tile;
    -- 130 of 400: the f32 forward's last key block seen by rows 114 on only
    for _, c in ipairs({{1, 9, 4, 2, 4}, {3, 70, 2, 1, 8}, {5, 140, 3, 3, 6}, {130, 400, 2, 1, 4}}) do
      local Sq, Sk, H, KV, hd = c[1], c[2], c[3], c[4], c[5]
      local P = Sk - Sq
      local q, k, v = randflat(Sk * H * hd), randflat(Sk * KV * hd), randflat(Sk * KV * hd)
      local qlast = {table.unpack(q, P * H * hd + 1)}
      local ref = ref_attention(qlast, k, v, Sq, H, KV, hd, P)
      local tk, tv = T(k, {Sk, KV, hd}), T(v, {Sk, KV, hd})
      local out, lse = ops.attention_forward(T(qlast, {Sq, H, hd}), tk, tv)
      assert_close(out, ref, 1e-12, "f64 Sk=" .. Sk)
      assert.are.same({H, Sq}, lse:shape())
      local sq_out, sq_lse = ops.attention_forward(T(q, {Sk, H, hd}), tk, tv)
      assert_same(out, sq_out:narrow(1, P + 1, Sq):contiguous(), "out = the square call's last rows")
      assert_same(lse, sq_lse:narrow(2, P + 1, Sq):contiguous(), "lse = the square call's last columns")
      local o32 = ops.attention_forward(T(qlast, {Sq, H, hd}, "f32"), T(k, {Sk, KV, hd}, "f32"),
                                        T(v, {Sk, KV, hd}, "f32"))
      assert_close(o32, ref, 1e-6, "f32 Sk=" .. Sk)
    end
  end)

  it("gradients of q, k and v match finite differences (GQA)", function()
    for _, c in ipairs({{6, 4, 2, 4}, {67, 2, 1, 2}}) do
      local S, H, KV, hd = c[1], c[2], c[3], c[4]
      local q, k, v = randflat(S * H * hd), randflat(S * KV * hd), randflat(S * KV * hd)
      local R = randflat(S * H * hd)
      local function loss()
        return dot(vals(ops.attention_forward(T(q, {S, H, hd}), T(k, {S, KV, hd}), T(v, {S, KV, hd}))), R)
      end
      local tq, tk, tv = T(q, {S, H, hd}), T(k, {S, KV, hd}), T(v, {S, KV, hd})
      local out, lse = ops.attention_forward(tq, tk, tv)
      local dq, dk, dv = ops.attention_backward(T(R, {S, H, hd}), tq, tk, tv, out, lse)
      assert_close(dq, fd(loss, q), GRAD_TOL, "dq S=" .. S)
      assert_close(dk, fd(loss, k), GRAD_TOL, "dk S=" .. S)
      assert_close(dv, fd(loss, v), GRAD_TOL, "dv S=" .. S)
    end
  end)

  it("f32 (sgemm tiles) matches the f64 path: outputs and gradients, block edges", function()
    -- f32 tiles are 128 x 128 (the forward's query blocks and the backward's
    -- query groups 512 rows): S = 128, 129, 256, 300 and 600 put the causal
    -- edge and a partial block or group on the boundaries
    for _, c in ipairs({{200, 4, 2, 32}, {128, 2, 1, 8}, {129, 2, 2, 4}, {256, 3, 1, 16}, {300, 2, 1, 8},
                        {600, 2, 1, 4}}) do
      local S, H, KV, hd = c[1], c[2], c[3], c[4]
      local q, k, v = randflat(S * H * hd), randflat(S * KV * hd), randflat(S * KV * hd)
      local R = randflat(S * H * hd)
      local function run(dt)
        local tq, tk, tv = T(q, {S, H, hd}, dt), T(k, {S, KV, hd}, dt), T(v, {S, KV, hd}, dt)
        local out, lse = ops.attention_forward(tq, tk, tv)
        local dq, dk, dv = ops.attention_backward(T(R, {S, H, hd}, dt), tq, tk, tv, out, lse)
        return {out, lse, dq, dk, dv}
      end
      local a, b = run("f64"), run("f32")
      for i, name in ipairs({"out", "lse", "dq", "dk", "dv"}) do
        assert_close(b[i], vals(a[i]), 1e-5, name .. " S=" .. S)
      end
    end
  end)

  it("forward and backward are bitwise identical for 1 and 4 threads (f32, f64)", function()
    -- KV 2: one thread runs the backward in one pass over kv heads, four in
    -- two (dq, then dk and dv); S 700 spans two of its query groups
    local S, H, KV, hd = 700, 4, 2, 16
    for _, dt in ipairs({"f32", "f64"}) do
      local q, k, v = m.randn({S, H, hd}, {seed = 11, dtype = dt}), m.randn({S, KV, hd}, {seed = 12, dtype = dt}),
          m.randn({S, KV, hd}, {seed = 13, dtype = dt})
      local dout = m.randn({S, H, hd}, {seed = 14, dtype = dt})
      local function run()
        local out, lse = ops.attention_forward(q, k, v)
        local dq, dk, dv = ops.attention_backward(dout, q, k, v, out, lse)
        return {out, lse, dq, dk, dv}
      end
      local a = with_threads(1, run)
      local b = with_threads(4, run)
      for i, name in ipairs({"out", "lse", "dq", "dk", "dv"}) do assert_same(a[i], b[i], name .. " " .. dt) end
    end
  end)

  it("accepts an empty sequence", function()
    local q, k = m.randn({0, 2, 4}), m.randn({0, 1, 4})
    local out, lse = ops.attention_forward(q, k, k)
    assert.are.same({0, 2, 4}, out:shape())
    assert.are.same({2, 0}, lse:shape())
    local dq, dk, dv = ops.attention_backward(out, q, k, k, out, lse)
    assert.are.same({0, 1, 4}, dv:shape())
    local loss = ops.cross_entropy_forward(m.randn({0, 4}), m.randn({5, 4}), ids({}, 0))
    assert.are.equal(0, loss)
  end)

  it("rejects bad arguments", function()
    local fn = "moelua.ops.attention_forward: "
    local q, k = m.randn({4, 4, 8}), m.randn({4, 2, 8})
    has(errmsg(ops.attention_forward, q, m.randn({4, 3, 8}), m.randn({4, 3, 8})), fn .. "q has 4 heads, not a multiple of k's 3")
    has(errmsg(ops.attention_forward, q, k, m.randn({4, 2, 6})), fn .. "v is [4,2,6] but must be [4,2,8]")
    has(errmsg(ops.attention_forward, q, k:to("f64"), k), "k is f64 but q is f32")
    has(errmsg(ops.attention_forward, q, m.randn({3, 2, 8}), m.randn({3, 2, 8})), fn .. "k has 3 positions, fewer than q's 4")
    has(errmsg(ops.attention_forward, q, m.randn({6, 2, 8}), k), fn .. "v is [4,2,8] but must be [6,2,8]")
    has(errmsg(ops.attention_forward, m.randn({2, 1, 300}), m.randn({2, 1, 300}), m.randn({2, 1, 300})),
        "head dim 300 must be in [1, 256]")
    has(errmsg(ops.attention_forward, q, k, k:transpose(1, 2)), "moelua.ops.attention_forward: v must be contiguous")
    local out, lse = ops.attention_forward(q, k, k)
    has(errmsg(ops.attention_backward, out, q, k, k, out, m.zeros({4, 3}, {dtype = "f64"})),
        "moelua.ops.attention_backward: lse is [4,3] but must be [4,4]")
    has(errmsg(ops.attention_backward, out, q, k, k, out, m.zeros({4, 4})), "moelua.ops.attention_backward: lse must be f64, got f32")
    has(errmsg(ops.attention_backward, m.randn({4, 4, 7}), q, k, k, out, lse), "dout is [4,4,7] but must be [4,4,8]")
    local k6 = m.randn({6, 2, 8})
    has(errmsg(ops.attention_backward, out, q, k6, k6, out, lse), "moelua.ops.attention_backward: k is [6,2,8] but must be [4,2,8]")
  end)
end)

-- ---- dtypes by device ------------------------------------------------------------

describe("moelua.ops dtypes", function()
  it("refuses bf16 on the CPU, naming the dtypes the CPU accepts", function()
    local function b(shape) return m.randn(shape):to("bf16") end
    local cases = {
      {"rmsnorm_forward", "x", ops.rmsnorm_forward, b({3, 4}), b({4})},
      {"rope_forward", "x", ops.rope_forward, b({2, 1, 4})},
      {"rope_backward", "dy", ops.rope_backward, b({2, 1, 4})},
      {"embedding_forward", "W", ops.embedding_forward, ids({0, 1}), b({3, 4})},
      {"embedding_backward", "dout", ops.embedding_backward, b({2, 4}), ids({0, 1}), 3},
      {"attention_forward", "q", ops.attention_forward, b({2, 1, 4}), b({2, 1, 4}), b({2, 1, 4})},
      {"cross_entropy_forward", "h", ops.cross_entropy_forward, b({2, 4}), b({3, 4}), ids({0, 1})},
    }
    for _, c in ipairs(cases) do
      local name, arg, op = c[1], c[2], c[3]
      assert.are.equal("moelua.ops." .. name .. ": " .. arg .. " must be f32 or f64, got bf16",
                       errmsg(op, table.unpack(c, 4)), name)
    end
  end)
end)
