-- moelua.router (host/bindings/l_router.c, kernels/router.c): the chunked router
-- against a float64 reference written here in plain Lua (logits, scores,
-- Philox gate noise and Gumbel draws with the counter layout of
-- kernels/router.h, softmax, top-k, weights, stats).
--
-- Tolerances (normwise relative error ||x - ref|| / ||ref||):
--   f32: 1e-6   logits are rounded once to f32 (~6e-8 relative), weights once
--               more; everything between is f64
--   f64: 1e-12
--   gradients: central differences in f64 with h = 1e-5, 1e-6 normwise; each
--               perturbed forward must keep the selection (asserted), so the
--               loss is smooth where it is differentiated
-- Indices, counts and everything labelled "bitwise" are compared exactly.
local m = require "moelua"
local router, mem = m.router, m.mem
local support = require "tests.support"

local THREADS0 = m.threads()
local TOL = {f32 = 1e-6, f64 = 1e-12}

-- ---- helpers ---------------------------------------------------------------

local vals, assert_close = support.values, support.assert_close
local errmsg, has = support.errmsg, support.has
local randn = support.generator(4242, "f32").randn

-- ---- the reference ---------------------------------------------------------

-- Philox-4x32-10 on Lua's 64-bit integers (a product of two 32-bit words
-- wraps modulo 2^64, which keeps its bits; >> is a logical shift).
local M32 = 0xffffffff
local function philox(c, key)
  local c0, c1, c2, c3 = c[1], c[2], c[3], c[4]
  local k0, k1 = key[1], key[2]
  for _ = 1, 10 do
    local p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
    c0, c1, c2, c3 = ((p1 >> 32) ~ c1 ~ k0) & M32, p1 & M32, ((p0 >> 32) ~ c3 ~ k1) & M32, p0 & M32
    k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
  end
  return {c0, c1, c2, c3}
end

