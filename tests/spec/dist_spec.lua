-- moelua.dist (host/bindings/l_dist.c, host/runtime/comm.c): every function
-- in a world of one rank (this process: no mpiexec, no MPI), bad input with
-- the message it must give, and jobs of `mpiexec -n 2` children: the
-- collectives across ranks, a Lua error on one rank ending the job with its
-- message, a stopped rank making the other exit within timeout + 2 s
-- naming the collective, and a skipped collective reported as a mismatch in
-- debug mode. The four-rank numerics are tests/c/test_comm.c's.
local m = require "moelua"
local dist = require "moelua.dist"
local support = require "tests.support"
local errmsg, has = support.errmsg, support.has

local function comm_bytes()
  return m.mem.stats().cpu.current.comm
end

describe("moelua.dist before init", function()
  it("answers rank 0 of 1 and refuses collectives", function()
    assert.is_false(dist.launched())
    assert.are.equal(0, dist.rank())
    assert.are.equal(1, dist.world())
    dist.progress()
    has(errmsg(dist.barrier, "x"), "moelua.dist.barrier: call moelua.dist.init first")
    has(errmsg(dist.all_reduce, m.zeros({2}), "x"), "moelua.dist.all_reduce: call moelua.dist.init first")
  end)

  it("refuses bad options", function()
    has(errmsg(dist.init, {timeout = 0}), "moelua.dist.init: option 'timeout' must be > 0 seconds, got 0")
    has(errmsg(dist.init, {timeout = "5"}), "option 'timeout' must be a number, got string")
    has(errmsg(dist.init, {debug = 1}), "option 'debug' must be a boolean, got number")
    has(errmsg(dist.init, {tiemout = 5}), "unknown option 'tiemout' (expected one of: timeout, debug, nccl)")
    has(errmsg(dist.init, 5), "options must be a table, got number")
  end)
end)

