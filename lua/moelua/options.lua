-- moelua.options: a recipe's command-line options. A recipe declares each
-- option once (default and help), and `options.parse(arg, spec)` returns the
-- values with their types checked, before anything is allocated:
--
--   local opts = options.parse(arg, {
--     {"seq-len", 8192, "tokens per sequence"},
--     {"steps", 200, "optimizer steps"},
--     {"resume", "", "checkpoint directory to continue from"},
--   })
--   print(opts.seq_len)
--
-- `--name value` or `--name=value`; a boolean option is `--name` alone or
-- `--name=false`. `--help` prints every option with its default and exits.
-- A numeric option may give bounds, {"steps", 50, "optimizer steps", min = 1}
-- (and max =, or below = for an open upper bound); a string option its
-- values, {"save", "recompute", "...", choices = {"save", "recompute"}}. An unknown option, a
-- missing value, a wrong type or a value out of bounds is a user error
-- (moelua.errors: printed without a traceback) naming the option. Dashes
-- in names become underscores in the result. The spec is checked first:
-- a misspelt key, a default outside its own bounds or choices, or a name
-- declared twice is an error at the recipe's line.
local errors = require "moelua.errors"

local options = {}

local function key(name) return (name:gsub("-", "_")) end

local function fail(fmt, ...) errors.user(string.format(fmt, ...)) end

-- options.boolean(text) -> true or false for what a boolean option reads
-- as such ("true", "1"; "false", "0"), else nil.
function options.boolean(text)
  if text == "true" or text == "1" then return true end
  if text == "false" or text == "0" then return false end
end

local function convert(o, text)
  local name, default = o[1], o[2]
  local t = type(default)
  if t == "number" then
    local v = tonumber(text)
    if v == nil or v ~= v then fail("option --%s expects a number, got '%s'", name, text) end
    if v == math.huge or v == -math.huge then fail("option --%s must be finite, got '%s'", name, text) end
    if math.type(default) == "integer" then
      if math.type(v) ~= "integer" and v ~= math.floor(v) then
        fail("option --%s expects an integer, got '%s'", name, text)
      end
      v = math.tointeger(v)
      if v == nil then fail("option --%s: '%s' is out of range", name, text) end
    end
    if o.min and v < o.min then fail("option --%s must be at least %s, got %s", name, o.min, text) end
    if o.max and v > o.max then fail("option --%s must be at most %s, got %s", name, o.max, text) end
    if o.below and v >= o.below then fail("option --%s must be below %s, got %s", name, o.below, text) end
    return v
  elseif t == "boolean" then
    local b = options.boolean(text)
    if b == nil then fail("option --%s expects true or false, got '%s'", name, text) end
    return b
  end
  if o.choices then
    for _, c in ipairs(o.choices) do if text == c then return text end end
    fail("option --%s must be one of %s, got '%s'", name, table.concat(o.choices, ", "), text)
  end
  return text
end

