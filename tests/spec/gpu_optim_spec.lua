-- tests/spec/gpu_optim_spec.lua - CPU-vs-CUDA parity of the optimizer
-- kernels (kernels/optim.cu against kernels/optim.c) through the functions
-- of moelua.optim_c on flat parameters placed on the device: a few steps
-- of AdamW (both lerp branches, a changing lr as lr_mult gives), SGD
-- (plain with weight decay, momentum with dampening, nesterov), lazy AdamW
-- over experts with states on some experts only and a mask that changes
-- every step, grad_norm over several buffers past one super block (4M
-- elements), slice_norms, scale_ and clip_slices_.
--
-- Lazy AdamW's active mask and step counts are host arrays on every
-- backend (kernels/optim.h), so they stay cpu tensors in both runs.
--
-- Tolerances. optim.cu computes every update in the CPU's operation order
-- and dtype from the same host-computed per-step scalars, with IEEE
-- + - * / and sqrt and no FMA, and its norms add squares in the CPU's block
-- order, so both are expected to be bitwise equal. The spec asserts the
-- bounds that hold even if a single operation rounded differently:
--   updates (p, exp_avg, exp_avg_sq, momentum buffers) after 5 steps:
--     normwise relative error f64 1e-12, f32 1e-6;
--   norms of n elements: relative n * 2^-53, the worst case of summing n
--     nonnegative squares in f64 in any other order (a different tree);
--   step counts and the number of active experts: equal.
--
-- Without a CUDA device the whole file is one pending test. With
-- MOELUA_GPU_SPEC_DEVICE=cpu it runs CPU against CPU (checks the spec
-- itself on a machine without a GPU).
local m = require "moelua"
local C = require "moelua.optim_c"
local support = require "tests.support"

local DEV = os.getenv("MOELUA_GPU_SPEC_DEVICE") or "cuda"

if DEV == "cuda" and not m.cuda_available() then
  describe("GPU optimizer parity", function()
    pending("no CUDA device: GPU optimizer specs skipped")
  end)
  return
end

local TOL = {f32 = 1e-6, f64 = 1e-12}
local gen = support.generator(9100)

local function values(t) return support.values(t:to("cpu")) end

local function assert_close(cpu, gpu, tol, what)
  assert.are.equal(DEV, gpu:device(), what)
  support.assert_close(values(gpu), values(cpu), tol, what)
end

-- |gpu - cpu| <= n 2^-53 |cpu| for a norm over n elements
local function assert_norm(cpu, gpu, n, what)
  local bound = n * 2^-53 * math.abs(cpu)
  assert(math.abs(gpu - cpu) <= bound,
         string.format("%s: cpu %.17g, %s %.17g (bound %.3g)", what, cpu, DEV, gpu, bound))
end

local function dev(t) return t:to(DEV) end

-- The same flat tensors on the cpu and on the device.
local function pair(t) return t, dev(t) end

describe("GPU optimizer parity: AdamW and SGD", function()
  local n = 10007   -- several blocks of threads, a ragged tail

  it("AdamW agrees over 5 steps, f32 and f64, both lerp branches", function()
    for _, dt in ipairs({"f32", "f64"}) do
      for _, beta1 in ipairs({0.9, 0.3}) do   -- 1 - beta1 below and above 0.5
        local p, gp = pair(gen.randn({n}, dt))
        local mm, gm = pair(m.zeros({n}, {dtype = dt}))
        local vv, gv = pair(m.zeros({n}, {dtype = dt}))
        for t = 1, 5 do
          local g = gen.randn({n}, dt, 0.1)
          local hp = {lr = 1e-2 * (t % 2 == 0 and 0.5 or 1), beta1 = beta1, beta2 = 0.95,
                      eps = 1e-8, weight_decay = 0.1, step = t}
          C.adamw_step(p, g, mm, vv, hp)
          C.adamw_step(gp, dev(g), gm, gv, hp)
        end
        local what = string.format("adamw %s beta1 %g", dt, beta1)
        assert_close(p, gp, TOL[dt], what .. " params")
        assert_close(mm, gm, TOL[dt], what .. " exp_avg")
        assert_close(vv, gv, TOL[dt], what .. " exp_avg_sq")
      end
    end
  end)

  it("SGD agrees over 5 steps: plain, momentum with dampening, nesterov", function()
    local configs = {
      {lr = 0.05, weight_decay = 0.01},
      {lr = 0.05, momentum = 0.9, dampening = 0.1, weight_decay = 0.01},
      {lr = 0.05, momentum = 0.8, nesterov = true},
    }
    for _, dt in ipairs({"f32", "f64"}) do
      for k, o in ipairs(configs) do
        local p, gp = pair(gen.randn({n}, dt))
        local buf, gbuf
        if o.momentum then buf, gbuf = pair(m.zeros({n}, {dtype = dt})) end
        for t = 1, 5 do
          local g = gen.randn({n}, dt, 0.1)
          local hp = {step = t}
          for key, v in pairs(o) do hp[key] = v end
          C.sgd_step(p, g, buf, hp)
          C.sgd_step(gp, dev(g), gbuf, hp)
        end
        local what = string.format("sgd %s config %d", dt, k)
        assert_close(p, gp, TOL[dt], what .. " params")
        if buf then assert_close(buf, gbuf, TOL[dt], what .. " momentum buffer") end
      end
    end
  end)
end)