describe("moelua.dist in a world of one rank", function()
  setup(function() dist.init{timeout = 5} end)

  it("init is idempotent and returns the library; other values are an error", function()
    assert.are.equal(dist, dist.init{timeout = 5})
    assert.are.equal(dist, dist.init())
    assert.are.equal(dist, dist.init{debug = false})
    has(errmsg(dist.init, {timeout = 6}),
        "already initialized with timeout = 5, debug = false: a second call cannot change them")
    assert.are.equal(0, dist.rank())
    assert.are.equal(1, dist.world())
  end)

  it("all_gather copies the shard; iall_gather gives a complete request", function()
    local shard, full = m.tensor({1.5, -2}), m.zeros({2})
    assert.are.equal(full, dist.all_gather(shard, full, "unit a"))
    assert.are.same({1.5, -2}, full:totable())
    local out = m.zeros({2}, {dtype = "f32"})
    do
      local req <close> = dist.iall_gather(shard, out, "unit a")
      assert.is_true(req:test())
      req:wait()
      req:wait()
    end
    assert.are.same({1.5, -2}, out:totable())
    assert.are.equal(0, comm_bytes())
  end)

  it("reduce_scatter copies, or accumulates; all_reduce leaves t as it is", function()
    local full, shard = m.tensor({0.25, 3}, {dtype = "f64"}), m.tensor({1, 1}, {dtype = "f64"})
    assert.are.equal(shard, dist.reduce_scatter(full, shard, "grads", true))
    assert.are.same({1.25, 4}, shard:totable())
    dist.reduce_scatter(full, shard, "grads")
    assert.are.same({0.25, 3}, shard:totable())
    local t = m.tensor({1, 2, 3})
    assert.are.equal(t, dist.all_reduce(t, "loads"))
    assert.are.same({1, 2, 3}, t:totable())
    assert.are.equal(0, comm_bytes())
  end)

  it("all_reduce_numbers returns a new table", function()
    local v = {1.5, 2, -3}
    local r = dist.all_reduce_numbers(v, "sum", "loss")
    assert.are_not.equal(v, r)
    assert.are.same({1.5, 2, -3}, r)
    assert.are.same({}, dist.all_reduce_numbers({}, "max", "none"))
    assert.are.same({7}, dist.all_reduce_numbers({7}, "min", "count"))
  end)

  it("broadcast, all_to_all_v, barrier, set_context, progress", function()
    local t = m.tensor({5, 6}, {dtype = "i64"})
    assert.are.equal(t, dist.broadcast(t, 0, "seed"))
    assert.are.same({5, 6}, t:totable())
    local send = m.tensor({{1, 2}, {3, 4}, {5, 6}})
    local recv = m.zeros({3, 2})
    assert.are.equal(recv, dist.all_to_all_v(send, {2}, recv, {2}, "tokens"))
    assert.are.same({{1, 2}, {3, 4}, {0, 0}}, recv:totable())
    dist.set_context("step 3")
    dist.barrier("end")
    dist.progress()
    dist.set_context("")
    assert.are.equal(0, comm_bytes())
  end)

  it("abort is error(msg) in a world of one rank", function()
    has(errmsg(dist.abort, "stop here"), "stop here")
    has(errmsg(dist.abort), "moelua.dist.abort: argument #1 (msg) must be a string, got no value")
  end)

  it("refuses bad input, naming the function and the argument", function()
    local x = m.zeros({4})
    has(errmsg(dist.all_gather, 1, x, "a"), "moelua.dist.all_gather: argument #1 (shard): expected a tensor, got number")
    has(errmsg(dist.all_gather, x, x, nil), "moelua.dist.all_gather: argument #3 (what) must be a string, got nil")
    has(errmsg(dist.all_gather, m.zeros({2}), m.zeros({3}), "a"),
        "moelua.dist.all_gather: full has 3 elements but must have world (1) x shard's numel (2) = 2")
    has(errmsg(dist.all_gather, m.zeros({2}), m.zeros({2}, {dtype = "f64"}), "a"),
        "full is f64 but shard is f32 (same dtype expected)")
    has(errmsg(dist.all_gather, m.zeros({2, 2}):t(), m.zeros({4}), "a"), "shard must be contiguous")
    local freed = m.zeros({2})
    freed:free()
    has(errmsg(dist.iall_gather, freed, x, "a"), "moelua.dist.iall_gather: argument #1 (shard): the tensor was freed")
    has(errmsg(dist.reduce_scatter, m.zeros({2}, {dtype = "i64"}), m.zeros({2}, {dtype = "i64"}), "g"),
        "moelua.dist.reduce_scatter: full must be f32 or f64, got i64")
    has(errmsg(dist.reduce_scatter, x, x:narrow(1, 1, 4), "g", 1),
        "argument #4 (accumulate) must be a boolean, got number")
    has(errmsg(dist.reduce_scatter, x, m.zeros({3}), "g"), "full has 4 elements but must have world (1) x shard's numel (3) = 3")
    has(errmsg(dist.all_reduce, x), "moelua.dist.all_reduce: argument #2 (what) must be a string, got nil")
    has(errmsg(dist.all_reduce_numbers, 1, "sum", "x"), "argument #1 (values) must be a table of numbers, got number")
    has(errmsg(dist.all_reduce_numbers, {1, "2"}, "sum", "x"), "argument #1 (values)[2] must be a number, got string")
    has(errmsg(dist.all_reduce_numbers, {1}, "avg", "x"), "argument #2 (op) must be 'sum', 'max' or 'min', got 'avg'")
    has(errmsg(dist.broadcast, x, 1, "x"), "moelua.dist.broadcast: argument #2 (root) must be a rank in [0, 1), got 1")
    has(errmsg(dist.broadcast, x, 0.5, "x"), "argument #2 (root) must be an integer rank, got number")
    local send, recv = m.zeros({3, 2}), m.zeros({3, 2})
    has(errmsg(dist.all_to_all_v, send, {1, 1}, recv, {1}, "t"),
        "moelua.dist.all_to_all_v: argument #2 (send_rows) must have 1 entries (one per rank), got 2")
    has(errmsg(dist.all_to_all_v, send, {-1}, recv, {1}, "t"), "argument #2 (send_rows)[1] must be an integer >= 0, got -1")
    has(errmsg(dist.all_to_all_v, send, {1}, recv, "x", "t"), "argument #4 (recv_rows) must be a table of 1 integers")
    has(errmsg(dist.all_to_all_v, send, {4}, recv, {4}, "t"), "send_rows add up to more than the 3 rows of send")
    has(errmsg(dist.all_to_all_v, send, {2}, recv, {1}, "t"), "send_rows (2) and recv_rows (1) for rank 0 differ")
    has(errmsg(dist.all_to_all_v, send, {1}, m.zeros({3, 3}), {1}, "t"), "recv's rows have 3 elements but send's have 2")
    has(errmsg(dist.all_to_all_v, send, {1}, send, {1}, "t"), "send and recv overlap")
    has(errmsg(dist.set_context, 3), "moelua.dist.set_context: argument #1 (context) must be a string, got number")
    assert.are.equal(0, comm_bytes())
  end)
end)

-- ---- jobs under mpiexec ----------------------------------------------------

