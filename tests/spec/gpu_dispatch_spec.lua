-- CPU-vs-CUDA parity of what expert parallelism adds to the dispatch
-- family (kernels/dispatch.cu against dispatch.c): per-expert capacities
-- in the counting sort, pack and unpack of a plan's rows, and the exchange
-- they make (pack, a k = 1 expert run per assignment, unpack) reproducing
-- experts.forward's y on one device. Everything is bitwise: the sort and
-- pack move integers and bytes, unpack adds a row's contributions in the
-- CPU's order (--fmad=false), and the exchange runs the same cuBLAS GEMM
-- shapes on the same rows as the one-device forward.
--
-- Without a CUDA device the whole file is one pending test. With
-- MOELUA_GPU_SPEC_DEVICE=cpu it runs CPU against CPU (checks the spec
-- itself on a machine without a GPU; the device-mismatch spec pends).
local m = require "moelua"
local support = require "tests.support"

local DEV = os.getenv("MOELUA_GPU_SPEC_DEVICE") or "cuda"

if DEV == "cuda" and not m.cuda_available() then
  describe("GPU parity: dispatch for expert parallelism", function()
    pending("no CUDA device: GPU specs skipped")
  end)
  return
end

local experts = m.experts

local function dev(t) return t:to(DEV) end
local function vals(t) return support.values(t:to("cpu")) end

-- bitwise: the same doubles ("%a" tells -0 from 0)
local function assert_same(cpu, gpu, what)
  local a, b = vals(cpu), vals(gpu)
  assert.are.same(cpu:shape(), gpu:shape(), what)
  for i = 1, #a do
    if string.format("%a", a[i]) ~= string.format("%a", b[i]) then
      error(string.format("%s: element %d differs: cpu %.17g, %s %.17g", what, i, a[i], DEV, b[i]), 2)
    end
  end
end

local function same_plan(p, g, what)
  for _, key in ipairs({"offsets", "order", "counts", "dropped"}) do
    assert.are.equal(DEV, g[key]:device())
    assert_same(p[key], g[key], key .. " " .. what)
  end
  assert.are.equal(p.ndropped, g.ndropped, "ndropped " .. what)
end

-- idx [T, k] of uniform expert ids (repeats within a token allowed: the
-- kernels do not care)
local function ids(T, k, E, seed)
  return m.rand({T, k}, {dtype = "f64", seed = seed, offset = 0}):mul(E):to("i64")
end

describe("GPU parity: dispatch for expert parallelism", function()
  it("sorts with per-expert capacities bitwise as the CPU, across many tiles", function()
    local cases = {{T = 1000, k = 2, E = 8}, {T = 5003, k = 4, E = 37}, {T = 1, k = 1, E = 3}}
    for ci, c in ipairs(cases) do
      local idx = ids(c.T, c.k, c.E, 70 + ci)
      local caps = m.rand({c.E}, {dtype = "f64", seed = 80 + ci, offset = 0})
                    :mul(2 * c.T * c.k / c.E):to("i64")
      local o, go = {policy = "drop", capacities = caps}, {policy = "drop", capacities = dev(caps)}
      same_plan(experts.dispatch(idx, c.E, o), experts.dispatch(dev(idx), c.E, go), "case " .. ci)
    end
  end)

  it("packs and unpacks bitwise as the CPU, per token and per assignment, every dtype", function()
    local T, k, E, C = 1001, 4, 16, 13
    local idx = ids(T, k, E, 90)
    local o = {policy = "drop", capacity = T * k // E - 40}
    local plan, gplan = experts.dispatch(idx, E, o), experts.dispatch(dev(idx), E, o)
    assert(plan.ndropped > 0, "the capacity must drop something here")
    local kept = T * k - plan.ndropped
    for _, dt in ipairs({"f32", "f64", "bf16", "i64", "u8"}) do
      for _, rows in ipairs({T, T * k}) do
        local src = m.randn({rows, C}, {dtype = "f64", seed = 91, offset = 0}):mul(50):to(dt)
        local what = ("pack %s [%d, %d]"):format(dt, rows, C)
        local g = experts.pack(dev(src), gplan)
        assert.are.equal(DEV, g:device())
        assert_same(experts.pack(src, plan), g, what)
      end
    end
    for _, dt in ipairs({"f32", "f64"}) do
      local rows = m.randn({kept, C}, {dtype = dt, seed = 92, offset = 0})
      for _, n in ipairs({T, T * k}) do
        local out = m.randn({n, C}, {dtype = dt, seed = 93, offset = 0})
        local gout = dev(out)
        experts.unpack(rows, plan, out)
        experts.unpack(dev(rows), gplan, gout)
        assert_same(out, gout, ("unpack %s into [%d, %d]"):format(dt, n, C))
      end
    end
  end)

  it("reproduces experts.forward's y bitwise on the device through pack, k = 1 runs and unpack", function()
    local T, k, E, D, F = 211, 2, 5, 24, 20
    for _, dt in ipairs({"f32", "f64"}) do
      local opt = {dtype = dt, seed = 94, offset = 0}
      local x = dev(m.randn({T, D}, opt))
      local gu = dev(m.randn({E, 2 * F, D}, opt):mul(0.3))
      local dn = dev(m.randn({E, D, F}, opt):mul(0.3))
      local w = dev(m.rand({T, k}, opt))
      local idx = dev(ids(T, k, E, 95))
      for _, o in ipairs({{tile = 16}, {tile = 16, policy = "drop", capacity = 70}}) do
        local what = dt .. (o.policy and " drop" or " dropless")
        local plan = experts.dispatch(idx, E, o)
        local y = experts.forward(x, gu, dn, idx, w, plan, o)
        local idx_a = experts.pack(idx:reshape({T * k, 1}), plan)
        local plan_a = experts.dispatch(idx_a, E)
        local y_a = experts.forward(experts.pack(x, plan), gu, dn, idx_a,
                                    experts.pack(w:reshape({T * k, 1}), plan), plan_a, {tile = 16})
        local y2 = m.zeros({T, D}, {dtype = dt, device = DEV})
        experts.unpack(y_a, plan, y2)
        assert_same(y, y2, what)
      end
    end
  end)

  it("refuses operands on two devices", function()
    if DEV == "cpu" then
      pending("one device: nothing to mismatch")
      return
    end
    local idx = m.tensor({{0, 1}, {2, 1}, {1, 0}}, {dtype = "i64"})
    local gplan = experts.dispatch(dev(idx), 3)
    support.raises("moelua.experts.pack: plan.order: a cuda tensor but the other operands are on "
                   .. "cpu (one device expected)", experts.pack, m.zeros({3, 2}), gplan)
    support.raises("moelua.experts.unpack: out: a cpu tensor but the other operands are on cuda",
                   experts.unpack, dev(m.zeros({6, 2})), gplan, m.zeros({3, 2}))
    support.raises("moelua.experts.dispatch: capacities: a cpu tensor but the other operands are "
                   .. "on cuda", experts.dispatch, dev(idx), 3,
                   {policy = "drop", capacities = m.ones({3}, {dtype = "i64"})})
  end)
end)
