-- moelua.attach_env: one request line of `moelua attach`, from its source
-- to its reply text. The one definition of what a line sees and how its
-- reply reads, for both places a line runs: the training thread
-- (lua/moelua/remote.lua) and the server thread of moelua.attach
-- (host/bindings/attach.c), whose small Lua state has only base, string, table and
-- math and loads this file by its path. So this module uses nothing else,
-- requires nothing and defines no globals; the printer (moelua.pretty) and
-- the JSON decoder (dkjson, for the server thread's snapshot) are passed in.
--
--   local E = attach_env.new(pretty)
--   E.show(v)          a value as a reply shows it: pretty.show (a table
--                      nested and bounded, keys sorted; a string as it is)
--   E.env(data, controls, out)  -> env: the environment of one line:
--                      data.stats, data.ledger, data.progress, copies of
--                      data.overrides and data.staged (nil: {}), the base
--                      functions, copies of math, string and table (no
--                      request changes what the next one sees), each control
--                      of attach_env.CONTROLS from `controls`, help() (the
--                      text of attach_env.help()), and a print that appends
--                      its line to `out`
--   E.run(code, data, controls, limited)  -> the reply text: code loaded as
--                      an expression ('return ' .. code), else as a
--                      statement, in E.env; run by limited(fn) (-> true,
--                      results... | false, error: fn under the instruction
--                      limit), with the strings' methods (s:find(...)) taken
--                      from the line's string table meanwhile; the printed
--                      lines and the results, one a line, a NUL byte written
--                      \0 (a NUL ends a reply on the wire), cut at
--                      attach_env.REPLY_MAX bytes; a load or run error as
--                      "error: ...". Raises only what limited or a control
--                      raises past it.
--   attach_env.SETTABLE, attach_env.check(name, value)  the controls set{}
--                      takes, in order, and the check of one (nil, or the
--                      error message naming it): remote.lua's set{} and
--                      help() read this one list.
--
-- The instruction limit counts Lua instructions; a C function runs to its
-- end unseen by it. So the line's string library has no pattern matching:
-- a pattern can run for hours in one C call (("a"):rep(20000):find
-- (".-.-.-.-.-b")), hanging the thread that runs it. string.find searches
-- plainly (s:find(text, init, true); a text with a pattern's special
-- characters ^$*+?.()[]%- and no `plain` is refused rather than read
-- plainly), and match, gmatch and gsub are refused, each with an error
-- that says why. string.rep and table.move, loops in C as long as the line
-- asks, refuse more than 2^24 repetitions or elements. The other string
-- and table functions are the real ones.
--   attach_env.server(json, pretty, limited)  -> evaluator(code, snapshot_json):
--                      the server thread's: E.run against the decoded
--                      snapshot; nil when the line calls a control (it is
--                      then run again by the training thread, which alone
--                      can change the job).
--
-- Not here: the controls themselves and the training thread's limited
-- runner (lua/moelua/remote.lua), the server thread's (host/bindings/attach.c), the
-- socket.
local attach_env = {}

attach_env.REPLY_MAX = 60000
attach_env.CONTROLS = {"set", "unset", "checkpoint", "pause", "resume"}

-- What set{} takes: every control the recipe's hook sets (train.lua's ctl),
-- each with its range: lo/hi bounds, open (excluded) where marked.
attach_env.SETTABLE = {
  {name = "temperature", lo = 0, lo_open = true, what = "> 0 (changes combine weights, never which experts)"},
  {name = "noise", lo = 0, what = ">= 0 (gate noise after the temperature: changes selection)"},
  {name = "eps", lo = 0, hi = 1, hi_open = true, what = "in [0, 1) (uniform share mixed into the probabilities)"},
  {name = "aux_weight", lo = 0, what = ">= 0 (load-balancing loss weight)"},
  {name = "z_weight", lo = 0, what = ">= 0 (router z-loss weight)"},
  {name = "lr_scale", lo = 0, what = ">= 0 (multiplies the scheduled learning rate; 0 holds the weights)"},
  {name = "capacity_factor", lo = 0, lo_open = true, what = "> 0 (a model with moe policy \"drop\" only)"},
}
local SETTABLE_BY = {}
for _, c in ipairs(attach_env.SETTABLE) do SETTABLE_BY[c.name] = c end

