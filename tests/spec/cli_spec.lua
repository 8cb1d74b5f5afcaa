-- The moelua command line, driven as a child process: lua.c's options (-v,
-- -e, -l, -E, -W, -, --), the arg table, exit statuses, stdin as a script,
-- the module path from any directory, tracebacks for bugs and none for user
-- errors (unless --traceback), the usage message, --help with the recipes,
-- and the usage of the plot and attach subcommands.
-- The child is the binary running this spec (so `make sanitize` checks the
-- ASan build), read from /proc/<pid>/exe.

local support = require "tests.support"
local HOST = support.host_path()
local q, slurp, spit = support.shell_quote, support.read_file, support.write_file

local tmpdir
local function tmpfile(name, contents)
    local path = tmpdir .. "/" .. name
    spit(path, contents)
    return path
end

-- Runs `HOST <args>` (args: a list of words, quoted here) with optional
-- stdin text, a directory and environment assignments; returns the exit
-- code, stdout and stderr. A 60 s timeout keeps a hang from blocking the suite.
local function run(args, opts)
    opts = opts or {}
    local errf = tmpdir .. "/stderr"
    local stdin = "/dev/null"
    if opts.stdin then stdin = tmpfile("stdin", opts.stdin) end
    local cmd = string.format("%s%s %s <%s 2>%s",
                              opts.cd and ("cd " .. q(opts.cd) .. " && ") or "",
                              opts.env or "", support.host_command(args), q(stdin), q(errf))
    local code, out = support.finish_child(assert(io.popen(cmd, "r")))
    return code, out, slurp(errf) or ""
end

