-- moelua.host (host/bindings/l_host.c): hold_interrupts and interruptible.
-- In this process: their results, their errors (raised again unchanged) and
-- bad input. In children that send themselves SIGINT or SIGTERM inside a
-- hold: one signal is held (fn finishes, kernels and Lua run on, held == 1,
-- one line on stderr), a second aborts with status 130 and a line saying
-- so, holds nest, and outside a hold (also after a hold that failed) a
-- signal interrupts as before (interrupt_spec.lua); interruptible inside a
-- hold is cut short by a signal as outside one, and a signal held before it
-- stops it before it starts; take_interrupt clears a held signal; is_interrupt
-- tells the interrupt error from others.
local host = require "moelua.host"
local support = require "tests.support"
local errmsg = support.errmsg

local HELD = "moelua: interrupt held until the work in progress is done (a step's update, " ..
             "a checkpoint; interrupt again to abort and lose it)\n"
local ABORT = "moelua: second interrupt while the first is held: aborting, " ..
              "the checkpoint or step being finished is lost\n"

-- Every child starts with this: signal(name) sends the child the signal
-- through kill(1) (io.popen: os.execute's system() ignores SIGINT in the
-- caller while it waits) and gives the handler 0.1 s of Lua to run in;
-- work() runs a kernel and a Lua loop, which an unheld interrupt would stop.
local PRELUDE = [[
local host = require "moelua.host"
local moelua = require "moelua"
local pid = io.open("/proc/self/stat"):read("n")
local function spin(s) local t = os.clock() + s while os.clock() < t do end end
local function signal(name)
    io.popen("kill -" .. name .. " " .. math.tointeger(pid)):close()
    spin(0.1)
end
local function work()
    local s = moelua.matmul(moelua.ones({256, 256}), moelua.ones({256, 256})):sum():item()
    spin(0.05)
    return s
end
]]

-- Runs PRELUDE .. body in a child; returns its exit code, stdout, stderr.
local function child(body)
    local dir = support.make_tmpdir()
    local path, errf = dir .. "/child.lua", dir .. "/stderr"
    support.write_file(path, PRELUDE .. body)
    local p = assert(io.popen(support.host_command({path}) .. " 2>" .. support.shell_quote(errf), "r"))
    local code, out = support.finish_child(p)
    local err = support.read_file(errf) or ""
    support.remove_dir(dir)
    return code, out, err
end

describe("moelua.host.hold_interrupts in this process", function()
    it("returns 0 and fn's results, nils and all", function()
        local r = table.pack(host.hold_interrupts(function(a, b) return a, nil, b end, 1, "x"))
        assert.are.same({n = 4, 0, 1, nil, "x"}, r)
        assert.are.same({n = 1, 0}, table.pack(host.hold_interrupts(function() end)))
    end)

    it("raises fn's error again, unchanged, and nests", function()
        local obj = setmetatable({}, {__tostring = function() return "an object" end})
        local ok, err = pcall(host.hold_interrupts, function() error(obj) end)
        assert.is_false(ok)
        assert.are.equal(obj, err)
        ok, err = pcall(host.hold_interrupts, function() error("plain", 0) end)
        assert.are.equal("plain", err)
        local outer, inner, v = host.hold_interrupts(function()
            return host.hold_interrupts(function() return 7 end)
        end)
        assert.are.same({0, 0, 7}, {outer, inner, v})
    end)

    it("checks its argument", function()
        assert.matches("moelua%.host%.hold_interrupts: argument #1 %(fn%) must be a function, got no value",
                       errmsg(host.hold_interrupts))
        assert.matches("must be a function, got number", errmsg(host.hold_interrupts, 5))
    end)
end)

describe("moelua.host.interruptible in this process", function()
    it("is a plain call outside a hold and inside one: fn's results, fn's error unchanged", function()
        assert.are.same({n = 3, 1, nil, "x"},
                        table.pack(host.interruptible(function(a, b) return a, nil, b end, 1, "x")))
        local r = table.pack(host.hold_interrupts(host.interruptible, function(a) return a + 1 end, 1))
        assert.are.same({n = 2, 0, 2}, r)
        local obj = setmetatable({}, {__tostring = function() return "an object" end})
        local ok, err = pcall(host.hold_interrupts, host.interruptible, function() error(obj) end)
        assert.is_false(ok)
        assert.are.equal(obj, err)
        assert.are.equal("plain", select(2, pcall(host.interruptible, function() error("plain", 0) end)))
    end)

    it("checks its argument", function()
        assert.matches("moelua%.host%.interruptible: argument #1 %(fn%) must be a function, got no value",
                       errmsg(host.interruptible))
        assert.matches("must be a function, got table", errmsg(host.interruptible, {}))
    end)
end)

