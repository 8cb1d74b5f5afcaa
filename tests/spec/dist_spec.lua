-- moelua.dist (host/bindings/l_dist.c, host/runtime/comm.c): every function
-- in a world of one rank (this process: no mpiexec, no MPI), bad input with
-- the message it must give, and jobs of `mpiexec -n 2` children: the
-- collectives across ranks, a Lua error on one rank ending the job with its
-- message, a stopped rank making the other exit within timeout + 2 s
-- naming the collective, and a skipped collective reported as a mismatch in
-- debug mode; groups (dist.split, dist.world_group) in world 1 with bad
-- input, and one `mpiexec -n 4` job with two splits checked per rank. The
-- four-rank numerics are tests/c/test_comm.c's.
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

  it("split gives a group of one rank whose methods mirror the module functions", function()
    local g = dist.split(3, 0, "ep")
    assert.are.equal(0, g:rank())
    assert.are.equal(1, g:world())
    local full = g:all_gather(m.tensor({1.5, -2}), m.zeros({2}), "unit a")
    assert.are.same({1.5, -2}, full:totable())
    do
      local out = m.zeros({2})
      local req <close> = g:iall_gather(m.tensor({4, 5}), out, "unit b")
      assert.is_true(req:test())
      req:wait()
      assert.are.same({4, 5}, out:totable())
    end
    local shard = m.tensor({1, 1}, {dtype = "f64"})
    assert.are.equal(shard, g:reduce_scatter(m.tensor({0.25, 3}, {dtype = "f64"}), shard, "grads", true))
    assert.are.same({1.25, 4}, shard:totable())
    assert.are.same({1, 2}, g:all_reduce(m.tensor({1, 2}), "loads"):totable())
    assert.are.same({2, 7}, g:all_reduce_numbers({2, 7}, "max", "norm"))
    assert.are.same({5}, g:broadcast(m.tensor({5}), 0, "seed"):totable())
    local recv = g:all_to_all_v(m.tensor({{1, 2}, {3, 4}}), {1}, m.zeros({2, 2}), {1}, "tokens")
    assert.are.same({{1, 2}, {0, 0}}, recv:totable())
    g:set_context("step 1")
    g:barrier("end")
    local sub = g:split(0, 0)
    assert.are.equal(1, sub:world())
    sub:barrier("nested")
    dist.progress()
    assert.are.equal(0, comm_bytes())
  end)

  it("world_group is the world as a group", function()
    local w = dist.world_group()
    assert.are.equal(w, dist.world_group())
    assert.are.equal(0, w:rank())
    assert.are.equal(1, w:world())
    assert.are.same({3}, w:all_reduce(m.tensor({3}), "x"):totable())
  end)

  it("split and group methods refuse bad input, naming the argument", function()
    has(errmsg(dist.split, -1, 0, "ep"), "moelua.dist.split: argument #1 (color) must be an integer >= 0, got -1")
    has(errmsg(dist.split, 0.5, 0, "ep"), "moelua.dist.split: argument #1 (color) must be an integer >= 0, got number")
    has(errmsg(dist.split, 0, "a", "ep"), "moelua.dist.split: argument #2 (key) must be an integer >= 0, got string")
    has(errmsg(dist.split, 0, -3), "argument #2 (key) must be an integer >= 0, got -3")
    has(errmsg(dist.split, 0, 0, 5), "moelua.dist.split: argument #3 (label) must be a string, got number")
    local g = dist.split(0, 0, "ep")
    has(errmsg(g.barrier, g, 1), "moelua.dist.Group:barrier: argument #1 (what) must be a string, got number")
    has(errmsg(g.all_gather, g, 1, m.zeros({2}), "a"), "moelua.dist.Group:all_gather: argument #1 (shard): expected a tensor, got number")
    has(errmsg(g.broadcast, g, m.zeros({2}), 1, "x"), "moelua.dist.Group:broadcast: argument #2 (root) must be a rank in [0, 1), got 1")
    has(errmsg(g.all_to_all_v, g, m.zeros({2, 2}), {1, 1}, m.zeros({2, 2}), {1}, "t"),
        "argument #2 (send_rows) must have 1 entries (one per rank), got 2")
    has(errmsg(g.split, g, 0, -1), "moelua.dist.Group:split: argument #2 (key) must be an integer >= 0, got -1")
    has(errmsg(g.barrier, {}, "x"), "moelua.dist.Group:barrier: self must be a moelua.dist group (call it as g:barrier(...)), got table")
  end)
end)

-- ---- jobs under mpiexec ----------------------------------------------------

