-- CPU-vs-CUDA parity of the dense families through moelua.ops:
-- kernels/rmsnorm.cu, rope.cu, embedding.cu, crossentropy.cu against their
-- .c twins, forward and backward, f32 and f64, and bf16 (cross-entropy's
-- bf16 tolerances are stated at its case). Inputs are drawn as
-- non-contiguous views and made contiguous on each side (these ops take
-- contiguous tensors).
--
-- Tolerances, normwise ||dev - cpu|| / ||cpu|| unless said otherwise:
--   rmsnorm f32: 64 eps (y, rstd, dw), 128 eps (dx): the device sums a row
--     in f32 over fixed slices and a tree (about D/256 + 8 roundings), the
--     CPU in f64; dx = r g - x c may cancel, hence twice the room.
--     f64: 1e-12 (a tree instead of a sequence, a few ulp).
--   rope: f32 8 eps, f64 1e-11: CUDA's pow/cos/sin are within 2 ulp of
--     glibc's; an angle of up to ~1e3 rad carries that error times the
--     position, about 5e-13 absolute, which can flip an f32 rounding of cos
--     or sin by one ulp.
--   embedding: bitwise in f32 and f64 (the same adds in the same order).
--   cross-entropy: cuBLAS orders the GEMM sums its own way: 4 D eps on the
--     loss (relative) and lse (logits of depth D), 4 (D + max(V, S)) eps on
--     dh and dW (then products of depth V and S).
--   bf16 (bf16 in and out on the device, f32 inside): against the CPU's
--     f32 result on the same bf16-rounded inputs. One rounding of the
--     output is at most 2^-8 relative: 2^-8 for rmsnorm and rope outputs;
--     rstd stays f64 from f32 sums: 64 f32 eps. Weight gradients are f32
--     (ml_grad_dtype): rmsnorm dw 64 f32 eps as in f32; the embedding
--     forward is a copy and its backward the CPU's f32 adds: both bitwise.
--
-- Without a CUDA device the whole file is one pending test. With
-- MOELUA_GPU_SPEC_DEVICE=cpu it runs CPU against CPU, to check the spec
-- itself on a machine without a GPU; the CPU kernels have no bf16, so there
-- the "device" side runs f32 on the bf16-rounded inputs and rounds its
-- tensor results to bf16 (which checks the bf16 tolerances' rounding part).
local m = require "moelua"
local ops = require "moelua.ops"
local support = require "tests.support"

local DEV = os.getenv("MOELUA_GPU_SPEC_DEVICE") or "cuda"

if DEV == "cuda" and not m.cuda_available() then
  describe("GPU parity: dense ops", function()
    pending("no CUDA device: GPU specs skipped")
  end)
  return
end

local EPS = {f32 = 2^-24, f64 = 2^-53}
local BF16_TOL = 2^-8
local values = support.values

local function assert_close(cpu, got, tol, what)
  assert.are.same(cpu:shape(), got:shape(), what)
  support.assert_close(got:to("f64"), values(cpu:to("f64")), tol, what)
end

local function assert_same(cpu, got, what)
  assert.are.same(cpu:shape(), got:shape(), what)
  local a, b = values(cpu), values(got)
  for i = 1, #a do
    if string.format("%a", a[i]) ~= string.format("%a", b[i]) then
      error(string.format("%s: element %d differs: cpu %.17g, %s %.17g", what, i, a[i], DEV, b[i]), 2)
    end
  end
end

local function rel_scalar(a, b, tol, what)
  local err = math.abs(a - b) / math.max(math.abs(a), 1e-300)
  assert(err <= tol, string.format("%s: %.17g vs %.17g (rel %.3e > %.3e)", what, a, b, err, tol))
end

local seed = 4100
-- a [..., r, c] tensor read through a transposed view: non-contiguous
local function noncontig(lead, r, c, dt, scale)
  seed = seed + 1
  local shape = {}
  for i, n in ipairs(lead) do shape[i] = n end
  shape[#shape + 1] = c
  shape[#shape + 1] = r
  local t = m.randn(shape, {dtype = dt, seed = seed, std = scale})
  return t:transpose(#shape - 1, #shape)
end

-- a [n] tensor with stride 2
local function noncontig_vec(n, dt)
  seed = seed + 1
  return m.randn({n, 2}, {dtype = dt, seed = seed}):select(2, 1)
end

-- Runs op on DEV with its tensor arguments moved there (made contiguous
-- there) and returns its results on the CPU. In cpu mode, bf16 tensors go
-- in as f32 and f32 results come back rounded to bf16 (see the header).
local function on_dev(op, ...)
  local args = table.pack(...)
  local emulate = false
  for i = 1, args.n do
    local a = args[i]
    if m.is_tensor(a) then
      if DEV == "cpu" and a:dtype() == "bf16" then
        a, emulate = a:to("f32"), true
      end
      args[i] = a:to(DEV):contiguous()
    end
  end
  local res = table.pack(op(table.unpack(args, 1, args.n)))
  for i = 1, res.n do
    if m.is_tensor(res[i]) then
      res[i] = res[i]:to("cpu")
      if emulate and res[i]:dtype() == "f32" then res[i] = res[i]:to("bf16") end
    end
  end
  return table.unpack(res, 1, res.n)
end

-- The CPU side: the same op on contiguous CPU tensors; bf16 inputs as f32.
local function on_cpu(op, ...)
  local args = table.pack(...)
  for i = 1, args.n do
    local a = args[i]
    if m.is_tensor(a) then
      args[i] = (a:dtype() == "bf16" and a:to("f32") or a):contiguous()
    end
  end
  return op(table.unpack(args, 1, args.n))
end

-- A bf16 case runs where the op lets bf16 through: the op layer's dtype
-- check may still say "must be f32 or f64, got bf16" for some ops; those
-- cases are pending until it accepts what the device supports. Any other
-- error fails the case.
local function bf16_it(name, probe, body)
  local ok, err = true, nil
  if DEV ~= "cpu" then ok, err = pcall(probe) end
  if ok or not tostring(err):find("got bf16", 1, true) then
    it(name, body)
  else
    pending(name .. ": " .. tostring(err))
  end
end

local function bf16(t) return t:to("bf16") end

-- ---- rmsnorm -----------------------------------------------------------------

describe("GPU parity: rmsnorm", function()
  local N, D, eps = 300, 320, 1e-5
  local TOL = {f32 = {y = 64 * EPS.f32, dx = 128 * EPS.f32}, f64 = {y = 1e-12, dx = 1e-12}}

  it("forward and backward agree in f32 and f64 (dw accumulates)", function()
    for _, dt in ipairs({"f32", "f64"}) do
      local x, w, dy = noncontig({}, N, D, dt), noncontig_vec(D, dt), noncontig({}, N, D, dt)
      local dw0 = noncontig_vec(D, dt)
      local y, r = on_cpu(ops.rmsnorm_forward, x, w, eps)
      local gy, gr = on_dev(ops.rmsnorm_forward, x, w, eps)
      assert_close(y, gy, TOL[dt].y, "y " .. dt)
      assert_close(r, gr, TOL[dt].y, "rstd " .. dt)
      local dx, dw = on_cpu(ops.rmsnorm_backward, dy, x, w, r, dw0:clone())
      local gdx, gdw = on_dev(ops.rmsnorm_backward, dy, x, w, r, dw0)
      assert_close(dx, gdx, TOL[dt].dx, "dx " .. dt)
      assert_close(dw, gdw, TOL[dt].y, "dw (+=) " .. dt)
    end
  end)

  local tiny = function() return m.ones({1, 2}, {dtype = "bf16"}):to(DEV) end
  -- dw is f32 for bf16 inputs (mixed precision: the weight gradient of
  -- bf16 is f32): the CPU's f64 terms summed in the device's fixed slices
  -- and rounded once, 64 f32 eps as in f32 (the cpu mode rounds every f32
  -- result to bf16, dw too: there 2^-8).
  bf16_it("bf16 matches the CPU's f32 on bf16-rounded inputs (dw f32)", function()
    ops.rmsnorm_forward(tiny(), tiny():reshape({2}))
  end, function()
    local x, w, dy = bf16(noncontig({}, N, D)), bf16(noncontig_vec(D)), bf16(noncontig({}, N, D))
    local dw0 = noncontig_vec(D)
    local y, r = on_cpu(ops.rmsnorm_forward, x, w, eps)
    local gy, gr = on_dev(ops.rmsnorm_forward, x, w, eps)
    assert.are.equal("bf16", gy:dtype())
    assert_close(y, gy, BF16_TOL, "y bf16")
    assert_close(r, gr, 64 * EPS.f32, "rstd bf16")
    local dx, dw = on_cpu(ops.rmsnorm_backward, dy, x, w, r, dw0:clone())
    local gdx, gdw = on_dev(ops.rmsnorm_backward, dy, x, w, r, dw0)
    assert.are.equal("bf16", gdx:dtype())
    assert_close(dx, gdx, BF16_TOL, "dx bf16")
    if DEV ~= "cpu" then assert.are.equal("f32", gdw:dtype()) end
    assert_close(dw, gdw, DEV == "cpu" and BF16_TOL or TOL.f32.y, "dw (+=) f32 of bf16")
    -- into zeros the op allocates: f32
    local _, gdw0 = on_dev(ops.rmsnorm_backward, dy, x, w, r)
    if DEV ~= "cpu" then assert.are.equal("f32", gdw0:dtype()) end
    local _, dwz = on_cpu(ops.rmsnorm_backward, dy, x, w, r)
    assert_close(dwz, gdw0, DEV == "cpu" and BF16_TOL or TOL.f32.y, "dw into zeros f32 of bf16")
  end)

  if DEV ~= "cpu" then
    it("bf16: a given dw must be f32", function()
      local x = m.ones({2, 4}, {dtype = "bf16"}):to(DEV)
      local w = m.ones({4}, {dtype = "bf16"}):to(DEV)
      local _, r = ops.rmsnorm_forward(x, w, eps)
      local ok, err = pcall(ops.rmsnorm_backward, x, x, w, r, m.zeros({4}, {dtype = "bf16"}):to(DEV))
      assert.is_false(ok)
      assert.truthy(tostring(err):find("dw must be f32, got bf16", 1, true), tostring(err))
    end)
  end
end)

-- ---- rope --------------------------------------------------------------------

describe("GPU parity: rope", function()
  local S, H, hd = 130, 3, 64
  local TOL = {f32 = 8 * EPS.f32, f64 = 1e-11}
  local CASES = {{offset = 0, theta = 10000}, {offset = 1000, theta = 500000}}

  it("forward and backward agree in f32 and f64", function()
    for _, dt in ipairs({"f32", "f64"}) do
      local x = noncontig({S}, H, hd, dt)     -- [S, hd, H] read as [S, H, hd]
      for _, o in ipairs(CASES) do
        local what = string.format("%s offset %d", dt, o.offset)
        assert_close(on_cpu(ops.rope_forward, x, o), on_dev(ops.rope_forward, x, o), TOL[dt], "forward " .. what)
        assert_close(on_cpu(ops.rope_backward, x, o), on_dev(ops.rope_backward, x, o), TOL[dt], "backward " .. what)
      end
    end
  end)

  it("in place (opts.out = x, as the model runs it) gives the same bits", function()
    for _, dt in ipairs({"f32", "f64"}) do
      local x = noncontig({S}, H, hd, dt):to(DEV):contiguous()
      for _, f in ipairs({ops.rope_forward, ops.rope_backward}) do
        local want = f(x, CASES[2]):to("cpu")
        local y = x:clone()
        f(y, {offset = CASES[2].offset, theta = CASES[2].theta, out = y})
        assert.are.same(want:totable(), y:to("cpu"):totable(), dt)
      end
    end
  end)

  bf16_it("bf16 matches the CPU's f32 on bf16-rounded inputs", function()
    ops.rope_forward(m.ones({1, 1, 2}, {dtype = "bf16"}):to(DEV))
  end, function()
    local x = bf16(noncontig({S}, H, hd))
    for _, o in ipairs(CASES) do
      local gy = on_dev(ops.rope_forward, x, o)
      assert.are.equal("bf16", gy:dtype())
      assert_close(on_cpu(ops.rope_forward, x, o), gy, BF16_TOL, "forward bf16 offset " .. o.offset)
      assert_close(on_cpu(ops.rope_backward, x, o), on_dev(ops.rope_backward, x, o), BF16_TOL,
                   "backward bf16 offset " .. o.offset)
    end
  end)
end)

-- ---- embedding ---------------------------------------------------------------

-- T ids in [0, V): a third of them one hot id (long runs across tiles),
-- the rest uniform
local function draw_ids(T, V, s)
  local u = values(m.rand({T}, {dtype = "f64", seed = s}))
  local l = {}
  for i = 1, T do l[i] = (i % 3 == 0) and 5 or math.floor(u[i] * V) end
  return m.tensor(l, {dtype = "i64"})
end

describe("GPU parity: embedding", function()
  local T, V, D = 3000, 197, 40   -- V spans several 64-row ranges of the device backward

  it("forward and backward are bitwise equal in f32 and f64 (dW accumulates)", function()
    local ids = draw_ids(T, V, 77)
    for _, dt in ipairs({"f32", "f64"}) do
      local W, dout, dW0 = noncontig({}, V, D, dt), noncontig({}, T, D, dt), noncontig({}, V, D, dt)
      assert_same(on_cpu(ops.embedding_forward, ids, W), on_dev(ops.embedding_forward, ids, W), "forward " .. dt)
      assert_same(on_cpu(ops.embedding_backward, dout, ids, dW0:clone()),
                  on_dev(ops.embedding_backward, dout, ids, dW0), "backward " .. dt)
      assert_same(on_cpu(ops.embedding_backward, dout, ids, V), on_dev(ops.embedding_backward, dout, ids, V),
                  "backward into zeros " .. dt)
    end
  end)

  -- bf16 W and dout, dW f32 (mixed precision: the weight gradient of bf16
  -- is f32): the device's backward adds the widened dout in f32 in token
  -- order, the CPU's f32 adds on the same values: bitwise (the cpu mode
  -- rounds every f32 result to bf16, dW too: there 2^-8).
  bf16_it("bf16: the forward is a copy, the backward into an f32 dW is bitwise", function()
    ops.embedding_forward(m.tensor({0}, {dtype = "i64"}):to(DEV), m.ones({1, 2}, {dtype = "bf16"}):to(DEV))
  end, function()
    local ids = draw_ids(T, V, 78)
    local W, dout, dW0 = bf16(noncontig({}, V, D)), bf16(noncontig({}, T, D)), noncontig({}, V, D)
    local gy = on_dev(ops.embedding_forward, ids, W)
    assert.are.equal("bf16", gy:dtype())
    assert_same(bf16(on_cpu(ops.embedding_forward, ids, W)), gy, "forward bf16")
    for _, into in ipairs({"dW0", "zeros"}) do
      local what = "backward bf16 into " .. into
      local dW = on_cpu(ops.embedding_backward, dout, ids, into == "dW0" and dW0:clone() or V)
      local gdW = on_dev(ops.embedding_backward, dout, ids, into == "dW0" and dW0 or V)
      if DEV == "cpu" then
        assert_close(dW, gdW, BF16_TOL, what)
      else
        assert.are.equal("f32", gdW:dtype())
        assert_same(dW, gdW, what)
      end
    end
  end)

  if DEV ~= "cpu" then
    it("bf16: a given dW must be f32", function()
      local dout = m.ones({1, 2}, {dtype = "bf16"}):to(DEV)
      local ids = m.tensor({0}, {dtype = "i64"}):to(DEV)
      local ok, err = pcall(ops.embedding_backward, dout, ids, m.zeros({3, 2}, {dtype = "bf16"}):to(DEV))
      assert.is_false(ok)
      assert.truthy(tostring(err):find("dW must be f32, got bf16", 1, true), tostring(err))
    end)
  end
end)

-- ---- cross-entropy -----------------------------------------------------------

describe("GPU parity: cross_entropy", function()
  local S, V, D = 300, 1000, 64
  local OPTS = {rows = 128, chunk = 300}    -- partial row and vocabulary chunks

  it("loss, lse, dh and dW agree in f32 and f64 (dW accumulates)", function()
    local targets = draw_ids(S, V, 79)
    for _, dt in ipairs({"f32", "f64"}) do
      local h, W = noncontig({}, S, D, dt), noncontig({}, V, D, dt, 1 / math.sqrt(D))
      local dW0 = noncontig({}, V, D, dt)
      local loss, lse = on_cpu(ops.cross_entropy_forward, h, W, targets, OPTS)
      local gloss, glse = on_dev(ops.cross_entropy_forward, h, W, targets, OPTS)
      rel_scalar(loss, gloss, 4 * D * EPS[dt], "loss " .. dt)
      assert_close(lse, glse, 4 * D * EPS[dt], "lse " .. dt)
      local dh, dW = on_cpu(ops.cross_entropy_backward, 1.7, h, W, targets, lse,
                            {rows = OPTS.rows, chunk = OPTS.chunk, dW = dW0:clone()})
      local gdW0 = dW0:to(DEV)
      local gdh, gdW = on_dev(ops.cross_entropy_backward, 1.7, h, W, targets, glse,
                              {rows = OPTS.rows, chunk = OPTS.chunk, dW = gdW0})
      local tol = 4 * (D + math.max(V, S)) * EPS[dt]
      assert_close(dh, gdh, tol, "dh " .. dt)
      assert_close(dW, gdW, tol, "dW (+=) " .. dt)
    end
  end)

  it("NaN logits are an error on both sides", function()
    local targets = draw_ids(8, 50, 80)
    local hv = values(m.randn({8, 16}, {seed = 81}))
    hv[37] = 0 / 0
    local h, W = m.tensor(hv):reshape({8, 16}), m.randn({50, 16}, {seed = 82})
    for _, run in ipairs({on_cpu, on_dev}) do
      support.raises("NaN in the logits", run, ops.cross_entropy_forward, h, W, targets, {rows = 3, chunk = 7})
    end
  end)

  -- bf16 (h, W, dh bf16; dW f32): the logits are an f32 GEMM of the same
  -- values on both sides, so loss and lse keep f32's 4 D eps. The device
  -- rounds G = (softmax - onehot) dloss/S to bf16 for its two GEMMs (at most
  -- 2^-8 per entry, about 0.4 * 2^-8 RMS): dW's increment (f32) is off by
  -- about 0.4 * 2^-8 normwise, asserted <= 2^-8; dh by as much again from
  -- its one rounding to bf16, asserted <= 2 * 2^-8. dW's accumulator is the
  -- device tensor passed in (read back here: in cpu mode on_dev would round
  -- the returned f32 dW to bf16).
  bf16_it("bf16 matches the CPU's f32 on bf16-rounded inputs (dW f32, accumulates)", function()
    local one = m.ones({1, 2}, {dtype = "bf16"}):to(DEV)
    ops.cross_entropy_forward(one, one, m.tensor({0}, {dtype = "i64"}):to(DEV))
  end, function()
    local targets = draw_ids(S, V, 83)
    local h, W = bf16(noncontig({}, S, D)), bf16(noncontig({}, V, D, nil, 1 / math.sqrt(D)))
    local dW0 = noncontig({}, V, D, "f32", 1e-3)   -- of the size of the increment: += shows
    local loss, lse = on_cpu(ops.cross_entropy_forward, h, W, targets, OPTS)
    local gloss, glse = on_dev(ops.cross_entropy_forward, h, W, targets, OPTS)
    rel_scalar(loss, gloss, 4 * D * EPS.f32, "loss bf16")
    assert_close(lse, glse, 4 * D * EPS.f32, "lse bf16")
    local dh, dW = on_cpu(ops.cross_entropy_backward, 1.7, h, W, targets, lse,
                          {rows = OPTS.rows, chunk = OPTS.chunk, dW = dW0:clone()})
    local gdW0 = dW0:clone():to(DEV)
    local gdh = on_dev(ops.cross_entropy_backward, 1.7, h, W, targets, glse,
                       {rows = OPTS.rows, chunk = OPTS.chunk, dW = gdW0})
    assert.are.equal("bf16", gdh:dtype())
    assert.are.equal("f32", gdW0:dtype())
    assert_close(dh, gdh, 2 * BF16_TOL, "dh bf16")
    local function inc(d) return d:to("cpu"):to("f64") - dW0:to("f64") end
    assert_close(inc(dW), inc(gdW0), BF16_TOL, "dW (+=) bf16")
    if DEV ~= "cpu" then   -- the weight gradient of bf16 inputs is f32
      local gh, gW = h:to(DEV):contiguous(), W:to(DEV):contiguous()
      support.raises("dW must be f32, got bf16", ops.cross_entropy_backward, 1.7, gh, gW, targets:to(DEV),
                     glse:to(DEV), {dW = bf16(dW0):to(DEV)})
    end
  end)
end)
