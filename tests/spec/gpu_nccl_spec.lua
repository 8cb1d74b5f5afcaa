-- moelua.dist over NCCL (host/runtime/comm.c, comm_nccl.c): a smoke test in
-- a world of one rank. dist.init{nccl = true} makes an NCCL communicator of
-- one rank; then every collective on CUDA tensors (f32 and f64) runs
-- through NCCL (sends and receives to itself, ncclAllGather,
-- ncclBroadcast) and the rank-order sum on the device, and must give bit
-- for bit what the same call on CPU tensors gives (the local path of world
-- 1). After each call the ledger's comm category is back where it started,
-- and a call mixing CPU and CUDA tensors is refused with a message naming
-- the device. The cross-rank numerics are tests/c/test_comm.c's (MPI) and
-- need several GPUs for NCCL.
--
-- Without a CUDA device the whole file is one pending test. With
-- MOELUA_GPU_SPEC_DEVICE=cpu it runs CPU against CPU without NCCL, to check
-- the spec itself on a machine without a GPU.
local m = require "moelua"
local dist = require "moelua.dist"
local support = require "tests.support"
local errmsg, has, values = support.errmsg, support.has, support.values

local DEV = os.getenv("MOELUA_GPU_SPEC_DEVICE") or "cuda"

if DEV == "cuda" and not m.cuda_available() then
  describe("GPU collectives: NCCL", function()
    pending("no CUDA device: GPU specs skipped")
  end)
  return
end

local function comm_bytes()
  return m.mem.stats()[DEV].current.comm
end

local function assert_same(cpu, got, what)
  assert.are.same(cpu:shape(), got:shape(), what)
  local a, b = values(cpu), values(got:to("cpu"))
  for i = 1, #a do
    if string.format("%a", a[i]) ~= string.format("%a", b[i]) then
      error(string.format("%s: element %d differs: cpu %.17g, %s %.17g", what, i, a[i], DEV, b[i]), 2)
    end
  end
end

local seed = 1100
local function randn(shape, dt)
  seed = seed + 1
  return m.randn(shape, {dtype = dt, seed = seed})
end

-- fn(args...) on CPU copies and on DEV copies of the tensors in args;
-- every tensor argument is compared afterwards (outputs are written in
-- place), and the comm ledger must be back at its start on DEV.
local function both(what, fn, ...)
  local args = table.pack(...)
  local cpu, dev = {}, {}
  for i = 1, args.n do
    local a = args[i]
    cpu[i] = m.is_tensor(a) and a:clone() or a
    dev[i] = m.is_tensor(a) and a:to(DEV):contiguous() or a
  end
  local before = comm_bytes()
  fn(table.unpack(cpu, 1, args.n))
  fn(table.unpack(dev, 1, args.n))
  for i = 1, args.n do
    if m.is_tensor(args[i]) then assert_same(cpu[i], dev[i], what .. ": argument " .. i) end
  end
  assert.are.equal(before, comm_bytes(), what .. ": comm ledger")
end

describe("GPU collectives: NCCL in a world of one rank", function()
  setup(function()
    dist.init{timeout = 30, nccl = DEV == "cuda"}
  end)

  it("has NCCL for CUDA tensors", function()
    assert.are.equal(DEV == "cuda", dist.nccl())
    assert.are.equal(1, dist.world())
  end)

  for _, dt in ipairs({"f32", "f64"}) do
    it("all_gather and iall_gather + wait, " .. dt, function()
      both("all_gather " .. dt, dist.all_gather, randn({37}, dt), m.zeros({37}, {dtype = dt}), "unit a")
      both("all_gather in place " .. dt, function(full)
        dist.all_gather(full:narrow(1, 1, 12), full, "unit b")
      end, randn({12}, dt))
      both("iall_gather " .. dt, function(shard, full)
        local req <close> = dist.iall_gather(shard, full, "unit c")
        req:wait()
        assert.is_true(req:test())
      end, randn({5, 3}, dt), m.zeros({15}, {dtype = dt}))
    end)

    it("reduce_scatter with and without accumulate, " .. dt, function()
      both("reduce_scatter " .. dt, function(full, shard)
        dist.reduce_scatter(full, shard, "grads")
      end, randn({1000}, dt), m.zeros({1000}, {dtype = dt}))
      both("reduce_scatter accumulate " .. dt, function(full, shard)
        dist.reduce_scatter(full, shard, "grads", true)
      end, randn({4, 250}, dt), randn({1000}, dt))
      both("reduce_scatter in place " .. dt, function(full)
        dist.reduce_scatter(full, full:narrow(1, 1, 1000), "grads", true)
      end, randn({1000}, dt))
    end)

    it("all_reduce with a size that is not a multiple of anything, " .. dt, function()
      both("all_reduce " .. dt, function(t) dist.all_reduce(t, "loads") end, randn({3, 7, 11}, dt))
      both("all_reduce one " .. dt, function(t) dist.all_reduce(t, "loads") end, randn({1}, dt))
    end)

    it("broadcast and all_to_all_v with uneven rows, " .. dt, function()
      both("broadcast " .. dt, function(t) dist.broadcast(t, 0, "seed") end, randn({33}, dt))
      both("all_to_all_v " .. dt, function(send, recv)
        dist.all_to_all_v(send, {5}, recv, {5}, "tokens")
      end, randn({7, 3}, dt), m.full({6, 3}, -1, {dtype = dt}))
      both("all_to_all_v no rows " .. dt, function(send, recv)
        dist.all_to_all_v(send, {0}, recv, {0}, "tokens")
      end, randn({2, 4}, dt), m.zeros({2, 4}, {dtype = dt}))
    end)
  end

  it("runs a collective on i64 and u8 bytes too (all_gather, broadcast)", function()
    both("all_gather i64", dist.all_gather, m.tensor({1, -2, 3}, {dtype = "i64"}),
         m.zeros({3}, {dtype = "i64"}), "ids")
    both("broadcast u8", function(t) dist.broadcast(t, 0, "mask") end, m.ones({9}, {dtype = "u8"}))
  end)

  it("refuses a call that mixes CPU and CUDA tensors, naming the device", function()
    if DEV == "cpu" then return end
    local before = comm_bytes()
    has(errmsg(dist.all_gather, m.zeros({4}), m.zeros({4}, {device = "cuda"}), "a"),
        "moelua.dist.all_gather: full is on cuda but the op runs on cpu")
    has(errmsg(dist.reduce_scatter, m.zeros({4}, {device = "cuda"}), m.zeros({4}), "g"),
        "moelua.dist.reduce_scatter: shard is on cpu but the op runs on cuda")
    has(errmsg(dist.all_to_all_v, m.zeros({2, 2}, {device = "cuda"}), {1}, m.zeros({2, 2}), {1}, "t"),
        "moelua.dist.all_to_all_v: recv is on cpu but the op runs on cuda")
    assert.are.equal(before, comm_bytes())
  end)
end)
