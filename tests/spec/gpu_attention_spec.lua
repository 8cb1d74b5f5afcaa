-- CPU-vs-CUDA parity of causal GQA attention (kernels/attention.cu against
-- kernels/attention.c) through moelua.ops.attention_forward/backward on
-- device tensors. The CUDA tiles are 16 x 16, so the shapes put S below,
-- on and past tile edges, and hd runs through 5, 8, 32, 64, 128 and 256
-- (the largest needs the shared-memory opt-in).
--
-- Tolerances (normwise relative error ||gpu - cpu|| / ||cpu||):
--   f64  1e-12: near-bitwise. The kernels sum in the CPU f64 path's order
--        with unfused products; they differ only through CUDA's exp/log
--        (an ulp or two) and the online softmax's tile size (16 keys, not
--        64), which moves the rescaling by a few eps.
--   f32  1e-5: the CPU runs sgemm tiles of 128 and a polynomial exp, the
--        GPU sequential dots in 16-key tiles and expf; each is within about
--        3e-7 of f64.
--   bf16 1e-2: bf16 in and out, f32 inside. The forward is compared with the
--        CPU f32 forward on the same bf16-rounded inputs; the backward with
--        the CPU f32 backward on the same rounded inputs and the GPU's own
--        out (as f32) and lse, so only the output rounding (2^-8 relative
--        at most) and f32 reordering separate them.
-- Determinism: two device runs give the same bits (no atomics).
--
-- Without a CUDA device the whole file is one pending test. With
-- MOELUA_GPU_SPEC_DEVICE=cpu it runs CPU against CPU (checks the spec
-- itself); the CPU has no bf16 attention, so there the bf16 test's device
-- side runs in f32 on the same rounded inputs.
local m = require "moelua"
local ops = require "moelua.ops"
local support = require "tests.support"

local DEV = os.getenv("MOELUA_GPU_SPEC_DEVICE") or "cuda"

if DEV == "cuda" and not m.cuda_available() then
  describe("GPU parity: attention", function()
    pending("no CUDA device: GPU specs skipped")
  end)
  return
end

local TOL = {f64 = 1e-12, f32 = 1e-5, bf16 = 1e-2}
local LOW = DEV == "cpu" and "f32" or "bf16"   -- the bf16 test's device dtype

-- {S, H, KV, hd}: one token; S below, on and past the 16-row tile; GQA
-- groups of 1, 2, 3 and 4; odd hd; several tiles with the CPU's f32 edge
local CASES = {
  {1, 1, 1, 8}, {17, 4, 2, 8}, {16, 2, 2, 64}, {45, 4, 1, 64}, {33, 6, 3, 128},
  {19, 3, 1, 5}, {20, 2, 1, 256}, {130, 2, 1, 32},
}

local function values(t)
  return support.values(t:to("cpu"))
end

local function assert_close(cpu, gpu, tol, what)
  assert.are.same(cpu:shape(), gpu:shape(), what)
  support.assert_close(values(gpu), values(cpu), tol, what)
end

