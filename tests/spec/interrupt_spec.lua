-- Ctrl-C without a terminal: a child moelua gets SIGINT (kill -INT) while it
-- computes. Inside a kernel, the kernel stops between tiles and the binding
-- raises "<fn>: interrupted" after its parallel region; in Lua code, the
-- hook raises "interrupted!". Uncaught, the script fails with status 1 and
-- the message alone (Ctrl-C is the user's doing: no traceback unless
-- --traceback); caught with pcall, the same host computes again, a later
-- Ctrl-C interrupts again, and it ends with an empty ledger (the exit status
-- checks it). A second signal while the first is still pending (C code that
-- does not poll) kills the process and says so. The REPL side is
-- repl_spec.lua; holds (moelua.host.hold_interrupts) are host_spec.lua.

local support = require "tests.support"

-- Every child starts with this: unbuffered output, its pid on line 1, and
-- ready() to say that the long computation starts now.
local PRELUDE = [[
io.stdout:setvbuf("no")
local moelua = require "moelua"
print(io.open("/proc/self/stat"):read("n"))
local function ready() io.write("ready\n") end
-- f64 GEMMs of ~0.25 s each on one thread: 100 of them run far longer
-- than the test waits, and nearly all the time is spent inside the kernel
-- (on many threads a GEMM is short beside the allocation between two,
-- where the hook and not the kernel sees the signal).
local function gemm_loop()
    moelua.threads(1)
    local a = moelua.rand({50, 16, 2048}, {dtype = "f64"})
    local b = moelua.rand({2048, 2048}, {dtype = "f64"})
    ready()
    for _ = 1, 100 do local c = moelua.matmul(a, b) end
end
]]

-- Runs PRELUDE and body in a child, sends SIGINT once it is ready, and
-- returns the exit code and everything it printed (stdout and stderr).
-- After "ready" the child is microseconds from its loop, but may still be
-- inside io.write, where the hook and not a kernel would see the signal.
-- The loop runs for seconds; 0.1 s puts the signal well inside it.
local function interrupt_child(body)
    return support.interrupt_child(PRELUDE .. body, 0.1)
end

