-- moelua.attach_env: one request line of `moelua attach`, from its source
-- to its reply text. The one definition of what a line sees and how its
-- reply reads, for both places a line runs: the training thread
-- (lua/moelua/remote.lua) and the server thread of moelua.attach
-- (host/attach.c), whose small Lua state has only base, string, table and
-- math and loads this file by its path. So this module uses nothing else,
-- requires nothing and defines no globals; the JSON encoder/decoder
-- (dkjson) is passed in.
--
--   local E = attach_env.new(json)
--   E.show(v)          a value as a reply shows it: a table as one line of
--                      JSON, anything else by tostring
--   E.env(data, controls, out)  -> env: the environment of one line:
--                      data.stats, data.ledger, data.progress, copies of
--                      data.overrides and data.staged (nil: {}), the base
--                      functions, copies of math, string and table (no
--                      request changes what the next one sees), each control
--                      of attach_env.CONTROLS from `controls`, and a print
--                      that appends its line to `out`
--   E.run(code, data, controls, limited)  -> the reply text: code loaded as
--                      an expression ('return ' .. code), else as a
--                      statement, in E.env; run by limited(fn) (-> true,
--                      results... | false, error: fn under the instruction
--                      limit); the printed lines and the results, one a
--                      line, cut at attach_env.REPLY_MAX bytes; a load or
--                      run error as "error: ...". Raises only what limited
--                      or a control raises past it.
--   attach_env.server(json, limited)  -> evaluator(code, snapshot_json):
--                      the server thread's: E.run against the decoded
--                      snapshot; nil when the line calls a control (it is
--                      then run again by the training thread, which alone
--                      can change the job).
--
-- Not here: the controls themselves and the training thread's limited
-- runner (lua/moelua/remote.lua), the server thread's (host/attach.c), the
-- socket.
local attach_env = {}

attach_env.REPLY_MAX = 60000
attach_env.CONTROLS = {"set", "checkpoint", "pause", "resume"}

local BASE = {"pairs", "ipairs", "next", "tostring", "tonumber", "type", "select", "pcall", "error", "assert"}
local LIBS = {"math", "string", "table"}
local G = _G

local function copy(t)
  local c = {}
  for k, v in pairs(t or {}) do c[k] = v end
  return c
end

function attach_env.new(json)
  local E = {}

  function E.show(v)
    if type(v) == "table" then
      local ok, s = pcall(json.encode, v, {indent = false})
      if ok and s then return s end
    end
    return tostring(v)
  end

  function E.env(data, controls, out)
    local env = {stats = data.stats, ledger = data.ledger, progress = data.progress,
                 overrides = copy(data.overrides), staged = copy(data.staged)}   -- changes go through set{...}
    for _, k in ipairs(BASE) do env[k] = G[k] end
    for _, k in ipairs(LIBS) do env[k] = copy(G[k]) end
    for _, k in ipairs(attach_env.CONTROLS) do env[k] = controls[k] end
    function env.print(...)
      local parts = {}
      for i = 1, select("#", ...) do parts[i] = E.show((select(i, ...))) end
      out[#out + 1] = table.concat(parts, "\t")
    end
    return env
  end

  function E.run(code, data, controls, limited)
    local out = {}
    local env = E.env(data, controls, out)
    local fn = load("return " .. code, "=attach", "t", env)
    if not fn then
      local err
      fn, err = load(code, "=attach", "t", env)
      if not fn then return "error: " .. err end
    end
    local res = table.pack(limited(fn))
    if not res[1] then return "error: " .. E.show(res[2]) end
    for i = 2, res.n do out[#out + 1] = E.show(res[i]) end
    local text = table.concat(out, "\n")
    local max = attach_env.REPLY_MAX
    if #text > max then text = text:sub(1, max) .. "\n... (cut at " .. max .. " bytes)" end
    return text
  end

  return E
end

function attach_env.server(json, limited)
  local E = attach_env.new(json)
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
