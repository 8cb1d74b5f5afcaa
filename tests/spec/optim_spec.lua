-- tests/spec/optim_spec.lua - the optimizers (kernels/optim.c,
-- host/bindings/l_optim.c, lua/moelua/optim.lua) against float64 references written
-- in plain Lua on tables: AdamW (torch.optim.AdamW), SGD (torch.optim.SGD),
-- lazy Adam over expert slices with per-expert states (allocated at an
-- expert's first tokens: ledger bytes, state_dict and checkpoint round
-- trips with partially allocated experts, a bit-exact resume), gradient
-- norms and clipping; bitwise thread-count invariance; state_dict round
-- trips; the ledger; bad input.
--
-- Tolerances are normwise relative errors ||x - ref|| / ||ref||:
--   f64 1e-12; f32 1e-5 (each op rounds to f32; five steps of AdamW's
--   division by sqrt(v) keep the error a few ulp of the update per step).
-- Everything labelled "bitwise" is compared exactly.
local m = require "moelua"
local optim = require "moelua.optim"
local C = require "moelua.optim_c"
local support = require "tests.support"

local THREADS0 = m.threads()
local TOL = {f32 = 1e-5, f64 = 1e-12}

-- ---- helpers ---------------------------------------------------------------

local vals, relerr, assert_close = support.values, support.relerr, support.assert_close

-- bitwise equality of two float tensors (no NaN in these specs)
local function same_bits(a, b)
  return a:numel() == b:numel() and (a - b):abs():max():item() == 0
end

local seed = 5000
local function randn(n, dtype, std)
  seed = seed + 1
  return m.randn({n}, {dtype = dtype, seed = seed, std = std})
end

local function copy_vals(v) local o = {} for i = 1, #v do o[i] = v[i] end return o end

-- torch.optim.AdamW in f64 on tables (p, m, v updated in place)
local function ref_adamw(p, g, mm, vv, o, t)
  local bc1, bc2 = 1 - o.beta1 ^ t, 1 - o.beta2 ^ t
  for i = 1, #p do
    p[i] = p[i] * (1 - o.lr * o.weight_decay)
    mm[i] = o.beta1 * mm[i] + (1 - o.beta1) * g[i]
    vv[i] = o.beta2 * vv[i] + (1 - o.beta2) * g[i] * g[i]
    p[i] = p[i] - o.lr * (mm[i] / bc1) / (math.sqrt(vv[i] / bc2) + o.eps)
  end
end

-- torch.optim.SGD in f64 on tables; buf nil on the first step
local function ref_sgd(p, g, buf, o)
  local first = buf[1] == nil
  for i = 1, #p do
    local d = g[i] + o.weight_decay * p[i]
    if o.momentum ~= 0 then
      buf[i] = first and d or o.momentum * buf[i] + (1 - o.dampening) * d
      d = o.nesterov and d + o.momentum * buf[i] or buf[i]
    end
    p[i] = p[i] - o.lr * d
  end
end

local function with_threads(n, f)
  m.threads(n)
  local ok, err = pcall(f)
  m.threads(THREADS0)
  if not ok then error(err, 0) end
end

local function allocs()
  local a, n = m.mem.stats().cpu.allocs, 0
  for _, c in pairs(a) do n = n + c end
  return n
end

local function optim_bytes() return m.mem.stats().cpu.current.optim or 0 end

local function u8(t) return m.tensor(t, {dtype = "u8"}) end

-- ---- AdamW and SGD against references ---------------------------------------

describe("AdamW", function()
  for _, dt in ipairs({"f32", "f64"}) do
    for _, b1 in ipairs({0.9, 0.3}) do   -- both branches of PyTorch's lerp
      it(dt .. " matches torch.optim.AdamW over several steps (beta1 " .. b1 .. ")", function()
        local n, o = 37, {lr = 0.05, beta1 = b1, beta2 = 0.99, eps = 1e-8, weight_decay = 0.1}
        local p, g = randn(n, dt), m.zeros({n}, {dtype = dt})
        local rp, rm, rv = vals(p), {}, {}
        for i = 1, n do rm[i], rv[i] = 0, 0 end
        local opt = optim.AdamW({{params = p, grads = g}}, o)
        for t = 1, 6 do
          g:copy_(randn(n, dt, t))            -- gradients of growing scale
          ref_adamw(rp, vals(g), rm, rv, o, t)
          opt:step()
        end
        local st = opt.state[1]
        assert.are.equal(6, st.step)
        assert_close(p, rp, TOL[dt], "params")
        assert_close(st.exp_avg, rm, TOL[dt], "exp_avg")
        assert_close(st.exp_avg_sq, rv, TOL[dt], "exp_avg_sq")
      end)
    end
  end

  it("applies bias correction from step 1 (first update is lr * sign(g) without decay)", function()
    local p, g = m.zeros({5}, {dtype = "f64"}), m.tensor({1, -2, 3, -4, 5}, {dtype = "f64"})
    C.adamw_step(p, g, m.zeros({5}, {dtype = "f64"}), m.zeros({5}, {dtype = "f64"}),
                 {lr = 0.1, eps = 0, weight_decay = 0, step = 1})
    assert_close(p, {-0.1, 0.1, -0.1, 0.1, -0.1}, 1e-15, "first step")
  end)

  it("decays weights decoupled from the gradient (zero gradient: p *= 1 - lr wd)", function()
    local p, g = m.full({4}, 2.0, {dtype = "f64"}), m.zeros({4}, {dtype = "f64"})
    local opt = optim.AdamW({{params = p, grads = g}}, {lr = 0.1, weight_decay = 0.5})
    opt:step()
    assert_close(p, {1.9, 1.9, 1.9, 1.9}, 1e-15, "decayed")
  end)
end)

describe("SGD", function()
  local cases = {
    {momentum = 0, dampening = 0, weight_decay = 0, nesterov = false},
    {momentum = 0.9, dampening = 0, weight_decay = 0.01, nesterov = false},
    {momentum = 0.9, dampening = 0.2, weight_decay = 0, nesterov = false},
    {momentum = 0.8, dampening = 0, weight_decay = 0.05, nesterov = true},
  }
  for _, dt in ipairs({"f32", "f64"}) do
    for ci, c in ipairs(cases) do
      it(string.format("%s matches torch.optim.SGD (case %d)", dt, ci), function()
        local n = 29
        local o = {lr = 0.1, momentum = c.momentum, dampening = c.dampening,
                   weight_decay = c.weight_decay, nesterov = c.nesterov}
        local p, g = randn(n, dt), m.zeros({n}, {dtype = dt})
        local rp, buf = vals(p), {}
        local opt = optim.SGD({{params = p, grads = g}}, o)
        for _ = 1, 5 do
          g:copy_(randn(n, dt))
          ref_sgd(rp, vals(g), buf, o)
          opt:step()
        end
        assert_close(p, rp, TOL[dt], "params")
        if c.momentum ~= 0 then
          assert_close(opt.state[1].momentum_buffer, buf, TOL[dt], "momentum_buffer")
        else
          assert.is_nil(opt.state[1].momentum_buffer)
        end
      end)
    end
  end
end)

-- ---- determinism --------------------------------------------------------------

describe("thread-count invariance", function()
  it("AdamW, lazy AdamW and SGD (f32) are bitwise equal over 1, 2 and 4 threads", function()
    local n, E = 300000, 6
    local p0, g = randn(n, "f32"), randn(n, "f32")
    local mask = m.tensor({1, 0, 1, 1, 0, 1}, {dtype = "u8"})
    local results = {}
    for _, nt in ipairs({1, 2, 4}) do
      with_threads(nt, function()
        local pa, pl, ps = p0:clone(), p0:clone(), p0:clone()
        local oa = optim.AdamW({{params = pa, grads = g}}, {lr = 0.01})
        local ol = optim.AdamW({{params = pl, grads = g, experts = E}}, {lr = 0.01})
        local os_ = optim.SGD({{params = ps, grads = g}}, {lr = 0.01, momentum = 0.9})
        for _ = 1, 3 do oa:step(); ol:step(nil, {mask}); os_:step() end
        results[nt] = {pa, pl, ps, oa.state[1].exp_avg_sq, ol.state[1].exp_avg_sq[6]}
      end)
    end
    for _, nt in ipairs({2, 4}) do
      for k = 1, 5 do
        assert.is_true(same_bits(results[1][k], results[nt][k]),
                       string.format("result %d differs at %d threads", k, nt))
      end
    end
    assert.is_false(same_bits(results[1][1], p0))   -- it did move
  end)

  it("grad_norm and slice norms are bitwise equal over 1, 2 and 4 threads", function()
    local a, b = randn(1000003, "f32"), randn(70000, "f64")
    local r = {}
    for _, nt in ipairs({1, 2, 4}) do
      with_threads(nt, function()
        r[nt] = {C.grad_norm({a, b}), C.slice_norms(b, 7)}
      end)
    end
    for _, nt in ipairs({2, 4}) do
      assert.are.equal(r[1][1], r[nt][1])
      assert.is_true(same_bits(r[1][2], r[nt][2]))
    end
  end)
end)

-- ---- lazy Adam ------------------------------------------------------------------

