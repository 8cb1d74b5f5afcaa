-- The REPL (`moelua -i`) through a real terminal: util-linux `script` runs
-- the host on a pty, reads keystrokes from a FIFO and copies the screen
-- into a typescript file (flushed per write), which the spec polls with a
-- deadline. \3 is Ctrl-C (the pty turns it into SIGINT), \4 is Ctrl-D, \16
-- is Ctrl-P (previous history line). The host is the binary running this
-- spec (/proc/<pid>/exe). HOME is a temp dir, so the history is the spec's.

local system = require "system"
local support = require "tests.support"

local HOST = support.host_path()
local q, slurp = support.shell_quote, support.read_file

local tmpdir, home
local nsessions = 0

-- A REPL on a pty (support.pty): s:send(keys), s:expect(pattern [, plain]),
-- s:prompt(), s:line(text) -> its output up to the next prompt, s:finish().
local function start()
    nsessions = nsessions + 1
    local s = support.pty(string.format("%s/s%d", tmpdir, nsessions), q(HOST) .. " -i", "HOME=" .. q(home))
    function s.prompt(self) return self:expect("\n> ", true) end
    function s.line(self, text)
        self:send(text .. "\n")
        return self:prompt()
    end
    return s
end

describe("the REPL on a terminal", function()
    setup(function()
        assert(os.execute("command -v script >/dev/null && command -v timeout >/dev/null"),
               "the REPL spec needs util-linux `script` and coreutils `timeout`")
        tmpdir = support.make_tmpdir()
        home = tmpdir .. "/home"
        assert(os.execute("mkdir -p " .. q(home)))
    end)
    teardown(function() support.remove_dir(tmpdir) end)

    it("prints results, reads multi-line chunks, shows errors with a traceback and goes on", function()
        local s = start()
        s:expect("moelua 0%.%d+ %(Lua 5%.4[^\n]*\n> ")
        assert.matches("\n2\r\n", s:line("1 + 1"))
        assert.matches("\n1\ttwo\tnil\r\n", s:line("1, 'two', nil"))
        s:line("m = require 'moelua'")
        local shown = s:line("m.ones({2, 3}) * 2")
        assert.truthy(shown:find("tensor([2,3], f32, cpu", 1, true), shown)
        assert.truthy(shown:find("min 2 mean 2 max 2", 1, true), shown)
        -- a chunk that ends in <eof> waits for more lines at the >> prompt
        s:send("function f(x)\n")
        s:expect("\n>> ", true)
        s:send("return x * 2\n")
        s:expect("\n>> ", true)
        s:line("end")
        assert.matches("\n42\r\n", s:line("f(21)"))
        assert.matches("\n8\r\n", s:line("=f(4)"))  -- lua.c's '=' prefix
        -- errors: message, traceback, and the next line still runs
        s:line("function g() error('boom') end")
        local err = s:line("g()")
        assert.matches("stdin:1: boom\r\nstack traceback:\r\n", err)
        assert.matches("in function 'g'", err)
        assert.matches("unexpected symbol near '='", s:line("x = = 1"))
        assert.matches("\n5\r\n", s:line("2 + 3"))
        local status = s:finish()
        assert.are.equal(0, status)  -- also: the ledger was empty at exit
    end)

    it("prints tables nested, sorted and bounded (never table: 0x...); help() lists what can be called", function()
        local s = start()
        s:prompt()
        assert.matches('\n{%[2%] = true, a = 1, b = {x = "s", y = {1, 2, 3}}}\r\n',
                       s:line('{b = {y = {1, 2, 3}, x = "s"}, a = 1, [2] = true}'))
        -- a wide table: one entry a line, indented
        local wide = s:line('{alpha = {1, 2, 3}, beta = {gamma = {delta = "a fairly long string value here"}}, ' ..
                            'epsilon = "another long string"}')
        assert.truthy(wide:find('{\r\n  alpha = {1, 2, 3},\r\n  beta = {gamma = {delta = "a fairly long ' ..
                                'string value here"}},\r\n  epsilon = "another long string"\r\n}\r\n', 1, true), wide)
        -- huge: 40 items a table, then a count; deep: cut with its size; a cycle
        s:line("big = {} for i = 1, 1000000 do big[i] = i end")
        local huge = s:line("big")
        assert.truthy(huge:find("{1, 2, 3, ", 1, true) and huge:find(", 40, ... (999960 more)}\r\n", 1, true), huge)
        assert.is_true(#huge < 400, huge)
        assert.truthy(s:line("{{{{{{{{1}}}}}}}}"):find("{{{{{{{... 1 entry}}}}}}}", 1, true))
        assert.truthy(s:line("c = {} c.me = c return c"):find("{me = <cycle>}", 1, true))
        assert.truthy(s:line("{('x'):rep(1000)}"):find('"... (1000 bytes)}', 1, true))
        -- a tensor inside a table keeps its own __tostring
        local t = s:line("{w = require('moelua').ones({2, 2})}")
        assert.truthy(t:find("{w = tensor([2,2], f32, cpu", 1, true), t)
        assert.is_nil((wide .. huge .. t):find("table: 0x", 1, true))
        local help = s:line("help()")
        for _, f in ipairs({"inspect.summary(r)", "inspect.compare(r1, r2, layer)", "inspect.loads(run_dir",
                            "h:generate(", "inspect.open(", "m.mem.report()", "train.run{", "moelua attach"}) do
            assert.truthy(help:find(f, 1, true), f .. " in " .. help)
        end
        s:line("big = nil")
        assert.are.equal(0, (s:finish()))
    end)

    it("Ctrl-C at the prompt discards the line being typed and prompts again", function()
        local s = start()
        s:prompt()
        s:send("12")
        s:expect("12", true)  -- echoed: readline has the keys
        s:send("\3")
        s:prompt()
        assert.matches("\n7\r\n", s:line("3 + 4"))  -- not 123 + 4
        s:send("\3")  -- at an empty prompt
        s:prompt()
        assert.matches("\n1042\r\n", s:line("6 * 7 + 1000"))
        s:send("function h()\n")  -- in a continuation: the whole chunk goes
        s:expect("\n>> ", true)
        s:send("\3")
        s:prompt()
        assert.matches("\nnil\r\n", s:line("h"))
        assert.are.equal(0, (s:finish()))
    end)

    it("Ctrl-C interrupts a running computation, in a kernel or in Lua, and the REPL computes again", function()
        local s = start()
        s:prompt()
        s:line("m = require 'moelua'")
        s:line("a = m.rand({50, 16, 2048}, {dtype = 'f64'}) b = m.rand({2048, 2048}, {dtype = 'f64'})")
        -- ~100 f64 GEMMs of ~0.1 s each: seconds of work, nearly all in the kernel
        s:send("io.write('gemm' .. 'ing\\n') for i = 1, 100 do c = m.matmul(a, b) end\n")
        s:expect("\ngemming\r\n", true)
        system.sleep(0.1)  -- past io.write, into the loop (it runs for seconds)
        s:send("\3")
        local out = s:prompt()
        assert.matches("moelua%.matmul: interrupted\r\n", out)   -- a user error: no traceback
        assert.matches("\n8%.0\r\n", s:line("m.ones({4}):add(1):sum():item()"))
        assert.matches("\n18%.0\r\n", s:line("m.matmul(m.ones({3, 2}), m.ones({2, 3})):sum():item()"))
        -- Lua code: the hook raises
        s:send("io.write('spin' .. 'ning\\n') while true do end\n")
        s:expect("\nspinning\r\n", true)
        s:send("\3")
        assert.matches("interrupted!\r\n", s:prompt())
        assert.matches("\n6\r\n", s:line("2 * 3"))
        s:line("a, b, c = nil")
        assert.are.equal(0, (s:finish()))
    end)

    it("saves the history in ~/.moelua_history for the next session", function()
        os.remove(home .. "/.moelua_history")
        local s = start()
        s:prompt()
        s:send("function twice(x)\n")
        s:expect("\n>> ", true)
        s:line("return 2 * x end")
        s:line("'hist' .. 'ory'")
        assert.are.equal(0, (s:finish()))
        local saved = slurp(home .. "/.moelua_history")
        assert.truthy(saved, "no history file")
        assert.truthy(saved:find("'hist' .. 'ory'", 1, true), saved)
        assert.truthy(saved:find("function twice(x)\nreturn 2 * x end", 1, true), saved)
        -- a new session recalls the last line (Ctrl-P), then the multi-line
        -- chunk before it as one entry
        s = start()
        s:prompt()
        assert.matches("\nhistory\r\n", s:line("\16"))
        s:send("\16\16\16\n")  -- up past the line just run, to the chunk
        s:prompt()
        assert.matches("\n14\r\n", s:line("twice(7)"))
        assert.are.equal(0, (s:finish()))
    end)
end)