-- 24 random bits of the router's draw `word` for (seed, step, layer, t, e)
local function router_bits(o, t, e, word)
  local s = o.seed or 0
  local r = philox({t & M32, (o.step or 0) & M32, ((e // 4) << 2) | word, 0x80000000 | (o.layer or 0)},
                   {s & M32, (s >> 32) & M32})
  return r[e % 4 + 1] >> 8
end

local function gate_noise(o, t, e)
  local u1 = (router_bits(o, t, e, 0) + 1) * 2 ^ -24
  local u2 = router_bits(o, t, e, 1) * 2 ^ -24
  return math.sqrt(-2 * math.log(u1)) * math.cos(6.283185307179586 * u2)
end

local function gumbel(o, t, e)
  local u = (router_bits(o, t, e, 2) + 0.5) * 2 ^ -24
  return -math.log(-math.log(u))
end

local function softmax(s)
  local mx = -math.huge
  for i = 1, #s do mx = math.max(mx, s[i]) end
  local p, sum = {}, 0
  for i = 1, #s do p[i] = math.exp(s[i] - mx); sum = sum + p[i] end
  for i = 1, #s do p[i] = p[i] / sum end
  return p, mx + math.log(sum)
end

-- Route x [T, D] with wg [E, D] (flat value tables) as router.h says.
-- Returns idx (0-based, flat), w (flat), counts, psum, z, entropy, and the
-- sorted key gaps of each token (for the margin checks).
local function ref_route(X, W, T, D, E, o)
  local k, tau, eps = o.k, o.temperature or 1, o.eps or 0
  local mode, renorm = o.mode or "softmax_topk", o.renorm ~= false
  local bias = o.bias and vals(o.bias)
  local r = {idx = {}, w = {}, counts = {}, psum = {}, z = 0, entropy = 0, gap = math.huge}
  for e = 1, E do r.counts[e], r.psum[e] = 0, 0 end
  for t = 0, T - 1 do
    local l = {}
    for e = 0, E - 1 do
      local acc = 0
      for d = 1, D do acc = acc + X[t * D + d] * W[e * D + d] end
      l[e + 1] = acc
    end
    local _, lse = softmax(l)
    r.z = r.z + lse * lse
    local s = {}
    for e = 0, E - 1 do
      s[e + 1] = l[e + 1] / tau
      if (o.noise or 0) > 0 then s[e + 1] = s[e + 1] + o.noise * gate_noise(o, t, e) end
      if o.gumbel then s[e + 1] = s[e + 1] + gumbel(o, t, e) end
    end
    local p = softmax(s)
    local key = {}
    for e = 1, E do
      p[e] = (1 - eps) * p[e] + eps / E
      r.psum[e] = r.psum[e] + p[e]
      if p[e] > 0 then r.entropy = r.entropy - p[e] * math.log(p[e]) end
      key[e] = (mode == "softmax_topk" and p[e] or s[e]) + (bias and bias[e] or 0)
    end
    local taken, sel = {}, {}
    for j = 1, math.min(k + 1, E) do
      local best
      for e = 1, E do
        if not taken[e] and (not best or key[e] > key[best]) then best = e end
      end
      taken[best] = true
      sel[j] = best
      if j > 1 then r.gap = math.min(r.gap, key[sel[j - 1]] - key[best]) end
    end
    local ws, Z = {}, 0
    for j = 1, k do
      local e = sel[j]
      if mode == "softmax_topk" then ws[j] = p[e] else ws[j] = s[e] end
    end
    if mode == "topk_softmax" then ws = softmax(ws) end
    for j = 1, k do Z = Z + ws[j] end
    for j = 1, k do
      r.idx[#r.idx + 1] = sel[j] - 1
      r.w[#r.w + 1] = (mode == "softmax_topk" and renorm) and ws[j] / Z or ws[j]
      r.counts[sel[j]] = r.counts[sel[j]] + 1
    end
  end
  return r
end

local function check_against_ref(x, wg, o, dtype)
  local T, D, E = x:size(1), x:size(2), wg:size(1)
  local idx, w, st = router.forward(x, wg, o)
  local r = ref_route(vals(x), vals(wg), T, D, E, o)
  assert.are.same(r.idx, vals(idx), "idx")
  assert_close(vals(w), r.w, TOL[dtype], "w")
  assert.are.same(r.counts, vals(st.counts), "counts")
  assert_close(vals(st.psum), r.psum, TOL[dtype], "psum")
  assert_close({st.z}, {r.z}, TOL[dtype], "zsum")
  assert_close({st.entropy}, {r.entropy}, TOL[dtype], "entropy")
  assert.are.equal(T, st.tokens)
  assert.are.equal("i64", idx:dtype())
  assert.are.equal(dtype, w:dtype())
  return idx, w, st, r
end

-- ---- forward ---------------------------------------------------------------

describe("router reference", function()
  it("the spec's Philox reproduces moelua.rand bit for bit", function()
    local u = vals(m.rand({8}, {dtype = "f64", seed = 77, offset = 5}))
    for i = 0, 7 do
      local r = philox({5 + i // 4, 0, 0, 0}, {77, 0})
      assert.are.equal((r[i % 4 + 1] >> 8) * 2 ^ -24, u[i + 1])
    end
  end)
end)

describe("router.forward", function()
  local T, D, E = 23, 13, 6
  local CASES = {
    {k = 2},
    {k = 2, renorm = false},
    {k = 3, mode = "topk_softmax"},
    {k = 2, temperature = 0.7, eps = 0.1},
    {k = 1, temperature = 2.5, eps = 0.3, renorm = false},
    {k = 2, mode = "topk_softmax", temperature = 0.5, eps = 0.05},
    {k = 2, noise = 0.8, seed = 11, step = 3, layer = 2},
    {k = 2, gumbel = true, seed = 5, step = 9, layer = 1, mode = "topk_softmax"},
    {k = 2, gumbel = true, noise = 0.3, seed = 2 ^ 40 + 3, step = 1},
    {k = 6},
    {k = 2, chunk = 4},
  }
  for _, dtype in ipairs({"f32", "f64"}) do
    for ci, o in ipairs(CASES) do
      it(string.format("matches the f64 reference (%s, case %d)", dtype, ci), function()
        local x, wg = randn({T, D}, dtype), randn({E, D}, dtype)
        check_against_ref(x, wg, o, dtype)
      end)
    end
    it("applies a selection bias to the keys only (" .. dtype .. ")", function()
      local x, wg = randn({T, D}, dtype), randn({E, D}, dtype)
      for _, mode in ipairs({"softmax_topk", "topk_softmax"}) do
        local bias = m.tensor({0, 0, 0, 0, 0, 100}, {dtype = dtype})
        local o = {k = 2, mode = mode, renorm = false, bias = bias}
        local idx, w = check_against_ref(x, wg, o, dtype)
        local plain_idx = router.forward(x, wg, {k = 2, mode = mode, renorm = false})
        local iv = vals(idx)
        for t = 0, T - 1 do assert.are.equal(5, iv[2 * t + 1]) end    -- always chosen first
        assert.are_not.same(vals(plain_idx), iv)
        if mode == "softmax_topk" then
          -- without renorm a weight is p' of its expert: the bias never enters it
          local full_idx, full_w = router.forward(x, wg, {k = E, renorm = false})
          local fi, fw, wv = vals(full_idx), vals(full_w), vals(w)
          for t = 0, T - 1 do
            for j = 1, 2 do
              local e = iv[2 * t + j]
              for q = 1, E do
                if fi[E * t + q] == e then assert.are.equal(fw[E * t + q], wv[2 * t + j]) end
              end
            end
          end
        end
      end
    end)
  end

  it("temperature and eps change the weights, never the selection", function()
    local x, wg = randn({40, 16}), randn({8, 16})
    for _, mode in ipairs({"softmax_topk", "topk_softmax"}) do
      local i1, w1, s1 = router.forward(x, wg, {k = 2, mode = mode})
      local i2, w2, s2 = router.forward(x, wg, {k = 2, mode = mode, temperature = 0.3, eps = 0.2})
      assert.are.same(vals(i1), vals(i2))
      assert.are_not.same(vals(w1), vals(w2))
      assert.are_not.same(vals(s1.psum), vals(s2.psum))
      assert.are.equal(s1.z, s2.z)     -- z-loss sees the raw logits
    end
  end)

  it("gate noise changes the selection; without noise nothing is random", function()
    local x, wg = randn({64, 16}), randn({8, 16})
    local i0 = vals(router.forward(x, wg, {k = 2, seed = 1}))
    assert.are.same(i0, vals(router.forward(x, wg, {k = 2, seed = 2, step = 5})))
    local i1 = vals(router.forward(x, wg, {k = 2, noise = 2, seed = 1}))
    assert.are_not.same(i0, i1)
  end)

  it("Gumbel sampling is a pure function of (seed, step, layer) and changes with each", function()
    local x, wg = randn({64, 16}), randn({8, 16})
    local base = {k = 2, gumbel = true, seed = 3, step = 10, layer = 4}
    local function route(over)
      local o = {}
      for k, v in pairs(base) do o[k] = v end
      for k, v in pairs(over or {}) do o[k] = v end
      local idx, w = router.forward(x, wg, o)
      return {vals(idx), vals(w)}
    end
    local a = route()
    assert.are.same(a, route())
    assert.are.same(a, route({chunk = 5}))
    assert.are_not.same(a[1], route({step = 11})[1])
    assert.are_not.same(a[1], route({layer = 5})[1])
    assert.are_not.same(a[1], route({seed = 4})[1])
  end)

  it("breaks ties toward the lower expert index", function()
    local x = randn({5, 8})
    local wg = m.zeros({4, 8})                    -- every logit is 0
    for _, mode in ipairs({"softmax_topk", "topk_softmax"}) do
      local idx, w = router.forward(x, wg, {k = 3, mode = mode})
      for t = 1, 5 do
        assert.are.same({0, 1, 2}, idx:totable()[t])
        assert_close(w:totable()[t], {1 / 3, 1 / 3, 1 / 3}, 1e-7, "tie weights")
      end
    end
    -- equal rows 1 and 3 (0-based): expert 1 before expert 3 whatever else
    local w2 = randn({4, 8})
    w2:select(1, 4):copy_(w2:select(1, 2))
    local idx = vals(router.forward(x, w2, {k = 4}))
    for t = 0, 4 do
      local p1, p3
      for j = 1, 4 do
        if idx[4 * t + j] == 1 then p1 = j end
        if idx[4 * t + j] == 3 then p3 = j end
      end
      assert.are.equal(p1 + 1, p3)
    end
  end)

  it("refuses a NaN logit, in forward and backward, and leaks nothing", function()
    local x, wg = randn({9, 4}), randn({3, 4})
    local idx = router.forward(x, wg, {k = 2})
    x:narrow(1, 6, 1):narrow(2, 2, 1):fill_(0 / 0)
    collectgarbage(); collectgarbage()
    local before = mem.stats().cpu.total
    has(errmsg(router.forward, x, wg, {k = 2}), "moelua.router.forward: NaN in router logits")
    has(errmsg(router.backward, m.ones({9, 2}), x, wg, idx, {k = 2}),
        "moelua.router.backward: NaN in router logits")
    collectgarbage(); collectgarbage()
    assert.are.equal(before, mem.stats().cpu.total)
    local x2 = randn({2, 4})
    x2:narrow(1, 1, 1):narrow(2, 1, 1):fill_(math.huge)
    x2:narrow(1, 1, 1):narrow(2, 2, 1):fill_(-math.huge)
    has(errmsg(router.forward, x2, wg, {k = 1}), "NaN in router logits")
  end)

  it("handles zero tokens", function()
    local idx, w, st = router.forward(m.zeros({0, 4}), randn({3, 4}), {k = 2})
    assert.are.same({0, 2}, idx:shape())
    assert.are.same({0, 2}, w:shape())
    assert.are.same({0, 0, 0}, vals(st.counts))
    assert.are.equal(0, st.z)
    local dx, dwg = router.backward(m.zeros({0, 2}), m.zeros({0, 4}), randn({3, 4}), idx, {k = 2})
    assert.are.same({0, 4}, dx:shape())
    assert.are.same(vals(m.zeros({3, 4})), vals(dwg))
  end)
end)

-- ---- invariance --------------------------------------------------------------

describe("router invariance", function()
  after_each(function() m.threads(THREADS0) end)

  -- f32 logits are summed four experts at a time (kernels/router.c), the
  -- rest one by one, each rounded to f32 once: an expert's logit is the
  -- same bits either way. Here an expert put first (its logit -1e30: never
  -- selected, and the renormalised weights see only the selected) moves
  -- expert 3 from the block of four to the single path.
  it("gives an expert the same f32 logit in a block of four as alone", function()
    local T, D = 200, 37
    local x = randn({T, D}, "f32")
    x:narrow(2, 1, 1):fill_(1)
    local wg = randn({4, D}, "f32")
    local wg5 = m.zeros({5, D}, {dtype = "f32"})
    wg5:narrow(1, 2, 4):copy_(wg)
    wg5:narrow(1, 1, 1):narrow(2, 1, 1):fill_(-1e30)
    local o = {k = 2, eps = 0, renorm = true}
    local i4, w4 = router.forward(x, wg, o)
    local i5, w5 = router.forward(x, wg5, o)
    local shifted = vals(i4)
    for j = 1, #shifted do shifted[j] = shifted[j] + 1 end
    assert.are.same(shifted, vals(i5))
    assert.are.same(vals(w4), vals(w5))
  end)

  -- every output of a forward + backward as Lua values
  local function run(x, wg, c, ga, o, chunk)
    local oo = {}
    for k, v in pairs(o) do oo[k] = v end
    oo.chunk = chunk
    local idx, w, st = router.forward(x, wg, oo)
    local dx, dwg = router.backward(c, x, wg, idx, oo, {aux = ga, z = 0.3})
    return {vals(idx), vals(w), vals(st.counts), vals(st.psum), st.z, st.entropy, vals(dx), vals(dwg)}
  end

  for _, o in ipairs({{k = 2, noise = 0.5, seed = 9, step = 2, eps = 0.05, temperature = 0.8},
                      {k = 3, mode = "topk_softmax", gumbel = true, seed = 1},
                      {k = 2, renorm = false, bias = m.tensor({0.1, 0, 0, 0.2, 0, 0, 0, 0})}}) do
    it("is bitwise identical for chunks 1, 7, T and threads 1, 2, 4 (" .. (o.mode or "softmax_topk") .. ")", function()
      local T, D, E = 200, 300, 8
      local x, wg = randn({T, D}), randn({E, D}, "f32", 0.1)
      local c, ga = randn({T, o.k}), randn({E}, "f64")
      m.threads(1)
      local ref = run(x, wg, c, ga, o, T)
      for _, n in ipairs({1, 2, 4}) do
        m.threads(n)
        for _, chunk in ipairs({1, 7, T, 4096}) do
          assert.are.same(ref, run(x, wg, c, ga, o, chunk), string.format("threads %d chunk %d", n, chunk))
        end
      end
    end)
  end

  it("token_offset: two calls on halves with offsets 0 and S reproduce one call on the whole", function()
    local T, S, D, E = 30, 13, 10, 5
    local x, wg = randn({T, D}, "f64"), randn({E, D}, "f64")
    local o = {k = 2, noise = 1.5, gumbel = true, seed = 21, step = 4, layer = 3}
    local idx, w = router.forward(x, wg, o)
    local x1, x2 = x:narrow(1, 1, S), x:narrow(1, S + 1, T - S)
    local i1, w1 = router.forward(x1, wg, o)
    local o2 = {k = 2, noise = 1.5, gumbel = true, seed = 21, step = 4, layer = 3, token_offset = S}
    local i2, w2 = router.forward(x2, wg, o2)
    local iv, wv = vals(i1), vals(w1)
    for _, v in ipairs(vals(i2)) do iv[#iv + 1] = v end
    for _, v in ipairs(vals(w2)) do wv[#wv + 1] = v end
    assert.are.same(vals(idx), iv)
    assert.are.same(vals(w), wv)
    -- without the offset the second half draws the first half's noise
    assert.are_not.same(vals(w2), vals(select(2, router.forward(x2, wg, o))))
    -- the backward's recompute keys the noise the same way
    local c = randn({T, 2}, "f64")
    local dx = router.backward(c, x, wg, idx, o)
    local d1 = router.backward(c:narrow(1, 1, S), x1, wg, i1, o)
    local d2 = router.backward(c:narrow(1, S + 1, T - S), x2, wg, i2, o2)
    local dv = vals(d1)
    for _, v in ipairs(vals(d2)) do dv[#dv + 1] = v end
    assert.are.same(vals(dx), dv)
    -- c0 = token_offset + t must fit in 32 bits
    local ok, err = pcall(router.forward, x2, wg,
                          {k = 2, noise = 1, token_offset = 2 ^ 32 - 10})
    assert.is_false(ok)
    assert.matches("noise is keyed by a 32%-bit token index: token_offset %+ T = 4294967286 %+ 17",
                   tostring(err))
    ok, err = pcall(router.backward, c:narrow(1, S + 1, T - S), x2, wg, i2,
                    {k = 2, noise = 1, token_offset = 2 ^ 32 - 10})
    assert.is_false(ok)
    assert.matches("moelua.router.backward: noise is keyed by a 32%-bit token index", tostring(err))
    ok, err = pcall(router.forward, x2, wg, {k = 2, token_offset = -1})
    assert.matches("option 'token_offset' must be >= 0, got %-1", tostring(err))
  end)

  it("reproduces gate noise in the backward's recompute (chunk 1 vs chunk T)", function()
    local T, D, E = 30, 10, 5
    local x, wg = randn({T, D}, "f64"), randn({E, D}, "f64")
    local o = {k = 2, noise = 1.5, seed = 21, step = 4, layer = 3}
    local idx = router.forward(x, wg, o)
    local c = randn({T, 2}, "f64")
    local o1 = {k = 2, noise = 1.5, seed = 21, step = 4, layer = 3, chunk = 1}
    local a1, b1 = router.backward(c, x, wg, idx, o1)
    local a2, b2 = router.backward(c, x, wg, idx, o)
    assert.are.same(vals(a1), vals(a2))
    assert.are.same(vals(b1), vals(b2))
    -- a different step is different noise: the recomputed weights differ
    local o3 = {k = 2, noise = 1.5, seed = 21, step = 5, layer = 3}
    assert.are_not.same(vals(a2), vals((router.backward(c, x, wg, idx, o3))))
  end)
end)

-- ---- gradients -----------------------------------------------------------------

describe("router.backward", function()
  local T, D, E = 6, 5, 5
  local H = 1e-5
  local CASES = {
    {k = 2},
    {k = 2, renorm = false},
    {k = 2, mode = "topk_softmax"},
    {k = 3, temperature = 0.6, eps = 0.15},
    {k = 3, temperature = 1.7, eps = 0.2, renorm = false},
    {k = 2, mode = "topk_softmax", temperature = 0.5, eps = 0.1},
    {k = 2, noise = 0.7, seed = 3, step = 1, layer = 2},
    {k = 2, gumbel = true, seed = 8, mode = "topk_softmax"},
    {k = 2, gumbel = true, seed = 8, eps = 0.05},
    {k = 1},
    {k = 2, bias = m.tensor({0, 0.3, 0, 0, 0.1}, {dtype = "f64"})},
    {k = 2, chunk = 4},
  }
  for ci, o in ipairs(CASES) do
    it(string.format("matches finite differences of L = c.w + ga.P + gz.z in f64 (case %d)", ci), function()
      -- inputs whose top-k margins (between consecutive keys down to the
      -- (k+1)-th) are far above the step
      local x, wg, r
      for _ = 1, 50 do
        x, wg = randn({T, D}, "f64"), randn({E, D}, "f64")
        r = ref_route(vals(x), vals(wg), T, D, E, o)
        if r.gap > 1e-3 then break end
      end
      assert(r.gap > 1e-3, "no input with a top-k margin above 1e-3 found")
      local c, ga, gz = randn({T, o.k}, "f64"), randn({E}, "f64"), 0.37
      local idx0 = router.forward(x, wg, o)
      local sel = vals(idx0)
      local cv, gav = vals(c), vals(ga)
      local function loss()
        local idx, w, st = router.forward(x, wg, o)
        assert.are.same(sel, vals(idx), "a perturbation changed the selection")
        local L, wv, pv = 0, vals(w), vals(st.psum)
        for i = 1, #wv do L = L + cv[i] * wv[i] end
        for e = 1, E do L = L + gav[e] * pv[e] end
        return L + gz * st.z
      end
      local function fd(t)
        local g, n = {}, t:numel()
        local flat = t:reshape(n)
        for i = 1, n do
          local v = flat:narrow(1, i, 1)
          local x0 = v:item()
          v:fill_(x0 + H); local lp = loss()
          v:fill_(x0 - H); local lm = loss()
          v:fill_(x0)
          g[i] = (lp - lm) / (2 * H)
        end
        return g
      end
      local dx0, dwg0 = randn({T, D}, "f64"), randn({E, D}, "f64")
      local dx, dwg = router.backward(c, x, wg, idx0, o, {aux = ga, z = gz, dx = dx0:clone(), dwg = dwg0:clone()})
      local gx, gw = fd(x), fd(wg)
      local ax, aw = vals(dx), vals(dwg)
      local bx, bw = vals(dx0), vals(dwg0)
      for i = 1, #ax do ax[i] = ax[i] - bx[i] end      -- the given buffers were accumulated into
      for i = 1, #aw do aw[i] = aw[i] - bw[i] end
      assert_close(ax, gx, 1e-6, "dx")
      assert_close(aw, gw, 1e-6, "dwg")
    end)
  end

  it("returns new zeroed buffers when none are given, and the given ones otherwise", function()
    local x, wg = randn({4, 3}), randn({3, 3})
    local idx = router.forward(x, wg, {k = 1})
    local dx, dwg = router.backward(m.zeros({4, 1}), x, wg, idx, {k = 1})
    assert.are.same(vals(m.zeros({4, 3})), vals(dx))
    assert.are.same(vals(m.zeros({3, 3})), vals(dwg))
    local gx, gw = m.ones({4, 3}), m.ones({3, 3})
    local rx, rw = router.backward(m.ones({4, 1}), x, wg, idx, {k = 1}, {dx = gx, dwg = gw, z = 1})
    assert.are.equal(gx, rx)
    assert.are.equal(gw, rw)
    assert.are_not.same(vals(m.ones({4, 3})), vals(gx))
  end)
end)

-- ---- aux-loss-free bias ------------------------------------------------------

describe("router.update_bias", function()
  it("moves each bias by gamma toward the mean load, in place", function()
    for _, dtype in ipairs({"f32", "f64"}) do
      local b = m.tensor({0.5, 0, 0, 1}, {dtype = dtype})
      local counts = m.tensor({10, 0, 5, 5}, {dtype = "i64"})   -- mean 5
      local r = router.update_bias(b, counts, 0.25)
      assert.are.equal(b, r)
      assert.are.same({0.25, 0.25, 0, 1}, vals(b))
    end
  end)

  it("closes the loop: the overloaded expert loses selections", function()
    local x = randn({200, 8})
    local wg = randn({4, 8}, "f32", 0.3)
    local b = m.tensor({3, 0, 0, 0})        -- expert 0 starts with most of the load
    local _, _, s0 = router.forward(x, wg, {k = 1, bias = b, mode = "topk_softmax"})
    for _ = 1, 40 do
      local _, _, s = router.forward(x, wg, {k = 1, bias = b, mode = "topk_softmax"})
      router.update_bias(b, s.counts, 0.1)
    end
    local _, _, s1 = router.forward(x, wg, {k = 1, bias = b, mode = "topk_softmax"})
    local c0, c1 = vals(s0.counts), vals(s1.counts)
    assert.is_true(c0[1] > 100, "expert 0 starts overloaded")
    assert.is_true(c1[1] < 70, "expert 0 should lose load: " .. c1[1])
    assert.is_true(b:totable()[1] < 3)
  end)
end)

-- ---- memory --------------------------------------------------------------------

describe("router memory", function()
  it("collects garbage and retries when growing the pool for its scratch is refused", function()
    local T, D, E = 256, 8, 4
    local x, wg = randn({T, D}), randn({E, D})
    local want = {router.forward(x, wg, {k = 2})}
    for _, lib in ipairs({"router", "experts"}) do
      local p = m.pool.new(1 << 16, {grow = true})
      local idx, w = router.forward(x, wg, {k = 2, pool = p})   -- outputs in the first block
      local gu, dn = randn({E, 64, D}), randn({E, D, 32})
      local plan = m.experts.dispatch(idx, E)
      collectgarbage()
      collectgarbage()
      collectgarbage("stop")
      do local _ = m.zeros({1 << 20}) end              -- 4 MiB of garbage, not collected
      local old = mem.budget({total = mem.stats().cpu.total + 1024})
      local ok, err
      if lib == "router" then
        ok, err = pcall(router.forward, x, wg, {k = 2, pool = p, chunk = T})
      else
        ok, err = pcall(m.experts.forward, x, gu, dn, idx, w, plan, {pool = p, tile = T * 2, save = "recompute"})
      end
      mem.budget(old)
      collectgarbage("restart")
      assert.is_true(ok, lib .. ": " .. tostring(err))
      if lib == "router" then assert.are.same(vals(want[1]), vals(err)) end
      p:close()
    end
  end)

  it("keeps O(chunk E) scratch beyond its outputs, never O(T E)", function()
    local T, D, E, k, chunk = 4096, 32, 64, 2, 64
    local x, wg = randn({T, D}), randn({E, D})
    local outputs = T * k * 8 + T * k * 4 + E * 8 + E * 8
    local scratch = router.scratch_bytes(T, D, E, chunk)
    assert.are.equal(chunk * (4 * E + 2) * 8, scratch)
    assert.is_true(scratch * 4 <= T * E * 4, "scratch must be far below one f32 [T, E]")
    collectgarbage(); collectgarbage()
    mem.reset_peak()
    local before = mem.stats().cpu.total
    local idx, w, st = router.forward(x, wg, {k = k, chunk = chunk})
    local s = mem.stats().cpu
    assert.is_true(s.total_peak - before <= outputs + scratch,
                   string.format("peak grew by %d, outputs %d + scratch %d", s.total_peak - before, outputs, scratch))
    assert.is_true(s.total_peak - before >= outputs + scratch)   -- the scratch is really charged
    assert.are.equal(outputs, s.total - before)                  -- and freed before returning
    -- backward: dx, dwg, the [chunk, 4E+2] rows and the [E, D] f64 accumulator
    collectgarbage(); collectgarbage()
    mem.reset_peak()
    before = mem.stats().cpu.total
    local bscratch = router.scratch_bytes(T, D, E, chunk, true)
    assert.are.equal(scratch + E * D * 8, bscratch)
    local dx, dwg = router.backward(w, x, wg, idx, {k = k, chunk = chunk})
    s = mem.stats().cpu
    assert.is_true(s.total_peak - before <= T * D * 4 + E * D * 4 + bscratch)
    local _ = {dx, dwg, st}
  end)

  it("takes its outputs and scratch from a pool and gives the scratch back", function()
    local T, D, E, chunk = 500, 16, 8, 32
    local x, wg = randn({T, D}), randn({E, D})
    local p = m.pool.new(1 << 20)
    local idx1, w1, s1 = router.forward(x, wg, {k = 2, chunk = chunk})
    collectgarbage(); collectgarbage()
    mem.reset_peak()
    local before = mem.stats().cpu.total
    local idx2, w2, s2 = router.forward(x, wg, {k = 2, chunk = chunk, pool = p})
    local st = mem.stats().cpu
    assert.are.equal(0, st.total_peak - before)       -- nothing from the ledger
    assert.are.equal("pool", idx2:category())
    assert.are.same(vals(idx1), vals(idx2))
    assert.are.same(vals(w1), vals(w2))
    assert.are.same(vals(s1.psum), vals(s2.psum))
    local function a64(n) return (n + 63) // 64 * 64 end
    local ps = p:stats()
    assert.are.equal(a64(T * 2 * 8) + a64(T * 2 * 4) + 2 * a64(E * 8), ps.used)   -- the outputs only
    assert.is_true(ps.high_water >= ps.used + router.scratch_bytes(T, D, E, chunk))
    local dx1 = router.backward(w1, x, wg, idx1, {k = 2, chunk = chunk})
    local dx2 = router.backward(w1, x, wg, idx1, {k = 2, chunk = chunk, pool = p})
    assert.are.same(vals(dx1), vals(dx2))
    assert.are.equal(ps.used + a64(T * D * 4) + a64(E * D * 4), p:stats().used)   -- + dx, dwg
    local small = m.pool.new(1024)
    has(errmsg(router.forward, x, wg, {k = 2, pool = small}),
        "moelua.router.forward: pool full: idx needs 7.81 KiB, 0 B of 1.00 KiB are in use (grow=false)")
    assert.are.equal(0, small:stats().used)
    local roomy = m.pool.new(a64(T * 2 * 8) + a64(T * 2 * 4) + 2 * a64(E * 8))   -- outputs fit, scratch does not
    has(errmsg(router.forward, x, wg, {k = 2, pool = roomy}),
        "moelua.router.forward: pool full: the router scratch needs 132.81 KiB")
    roomy:close()
    small:close()
    has(errmsg(router.forward, x, wg, {k = 2, pool = small}), "moelua.router.forward: option 'pool': the pool is closed")
    p:close()
  end)
end)

-- ---- bad input ---------------------------------------------------------------------

describe("router bad input", function()
  local x, wg = randn({4, 3}), randn({2, 3})
  local F = "moelua.router.forward: "

  it("checks x and wg", function()
    has(errmsg(router.forward, "x", wg, {k = 1}), F .. "argument #1: expected a tensor, got string")
    has(errmsg(router.forward, x, nil, {k = 1}), F .. "argument #2: expected a tensor, got nil")
    has(errmsg(router.forward, m.zeros({4}), wg, {k = 1}), F .. "x must be 2-dim, got 1 dims")
    has(errmsg(router.forward, m.zeros({4, 3}, {dtype = "i64"}), wg, {k = 1}),
        F .. "x must be f32 or f64, got i64")
    has(errmsg(router.forward, x:to("bf16"), wg:to("bf16"), {k = 1}), F .. "x must be f32 or f64, got bf16")   -- (cuda's)
    has(errmsg(router.forward, x, wg:to("f64"), {k = 1}), F .. "x is f32 but wg is f64")
    has(errmsg(router.forward, x, m.zeros({2, 5}), {k = 1}), F .. "x is [4,3] but wg is [2,5]: wg must be [E, 3]")
    has(errmsg(router.forward, x, m.zeros({0, 3}), {k = 1}), "at least one expert")
    local freed = randn({4, 3}); freed:free()
    has(errmsg(router.forward, freed, wg, {k = 1}), "argument #1: the tensor was freed")
    -- a non-contiguous x is copied, not refused
    local xt = randn({3, 4}):t()
    local i1 = router.forward(xt, wg, {k = 1})
    assert.are.same(vals(i1), vals(router.forward(xt:contiguous(), wg, {k = 1})))
  end)

  it("checks every option by name", function()
    has(errmsg(router.forward, x, wg), F .. "argument #3: expected an options table with k, got nil")
    has(errmsg(router.forward, x, wg, {}), F .. "option 'k' (experts per token) is required")
    has(errmsg(router.forward, x, wg, {k = 1, topk = 2}), F .. "unknown option 'topk'")
    has(errmsg(router.forward, x, wg, {k = 3}), F .. "k = 3 exceeds the number of experts (2)")
    local BAD = {
      {{k = 0}, "option 'k' must be >= 1, got 0"},
      {{k = 1.5}, "option 'k' must be an integer, got a fraction"},
      {{k = "2"}, "option 'k' must be an integer, got string"},
      {{k = 1, chunk = 0}, "option 'chunk' must be >= 1, got 0"},
      {{k = 1, chunk = true}, "option 'chunk' must be an integer, got boolean"},
      {{k = 1, mode = "sparse"}, "option 'mode': unknown mode 'sparse' (softmax_topk, topk_softmax)"},
      {{k = 1, mode = 1}, "option 'mode' must be a string, got number"},
      {{k = 1, renorm = 1}, "option 'renorm' must be a boolean, got number"},
      {{k = 1, temperature = 0}, "temperature must be finite and > 0, got 0"},
      {{k = 1, temperature = "hot"}, "option 'temperature' must be a number, got string"},
      {{k = 1, temperature = math.huge}, "option 'temperature' must be finite"},
      {{k = 1, eps = 1}, "eps must be in [0, 1), got 1"},
      {{k = 1, eps = -0.1}, "eps must be in [0, 1), got -0.1"},
      {{k = 1, noise = -1}, "noise must be finite and >= 0, got -1"},
      {{k = 1, noise = {}}, "option 'noise' must be a number, got table"},
      {{k = 1, gumbel = "yes"}, "option 'gumbel' must be a boolean, got string"},
      {{k = 1, seed = -1}, "option 'seed' must be >= 0, got -1"},
      {{k = 1, seed = 0.5}, "option 'seed' must be an integer, got a fraction"},
      {{k = 1, step = -2}, "option 'step' must be >= 0, got -2"},
      {{k = 1, step = 2 ^ 32}, "option 'step' must be <= 4294967295"},
      {{k = 1, layer = -1}, "option 'layer' must be >= 0, got -1"},
      {{k = 1, layer = 2 ^ 31}, "option 'layer' must be <= 2147483647"},
      {{k = 1, bias = {0, 0}}, "option 'bias' must be a tensor, got table"},
      {{k = 1, bias = m.zeros({3})}, "bias is [3] but must be [2] (one value per expert)"},
      {{k = 1, bias = m.zeros({2}, {dtype = "i64"})}, "bias must be f32 or f64, got i64"},
      {{k = 1, bias = m.tensor({0, 0 / 0})}, "bias has a non-finite value at expert 1"},
      {{k = 1, pool = {}}, "option 'pool' must be a moelua.pool, got table"},
    }
    for _, c in ipairs(BAD) do
      has(errmsg(router.forward, x, wg, c[1]), F .. c[2])
      has(errmsg(router.backward, m.zeros({4, 1}), x, wg, m.zeros({4, 1}, {dtype = "i64"}), c[1]),
          "moelua.router.backward: " .. c[2])
    end
  end)

  it("checks the backward's arguments", function()
    local B = "moelua.router.backward: "
    local idx = router.forward(x, wg, {k = 1})
    local dw = m.zeros({4, 1})
    has(errmsg(router.backward, m.zeros({4, 2}), x, wg, idx, {k = 1}),
        B .. "dw is [4,2] but x is [4,3] and k = 1: dw must be [4,1]")
    has(errmsg(router.backward, m.zeros({4, 1}, {dtype = "f64"}), x, wg, idx, {k = 1}),
        B .. "dw is f64 but x is f32")
    has(errmsg(router.backward, dw, x, wg, idx:to("f32"), {k = 1}), B .. "idx must be i64, got f32")
    has(errmsg(router.backward, dw, x, wg, m.zeros({4, 2}, {dtype = "i64"}), {k = 1}),
        B .. "idx is [4,2] but x is [4,3] and k = 1: idx must be [4,1]")
    has(errmsg(router.backward, dw, x, wg, m.full({4, 1}, 2, {dtype = "i64"}), {k = 1}),
        B .. "idx: expert 2 at position 0 is outside [0, 2)")
    has(errmsg(router.backward, dw, x, wg, idx, {k = 1}, 5), B .. "argument #6 (grads) must be a table or nil, got number")
    has(errmsg(router.backward, dw, x, wg, idx, {k = 1}, {dgx = 1}), B .. "unknown option 'dgx'")
    has(errmsg(router.backward, dw, x, wg, idx, {k = 1}, {aux = m.zeros({2})}), B .. "grads.aux must be f64, got f32")
    has(errmsg(router.backward, dw, x, wg, idx, {k = 1}, {aux = m.zeros({3}, {dtype = "f64"})}),
        B .. "grads.aux is [3] but must be [2]")
    has(errmsg(router.backward, dw, x, wg, idx, {k = 1}, {aux = 1}), B .. "option 'aux' must be a tensor, got number")
    has(errmsg(router.backward, dw, x, wg, idx, {k = 1}, {z = "1"}), B .. "grads.z must be a number, got string")
    has(errmsg(router.backward, dw, x, wg, idx, {k = 1}, {dx = m.zeros({4, 2})}),
        B .. "grads.dx is [4,2] but must be [4,3]")
    has(errmsg(router.backward, dw, x, wg, idx, {k = 1}, {dwg = m.zeros({2, 3}, {dtype = "f64"})}),
        B .. "grads.dwg is f64 but x is f32")
    has(errmsg(router.backward, dw, x, wg, idx, {k = 1}, {dx = m.zeros({3, 4}):t()}),
        B .. "grads.dx must be contiguous")
    has(errmsg(router.backward, dw, x, wg, idx, {k = 1}, {dx = x}), B .. "grads.dx and grads.dwg must not share storage with x")
  end)

  it("checks update_bias and scratch_bytes", function()
    local U = "moelua.router.update_bias: "
    local c = m.zeros({2}, {dtype = "i64"})
    has(errmsg(router.update_bias, m.zeros({2}, {dtype = "i64"}), c, 0.1), U .. "bias must be f32 or f64, got i64")
    has(errmsg(router.update_bias, m.zeros({2, 1}), c, 0.1), U .. "bias must be 1-dim [E], got 2 dims")
    has(errmsg(router.update_bias, m.zeros({2}), m.zeros({2}), 0.1), U .. "counts must be i64, got f32")
    has(errmsg(router.update_bias, m.zeros({3}), c, 0.1), U .. "bias is [3] but counts is [2]")
    has(errmsg(router.update_bias, m.zeros({2}), c, "x"), U .. "argument #3 (gamma) must be a number, got string")
    has(errmsg(router.update_bias, m.zeros({2}), c, -1), U .. "gamma must be finite and >= 0, got -1")
    has(errmsg(router.update_bias, nil, c, 1), U .. "argument #1: expected a tensor, got nil")
    local S = "moelua.router.scratch_bytes: "
    has(errmsg(router.scratch_bytes, 1, 2, 3, 0), S .. "argument #4 (chunk) is out of range: 0")
    has(errmsg(router.scratch_bytes, 1, "2", 3, 1), S .. "argument #2 (D) must be an integer, got string")
    has(errmsg(router.scratch_bytes, 1, 2, 3, 1, 1), S .. "argument #5 (backward) must be a boolean, got number")
  end)
end)

-- ---- Ctrl-C ---------------------------------------------------------------------

describe("router interrupt", function()
  -- as tests/spec/interrupt_spec.lua: a child host gets SIGINT mid-kernel
  it("stops between tiles, gives the pool scratch back, and routes again", function()
    local code, out = support.interrupt_child([[
      io.stdout:setvbuf("no")
      local m = require "moelua"
      print(io.open("/proc/self/stat"):read("n"))
      local x, wg = m.randn({32768, 512}), m.randn({8, 512})
      local p = m.pool.new(1 << 20, {grow = true})
      local ok, err = pcall(function()
        print("ready")
        for _ = 1, 1000 do
          local mark = p:mark()
          local idx, w = m.router.forward(x, wg, {k = 2, pool = p})
          m.router.backward(w, x, wg, idx, {k = 2, pool = p})
          p:rewind(mark)
        end
      end)
      print("caught", ok, err)
      -- what is left in the pool is the interrupted call's outputs, never its scratch
      local function a64(n) return (n + 63) // 64 * 64 end
      local fwd = a64(32768 * 2 * 8) + a64(32768 * 2 * 4) + 2 * a64(8 * 8)
      local bwd = a64(32768 * 512 * 4) + a64(8 * 512 * 4)
      local used = p:stats().used
      print("pool holds outputs only", used == fwd or used == fwd + bwd)
      p:reset()
      local idx = m.router.forward(x:narrow(1, 1, 64), wg, {k = 2, pool = p})
      print("again", idx:size(1))
    ]], 0.3)
    assert.are.equal(0, code, out)      -- 0 also means: the ledger was empty at exit
    assert.matches("caught\tfalse\t[^\n]*moelua%.router%.%a+: interrupted\n", out)
    assert.matches("pool holds outputs only\ttrue\n", out)
    assert.matches("again\t64\n", out)
  end)
end)