-- options.unknown(key, spec) -> "unknown option 'key' (expected one of: a,
-- b, ...)", spec's keys sorted: the refusal of a Lua API's options table
-- (moe.new, nn.Transformer.new, the optimizers, train.run), raised by each
-- its own way.
function options.unknown(key, spec)
  local names = {}
  for n in pairs(spec) do names[#names + 1] = n end
  table.sort(names)
  return string.format("unknown option '%s' (expected one of: %s)", tostring(key), table.concat(names, ", "))
end

-- What each kind of options.check accepts: v as the option holds it, or nil.
local KINDS = {
  integer = function(v) return math.type(v) and math.tointeger(v) or nil end,   -- 2^20 is an integer too
  number = function(v) return type(v) == "number" and v == v and math.abs(v) < math.huge and v or nil end,
  ["function"] = function(v)   -- a callable table too (a schedule object)
    local mt = type(v) == "table" and getmetatable(v)
    return (type(v) == "function" or mt and mt.__call) and v or nil
  end,
}
local KIND_NAMES = {integer = "an integer", number = "a finite number", string = "a string", boolean = "a boolean",
                    table = "a table", ["function"] = "a function"}

local function accept(kind, v)
  for k in kind:gmatch("[^|]+") do
    local got
    if KINDS[k] then got = KINDS[k](v) elseif type(v) == k then got = v end
    if got ~= nil then return got end
  end
end

-- options.check(opts, spec, fail [, prefix]) -> a copy of the options table
-- opts (nil: none given) with spec's defaults filled in: the options of the
-- Lua APIs (moe.new, nn.Transformer.new, expert_store.new, the optimizers,
-- inspect, train.run and its rollback and alarms). spec = {key = {kind, default
-- [, min = least | above = bound] [, inf = true: math.huge too]}}: kind is
-- "integer", "number" (finite), "string", "boolean", "table", "function"
-- (a callable table too) or alternatives ("string|table"); a default nil makes the option
-- required, false leaves it out (a boolean's false is its value; a false
-- given for such an option is none, as `cond and {...}` passes it). An
-- unknown key, a value of the wrong kind or out of bounds, or a missing
-- required one calls fail(fmt, ...), which raises the API's own error;
-- prefix names the keys in messages ("store.").
function options.check(opts, spec, fail, prefix)
  prefix = prefix or ""
  if opts == nil then opts = {} end
  if type(opts) ~= "table" then fail("options must be a table, got %s", type(opts)) end
  local o = {}
  for k, v in pairs(opts) do
    local s = spec[k]
    if not s then fail("%s", options.unknown(prefix .. tostring(k), spec)) end
    if not (v == false and s[2] == false) then   -- `x and {...}` passes false for none
      local got = s.inf and v == math.huge and v or accept(s[1], v)
      if got == nil or s.min and got < s.min or s.above and got <= s.above then
        local names = {}
        for kind in s[1]:gmatch("[^|]+") do names[#names + 1] = KIND_NAMES[kind] end
        fail("option '%s%s' must be %s%s%s, got %s", prefix, k, table.concat(names, " or "),
             s.min and " >= " .. s.min or s.above and " > " .. s.above or "", s.inf and " or math.huge" or "",
             type(v) == "number" and tostring(v) or type(v))
      end
      o[k] = got
    end
  end
  for k, s in pairs(spec) do
    if o[k] == nil then
      if s[2] == nil then fail("option '%s%s' is required", prefix, k) end
      if s[2] ~= false or s[1] == "boolean" then o[k] = s[2] end
    end
  end
  return o
end

function options.help(spec, out)
  out = out or io.stdout
  out:write(#spec > 0 and "options:\n" or "options: none\n")
  for _, o in ipairs(spec) do
    local top = o.max and tostring(o.max) or o.below and ("<" .. o.below) or ""
    local bounds = (o.min or o.max or o.below) and string.format(" (%s..%s)", o.min or "", top) or ""
    out:write(string.format("  --%-22s %-12s %s%s\n", o[1], tostring(o[2]), o[3] or "", bounds))
  end
end

local RULE_KEYS = {min = "number", max = "number", below = "number", choices = "table"}

-- The recipe's own spec, checked before the command line: a misspelt
-- bound, a name declared twice or a default its own rule refuses is a bug
-- of the recipe, raised at the recipe's line (with its traceback).
local function check_spec(spec)
  local fn = "moelua.options.parse"
  if type(spec) ~= "table" then
    error(string.format("%s: argument #2 (spec): expected a list of {name, default, help}, got %s", fn, type(spec)), 3)
  end
  local seen = {}
  for i, o in ipairs(spec) do
    local where = string.format("%s: spec[%d]", fn, i)
    if type(o) ~= "table" or type(o[1]) ~= "string" or o[1] == "" then
      error(where .. ": expected {name, default, help}", 3)
    end
    where = where .. " (--" .. o[1] .. ")"
    if seen[key(o[1])] then error(where .. ": declared twice", 3) end
    seen[key(o[1])] = true
    local t = type(o[2])
    if t ~= "number" and t ~= "string" and t ~= "boolean" then
      error(where .. ": the default must be a number, a string or a boolean, got " .. t, 3)
    end
    for k, v in pairs(o) do
      if math.type(k) ~= "integer" and not RULE_KEYS[k] then
        error(where .. ": unknown key '" .. tostring(k) .. "' (min, max, below, choices)", 3)
      end
      if RULE_KEYS[k] and type(v) ~= RULE_KEYS[k] then error(where .. ": " .. k .. " must be a " .. RULE_KEYS[k], 3) end
    end
    if (o.min or o.max or o.below) and t ~= "number" then error(where .. ": min, max and below bound numbers", 3) end
    if o.choices and t ~= "string" then error(where .. ": choices are a string option's", 3) end
    if t == "number" and (o.min and o[2] < o.min or o.max and o[2] > o.max or o.below and o[2] >= o.below) then
      error(string.format("%s: the default %s is outside its own bounds", where, tostring(o[2])), 3)
    end
    if o.choices then
      local found = false
      for _, c in ipairs(o.choices) do found = found or c == o[2] end
      if not found then error(string.format("%s: the default '%s' is not one of its choices", where, o[2]), 3) end
    end
  end
end

-- values, given = options.parse(argv, spec [, usage]): spec is a list of
-- {name, default, help}; given[key] is true for each option on the command
-- line (so a recipe can refuse one that its other options make unused).
function options.parse(argv, spec, usage)
  if type(argv) ~= "table" then
    error("moelua.options.parse: argument #1 (argv): expected the script's arg table, got " .. type(argv), 2)
  end
  check_spec(spec)
  local byname, values, given = {}, {}, {}
  for _, o in ipairs(spec) do
    byname[o[1]] = o
    values[key(o[1])] = o[2]
  end
  local i = 1
  while argv[i] do
    local a = argv[i]
    if a:match("^%-%-help=") then fail("option --help takes no value, got '%s'", a) end
    if a == "--help" or a == "-h" then
      if usage then io.stdout:write(usage, "\n") end
      options.help(spec)
      os.exit(0)
    end
    local name, inline = a:match("^%-%-([%w%-_]+)=(.*)$")
    if not name then name = a:match("^%-%-([%w%-_]+)$") end
    if not name then
      local path = io.open(a, "r")   -- a file name: a glob the shell expanded into many arguments
      if path then path:close() end
      fail("unexpected argument '%s' (options are --name value%s)", a,
           path and "; an unquoted glob is expanded by the shell into many arguments: quote it" or "")
    end
    local o = byname[name] or byname[name:gsub("_", "-")]
    if not o then
      local names = {}
      for _, s in ipairs(spec) do names[#names + 1] = "--" .. s[1] end
      if #names == 0 then fail("unknown option --%s (this script takes no options)", name) end
      fail("unknown option --%s (known: %s; --help lists them)", name, table.concat(names, " "))
    end
    local text = inline
    if text == nil then
      if type(o[2]) == "boolean" and (argv[i + 1] == nil or argv[i + 1]:match("^%-%-")) then
        text = "true"
      else
        i = i + 1
        text = argv[i]
        if text == nil then fail("option --%s needs a value", name) end
      end
    end
    values[key(o[1])] = convert(o, text)
    given[key(o[1])] = true
    i = i + 1
  end
  return values, given
end

-- options.refuse_unused(given, rules): rules = {{name, unused, why}, ...};
-- an option given on the command line while `unused` is true (the other
-- options leave it without effect) is a user error "--name: why", not
-- silently ignored.
function options.refuse_unused(given, rules)
  for i, r in ipairs(rules) do
    if type(r) ~= "table" or type(r[1]) ~= "string" or type(r[3]) ~= "string" then
      error(string.format("moelua.options.refuse_unused: rules[%d]: expected {name, unused, why}", i), 2)
    end
    if given[key(r[1])] and r[2] then fail("--%s: %s", r[1], r[3]) end
  end
end

local UNITS = {B = 1, KiB = 2^10, MiB = 2^20, GiB = 2^30, TiB = 2^40}

-- options.bytes(name, text): a size option's bytes (an integer): a number
-- of bytes or a number with B, KiB, MiB, GiB or TiB ("64MiB", "1.5GiB");
-- anything else is a user error naming --name.
function options.bytes(name, text)
  local num, unit = tostring(text):match("^%s*([%d%.]+)%s*(%a*)%s*$")
  local v = tonumber(num or "")
  local scale = UNITS[unit ~= "" and unit or "B"]
  if not v or not scale then
    fail("option --%s expects a size such as 64MiB or 1.5GiB (B, KiB, MiB, GiB, TiB), got '%s'", name, tostring(text))
  end
  if v * scale < 1 or v * scale >= 2^62 then
    fail("option --%s must be at least 1 byte and below 4 EiB, got '%s'", name, tostring(text))
  end
  return math.floor(v * scale)
end

-- --device's value, checked: "cpu" or "cuda" (a user error otherwise).
function options.device(value)
  if value ~= "cpu" and value ~= "cuda" then fail("--device must be cpu or cuda, got '%s'", tostring(value)) end
  return value
end

-- A user error unless the device can run now: for cuda, a GPU this build
-- can use (the error says why not, then `extra`).
function options.need_device(value, extra)
  if options.device(value) == "cuda" then
    local ok, why_not = require("moelua.tensor").cuda_available()
    if not ok then fail("--device cuda: no usable GPU (%s)%s", why_not, extra or "") end
  end
  return value
end

return options
