-- `moelua attach RUN_DIR` against a real tiny training started with
-- --attach: the client (fed from a pipe) pauses the job, reads stats,
-- changes the temperature (seen in metrics.jsonl for the later steps), has
-- an endless loop cut off with an error reply, detaches; the job finishes.
-- Also: the socket directory's mode, bad arguments of moelua.attach, the
-- sun_path limit, and a client with no job.
local attach = require "moelua.attach"
local json = require "dkjson"
local system = require "system"
local support = require "tests.support"

local function mode_of(path)
  local p = assert(io.popen("stat -c %a " .. support.shell_quote(path)))
  local m = p:read("l")
  p:close()
  return m
end

describe("moelua attach", function()
  local dir
  before_each(function() dir = support.make_tmpdir() end)
  after_each(function() support.remove_dir(dir) end)

  it("reads stats, changes the temperature, survives an endless loop, and the job finishes", function()
    local run = dir .. "/run"
    local job = assert(io.popen(support.host_command({"recipes/tiny.lua", "--steps", "400", "--seq-len", "64",
                                                      "--run-dir", run, "--ckpt-every", "0", "--attach"}) ..
                                " 2>&1"))
    for _ = 1, 200 do
      if mode_of(run .. "/attach/sock") then break end
      system.sleep(0.02)
    end
    assert.are.equal("700", mode_of(run .. "/attach"))
    local lines = table.concat({
      "pause()", "progress.step", "stats.loss", "set{temperature = 0.5}", "while true do end",
      "progress.paused", "set{temperature = -1}", "checkpoint()", "resume()", ""}, "\n")
    local input = dir .. "/input"
    support.write_file(input, lines)
    local code, out = support.finish_child(assert(io.popen(
      support.host_command({"attach", run}) .. " < " .. support.shell_quote(input) .. " 2>&1")))
    assert.are.equal(0, code, out)
    local replies = {}
    for l in out:gmatch("[^\n]+") do replies[#replies + 1] = l end
    local at = tonumber(replies[1]:match("^paused at step (%d+)$"))
    assert.is_not_nil(at, out)
    assert.are.equal(at, tonumber(replies[2]), out)
    assert.is_not_nil(tonumber(replies[3]), out)               -- stats: the last step's loss
    assert.are.equal("applied from step " .. at, replies[4])
    support.has(replies[5], "error: attach:1: instruction limit exceeded")
    assert.are.equal("true", replies[6])                        -- the job answered after the loop
    support.has(replies[7], "set: temperature must be a finite number > 0")
    assert.are.equal("a checkpoint will be saved after step " .. at, replies[8])
    assert.are.equal("resumed", replies[9])

    local jcode, jout = support.finish_child(job)
    assert.are.equal(0, jcode, jout)
    assert.truthy(jout:find("checkpoint: " .. run, 1, true), jout)
    local temps, n, asked = {}, 0, nil
    for l in io.lines(run .. "/metrics.jsonl") do
      local m = json.decode(l)
      if m.step and not m.event then
        temps[m.step] = m.temperature
        n = n + 1
      elseif m.event == "checkpoint" and m.reason == "attach" then
        asked = m.step
      end
    end
    assert.are.equal(at, asked, "the requested checkpoint was saved after the paused step")
    assert.are.equal(400, n)
    for s = 0, 399 do assert.are.equal(s < at and 1.0 or 0.5, temps[s], "step " .. s) end
    assert.is_nil(mode_of(run .. "/attach/sock"))               -- removed at the end
  end)

  it("checks its arguments and the socket path limit", function()
    support.has(support.errmsg(attach.listen, true), "string expected")
    support.has(support.errmsg(attach.listen, dir .. "/" .. string.rep("x", 120)),
                "over the 107-byte limit of a Unix socket address")
    local h = attach.listen(dir)
    assert.are.equal("700", mode_of(dir .. "/attach"))
    local reqs, n = h:poll()
    assert.are.same({}, reqs)
    assert.are.equal(0, n)
    support.has(support.errmsg(attach.poll, "x"), "moelua.attach.poll: argument #1: expected an attach handle")
    support.has(support.errmsg(h.poll, h, -1), "argument #2 (timeout_ms)")
    support.has(support.errmsg(attach.reply, h, "x", "t"), "number expected")
    assert.is_false(h:reply(7, "nobody"))
    h:close()
    h:close()                                                   -- idempotent
    support.has(support.errmsg(h.poll, h), "the attach handle is closed")
  end)

  it("says so when no job listens", function()
    local code, out = support.finish_child(assert(io.popen(support.host_command({"attach", dir}) .. " 2>&1 </dev/null")))
    assert.are.equal(1, code)
    support.has(out, "cannot connect to " .. dir .. "/attach/sock")
  end)
end)