-- Runs `script` as `mpiexec -n 2 moelua script` (support.mpiexec_command,
-- killed after `limit` seconds); returns its exit code, stdout, stderr and
-- the seconds it took.
local function mpirun(script, limit)
  local dir = support.make_tmpdir()
  local q = support.shell_quote
  support.write_file(dir .. "/job.lua", script)
  local cmd = table.concat({
    "start=$(date +%s%N);",
    support.mpiexec_command(2, {dir .. "/job.lua"}, limit),
    ">" .. q(dir .. "/out"), "2>" .. q(dir .. "/err") .. ";",
    "echo $? $(( ($(date +%s%N) - start) / 1000000 ))"}, " ")
  local p = assert(io.popen(cmd))
  local code, ms = p:read("n", "n")
  p:close()
  local out, err = support.read_file(dir .. "/out"), support.read_file(dir .. "/err")
  support.remove_dir(dir)
  return code, out, err, ms / 1000
end

local preamble = [[
local dist = require "moelua.dist"
local m = require "moelua"
io.stdout:setvbuf("line")
]]

if support.mpiexec_missing() then
  describe("moelua.dist under mpiexec -n 2", function() pending(support.mpiexec_missing()) end)
  return
end

describe("moelua.dist under mpiexec -n 2", function()
  it("gathers, reduces in rank order and agrees on numbers", function()
    local code, out, err = mpirun(preamble .. [[
dist.init{timeout = 5, debug = true}
local r, w = dist.rank(), dist.world()
assert(dist.launched() and w == 2)
local full = dist.all_gather(m.tensor({r + 0.5}), m.zeros({2}), "unit a")
local shard = dist.reduce_scatter(m.tensor({1 + r, 10 * (r + 1)}), m.zeros({1}), "grads")
local t = dist.all_reduce(m.tensor({r, 1, 2}), "loads")
local n = dist.all_reduce_numbers({r + 1, r}, "max", "norm")
local b = dist.broadcast(m.tensor({r}), 1, "seed")
local recv = dist.all_to_all_v(m.tensor({{r, 0}, {r, 1}, {r, 2}}), {1 + r, 1}, m.zeros({3, 2}),
                               r == 0 and {1, 2} or {1, 1}, "tokens")
local req <close> = dist.iall_gather(m.tensor({r}), m.zeros({2}), "unit b")
dist.progress()
req:wait()
dist.barrier("end")
local function s(v)
  local o = {}
  for i, x in ipairs(type(v) == "table" and v or v:view(-1):totable()) do o[i] = string.format("%g", x) end
  return table.concat(o, ",")
end
print(string.format("rank %d full %s shard %s t %s n %s b %s recv %s", r, s(full), s(shard), s(t),
  s(n), s(b), s(recv)))
]], 10)
    assert.are.equal(0, code, err)
    has(out, "rank 0 full 0.5,1.5 shard 3 t 1,2,4 n 2,1 b 1 recv 0,0,1,0,1,1\n")
    has(out, "rank 1 full 0.5,1.5 shard 30 t 1,2,4 n 2,1 b 1 recv 0,1,1,2,0,0\n")
  end)

  it("a Lua error on rank 1 only ends the job within seconds with its message", function()
    local code, _, err, took = mpirun(preamble .. [[
dist.init{timeout = 30}
if dist.rank() == 1 then error("boom on one rank") end
dist.barrier("never reached by rank 1")
]], 10)
    assert.are_not.equal(0, code)
    assert.is_true(took < 5, "took " .. took .. " s")
    has(err, "rank 1: ")
    has(err, "boom on one rank")
  end)

  it("a stopped rank makes the other exit within timeout + 2 s, naming the collective", function()
    local code, _, err, took = mpirun(preamble .. [[
dist.init{timeout = 1}
dist.set_context("step 3")
local shard, full = m.ones({2}), m.zeros({4})
dist.all_gather(shard, full, "unit warmup")
if dist.rank() == 1 then
  os.execute("kill -STOP " .. io.open("/proc/self/stat"):read("n"))
end
dist.all_gather(shard, full, "unit layers.0.dense")
]], 10)
    assert.are_not.equal(0, code)
    assert.is_true(took < 1 + 2, "took " .. took .. " s")
    has(err, "rank 0: ")
    has(err, "moelua.dist.all_gather: all-gather of unit layers.0.dense (step 3, collective #2 of rank 0) " ..
             "did not complete within 1 s: a rank stopped, died or called a different collective")
  end)

  it("debug: a collective skipped on one rank is a mismatch, not a hang", function()
    local code, _, err, took = mpirun(preamble .. [[
dist.init{timeout = 5, debug = true}
if dist.rank() == 0 then dist.all_gather(m.ones({2}), m.zeros({4}), "unit a") end
dist.barrier("step end")
]], 10)
    assert.are_not.equal(0, code)
    assert.is_true(took < 4, "took " .. took .. " s")
    has(err, "collective mismatch at #1: rank 0 calls all-gather of unit a (2 elements of f32), " ..
             "rank 1 calls barrier of step end")
  end)
end)