-- Runs `script` as `mpiexec -n <n or 2> moelua script` (support.mpiexec_command,
-- killed after `limit` seconds); returns its exit code, stdout, stderr and
-- the seconds it took.
local function mpirun(script, limit, n)
  local dir = support.make_tmpdir()
  local q = support.shell_quote
  support.write_file(dir .. "/job.lua", script)
  local cmd = table.concat({
    "start=$(date +%s%N);",
    support.mpiexec_command(n or 2, {dir .. "/job.lua"}, limit),
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
io.write(string.format("rank %d full %s shard %s t %s n %s b %s recv %s\n", r, s(full), s(shard), s(t),
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

  it("an error every rank raises is printed once, by rank 0", function()
    local code, _, err = mpirun(preamble .. [[
dist.init{timeout = 30}
require("moelua.errors").user("option --steps must be at least 1, got 0")
]], 10)
    assert.are_not.equal(0, code)
    has(err, "rank 0: option --steps must be at least 1, got 0")
    assert.is_nil(err:find("rank 1: ", 1, true), err)
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
    assert.is_nil(err:find("stack traceback", 1, true), err)   -- the job's environment, not a bug
  end)

  it("a timeout the script catches: its buffers go back at exit, no leak reported", function()
    local code, out, err = mpirun(preamble .. [[
dist.init{timeout = 1}
local shard, full = m.ones({2}), m.zeros({4})
if dist.rank() == 0 then
  local ok, why = pcall(dist.all_gather, shard, full, "unit skipped by rank 1")
  print("caught", ok, why)
end
os.execute("sleep 1.5")
]], 10)
    assert.are.equal(0, code, err)
    has(out, "caught\tfalse\tmoelua.dist.all_gather: all-gather of unit skipped by rank 1 (collective #1 of rank 0) " ..
             "did not complete within 1 s")
    assert.is_nil(err:find("leak: the cpu ledger", 1, true), err)
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

  it("debug: all-to-all-v row counts that disagree between ranks are an error on every rank", function()
    local code, _, err = mpirun(preamble .. [[
dist.init{timeout = 5, debug = true}
local r = dist.rank()
dist.all_to_all_v(m.full({3, 2}, r + 1), r == 0 and {1, 2} or {1, 1}, m.full({3, 2}, 9), {1, 1}, "tokens")
]], 10)
    assert.are_not.equal(0, code)
    has(err, "all-to-all-v of tokens (collective #1 of rank ")
    has(err, "): rank 0 sends 2 rows to rank 1, which expects 1 (send_rows and recv_rows disagree)")
  end)
end)

describe("moelua.dist groups under mpiexec -n 4", function()
  it("two splits: collectives inside each group, per rank", function()
    local code, out, err, took = mpirun(preamble .. [[
dist.init{timeout = 5, debug = true}
local r = dist.rank()
local ep = dist.split(r % 2, r, "ep")      -- {0, 2} and {1, 3}
local edp = dist.split(r // 2, r, "edp")   -- {0, 1} and {2, 3}
local w = dist.world_group()
assert(w:world() == 4 and ep:world() == 2 and edp:world() == 2)
local g1 = ep:all_gather(m.tensor({r}), m.zeros({2}), "unit e")
local g2 = edp:reduce_scatter(m.tensor({r, 10 * r}), m.zeros({1}), "grads")
local n = ep:all_reduce_numbers({r}, "sum", "load")
local b = edp:broadcast(m.tensor({r}), 1, "seed")
local recv = ep:all_to_all_v(m.tensor({{r}, {r + 0.5}}), {1, 1}, m.zeros({2, 1}), {1, 1}, "tokens")
local t = w:all_reduce(m.tensor({r}), "all")
ep:barrier("end")
local function s(v)
  local o = {}
  for i, x in ipairs(type(v) == "table" and v or v:view(-1):totable()) do o[i] = string.format("%g", x) end
  return table.concat(o, ",")
end
io.write(string.format("rank %d ep %d/%d edp %d/%d g1 %s g2 %s n %s b %s recv %s t %s\n", r, ep:rank(),
  ep:world(), edp:rank(), edp:world(), s(g1), s(g2), s(n), s(b), s(recv), s(t)))
]], 10, 4)
    assert.are.equal(0, code, err)
    assert.is_true(took < 5, "took " .. took .. " s")
    has(out, "rank 0 ep 0/2 edp 0/2 g1 0,2 g2 1 n 2 b 1 recv 0,2 t 6\n")
    has(out, "rank 1 ep 0/2 edp 1/2 g1 1,3 g2 10 n 4 b 1 recv 1,3 t 6\n")
    has(out, "rank 2 ep 1/2 edp 0/2 g1 0,2 g2 5 n 2 b 3 recv 0.5,2.5 t 6\n")
    has(out, "rank 3 ep 1/2 edp 1/2 g1 1,3 g2 50 n 4 b 3 recv 1.5,3.5 t 6\n")
  end)
end)
