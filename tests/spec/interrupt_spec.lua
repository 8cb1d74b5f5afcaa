-- Ctrl-C without a terminal: a child moelua gets SIGINT (kill -INT) while it
-- computes. Inside a kernel, the kernel stops between tiles and the binding
-- raises "<fn>: interrupted" after its parallel region; in Lua code, the
-- hook raises "interrupted!". Uncaught, the script fails with status 1;
-- caught with pcall, the same host computes again and ends with an empty
-- ledger (the exit status checks it). The REPL side is repl_spec.lua.

local support = require "tests.support"

-- Every child starts with this: unbuffered output, its pid on line 1, and
-- ready() to say that the long computation starts now.
local PRELUDE = [[
io.stdout:setvbuf("no")
local moelua = require "moelua"
print(io.open("/proc/self/stat"):read("n"))
local function ready() io.write("ready\n") end
-- f64 GEMMs of ~0.1 s each on two cores: 100 of them run far longer than
-- the test waits, and nearly all the time is spent inside the kernel.
local function gemm_loop()
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

describe("Ctrl-C (SIGINT) without a terminal", function()
    it("stops a kernel between tiles and fails the script with status 1", function()
        local code, out = interrupt_child([[
            gemm_loop()
            print("finished")
        ]])
        assert.are.equal(1, code)
        assert.matches("moelua%.matmul: interrupted\nstack traceback:", out)
        assert.not_matches("finished", out)
        assert.not_matches("leak", out)
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
        assert.matches("interrupted!\nstack traceback:", out)
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
end)