describe("GPU optimizer parity: lazy AdamW", function()
  it("agrees over 5 steps with per-expert states, counts and masks", function()
    local E, S = 4, 2501
    local n = E * S
    local masks = {{1, 1, 0, 0}, {0, 1, 0, 1}, {1, 0, 0, 1}, {1, 1, 0, 1}, {0, 0, 0, 0}}
    local hp = {lr = 1e-2, beta1 = 0.9, beta2 = 0.99, eps = 1e-8, weight_decay = 0.1}
    for _, dt in ipairs({"f32", "f64"}) do
      local p, gp = pair(gen.randn({n}, dt))
      -- expert 3 is never active and has no states
      local ms, vs, gms, gvs = {}, {}, {}, {}
      for _, e in ipairs({1, 2, 4}) do
        ms[e], gms[e] = pair(m.zeros({S}, {dtype = dt}))
        vs[e], gvs[e] = pair(m.zeros({S}, {dtype = dt}))
      end
      local steps = m.zeros({E}, {dtype = "i64"})
      local gsteps = m.zeros({E}, {dtype = "i64"})
      for t, mask in ipairs(masks) do
        local g = gen.randn({n}, dt, 0.1)
        local active = m.tensor(mask, {dtype = "u8"})
        local k = C.lazy_adamw_step(p, g, ms, vs, active, steps, E, hp)
        local gk = C.lazy_adamw_step(gp, dev(g), gms, gvs, active, gsteps, E, hp)
        assert.are.equal(k, gk, "active experts at step " .. t)
      end
      assert.are.same(support.values(steps), support.values(gsteps))
      assert.are.same({3, 3, 0, 3}, support.values(gsteps))
      local what = "lazy adamw " .. dt
      assert_close(p, gp, TOL[dt], what .. " params")
      for _, e in ipairs({1, 2, 4}) do
        assert_close(ms[e], gms[e], TOL[dt], what .. " exp_avg " .. e)
        assert_close(vs[e], gvs[e], TOL[dt], what .. " exp_avg_sq " .. e)
      end
    end
  end)
end)

describe("GPU optimizer parity: norms and clipping", function()
  it("grad_norm agrees over buffers of both dtypes, past one super block", function()
    local big = 4 * 1024 * 1024 + 12345   -- two super blocks, a ragged last block
    local a, ga = pair(gen.randn({big}, "f32"))
    local b, gb = pair(gen.randn({70001}, "f64"))
    local cpu, gpu = C.grad_norm({a, b}), C.grad_norm({ga, gb})
    assert_norm(cpu, gpu, big + 70001, "grad_norm")
    assert.are.equal(0, C.grad_norm({dev(m.zeros({5}))}))
  end)

  it("slice_norms agrees per slice, slices past one super block", function()
    local cases = {{"f32", 3, 4 * 1024 * 1024 + 5}, {"f64", 7, 10000}, {"f32", 1, 4097}}
    for _, c in ipairs(cases) do
      local dt, E, S = c[1], c[2], c[3]
      local x, gx = pair(gen.randn({E * S}, dt))
      local cpu, gpu = C.slice_norms(x, E), C.slice_norms(gx, E)
      assert.are.equal(DEV, gpu:device())
      local cv, gv = support.values(cpu), values(gpu)
      for e = 1, E do
        assert_norm(cv[e], gv[e], S, string.format("slice_norms %s E %d slice %d", dt, E, e))
      end
    end
  end)

  it("scale_ and clip_slices_ agree (some slices clipped, some not)", function()
    for _, dt in ipairs({"f32", "f64"}) do
      local E, S = 5, 3001
      local x, gx = pair(gen.randn({E * S}, dt))
      C.scale_(x, 0.37)
      C.scale_(gx, 0.37)
      assert_close(x, gx, TOL[dt], "scale_ " .. dt)
      -- slice norms are about 0.37 sqrt(S) ~ 20: bounds 1 and 5 clip, 100 does not
      local bounds = {1, 100, 5, 100, 0}
      -- out = nil spelled out: a trailing nil counts as no out
      local cpu = C.clip_slices_(x, E, bounds, nil)
      local gpu = C.clip_slices_(gx, E, bounds, nil)
      local cv, gv = support.values(cpu), values(gpu)
      for e = 1, E do
        assert_norm(cv[e], gv[e], S, string.format("clip_slices_ %s norm %d", dt, e))
      end
      assert_close(x, gx, TOL[dt], "clip_slices_ " .. dt)
      local after = support.values(C.slice_norms(x, E))
      assert(math.abs(after[1] - 1) < 1e-4 and after[5] == 0, "clip_slices_ clipped " .. dt)
    end
  end)
end)
