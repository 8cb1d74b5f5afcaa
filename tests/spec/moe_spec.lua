-- The MoE layer (lua/moelua/moe.lua): router + dispatch + experts + combine
-- composed, against a dense f64 reference; gradients by finite differences
-- in f64; aux and z losses; memory behaviour; options.
local m = require "moelua"
local moe = require "moelua.moe"
local support = require "tests.support"
local errmsg = support.errmsg

-- ||a - b|| / ||b|| of two CPU tensors
local function normwise(a, b) return support.relerr(support.values(a), support.values(b)) end

-- y = sum_e W_te * down_e(silu(w1_e x) * w3_e x), W [T, E] dense routing weights
local function dense_reference(layer, x)
  local o, p = layer.opts, layer.params
  local E, F = o.experts, o.ffn
  local x64 = x:to("f64")
  local y = m.zeros({x:size(1), o.dim}, {dtype = "f64"})
  local W = m.zeros({x:size(1), E}, {dtype = "f64"})
  local ctx = layer.ctx
  local w = ctx.w:to("f64")
  W:scatter_add_(2, ctx.idx, w)
  for e = 1, E do
    local gu = p.gate_up:select(1, e):to("f64")          -- [2F, D]
    local h = m.matmul(x64, gu:t())                      -- [T, 2F]
    local act = h:narrow(2, 1, F):silu():mul(h:narrow(2, F + 1, F))
    local out = m.matmul(act, p.down:select(1, e):to("f64"):t())   -- [T, D]
    local wcol = W:narrow(2, e, 1):contiguous():reshape(-1)
    -- scale row t by W[t, e]: broadcast a [T, 1] column via transpose trick
    y:add_(out:t():mul(wcol):t())
  end
  return y
end