-- Runs PRELUDE and body in a child (host options first) and sends it the
-- signals of `plan` in order: each {sig, delay}, after reading up to one
-- more "ready" line when `ready` is set. Returns the exit code and the
-- output (the lines read while waiting included, "ready" lines left out).
local function signal_child(body, plan, options)
    local path = os.tmpname()
    support.write_file(path, PRELUDE .. body)
    local args = {}
    for _, o in ipairs(options or {}) do args[#args + 1] = o end
    args[#args + 1] = path
    local p = assert(io.popen(support.host_command(args) .. " 2>&1", "r"))
    local pid = assert(p:read("n"), "the child printed no pid")
    p:read("l")
    local seen = {}
    for _, step in ipairs(plan) do
        while step.ready do
            local line = assert(p:read("l"), "the child ended before it was ready")
            if line == "ready" then break end
            seen[#seen + 1] = line .. "\n"
        end
        require("system").sleep(step.delay)
        assert(os.execute("kill -" .. step.sig .. " " .. math.tointeger(pid)))
    end
    local code, out = support.finish_child(p)
    os.remove(path)
    return code, table.concat(seen) .. out
end

-- A pattern match that backtracks for far longer than any test waits: C
-- code that no hook and no flag can stop.
local STUCK = [[
    ready()
    string.find(("a"):rep(60), ("a-"):rep(14) .. "b")
    print("finished")
]]

describe("Ctrl-C (SIGINT) without a terminal", function()
    it("stops a kernel between tiles and fails the script with status 1", function()
        local code, out = interrupt_child([[
            gemm_loop()
            print("finished")
        ]])
        assert.are.equal(1, code)
        assert.matches(": moelua%.matmul: interrupted\n$", out)
        assert.not_matches(":%d+: ", out)   -- no position: Ctrl-C, not a line, stopped it
        assert.not_matches("stack traceback", out)
        assert.not_matches("finished", out)
        assert.not_matches("leak", out)
    end)

    it("stops one large GEMM between its blocks of rows, not after it", function()
        -- one product of 2 x 12000 x 2048 x 2048 = 100 GFLOP, in 4 blocks: the kernel itself says
        -- it was interrupted (after the call, the hook would raise "interrupted!"); on one thread,
        -- so that it lasts well past the signal on a machine of many cores too (0.5 s at 200 GFLOP/s)
        local code, out = interrupt_child([[
            moelua.threads(1)
            local a = moelua.rand({12000, 2048})
            local b = moelua.rand({2048, 2048})
            ready()
            print(pcall(moelua.matmul, a, b))
        ]])
        assert.are.equal(0, code, out)
        assert.matches("false\tmoelua%.matmul: interrupted\n", out)
    end)

    it("leaves a host that computes again when the script catches it mid-kernel", function()
        local code, out = interrupt_child([[
            local ok, err = pcall(gemm_loop)
            print("caught", ok, err)
            -- the flag was consumed: big tiled kernels, BLAS and Lua run again
            local n = 1 << 22
            local s = moelua.ones({n}):add(1):sum():item()
            local m = moelua.matmul(moelua.ones({2, 3}), moelua.ones({3, 2})):sum():item()
            local k = 0
            for i = 1, 1000000 do k = k + 1 end
            print(string.format("computed again %d %d %d", s, m, k))
        ]])
        assert.are.equal(0, code, out)  -- 0 also means: the ledger was empty at exit
        assert.matches("caught\tfalse\t[^\n]*moelua%.matmul: interrupted\n", out)
        assert.matches("computed again 8388608 12 1000000\n", out)
    end)

    it("interrupts Lua code through the hook, and a caught hook error computes again", function()
        local code, out = interrupt_child([[
            ready()
            while true do end
        ]])
        assert.are.equal(1, code)
        assert.matches(": interrupted!\n$", out)
        assert.not_matches(":%d+: ", out)
        assert.not_matches("stack traceback", out)
        code, out = interrupt_child([[
            local ok, err = pcall(function() ready() while true do end end)
            print("caught", ok, err)
            print("again", moelua.ones({1 << 20}):sum():item() == 1 << 20)
        ]])
        assert.are.equal(0, code, out)
        assert.matches("caught\tfalse\t[^\n]*interrupted!\n", out)
        assert.matches("again\ttrue\n", out)
    end)

    it("interrupts a loop of elementwise kernels", function()
        local code, out = interrupt_child([[
            local x = moelua.ones({1 << 22})
            local ok, err = pcall(function()
                ready()
                for _ = 1, 100000 do x:mul_(1.0) x:add_(0.0) end
            end)
            print("caught", ok, err)
            print("again", x:sum():item() == 1 << 22)
        ]])
        assert.are.equal(0, code, out)
        assert.matches("caught\tfalse\t[^\n]*interrupted", out)
        assert.matches("again\ttrue\n", out)
    end)

    it("prints the traceback of an uncaught interrupt with --traceback", function()
        local code, out = signal_child("gemm_loop()", {{sig = "INT", delay = 0.1, ready = true}},
                                       {"--traceback"})
        assert.are.equal(1, code)
        assert.matches("moelua%.matmul: interrupted\nstack traceback:", out)
        assert.matches("in local 'gemm_loop'", out)
    end)

    it("interrupts again after a caught interrupt (SIGTERM too)", function()
        local code, out = signal_child([[
            for i = 1, 2 do
                local ok, err = pcall(function() ready() while true do end end)
                print("caught", i, err)
            end
            print("done")
        ]], {{sig = "INT", delay = 0.1, ready = true}, {sig = "TERM", delay = 0.1, ready = true}})
        assert.are.equal(0, code, out)
        assert.matches("caught\t1\t[^\n]*interrupted!\ncaught\t2\t[^\n]*interrupted!\ndone\n", out)
    end)

    it("kills the process, saying so, at a second signal while the first is pending", function()
        local code, out = signal_child(STUCK, {{sig = "INT", delay = 0.1, ready = true},
                                               {sig = "INT", delay = 0.2}})
        assert.are.equal(130, code)   -- killed by SIGINT
        assert.matches("moelua: second interrupt before the first was handled %(a C call that " ..
                       "does not stop%): killing the process\n", out)
        assert.not_matches("finished", out)
        code, out = signal_child(STUCK, {{sig = "TERM", delay = 0.1, ready = true},
                                         {sig = "TERM", delay = 0.2}})
        assert.are.equal(143, code)   -- killed by SIGTERM
        assert.matches("moelua: second interrupt before the first was handled", out)
    end)
end)