function attach_env.is_control(name) return SETTABLE_BY[name] ~= nil end

function attach_env.names()
  local n = {}
  for i, c in ipairs(attach_env.SETTABLE) do n[i] = c.name end
  return table.concat(n, ", ")
end

-- nil when set{name = value} is valid, else the message (naming the control).
function attach_env.check(name, value)
  local c = SETTABLE_BY[name]
  if not c then return "unknown control '" .. tostring(name) .. "' (one of " .. attach_env.names() .. ")" end
  local ok = type(value) == "number" and value == value and value > -math.huge and value < math.huge and
             (value > c.lo or (value == c.lo and not c.lo_open)) and
             (not c.hi or value < c.hi or (value == c.hi and not c.hi_open))
  if not ok then
    return name .. " must be a finite number " .. c.what .. ", got " ..
           (type(value) == "number" and tostring(value) or string.format("%s %q", type(value), tostring(value)))
  end
end

-- help()'s text, made once: a line's string methods are its own meanwhile.
local HELP
do
  local lines = {
    "What a line can use (each line is Lua; its value is printed):",
    "  stats        the last step's metrics (loss, lr, temperature, loads[layer].counts, ...)",
    "  ledger       memory by device and category (moelua.mem.stats())",
    "  progress     step, steps, paused, and where in the step: phase, layer, micro, micros",
    "  overrides    what set{} put in force (copies: change them with set/unset)",
    "  staged       set/unset made inside a step, in force from the next step",
    "  set{name = value, ...}  override what the recipe's hook sets, from this step (at a step's",
    "               start) or the next; kept across rollbacks, not saved in checkpoints:",
  }
  for _, c in ipairs(attach_env.SETTABLE) do lines[#lines + 1] = string.format("    %-16s %s", c.name, c.what) end
  for _, l in ipairs({
    "  unset(\"name\", ...)     drop overrides (unset() drops all): the hook's values come back",
    "  checkpoint() save a checkpoint after the current step",
    "  pause()      hold the job at this safe point; resume() lets it go on",
    "  help()       this text",
    "Also: the base functions, math, string (no patterns: s:find(text, 1, true)) and table.",
  }) do lines[#lines + 1] = l end
  HELP = table.concat(lines, "\n")
end
function attach_env.help() return HELP end

local BASE = {"pairs", "ipairs", "next", "tostring", "tonumber", "type", "select", "pcall", "error", "assert"}
local LIBS = {"math", "string", "table"}
local G = _G
local sfind, gsub = string.find, string.gsub
local STRMETA = getmetatable("")   -- its __index: what s:find(...) calls

-- A shallow copy (of overrides and staged: flat tables of controls).
function attach_env.copy(t)
  local c = {}
  for k, v in pairs(t or {}) do c[k] = v end
  return c
end
local copy = attach_env.copy

-- The line's string library (copied for each line): the real one without
-- pattern matching (see above).
local WHY = "a pattern can run for hours in C, where the instruction limit cannot stop it"
local SPECIAL = "[%^%$%*%+%?%.%(%)%[%]%%%-]"
local STRING = copy(string)
function STRING.find(s, text, init, plain)
  local t = type(text) == "number" and tostring(text) or text
  if not plain and type(t) == "string" and sfind(t, SPECIAL) then
    error("string.find: the pattern '" .. t .. "' is refused here (" .. WHY .. "); to search for it " ..
          "plainly: s:find(text, init, true)", 2)
  end
  return sfind(s, text, init, true)
end
for _, name in ipairs({"match", "gmatch", "gsub"}) do
  STRING[name] = function()
    error("string." .. name .. " is refused here: " .. WHY .. "; string.find(s, text, init, true) " ..
          "searches plainly", 2)
  end
end

-- Two more loops in C whose length the line chooses: bounded.
local LOOP_MAX = 1 << 24
local srep, tmove = string.rep, table.move
function STRING.rep(s, n, sep)
  if type(n) == "number" and n > LOOP_MAX then
    error(("string.rep: %.0f repetitions is over the %d allowed here "):format(n, LOOP_MAX) ..
          "(a loop in C, where the instruction limit cannot stop it)", 2)
  end
  return srep(s, n, sep)
end
local TABLE = copy(table)
function TABLE.move(a1, f, e, t, a2)
  if type(f) == "number" and type(e) == "number" and e - f >= LOOP_MAX then
    error(("table.move: a range of %.0f elements is over the %d allowed here "):format(e - f + 1, LOOP_MAX) ..
          "(a loop in C, where the instruction limit cannot stop it)", 2)
  end
  return tmove(a1, f, e, t, a2)
end

-- What the line returned through limited, once the strings' methods are
-- back to the real string library.
local function restore(index, ok, ...)
  STRMETA.__index = index
  if not ok then error((...), 0) end
  return ...
end

-- A reply's text: a NUL byte ends a reply on the wire.
local function no_nul(text)
  return (gsub(text, "\0", "\\0"))
end

function attach_env.new(pretty)
  local E = {}

  function E.show(v) return pretty.show(v) end

  -- Before the first step is logged: a `stats` that says so when read.
  local no_stats = setmetatable({}, {__index = function(_, k)
    error("stats." .. tostring(k) .. ": no step has been logged yet (stats is the last logged step's metrics; " ..
          "progress.step says where the job is)", 2)
  end})

  function E.env(data, controls, out)
    local env = {stats = data.stats or no_stats, ledger = data.ledger, progress = data.progress,
                 overrides = copy(data.overrides), staged = copy(data.staged)}   -- changes go through set{...}
    for _, k in ipairs(BASE) do env[k] = G[k] end
    for _, k in ipairs(LIBS) do env[k] = copy(k == "string" and STRING or k == "table" and TABLE or G[k]) end
    for _, k in ipairs(attach_env.CONTROLS) do env[k] = controls[k] end
    env.help = attach_env.help
    function env.print(...)
      local parts = {}
      for i = 1, select("#", ...) do parts[i] = E.show((select(i, ...))) end
      out[#out + 1] = table.concat(parts, "\t")
    end
    return env
  end

  -- The reply to one line, and true when the line ended in an error.
  function E.run(code, data, controls, limited)
    local out = {}
    local env = E.env(data, controls, out)
    local fn = load("return " .. code, "=attach", "t", env)
    if not fn then
      local err
      fn, err = load(code, "=attach", "t", env)
      if not fn then return no_nul("error: " .. err), true end
    end
    local index = STRMETA.__index
    STRMETA.__index = env.string
    local res = table.pack(restore(index, pcall(limited, fn)))
    if not res[1] then return no_nul("error: " .. E.show(res[2])), true end
    for i = 2, res.n do out[#out + 1] = E.show(res[i]) end
    local text = no_nul(table.concat(out, "\n"))
    local max = attach_env.REPLY_MAX
    if #text > max then text = text:sub(1, max) .. "\n... (cut at " .. max .. " bytes)" end
    return text
  end

  return E
end

function attach_env.server(json, pretty, limited)
  local E = attach_env.new(pretty)
  local CONTROL, called = {}, false
  local function queue() called = true; error(CONTROL, 0) end
  local controls = {}
  for _, k in ipairs(attach_env.CONTROLS) do controls[k] = queue end
  return function(code, snapshot)
    local snap = snapshot and json.decode(snapshot)
    if type(snap) ~= "table" then snap = {} end
    called = false
    local text = E.run(code, snap, controls, limited)
    if called then return nil end
    return text
  end
end

return attach_env