describe("moe layer", function()
  local opts = {dim = 12, ffn = 20, experts = 4, topk = 2, dtype = "f64", init_std = 0.5, init_seed = 3}

  it("forward equals a dense reference (every expert on every token, masked by the routing)", function()
    local layer = moe.new(opts)
    local x = m.randn({40, 12}, {dtype = "f64", seed = 1})
    local y = layer:forward(x, 0)
    assert.is_true(normwise(y, dense_reference(layer, x)) < 1e-12)
    local l32 = moe.new{dim = 12, ffn = 20, experts = 4, topk = 2, init_std = 0.5, init_seed = 3}
    local x32 = x:to("f32")
    local y32 = l32:forward(x32, 0)
    assert.is_true(normwise(y32, dense_reference(l32, x32)) < 1e-5)
  end)

  -- every scoring mode, with aux and z on, and with dropping on
  local GRAD_CASES = {
    {name = "softmax_topk, renorm"},
    {name = "softmax_topk, no renorm", renorm = false},
    {name = "topk_softmax", mode = "topk_softmax"},
    {name = "temperature and eps", temperature = 0.7, eps = 0.1},
    {name = "capacity drops", policy = "drop", capacity_factor = 0.75},
    {name = "layer-scope aux", aux_scope = "layer"},
  }
  for _, case in ipairs(GRAD_CASES) do
    it("has gradients that match finite differences (f64, aux and z on): " .. case.name, function()
      local o = {}
      for k, v in pairs(opts) do o[k] = v end
      for k, v in pairs(case) do if k ~= "name" then o[k] = v end end
      o.aux_weight, o.z_weight = 0.3, 0.05
      local layer = moe.new(o)
      local x = m.randn({24, 12}, {dtype = "f64", seed = 5})
      local c = m.randn({24, 12}, {dtype = "f64", seed = 6})
      local function loss()
        local y, st = layer:forward(x, 0)
        return y:mul(c):sum():item() + o.aux_weight * st.aux + o.z_weight * st.z,
               layer.ctx.idx:totable(), st.dropped
      end
      local _, idx0, dropped0 = loss()
      if case.policy == "drop" then assert.is_true(dropped0 > 0, "the case must drop assignments") end
      layer:zero_grad()
      local dx = layer:backward(c):clone()
      local function check(t, g, name)
        local n = t:numel()
        local flat, gflat = t:view(n), g:contiguous():view(n)
        local step = 1e-6
        for _, i in ipairs({1, n // 3, n // 2, n}) do
          local e = flat:narrow(1, i, 1)
          local v = e:item()
          e:fill_(v + step); local lp, ip = loss()
          e:fill_(v - step); local lm, im = loss()
          e:fill_(v)
          assert.are.same(idx0, ip, name .. ": the perturbation changed the routing")
          assert.are.same(idx0, im, name .. ": the perturbation changed the routing")
          local fd, an = (lp - lm) / (2 * step), gflat:narrow(1, i, 1):item()
          assert.is_true(math.abs(fd - an) <= 1e-6 * math.max(1, math.abs(fd)),
                         string.format("%s[%d]: finite difference %.10g, backward %.10g", name, i, fd, an))
        end
      end
      check(x, dx, "x")
      check(layer.params.wg, layer.grads.wg, "wg")
      check(layer.params.gate_up, layer.grads.gate_up, "gate_up")
      check(layer.params.down, layer.grads.down, "down")
    end)
  end

  it("gives bitwise the same output for any router chunk size", function()
    local x = m.randn({37, 12}, {seed = 9})
    local a = moe.new{dim = 12, ffn = 20, experts = 4, topk = 2, chunk = 7, init_seed = 1}
    local b = moe.new{dim = 12, ffn = 20, experts = 4, topk = 2, chunk = 64, init_seed = 1}
    local ya, yb = a:forward(x, 0):clone(), b:forward(x, 0):clone()
    assert.are.same(ya:totable(), yb:totable())
  end)

  it("route_only: routing and context alone, and backward's gradients bitwise a full forward's", function()
    local x, dy = m.randn({53, 12}, {seed = 4}), m.randn({53, 12}, {seed = 5})
    local grads = {}
    for _, c in ipairs{{"save", false}, {"save", true}, {"recompute", true}} do
      local layer = moe.new{dim = 12, ffn = 20, experts = 4, topk = 2, tile = 8, save = c[1], init_seed = 2,
                            aux_weight = 0.01, z_weight = 1e-3}
      local y = layer:forward(x, 3, c[2])
      assert.are.equal(c[2], y == nil, "y only without route_only")
      if c[2] then assert.are.same({tile = 8, nsaved = 0}, layer.ctx.saved) end
      local g = {dx = layer:backward(dy):clone()}
      for k, v in pairs(layer.grads) do g[k] = v:clone() end
      if grads.dx then
        for k, v in pairs(grads) do assert.are.same(v:totable(), g[k]:totable(), c[1] .. " " .. k) end
      else
        grads = g
      end
    end
  end)

  it("makes no ledger allocation in a warmed-up step", function()
    local layer = moe.new{dim = 16, ffn = 24, experts = 4, topk = 2, aux_weight = 0.01, z_weight = 1e-3}
    local x, dy = m.randn({64, 16}), m.randn({64, 16})
    -- warm-up: the first step grows the pool (in several blocks when its
    -- scratch outgrows the first: more threads, more scratch); the second
    -- step's reset makes them one block of the high-water mark
    for step = 0, 1 do layer:forward(x, step); layer:backward(dy) end
    collectgarbage(); collectgarbage()
    local before = m.mem.stats().cpu.allocs
    for step = 2, 4 do
      layer:zero_grad()
      layer:forward(x, step)
      layer:backward(dy)
    end
    local after = m.mem.stats().cpu.allocs
    for cat, n in pairs(after) do assert.are.equal(before[cat], n, "allocations under " .. cat) end
  end)

  it("reports routing statistics", function()
    local layer = moe.new{dim = 8, ffn = 8, experts = 4, topk = 2}
    local _, st = layer:forward(m.randn({100, 8}), 0)
    local counts = st.counts:totable()
    local total = 0
    for _, c in ipairs(counts) do total = total + c end
    assert.are.equal(200, total)
    assert.are.equal(0, st.dropped)
    assert.is_true(math.abs(st.mean_prob:sum():item() - 1) < 1e-6)
    assert.is_true(st.entropy > 0 and st.entropy <= math.log(4) + 1e-9)
    assert.is_true(st.max_share >= 0.25 and st.max_share <= 0.5)
  end)

  it("has aux = k under uniform routing (Hugging Face's convention)", function()
    local layer = moe.new{dim = 8, ffn = 8, experts = 4, topk = 2, init_std = 0}
    local _, st = layer:forward(m.randn({30, 8}), 0)
    assert.is_true(math.abs(st.aux - 2) < 1e-12, "aux " .. st.aux)
    assert.is_true(math.abs(st.z - math.log(4) ^ 2) < 1e-6)
    local loss, coefs, parts = moe.aux_loss({layer, layer}, 0.1, 0)
    assert.is_true(math.abs(parts.aux - 2) < 1e-12)
    assert.is_true(math.abs(loss - 0.2) < 1e-12)
    assert.are.equal(2, #coefs)
    local _, _, lparts = moe.aux_loss({layer}, 0.1, 0, "layer")
    assert.is_true(math.abs(lparts.aux - 2) < 1e-12)
  end)

  it("drops over-capacity assignments under policy drop", function()
    local layer = moe.new{dim = 8, ffn = 8, experts = 4, topk = 2, policy = "drop",
                          capacity_factor = 0.5, init_std = 0}
    local _, st = layer:forward(m.randn({40, 8}), 0)
    -- uniform logits: experts 1 and 2 get all 40 assignments each; capacity ceil(0.5*40*2/4) = 10
    assert.are.same({10, 10, 0, 0}, st.kept:totable())
    assert.are.equal(60, st.dropped)
  end)

  it("moves the aux-loss-free bias toward balance", function()
    local layer = moe.new{dim = 8, ffn = 8, experts = 4, topk = 1, bias_rate = 0.01, init_std = 0}
    layer:forward(m.randn({16, 8}), 0)         -- ties: every token picks expert 1
    layer:update_bias()
    local b = layer.bias:totable()
    assert.is_true(b[1] < 0 and b[2] > 0 and b[3] > 0 and b[4] > 0)
    layer:forward(m.randn({16, 8}), 1)
    assert.are.equal(0, layer.stats.counts:totable()[1], "the bias moved selection off expert 1")
  end)

  it("refuses bad options with their names", function()
    assert.matches("unknown option 'experst'", errmsg(moe.new, {dim = 4, ffn = 4, experst = 2}))
    assert.matches("option 'dim' is required", errmsg(moe.new, {ffn = 4, experts = 2}))
    assert.matches("option 'topk' must be an integer, got string",
                   errmsg(moe.new, {dim = 4, ffn = 4, experts = 2, topk = "2"}))
    -- called from pcall (C): no position at all, not moe.lua's
    assert.matches("^moelua%.moe%.new: option 'topk' = 3 must be in 1..experts %(2%)",
                   errmsg(moe.new, {dim = 4, ffn = 4, experts = 2, topk = 3}))
    assert.matches("policy \"drop\" needs capacity_factor > 0",
                   errmsg(moe.new, {dim = 4, ffn = 4, experts = 2, policy = "drop"}))
    assert.matches("option 'aux_scope' must be", errmsg(moe.new, {dim = 4, ffn = 4, experts = 2, aux_scope = "x"}))
    assert.matches("options must be a table", errmsg(moe.new, 3))
    -- the router's and the experts' checks, at moe.new rather than at the first forward
    for _, c in ipairs{{{mode = "x"}, "option 'mode' must be \"softmax_topk\" or \"topk_softmax\", got x"},
                       {{temperature = 0}, "option 'temperature' must be finite and > 0, got 0"},
                       {{temperature = -1}, "option 'temperature' must be finite and > 0, got %-1"},
                       {{temperature = math.huge}, "option 'temperature' must be a finite number, got inf"},
                       {{eps = 1}, "option 'eps' must be in %[0, 1%), got 1"},
                       {{noise = -1}, "option 'noise' must be a finite number >= 0, got %-1"},
                       {{tile = 0}, "option 'tile' must be an integer >= 1, got 0"},
                       {{chunk = 0}, "option 'chunk' must be an integer >= 1, got 0"},
                       {{partial_recompute = 2}, "option 'partial_recompute' must be in %[0, 1%] %(%-1: off%), got 2"}} do
      local o = {dim = 4, ffn = 4, experts = 2, topk = 1}
      for k, v in pairs(c[1]) do o[k] = v end
      assert.matches("moelua.moe.new: " .. c[2], errmsg(moe.new, o))
    end
    assert.matches("option 'dim' must be an integer >= 1, got 4.5", errmsg(moe.new, {dim = 4.5, ffn = 4, experts = 2}))
    assert.matches("option 'init_std' must be a finite number >= 0, got %-1",
                   errmsg(moe.new, {dim = 4, ffn = 4, experts = 2, init_std = -1}))
    assert.are.equal(16, moe.new{dim = 2 ^ 4, ffn = 4, experts = 2, topk = 1}.opts.dim)   -- a whole float
  end)

  it("refuses bad inputs to forward, backward and aux_loss at the caller's line", function()
    local layer = moe.new{dim = 4, ffn = 4, experts = 2, topk = 1}
    local function at_caller(f, ...)
      local ok, err = pcall(f, ...)
      assert.is_false(ok)
      assert.matches("^[^:]*moe_spec%.lua:%d+: ", tostring(err))
      return tostring(err)
    end
    local x = m.randn({3, 4})
    local function fwd(...) local y = layer:forward(...); return y end
    local function bwd(...) local dx = layer:backward(...); return dx end
    local function aux(...) local l = moe.aux_loss(...); return l end
    support.has(at_caller(bwd, x), "layer:backward: no forward to go back through")
    support.has(at_caller(fwd, m.randn({3, 5}), 0), "layer:forward: x is [3,5]: it must be [T, 4]")
    support.has(at_caller(fwd, nil, 0), "layer:forward: x must be a tensor, got nil")
    support.has(at_caller(fwd, m.randn({3, 4}, {dtype = "f64"}), 0),
                "layer:forward: x is f64 on cpu: the layer's are f32 on cpu")
    support.has(at_caller(fwd, x, -1), "layer:forward: step must be a whole number >= 0, got -1")
    support.has(at_caller(fwd, x, 0, 1), "layer:forward: route_only must be a boolean, got number")
    support.has(at_caller(aux, {layer}, 0.1, 0),
                "moelua.moe.aux_loss: layers[1] has no forward to take its routing from")
    layer:forward(x, 0)
    support.has(at_caller(bwd, m.randn({2, 4})), "layer:backward: dy is [2,4]: it must be [3, 4]")
    support.has(at_caller(bwd, x, "x"),
                "layer:backward: coef must be moe.aux_loss's {aux = tensor, z = number}, got string")
    support.has(at_caller(aux, nil, 0.1, 0), "moelua.moe.aux_loss: layers must be a non-empty list of MoE layers")
    support.has(at_caller(aux, {layer, {}}, 0.1, 0), "moelua.moe.aux_loss: layers[2] is not an MoE layer (moe.new)")
    support.has(at_caller(aux, {layer}, -1, 0), "moelua.moe.aux_loss: aux_weight must be a finite number >= 0, got -1")
    support.has(at_caller(aux, {layer}, 0.1, "x"), "moelua.moe.aux_loss: z_weight must be a finite number >= 0, got x")
    support.has(at_caller(aux, {layer}, 0.1, 0, "lyr"),
                "moelua.moe.aux_loss: scope must be \"model\" or \"layer\", got lyr")
    local _, coefs = moe.aux_loss({layer}, 0.1, 0)
    assert.are.same({3, 4}, layer:backward(x, coefs[1]):shape())
  end)
end)

describe("moe layer on given units", function()
  local support = require "tests.support"
  it("computes with views the caller owns, and checks them", function()
    local o = {dim = 8, ffn = 6, experts = 3, topk = 2, init_seed = 4}
    local own = moe.new(o)
    local p = {wg = own.params.wg:clone(), gate_up = own.params.gate_up:clone(), down = own.params.down:clone()}
    local g = {wg = m.zeros({3, 8}), gate_up = m.zeros({3, 12, 8}), down = m.zeros({3, 8, 6})}
    local layer = moe.new(o, {params = p, grads = g})
    local x, dy = m.randn({10, 8}, {seed = 2}), m.randn({10, 8}, {seed = 3})
    assert.are.same(own:forward(x, 0):totable(), layer:forward(x, 0):totable())
    own:zero_grad(); own:backward(dy); layer:backward(dy)
    assert.are.same(own.grads.down:totable(), g.down:totable())
    assert.matches("units.params.wg is %[3,7%] f32 cpu, expected %[3,8%] f32 cpu",
                   support.errmsg(moe.new, o, {params = {wg = m.zeros({3, 7}), gate_up = p.gate_up, down = p.down},
                                              grads = g}))
    assert.matches("units.grads.down must be a tensor, got nil",
                   support.errmsg(moe.new, o, {params = p, grads = {wg = g.wg, gate_up = g.gate_up}}))
  end)

  it("reinitialises a dead expert as a noisy copy of a live one, and resets the bias", function()
    local layer = moe.new{dim = 8, ffn = 6, experts = 4, topk = 2, bias_rate = 0.1, dtype = "f64"}
    local p = layer.params
    layer.bias:copy_(m.tensor({0.5, -1, 2, 0}, {dtype = "f64"}))
    layer:reinit_expert(1, 3, 0)                        -- no noise: an exact copy
    for _, k in ipairs({"wg", "gate_up", "down"}) do
      assert.are.same(support.values(p[k]:select(1, 4)), support.values(p[k]:select(1, 2)))
    end
    assert.are.same({0.5, 0, 2, 0}, layer.bias:totable())
    local before = p.gate_up:select(1, 4):clone()
    layer:reinit_expert(2, 0, 1e-3)                     -- noise of std 1e-3 around expert 0
    local d = p.gate_up:select(1, 3):sub(p.gate_up:select(1, 1))
    local n = d:numel()
    local rms = math.sqrt(d:mul(d):sum():item() / n)
    assert.is_true(rms > 0.7e-3 and rms < 1.3e-3, tostring(rms))   -- 96 draws of N(0, 1e-6)
    assert.are.same(support.values(before), support.values(p.gate_up:select(1, 4)))   -- others untouched
    layer:reset_bias()
    assert.are.same({0, 0, 0, 0}, layer.bias:totable())
    assert.matches("moelua.moe.reinit_expert: argument #1 (dead): expected an expert id in 0..3, got 4",
                   errmsg(layer.reinit_expert, layer, 4, 0, 0), nil, true)
    assert.matches("argument #2 (from): expected an expert id in 0..3, got 1.5",
                   errmsg(layer.reinit_expert, layer, 0, 1.5, 0), nil, true)
    assert.matches("dead and from are the same expert", errmsg(layer.reinit_expert, layer, 1, 1, 0))
    assert.matches("noise_std%): expected a number >= 0", errmsg(layer.reinit_expert, layer, 1, 2, -1))
  end)
end)