-- Per-expert states {[e] = tensor [S]} as one [E*S] list (0 where an expert
-- has none), to compare with a flat reference.
local function expert_vals(states, E, S)
  local out = {}
  for e = 1, E do
    local v = states[e] and vals(states[e])
    for j = 1, S do out[#out + 1] = v and v[j] or 0 end
  end
  return out
end

-- lazy Adam in f64 on tables: expert e (1-based, S elements) of p, g, mm,
-- vv takes one torch.optim.AdamW step with its own count cnt[e] + 1 when
-- mask[e] == 1.
local function ref_lazy(p, g, mm, vv, cnt, mask, S, o)
  for e = 1, #mask do
    if mask[e] == 1 then
      cnt[e] = cnt[e] + 1
      local sp, sg, sm, sv = {}, {}, {}, {}
      for j = 1, S do
        local i = (e - 1) * S + j
        sp[j], sg[j], sm[j], sv[j] = p[i], g[i], mm[i], vv[i]
      end
      ref_adamw(sp, sg, sm, sv, o, cnt[e])
      for j = 1, S do
        local i = (e - 1) * S + j
        p[i], mm[i], vv[i] = sp[j], sm[j], sv[j]
      end
    end
  end
end

describe("lazy AdamW (sparse experts)", function()
  local E, S = 4, 8
  local o = {lr = 0.05, beta1 = 0.9, beta2 = 0.99, eps = 1e-8, weight_decay = 0.1}

  it("matches a float64 reference of lazy Adam, with states appearing per expert", function()
    local n = E * S
    local p, g = randn(n, "f64"), m.zeros({n}, {dtype = "f64"})
    local rp, rm, rv, cnt = vals(p), {}, {}, {}
    for i = 1, n do rm[i], rv[i] = 0, 0 end
    for e = 1, E do cnt[e] = 0 end
    local opt = optim.AdamW({{params = p, grads = g, experts = E}}, o)
    local st = opt.state[1]
    -- expert 3 is idle in step 1, expert 4 in steps 1-3: each gets states later
    local masks = {{1, 1, 0, 0}, {0, 1, 1, 0}, {1, 0, 0, 0}, {0, 1, 1, 1}, {0, 0, 0, 0}, {1, 0, 0, 1}}
    local had = {}
    for si, mk in ipairs(masks) do
      g:copy_(randn(n, "f64"))
      ref_lazy(rp, vals(g), rm, rv, cnt, mk, S, o)
      opt:step(nil, {u8(mk)})
      opt:zero_grad()
      for e = 1, E do
        had[e] = had[e] or mk[e] == 1
        assert.are.equal(had[e], st.exp_avg[e] ~= nil, string.format("step %d expert %d exp_avg", si, e))
        assert.are.equal(had[e], st.exp_avg_sq[e] ~= nil, string.format("step %d expert %d exp_avg_sq", si, e))
      end
      assert_close(p, rp, 1e-12, "params after step " .. si)
      assert.is_true(relerr(expert_vals(st.exp_avg, E, S), rm) <= 1e-12, "exp_avg after step " .. si)
      assert.is_true(relerr(expert_vals(st.exp_avg_sq, E, S), rv) <= 1e-12, "exp_avg_sq after step " .. si)
      assert.are.same(cnt, st.steps:totable())
    end
    assert.are.same({3, 3, 2, 2}, cnt)
    assert.are.equal(24 - 10, opt.skipped_expert_steps)  -- 10 expert-steps ran
  end)

  it("leaves an expert active in step s and idle in s+1 untouched (not updated, not decayed, count kept)", function()
    local n = E * S
    local p, g = randn(n, "f32"), randn(n, "f32")
    local opt = optim.AdamW({{params = p, grads = g, experts = E}}, o)
    opt:step(nil, {u8({1, 1, 1, 1})})                           -- step s: expert 3 active
    opt:zero_grad()
    assert.are.equal(0, g:abs():max():item())                    -- no stale gradient left
    local st = opt.state[1]
    local p3, m3, v3 = p:narrow(1, 2 * S + 1, S):clone(), st.exp_avg[3]:clone(), st.exp_avg_sq[3]:clone()
    g:copy_(randn(n, "f32"))                                     -- even a stale value is ignored
    opt:step(nil, {u8({1, 0, 0, 1})})                           -- step s+1: expert 3 idle
    assert.is_true(same_bits(p3, p:narrow(1, 2 * S + 1, S):clone()), "params moved")
    assert.is_true(same_bits(m3, st.exp_avg[3]), "exp_avg moved")
    assert.is_true(same_bits(v3, st.exp_avg_sq[3]), "exp_avg_sq moved")
    assert.are.same({2, 1, 1, 2}, st.steps:totable())
    -- dense AdamW, by contrast, moves a parameter whose gradient is zero
    local q, z = randn(8, "f32"), m.zeros({8})
    local q0 = q:clone()
    local dense = optim.AdamW({{params = q, grads = z}}, o)
    dense:step()
    assert.is_false(same_bits(q0, q))
  end)

  it("gives an expert states when it first gets tokens, its first update a fresh step 1", function()
    local n = E * S
    local p, g = randn(n, "f32"), randn(n, "f32")
    local p1 = p:narrow(1, S + 1, S):clone()
    local opt = optim.AdamW({{params = p, grads = g, experts = E}}, o)
    for _ = 1, 3 do opt:step(nil, {u8({1, 0, 1, 1})}) end
    assert.is_nil(opt.state[1].exp_avg[2])                       -- idle so far: no states
    local mask = u8({0, 1, 0, 0})
    local before, a0 = optim_bytes(), allocs()
    opt:step(nil, {mask})                                        -- expert 2's first step at t = 4
    assert.are.equal("optim", opt.state[1].exp_avg[2]:category())
    assert.are.equal("optim", opt.state[1].exp_avg_sq[2]:category())
    assert.are.equal(before + 2 * S * 4, optim_bytes())          -- exactly its two states
    assert.are.equal(a0 + 2, allocs())
    -- equals a fresh AdamW step 1 on that slice, bitwise
    local hp = {lr = o.lr, beta1 = o.beta1, beta2 = o.beta2, eps = o.eps,
                weight_decay = o.weight_decay, step = 1}
    local m1, v1 = m.zeros({S}), m.zeros({S})
    C.adamw_step(p1, g:narrow(1, S + 1, S):clone(), m1, v1, hp)
    assert.is_true(same_bits(p1, p:narrow(1, S + 1, S):clone()))
    assert.is_true(same_bits(m1, opt.state[1].exp_avg[2]))
    assert.is_true(same_bits(v1, opt.state[1].exp_avg_sq[2]))
    assert.are.same({3, 1, 3, 3}, opt.state[1].steps:totable())
  end)

  it("plans the worst case under mem.plan: every expert's states (masks are meaningless there)", function()
    collectgarbage(); collectgarbage()
    local base = optim_bytes()                     -- the plan's books start from the live ones
    local books = m.mem.plan(function()
      local opt = optim.AdamW({{params = m.zeros({E * S}), grads = m.zeros({E * S}), experts = E}}, o)
      opt:step(nil, {m.zeros({E}, {dtype = "u8"})})
    end)
    assert.are.equal(base + 2 * E * S * 4 + E * 8, books.cpu.peak.optim)
    assert.are.equal(base, optim_bytes())
  end)

  it("gives an expert idle from the start no states: ledger optim bytes are the active experts' exactly", function()
    -- two sparse groups of different slice sizes and one dense group
    local E2, S2 = 8, 24
    local pa, ga = randn(E * S, "f32"), randn(E * S, "f32")
    local pb, gb = randn(E2 * S2, "f64"), randn(E2 * S2, "f64")
    local pd, gd = randn(40, "f32"), randn(40, "f32")
    local pa0, pb0 = pa:clone(), pb:clone()
    local base = optim_bytes()
    local opt = optim.AdamW({{params = pa, grads = ga, experts = E},
                             {params = pb, grads = gb, experts = E2},
                             {params = pd, grads = gd}}, o)
    assert.are.equal(base, optim_bytes())
    -- step 1: no expert of either group has tokens; only the dense group gets states
    opt:step(nil, {u8({0, 0, 0, 0}), u8({0, 0, 0, 0, 0, 0, 0, 0})})
    assert.are.equal(base + 2 * 40 * 4, optim_bytes())
    assert.is_nil(opt.state[1].steps)
    assert.is_nil(next(opt.state[1].exp_avg))
    assert.is_true(same_bits(pa0, pa) and same_bits(pb0, pb))
    assert.are.equal(E + E2, opt.skipped_expert_steps)
    -- then only experts 3 (group 1) and 2, 7 (group 2) ever get tokens
    local ma = {{0, 0, 1, 0}, {0, 0, 0, 0}, {0, 0, 1, 0}}
    local mb = {{0, 1, 0, 0, 0, 0, 1, 0}, {0, 0, 0, 0, 0, 0, 1, 0}, {0, 1, 0, 0, 0, 0, 0, 0}}
    for i = 1, 3 do opt:step(nil, {u8(ma[i]), u8(mb[i])}) end
    local want = 2 * 40 * 4                       -- dense
        + 2 * 1 * S * 4 + E * 8                   -- group 1: one expert's m and v, the counts
        + 2 * 2 * S2 * 8 + E2 * 8                 -- group 2 (f64): two experts, the counts
    assert.are.equal(base + want, optim_bytes())
    for e = 1, E do assert.are.equal(e == 3, opt.state[1].exp_avg[e] ~= nil, "group 1 expert " .. e) end
    for e = 1, E2 do
      assert.are.equal(e == 2 or e == 7, opt.state[2].exp_avg_sq[e] ~= nil, "group 2 expert " .. e)
    end
    -- an idle expert's parameters never moved
    assert.is_true(same_bits(pa0:narrow(1, 1, 2 * S), pa:narrow(1, 1, 2 * S)))
    assert.is_true(same_bits(pb0:narrow(1, 3 * S2 + 1, 3 * S2), pb:narrow(1, 3 * S2 + 1, 3 * S2)))
    assert.are.same({0, 0, 2, 0}, opt.state[1].steps:totable())
    assert.are.same({0, 2, 0, 0, 0, 0, 2, 0}, opt.state[2].steps:totable())
    assert.are.equal((E + E2) * 4 - 2 - 4, opt.skipped_expert_steps)
  end)
end)

-- ---- given states: views of reserved flat buffers -----------------------------

-- Reserved buffers (f32 or f64 [n]) for exp_avg and exp_avg_sq, as a unit
-- lays them out, under "optim".
local function reserved_states(n, dt)
  local r = function() return m.mem.scope("optim", m.reserve, {n}, {dtype = dt}) end
  return r(), r()
end

describe("AdamW with given states (views of reserved buffers)", function()
  local E, S = 4, 8
  local o = {lr = 0.05, beta1 = 0.9, beta2 = 0.99, eps = 1e-8, weight_decay = 0.1}
  -- the same groups twice: states allocated by the optimizer, and given
  local function twins(given)
    seed = 7000
    local pd, gd = randn(40, "f32"), m.zeros({40})
    local pe, ge = randn(E * S, "f64"), m.zeros({E * S}, {dtype = "f64"})
    local groups = {{params = pd, grads = gd}, {params = pe, grads = ge, experts = E}}
    local bufs = {}
    if given then
      bufs[1], bufs[2] = reserved_states(40, "f32")
      bufs[3], bufs[4] = reserved_states(E * S, "f64")
      groups[1].exp_avg, groups[1].exp_avg_sq = bufs[1], bufs[2]
      groups[2].exp_avg, groups[2].exp_avg_sq = bufs[3]:view({E, S}), bufs[4]
    end
    return optim.AdamW(groups, o), groups, bufs
  end
  -- expert 4 never gets tokens, expert 2 from step 3 on
  local MASKS = {{1, 0, 1, 0}, {0, 0, 1, 0}, {1, 1, 0, 0}, {0, 1, 1, 0}}
  local function run(opt, groups, steps)
    for si = steps[1], steps[2] do
      seed = 8000 + si
      groups[1].grads:copy_(randn(40, "f32"))
      groups[2].grads:copy_(randn(E * S, "f64"))
      opt:step(nil, {nil, u8(MASKS[si])})
      opt:zero_grad()
    end
  end

  it("updates bitwise as allocated states do, with the same ledger optim bytes", function()
    collectgarbage(); collectgarbage()
    local base = optim_bytes()
    local a, ga = twins(false)
    run(a, ga, {1, 4})
    local allocated = optim_bytes() - base
    a, ga = nil, nil
    collectgarbage(); collectgarbage()
    assert.are.equal(base, optim_bytes())
    local b, gb, bufs = twins(true)
    assert.are.equal(base, optim_bytes())               -- reserving commits nothing
    run(b, gb, {1, 4})
    assert.are.equal(allocated, optim_bytes() - base)
    assert.are.equal(2 * 40 * 4 + 2 * 3 * S * 8 + E * 8, allocated)
    local a2, ga2 = twins(false)
    run(a2, ga2, {1, 4})
    for i = 1, 2 do assert.is_true(same_bits(ga2[i].params, gb[i].params), "group " .. i) end
    local sa, sb = a2.state, b.state
    assert.is_true(same_bits(sa[1].exp_avg, sb[1].exp_avg) and same_bits(sa[1].exp_avg_sq, sb[1].exp_avg_sq))
    for e = 1, 3 do
      assert.is_true(same_bits(sa[2].exp_avg[e], sb[2].exp_avg[e]), "exp_avg " .. e)
      assert.is_true(same_bits(sa[2].exp_avg_sq[e], sb[2].exp_avg_sq[e]), "exp_avg_sq " .. e)
      assert.is_true(sb[2].exp_avg[e]:same_storage(bufs[3]))       -- the live state is the slice
      assert.are.equal((e - 1) * S, sb[2].exp_avg[e]:storage_offset())
    end
    assert.is_true(sb[1].exp_avg:same_storage(bufs[1]) and bufs[1]:committed())
    -- expert 4 never had tokens: no state, its slices uncommitted, an op refuses them
    assert.is_nil(sb[2].exp_avg[4])
    assert.is_false(bufs[3]:view_at(3 * S, {S}):committed())
    assert.is_false(bufs[4]:view_at(3 * S, {S}):committed())
    assert.is_true(bufs[3]:view_at(0, {3 * S}):committed())
    assert.has_error(function() return bufs[3]:sum() end,
                     "Tensor:sum: t: the tensor is reserved but not committed")
  end)

  it("round-trips state_dict / load_state_dict into given views and resumes bitwise", function()
    local a, ga = twins(true)
    run(a, ga, {1, 2})
    local sd = a:state_dict()
    assert.is_nil(sd.groups[2].exp_avg[2])                -- expert 2 not yet active
    -- reload into itself: the live views are kept (no copy, nothing committed twice)
    local before = optim_bytes()
    a:load_state_dict(sd, {adopt = true})
    assert.are.equal(before, optim_bytes())
    assert.is_true(rawequal(sd.groups[1].exp_avg, a.state[1].exp_avg))
    -- a second optimizer with its own reserved buffers: copies into them
    local b, gb, bufs = twins(true)
    for i = 1, 2 do gb[i].params:copy_(ga[i].params) end
    local bb = optim_bytes()
    b:load_state_dict(sd)                                  -- a's live tensors: copied, not adopted
    assert.are.equal(2 * 40 * 4 + 2 * 2 * S * 8 + E * 8, optim_bytes() - bb)
    assert.is_true(b.state[2].exp_avg[3]:same_storage(bufs[3]))
    assert.is_false(bufs[3]:view_at(S, {S}):committed())   -- expert 2: no state in sd
    assert.is_false(bufs[4]:view_at(3 * S, {S}):committed())
    run(a, ga, {3, 4})
    run(b, gb, {3, 4})
    for i = 1, 2 do assert.is_true(same_bits(ga[i].params, gb[i].params), "group " .. i) end
    for e = 1, 3 do assert.is_true(same_bits(a.state[2].exp_avg_sq[e], b.state[2].exp_avg_sq[e])) end
    -- a state absent from sd drops the live view; the bytes stay committed and are reused
    local sd2 = b:state_dict()
    sd2.groups[2].exp_avg[3], sd2.groups[2].exp_avg_sq[3] = nil, nil
    local cb = optim_bytes()
    b:load_state_dict(sd2)
    assert.is_nil(b.state[2].exp_avg[3])
    assert.are.equal(cb, optim_bytes())
    b:step(nil, {nil, u8({0, 0, 1, 0})})                   -- expert 3 again: zeroed, not recommitted
    assert.are.equal(cb, optim_bytes())
    assert.is_true(b.state[2].exp_avg[3]:same_storage(bufs[3]))
    assert.are.equal(2 * S, b.state[2].exp_avg[3]:storage_offset())
  end)

  it("state_tensor: the live state, made now (committed given view or allocated zeros)", function()
    local a, _, bufs = twins(true)
    local base = optim_bytes()
    local t = a:state_tensor(2, "exp_avg_sq", 2)
    assert.is_true(t:same_storage(bufs[4]) and t:storage_offset() == S and t:numel() == S)
    assert.are.equal(0, t:abs():max():item())
    assert.is_true(rawequal(t, a:state_tensor(2, "exp_avg_sq", 2)))   -- made once
    assert.is_true(a.state[2].exp_avg[2]:committed())                    -- with its pair
    assert.are.equal(base + 2 * S * 8 + E * 8, optim_bytes())            -- and the step counts
    assert.is_true(rawequal(a.state[2].steps, a:state_tensor(2, "steps")))
    t:fill_(0.5)                                            -- a loader reads a range into it
    assert.are.equal(0.5, a:state_dict().groups[2].exp_avg_sq[2]:max():item())
    local d = a:state_tensor(1, "exp_avg")
    assert.is_true(rawequal(d, a.state[1].exp_avg) and d:same_storage(bufs[1]))
    -- without given states: zeros under "optim", as the first step makes them
    local p = m.zeros({E * S})
    local c = optim.AdamW({{params = p, grads = m.zeros({E * S}), experts = E}}, o)
    local cb = optim_bytes()
    local z = c:state_tensor(1, "exp_avg", 4)
    assert.are.equal("optim", z:category())
    assert.are.equal(cb + 2 * S * 4 + E * 8, optim_bytes())
    local fn = "moelua.optim.AdamW:state_tensor: "
    assert.has_error(function() a:state_tensor(3, "exp_avg") end, fn .. "no group 3 (the optimizer has 2)")
    assert.has_error(function() a:state_tensor(1, "m") end,
                     fn .. 'state must be "exp_avg", "exp_avg_sq" or "steps", got m')
    assert.has_error(function() a:state_tensor(1, "exp_avg", 1) end, fn .. "group 1 is dense: it has no experts")
    assert.has_error(function() a:state_tensor(1, "steps") end,
                     fn .. "group 1 is dense: it has no per-expert steps")
    assert.has_error(function() a:state_tensor(2, "exp_avg", 5) end, fn .. "group 2 has experts 1..4, got 5")
    assert.has_error(function() a:state_tensor(2, "steps", 1) end,
                     fn .. "group 2: 'steps' is one tensor [4], not per expert")
  end)

  it("plans the worst case under mem.plan: every expert's slices committed to the plan's books", function()
    collectgarbage(); collectgarbage()
    local base = optim_bytes()
    local books = m.mem.plan(function()
      local ea, eq = reserved_states(E * S, "f32")
      local opt = optim.AdamW({{params = m.zeros({E * S}), grads = m.zeros({E * S}), experts = E,
                                exp_avg = ea, exp_avg_sq = eq}}, o)
      opt:step(nil, {m.zeros({E}, {dtype = "u8"})})
    end)
    assert.are.equal(base + 2 * E * S * 4 + E * 8, books.cpu.peak.optim)
    assert.are.equal(base, optim_bytes())
  end)

  it("checks the given states", function()
    local p, g = m.zeros({8}), m.zeros({8})
    local fn = "moelua.optim.AdamW: group 1: "
    local function bad(extra, msg, ctor)
      local grp = {params = p, grads = g}
      for k, v in pairs(extra) do grp[k] = v end
      assert.has_error(function() (ctor or optim.AdamW)({grp}) end, msg)
    end
    bad({exp_avg = m.zeros({8})}, fn .. "'exp_avg_sq' must be a tensor when exp_avg is given, got nil")
    bad({exp_avg = m.zeros({8}), exp_avg_sq = m.zeros({7})},
        fn .. "'exp_avg_sq' must be contiguous, f32 on cpu with 8 elements like params, got f32 on cpu with 7")
    bad({exp_avg = m.zeros({8}, {dtype = "f64"}), exp_avg_sq = m.zeros({8})},
        fn .. "'exp_avg' must be contiguous, f32 on cpu with 8 elements like params, got f64 on cpu with 8")
    bad({exp_avg = m.zeros({2, 8}):narrow(2, 1, 4), exp_avg_sq = m.zeros({8})},
        fn .. "'exp_avg' must be contiguous, f32 on cpu with 8 elements like params, got " ..
        "non-contiguous f32 on cpu with 8")
    -- SGD has no such states: it leaves them (a model's groups carry them for AdamW)
    local sgd = optim.SGD({{params = p, grads = g, exp_avg = m.reserve({8}), exp_avg_sq = m.reserve({8})}},
                          {lr = 0.1, momentum = 0.9})
    sgd:step()
    assert.is_nil(sgd:state_dict().groups[1].exp_avg)
    -- a given view partly committed by its caller: the commit names the overlap
    local r = m.reserve({8})
    r:view_at(2, {2}):commit_()
    local opt = optim.AdamW({{params = p, grads = g, exp_avg = r, exp_avg_sq = m.reserve({8})}})
    assert.has_error(function() opt:step() end,
                     "Tensor:commit_: bytes [0, 32) overlap the committed bytes [8, 16)")
  end)
end)

-- ---- norms and clipping --------------------------------------------------------

describe("gradient norms and clipping", function()
  local function sumsq(v) local s = 0 for i = 1, #v do s = s + v[i] * v[i] end return s end

  it("grad_norm sums squares in the same fixed blocks as sum (one routine), past 4M elements", function()
    for _, dtype in ipairs({"f64", "f32"}) do
      local x = m.randn({5000003}, {dtype = dtype}):to("f64")
      local want = math.sqrt((x * x):sum():item())
      assert.are.equal(want, C.grad_norm({x}), dtype)
    end
  end)

  it("grad_norm matches the reference over mixed f32/f64 buffers", function()
    local a, b, c = randn(5000, "f32"), randn(123, "f64"), randn(9000, "f32")
    local ref = math.sqrt(sumsq(vals(a)) + sumsq(vals(b)) + sumsq(vals(c)))
    assert(math.abs(C.grad_norm({a, b, c}) - ref) <= 1e-12 * ref)
    assert.are.equal(0, C.grad_norm({}))
  end)

  it("slice_norms matches per-expert references", function()
    local t = randn(60, "f32")
    local v, ref = vals(t), {}
    for e = 1, 5 do
      local s = 0
      for j = 1, 12 do s = s + v[(e - 1) * 12 + j] ^ 2 end
      ref[e] = math.sqrt(s)
    end
    local r = C.slice_norms(t, 5)
    assert.are.equal("f64", r:dtype())
    assert_close(r, ref, 1e-13, "slice norms")
    local out = m.zeros({5}, {dtype = "f64"})
    assert.are.equal(out, optim.expert_norms(t, 5, out))
    assert_close(out, ref, 1e-13, "into out")
  end)

  it("clip_grad_norm scales all non-frozen groups to max_norm and returns the total", function()
    local g1, g2, g3 = randn(100, "f32"), randn(50, "f64"), randn(10, "f32")
    local g3c = g3:clone()
    local total0 = math.sqrt(sumsq(vals(g1)) + sumsq(vals(g2)))
    local groups = {{params = m.zeros({100}), grads = g1}, {params = m.zeros({50}, {dtype = "f64"}), grads = g2},
                    {params = m.zeros({10}), grads = g3, frozen = true}}
    local total = optim.clip_grad_norm(groups, 1.0)
    assert(math.abs(total - total0) <= 1e-12 * total0)
    local after = math.sqrt(sumsq(vals(g1)) + sumsq(vals(g2)))
    assert(math.abs(after - 1.0) < 1e-5, "norm after clipping " .. after)
    assert.is_true(same_bits(g3c, g3), "frozen group's gradient changed")
    -- under the bound: untouched
    local g1c = g1:clone()
    optim.clip_grad_norm(groups, 10.0)
    assert.is_true(same_bits(g1c, g1))
  end)

  it("clips each expert to its bound and leaves the others bitwise untouched", function()
    local g = randn(40, "f32")           -- E = 4 slices of 10; norms ~ 3
    local v0 = vals(g)
    local pre = {}
    for e = 1, 4 do
      local s = 0
      for j = 1, 10 do s = s + v0[(e - 1) * 10 + j] ^ 2 end
      pre[e] = math.sqrt(s)
    end
    local bounds = {1.0, 100, 0.5, 100}
    local norms = optim.clip_expert_norms(g, 4, bounds)
    assert_close(norms, pre, 1e-13, "returned norms")
    local post = C.slice_norms(g, 4):totable()
    assert(math.abs(post[1] - 1.0) < 1e-5 and math.abs(post[3] - 0.5) < 1e-5)
    local v1 = vals(g)
    for j = 11, 20 do assert.are.equal(v0[j], v1[j]) end
    for j = 31, 40 do assert.are.equal(v0[j], v1[j]) end
    -- bounds as a tensor
    local h = randn(40, "f64")
    optim.clip_expert_norms(h, 4, m.full({4}, 0.25, {dtype = "f64"}))
    for _, x in ipairs(C.slice_norms(h, 4):totable()) do assert(math.abs(x - 0.25) < 1e-6) end
  end)

  it("clips per expert first, then globally, as the reference does", function()
    local g = randn(60, "f64")
    local v = vals(g)
    local bounds = {0.5, 2.0, 1.0}
    for e = 1, 3 do                                   -- reference: per expert
      local s = 0
      for j = 1, 20 do s = s + v[(e - 1) * 20 + j] ^ 2 end
      local c = bounds[e] / (math.sqrt(s) + 1e-6)
      if c < 1 then for j = 1, 20 do v[(e - 1) * 20 + j] = v[(e - 1) * 20 + j] * c end end
    end
    local tot = math.sqrt(sumsq(v))                   -- then global
    local c = 1.5 / (tot + 1e-6)
    if c < 1 then for i = 1, #v do v[i] = v[i] * c end end
    optim.clip_expert_norms(g, 3, bounds)
    local total = optim.clip_grad_norm({{params = m.zeros({60}, {dtype = "f64"}), grads = g}}, 1.5)
    assert(math.abs(total - tot) <= 1e-12 * tot)
    assert_close(g, v, 1e-12, "clipped gradients")
  end)

  it("clip_grad_norm_ (one op) is grad_norm then scale_, bit for bit", function()
    local a, b = randn(100, "f32"), randn(30, "f64")
    local a2, b2 = a:clone(), b:clone()
    local total = C.clip_grad_norm_({a, b}, 0.5)
    local ref = C.grad_norm({a2, b2})
    assert.are.equal(ref, total)
    local coef = 0.5 / (ref + 1e-6)
    C.scale_(a2, coef)
    C.scale_(b2, coef)
    assert.is_true(same_bits(a, a2) and same_bits(b, b2))
    local c = a:clone()
    assert.are.equal(C.grad_norm({a}), C.clip_grad_norm_({a}, math.huge))   -- no bound
    assert.is_true(same_bits(a, c))
  end)

  it("clips and updates more experts than one kernel call takes (E = 130), bit for bit", function()
    local E, S = 130, 3
    local function slice(t, e) return t:narrow(1, (e - 1) * S + 1, S) end
    local g = randn(E * S, "f32")
    local ref, bounds = g:clone(), {}
    for e = 1, E do bounds[e] = e % 2 == 0 and 0.1 or 100 end
    local pre = C.slice_norms(ref, E):totable()
    local norms = C.clip_slices_(g, E, bounds):totable()
    for e = 1, E do
      assert.are.equal(pre[e], norms[e])
      local f = bounds[e] / (pre[e] + 1e-6)
      if f < 1 then C.scale_(slice(ref, e), f) end
    end
    assert.is_true(same_bits(g, ref))
    local p, gr = randn(E * S, "f32"), randn(E * S, "f32")
    local p2, ms, vs, mask = p:clone(), {}, {}, {}
    for e = 1, E do ms[e], vs[e], mask[e] = m.zeros({S}), m.zeros({S}), e % 2 end
    local steps = m.zeros({E}, {dtype = "i64"})
    assert.are.equal(65, C.lazy_adamw_step(p, gr, ms, vs, u8(mask), steps, E, {lr = 0.1}))
    for e = 1, E, 2 do
      C.adamw_step(slice(p2, e), slice(gr, e), m.zeros({S}), m.zeros({S}), {lr = 0.1, step = 1})
    end
    assert.is_true(same_bits(p, p2))
    assert.are.same(mask, steps:totable())
  end)

  it("returns a non-finite total without scaling", function()
    local g = m.tensor({1, 0 / 0, 3})
    local total = optim.clip_grad_norm({{params = m.zeros({3}), grads = g}}, 1.0)
    assert.is_true(total ~= total)
    assert.are.equal(3, g:totable()[3])
  end)
end)

-- ---- groups, states, ledger ------------------------------------------------------

describe("parameter groups and state", function()
  it("never touches a frozen group and gives it no state", function()
    local p, g = randn(16, "f32"), randn(16, "f32")
    local p0 = p:clone()
    local q, h = randn(16, "f32"), randn(16, "f32")
    local opt = optim.AdamW({{params = p, grads = g, frozen = true}, {params = q, grads = h}}, {lr = 0.1})
    opt:step(); opt:step()
    assert.is_true(same_bits(p0, p))
    assert.is_nil(opt.state[1].exp_avg)
    assert.are.equal(0, opt.state[1].step)
    local s = optim.SGD({{params = p, grads = g, frozen = true}}, {lr = 0.1, momentum = 0.9})
    s:step()
    assert.is_true(same_bits(p0, p))
    assert.is_nil(s.state[1].momentum_buffer)
  end)

  it("rounds each stepped group's params into its compute copy (mixed precision's bf16 weights)", function()
    for _, make in ipairs{function(gs) return optim.AdamW(gs, {lr = 0.1}) end,
                          function(gs) return optim.SGD(gs, {lr = 0.1, momentum = 0.9}) end} do
      local p, g, q, h = randn(16, "f32"), randn(16, "f32"), randn(16, "f32"), randn(16, "f32")
      local cp, cq = m.zeros({16}, {dtype = "bf16"}), m.zeros({16}, {dtype = "bf16"})
      local opt = make({{params = p, grads = g, compute = cp}, {params = q, grads = h, compute = cq, frozen = true}})
      opt:step(); opt:step()
      -- round to nearest even of each f32 master, by hand: the top 16 bits, plus the rounding bit
      for i, v in ipairs(vals(p)) do
        local u = string.unpack("<I4", string.pack("<f", v))
        local r = (u + 0x7fff + ((u >> 16) & 1)) >> 16 << 16
        assert.are.equal(string.unpack("<f", string.pack("<I4", r)), vals(cp:to("f32"))[i], "element " .. i)
      end
      assert.are.equal(0, cq:to("f32"):abs():max():item())   -- a frozen group's copy is never written
    end
    local e = support.errmsg(optim.AdamW, {{params = randn(16, "f32"), grads = randn(16, "f32"),
                                            compute = m.zeros({8}, {dtype = "bf16"})}})
    support.has(e, "moelua.optim.AdamW: group 1: 'compute' must be a contiguous bf16 (or f32) tensor on cpu with " ..
                   "16 elements like params")
    -- an i64 copy would truncate the weights
    support.has(support.errmsg(optim.AdamW, {{params = randn(16, "f32"), grads = randn(16, "f32"),
                                             compute = m.zeros({16}, {dtype = "i64"})}}),
                "group 1: 'compute' must be a contiguous bf16 (or f32) tensor")
  end)

  it("refuses groups it would never step, infinite factors and a method called with a dot", function()
    local function G() return {params = randn(4, "f32"), grads = randn(4, "f32")} end
    local has, errmsg = support.has, support.errmsg
    has(errmsg(optim.AdamW, {G(), nil, G()}),
        "moelua.optim.AdamW: groups must be a list 1..n, got a hole: group 2 is nil")
    has(errmsg(optim.SGD, {G(), extra = G()}), "moelua.optim.SGD: groups must be a list 1..n, got the key extra")
    has(errmsg(optim.AdamW, {G(), {params = randn(4, "f32"), grads = randn(4, "f32"), lr_mult = 1e309}}),
        "group 2: 'lr_mult' must be a finite number >= 0, got inf")
    has(errmsg(optim.AdamW, {{params = randn(4, "f32"), grads = randn(4, "f32"), weight_decay = 1 / 0}}),
        "group 1: 'weight_decay' must be a finite number >= 0, got inf")
    local o = optim.AdamW({G()})
    has(errmsg(o.step, o, math.huge), "moelua.optim.AdamW:step: lr must be a number in [0, inf), got inf")
    has(errmsg(o.step, 1e-3), "moelua.optim: opt:step is a method: call it with a colon, got a number for self")
    has(errmsg(o.zero_grad), "opt:zero_grad is a method: call it with a colon, got a nil for self")
    has(errmsg(o.state_tensor, o, "1", "exp_avg"),
        "moelua.optim.AdamW:state_tensor: argument #1 (group) must be an integer, got string")
    assert.is_table(optim.AdamW({G()}, {offload = false}))   -- `x and {...}`: none
  end)

  it("loads a state dict only whole: both dense states, known keys, none for a frozen group", function()
    local function G(frozen) return {params = randn(4, "f32"), grads = randn(4, "f32"), frozen = frozen} end
    local has, errmsg = support.has, support.errmsg
    local o = optim.AdamW({G(), G(true)})
    local fn = "moelua.optim.AdamW:load_state_dict: "
    has(errmsg(o.load_state_dict, o, {kind = "AdamW", t = 1, groups = {{step = 1, exp_avg_sq = m.full({4}, 7)},
                                                                      {step = 0}}}),
        fn .. "group 1: exp_avg_sq without exp_avg (a dense group's states are both or neither)")
    has(errmsg(o.load_state_dict, o, {kind = "AdamW", t = 1, groups = {{step = 1, exp_avgg = m.zeros(4)},
                                                                      {step = 0}}}),
        fn .. "group 1: 'exp_avgg' is not a state of AdamW (expected step, exp_avg, exp_avg_sq, steps)")
    has(errmsg(o.load_state_dict, o, {kind = "AdamW", t = 1, groups = {{step = 1},
                                                                      {step = 1, exp_avg = m.zeros(4),
                                                                       exp_avg_sq = m.zeros(4)}}}),
        fn .. "group 2 is frozen: it has no states, got 'exp_avg")
    has(errmsg(o.load_state_dict, o, o:state_dict(), {adpot = true}), fn .. "unknown option 'adpot'")
    o:load_state_dict(o:state_dict(), {adopt = false})
    -- a frozen sparse group round-trips (its state_dict lists no expert's states)
    local s = optim.AdamW({G(), {params = randn(4, "f32"), grads = randn(4, "f32"), experts = 2, frozen = true}})
    s:step(1e-3, {[2] = m.ones({2}, {dtype = "u8"})})
    s:load_state_dict(s:state_dict())
  end)

  it("scales a group's lr by lr_mult and uses its own weight_decay", function()
    local p0, g = randn(16, "f32"), randn(16, "f32")
    local a, b = p0:clone(), p0:clone()
    local oa = optim.AdamW({{params = a, grads = g, lr_mult = 0.25, weight_decay = 0}}, {lr = 0.1})
    local ob = optim.AdamW({{params = b, grads = g}}, {lr = 0.025, weight_decay = 0})
    for _ = 1, 3 do oa:step(); ob:step() end
    assert.is_true(same_bits(a, b))
    oa:step(0.4); ob:step(0.1)             -- the lr argument is scaled too
    assert.is_true(same_bits(a, b))
  end)

  it("round-trips state_dict into a fresh optimizer (dense, sparse and SGD)", function()
    local E = 3
    for _, kind in ipairs({"AdamW", "SGD"}) do
      local gd, ge = randn(12, "f32"), randn(12, "f32")
      local pd, pe = randn(12, "f32"), randn(12, "f32")
      local A = kind == "AdamW"
          and optim.AdamW({{params = pd, grads = gd}, {params = pe, grads = ge, experts = E}}, {lr = 0.01})
          or optim.SGD({{params = pd, grads = gd}}, {lr = 0.01, momentum = 0.9})
      local masks = {m.tensor({1, 0, 1}, {dtype = "u8"})}
      for _ = 1, 3 do A:step(nil, {nil, masks[1]}) end
      local sd = A:state_dict()
      local pd2, pe2 = pd:clone(), pe:clone()
      local B = kind == "AdamW"
          and optim.AdamW({{params = pd2, grads = gd}, {params = pe2, grads = ge, experts = E}}, {lr = 0.01})
          or optim.SGD({{params = pd2, grads = gd}}, {lr = 0.01, momentum = 0.9})
      B:load_state_dict(sd)
      assert.are.equal(3, B.t)
      if kind == "AdamW" then
        assert.are.same({3, 0, 3}, B.state[2].steps:totable())
        assert.are.equal("optim", B.state[1].exp_avg:category())
      end
      local mask2 = m.tensor({1, 1, 0}, {dtype = "u8"})
      A:step(nil, {nil, mask2}); B:step(nil, {nil, mask2})
      assert.is_true(same_bits(pd, pd2), kind .. " dense params")
      if kind == "AdamW" then assert.is_true(same_bits(pe, pe2), "expert params") end
    end
  end)

  it("round-trips state_dict with partially allocated experts (absent experts stay absent)", function()
    local E, S = 4, 6
    local o = {lr = 0.02, weight_decay = 0.1}
    local g = randn(E * S, "f32")
    local p = randn(E * S, "f32")
    local A = optim.AdamW({{params = p, grads = g, experts = E}}, o)
    A:step(nil, {u8({1, 0, 0, 0})}); A:step(nil, {u8({1, 0, 1, 0})})  -- experts 2, 4 never
    local sd = A:state_dict()
    assert.is_nil(sd.groups[1].exp_avg[2])
    assert.is_nil(sd.groups[1].exp_avg_sq[4])
    assert.are.equal(A.state[1].exp_avg[3], sd.groups[1].exp_avg[3])   -- live tensors
    local base = optim_bytes()
    local p2 = p:clone()
    local B = optim.AdamW({{params = p2, grads = g, experts = E}}, o)
    B:step(nil, {u8({0, 1, 0, 0})})            -- B has a state A lacks: loading frees it
    assert.are.equal(base + 2 * S * 4 + E * 8, optim_bytes())
    p2:copy_(p)
    B:load_state_dict(sd)
    assert.are.equal(base + 2 * 2 * S * 4 + E * 8, optim_bytes())   -- experts 1 and 3 only
    for e = 1, E do
      assert.are.equal(e == 1 or e == 3, B.state[1].exp_avg[e] ~= nil, "expert " .. e)
      assert.are.equal(e == 1 or e == 3, B.state[1].exp_avg_sq[e] ~= nil, "expert " .. e)
    end
    assert.are.equal("optim", B.state[1].exp_avg[3]:category())
    assert.are.same({2, 0, 1, 0}, B.state[1].steps:totable())
    assert.are.equal(2, B.t)
    assert.are.equal(A.skipped_expert_steps, B.skipped_expert_steps)
    -- both continue identically, expert 2's first states included
    for _, mk in ipairs({{0, 1, 1, 0}, {1, 1, 0, 1}}) do
      A:step(nil, {u8(mk)}); B:step(nil, {u8(mk)})
    end
    assert.is_true(same_bits(p, p2))
    for e = 1, E do
      assert.is_true(same_bits(A.state[1].exp_avg[e], B.state[1].exp_avg[e]), "exp_avg " .. e)
      assert.is_true(same_bits(A.state[1].exp_avg_sq[e], B.state[1].exp_avg_sq[e]), "exp_avg_sq " .. e)
    end
    assert.are.same(A.state[1].steps:totable(), B.state[1].steps:totable())
    -- an empty state (nothing ever active) loads as no states at all
    local C2 = optim.AdamW({{params = randn(E * S, "f32"), grads = g, experts = E}}, o)
    local before = optim_bytes()
    C2:load_state_dict(optim.AdamW({{params = randn(E * S, "f32"), grads = g, experts = E}}, o):state_dict())
    assert.are.equal(before, optim_bytes())
    assert.is_nil(C2.state[1].steps)
  end)

  it("refuses a state_dict of another kind or shape", function()
    local p, g = randn(8, "f32"), randn(8, "f32")
    local a = optim.AdamW({{params = p, grads = g}})
    local s = optim.SGD({{params = p, grads = g}}, {momentum = 0.9})
    s:step()
    assert.has_error(function() a:load_state_dict(s:state_dict()) end,
                     "moelua.optim.AdamW:load_state_dict: state of a SGD optimizer, this is AdamW")
    a:step()
    local sd = a:state_dict()
    local b = optim.AdamW({{params = randn(4, "f32"), grads = randn(4, "f32")}})
    assert.has_error(function() b:load_state_dict(sd) end,
                     "moelua.optim.AdamW:load_state_dict: group 1: 'exp_avg' must be f32 with 4 elements, got f32 with 8")
    -- sparse groups: per-expert tables, matching experts, counts
    local x = optim.AdamW({{params = randn(8, "f32"), grads = randn(8, "f32"), experts = 2}})
    local function bad(gs, msg)
      gs.step = 1
      collectgarbage()          -- the earlier optimizers' states: freed now, not during the call
      local before = optim_bytes()
      assert.has_error(function() x:load_state_dict({kind = "AdamW", groups = {gs}}) end,
                       "moelua.optim.AdamW:load_state_dict: group 1: " .. msg)
      assert.are.equal(before, optim_bytes())
    end
    local i64 = m.zeros({2}, {dtype = "i64"})
    bad({exp_avg = m.zeros({8}), exp_avg_sq = {}, steps = i64},
        "'exp_avg' must be a table {[expert] = tensor} (sparse group), got a tensor")
    bad({exp_avg = {[3] = m.zeros({4})}, exp_avg_sq = {}, steps = i64},
        "'exp_avg' keys must be experts 1..2, got 3")
    bad({exp_avg = {m.zeros({5})}, exp_avg_sq = {m.zeros({4})}, steps = i64},
        "'exp_avg[1]' must be f32 with 4 elements, got f32 with 5")
    bad({exp_avg = {nil, m.zeros({4})}, exp_avg_sq = {}, steps = i64},
        "expert 2 has exp_avg but not exp_avg_sq")
    bad({exp_avg = {m.zeros({4})}, exp_avg_sq = {m.zeros({4})}},
        "experts have states but no 'steps'")
    bad({exp_avg = {}, exp_avg_sq = {}, steps = m.zeros({3}, {dtype = "i64"})},
        "'steps' must be i64 with 2 elements, got i64 with 3")
  end)

  it("allocates states under the ledger category 'optim', lazily", function()
    local p, g = randn(100, "f32"), randn(100, "f32")
    local before = m.mem.stats().cpu.current.optim
    local opt = optim.AdamW({{params = p, grads = g}})
    assert.are.equal(before, m.mem.stats().cpu.current.optim)
    opt:step()
    assert.are.equal(before + 2 * 100 * 4, m.mem.stats().cpu.current.optim)
    assert.are.equal("optim", opt.state[1].exp_avg_sq:category())
  end)

  it("makes no ledger allocation in a warmed-up step (with clipping)", function()
    local p, g = randn(5000, "f32"), randn(5000, "f32")
    local q, h = randn(400, "f32"), randn(400, "f32")
    local mask = m.tensor({1, 0, 1, 1}, {dtype = "u8"})
    local norms = m.zeros({4}, {dtype = "f64"})
    local opt = optim.AdamW({{params = p, grads = g}, {params = q, grads = h, experts = 4}})
    local sgd = optim.SGD({{params = m.zeros({300}), grads = m.ones({300})}}, {momentum = 0.9})
    opt:step(1e-3, {nil, mask}); sgd:step()          -- warm-up: states appear
    collectgarbage(); collectgarbage()
    local before = allocs()
    for _ = 1, 3 do
      optim.clip_expert_norms(h, 4, {1, 1, 1, 1}, norms)
      optim.clip_grad_norm(opt, 1.0)
      opt:step(1e-3, {nil, mask})
      sgd:step()
    end
    opt:zero_grad()
    assert.are.equal(before, allocs())
  end)
end)

-- ---- checkpoints of a sparse run (moelua.train: optim_by_name, load_optim) ----------

describe("lazy Adam in checkpoints", function()
  local nn = require "moelua.nn"
  local sched = require "moelua.sched"
  local data = require "moelua.data"
  local train = require "moelua.train"
  local ckpt = require "moelua.ckpt"
  local SEQ, E = 16, 16          -- 16 tokens, top-1 of 16 experts: some stay idle

  -- which experts have states, per sparse group: {[gi] = "0110..."}
  local function held(opt)
    local out = {}
    for gi, st in ipairs(opt.state) do
      if st.experts then
        local b = {}
        for e = 1, st.experts do b[e] = st.exp_avg[e] and "1" or "0" end
        out[gi] = table.concat(b)
      end
    end
    return out
  end

  -- over.snap: a table that receives held(opt) at the start of step 2
  local function run(over)
    m.manual_seed(0)
    local model = nn.Transformer.new{vocab = 256, dim = 16, layers = 1, heads = 2, kv_heads = 1, ffn = 8,
                                     experts = E, topk = 1, seed = 0, checkpoint = "moe"}
    local ds = data.open{glob = "/usr/include/std*.h", seq_len = SEQ, seed = 0, holdout = 0.01}
    local groups = model:param_groups{weight_decay = 0.1, sparse = true}
    local opt = optim.AdamW(groups, {lr = 3e-3, beta2 = 0.95})
    local cfg = {model = model, data = ds, optimizer = opt, groups = groups, seq_len = SEQ, steps = 5,
                 lr = sched.constant(3e-3), clip = 1.0, aux_weight = 0.01, z_weight = 1e-3}
    for k, v in pairs(over) do if k ~= "snap" then cfg[k] = v end end
    if over.snap then
      cfg.hook = function(step) if step == 2 then over.snap.held = held(opt) end end
    end
    return train.run(cfg), model, opt
  end

  local dir
  before_each(function() dir = support.make_tmpdir() end)
  after_each(function() support.remove_dir(dir) end)

  it("saves only the experts that have states and resumes bit-exactly", function()
    local sa, sb = {}, {}
    local a, ma, oa = run{run_dir = dir .. "/a", ckpt_every = 2, keep = 5, snap = sa}
    local c = ckpt.load(dir .. "/a/ckpt/step-000001")
    -- an expert's w1/w2/w3 states are saved iff it has had tokens (count > 0)
    local idle = 0
    for e = 0, E - 1 do
      local pre = "model.layers.0.block_sparse_moe.experts." .. e .. "."
      local cnt = c.optim_steps[pre .. "w1.weight"]:read():item()
      for _, w in ipairs({"w1", "w2", "w3"}) do
        assert.are.equal(cnt, c.optim_steps[pre .. w .. ".weight"]:read():item())
        assert.are.equal(cnt > 0, c.optim[pre .. w .. ".weight"] ~= nil, pre .. w)
      end
      if cnt == 0 then idle = idle + 1 end
    end
    assert.is_true(idle > 0 and idle < E, "partially allocated experts at the checkpoint: " .. idle .. " idle")
    assert.is_not_nil(c.optim["model.layers.0.self_attn.q_proj.weight"])   -- dense states as before
    local b, mb, ob = run{run_dir = dir .. "/b", resume = dir .. "/a/ckpt/step-000001", snap = sb}
    assert.are.equal(2, b.first_step)
    -- the resumed optimizer holds states for exactly the experts the saved one held
    assert.is_not_nil(sa.held and next(sa.held))
    assert.are.same(sa.held, sb.held)
    for gi, bits in pairs(sb.held) do
      assert.matches("0", bits, "group " .. gi .. ": an idle expert without states")
      assert.matches("1", bits, "group " .. gi .. ": an expert with states")
    end
    for step = 2, 4 do
      assert.are.equal(string.format("%a", a.losses[step]), string.format("%a", b.losses[step]), "step " .. step)
    end
    local pa, pb = ma:named_parameters(), mb:named_parameters()
    for i, t in ipairs(pa) do assert.is_true(same_bits(t.tensor, pb[i].tensor), t.name) end
    assert.are.equal(oa.skipped_expert_steps, ob.skipped_expert_steps)
    for gi, st in ipairs(oa.state) do
      if st.experts then
        for e = 1, st.experts do
          local x, y = st.exp_avg_sq[e], ob.state[gi].exp_avg_sq[e]
          assert.are.equal(x ~= nil, y ~= nil, "group " .. gi .. " expert " .. e)
          if x then assert.is_true(same_bits(x, y), "group " .. gi .. " expert " .. e) end
        end
        assert.are.same(st.steps:totable(), ob.state[gi].steps:totable())
      end
    end
  end)
end)

-- ---- interrupt ---------------------------------------------------------------------

describe("Ctrl-C during steps", function()
  it("never stops an optimizer step midway, inside a group or between groups", function()
    -- p and g are constant, so after any whole number of steps every element
    -- of a group is equal (a step cut between tiles would leave two values),
    -- and the three groups are equal (a step cut between groups would not).
    local code, out = support.interrupt_child([[
      io.stdout:setvbuf("no")
      local m = require "moelua"
      local optim = require "moelua.optim"
      print(io.open("/proc/self/stat"):read("n"))
      local n = 1 << 21
      local p, g = m.full({n}, 1.0), m.full({n}, 0.5)
      local p2, p3 = p:clone(), p:clone()
      local opt = optim.AdamW({{params = p, grads = g}, {params = p2, grads = g},
                               {params = p3, grads = g}}, {lr = 1e-3})
      io.write("ready\n")
      local ok, err = pcall(function() for _ = 1, 2000 do opt:step() end end)
      print("caught", ok, err)
      print("steps", opt.t, opt.state[1].step, opt.state[3].step,
            "spread", p:max():item() - p:min():item(), p3:max():item() - p3:min():item(),
            "groups", p:max():item() - p2:max():item(), p:max():item() - p3:max():item())
    ]], 0.1)
    assert.are.equal(0, code, out)
    assert.matches("caught\tfalse", out)
    assert.not_matches("adamw_step: interrupted", out)
    assert.matches("spread\t0%.0\t0%.0\tgroups\t0%.0\t0%.0", out)
    local t, s1, s3 = out:match("steps\t(%d+)\t(%d+)\t(%d+)")
    assert.is_true(t ~= nil and t == s1 and t == s3, out)
  end)
end)

-- ---- bad input ---------------------------------------------------------------------

describe("optimizer bad input", function()
  local f32, f64 = m.zeros({8}), m.zeros({8}, {dtype = "f64"})
  local function e(fn, msg) assert.has_error(fn, msg) end
  local hp = {lr = 0.1, step = 1}

  it("adamw_step checks tensors and options", function()
    e(function() C.adamw_step(f32, f64, f32, f32, hp) end,
      "moelua.optim_c.adamw_step: grads is f64 but params is f32 (same dtype expected)")
    e(function() C.adamw_step(f32, m.zeros({9}), f32, f32, hp) end,
      "moelua.optim_c.adamw_step: grads has 9 elements but must have 8")
    e(function() C.adamw_step(f32, f32, m.zeros({4, 2}):t(), f32, hp) end,
      "moelua.optim_c.adamw_step: exp_avg must be contiguous (call :contiguous())")
    e(function() C.adamw_step(m.zeros({8}, {dtype = "i32"}), f32, f32, f32, hp) end,
      "moelua.optim_c.adamw_step: params must be f32 or f64, got i32")
    e(function() C.adamw_step(f32, f32, f32, "v", hp) end,
      "moelua.optim_c.adamw_step: argument #4 (exp_avg_sq): expected a tensor, got string")
    e(function() C.adamw_step(f32, f32, f32, f32, {lr = 0.1}) end,
      "moelua.optim_c.adamw_step: option 'step' is required")
    e(function() C.adamw_step(f32, f32, f32, f32, {lr = 0.1, step = 0}) end,
      "moelua.optim_c.adamw_step: step must be >= 1 (1-based), got 0")
    e(function() C.adamw_step(f32, f32, f32, f32, {lr = 0.1, step = 1, beta1 = 1}) end,
      "moelua.optim_c.adamw_step: beta1 must be in [0, 1), got 1")
    e(function() C.adamw_step(f32, f32, f32, f32, {step = 1}) end,
      "moelua.optim_c.adamw_step: option 'lr' is required")
    e(function() C.adamw_step(f32, f32, f32, f32, {lr = 0.1, step = 1, betas = {}}) end,
      "moelua.optim_c.adamw_step: unknown option 'betas' (expected one of: lr, beta1, beta2, eps, weight_decay, step)")
    e(function() C.adamw_step(f32, f32, f32, f32) end,
      "moelua.optim_c.adamw_step: argument #5 (opts): expected a table, got no value")
  end)

  it("lazy_adamw_step checks masks, counts, E and the per-expert states", function()
    local a, s = m.zeros({4}, {dtype = "u8"}), m.zeros({4}, {dtype = "i64"})
    local o = {lr = 0.1}
    local fn = "moelua.optim_c.lazy_adamw_step: "
    e(function() C.lazy_adamw_step(f32, f32, {}, {}, a, s, 3, o) end,
      fn .. "E = 3 does not divide the 8 elements of params")
    e(function() C.lazy_adamw_step(f32, f32, {}, {}, m.zeros({4}), s, 4, o) end,
      fn .. "active must be u8, got f32")
    e(function() C.lazy_adamw_step(f32, f32, {}, {}, a, m.zeros({2}, {dtype = "i64"}), 4, o) end,
      fn .. "steps has 2 elements but must have 4")
    e(function() C.lazy_adamw_step(f32, f32, {}, {}, a, s, 4, {lr = 0.1, step = 2}) end,
      fn .. "unknown option 'step' (expected one of: lr, beta1, beta2, eps, weight_decay)")
    e(function() C.lazy_adamw_step(f32, f32, {}, {}, a, s, 0, o) end,
      fn .. "E must be >= 1, got 0")
    e(function() C.lazy_adamw_step(f32, f32, f32, {}, a, s, 4, o) end,
      fn .. "argument #3 (exp_avg): expected a table {[expert] = tensor}, got userdata")
    e(function() C.lazy_adamw_step(f32, f32, {[5] = m.zeros({2})}, {}, a, s, 4, o) end,
      fn .. "argument #3 (exp_avg): keys must be experts 1..4, got 5")
    e(function() C.lazy_adamw_step(f32, f32, {}, {nil, m.zeros({3})}, a, s, 4, o) end,
      fn .. "exp_avg_sq[2] has 3 elements but must have 2")
    e(function() C.lazy_adamw_step(f32, f32, {}, {m.zeros({2}, {dtype = "f64"})}, a, s, 4, o) end,
      fn .. "exp_avg_sq[1] is f64 but params is f32 (same dtype expected)")
    local p = randn(8, "f32")
    local p0 = p:clone()
    local act = u8({0, 1, 0, 0})
    e(function() C.lazy_adamw_step(p, f32, {}, {}, act, s, 4, o) end,
      fn .. "exp_avg[2]: expert 2 is active but has no state")
    e(function() C.lazy_adamw_step(p, f32, {nil, m.zeros({2})}, {}, act, s, 4, o) end,
      fn .. "exp_avg_sq[2]: expert 2 is active but has no state")
    assert.is_true(same_bits(p0, p))
    assert.are.same({0, 0, 0, 0}, s:totable())
    -- the states of idle experts may be absent; an active one is updated
    local g = randn(8, "f32")
    assert.are.equal(1, C.lazy_adamw_step(p, g, {nil, m.zeros({2})}, {nil, m.zeros({2})}, act, s, 4, o))
    assert.are.same({0, 1, 0, 0}, s:totable())
    assert.is_true(same_bits(p0:narrow(1, 1, 2), p:narrow(1, 1, 2)))
    assert.is_false(same_bits(p0:narrow(1, 3, 2), p:narrow(1, 3, 2)))
    e(function() C.unstated(m.zeros({4}), {}, {}) end,
      "moelua.optim_c.unstated: active must be u8, got f32")
    e(function() C.unstated(a, f32, {}) end,
      "moelua.optim_c.unstated: argument #2 (states): expected a table {[expert] = tensor}, got userdata")
    local out = {}
    assert.are.equal(2, C.unstated(u8({1, 1, 0, 1}), {nil, m.zeros({2})}, out))
    assert.are.same({1, 4}, out)
  end)

  it("sgd_step checks the momentum buffer and nesterov", function()
    e(function() C.sgd_step(f32, f32, nil, {lr = 0.1, momentum = 0.9, step = 1}) end,
      "moelua.optim_c.sgd_step: momentum 0.9 needs a momentum_buffer, got none")
    e(function() C.sgd_step(f32, f32, nil, {lr = 0.1, step = 0}) end,
      "moelua.optim_c.sgd_step: step must be >= 1 (1-based), got 0")
    e(function() C.sgd_step(f32, f32, f32, {lr = 0.1, nesterov = true, step = 1}) end,
      "moelua.optim_c.sgd_step: nesterov needs momentum > 0 and dampening = 0 (got momentum 0, dampening 0)")
    e(function() C.sgd_step(f32, f32, f64, {lr = 0.1, momentum = 0.5, step = 1}) end,
      "moelua.optim_c.sgd_step: momentum_buffer is f64 but params is f32 (same dtype expected)")
  end)

  it("norm and clip functions check their arguments", function()
    e(function() C.grad_norm({f32, "x"}) end,
      "moelua.optim_c.grad_norm: argument #1 (tensor 2): expected a tensor, got string")
    e(function() C.grad_norm(f32) end,
      "moelua.optim_c.grad_norm: argument #1: expected a table of tensors, got userdata")
    e(function() C.clip_grad_norm_({f32}, -1) end,
      "moelua.optim_c.clip_grad_norm_: max_norm must be >= 0, got -1")
    e(function() C.clip_grad_norm_({f32, m.zeros({2}, {dtype = "i32"})}, 1) end,
      "moelua.optim_c.clip_grad_norm_: tensor 2 must be f32 or f64, got i32")
    e(function() C.slice_norms(f32, 3) end,
      "moelua.optim.expert_norms: E = 3 does not divide the 8 elements of grads")
    e(function() C.slice_norms(f32, 4, m.zeros({4})) end,
      "moelua.optim.expert_norms: out must be f64, got f32")
    e(function() C.scale_(f32, math.huge) end,
      "moelua.optim_c.scale_: factor must be finite, got inf")
    e(function() optim.clip_expert_norms(f32, 4, {1, 2, 3}) end,
      "moelua.optim.clip_expert_norms: argument #3 (bounds): expected 4 bounds, got 3")
    e(function() optim.clip_expert_norms(f32, 2, {1, -1}) end,
      "moelua.optim.clip_expert_norms: bounds[2] must be finite and >= 0, got -1")
    e(function() optim.clip_grad_norm({{params = f32}}, 1) end,
      "moelua.optim.clip_grad_norm: group 1 has no 'grads' tensor")
    e(function() optim.clip_grad_norm({{grads = m.zeros({2}, {dtype = "i64"})}}, 1) end,
      "moelua.optim.clip_grad_norm: group 1: grads must be f32 or f64, got i64")
    e(function() optim.clip_expert_norms(m.zeros(7), 3, {1, 1, 1}) end,
      "moelua.optim.clip_expert_norms: E = 3 does not divide the 7 elements of grads")
    e(function() optim.expert_norms(f32, "4") end,
      "moelua.optim.expert_norms: argument #2 (E): expected an integer, got string")
    -- at the caller's line, not optim.lua's
    assert.matches("^[^:]*optim_spec%.lua:%d+: moelua%.optim%.clip_expert_norms: bounds%[2%]",
                   select(2, pcall(function() local n = optim.clip_expert_norms(f32, 2, {1, -1}); return n end)))
  end)

  it("step_all checks every job before it updates any", function()
    local p, g = randn(8, "f32"), randn(8, "f32")
    local p0 = p:clone()
    local good = {op = "adamw", params = p, grads = g, exp_avg = m.zeros({8}),
                  exp_avg_sq = m.zeros({8}), step = 0, hp = {lr = 0.1}}
    local bad = {op = "sgd", params = m.zeros({8}), grads = m.zeros({8}, {dtype = "f64"}),
                 step = 0, hp = {lr = 0.1}}
    local counters = {t = 0, skipped_expert_steps = 0}
    e(function() C.step_all({good, bad}, counters) end,
      "moelua.optim_c.step_all: job 2 (sgd): grads is f64 but params is f32 (same dtype expected)")
    assert.is_true(same_bits(p0, p))
    assert.are.equal(0, good.step)
    assert.are.equal(0, counters.t)
    local lazy = {op = "lazy_adamw", params = randn(8, "f32"), grads = g, exp_avg = {},
                  exp_avg_sq = {}, active = u8({0, 1}), steps = m.zeros({2}, {dtype = "i64"}),
                  experts = 2, hp = {lr = 0.1}}
    e(function() C.step_all({good, lazy}, counters) end,
      "moelua.optim_c.step_all: job 2 (lazy_adamw): exp_avg[2]: expert 2 is active but has no state")
    assert.is_true(same_bits(p0, p))
    e(function() C.step_all({{op = "adam"}}, counters) end,
      "moelua.optim_c.step_all: job 1: field 'op' must be \"adamw\", \"lazy_adamw\" or \"sgd\", got adam")
    C.step_all({good}, counters, 0)
    e(function() C.step_all({{op = "adamw", params = p, grads = g, exp_avg = good.exp_avg,
      exp_avg_sq = good.exp_avg_sq, step = -1, hp = {lr = 0.1}}}, counters) end,
      "moelua.optim_c.step_all: job 1 (adamw): step must be >= 0 (completed steps), got -1")
    assert.are.equal(1, good.step)     -- the first call ran
    assert.are.equal(1, counters.t)
  end)

  it("the classes check groups, options and masks", function()
    e(function() optim.AdamW({}) end,
      "moelua.optim.AdamW: groups must be a non-empty list of tables, got table")
    e(function() optim.AdamW({{params = f32, grads = f64}}) end,
      "moelua.optim.AdamW: group 1: params (f32) and grads (f64) must share dtype f32 or f64")
    e(function() optim.AdamW({{params = f32, grads = f32, lr = 1}}) end,
      "moelua.optim.AdamW: group 1: unknown key 'lr' (expected one of: compute, exp_avg, exp_avg_sq, experts, frozen, grads, lr_mult, name, params, weight_decay)")
    e(function() optim.AdamW({{params = f32, grads = f32, experts = 3}}) end,
      "moelua.optim.AdamW: group 1: 'experts' must be an integer >= 1 dividing 8 elements, got 3")
    e(function() optim.AdamW({{params = f32, grads = f32}}, {betas = {0.9, 0.99}}) end,
      "moelua.optim.AdamW: unknown option 'betas' (expected one of: beta1, beta2, eps, lr, offload, weight_decay)")
    e(function() optim.AdamW({{params = f32, grads = f32}}, {beta2 = 1.5}) end,
      "moelua.optim.AdamW: option 'beta2' must be a number in [0, 1), got 1.5")
    e(function() optim.SGD({{params = f32, grads = f32, experts = 2}}) end,
      "moelua.optim.SGD: group 1: 'experts' (sparse mode) is lazy Adam; use optim.AdamW")
    e(function() optim.SGD({{params = f32, grads = f32}}, {nesterov = true}) end,
      "moelua.optim.SGD: nesterov needs momentum > 0 and dampening = 0")
    local opt = optim.AdamW({{params = m.zeros({8}), grads = m.zeros({8}), experts = 2}})
    e(function() opt:step() end,
      "moelua.optim.AdamW:step: group 1 has experts = 2 and needs active_masks[1] (u8 [2]), got nil")
    e(function() opt:step(-1) end,
      "moelua.optim.AdamW:step: lr must be a number in [0, inf), got -1")
    e(function() opt:step(nil, {u8({1, 0, 1})}) end,
      "moelua.optim.AdamW:step: group 1 has experts = 2 and needs active_masks[1] (u8 [2]), got u8 [3]")
    assert.is_nil(next(opt.state[1].exp_avg))      -- refused before any state was allocated
    -- each blames its caller's line, not optim.lua's, however deep the check
    for _, f in ipairs{function() optim.AdamW({}) end,
                       function() optim.AdamW({{params = f32, grads = f32, lr = 1}}) end,
                       function() optim.AdamW({{params = f32, grads = f32}}, {betas = 1}) end,
                       function() optim.AdamW({{params = f32, grads = f32}}, {beta2 = 1.5}) end,
                       function() opt:step(-1) end} do
      assert.matches("^[^:]*optim_spec%.lua:%d+: moelua%.optim%.AdamW", select(2, pcall(f)))
    end
  end)

  it("README's example runs as written", function()
    local readme = support.read_file("README.md")
    local a = assert(readme:find("```lua\nlocal m, optim = require \"moelua\", require \"moelua.optim\"", 1, true))
    local b = assert(readme:find("\n```\n", a, true))
    local chunk = assert(load(readme:sub(a + 7, b) .. "return opt, norm", "=README"))
    local opt, norm = chunk()
    assert.are.equal(3, opt.skipped_expert_steps)   -- the example's comment
    assert.is_true(norm > 0 and norm < math.huge)
  end)
end)
