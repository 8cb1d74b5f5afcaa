-- The device memory outside the ledger (issue 14: `moelua plan` lists it
-- as not planned): moelua.mem.stats().cuda.untracked, cudaMemGetInfo's used
-- bytes less the caching allocator's reservations, read after each thing
-- that takes some in this process: the CUDA context (the first tensor),
-- cuBLAS (its handle and workspace: the first matmul) and an NCCL
-- communicator (dist.init{nccl = true}, one rank); before the first, none
-- (mem.stats() does not make the context). None of them frees
-- memory, so the readings never fall; each stays under 2 GiB. The lines it
-- prints are what plan_cli's outside lines quote (an H200 with CUDA 13:
-- BENCHMARKS.md, "The GPU, measured").
--
-- Without a CUDA device the whole file is one pending test. The emulated
-- build's device has no context: its readings are 0.
local m = require "moelua"
local dist = require "moelua.dist"

if not m.cuda_available() then
  describe("GPU memory outside the ledger", function()
    pending("no CUDA device: GPU specs skipped")
  end)
  return
end

local function untracked()
  return m.mem.stats().cuda.untracked
end

describe("GPU memory outside the ledger", function()
  it("is the context, then cuBLAS, then NCCL, each read as it comes", function()
    -- nothing read before this process has device memory (the read would make the context)
    assert.is_nil(untracked())
    local steps, readings = {}, {}
    local function read(what)
      local v = untracked()
      assert.is_number(v, what)
      readings[#readings + 1], steps[#steps + 1] = v, what
    end
    local a = m.randn({64, 64}, {seed = 1}):to("cuda")
    read("the CUDA context")
    local c = m.matmul(a, a)
    c:to("cpu")
    read("cuBLAS's handle and workspace")
    dist.init{timeout = 30, nccl = true}
    read("an NCCL communicator of one rank")
    for i, v in ipairs(readings) do
      assert.is_true(v >= (readings[i - 1] or 0), steps[i] .. ": the reading fell")
      assert.is_true(v < 2 << 30, steps[i] .. ": over 2 GiB")
      print(string.format("# outside the ledger after %s: %.1f MiB (+%.1f)", steps[i], v / 2^20,
                          (v - (readings[i - 1] or 0)) / 2^20))
    end
  end)
end)
