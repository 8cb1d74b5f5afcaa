-- moelua.options (lua/moelua/options.lua): recipe options, parsed and
-- checked, and the --device checks every recipe shares. Errors are user
-- errors: their text names the option and the value.
local m = require "moelua"
local options = require "moelua.options"
local support = require "tests.support"

local SPEC = {{"steps", 5, "optimizer steps", min = 1}, {"device", "cpu", "cpu or cuda"}}

describe("moelua.options", function()
  it("parses values of the defaults' types and checks bounds", function()
    local o, given = options.parse({"--steps", "7"}, SPEC, "usage")
    assert.are.equal(7, o.steps)
    assert.are.equal("cpu", o.device)
    assert.are.same({steps = true}, given)   -- what the command line gave, not the defaults
    o, given = options.parse({"--device=cpu", "--steps", "5"}, SPEC, "usage")
    assert.are.same({steps = true, device = true}, given)
    options.refuse_unused(given, {{"steps", false, "never"}})   -- given, but used
    support.raises("--device: unused here", options.refuse_unused, given, {{"device", true, "unused here"}})
    support.raises("option --steps must be at least 1, got 0", options.parse, {"--steps", "0"}, SPEC, "usage")
    support.raises("option --device needs a value", options.parse, {"--device"}, SPEC, "usage")
    local open = {{"eps", 0.05, "a share", min = 0, below = 1}, {"zero", 0, "a stage", min = 0, max = 3}}
    assert.are.equal(0.5, options.parse({"--eps", "0.5"}, open, "usage").eps)
    assert.are.equal(3, options.parse({"--zero", "3"}, open, "usage").zero)
    support.raises("option --eps must be below 1, got 1", options.parse, {"--eps", "1"}, open, "usage")
    support.raises("option --zero must be at most 3, got 4", options.parse, {"--zero", "4"}, open, "usage")
    local out = {}
    options.help(open, {write = function(_, text) out[#out + 1] = text end})
    assert.matches("a share %(0%.%.<1%)", table.concat(out))
    assert.matches("a stage %(0%.%.3%)", table.concat(out))
    local pick = {{"save", "recompute", "pre-activations", choices = {"save", "recompute"}}}
    assert.are.equal("save", options.parse({"--save", "save"}, pick, "usage").save)
    support.raises("option --save must be one of save, recompute, got 'bogus'", options.parse, {"--save", "bogus"},
                   pick, "usage")
    -- a boolean option: bare, a word or a digit; options.boolean is the one reading of it (moelua plan's too)
    local flag = {{"offload", false, "offload"}, {"steps", 5, "steps"}}
    assert.is_true(options.parse({"--offload", "--steps", "2"}, flag, "usage").offload)
    assert.is_false(options.parse({"--offload=0"}, flag, "usage").offload)
    assert.is_true(options.parse({"--offload", "1"}, flag, "usage").offload)
    support.raises("option --offload expects true or false, got 'yes'", options.parse, {"--offload", "yes"}, flag,
                   "usage")
    assert.are.same({true, true, false, false}, {options.boolean("true"), options.boolean("1"),
                                                 options.boolean("false"), options.boolean("0")})
    assert.is_nil(options.boolean("yes"))
    assert.is_nil(options.boolean(""))
    support.raises("option --help takes no value, got '--help=false'", options.parse, {"--help=false"}, flag)
    support.raises("unexpected argument '4' (options are --name value)", options.parse, {"--steps", "3", "4"}, flag)
    support.raises("unexpected argument 'tests/support.lua' (options are --name value; an unquoted glob is expanded " ..
                   "by the shell into many arguments: quote it)", options.parse,
                   {"--steps", "tests/spec/options_spec.lua", "tests/support.lua"}, {{"steps", "", "a path"}})
    -- a script without options (recipes/demo.lua) still refuses one, and says it takes none
    support.raises("unknown option --bogus (this script takes no options)", options.parse, {"--bogus"}, {}, "usage")
    assert.are.same({}, options.parse({}, {}, "usage"))
    out = {}
    options.help({}, {write = function(_, text) out[#out + 1] = text end})
    assert.are.equal("options: none\n", table.concat(out))
  end)

  it("refuses a recipe's own spec that is wrong, at the recipe's line, before reading the command line", function()
    local function refused(spec, msg) support.has(support.errmsg(options.parse, {}, spec, "usage"), msg) end
    local P = "moelua.options.parse: "
    refused({{"steps", 20, "steps", mn = 1}}, P .. "spec[1] (--steps): unknown key 'mn' (min, max, below, choices)")
    refused({{"steps", 20, "steps", min = "x"}}, P .. "spec[1] (--steps): min must be a number")
    refused({{"steps", 0, "steps", min = 1}}, P .. "spec[1] (--steps): the default 0 is outside its own bounds")
    refused({{"mode", "a", "m", choices = {"x", "y"}}}, P .. "spec[1] (--mode): the default 'a' is not one of its " ..
                                                       "choices")
    refused({{"n", 1, "n"}, {"n", 5, "again"}}, P .. "spec[2] (--n): declared twice")
    refused({{"mode", "a", "m", min = 1}}, P .. "spec[1] (--mode): min, max and below bound numbers")
    refused({{"lr", {}, "lr"}}, P .. "spec[1] (--lr): the default must be a number, a string or a boolean, got table")
    refused({"steps"}, P .. "spec[1]: expected {name, default, help}")
    support.has(support.errmsg(options.parse, {"--steps", "3"}), P .. "argument #2 (spec): expected a list of " ..
                "{name, default, help}, got nil")
    support.has(support.errmsg(options.parse, nil, SPEC),
                P .. "argument #1 (argv): expected the script's arg table, got nil")
    support.has(support.errmsg(options.refuse_unused, {}, {"steps", true, "why"}),
                "moelua.options.refuse_unused: rules[1]: expected {name, unused, why}")
  end)

  it("checks a Lua API's options table by kind, with defaults (options.check)", function()
    local spec = {n = {"integer", min = 1}, rate = {"number", 0.5, min = 0}, name = {"string", false},
                  on = {"boolean", false}, ck = {"string|table", "none"}}
    local function fail(fmt, ...) error("api: " .. fmt:format(...), 0) end
    local function check(o, prefix) return options.check(o, spec, fail, prefix) end
    assert.are.same({n = 16, rate = 0.5, on = false, ck = "none"}, check{n = 2 ^ 4})   -- a whole float
    assert.are.equal("integer", math.type(check{n = 2 ^ 4}.n))
    assert.are.same({n = 1, rate = 0, on = true, ck = {"a"}, name = "x"},
                    check{n = 1, rate = 0, on = true, ck = {"a"}, name = "x"})
    local function refused(o, msg, prefix) assert.are.equal(msg, support.errmsg(check, o, prefix)) end
    refused({}, "api: option 'n' is required")
    refused(5, "api: options must be a table, got number")
    refused({n = 1, nn = 2}, "api: unknown option 'nn' (expected one of: ck, n, name, on, rate)")
    refused({n = 1, nn = 2}, "api: unknown option 'm.nn' (expected one of: ck, n, name, on, rate)", "m.")
    refused({n = 2.5}, "api: option 'n' must be an integer >= 1, got 2.5")
    refused({n = 0}, "api: option 'n' must be an integer >= 1, got 0")
    refused({n = "3"}, "api: option 'n' must be an integer >= 1, got string")
    refused({n = 1, rate = 0 / 0}, "api: option 'rate' must be a finite number >= 0, got " .. tostring(0 / 0))
    refused({n = 1, rate = math.huge}, "api: option 'rate' must be a finite number >= 0, got inf")
    refused({n = 1, rate = -1}, "api: option 'rate' must be a finite number >= 0, got -1")
    refused({n = 1, on = 1}, "api: option 'on' must be a boolean, got 1")
    refused({n = 1, ck = 2}, "api: option 'ck' must be a string or a table, got 2")
    refused({n = 1, name = 2}, "api: option 'm.name' must be a string, got 2", "m.")
    assert.are.same({n = 1, rate = 0.5, on = false, ck = "none"}, check{n = 1, name = false})   -- false: none
    refused({n = false}, "api: option 'n' must be an integer >= 1, got boolean")   -- required: no none
    local off = {cut = {"number", 6, above = 0, inf = true}}   -- math.huge allowed: "off"
    assert.are.equal(math.huge, options.check({cut = math.huge}, off, fail).cut)
    assert.are.equal("api: option 'cut' must be a finite number > 0 or math.huge, got 0",
                     support.errmsg(options.check, {cut = 0}, off, fail))
  end)

  it("checks --device: cpu or cuda, and a usable GPU when one is needed", function()
    assert.are.equal("cpu", options.device("cpu"))
    assert.are.equal("cuda", options.device("cuda"))
    support.raises("--device must be cpu or cuda, got 'tpu'", options.device, "tpu")
    assert.are.equal("cpu", options.need_device("cpu"))
    local ok, why = m.cuda_available()
    if ok then
      assert.are.equal("cuda", options.need_device("cuda"))
    else
      support.raises("--device cuda: no usable GPU (" .. why .. "); more", options.need_device, "cuda", "; more")
    end
  end)
end)
