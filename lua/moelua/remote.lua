-- moelua.remote: the job's side of `moelua attach RUN_DIR`. It answers the
-- lines clients send to the socket of moelua.attach (host/l_attach.c), on
-- the training thread, at the start of a step (from the step hook, so the
-- state it sees is consistent).
--
--   local remote = require "moelua.remote"
--   local srv = remote.listen(run_dir, {steps = N})
--   train.run{..., attach = srv}  -- the trainer polls it at the start of each
--                                 -- step and applies its overrides after the hook
--
-- Each line is Lua source run in its own environment: `stats` (the last
-- step's metrics, the last step line of metrics.jsonl), `ledger`
-- (moelua.mem.stats()), `progress` ({step =, steps =, paused =}), and the
-- controls set{temperature =, aux_weight =, lr_scale =} (kept for every
-- next step), checkpoint() (saved after the current step), pause() /
-- resume(). The chunk runs in a coroutine under an
-- instruction limit (debug.sethook count, 1e6 by default), so an endless
-- loop ends with an error reply; every error is replied, none reaches the
-- training loop. A pause holds the job at the step's start while it answers
-- requests; it ends with resume() or when no client is left attached.
--
-- Not here: checkpoint requests and polls between micro-batches (they need
-- the trainer's loop, lua/moelua/train.lua).
local attach = require "moelua.attach"
local mem = require "moelua.mem"
local fs = require "moelua.fs"
local json = require "dkjson"

local remote = {}

local Server = {}
Server.__index = Server

local SETTABLE = {temperature = true, aux_weight = true, lr_scale = true}
local REPLY_MAX = 60000

-- The last step's metrics: the last line of metrics.jsonl with a `step` and no `event`.
local function last_metrics(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local size = f:seek("end")
  f:seek("set", math.max(0, size - 65536))
  local tail = f:read("a") or ""
  f:close()
  local found
  for line in tail:gmatch("[^\n]+") do
    if line:find('"step"', 1, true) and not line:find('"event"', 1, true) then found = line end
  end
  if not found then return nil end
  local ok, m = pcall(json.decode, found)
  return ok and m or nil
end

local function show(v)
  if type(v) == "table" then
    local ok, s = pcall(json.encode, v, {indent = false})
    if ok and s then return s end
  end
  return tostring(v)
end

function remote.listen(run_dir, opts)
  opts = opts or {}
  fs.mkdir_p(run_dir)
  return setmetatable({
    handle = attach.listen(run_dir), metrics_path = run_dir .. "/metrics.jsonl",
    steps = opts.steps, limit = opts.instructions or 1e6, overrides = {}, paused = false, step = nil,
  }, Server)
end

-- The environment of one request; output of print goes into the reply.
function Server:env(out)
  local srv = self
  local env = {
    stats = last_metrics(self.metrics_path), ledger = mem.stats(),
    progress = {step = self.step, steps = self.steps, paused = self.paused},
    overrides = {},   -- a copy: changes go through set{...}
    math = math, string = string, table = table, pairs = pairs, ipairs = ipairs, next = next,
    tostring = tostring, tonumber = tonumber, type = type, select = select, pcall = pcall,
    error = error, assert = assert,
  }
  for k, v in pairs(self.overrides) do env.overrides[k] = v end
  function env.print(...)
    local parts = {}
    for i = 1, select("#", ...) do parts[i] = show((select(i, ...))) end
    out[#out + 1] = table.concat(parts, "\t")
  end
  function env.set(t)
    if type(t) ~= "table" then error("set: expected a table {temperature =, aux_weight =, lr_scale =}", 2) end
    for k, v in pairs(t) do
      if not SETTABLE[k] then error("set: unknown control '" .. tostring(k) ..
                                    "' (temperature, aux_weight, lr_scale)", 2) end
      if type(v) ~= "number" or v ~= v or v < 0 or v == math.huge or (k ~= "aux_weight" and v == 0) then
        error("set: " .. k .. " must be a finite number > 0 (aux_weight >= 0), got " .. tostring(v), 2)
      end
    end
    for k, v in pairs(t) do srv.overrides[k] = v end
    return "applied from step " .. tostring(srv.step)
  end
  function env.checkpoint()
    srv.want_checkpoint = true
    return "a checkpoint will be saved after step " .. tostring(srv.step)
  end
  function env.pause() srv.paused = true; return "paused at step " .. tostring(srv.step) end
  function env.resume() srv.paused = false; return "resumed" end
  return env
end

-- Run one line; returns the reply text. Never raises.
function Server:run(code)
  local out = {}
  local env = self:env(out)
  local fn = load("return " .. code, "=attach", "t", env)
  if not fn then
    local err
    fn, err = load(code, "=attach", "t", env)
    if not fn then return "error: " .. err end
  end
  local co = coroutine.create(fn)
  debug.sethook(co, function() error(("instruction limit exceeded (%d instructions)"):format(math.floor(self.limit)), 2) end,
                "", math.floor(self.limit))
  local res = table.pack(coroutine.resume(co))
  if not res[1] then return "error: " .. show(res[2]) end
  for i = 2, res.n do out[#out + 1] = show(res[i]) end
  local text = table.concat(out, "\n")
  if #text > REPLY_MAX then text = text:sub(1, REPLY_MAX) .. "\n... (cut at " .. REPLY_MAX .. " bytes)" end
  return text
end

-- Answer every pending request; while paused, keep answering until resumed.
function Server:poll(step)
  self.step = step
  local timeout = 0
  repeat
    local ok, reqs, n = pcall(attach.poll, self.handle, timeout)
    if not ok then return end
    for _, r in ipairs(reqs) do
      local okr, text = pcall(self.run, self, r.code)
      pcall(attach.reply, self.handle, r.client, okr and text or ("error: " .. tostring(text)))
    end
    if n == 0 then self.paused = false end
    timeout = 50
  until not self.paused
end

function Server:close() attach.close(self.handle) end

return remote
