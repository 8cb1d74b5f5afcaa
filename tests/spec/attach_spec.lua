-- `moelua attach RUN_DIR` and its job side (host/bindings/l_attach.c, moelua.remote):
--   - on a pseudo-terminal, against a tiny training started with --attach:
--     pause, read stats, change the temperature (seen in metrics.jsonl and
--     in stats), resume, detach; the job finishes with exit 0;
--   - through a pipe: an endless loop cut off, a bad set{}, a request over
--     8192 bytes refused while training goes on, checkpoint() after the step;
--   - in process: while the training thread is busy in one long C call (no
--     safe point), queries are answered at once from the last published
--     snapshot, and an endless loop or a memory bomb in one is cut off in
--     the server thread; a set{} sent meanwhile is answered only at the
--     next safe point;
--   - in process: a pause() that arrives mid-step holds the step at the
--     next layer; set{} inside a step waits for the next; the order of the
--     safe points in a step;
--   - permissions: the 0700 directory and the 0600 socket stop a peer of
--     another uid, and SO_PEERCRED refuses it when both are loosened;
--   - bad arguments, the sun_path limit, a client with no job;
--   - what the review found: a control line whose pcall outlasted the
--     instruction limit, a reply with a NUL byte, a pattern that runs for
--     hours in C, a second job on the same run directory.
-- Queries (no control called) are answered by the server thread of
-- host/bindings/attach.c from the snapshot; controls at the training thread's safe
-- points (lua/moelua/remote.lua).
-- The jobs run with one thread: a loaded machine slows them less.
local attach = require "moelua.attach"
local remote = require "moelua.remote"
local m = require "moelua"
local bench = require "moelua.bench"
local mem = require "moelua.mem"
local nn = require "moelua.nn"
local optim = require "moelua.optim"
local data = require "moelua.data"
local train = require "moelua.train"
local attach_env = require "moelua.attach_env"
local json = require "dkjson"
local pretty = require "moelua.pretty"
local system = require "system"
local support = require "tests.support"

local q = support.shell_quote
local TIMEOUT = 20   -- seconds for anything awaited

local function shell_out(cmd)
  local p = assert(io.popen(cmd))
  local s = p:read("l")
  p:close()
  return s
end

local function mode_of(path) return shell_out("stat -c %a " .. q(path) .. " 2>/dev/null") end

-- Waits until f() returns a true value and returns it; fails naming `what`.
local function wait_for(what, f)
  local deadline = system.gettime() + TIMEOUT
  while true do
    local v = f()
    if v then return v end
    assert(system.gettime() < deadline, "timed out waiting for " .. what)
    system.sleep(0.01)
  end
end

-- The step lines of RUN_DIR/metrics.jsonl by step, their count, and the
-- step of the checkpoint asked for from attach (nil: none).
local function metrics(run)
  local steps, n, asked = {}, 0, nil
  local f = io.open(run .. "/metrics.jsonl")
  if not f then return steps, 0 end
  for l in f:lines() do
    local ok, obj = pcall(json.decode, l)
    if ok and type(obj) == "table" then   -- a line being written may be cut
      if obj.step and not obj.event then
        steps[obj.step] = obj
        n = n + 1
      elseif obj.event == "checkpoint" and obj.reason == "attach" then
        asked = obj.step
      end
    end
  end
  f:close()
  return steps, n, asked
end

-- A tiny training with --attach in the background; returns its popen
-- handle once the socket is there and one step is logged (so `stats` exists).
local function start_job(run, steps)
  -- (a checkpoint a client asks for is a rollback target: --max-rollbacks 100 lets a loss spike
  -- roll back to it without ever stopping the run)
  local job = assert(io.popen(support.host_command({"recipes/tiny.lua", "--steps", tostring(steps),
      "--seq-len", "64", "--threads", "1", "--run-dir", run, "--ckpt-every", "0", "--max-rollbacks", "100",
      "--attach"}) .. " 2>&1"))
  wait_for("the job's socket", function() return mode_of(run .. "/attach/sock") end)
  wait_for("the job's first step", function() return select(2, metrics(run)) > 0 end)
  return job
end

-- Every step s of a finished run has temperature 1.0 before `from`, t after
-- (its last line: a rollback replays steps).
local function assert_temperatures(run, steps, from, t)
  local by_step, n = metrics(run)
  for s = 0, steps - 1 do assert.is_not_nil(by_step[s], "step " .. s) end
  assert.is_true(n >= steps)
  for s = 0, steps - 1 do assert.are.equal(s < from and 1.0 or t, by_step[s].temperature, "step " .. s) end
end

