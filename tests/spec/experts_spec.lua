-- tests/spec/experts_spec.lua - moelua.experts (host/bindings/l_experts.c,
-- kernels/dispatch.c, kernels/experts.c): dispatch (scalar and per-expert
-- capacities) against a Lua reference, pack / unpack of a plan's rows
-- against a Lua reference and as expert parallelism uses them (bitwise
-- experts.forward's y),
-- forward against a dense f64 reference computed in plain Lua (every expert
-- on every token, masked by the routing), finite-difference gradients, the
-- save policies, untouched experts, zero ledger allocations with a pool,
-- per-expert weight tables run a subset per call (bitwise one call), and
-- bad input.
--
-- Tolerances are normwise relative errors ||x - ref|| / ||ref||:
--   forward vs the dense reference: f64 1e-6 (observed ~1e-15), f32 1e-5
--   (sgemm over k <= 2F products in f32)
--   finite differences, f64, central, step 1e-6: 1e-6
-- Dispatch, save vs recompute vs partial, run-to-run, thread counts and
-- untouched-expert sentinels are compared exactly (one binary).
local m = require "moelua"
local ex = m.experts
local support = require "tests.support"

-- ---- helpers ---------------------------------------------------------------

local vals, assert_close = support.values, support.assert_close
local gen = support.generator(7000, "f64")
local randn, rand = gen.randn, gen.rand

-- idx [T, k] with k distinct experts per token (a deterministic shuffle of a
-- uniform draw); `skip` = an expert that never appears
local function routing(T, k, E, skip)
  local u = vals(rand({T, E}))
  local ids = {}
  for t = 1, T do
    local cand = {}
    for e = 0, E - 1 do
      if e ~= skip then cand[#cand + 1] = {e, u[(t - 1) * E + e + 1]} end
    end
    table.sort(cand, function(a, b) return a[2] < b[2] end)
    for j = 1, k do ids[#ids + 1] = cand[j][1] end
  end
  return m.tensor(ids, {dtype = "i64"}):reshape({T, k}), ids
end

-- the dispatch reference: plain Lua, the definition in kernels/dispatch.h;
-- cap: a number, per-expert capacities {cap_0, ..., cap_E-1}, or nil
local function dispatch_ref(ids, T, k, E, cap)
  local count, kept, drop = {}, {}, {}
  for e = 0, E - 1 do count[e] = 0; kept[e] = {} end
  local dropped_list = {}
  for a = 0, T * k - 1 do
    local e = ids[a + 1]
    local c = type(cap) == "table" and cap[e + 1] or cap
    count[e] = count[e] + 1
    if c and #kept[e] >= c then
      drop[a + 1] = 1
      dropped_list[#dropped_list + 1] = a
    else
      drop[a + 1] = 0
      kept[e][#kept[e] + 1] = a
    end
  end
  local offsets, order, counts = {0}, {}, {}
  for e = 0, E - 1 do
    for _, a in ipairs(kept[e]) do order[#order + 1] = a end
    offsets[#offsets + 1] = offsets[#offsets] + #kept[e]
    counts[#counts + 1] = #kept[e]
  end
  for _, a in ipairs(dropped_list) do order[#order + 1] = a end
  return {offsets = offsets, order = order, counts = counts, dropped = drop,
          ndropped = #dropped_list}
end

local function silu(v) return v / (1 + math.exp(-v)) end

-- dense reference: every expert on every token, then y_t = sum_j [kept] w_tj out_{e_tj}(x_t)
local function dense_ref(x, gate_up, down, ids, w, dropped, T, k, D, F, E)
  local X, GU, DN, W = vals(x), vals(gate_up), vals(down), vals(w)
  local out = {}   -- out[e][t] = {D values}
  for e = 0, E - 1 do
    out[e] = {}
    for t = 0, T - 1 do
      local h = {}
      for r = 0, 2 * F - 1 do
        local s = 0
        for d = 0, D - 1 do s = s + X[t * D + d + 1] * GU[(e * 2 * F + r) * D + d + 1] end
        h[r] = s
      end
      local act = {}
      for f = 0, F - 1 do act[f] = silu(h[f]) * h[F + f] end
      local o = {}
      for d = 0, D - 1 do
        local s = 0
        for f = 0, F - 1 do s = s + act[f] * DN[(e * D + d) * F + f + 1] end
        o[d] = s
      end
      out[e][t] = o
    end
  end
  local y = {}
  for t = 0, T - 1 do
    for d = 0, D - 1 do
      local s = 0
      for j = 0, k - 1 do
        local a = t * k + j
        if not dropped or dropped[a + 1] == 0 then
          s = s + W[a + 1] * out[ids[a + 1]][t][d]
        end
      end
      y[t * D + d + 1] = s
    end
  end
  return y
end

-- a small problem: weights at a scale where silu is well inside its curve
local function problem(T, k, D, F, E, dt, skip)
  local idx, ids = routing(T, k, E, skip)
  return {
    T = T, k = k, D = D, F = F, E = E, ids = ids, idx = idx,
    x = randn({T, D}, dt),
    gate_up = randn({E, 2 * F, D}, dt, 1 / math.sqrt(D)),
    down = randn({E, D, F}, dt, 1 / math.sqrt(F)),
    w = rand({T, k}, dt, 0.2, 1),
  }
end

-- ---- dispatch ----------------------------------------------------------------

describe("experts.dispatch", function()
  it("is a stable counting sort by expert (dropless)", function()
    local T, k, E = 37, 3, 5
    local idx, ids = routing(T, k, E)
    local p = ex.dispatch(idx, E)
    local r = dispatch_ref(ids, T, k, E)
    assert.are.same(r.offsets, vals(p.offsets))
    assert.are.same(r.order, vals(p.order))
    assert.are.same(r.counts, vals(p.counts))
    assert.are.same(r.dropped, vals(p.dropped))
    assert.are.equal(0, p.ndropped)
    assert.are.equal(-1, p.capacity)
    assert.are.same({T, k}, p.dropped:shape())
  end)

  it("handles repeated experts in a row and empty experts", function()
    local ids = {2, 2, 0, 2, 2, 0, 0, 0}
    local p = ex.dispatch(m.tensor(ids, {dtype = "i64"}):reshape({4, 2}), 4)
    assert.are.same({0, 4, 4, 8, 8}, vals(p.offsets))
    assert.are.same({2, 5, 6, 7, 0, 1, 3, 4}, vals(p.order))
    assert.are.same({4, 0, 4, 0}, vals(p.counts))
  end)

  it("drops over capacity in (t, j) order and counts the drops", function()
    local T, k, E = 50, 2, 4
    local idx, ids = routing(T, k, E)
    for _, cap in ipairs({0, 7, 25, 1000}) do
      local p = ex.dispatch(idx, E, {capacity = cap, policy = "drop"})
      local r = dispatch_ref(ids, T, k, E, cap)
      assert.are.same(r.offsets, vals(p.offsets), "cap " .. cap)
      assert.are.same(r.order, vals(p.order), "cap " .. cap)
      assert.are.same(r.counts, vals(p.counts), "cap " .. cap)
      assert.are.same(r.dropped, vals(p.dropped), "cap " .. cap)
      assert.are.equal(r.ndropped, p.ndropped, "cap " .. cap)
      assert.are.equal(cap, p.capacity)
    end
    assert.are.equal(T * k, ex.dispatch(idx, E, {capacity = 0, policy = "drop"}).ndropped)
  end)

  it("is the same on every call (deterministic)", function()
    local idx = routing(300, 2, 8)
    local a, b = ex.dispatch(idx, 8, {capacity = 60, policy = "drop"}),
                 ex.dispatch(idx, 8, {capacity = 60, policy = "drop"})
    assert.are.same(vals(a.order), vals(b.order))
  end)

  it("keeps expert e's first capacities[e] assignments in (t, j) order", function()
    local T, k, E = 50, 2, 4
    local idx, ids = routing(T, k, E)
    for _, caps in ipairs({{0, 3, 40, 12}, {7, 7, 7, 7}, {100, 0, 0, 100}}) do
      local what = table.concat(caps, ",")
      local p = ex.dispatch(idx, E, {policy = "drop", capacities = m.tensor(caps, {dtype = "i64"})})
      local r = dispatch_ref(ids, T, k, E, caps)
      assert.are.same(r.offsets, vals(p.offsets), what)
      assert.are.same(r.order, vals(p.order), what)
      assert.are.same(r.counts, vals(p.counts), what)
      assert.are.same(r.dropped, vals(p.dropped), what)
      assert.are.equal(r.ndropped, p.ndropped, what)
      assert.are.equal(-1, p.capacity, what)
    end
    -- equal capacities are the scalar capacity
    local a = ex.dispatch(idx, E, {policy = "drop", capacities = m.full({E}, 9, {dtype = "i64"})})
    local b = ex.dispatch(idx, E, {policy = "drop", capacity = 9})
    for _, key in ipairs({"offsets", "order", "counts", "dropped"}) do
      assert.are.same(vals(b[key]), vals(a[key]), key)
    end
    assert.are.equal(b.ndropped, a.ndropped)
  end)
end)

-- ---- pack and unpack ------------------------------------------------------------

describe("experts.pack and experts.unpack", function()
  local T, k, E, C = 7, 2, 4, 3
  local idx, ids = routing(T, k, E)
  local plans = {dropless = ex.dispatch(idx, E),
                 drop = ex.dispatch(idx, E, {policy = "drop", capacity = 2})}
  assert(plans.drop.ndropped > 0, "capacity 2 must drop something here")

  -- the reference: row p of the result is row order[p] // div of src
  local function pack_ref(src, order, kept, div, C)
    local v, out = vals(src), {}
    for p = 1, kept do
      local r = order[p] // div
      for c = 1, C do out[#out + 1] = v[r * C + c] end
    end
    return out
  end

  it("packs the kept rows in plan order, per token and per assignment, any dtype", function()
    for name, plan in pairs(plans) do
      local order, kept = vals(plan.order), T * k - plan.ndropped
      local x, xa = randn({T, C}), randn({T * k, C}, "f32")
      local rows = ex.pack(x, plan)
      assert.are.same({kept, C}, rows:shape(), name)
      assert.are.same(pack_ref(x, order, kept, k, C), vals(rows), name .. " per token")
      local ra = ex.pack(xa, plan)
      assert.are.equal("f32", ra:dtype())
      assert.are.same(pack_ref(xa, order, kept, 1, C), vals(ra), name .. " per assignment")
      local ia = ex.pack(idx:reshape({T * k, 1}), plan)
      assert.are.equal("i64", ia:dtype())
      assert.are.same(pack_ref(idx:reshape({T * k, 1}), order, kept, 1, 1), vals(ia), name .. " i64")
      -- the expert of every packed assignment, ascending (kept rows are grouped by expert)
      for p = 2, kept do assert(vals(ia)[p - 1] <= vals(ia)[p], name .. " sorted") end
    end
  end)

  it("unpacks by adding each row at its token or assignment, positions ascending", function()
    for name, plan in pairs(plans) do
      local order, kept = vals(plan.order), T * k - plan.ndropped
      for _, div in ipairs({k, 1}) do
        local rows_out, cols = T * k // div, div == k and C or 1
        local rows = randn({kept, cols})
        local out0 = randn({rows_out, cols})
        local out = out0:clone()
        assert.are.equal(out, ex.unpack(rows, plan, out))
        local ref, rv = vals(out0), vals(rows)
        for p = 1, kept do   -- Lua adds doubles in the same order: bitwise
          local r = order[p] // div
          for c = 1, cols do
            ref[r * cols + c] = ref[r * cols + c] + rv[(p - 1) * cols + c]
          end
        end
        assert.are.same(ref, vals(out), name .. " div " .. div)
      end
      -- f32: the reference in f64, within f32 rounding
      local rows = randn({kept, C}, "f32")
      local out = m.zeros({T, C}, {dtype = "f32"})
      ex.unpack(rows, plan, out)
      local ref, rv = {}, vals(rows)
      for i = 1, T * C do ref[i] = 0 end
      for p = 1, kept do
        for c = 1, C do
          local r = order[p] // k
          ref[r * C + c] = ref[r * C + c] + rv[(p - 1) * C + c]
        end
      end
      assert_close(vals(out), ref, 1e-6, name .. " f32")
    end
  end)

  it("reproduces experts.forward's y bitwise from one k = 1 run per assignment (expert parallelism)", function()
    local big_idx = routing(200, 2, E)
    local cases = {
      {T = T, D = 8, F = 6, idx = idx, plans = plans},
      {T = 200, D = 32, F = 16, idx = big_idx,
       plans = {dropless = ex.dispatch(big_idx, E),
                drop = ex.dispatch(big_idx, E, {policy = "drop", capacities = m.tensor({100, 30, 0, 400}, {dtype = "i64"})})}},
    }
    for _, c in ipairs(cases) do
      for name, plan in pairs(c.plans) do
        for _, dt in ipairs({"f64", "f32"}) do
          local what = ("T %d %s %s"):format(c.T, name, dt)
          local P = problem(c.T, k, c.D, c.F, E, dt)
          local o = {tile = 3}
          local y = ex.forward(P.x, P.gate_up, P.down, c.idx, P.w, plan, o)
          -- what a rank owning the experts receives: rows, weights and ids in plan order
          local x_a = ex.pack(P.x, plan)
          local w_a = ex.pack(P.w:reshape({c.T * k, 1}), plan)
          local idx_a = ex.pack(c.idx:reshape({c.T * k, 1}), plan)
          local plan_a = ex.dispatch(idx_a, E)
          assert.are.equal(0, plan_a.ndropped)
          local y_a = ex.forward(x_a, P.gate_up, P.down, idx_a, w_a, plan_a, o)
          -- back at the origin: the sum of a token's rows in plan order
          local y2 = m.zeros({c.T, c.D}, {dtype = dt})
          ex.unpack(y_a, plan, y2)
          assert.are.same(vals(y), vals(y2), what)
        end
      end
    end
  end)

  it("makes its rows in the pool when one is given", function()
    local pool <close> = m.pool.new(1 << 16)
    local x = randn({T, C})
    local rows = ex.pack(x, plans.drop, {pool = pool})
    assert.are.equal(1, pool:stats().slots)
    assert.are.same(vals(ex.pack(x, plans.drop)), vals(rows))
  end)

  it("takes the worst case inside a memory plan (nothing read back), on the CPU and on CUDA", function()
    for _, device in ipairs({"cpu", "cuda"}) do
      local shapes
      m.mem.plan(function()
        local o = {dtype = "i64", device = device}
        local pidx = m.zeros({T, k}, o)
        -- capacities are not read inside a plan: a negative one passes
        local plan = ex.dispatch(pidx, E, {policy = "drop", capacities = m.full({E}, -1, o)})
        local x = m.zeros({T, C}, {dtype = "f64", device = device})
        local rows = ex.pack(x, plan)
        local out = m.zeros({T * k, C}, {dtype = "f64", device = device})
        ex.unpack(rows, plan, out)
        shapes = {plan.ndropped, rows:shape(), rows:device()}
      end)
      assert.are.same({0, {T * k, C}, device}, shapes, device)
    end
  end)

  it("refuses bad input with messages that name it", function()
    local function err(pat, f, ...)
      local ok, msg = pcall(f, ...)
      assert.is_false(ok)
      assert(tostring(msg):find(pat, 1, true), "expected '" .. pat .. "' in: " .. tostring(msg))
    end
    local plan = plans.drop
    local kept = T * k - plan.ndropped
    local x = randn({T, C})
    err("moelua.experts.pack: argument #2 (plan): expected the table experts.dispatch returned, got number",
        ex.pack, x, 5)
    err("moelua.experts.pack: argument #1 (src): expected a tensor", ex.pack, {}, plan)
    err("src is [5,3] but must be [T, C] = [7, C] (per token) or [T·k, C] = [14, C] (per assignment) "
        .. "for the plan's T = 7, k = 2", ex.pack, randn({5, C}), plan)
    err("src: expected 2 dims, got [7]", ex.pack, randn({T}), plan)
    err("argument #2 (plan): expected an integer plan.k", ex.pack, x,
        {offsets = plan.offsets, order = plan.order, ndropped = 0})
    err("plan.order: expected dtype i64, got f64", ex.pack, x,
        {offsets = plan.offsets, order = plan.order:to("f64"), k = 2, ndropped = 0})
    err("plan.order[3] = 14 is not an assignment in [0, 14)", ex.pack, x,
        {offsets = plan.offsets, order = m.tensor({0, 1, 2, 14, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13},
                                                  {dtype = "i64"}), k = 2, ndropped = 0})
    err("plan.ndropped = 15 is outside [0, T·k = 14]", ex.pack, x,
        {offsets = plan.offsets, order = plan.order, k = 2, ndropped = 15})
    err("plan.order: 14 assignments are not T·k for k = 3", ex.pack, x,
        {offsets = plan.offsets, order = plan.order, k = 3, ndropped = 0})
    local rows = randn({kept, C})
    err(("rows is [%d,3] but must be [kept, C] = [%d, 3] (the plan keeps %d of T·k = 14 assignments)")
        :format(kept + 1, kept, kept), ex.unpack, randn({kept + 1, C}), plan, m.zeros({T, C}, {dtype = "f64"}))
    err("rows: expected dtype f32 or f64, got i64", ex.unpack, rows:to("i64"), plan, m.zeros({T, C}, {dtype = "f64"}))
    err("out: expected dtype f64, got f32", ex.unpack, rows, plan, m.zeros({T, C}, {dtype = "f32"}))
    err("out is [6,3] but must be [T, C]", ex.unpack, rows, plan, m.zeros({6, C}, {dtype = "f64"}))
    err("moelua.experts.unpack: argument #3 (out): expected a tensor", ex.unpack, rows, plan)
    err("out shares storage with rows", ex.unpack, rows, plan, rows:narrow(1, 1, T))
    local gone = randn({T, C})
    gone:free()
    err("moelua.experts.pack: argument #1 (src): the tensor was freed", ex.pack, gone, plan)
  end)
end)

-- ---- forward ------------------------------------------------------------------

describe("experts.forward", function()
  it("dropless equals the dense reference (f64 <= 1e-6, f32 <= 1e-5) for tiles that do not divide the counts", function()
    local P = problem(23, 2, 8, 6, 4, "f64")
    local plan = ex.dispatch(P.idx, P.E)
    local ref = dense_ref(P.x, P.gate_up, P.down, P.ids, P.w, nil, P.T, P.k, P.D, P.F, P.E)
    for _, tile in ipairs({1, 3, 5, 16, 256}) do
      local y = ex.forward(P.x, P.gate_up, P.down, P.idx, P.w, plan, {tile = tile})
      assert_close(vals(y), ref, 1e-6, "f64 tile " .. tile)
      local y32 = ex.forward(P.x:to("f32"), P.gate_up:to("f32"), P.down:to("f32"), P.idx,
                             P.w:to("f32"), plan, {tile = tile})
      assert.are.equal("f32", y32:dtype())
      assert_close(vals(y32), ref, 1e-5, "f32 tile " .. tile)
    end
  end)

  it("with drop, dropped assignments contribute nothing", function()
    local P = problem(30, 2, 6, 5, 3, "f64")
    local plan = ex.dispatch(P.idx, P.E, {capacity = 12, policy = "drop"})
    assert(plan.ndropped > 0, "the capacity must drop something here")
    local drop = vals(plan.dropped)
    local ref = dense_ref(P.x, P.gate_up, P.down, P.ids, P.w, drop, P.T, P.k, P.D, P.F, P.E)
    local y = ex.forward(P.x, P.gate_up, P.down, P.idx, P.w, plan, {tile = 4})
    assert_close(vals(y), ref, 1e-6, "drop")
    -- every assignment dropped: y is exactly 0
    local none = ex.dispatch(P.idx, P.E, {capacity = 0, policy = "drop"})
    local y0 = ex.forward(P.x, P.gate_up, P.down, P.idx, P.w, none)
    for _, v in ipairs(vals(y0)) do assert.are.equal(0, v) end
  end)

  it("saves h [floor((1-f)·T·k), 2F] by policy and is bitwise the same whatever it saves", function()
    local P = problem(40, 2, 8, 6, 4, "f32")
    local plan = ex.dispatch(P.idx, P.E)
    local y1, s1 = ex.forward(P.x, P.gate_up, P.down, P.idx, P.w, plan, {tile = 7})
    local y2, s2 = ex.forward(P.x, P.gate_up, P.down, P.idx, P.w, plan, {tile = 7, save = "recompute"})
    local y3, s3 = ex.forward(P.x, P.gate_up, P.down, P.idx, P.w, plan, {tile = 7, partial_recompute = 0.3})
    assert.are.same({80, 12}, s1.h:shape())
    assert.is_nil(s2.h)
    assert.are.equal(0, s2.nsaved)
    assert.are.same({56, 12}, s3.h:shape())
    assert.are.equal(7, s1.tile)
    assert.are.same(vals(y1), vals(y2))
    assert.are.same(vals(y1), vals(y3))
  end)
end)

-- ---- backward -----------------------------------------------------------------

-- loss = sum(y ⊙ R); central differences of every element of tensor t
local function fd_grad(t, loss)
  local flat = t:reshape({t:numel()})
  local g, h = {}, 1e-6
  for i = 1, t:numel() do
    local cell = flat:narrow(1, i, 1)
    local v = cell:item()
    cell:fill_(v + h)
    local lp = loss()
    cell:fill_(v - h)
    local lm = loss()
    cell:fill_(v)
    g[i] = (lp - lm) / (2 * h)
  end
  return g
end

describe("experts.backward", function()
  it("matches finite differences in f64 for x, gate_up, down and w (rel err <= 1e-6)", function()
    for _, case in ipairs({{policy = nil}, {capacity = 5, policy = "drop"}}) do
      local P = problem(9, 2, 5, 4, 3, "f64")
      local plan = ex.dispatch(P.idx, P.E, case.policy and case or nil)
      local R = randn({P.T, P.D})
      local Rv = vals(R)
      local opts = {tile = 2, partial_recompute = 0.5}
      local function loss()
        local y = ex.forward(P.x, P.gate_up, P.down, P.idx, P.w, plan, opts)
        local s = 0
        for i, v in ipairs(vals(y)) do s = s + v * Rv[i] end
        return s
      end
      local _, saved = ex.forward(P.x, P.gate_up, P.down, P.idx, P.w, plan, opts)
      local dx, dgu, ddn, dw, touched = ex.backward(R, P.x, P.gate_up, P.down, P.idx, P.w, plan,
                                                    saved, opts)
      local what = case.policy or "dropless"
      assert_close(vals(dx), fd_grad(P.x, loss), 1e-6, what .. " dx")
      assert_close(vals(dgu), fd_grad(P.gate_up, loss), 1e-6, what .. " dgate_up")
      assert_close(vals(ddn), fd_grad(P.down, loss), 1e-6, what .. " ddown")
      assert_close(vals(dw), fd_grad(P.w, loss), 1e-6, what .. " dw")
      if case.policy then
        assert(plan.ndropped > 0)
        local drop = vals(plan.dropped)
        local dwv = vals(dw)
        for a = 1, #drop do
          if drop[a] == 1 then assert.are.equal(0, dwv[a], "dw of a dropped slot") end
        end
      end
      assert.are.same({1, 1, 1}, vals(touched))
    end
  end)

  it("gives bitwise identical gradients for save, recompute and partial recompute", function()
    local P = problem(64, 2, 16, 24, 4, "f32")
    local plan = ex.dispatch(P.idx, P.E)
    local dy = randn({P.T, P.D}, "f32")
    local results = {}
    for _, o in ipairs({{save = "save"}, {save = "recompute"}, {partial_recompute = 0.37},
                        {partial_recompute = 0.999}}) do
      o.tile = 5
      local _, saved = ex.forward(P.x, P.gate_up, P.down, P.idx, P.w, plan, o)
      local g = {ex.backward(dy, P.x, P.gate_up, P.down, P.idx, P.w, plan, saved, o)}
      for i = 1, 4 do g[i] = vals(g[i]) end
      results[#results + 1] = g
    end
    for r = 2, #results do
      for i = 1, 4 do assert.are.same(results[1][i], results[r][i], "result " .. i) end
    end
  end)

  it("accumulates dx, dgate_up and ddown into grads, overwrites dw, and writes nothing for an expert with no tokens", function()
    local P = problem(20, 2, 6, 5, 4, "f64", 2)   -- expert 2 gets no tokens
    local plan = ex.dispatch(P.idx, P.E)
    assert.are.equal(0, vals(plan.counts)[3])
    local dy = randn({P.T, P.D})
    local _, saved = ex.forward(P.x, P.gate_up, P.down, P.idx, P.w, plan, {tile = 3})
    local fresh = {ex.backward(dy, P.x, P.gate_up, P.down, P.idx, P.w, plan, saved, {tile = 3})}
    local S = 7.5
    local grads = {dx = m.full({P.T, P.D}, S, {dtype = "f64"}),
                   dgate_up = m.full({P.E, 2 * P.F, P.D}, S, {dtype = "f64"}),
                   ddown = m.full({P.E, P.D, P.F}, S, {dtype = "f64"}),
                   dw = m.full({P.T, P.k}, S, {dtype = "f64"}),
                   touched = m.full({P.E}, 9, {dtype = "u8"})}
    local dx, dgu, ddn, dw, touched = ex.backward(dy, P.x, P.gate_up, P.down, P.idx, P.w, plan,
                                                  saved, nil, grads)
    assert.are.equal(grads.dx, dx)
    assert.are.equal(grads.dgate_up, dgu)
    assert.are.same({1, 1, 0, 1}, vals(touched))
    -- the untouched expert keeps its sentinel bit for bit
    for _, v in ipairs(vals(dgu:select(1, 3))) do assert.are.equal(S, v) end
    for _, v in ipairs(vals(ddn:select(1, 3))) do assert.are.equal(S, v) end
    -- the fresh run left it zero
    for _, v in ipairs(vals(fresh[2]:select(1, 3))) do assert.are.equal(0, v) end
    -- the others accumulated (+=): sentinel + fresh gradient
    local function plus(t) local r = vals(t); for i = 1, #r do r[i] = r[i] + S end; return r end
    assert_close(vals(dx), plus(fresh[1]), 1e-14, "dx +=")
    assert_close(vals(dgu), plus(fresh[2]), 1e-14, "dgate_up +=")
    assert_close(vals(ddn), plus(fresh[3]), 1e-14, "ddown +=")
    assert.are.same(vals(fresh[4]), vals(dw))   -- dw is overwritten
  end)

  it("is bitwise repeatable run to run", function()
    local P = problem(50, 2, 12, 10, 4, "f32")
    local plan = ex.dispatch(P.idx, P.E)
    local dy = randn({P.T, P.D}, "f32")
    local function run()
      local y, saved = ex.forward(P.x, P.gate_up, P.down, P.idx, P.w, plan, {tile = 6})
      local g = {y, ex.backward(dy, P.x, P.gate_up, P.down, P.idx, P.w, plan, saved)}
      for i = 1, 5 do g[i] = vals(g[i]) end
      return g
    end
    local a, b = run(), run()
    for i = 1, 5 do assert.are.same(a[i], b[i]) end
  end)

  it("is bitwise the same for 1, 2 and 3 threads (threads share out tiles, never a sum)", function()
    local P = problem(70, 2, 12, 10, 4, "f32")
    local plan = ex.dispatch(P.idx, P.E)
    local dy = randn({P.T, P.D}, "f32")
    local before = m.threads()
    local function run(n)
      m.threads(n)
      local y, saved = ex.forward(P.x, P.gate_up, P.down, P.idx, P.w, plan,
                                  {tile = 5, partial_recompute = 0.5})
      local g = {y, ex.backward(dy, P.x, P.gate_up, P.down, P.idx, P.w, plan, saved)}
      for i = 1, 5 do g[i] = vals(g[i]) end
      return g
    end
    local ok, err = pcall(function()
      local one, two, three = run(1), run(2), run(3)
      for i = 1, 5 do
        assert.are.same(one[i], two[i])
        assert.are.same(one[i], three[i])
      end
    end)
    m.threads(before)
    assert(ok, err)
  end)

  it("makes no ledger allocation after warm-up when a pool is given", function()
    local P = problem(64, 2, 16, 24, 4, "f32")
    local pool <close> = m.pool.new(4 << 20, {grow = false})
    local grads = {dgate_up = m.zeros({P.E, 2 * P.F, P.D}), ddown = m.zeros({P.E, P.D, P.F})}
    local dy = randn({P.T, P.D}, "f32")
    local opts = {tile = 16, pool = pool, partial_recompute = 0.5}
    local function step()
      local mark = pool:mark()
      local plan = ex.dispatch(P.idx, P.E, opts)
      local y, saved = ex.forward(P.x, P.gate_up, P.down, P.idx, P.w, plan, opts)
      local dx, _, _, dw, touched = ex.backward(dy, P.x, P.gate_up, P.down, P.idx, P.w, plan,
                                                saved, opts, grads)
      local r = {vals(y), vals(dx), vals(dw), vals(touched)}
      pool:rewind(mark)
      return r
    end
    local first = step()
    local a0 = m.mem.stats().cpu.allocs
    local second = step()
    local a1 = m.mem.stats().cpu.allocs
    assert.are.same(a0, a1)
    assert.are.same(first, second)
    assert.are.equal(0, pool:stats().slots)
    assert.are.equal(0, pool:stats().overflows)
  end)
end)

-- ---- per-expert tables: a subset of the experts per call ---------------------------

-- "%a" of every value (tells -0 from 0): bitwise comparisons
local function bits(t)
  local r = {}
  for i, v in ipairs(vals(t)) do r[i] = string.format("%a", v) end
  return r
end

-- the rows of saved h that forward writes: positions in tiles (within each
-- expert) lying below S; the others are never written
local function saved_rows(h, plan, tile, S)
  local off, hv, rows = vals(plan.offsets), vals(h), {}
  local w = h:shape()[2]
  for e = 1, #off - 1 do
    for p0 = off[e], off[e + 1] - 1, tile do
      local r = math.min(tile, off[e + 1] - p0)
      if p0 + r <= S then
        for i = p0 * w + 1, (p0 + r) * w do rows[#rows + 1] = string.format("%a", hv[i]) end
      end
    end
  end
  return rows
end

describe("experts with per-expert tables", function()
  local T, k, D, F, E = 37, 2, 6, 5, 4
  local MODES = {{save = "save"}, {save = "recompute"}, {partial_recompute = 0.37}}
  local GROUPS = {{{0, 1}, {2, 3}}, {{0}, {1}, {2}, {3}}}

  local function with(o, extra)
    local c = {}
    for key, v in pairs(o) do c[key] = v end
    for key, v in pairs(extra) do c[key] = v end
    return c
  end

  it("run one layer's experts a subset per call, bitwise one call, every save mode, with and without drops", function()
    for _, dt in ipairs({"f64", "f32"}) do
      local P = problem(T, k, D, F, E, dt)
      local dy = randn({T, D}, dt)
      -- each expert in buffers of its own, as cache slots hold them
      local gu, dn = {}, {}
      for e = 1, E do
        gu[e] = P.gate_up:select(1, e):clone()
        dn[e] = P.down:select(1, e):clone()
      end
      local function sentinel(shape) return m.full(shape, 0.5, {dtype = dt}) end
      local plans = {ex.dispatch(P.idx, E), ex.dispatch(P.idx, E, {policy = "drop", capacity = 15})}
      assert(plans[2].ndropped > 0, "the capacity must drop something here")
      for pi, plan in ipairs(plans) do
        for mi, mode in ipairs(MODES) do
          local o = with(mode, {tile = 5})
          local y, saved = ex.forward(P.x, P.gate_up, P.down, P.idx, P.w, plan, o)
          local ref = {ex.backward(dy, P.x, P.gate_up, P.down, P.idx, P.w, plan, saved, o,
                                   {dx = sentinel({T, D}), dgate_up = sentinel({E, 2 * F, D}),
                                    ddown = sentinel({E, D, F})})}
          for gi, groups in ipairs(GROUPS) do
            local what = ("%s plan %d mode %d groups %d"):format(dt, pi, mi, gi)
            local ys, ss
            for _, grp in ipairs(groups) do
              local tg, td = {}, {}
              for _, e in ipairs(grp) do tg[e + 1], td[e + 1] = gu[e + 1], dn[e + 1] end
              local y2, s2 = ex.forward(P.x, tg, td, P.idx, P.w, plan,
                                        with(o, {out = ys, saved = ss}))
              if ys then
                assert.are.equal(ys, y2, "out is returned")
                assert.are.equal(ss, s2, "saved is returned")
              end
              ys, ss = y2, s2
            end
            assert.are.same(bits(y), bits(ys), "y " .. what)
            assert.are.equal(saved.nsaved, ss.nsaved)
            if saved.nsaved > 0 then
              assert.are.same(saved_rows(saved.h, plan, 5, saved.nsaved),
                              saved_rows(ss.h, plan, 5, saved.nsaved), "saved h " .. what)
            end
            local dgu, ddn = {}, {}
            for e = 1, E do dgu[e], ddn[e] = sentinel({2 * F, D}), sentinel({D, F}) end
            local g = {dx = sentinel({T, D})}
            for i, grp in ipairs(groups) do
              local tg, td = {}, {}
              g.dgate_up, g.ddown = {}, {}
              for _, e in ipairs(grp) do
                tg[e + 1], td[e + 1] = gu[e + 1], dn[e + 1]
                g.dgate_up[e + 1], g.ddown[e + 1] = dgu[e + 1], ddn[e + 1]
              end
              local r = {ex.backward(dy, P.x, tg, td, P.idx, P.w, plan, ss,
                                     with(o, {accumulate = i > 1}), g)}
              assert.are.equal(g.dgate_up, r[2])
              assert.are.equal(g.ddown, r[3])
              g.dx, g.dw, g.touched = r[1], r[4], r[5]
              for j = i + 1, #groups do   -- the experts not run yet: untouched
                for _, e in ipairs(groups[j]) do
                  for _, v in ipairs(vals(dgu[e + 1])) do assert.are.equal(0.5, v) end
                  for _, v in ipairs(vals(ddn[e + 1])) do assert.are.equal(0.5, v) end
                end
              end
            end
            assert.are.same(bits(ref[1]), bits(g.dx), "dx " .. what)
            assert.are.same(bits(ref[4]), bits(g.dw), "dw " .. what)
            assert.are.same(vals(ref[5]), vals(g.touched), "touched " .. what)
            for e = 1, E do
              assert.are.same(bits(ref[2]:select(1, e)), bits(dgu[e]), "dgate_up " .. e .. " " .. what)
              assert.are.same(bits(ref[3]:select(1, e)), bits(ddn[e]), "ddown " .. e .. " " .. what)
            end
          end
        end
      end
    end
  end)

  it("take E from the plan or opts.E and skip the experts without entries", function()
    local P = problem(T, k, D, F, E, "f64")
    local plan = ex.dispatch(P.idx, E)
    local gu, dn = {}, {}
    for e = 1, E do gu[e], dn[e] = P.gate_up:select(1, e):clone(), P.down:select(1, e):clone() end
    local y = ex.forward(P.x, gu, dn, P.idx, P.w, plan)
    assert.are.same(bits(ex.forward(P.x, P.gate_up, P.down, P.idx, P.w, plan)), bits(y))
    local bare = {offsets = plan.offsets, order = plan.order}   -- no plan.E
    assert.are.same(bits(y), bits(ex.forward(P.x, gu, dn, P.idx, P.w, bare, {E = E})))
    -- an all-skipped call: y is zero, nothing else written
    local y0 = ex.forward(P.x, {[2] = gu[2]}, {[2] = dn[2]}, P.idx, P.w,
                          ex.dispatch(P.idx, E, {policy = "drop", capacity = 0}))
    for _, v in ipairs(vals(y0)) do assert.are.equal(0, v) end
  end)

  it("refuse bad tables, grads and out with messages that name them", function()
    local P = problem(6, 2, 4, 3, 3, "f32")
    local plan = ex.dispatch(P.idx, P.E)
    local gu, dn = {}, {}
    for e = 1, 3 do gu[e], dn[e] = P.gate_up:select(1, e):clone(), P.down:select(1, e):clone() end
    local function err(pat, f, ...)
      local ok, msg = pcall(f, ...)
      assert.is_false(ok)
      assert(tostring(msg):find(pat, 1, true), "expected '" .. pat .. "' in: " .. tostring(msg))
    end
    local F_ = ex.forward
    err("moelua.experts.forward: gate_up of expert 1: expected shape [6,4], got [4,6]", F_, P.x,
        {gu[1], m.zeros({4, 6})}, {dn[1], dn[2]}, P.idx, P.w, plan)
    err("down of expert 2: expected dtype f32, got f64", F_, P.x, {[3] = gu[3]},
        {[3] = dn[3]:to("f64")}, P.idx, P.w, plan)
    err("down of expert 0: expected a contiguous tensor", F_, P.x, {gu[1]},
        {m.zeros({3, 4}):transpose(1, 2)}, P.idx, P.w, plan)
    err("expert 1 has gate_up but no down (both or neither: neither skips it)", F_, P.x,
        {gu[1], gu[2]}, {dn[1]}, P.idx, P.w, plan)
    err("gate_up: key 4 is not an expert's (expected integers 1 .. E = 3: expert + 1)", F_, P.x,
        {[4] = gu[1]}, {[4] = dn[1]}, P.idx, P.w, plan)
    err("gate_up: key x is not an expert's", F_, P.x, {x = gu[1]}, {dn[1]}, P.idx, P.w, plan)
    err("gate_up[1]: expected a tensor, got number", F_, P.x, {1}, {dn[1]}, P.idx, P.w, plan)
    err("argument #3 (down): expected a table of per-expert tensors like gate_up, got userdata",
        F_, P.x, gu, P.down, P.idx, P.w, plan)
    err("argument #3 (down): expected a tensor like gate_up, got table", F_, P.x, P.gate_up, dn,
        P.idx, P.w, plan)
    err("gate_up: no expert given", F_, P.x, {}, {}, P.idx, P.w, plan)
    err("option 'E' = 4 differs from plan.E = 3", F_, P.x, gu, dn, P.idx, P.w, plan, {E = 4})
    err("argument #6 (plan): no plan.E: give option 'E'", F_, P.x, gu, dn, P.idx, P.w,
        {offsets = plan.offsets, order = plan.order})
    err("option 'out': expected a tensor, got table", F_, P.x, gu, dn, P.idx, P.w, plan, {out = {}})
    err("moelua.experts.forward: y is [5,4] but must be [6,4]", F_, P.x, gu, dn, P.idx, P.w, plan,
        {out = m.zeros({5, 4})})
    err("y shares storage with x (outputs must not alias inputs)", F_, P.x, gu, dn, P.idx, P.w,
        plan, {out = P.x})
    err("option 'saved' must be the table experts.forward returned, got number", F_, P.x, gu, dn,
        P.idx, P.w, plan, {saved = 3})
    local y, saved = F_(P.x, {gu[1]}, {dn[1]}, P.idx, P.w, plan, {tile = 4})
    err("option 'tile' = 8 differs from the forward's tile 4 (saved.tile)", F_, P.x, {[2] = gu[2]},
        {[2] = dn[2]}, P.idx, P.w, plan, {tile = 8, out = y, saved = saved})
    err("options 'save' / 'partial_recompute' keep S = 0 positions but saved.nsaved is 12", F_,
        P.x, {[2] = gu[2]}, {[2] = dn[2]}, P.idx, P.w, plan, {save = "recompute", out = y,
        saved = saved})

    local dy = m.zeros({6, 4})
    local dgu, ddn = {}, {}
    for e = 1, 3 do dgu[e], ddn[e] = m.zeros({6, 4}), m.zeros({4, 3}) end
    local B = ex.backward
    err("grads.dgate_up: expected a table of per-expert gradient tensors", B, dy, P.x, gu, dn,
        P.idx, P.w, plan, saved)
    err("grads.ddown: expected a table of per-expert gradient tensors", B, dy, P.x, gu, dn,
        P.idx, P.w, plan, saved, nil, {dgate_up = dgu, ddown = m.zeros({3, 4, 3})})
    err("dgate_up of expert 1: missing, but the expert runs (its weights are given)", B, dy, P.x,
        gu, dn, P.idx, P.w, plan, saved, nil, {dgate_up = {dgu[1]}, ddown = ddn})
    err("ddown of expert 2: expected shape [4,3], got [3,4]", B, dy, P.x, gu, dn, P.idx, P.w,
        plan, saved, nil, {dgate_up = dgu, ddown = {ddn[1], ddn[2], m.zeros({3, 4})}})
    err("grads.dw: expected a given tensor (an accumulating call keeps the earlier calls' "
        .. "entries)", B, dy, P.x, gu, dn, P.idx, P.w, plan, saved, {accumulate = true},
        {dgate_up = dgu, ddown = ddn})
    err("option 'accumulate' must be a boolean, got number", B, dy, P.x, gu, dn, P.idx, P.w, plan,
        saved, {accumulate = 1}, {dgate_up = dgu, ddown = ddn})
    -- nothing was written by the refused calls
    for e = 1, 3 do
      for _, v in ipairs(vals(dgu[e])) do assert.are.equal(0, v) end
    end
  end)
end)

-- ---- bad input ------------------------------------------------------------------

describe("experts bad input", function()
  local P = problem(6, 2, 4, 3, 3, "f32")
  local plan = ex.dispatch(P.idx, P.E)

  local function err(pat, f, ...)
    local ok, msg = pcall(f, ...)
    assert.is_false(ok)
    assert(tostring(msg):find(pat, 1, true), "expected '" .. pat .. "' in: " .. tostring(msg))
  end

  it("names unknown options and wrong types", function()
    err("unknown option 'tiles'", ex.forward, P.x, P.gate_up, P.down, P.idx, P.w, plan, {tiles = 4})
    err("option 'tile' must be an integer >= 1", ex.forward, P.x, P.gate_up, P.down, P.idx, P.w, plan, {tile = 0})
    err("option 'tile' must be an integer >= 1", ex.forward, P.x, P.gate_up, P.down, P.idx, P.w, plan, {tile = "x"})
    err("option 'save' must be", ex.forward, P.x, P.gate_up, P.down, P.idx, P.w, plan, {save = "all"})
    err("option 'partial_recompute' must be in [0, 1]", ex.forward, P.x, P.gate_up, P.down, P.idx, P.w, plan, {partial_recompute = 1.5})
    err("exclude each other", ex.forward, P.x, P.gate_up, P.down, P.idx, P.w, plan, {save = "save", partial_recompute = 0.5})
    err("option 'pool' must be a moelua.pool", ex.forward, P.x, P.gate_up, P.down, P.idx, P.w, plan, {pool = {}})
    err("option 'policy' must be", ex.dispatch, P.idx, 3, {policy = "spill"})
    err("needs option 'capacity'", ex.dispatch, P.idx, 3, {policy = "drop"})
    err("option 'capacity' needs policy", ex.dispatch, P.idx, 3, {capacity = 4})
    err("option 'capacity' must be an integer >= 0", ex.dispatch, P.idx, 3, {capacity = -1, policy = "drop"})
    local caps = m.tensor({2, 2, 2}, {dtype = "i64"})
    err("options 'capacity' and 'capacities' exclude each other", ex.dispatch, P.idx, 3,
        {policy = "drop", capacity = 2, capacities = caps})
    err("option 'capacities' needs policy = \"drop\" (policy is \"dropless\")", ex.dispatch, P.idx, 3,
        {policy = "dropless", capacities = caps})
    err("option 'capacities' needs policy = \"drop\"", ex.dispatch, P.idx, 3, {capacities = caps})
    err("needs option 'capacity' or 'capacities'", ex.dispatch, P.idx, 3, {policy = "drop"})
    err("option 'capacities': expected a tensor", ex.dispatch, P.idx, 3, {policy = "drop", capacities = {2, 2, 2}})
    err("moelua.experts.dispatch: capacities: expected shape [3], got [4]", ex.dispatch, P.idx, 3,
        {policy = "drop", capacities = m.tensor({2, 2, 2, 2}, {dtype = "i64"})})
    err("capacities: expected dtype i64, got f64", ex.dispatch, P.idx, 3,
        {policy = "drop", capacities = m.tensor({2, 2, 2}, {dtype = "f64"})})
    err("capacities: expert 1's capacity is -1 (must be >= 0)", ex.dispatch, P.idx, 3,
        {policy = "drop", capacities = m.tensor({2, -1, 2}, {dtype = "i64"})})
  end)

  it("refuses bad expert ids and bad E", function()
    local bad = m.tensor({0, 1, 2, 3}, {dtype = "i64"}):reshape({2, 2})
    err("expert id 3 at token 1, slot 1 (0-based) is outside [0, 3)", ex.dispatch, bad, 3)
    err("argument #2 (E)", ex.dispatch, P.idx, 0)
    err("expected dtype i64, got f32", ex.dispatch, P.x, 3)
  end)

  it("names both shapes when they do not match", function()
    local gu = m.zeros({3, 6, 5})
    err("gate_up [3,6,5] does not match x [T, D] [6,4]", ex.forward, P.x, gu, P.down, P.idx, P.w, plan)
    err("down [3,3,4] does not match gate_up [E, 2F, D] [3,6,4]", ex.forward, P.x, P.gate_up,
        m.zeros({3, 3, 4}), P.idx, P.w, plan)
    err("w [6,3] does not match idx [6,2]", ex.forward, P.x, P.gate_up, P.down, P.idx, m.zeros({6, 3}), plan)
    err("dtype f64 does not match x's f32", ex.forward, P.x, P.gate_up:to("f64"), P.down, P.idx, P.w, plan)
    err("x: expected 2 dims, got [24]", ex.forward, P.x:reshape({24}), P.gate_up, P.down, P.idx, P.w, plan)
  end)

  it("refuses a plan that does not belong to idx", function()
    local other = ex.dispatch(routing(6, 2, 3), 3)
    local same = true
    for i, v in ipairs(vals(other.order)) do same = same and v == vals(plan.order)[i] end
    if not same then
      err("does not match idx", ex.forward, P.x, P.gate_up, P.down, P.idx, P.w, other)
    end
    err("plan.offsets: expected shape [4], got [5]", ex.forward, P.x, P.gate_up, P.down, P.idx, P.w,
        ex.dispatch(P.idx, 4))
    err("argument #6 (plan)", ex.forward, P.x, P.gate_up, P.down, P.idx, P.w, 5)
  end)

  it("refuses a tile whose scratch overflows and clamps a long one to T·k", function()
    err("tile = 576460752303423488 is out of range", ex.forward, P.x, P.gate_up, P.down,
        P.idx, P.w, plan, {tile = 1 << 59})
    local y1, s1 = ex.forward(P.x, P.gate_up, P.down, P.idx, P.w, plan, {tile = 1 << 40})
    local y2 = ex.forward(P.x, P.gate_up, P.down, P.idx, P.w, plan, {tile = 12})
    assert.are.same(vals(y2), vals(y1))
    assert.are.equal(1 << 40, s1.tile)
    local dy = m.ones({6, 4})
    local g1 = {ex.backward(dy, P.x, P.gate_up, P.down, P.idx, P.w, plan, s1)}
    local _, s2 = ex.forward(P.x, P.gate_up, P.down, P.idx, P.w, plan, {tile = 12})
    local g2 = {ex.backward(dy, P.x, P.gate_up, P.down, P.idx, P.w, plan, s2)}
    for i = 1, 4 do assert.are.same(vals(g2[i]), vals(g1[i])) end
    s1.tile = 1 << 59
    err("tile = 576460752303423488 is out of range", ex.backward, dy, P.x, P.gate_up,
        P.down, P.idx, P.w, plan, s1)
  end)

  it("refuses a plan that lists an assignment twice or out of order within an expert", function()
    local o = vals(plan.order)
    local off = vals(plan.offsets)
    local e = 0   -- an expert with >= 2 kept assignments
    while off[e + 2] - off[e + 1] < 2 do e = e + 1 end
    local p0 = off[e + 1] + 1   -- 1-based position of its first entry
    local dup = {}
    for i, v in ipairs(o) do dup[i] = v end
    dup[p0 + 1] = dup[p0]
    local bad = {offsets = plan.offsets, order = m.tensor(dup, {dtype = "i64"})}
    err(("order[%d] does not match idx"):format(p0), ex.forward, P.x, P.gate_up, P.down, P.idx, P.w, bad)
    local swp = {}
    for i, v in ipairs(o) do swp[i] = v end
    swp[p0], swp[p0 + 1] = swp[p0 + 1], swp[p0]
    bad.order = m.tensor(swp, {dtype = "i64"})
    err(("order[%d] does not match idx"):format(p0), ex.forward, P.x, P.gate_up, P.down, P.idx, P.w, bad)
  end)

  it("refuses grads that share storage with an input or with each other", function()
    local _, saved = ex.forward(P.x, P.gate_up, P.down, P.idx, P.w, plan)
    local dy = m.ones({6, 4})
    err("grads.dw shares storage with w (outputs must not alias inputs)", ex.backward, dy, P.x, P.gate_up,
        P.down, P.idx, P.w, plan, saved, nil, {dw = P.w})
    err("grads.dx shares storage with dy (outputs must not alias inputs)", ex.backward, dy, P.x, P.gate_up,
        P.down, P.idx, P.w, plan, saved, nil, {dx = dy})
    err("grads.dx shares storage with x (outputs must not alias inputs)", ex.backward, dy, P.x, P.gate_up,
        P.down, P.idx, P.w, plan, saved, nil, {dx = P.x})
    err("grads.ddown shares storage with down (outputs must not alias inputs)", ex.backward, dy, P.x, P.gate_up,
        P.down, P.idx, P.w, plan, saved, nil, {ddown = P.down})
    local g = m.zeros({6, 4})
    err("grads.dx shares storage with dy (outputs must not alias inputs)", ex.backward, g, P.x, P.gate_up,
        P.down, P.idx, P.w, plan, saved, nil, {dx = g})
    local w0 = vals(P.w)
    assert.are.same(w0, vals(P.w))
  end)

  it("checks backward's saved table and grads", function()
    local _, saved = ex.forward(P.x, P.gate_up, P.down, P.idx, P.w, plan, {tile = 4})
    local dy = m.zeros({6, 4})
    err("option 'tile' = 8 differs from the forward's tile 4", ex.backward, dy, P.x, P.gate_up,
        P.down, P.idx, P.w, plan, saved, {tile = 8})
    err("unknown key 'dX'", ex.backward, dy, P.x, P.gate_up, P.down, P.idx, P.w, plan, saved, nil, {dX = dy})
    err("grads.dgate_up: expected shape [3,6,4], got [3,4,6]", ex.backward, dy, P.x, P.gate_up,
        P.down, P.idx, P.w, plan, saved, nil, {dgate_up = m.zeros({3, 4, 6})})
    err("grads.dx: expected dtype f32, got f64", ex.backward, dy, P.x, P.gate_up,
        P.down, P.idx, P.w, plan, saved, nil, {dx = m.zeros({6, 4}, {dtype = "f64"})})
    err("argument #8 (saved)", ex.backward, dy, P.x, P.gate_up, P.down, P.idx, P.w, plan, {})
    err("expected dy [T, D]", ex.backward, m.zeros({5, 4}), P.x, P.gate_up, P.down, P.idx, P.w, plan, saved)
    local pool <close> = m.pool.new(1 << 20)
    local mark = pool:mark()
    local _, s2 = ex.forward(P.x, P.gate_up, P.down, P.idx, P.w, plan, {pool = pool})
    pool:rewind(mark)
    err("saved.h: stale pool view", ex.backward, dy, P.x, P.gate_up, P.down, P.idx, P.w, plan, s2)
  end)
end)