describe("moelua command line", function()
    setup(function() tmpdir = support.make_tmpdir() end)
    teardown(function() support.remove_dir(tmpdir) end)

    it("-v prints the version and exits 0", function()
        local code, out, err = run({"-v"})
        assert.are.equal(0, code)
        assert.matches("^moelua %d+%.%d+ %(Lua 5%.4%.%d+%)\n$", out)
        assert.are.equal("", err)
    end)

    it("-e runs each statement in order, in one state", function()
        local code, out = run({"-e", "x = 20", "-e", "print(x + 22)", "-ex = nil print(x)"})
        assert.are.equal(0, code)
        assert.are.equal("42\nnil\n", out)
    end)

    it("-l requires a module into a global, and -l g=mod names the global", function()
        local code, out, err = run({"-l", "moelua", "-lt=moelua.tensor",
                                    "-e", "print(moelua.zeros({2, 3}):numel(), t.ones({4}):numel())"})
        assert.are.equal(0, code, err)
        assert.are.equal("6\t4\n", out)
        code, _, err = run({"-l", "no.such.module"})
        assert.are.equal(1, code)
        assert.matches("module 'no.such.module' not found", err)
    end)

    it("builds arg like lua: script at 0, options at negative indices, args as ...", function()
        local script = tmpfile("args.lua", [[
            local t = {}
            for i = -3, #arg do t[#t + 1] = i .. "=" .. tostring(arg[i]) end
            print(table.concat(t, " "))
            print(select("#", ...), ...)
        ]])
        local code, out, err = run({"-e", "y=1", script, "a", "b c"})
        assert.are.equal(0, code, err)
        assert.are.equal(string.format("-3=%s -2=-e -1=y=1 0=%s 1=a 2=b c\n2\ta\tb c\n", HOST, script), out)
        -- no script: as in lua.c, the program is arg[0] and the options follow it
        code, out = run({"-e", "print(arg[0], arg[-1], arg[1], #arg)"})
        assert.are.equal(0, code)
        assert.are.equal(HOST .. "\tnil\t-e\t2\n", out)
        -- `--` ends the options: what follows is the script, even if it starts with '-'
        code, _, err = run({"--", "-e"})
        assert.are.equal(1, code)
        assert.matches("cannot open %-e", err)
    end)

    it("exits with the script's status", function()
        assert.are.equal(0, (run({"-e", "local x = 1"})))
        assert.are.equal(3, (run({"-e", "os.exit(3)"})))
        assert.are.equal(0, (run({"-e", "os.exit(true)"})))
        assert.are.equal(1, (run({"-e", "os.exit(false)"})))
        assert.are.equal(7, (run({"-e", "os.exit(7, true)"})))
        -- close = true runs the finalizers, so a live tensor is no leak
        local code, _, err = run({"-l", "moelua", "-e", "x = moelua.ones({1000}) os.exit(0, true)"})
        assert.are.equal(0, code, err)
        assert.are.equal("", err)
        local script = tmpfile("fail.lua", "error('bad thing')\n")
        code, _, err = run({script})
        assert.are.equal(1, code)
        assert.matches("bad thing", err)
        code, _, err = run({tmpdir .. "/missing.lua"})
        assert.are.equal(1, code)
        assert.matches("cannot open", err)
        code, _, err = run({tmpfile("syntax.lua", "x = = 1\n")})
        assert.are.equal(1, code)
        assert.matches("unexpected symbol near '='", err)
    end)

    it("prints a runtime error with a traceback through the script's functions", function()
        local script = tmpfile("deep.lua", "local function inner() error('deep trouble') end\n" ..
                                           "local function outer() inner() end\n" ..
                                           "outer()\n")
        local code, out, err = run({script})
        assert.are.equal(1, code)
        assert.are.equal("", out)
        assert.matches(":1: deep trouble\nstack traceback:\n", err)
        assert.matches("in upvalue 'inner'", err)
        assert.matches("in local 'outer'", err)
        assert.matches("in main chunk", err)
        -- a bug in a training hook keeps the traceback of where it was raised (the trainer catches
        -- a step's error and raises it again after its bookkeeping), once
        local recipe = tmpfile("bughook.lua", [[
local nn, optim, sched, data, train = require "moelua.nn", require "moelua.optim", require "moelua.sched",
                                      require "moelua.data", require "moelua.train"
local model = nn.Transformer.new{vocab = 256, dim = 16, layers = 1, heads = 2, kv_heads = 1, ffn = 24,
                                 experts = 4, topk = 2, seed = 0}
local ds = data.open{glob = "/usr/include/std*.h", seq_len = 32, seed = 0, holdout = 0.01}
local groups = model:param_groups{}
local function my_hook(step) if step == 1 then local x; return x.y end end
train.run{model = model, data = ds, optimizer = optim.AdamW(groups, {lr = 1e-3}), groups = groups,
          seq_len = 32, steps = 3, lr = sched.constant(1e-3), hook = my_hook}
]])
        code, _, err = run({recipe})
        assert.are.equal(1, code)
        assert.matches("bughook%.lua:7: attempt to index a nil value %(local 'x'%)\nstack traceback:\n" ..
                       "\t[^\n]*bughook%.lua:7: in ", err)
        local _, n = err:gsub("stack traceback:", "")
        assert.are.equal(1, n, err)
        -- a non-string error object is described, not lost
        code, _, err = run({"-e", "error({})"})
        assert.are.equal(1, code)
        assert.matches("%(error object is a table value%)", err)
    end)

    it("runs stdin as a script with - (args follow) and when stdin is not a terminal", function()
        local code, out, err = run({"-", "x", "y"}, {stdin = "print(arg[0], ...)\n"})
        assert.are.equal(0, code, err)
        assert.are.equal("-\tx\ty\n", out)
        code, out = run({}, {stdin = "print('piped', 6 * 7)\n"})
        assert.are.equal(0, code)
        assert.are.equal("piped\t42\n", out)
        code, _, err = run({"-"}, {stdin = "error('from stdin')\n"})
        assert.are.equal(1, code)
        assert.matches("stdin:1: from stdin", err)
        -- unlike lua.c, a failing stdin script is a failure without '-' too
        code = run({}, {stdin = "error('from stdin')\n"})
        assert.are.equal(1, code)
    end)

    it("-i after a script reads more statements (piped: no prompts, results printed)", function()
        local code, out, err = run({"-e", "z = 5", "-i"}, {stdin = "z * 2\nfunction f(a)\nreturn a + z\nend\n=f(1)\n"})
        assert.are.equal(0, code, err)
        assert.matches("^moelua [^\n]*\n10\n6\n$", out)
    end)

    it("finds require 'moelua' from another directory", function()
        local code, out, err = run({"-e", "print(require('moelua').zeros({2, 3}):numel())"}, {cd = "/tmp"})
        assert.are.equal(0, code, err)
        assert.are.equal("6\n", out)
    end)

    it("runs LUA_INIT first, and -E ignores it", function()
        local code, out = run({"-e", "print(init_ran)"}, {env = "LUA_INIT='init_ran = 1' "})
        assert.are.equal(0, code)
        assert.are.equal("1\n", out)
        code, out = run({"-E", "-e", "print(init_ran)"}, {env = "LUA_INIT='init_ran = 1' "})
        assert.are.equal(0, code)
        assert.are.equal("nil\n", out)
        code, out = run({"-e", "print(init_ran)"}, {env = "LUA_INIT_5_4='init_ran = 54' LUA_INIT='init_ran = 1' "})
        assert.are.equal("54\n", out)
        code, _, err = run({"-e", "print(1)"}, {env = "LUA_INIT='error(\"init failed\")' "})
        assert.are.equal(1, code)
        assert.matches("init failed", err)
    end)

    it("-W turns warnings on", function()
        local _, _, err = run({"-e", "warn('quiet')"})
        assert.are.equal("", err)
        local code
        code, _, err = run({"-W", "-e", "warn('loud')"})
        assert.are.equal(0, code)
        assert.matches("Lua warning: loud", err)
    end)

    it("prints the usage on a bad option and exits 1", function()
        local code, out, err = run({"-x"})
        assert.are.equal(1, code)
        assert.are.equal("", out)
        assert.matches("unrecognized option '%-x'", err)
        assert.matches("usage: .- %[options%] %[script %[args%]%]", err)
        assert.matches("%-e stat", err)
        code, _, err = run({"-e"})
        assert.are.equal(1, code)
        assert.matches("'%-e' needs argument", err)
        code, _, err = run({"-vx"})
        assert.are.equal(1, code)
        assert.matches("unrecognized option '%-vx'", err)
        code, _, err = run({"--x"})
        assert.are.equal(1, code)
        assert.matches("usage:", err)
    end)

    it("prints a user error as its message alone; --traceback and MOELUA_TRACEBACK=1 add the traceback", function()
        local raise = "require('moelua.errors').user('option --steps must be at least 1, got 0')"
        local code, out, err = run({"-e", raise})
        assert.are.equal(1, code)
        assert.are.equal("", out)
        assert.are.equal(HOST .. ": option --steps must be at least 1, got 0\n", err)
        -- any error object with __tostring is the user's message too
        code, _, err = run({"-e", "error(setmetatable({}, {__tostring = function() return 'told' end}))"})
        assert.are.equal(1, code)
        assert.are.equal(HOST .. ": told\n", err)
        -- raised from C (ml_user_error): a budget the machine cannot hold
        code, _, err = run({"-e", "require('moelua').mem.budget{total = 1e15}"})
        assert.are.equal(1, code)
        assert.matches("^[^\n]*: %(command line%):1: moelua%.mem%.budget: the total budget of [^\n]*\n$", err)
        for _, how in ipairs({{args = {"--traceback", "-e", raise}}, {args = {"-e", raise}, env = "MOELUA_TRACEBACK=1 "}}) do
            code, _, err = run(how.args, {env = how.env})
            assert.are.equal(1, code)
            assert.matches(": option %-%-steps must be at least 1, got 0\nstack traceback:\n", err)
            assert.matches("in function 'moelua%.errors%.user'", err)
        end
        -- a bug keeps its traceback whatever the option
        code, _, err = run({"-e", "error('a bug')"})
        assert.matches("a bug\nstack traceback:", err)
    end)

    it("--help and -h print the options, the subcommands and the recipes, and exit 0", function()
        local code, out, err = run({"--help"})
        assert.are.equal(0, code, err)
        assert.are.equal("", err)
        assert.matches("^usage: [^\n]* %[options%] %[script %[args%]%]\n", out)
        for _, part in ipairs({"-e stat", "-l g=mod", "--traceback", "MOELUA_TRACEBACK=1", "-h, --help",
                               "\n  plot RUN_DIR [OUT_DIR]  draw RUN_DIR/metrics.jsonl",
                               "\n  attach RUN_DIR          a Lua prompt inside the job"}) do
            assert(out:find(part, 1, true), "--help lacks " .. part)
        end
        -- every recipes/*.lua of the repository, with its header's first sentence
        local p = assert(io.popen("ls recipes/*.lua"))
        local n = 0
        for path in p:lines() do
            local name = path:match("[^/]+$")
            assert.matches("\n  " .. name:gsub("%p", "%%%0") .. " +%S", out)
            n = n + 1
        end
        p:close()
        assert.is_true(n >= 3)
        assert(out:find("\n  tiny.lua      recipes/longctx.lua at smoke-test size (seconds, not minutes).\n", 1, true), out)
        -- how to run one, with a path that works from anywhere
        local dir = out:match("Recipes %(run one as `[^`]- ([^`]+)/NAME`; with %-%-help it lists its options%):")
        assert.is_string(dir, out)
        assert.are.equal("/", dir:sub(1, 1))
        assert(io.open(dir .. "/tiny.lua")):close()
        assert.are.equal(out, select(2, run({"-h"})))
        -- --help does not run what follows it
        code, out = run({"--help", "-e", "print('ran')"})
        assert.are.equal(0, code)
        assert.not_matches("ran", out)
    end)

    it("--help finds the recipes next to MOELUA_LUA_DIR, sorted, each with its summary", function()
        assert(os.execute("mkdir -p " .. q(tmpdir .. "/bundle/lua") .. " " .. q(tmpdir .. "/bundle/recipes")))
        tmpfile("bundle/recipes/b.lua", "-- recipes/b.lua: the second. More text\n-- here.\nprint(1)\n")
        tmpfile("bundle/recipes/a.lua", "-- a.lua: a first recipe whose header runs on\n-- to a second line. Then more.\n")
        tmpfile("bundle/recipes/c.lua", "print('no header')\n")
        tmpfile("bundle/recipes/notes.txt", "-- not a recipe\n")
        local code, out, err = run({"--help"}, {env = "MOELUA_LUA_DIR=" .. q(tmpdir .. "/bundle/lua") .. " "})
        assert.are.equal(0, code, err)
        local recipes = out:match("\nRecipes [^\n]*\n(.*)$")
        assert.are.equal("  a.lua  a first recipe whose header runs on to a second line.\n" ..
                         "  b.lua  the second.\n" ..
                         "  c.lua\n", recipes)
        assert.matches("Recipes %(run one as `[^`\n]* [^\n]*/bundle/recipes/NAME`;", out)
    end)

    it("plot and attach print their usage with --help or -h and exit 0; attach alone exits 1", function()
        for _, sub in ipairs({"plot", "attach"}) do
            for _, opt in ipairs({"--help", "-h"}) do
                local code, out, err = run({sub, opt})
                assert.are.equal(0, code, err)
                assert.are.equal("", err)
                assert.matches("^usage: [^\n]*" .. sub .. " RUN_DIR", out)
            end
        end
        local code, out, err = run({"attach"})
        assert.are.equal(1, code)
        assert.are.equal("", out)
        assert.matches("^usage: [^\n]*attach RUN_DIR\n", err)
        code, out, err = run({"attach", "runs/x", "extra"})
        assert.are.equal(1, code)
        assert.matches("^[^\n]*: attach takes one run directory, got also 'extra'\nusage: ", err)
        code, out, err = run({"attach", "--bogus"})   -- named at once, no wait for a job in '--bogus'
        assert.are.equal(1, code)
        assert.matches("^[^\n]*: attach: unknown option '%-%-bogus'\nusage: ", err)
    end)
end)