local function lines_of(s)
  local out = {}
  for l in s:gmatch("[^\n]+") do out[#out + 1] = l end
  return out
end

-- A job's server on run (remote.listen) and a client attached to it
-- (popen, written line by line, its output in `out`); both closed when the
-- spec ends.
local function attached(run, out)
  local srv = remote.listen(run, {steps = 4})
  local client = assert(io.popen(support.host_command({"attach", run}) .. " > " .. q(out) .. " 2>&1", "w"))
  client:setvbuf("no")
  finally(function()
    srv:close()                                    -- first: a client waiting on a reply then exits
    client:close()
  end)
  wait_for("the client", function() return select(2, srv.handle:poll()) == 1 end)
  return srv, client
end

describe("moelua attach", function()
  local dir
  before_each(function() dir = support.make_tmpdir() end)
  after_each(function() support.remove_dir(dir) end)

  it("on a terminal: reads stats, changes the temperature (seen in metrics.jsonl), detaches; the job finishes",
     function()
    local run, steps = dir .. "/run", 150
    local job = start_job(run, steps)
    local s = support.pty(dir .. "/pty", q(support.host_path()) .. " attach " .. q(run))
    s:expect("attached to " .. run .. " (Ctrl-D detaches; the job keeps running)", true)
    s:expect("attach> ", true)
    local at = tonumber(s:line("pause()", "attach> "):match("\npaused at step (%d+)"))
    assert.is_not_nil(at, "no pause reply")
    local seen = s:line("stats.step, stats.loss, progress.step", "attach> ")
    local last, loss, now = seen:match("\n(%d+)\r\n([%d.]+)\r\n(%d+)\r\n")
    assert.is_not_nil(last, seen)
    assert.is_true(tonumber(last) < at, seen)              -- stats: the last finished step
    assert.is_true(tonumber(loss) > 0, seen)
    assert.are.equal(at, tonumber(now))
    local from = tonumber(s:line("set{temperature = 0.5}", "attach> "):match("\napplied from step (%d+)"))
    assert.is_true(from == at or from == at + 1, "applied from " .. tostring(from) .. ", paused at " .. at)
    assert.matches("\nresumed\r\n", s:line("resume()", "attach> "))
    -- still attached: the job logs the new temperature, and stats shows it
    wait_for("step " .. from .. " in metrics.jsonl", function() return metrics(run)[from] end)
    assert.are.equal(0.5, metrics(run)[from].temperature)
    -- stats: as published at the next step's start
    local seen_t = wait_for("step " .. from .. " in stats", function()
      local st, t = s:line("stats.step, stats.temperature", "attach> "):match("\n(%d+)\r\n([%d.]+)\r\n")
      return st and tonumber(st) >= from and t
    end)
    assert.are.equal("0.5", seen_t)
    local status, screen = s:finish()
    assert.are.equal(0, status, screen)
    assert.is_nil(screen:find("error", 1, true), screen)
    local code, out = support.finish_child(job)
    assert.are.equal(0, code, out)
    assert_temperatures(run, steps, from, 0.5)
    assert.is_nil(mode_of(run .. "/attach/sock"))          -- removed at the end
  end)

  it("on a terminal: says at once, at the prompt, that the job closed the connection", function()
    local run = dir .. "/run"
    local srv = remote.listen(run, {steps = 4})
    local s = support.pty(dir .. "/pty", q(support.host_path()) .. " attach " .. q(run))
    s:expect("attach> ", true)
    wait_for("the client", function() return select(2, srv.handle:poll()) == 1 end)
    srv:close()                                            -- the job ends; nothing is typed
    s:expect("moelua attach: the job closed the connection", true)
    local status, screen = s:finish()
    assert.are.equal(1, status, screen)
  end)

  it("through a pipe: cuts off an endless loop, refuses a request over 8192 bytes, checkpoints after the step",
     function()
    local run, steps = dir .. "/run", 150
    local job = start_job(run, steps)
    local big = "x = '" .. string.rep("a", 9000) .. "'"
    local input = dir .. "/input"
    support.write_file(input, table.concat({
      "pause()", "progress.step", "stats.loss", "set{temperature = 0.5}", "while true do end",
      "progress.paused", "set{temperature = -1}", big, "progress.paused", "checkpoint()", "resume()", "resume()",
      ""}, "\n"))
    local code, out = support.finish_child(assert(io.popen(
      support.host_command({"attach", run}) .. " < " .. q(input) .. " 2>&1")))
    assert.are.equal(0, code, out)
    local replies = lines_of(out)
    assert.are.equal(12, #replies, out)
    local at, inside = replies[1]:match("^paused at step (%d+)(.*)$")
    at = tonumber(at)
    assert.is_not_nil(at, out)
    assert.are.equal(at, tonumber(replies[2]), out)
    assert.is_true(tonumber(replies[3]) > 0, out)             -- stats: the last step's loss
    -- paused inside the step ("... (after the forward of layer 1)"): from the next step
    local from = inside == "" and at or at + 1
    support.has(replies[4], "applied from step " .. from .. ": temperature = 0.5 (kept across rollbacks")
    support.has(replies[5], "error: attach:1: instruction limit exceeded (1000000 instructions)")
    assert.are.equal("true", replies[6])                      -- the job answered after the loop
    support.has(replies[7], "set: temperature must be a finite number > 0")
    assert.are.equal("error: request over 8192 bytes: refused, not run " ..
                     "(one line at most 8192 bytes with its newline)", replies[8])
    assert.are.equal("true", replies[9])                      -- the same client, still served
    assert.are.equal("a checkpoint will be saved after step " .. at, replies[10])
    assert.are.equal("resumed", replies[11])
    assert.are.equal("not paused", replies[12])

    local jcode, jout = support.finish_child(job)
    assert.are.equal(0, jcode, jout)
    assert.are.equal(at, select(3, metrics(run)), "the requested checkpoint: after the paused step")
    assert_temperatures(run, steps, from, 0.5)
  end)

  it("answers queries at once from the snapshot while the training thread is busy in C; a control waits " ..
     "for the next safe point", function()
    collectgarbage()                                 -- no earlier spec's tensor freed midway
    local run = dir .. "/run"
    local srv = remote.listen(run, {steps = 10})
    support.write_file(run .. "/metrics.jsonl", '{"step":6,"loss":2.5,"temperature":1.0}\n')
    srv:poll(7)                                      -- step 7 starts: stats of step 6
    srv:position(1, 1)
    srv:safe_point("forward", 1)                     -- the last snapshot before the busy spell
    local published = mem.stats().cpu.total
    local n = 512
    local a, b, c = m.randn({n, n}, {seed = 1}), m.randn({n, n}, {seed = 2}), m.zeros({n, n})
    assert.is_true(mem.stats().cpu.total > published)   -- the ledger moved on, the snapshot did not
    local out = dir .. "/client.out"
    local client = assert(io.popen(support.host_command({"attach", run}) .. " > " .. q(out) .. " 2>&1", "w"))
    client:setvbuf("no")
    local threads0 = m.threads()
    finally(function()                               -- also when an assertion fails
      m.threads(threads0)
      srv:close()                                    -- first: a client waiting on a reply then exits
      if io.type(client) == "file" then client:close() end
    end)
    wait_for("the client", function() return select(2, srv.handle:poll()) == 1 end)
    m.threads(1)                                     -- one BLAS thread: a core left for the client
    -- the fastest of a few samples: a slow first call (pages, the pool) would cut the spell short
    local per_call = math.huge
    for _ = 1, 4 do per_call = math.min(per_call, bench.raw_sgemm(c, a, b, 2)) end
    local calls = math.ceil(2.5 / per_call)
    -- sent one at a time by the client, each after the last one's reply
    client:write("progress.step, progress.phase, progress.layer, stats.loss, ledger.cpu.total\n" ..
                 "while true do pcall(function() while true do end end) end\n" ..
                 "local t = {} for i = 1, 8 do t[i] = string.rep(i, 1 << 24) end\n" ..   -- 128 MiB
                 "set{temperature = 0.7}\n" ..
                 "progress.phase, staged.temperature\n")
    local t0 = bench.now()
    bench.raw_sgemm(c, a, b, calls)                  -- one C call: no safe point for ~2.5 s
    local busy = bench.now() - t0
    local during = support.read_file(out)
    assert.is_true(busy > 1.0, "busy for " .. busy .. " s only")
    assert.are.equal(table.concat({"7", "forward", "1", "2.5", tostring(published),
                                   "error: attach:1: instruction limit exceeded (1000000 instructions)",
                                   "error: not enough memory", ""}, "\n"), during)
    -- set{} was not answered: it waits, queued, for the training thread
    assert.are.same({}, srv.staged)
    system.sleep(0.2)
    assert.are.equal(during, support.read_file(out))
    srv:safe_point("backward", 1)                    -- runs it: mid-step, staged for step 8
    assert.are.same({temperature = 0.7}, srv.staged)
    local rest = "applied from step 8: temperature = 0.7 (kept across rollbacks, not saved in checkpoints; " ..
                 'unset("temperature") drops it)\nbackward\n0.7\n'  -- and the next query sees it
    wait_for("the replies after the safe point", function()
      return support.read_file(out) == during .. rest
    end)
    client:close()
    srv:close()
    assert.is_nil(mode_of(run .. "/attach/sock"))
  end)

  it("holds a step at the next layer for a pause() sent mid-step; set{} inside a step waits for the next",
     function()
    m.manual_seed(0)
    local model = nn.Transformer.new{vocab = 256, dim = 16, layers = 2, heads = 2, kv_heads = 1, ffn = 24,
                                     experts = 4, topk = 2, seed = 0, checkpoint = "moe"}
    local ds = data.open{glob = "/usr/include/std*.h", seq_len = 32, seed = 0, holdout = 0.01}
    local groups = model:param_groups{weight_decay = 0.1}
    local run = dir .. "/run"
    local srv = remote.listen(run, {steps = 4})
    local order, plain = {}, srv.safe_point
    function srv:safe_point(phase, layer)               -- the safe points of step 0, in order
      if self.step == 0 then order[#order + 1] = phase .. (layer or "") end
      return plain(self, phase, layer)
    end
    local out = dir .. "/client.out"
    local client = assert(io.popen(support.host_command({"attach", run}) .. " > " .. q(out) .. " 2>&1", "w"))
    client:setvbuf("no")
    -- the hook runs at a step's start, after that safe point: what it sends
    -- arrives mid-step (the client relays it within the 0.3 s it waits)
    local function hook(step)
      if step == 1 then
        client:write("print(progress.step, progress.steps, progress.paused, progress.micros, progress.phase)\n")
        system.sleep(0.3)
      elseif step == 2 then
        client:write("pause()\nprogress.phase, progress.layer, progress.paused\nset{temperature = 0.5}\n" ..
                     "staged.temperature, overrides.temperature\nresume()\n")
        system.sleep(0.3)
      end
    end
    train.run{model = model, data = ds, optimizer = optim.AdamW(groups, {lr = 1e-3}), groups = groups,
              seq_len = 32, steps = 4, accum = 2, hook = hook, run_dir = run, attach = srv}
    client:close()
    srv:close()
    assert.are.same({"forward1", "forward2", "backward2", "backward1", "micro-batch",
                     "forward1", "forward2", "backward2", "backward1", "micro-batch"}, order)
    assert.is_nil(model.safe_point)                          -- removed after the step
    local replies = lines_of(assert(support.read_file(out)))
    assert.are.equal(9, #replies, table.concat(replies, "\n"))
    -- answered at once from the snapshot of step 1's start (or of a later
    -- safe point of step 1, if the client took over 0.3 s to relay it)
    local p = {}
    for f in replies[1]:gmatch("[^\t]+") do p[#p + 1] = f end
    assert.are.same({"1", "4", "false", "2"}, {p[1], p[2], p[3], p[4]})
    assert.is_true(p[5] == "start" or p[5] == "forward" or p[5] == "backward" or p[5] == "micro-batch", replies[1])
    -- paused inside step 2, where the reply and progress say
    local phase, layer = replies[2]:match("^paused at step 2 %(after the (%a+) of layer (%d), micro%-batch %d of 2%)$")
    if not phase then
      assert.matches("^paused at step 2 %(after micro%-batch %d of 2%)$", replies[2])
      phase, layer = "micro-batch", "nil"
    end
    assert.are.same({phase, layer, "true"}, {replies[3], replies[4], replies[5]})
    assert.matches("^applied from step 3: temperature = 0.5 ", replies[6])
    assert.are.same({"0.5", "nil"}, {replies[7], replies[8]})  -- staged, not yet in force
    assert.are.equal("resumed", replies[9])
    local by_step = metrics(run)
    assert.are.same({1.0, 1.0, 1.0, 0.5}, {by_step[0].temperature, by_step[1].temperature,
                                           by_step[2].temperature, by_step[3].temperature})
  end)

  it("a job paused inside a step, where the trainer holds the collector, does not grow its Lua heap", function()
    local model = nn.Transformer.new{vocab = 256, dim = 16, layers = 1, heads = 2, kv_heads = 1, ffn = 24,
                                     experts = 4, topk = 2, seed = 0}
    local ds = data.open{glob = "/usr/include/std*.h", seq_len = 32, seed = 0, holdout = 0.01}
    local groups = model:param_groups{weight_decay = 0.1}
    local run = dir .. "/run"
    local srv = remote.listen(run, {steps = 2})
    local heap, plain = {}, srv.publish
    function srv:publish(fresh)                        -- the paused loop publishes every 50 ms
      if self.paused then heap[#heap + 1] = collectgarbage("count") end
      return plain(self, fresh)
    end
    local client
    local function hook(step)
      if step == 0 then   -- paused at the step's next safe point for 1.5 s
        client = assert(io.popen("(printf 'pause()\\n'; sleep 1.5; printf 'resume()\\n') | " ..
                                 support.host_command({"attach", run}) .. " > /dev/null 2>&1", "w"))
        system.sleep(0.5)   -- the client relays pause() meanwhile
      end
    end
    train.run{model = model, data = ds, optimizer = optim.AdamW(groups, {lr = 1e-3}), groups = groups,
              seq_len = 32, steps = 2, hook = hook, run_dir = run, attach = srv}
    client:close()
    srv:close()
    assert.is_true(#heap >= 10, "paused for " .. #heap .. " publishes")
    -- (from the second: the first comes before the loop's first collection)
    assert.is_true(heap[#heap] - heap[2] < 32, string.format("the heap grew from %.0f to %.0f KiB", heap[2], heap[#heap]))
  end)

  it("keeps its socket 0600 in a 0700 directory of the job's user; checks its arguments", function()
    support.has(support.errmsg(attach.listen, true), "string expected")
    support.has(support.errmsg(attach.listen, dir .. "/" .. string.rep("x", 120)),
                "over the 107-byte limit of a Unix socket address")
    support.has(support.errmsg(attach.listen, dir, 0), "argument #2 (instructions): expected 1..1e9, got 0")
    local h = attach.listen(dir)
    assert.are.equal("700", mode_of(dir .. "/attach"))
    assert.are.equal("600", mode_of(dir .. "/attach/sock"))
    local uid = shell_out("id -u")
    assert.are.equal(uid, shell_out("stat -c %u " .. q(dir .. "/attach")))
    assert.are.equal(uid, shell_out("stat -c %u " .. q(dir .. "/attach/sock")))
    local reqs, n = h:poll()
    assert.are.same({}, reqs)
    assert.are.equal(0, n)
    support.has(support.errmsg(attach.poll, "x"), "moelua.attach.poll: argument #1: expected an attach handle")
    support.has(support.errmsg(h.poll, h, -1), "argument #2 (timeout_ms)")
    support.has(support.errmsg(attach.reply, h, "x", "t"), "number expected")
    support.has(support.errmsg(attach.publish, h, {}), "string expected")
    assert.is_false(h:reply(7, "nobody"))
    h:close()
    h:close()                                                   -- idempotent
    support.has(support.errmsg(h.poll, h), "the attach handle is closed")
    support.has(support.errmsg(h.publish, h, "{}"), "the attach handle is closed")
    assert.are.equal("moelua.Attach(" .. dir .. "/attach/sock, closed)", tostring(h))
    assert.is_nil(mode_of(dir .. "/attach/sock"))
  end)

  it("refuses a peer of another uid: the 0700 directory stops it, and SO_PEERCRED once loosened", function()
    if shell_out("id -u") ~= "0" then
      pending("running a client as another user needs root")
      return
    end
    local runas = os.execute("command -v setpriv >/dev/null") and "setpriv --reuid=nobody --regid=nogroup --clear-groups "
                  or "runuser -u nobody -- "
    assert(os.execute("chmod 755 " .. q(dir)))                 -- nobody may reach dir/attach
    local h = attach.listen(dir)
    local sock = dir .. "/attach/sock"
    local function as_nobody()
      return support.finish_child(assert(io.popen(runas .. support.host_command({"attach", dir}) ..
                                                  " </dev/null 2>&1")))
    end
    local code, out = as_nobody()
    assert.are.equal(1, code, out)
    support.has(out, "cannot connect to " .. sock .. ": Permission denied")
    assert(os.execute("chmod 711 " .. q(dir .. "/attach")))   -- the directory loosened: the socket's 0600
    code, out = as_nobody()
    assert.are.equal(1, code, out)
    support.has(out, "cannot connect to " .. sock .. ": Permission denied")
    assert(os.execute("chmod 666 " .. q(sock)))               -- both loosened: SO_PEERCRED decides

    -- a client in the background, sending `input`; the spec serves the socket meanwhile
    local function session(prefix, name, input, serve)
      local o, st = dir .. "/" .. name .. ".out", dir .. "/" .. name .. ".status"
      assert(os.execute(string.format("(printf %s | %s%s >%s 2>&1; echo $? >%s) &", q(input), prefix,
                                      support.host_command({"attach", dir}), q(o), q(st))))
      wait_for(name .. "'s exit", function()
        local reqs, nclients = h:poll(20)
        serve(reqs, nclients)
        local s = support.read_file(st)
        return s and s ~= ""
      end)
      return support.read_file(o), support.read_file(st)
    end
    local status
    out, status = session(runas, "nobody", "checkpoint()\\n", function(reqs, nclients)
      assert.are.same({}, reqs)                                 -- never a request
      assert.are.equal(0, nclients)                             -- never a client
    end)
    assert.are.equal("error: refused: this job runs as uid 0 and the peer is uid 65534 (SO_PEERCRED); " ..
                     "attach as the job's user\n", out)
    assert.are.equal("1\n", status)                            -- the client exits 1
    -- the job's own uid on the same socket is served: a query by the server
    -- thread from the snapshot, a control by the spec (the training thread)
    h:publish('{"progress":{"step":3}}')
    local served = 0
    out, status = session("", "root", "progress.step\\ncheckpoint()\\n", function(reqs)
      for _, r in ipairs(reqs) do
        assert.are.equal("checkpoint()", r.code)
        assert.is_true(h:reply(r.client, "served"))
        served = served + 1
      end
    end)
    assert.are.equal(1, served)
    assert.are.equal("3\nserved\n", out)
    assert.are.equal("0\n", status)
    h:close()
  end)

  it("ends a control line whose pcall outlasts the instruction limit: every instruction raises once it is hit",
     function()
    local srv = remote.listen(dir .. "/run", {instructions = 10000})
    finally(function() srv:close() end)
    local LIMIT = "error: attach:1: instruction limit exceeded (10000 instructions)"
    -- each pcall took the limit's one error and the loop went on: this one
    -- ended only because it counts to 100 (the next one never did)
    local UNDONE = "\n(what this line set, unset, paused or asked for before the error is undone)"
    assert.are.equal(LIMIT .. UNDONE, srv:run("pcall(set, {temperature = 0.5}) local n = 0 while n < 100 do " ..
                                              "n = n + 1 pcall(function() while true do end end) end return n"))
    assert.are.equal(LIMIT .. UNDONE,
                     srv:run("pcall(set,{temperature=0.5}); while true do pcall(function() while true do end end) end"))
    assert.are.same({}, srv.overrides)
    assert.matches("^applied from step nil: lr_scale = 2", srv:run("set{lr_scale = 2}"))   -- the next line runs as before
  end)

  it("writes a NUL byte of a reply as \\0 on both threads; a reply that cannot be queued is an error reply",
     function()
    local out = dir .. "/client.out"
    local srv, client = attached(dir .. "/run", out)
    -- the server thread, then the training thread (a control), then a query:
    -- the client waited forever for the second reply
    client:write("string.char(97, 0, 98)\nset{temperature = 0.5}; return string.char(97, 0, 98)\nprogress.step\n")
    local want = "a\\0b\na\\0b\n1\n"
    wait_for("the replies", function()
      srv:poll(1)
      return support.read_file(out) == want
    end)
    -- a reply the training thread cannot queue (here: a NUL that nothing
    -- escaped) is replaced by an error reply, and the client goes on
    srv.run = function() return "x\0y" end
    client:write("checkpoint()\nprogress.step\n")
    want = want .. "error: the reply could not be sent: moelua.attach.reply: argument #3 (text): " ..
           "contains a NUL byte\n1\n"
    wait_for("the error reply", function()
      srv:poll(1)
      return support.read_file(out) == want
    end)
  end)

  it("a line that ends in an error applies none of its controls, and says so", function()
    local out = dir .. "/client.out"
    local srv, client = attached(dir .. "/run", out)
    client:write("set{temperature = 0.5}; pause(); checkpoint(); set{noise = -1}\n")
    wait_for("the reply", function()
      srv:poll(1)
      return support.read_file(out):find("is undone)\n", 1, true)
    end)
    support.has(support.read_file(out), "set: noise must be")
    support.has(support.read_file(out),
                "\n(what this line set, unset, paused or asked for before the error is undone)\n")
    assert.are.same({}, srv.overrides)
    assert.are.same({}, srv.staged)
    assert.is_false(srv.paused)
    assert.is_falsy(srv.want_checkpoint)
  end)

  it("before the first step is logged, reading stats says so", function()
    local E = attach_env.new(pretty)
    assert.are.equal("error: attach:1: stats.max_share: no step has been logged yet (stats is the last logged " ..
                     "step's metrics; progress.step says where the job is)",
                     E.run("stats.max_share, stats.alarms", {}, {}, pcall))
    assert.are.equal("0.5", E.run("stats.max_share", {stats = {max_share = 0.5}}, {}, pcall))
  end)

  it("has no pattern matching in a request's string library (a pattern runs in C, past the instruction limit); " ..
     "find searches plainly", function()
    local E = attach_env.new(pretty)
    local function run(code) return E.run(code, {}, {}, pcall) end
    local WHY = "a pattern can run for hours in C, where the instruction limit cannot stop it"
    support.has(run('("abc"):match("b")'), "error: string.match is refused here: " .. WHY)
    support.has(run('string.gsub("abc", "b", "x")'), "error: string.gsub is refused here: " .. WHY)
    support.has(run('for w in ("a b"):gmatch("%a") do end'), "error: attach:1: string.gmatch is refused here")
    support.has(run('("a.b"):find(".")'), "error: string.find: the pattern '.' is refused here (" .. WHY .. ")")
    support.has(run('("a1.5"):find(1.5)'), "the pattern '1.5' is refused")
    -- plainly, and every other string function the real one
    assert.are.equal("2\n3\nnil\n2\n4", run('("a.b"):find(".", 1, true), string.find("abc", "c"), ' ..
                                                  '("abc"):find("x"), ("a1.5"):find(1.5, 1, true)'))
    assert.are.equal("x,x,x\n005\nABC\nbc\n97\nba\n3", run('("x"):rep(3, ","), ("%03d"):format(5), ' ..
                     '("abc"):upper(), ("abc"):sub(2), ("abc"):byte(1), string.reverse("ab"), #"abc"'))
    -- the other loops in C whose length the line chooses are bounded
    support.has(run('string.rep("", 1e10)'), "string.rep: 10000000000 repetitions is over the 16777216 allowed here")
    support.has(run('table.move({}, 1, 3e9, 1, {})'), "table.move: a range of 3000000000 elements is over")
    assert.are.equal("3", run('#table.move({1, 2, 3}, 1, 3, 1, {})'))
    -- the strings' methods are the real ones again after a line, whatever it did
    run('string.find = nil; ("a"):match("a")')
    assert.are.equal("b", ("abc"):match("b"))
    assert.are.equal(string, getmetatable("").__index)
    assert.are.equal("1\n1", run('("a"):find("a")'))

    -- the server thread, then the training thread (a line that calls a
    -- control): each replies at once, and close() does not wait on them
    local out = dir .. "/client.out"
    local srv, client = attached(dir .. "/run", out)
    client:write('string.rep("a", 20000):find(".-.-.-.-.-b")\n' ..
                 'set{temperature = 0.5}; return string.rep("a", 20000):find(".-.-.-.-.-b")\n')
    local refused = "error: string.find: the pattern '.-.-.-.-.-b' is refused here (" .. WHY ..
                    "); to search for it plainly: s:find(text, init, true)\n"
    local undone = "(what this line set, unset, paused or asked for before the error is undone)\n"
    wait_for("the replies", function()
      srv:poll(1)
      return support.read_file(out) == refused .. refused .. undone
    end)
    assert.are.same({}, srv.overrides)
  end)

  it("prints replies readably on both threads (nested, keys sorted, arrays inline, bounded); help() lists " ..
     "every control", function()
    local out = dir .. "/client.out"
    local srv, client = attached(dir .. "/run", out)
    -- the server thread: a nested table, a long array, a wide table
    client:write('{b = {y = {1, 2, 3}, x = "s"}, a = 1, [2] = true}\n' ..
                 'local t = {} for i = 1, 20000 do t[i] = i end return t\n' ..
                 'local t = {} for i = 1, 3000 do t["k" .. i] = {i} end return t\n' ..
                 'local t = {} t.self = t return t\n' ..
                 'string.rep("x", 300), {string.rep("y", 300)}\n' ..
                 -- the training thread (a control): the same printer
                 'set{noise = 0.25}; return {{1, {2}}, n = {m = {}}}\n' ..
                 'help()\n')
    local nested = '{[2] = true, a = 1, b = {x = "s", y = {1, 2, 3}}}\n'
    local first = {}
    for i = 1, 40 do first[i] = i end
    local array = "{" .. table.concat(first, ", ") .. ", ... (19960 more)}\n"
    local wide = {"{"}
    local keys = {}
    for i = 1, 3000 do keys[i] = "k" .. i end
    table.sort(keys)
    for i = 1, 40 do wide[#wide + 1] = "  " .. keys[i] .. " = {" .. keys[i]:sub(2) .. "}," end
    wide[#wide + 1] = "  ... (2960 more)\n}\n"
    local long = string.rep("x", 300) .. "\n" .. '{"' .. string.rep("y", 200) .. '"... (300 bytes)}\n'
    local control = "{{1, {2}}, n = {m = {}}}\n"
    local text = wait_for("the replies", function()
      srv:poll(1)
      local t = support.read_file(out)
      return t and t:find("Also: the base functions", 1, true) and t
    end)
    local want = nested .. array .. table.concat(wide, "\n") .. "{self = <cycle>}\n" .. long .. control
    assert.are.equal(want, text:sub(1, #want))
    local help = text:sub(#want + 1)
    for _, c in ipairs(attach_env.SETTABLE) do support.has(help, "    " .. c.name .. " ") end
    for _, f in ipairs({"stats", "ledger", "progress", "overrides", "staged", "set{", "unset(", "checkpoint()",
                        "pause()", "resume()", "help()"}) do
      support.has(help, f)
    end
    assert.is_nil(text:find("table: 0x", 1, true))
    assert.are.same({noise = 0.25}, srv.overrides)
  end)

  it("set{} takes every control of the hook, checked by name and range; unset() drops overrides; " ..
     "the reply says overrides outlive rollbacks", function()
    local srv = remote.listen(dir .. "/run", {steps = 10})
    finally(function() srv:close() end)
    srv:poll(3)                                           -- a step's start: applied at once
    local all = {temperature = 0.7, noise = 0.1, eps = 0.05, aux_weight = 0.02, z_weight = 0.001, lr_scale = 0.5}
    local reply = srv:run("set{temperature = 0.7, noise = 0.1, eps = 0.05, aux_weight = 0.02, " ..
                          "z_weight = 0.001, lr_scale = 0.5}")
    assert.are.equal("applied from step 3: aux_weight = 0.02, eps = 0.05, lr_scale = 0.5, noise = 0.1, " ..
                     "temperature = 0.7, z_weight = 0.001 (kept across rollbacks, not saved in checkpoints; " ..
                     'unset("aux_weight", "eps", "lr_scale", "noise", "temperature", "z_weight") drops them)',
                     reply)
    assert.are.same(all, srv.overrides)
    -- a wrong key, a negative or out-of-range value: an error reply naming it, nothing applied
    local bad = {
      {"set{temprature = 1}", "error: set: unknown control 'temprature' (one of temperature, noise, " ..
                              "eps, aux_weight, z_weight, lr_scale, capacity_factor)"},
      {"set{noise = -0.1}", "set: noise must be a finite number >= 0"},
      {"set{aux_weight = -1}", "set: aux_weight must be a finite number >= 0"},
      {"set{z_weight = -1e-3}", "set: z_weight must be a finite number >= 0"},
      {"set{eps = 1}", "set: eps must be a finite number in [0, 1)"},
      {"set{temperature = 0}", "set: temperature must be a finite number > 0"},
      {"set{lr_scale = 1/0}", "set: lr_scale must be a finite number >= 0"},
      {"set{temperature = '1'}", "set: temperature must be a finite number > 0 " ..
                                 "(changes combine weights, never which experts), got string \"1\""},
      {"set{temperature = false}", "set: temperature must be a finite number > 0"},
      {"set{noise = 0.2, eps = -1}", "set: eps must be a finite number in [0, 1)"},
      {"set{capacity_factor = 1.25}", 'set: capacity_factor applies only to a model with moe policy "drop"'},
      {"set(1)", "set: expected a table {name = value, ...}"},
      {"unset('temp')", "unset: unknown control 'temp'"},
    }
    for _, b in ipairs(bad) do support.has(srv:run(b[1]), b[2]) end
    assert.are.same(all, srv.overrides)
    -- capacity_factor with a drop-policy model
    local drop = remote.listen(dir .. "/run2", {policy = "drop"})
    finally(function() drop:close() end)
    drop:poll(0)
    assert.matches("^applied from step 0: capacity_factor = 1.25", drop:run("set{capacity_factor = 1.25}"))
    support.has(drop:run("set{capacity_factor = 0}"), "capacity_factor must be a finite number > 0")
    assert.are.same({capacity_factor = 1.25}, drop.overrides)
    -- the refusal names the job's policy: a model's default, or unknown without one
    local model = {opts = {moe_opts = {save = "save"}}}   -- what listen reads of an nn.Transformer
    local dropless = remote.listen(dir .. "/run3", {model = model})
    finally(function() dropless:close() end)
    dropless:poll(0)
    assert.are.equal('error: set: capacity_factor applies only to a model with moe policy "drop" ' ..
                     '(this job\'s: "dropless")', dropless:run("set{capacity_factor = 1.25}"))
    assert.are.equal('error: set: capacity_factor applies only to a model with moe policy "drop" ' ..
                     '(this job\'s: unknown: the job gave remote.listen no model or policy)',
                     srv:run("set{capacity_factor = 1.25}"))
    -- unset at a step's start: gone at once; inside a step: staged (false) until the next step's start
    assert.are.equal("unset from step 3: temperature (the recipe's hook sets them again)",
                     srv:run('unset("temperature")'))
    assert.is_nil(srv.overrides.temperature)
    srv:safe_point("forward", 1)
    assert.are.equal("unset from step 4: eps, noise (the recipe's hook sets them again)", srv:run('unset("noise", "eps")'))
    assert.are.same({noise = false, eps = false}, srv.staged)
    assert.are.equal(0.1, srv.overrides.noise)               -- this step keeps its settings
    assert.are.equal("false", srv:run("staged.noise"))
    srv:poll(4)
    assert.are.same({aux_weight = 0.02, z_weight = 0.001, lr_scale = 0.5}, srv.overrides)
    assert.are.same({}, srv.staged)
    assert.are.equal("unset from step 4: aux_weight, lr_scale, z_weight (the recipe's hook sets them again)",
                     srv:run("unset()"))
    assert.are.same({}, srv.overrides)
    assert.are.equal("no overrides to unset", srv:run("unset()"))
    assert.are.equal("no override of noise, temperature to unset", srv:run('unset("temperature", "noise")'))
  end)

  it("refuses a second job on a run directory a live job serves; a job removes only the socket it bound", function()
    local sock = dir .. "/attach/sock"
    local h1, h2, h3 = attach.listen(dir)
    finally(function()
      for _, h in ipairs({h1, h2, h3}) do h:close() end
    end)
    local function query(line)
      return support.finish_child(assert(io.popen("printf '%s\\n' " .. q(line) .. " | " ..
                                                  support.host_command({"attach", dir}) .. " 2>&1")))
    end
    assert.are.equal(1, support.errmsg(attach.listen, dir):find("moelua.attach.listen: another job serves " .. sock,
                                                                1, true))   -- no position: the socket is busy
    h1:publish('{"progress":{"step":5}}')
    assert.are.same({0, "5\n"}, {query("progress.step")})   -- still the first job's
    -- the socket replaced under h1 (removed, another listener bound there):
    -- closing h1 leaves the other job's socket
    assert(os.remove(sock))
    h2 = attach.listen(dir)
    h2:publish('{"progress":{"step":7}}')
    h1:close()
    assert.are.equal("600", mode_of(sock))
    assert.are.same({0, "7\n"}, {query("progress.step")})
    -- a socket left by a job that died (nobody accepts on it) is replaced
    assert(os.rename(sock, dir .. "/old"))
    h2:close()                                        -- not its socket any more
    assert.are.equal("600", mode_of(dir .. "/old"))
    assert(os.rename(dir .. "/old", sock))
    h3 = attach.listen(dir)
    h3:close()
    assert.is_nil(mode_of(sock))
  end)

  it("says so when no job listens", function()
    local code, out = support.finish_child(assert(io.popen(support.host_command({"attach", dir}) .. " 2>&1 </dev/null")))
    assert.are.equal(1, code)
    support.has(out, "no job in " .. dir .. " yet: waiting up to 5 s for one to start")
    support.has(out, "cannot connect to " .. dir .. "/attach/sock")
    -- the run's lock names a process that has ended: another job may be starting there
    support.write_file(dir .. "/lock", "999999999\n")
    code, out = support.finish_child(assert(io.popen(support.host_command({"attach", dir}) .. " 2>&1 </dev/null")))
    assert.are.equal(1, code)
    support.has(out, "the last job in " .. dir .. " has ended: waiting up to 5 s for another to start")
    support.has(out, "cannot connect to " .. dir .. "/attach/sock")
  end)

  it("a job that trains without --attach is said at once, not waited for", function()
    local run = dir .. "/plain"
    local cmd = support.host_command({"recipes/tiny.lua", "--steps", "400", "--seq-len", "64", "--threads", "1",
                                      "--run-dir", run, "--ckpt-every", "0"}) ..
                " >/dev/null 2>&1 & job=$!; " ..
                "while [ ! -s " .. q(run .. "/metrics.jsonl") .. " ]; do sleep 0.1; done; " ..
                support.host_command({"attach", run}) .. " </dev/null 2>&1; rc=$?; kill -INT $job; wait $job; exit $rc"
    local t0 = bench.now()
    local code, out = support.finish_child(assert(io.popen(cmd)))
    assert.are.equal(1, code, out)
    support.has(out, "moelua attach: the job in " .. run .. " (pid ")
    support.has(out, ") is training and listens on no socket: it was started without --attach")
    assert.is_true(bench.now() - t0 < 30, out)
  end)

  it("attached right after the job is started (`job --attach & moelua attach`): waits for its socket", function()
    local run = dir .. "/late"
    require("moelua.fs").mkdir_p(run)
    support.write_file(run .. "/lock", "999999999\n")   -- an earlier job's: this one takes it over
    local cmd = support.host_command({"recipes/tiny.lua", "--steps", "400", "--seq-len", "64", "--threads", "1",
                                      "--run-dir", run, "--ckpt-every", "0", "--attach"}) ..
                " >/dev/null 2>&1 & job=$!; echo '\"at\" .. \"tached\"' | " .. support.host_command({"attach", run}) ..
                " 2>&1; rc=$?; kill -INT $job; wait $job; exit $rc"
    local code, out = support.finish_child(assert(io.popen(cmd)))
    assert.are.equal(0, code, out)
    support.has(out, "attached")   -- the reply to the line (the job may not have taken a step yet)
  end)
end)