local function assert_same(a, b, what)
  local x, y = values(a), values(b)
  assert.are.equal(#x, #y, what)
  for i = 1, #x do
    if string.format("%a", x[i]) ~= string.format("%a", y[i]) then
      error(string.format("%s: element %d differs: %.17g vs %.17g", what, i, x[i], y[i]), 2)
    end
  end
end

local function name(c, dt)
  return string.format("%s S=%d H=%d KV=%d hd=%d", dt, c[1], c[2], c[3], c[4])
end

-- q, k, v, dout of case c in dtype dt on the CPU
local function inputs(c, dt, seed)
  local S, H, KV, hd = c[1], c[2], c[3], c[4]
  local g = support.generator(seed, dt)
  return g.randn({S, H, hd}), g.randn({S, KV, hd}), g.randn({S, KV, hd}), g.randn({S, H, hd})
end

-- forward then backward; returns out, lse, dq, dk, dv
local function run(q, k, v, dout)
  local out, lse = ops.attention_forward(q, k, v)
  local dq, dk, dv = ops.attention_backward(dout, q, k, v, out, lse)
  return out, lse, dq, dk, dv
end

local function on(dev, ...)
  local r = {}
  for i, t in ipairs({...}) do r[i] = t:to(dev) end
  return table.unpack(r)
end

local OUTS = {"out", "lse", "dq", "dk", "dv"}

describe("GPU parity: attention", function()
  for _, dt in ipairs({"f64", "f32"}) do
    it("forward and backward match the CPU (" .. dt .. ")", function()
      for n, c in ipairs(CASES) do
        local q, k, v, dout = inputs(c, dt, 100 * n)
        local cpu = {run(q, k, v, dout)}
        local gpu = {run(on(DEV, q, k, v, dout))}
        for i, o in ipairs(OUTS) do
          assert_close(cpu[i], gpu[i], TOL[dt], o .. " " .. name(c, dt))
        end
      end
    end)
  end

  it("bf16 in and out matches the CPU f32 result on bf16-rounded inputs", function()
    for n, c in ipairs(CASES) do
      local q, k, v, dout = inputs(c, "f32", 100 * n)
      q, k, v, dout = q:to("bf16"):to("f32"), k:to("bf16"):to("f32"), v:to("bf16"):to("f32"),
          dout:to("bf16"):to("f32")
      local gq, gk, gv, gdout = on(DEV, q:to(LOW), k:to(LOW), v:to(LOW), dout:to(LOW))
      local gout, glse = ops.attention_forward(gq, gk, gv)
      local out, lse = ops.attention_forward(q, k, v)
      assert_close(out, gout:to("f32"), TOL.bf16, "out " .. name(c, "bf16"))
      assert_close(lse, glse, TOL.bf16, "lse " .. name(c, "bf16"))
      local cout, clse = gout:to("cpu"):to("f32"), glse:to("cpu")
      local ref = {ops.attention_backward(dout, q, k, v, cout, clse)}
      local got = {ops.attention_backward(gdout, gq, gk, gv, gout, glse)}
      for i, o in ipairs({"dq", "dk", "dv"}) do
        assert_close(ref[i], got[i]:to("f32"), TOL.bf16, o .. " " .. name(c, "bf16"))
      end
    end
  end)

  it("decodes against a KV cache: the device's last rows of its square call, the CPU's within tolerance", function()
    -- {Sq, Sk, H, KV, hd}: one query, several, across 16-row tiles and the CPU's 128
    for n, c in ipairs({{1, 17, 4, 2, 8}, {3, 45, 4, 1, 64}, {20, 150, 2, 1, 32}}) do
      local Sq, Sk, H, KV, hd = c[1], c[2], c[3], c[4], c[5]
      local what = string.format("Sq=%d Sk=%d H=%d KV=%d hd=%d", Sq, Sk, H, KV, hd)
      for _, dt in ipairs({"f64", "f32", LOW}) do
        local g = support.generator(50 * n, dt == LOW and "f32" or dt)
        local q, k, v = g.randn({Sk, H, hd}), g.randn({Sk, KV, hd}), g.randn({Sk, KV, hd})
        if dt == LOW then q, k, v = q:to("bf16"):to("f32"), k:to("bf16"):to("f32"), v:to("bf16"):to("f32") end
        local ql = q:narrow(1, Sk - Sq + 1, Sq):contiguous()
        local gq, gl, gk, gv = on(DEV, q:to(dt), ql:to(dt), k:to(dt), v:to(dt))
        local out, lse = ops.attention_forward(gl, gk, gv)
        local sq_out, sq_lse = ops.attention_forward(gq, gk, gv)
        -- bitwise on CUDA (its tiles are its own sums); the CPU's f32 tiles are sgemm calls of another M
        local same = (DEV == "cuda" or dt == "f64") and assert_same or function(a, b, w) assert_close(b, a, TOL.f32, w) end
        same(out, sq_out:narrow(1, Sk - Sq + 1, Sq):contiguous(), "out = the square's rows " .. dt .. " " .. what)
        same(lse, sq_lse:narrow(2, Sk - Sq + 1, Sq):contiguous(), "lse = the square's rows " .. dt .. " " .. what)
        local cout, clse = ops.attention_forward(ql, k, v)
        local tol = dt == LOW and TOL.bf16 or TOL[dt]
        assert_close(cout, out:to("cpu"):to(cout:dtype()), tol, "out " .. dt .. " " .. what)
        assert_close(clse, lse, tol, "lse " .. dt .. " " .. what)
      end
    end
  end)

  it("is deterministic: two device runs give the same bits", function()
    for _, dt in ipairs({"f32", LOW}) do
      local c = {45, 4, 2, 64}
      local q, k, v, dout = on(DEV, inputs(c, dt, 7))
      local a, b = {run(q, k, v, dout)}, {run(q, k, v, dout)}
      for i, o in ipairs(OUTS) do assert_same(a[i], b[i], o .. " " .. name(c, dt)) end
    end
  end)

  it("accepts an empty sequence", function()
    local q, k = on(DEV, m.randn({0, 2, 8}), m.randn({0, 1, 8}))
    local out, lse, dq, dk, dv = run(q, k, k, q)
    assert.are.same({0, 2, 8}, out:shape())
    assert.are.same({2, 0}, lse:shape())
    assert.are.same({0, 2, 8}, dq:shape())
    assert.are.same({0, 1, 8}, dk:shape())
    assert.are.same({0, 1, 8}, dv:shape())
  end)
end)