describe("moelua.host.hold_interrupts with signals", function()
    for _, sig in ipairs({"INT", "TERM"}) do
        it("holds one SIG" .. sig .. ": fn finishes, held == 1, the script runs on", function()
            local code, out, err = child(string.format([[
                local held, a, b = host.hold_interrupts(function(x)
                    signal(%q)
                    return x, work()
                end, 42)
                print("held", held, a, b)
                for _ = 1, 3 do work() end
                print("after")
            ]], sig))
            assert.are.equal(0, code, err)
            assert.are.equal("held\t1\t42\t16777216.0\nafter\n", out)
            assert.are.equal(HELD, err)
        end)

        it("aborts with status 130 at a second SIG" .. sig, function()
            local code, out, err = child(string.format([[
                io.stdout:setvbuf("no")
                host.hold_interrupts(function()
                    signal(%q)
                    print("one")
                    signal(%q)
                    print("two")
                end)
                print("after")
            ]], sig, sig))
            assert.are.equal(130, code)
            assert.are.equal("one\n", out)
            assert.are.equal(HELD .. ABORT, err)
        end)
    end

    it("nests: the inner hold counts its signal, which stays held for the outer one", function()
        local code, out, err = child([[
            io.stdout:setvbuf("no")
            local outer, inner = host.hold_interrupts(function()
                local n = host.hold_interrupts(signal, "INT")
                print("inner", n)
                return n
            end)
            print("outer", outer, inner)
            host.hold_interrupts(function()
                host.hold_interrupts(signal, "INT")
                print("second hold, one signal")
                signal("INT")
                print("not reached")
            end)
        ]])
        assert.are.equal(130, code)
        assert.are.equal("inner\t1\nouter\t1\t1\nsecond hold, one signal\n", out)
        assert.are.equal(HELD .. HELD .. ABORT, err)
    end)

    it("interruptible: a signal inside a hold stops fn as outside one; the hold goes on", function()
        local code, out, err = child([[
            io.stdout:setvbuf("no")
            local held, ok, e = host.hold_interrupts(function()
                local ok, e = pcall(host.interruptible, function()
                    signal("INT")
                    while true do work() end
                end)
                work()   -- held again: this runs whole
                return ok, e
            end)
            print("stopped", held, ok, e)
            print("outside", host.interruptible(work))
        ]])
        assert.are.equal(0, code, err)
        assert.matches("^stopped\t0\tfalse\t[^\n]*interrupted[^\n]*\noutside\t16777216.0\n$", out)
        assert.are.equal("", err)
    end)

    it("interruptible: a signal held before it stops fn before it starts, and is used up", function()
        local code, out, err = child([[
            io.stdout:setvbuf("no")
            local ran = false
            local held, ok, e = host.hold_interrupts(function()
                signal("TERM")
                local ok, e = pcall(host.interruptible, function() ran = true end)
                signal("TERM")   -- a new first signal, held: no abort
                return ok, e
            end)
            print("held", held, ok, e, ran)
        ]])
        assert.are.equal(0, code, err)
        assert.are.equal("held\t1\tfalse\tinterrupted!\tfalse\n", out)
        assert.are.equal(HELD .. HELD, err)
    end)

    it("take_interrupt: clears a held signal, so the next one is held, not an abort", function()
        local code, out, err = child([[
            io.stdout:setvbuf("no")
            print("outside", host.take_interrupt())
            local held, a, b, c = host.hold_interrupts(function()
                local none = host.take_interrupt()
                signal("INT")
                local taken = host.take_interrupt()
                signal("INT")   -- a first signal again
                return none, taken, work()
            end)
            print("held", held, a, b, c)
        ]])
        assert.are.equal(0, code, err)
        assert.are.equal("outside\tfalse\nheld\t1\tfalse\ttrue\t16777216.0\n", out)
        assert.are.equal(HELD .. HELD, err)
    end)

    it("is_interrupt: true for the interrupt error as raised, false for anything else", function()
        local code, out, err = child([[
            local ok, e = pcall(function() signal("INT") while true do end end)
            print(ok, host.is_interrupt(e), host.is_interrupt(e .. " (wrapped)"), host.is_interrupt("interrupted!"),
                  host.is_interrupt({}))
        ]])
        assert.are.equal(0, code, err)
        assert.are.equal("false\ttrue\tfalse\tfalse\tfalse\n", out)
    end)

    it("ends with fn's error, and a signal after it interrupts as before", function()
        local code, out, err = child([[
            local ok, e = pcall(host.hold_interrupts, function() signal("INT") error("save failed", 0) end)
            print("failed", ok, e)
            ok, e = pcall(function() signal("INT") while true do end end)
            print("interrupted", ok, e)
        ]])
        assert.are.equal(0, code, err)
        assert.matches("^failed\tfalse\tsave failed\ninterrupted\tfalse\t[^\n]*interrupted!\n$", out)
        assert.are.equal(HELD, err)
    end)
end)
