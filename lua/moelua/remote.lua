-- moelua.remote: the job's side of `moelua attach RUN_DIR`. moelua.attach
-- (host/bindings/attach.c) serves the socket from its own thread; this module runs
-- on the training thread, at the trainer's safe points: it publishes the
-- snapshot that thread answers from, and runs the requests it cannot
-- answer.
--
--   local remote = require "moelua.remote"
--   local srv = remote.listen(run_dir, {steps = N [, policy = "drop" | model = model]})
--   (the moe policy: set{capacity_factor =} is refused unless it is "drop")
--   train.run{..., attach = srv}   -- the trainer calls the safe points below
--
-- Each line is Lua source run in its own environment, the same in both
-- threads (moelua.attach_env): `stats` (the last step's metrics, the last
-- step line of metrics.jsonl), `ledger` (moelua.mem.stats()), `progress`
-- ({step =, steps =, paused =, phase =, layer =, micro =, micros =}: where
-- the job stands), `overrides` and `staged` (copies), and the controls
-- set{...} (every control of the recipe's hook: attach_env.SETTABLE),
-- unset(name, ...), checkpoint(), pause() / resume(), help(). Every line
-- runs under an
-- instruction limit (1e6 by default; once hit, every further instruction
-- raises, so a pcall in the line cannot outlast it), so an endless loop
-- ends with an error reply, and the string library has no pattern matching
-- (moelua.attach_env); every error is replied (a reply that cannot be
-- queued, by a short error reply), none reaches the training loop (only
-- Ctrl-C's "interrupted" passes through, to stop the job as it would
-- anyway).
--
-- Where a line runs:
--   - at once, in the server thread of moelua.attach, whatever the training
--     thread is doing (in a long kernel, in the optimizer): a line that
--     calls no control. It sees the snapshot this module published last
--     (srv:publish(), a JSON text: stats, ledger, progress, overrides,
--     staged), so it is as fresh as the last safe point;
--   - at the next safe point, here, on the training thread: a line that
--     calls a control. The server thread queues it whole; here it runs
--     again in a coroutine under the same limit (debug.sethook count),
--     against the live state, and its reply goes back through the server
--     thread. The snapshot is published again before each reply, so the
--     client's next query sees what its control did.
--
-- Safe points, and what a request does at each:
--   srv:poll(step)               the start of step `step`, before its hook
--                                (phase "start"); stats is read here
--   srv:safe_point(phase, layer) inside the step: after each block's forward
--                                or backward (phase "forward"/"backward",
--                                from model.safe_point, which the trainer
--                                sets to srv.on_layer during its step) and
--                                after each micro-batch (phase "micro-batch")
--   srv:position(micro, micros)  the micro-batch now running (no I/O)
--   srv:finish(steps)            after the last step (phase "done")
-- set{...} at the start of step N applies from step N; inside step N it is
-- staged and applies from step N + 1 (the reply says which step), so a step
-- never mixes two temperatures, aux weights or learning rates across its
-- layers or micro-batches. Overrides are kept for every later step and win
-- over the recipe's hook. checkpoint() saves after the current step (the
-- trainer's loop, lua/moelua/train.lua). pause() blocks the job at the safe
-- point where it was run, still running controls (50 ms waits) while the
-- server thread answers queries, until resume() or until no client is left
-- attached.
--
-- Not here: a line's environment and its reply text
-- (lua/moelua/attach_env.lua), the socket and the server thread
-- (host/bindings/attach.c, host/bindings/l_attach.c) and the loop that calls the safe points
-- and saves the checkpoint (lua/moelua/train.lua).
local attach = require "moelua.attach"
local mem = require "moelua.mem"
local bench = require "moelua.bench"
local fs = require "moelua.fs"
local json = require "dkjson"
local attach_env = require "moelua.attach_env"

local remote = {}

local Server = {}
Server.__index = Server

local E = attach_env.new(require "moelua.pretty")
-- Encoding the ledger takes ~0.15 ms and a tiny model reaches a safe point
-- every ~1 ms: the snapshot's ledger is encoded again at most this often
-- (seconds), and after every control; the rest of it at every safe point.
local LEDGER_EVERY = 0.02

-- The last step's metrics, as its JSON line: the last line of metrics.jsonl
-- with a `step` and no `event` that decodes.
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
  return ok and type(m) == "table" and found or nil
end

-- The controls a request line calls (moelua.attach_env.CONTROLS), acting on srv.
-- A change made at a step's start is in force for that step; one made inside
-- a step is staged for the next (staged[name] = false: an unset to come).
local function controls(srv)
  local c = {}
  local function target()
    if srv.phase == "start" then return srv.overrides, srv.step end   -- this step's settings are not taken yet
    return srv.staged, srv.step and srv.step + 1
  end
  function c.set(t)
    if type(t) ~= "table" then
      error("set: expected a table {name = value, ...}; see help() for the controls", 2)
    end
    local keys = {}
    for k, v in pairs(t) do
      local why = attach_env.check(k, v)
      if why then error("set: " .. why, 2) end
      if k == "capacity_factor" and srv.policy ~= "drop" then
        error("set: capacity_factor applies only to a model with moe policy \"drop\" (this job's: " ..
              (srv.policy and "\"" .. srv.policy .. "\"" or "unknown: the job gave remote.listen no model or policy") ..
              ")", 2)
      end
      keys[#keys + 1] = k
    end
    table.sort(keys)
    local into, from = target()
    local parts, quoted = {}, {}
    for i, k in ipairs(keys) do
      into[k] = t[k]
      parts[i], quoted[i] = k .. " = " .. tostring(t[k]), '"' .. k .. '"'
    end
    if #keys == 0 then return "nothing to set; see help()" end
    return ("applied from step %s: %s (kept across rollbacks, not saved in checkpoints; unset(%s) drops %s)")
           :format(tostring(from), table.concat(parts, ", "), table.concat(quoted, ", "), #keys == 1 and "it" or "them")
  end
  function c.unset(...)
    local names = table.pack(...)
    if names.n == 0 then   -- every override, and every staged change
      for k in pairs(srv.overrides) do names[#names + 1] = k end
      for k in pairs(srv.staged) do names[#names + 1] = k end
    end
    local into, from = target()
    local gone, none = {}, {}
    for i = 1, #names do
      local k = names[i]
      if not attach_env.is_control(k) then
        error("unset: unknown control '" .. tostring(k) .. "' (one of " .. attach_env.names() .. ")", 2)
      end
      if srv.overrides[k] == nil and not srv.staged[k] then   -- nothing in force or to come: nothing to drop
        none[#none + 1] = k
      else
        if into == srv.overrides then into[k] = nil; srv.staged[k] = nil else into[k] = false end
        gone[#gone + 1] = k
      end
    end
    table.sort(gone)
    table.sort(none)
    if #gone == 0 then
      return #none == 0 and "no overrides to unset" or "no override of " .. table.concat(none, ", ") .. " to unset"
    end
    return ("unset from step %s: %s (the recipe's hook sets them again)"):format(tostring(from),
                                                                                 table.concat(gone, ", "))
  end
  function c.checkpoint()
    srv.want_checkpoint = true
    return "a checkpoint will be saved after step " .. tostring(srv.step)
  end
  function c.pause()
    srv.paused = true
    if srv.phase == "start" then return "paused at step " .. tostring(srv.step) end
    return ("paused at step %s (%s)"):format(tostring(srv.step), srv:where())
  end
  function c.resume()
    local was = srv.paused
    srv.paused = false
    return was and "resumed" or "not paused"
  end
  return c
end

-- attach_env's `limited` on this thread: fn in a coroutine under `limit`
-- instructions (debug.sethook count) -> true, results... | false, error.
-- Once the limit is hit every further instruction raises (the hook re-armed
-- at count 1, as host/bindings/attach.c's limit_hook), so a pcall in the line cannot
-- outlast it. The message is made here: the hook calls nothing of the line's.
local function limiter(limit)
  local msg = ("instruction limit exceeded (%d instructions)"):format(limit)
  local function hook()
    debug.sethook(hook, "", 1)   -- the running coroutine: the line's
    error(msg, 2)
  end
  return function(fn)
    local co = coroutine.create(fn)
    debug.sethook(co, hook, "", limit)
    return coroutine.resume(co)
  end
end

function remote.listen(run_dir, opts)
  opts = opts or {}
  fs.mkdir_p(run_dir)
  local limit = math.floor(opts.instructions or 1e6)
  local srv = setmetatable({
    handle = attach.listen(run_dir, limit), metrics_path = run_dir .. "/metrics.jsonl",
    steps = opts.steps, limit = limit, policy = opts.policy or (opts.model and ((opts.model.opts.moe_opts or {}).policy or "dropless")), overrides = {}, staged = {}, paused = false,
    step = nil, phase = "start", layer = nil, micro = nil, micros = nil,
    stats_line = nil, ledger_json = nil, ledger_at = nil,   -- the snapshot's, as JSON text
  }, Server)
  srv.on_layer = function(phase, layer) srv:safe_point(phase, layer) end   -- the model's safe_point
  srv.controls, srv.limited = controls(srv), limiter(limit)
  srv.stats_line = last_metrics(srv.metrics_path)
  srv:publish()
  return srv
end

function Server:progress()
  return {step = self.step, steps = self.steps, paused = self.paused, phase = self.phase,
          layer = self.layer, micro = self.micro, micros = self.micros}
end

local function pass_interrupt(err)
  if tostring(err):find("interrupted", 1, true) then error(err, 0) end
end

local function publish(srv, fresh)
  local t = bench.now()
  if fresh or not srv.ledger_json or t - srv.ledger_at >= LEDGER_EVERY then
    srv.ledger_json, srv.ledger_at = json.encode(mem.stats()), t
  end
  local rest = json.encode({progress = srv:progress(), overrides = srv.overrides, staged = srv.staged})
  attach.publish(srv.handle, '{"stats":' .. (srv.stats_line or "null") .. ',"ledger":' .. srv.ledger_json ..
                             "," .. rest:sub(2))
end

-- The snapshot the server thread answers queries from: stats (the JSON line
-- as read at the step's start), ledger (at most LEDGER_EVERY old; `fresh`:
-- now), progress, overrides, staged. Never raises, but for Ctrl-C.
function Server:publish(fresh)
  local ok, err = pcall(publish, self, fresh)
  if not ok then pass_interrupt(err) end
end

-- Where inside the step the job stands: "after the forward of layer 2,
-- micro-batch 1 of 2".
function Server:where()
  if self.phase == "start" then return "at its start" end
  if self.phase == "done" then return "after the last step" end
  local s = self.phase == "micro-batch" and "after micro-batch " .. tostring(self.micro)
            or ("after the %s of layer %s"):format(self.phase, tostring(self.layer))
  if self.micros and self.micros > 1 and self.phase ~= "micro-batch" then
    s = s .. ", micro-batch " .. tostring(self.micro)
  end
  return self.micros and self.micros > 1 and s .. " of " .. self.micros or s
end

-- Run one line against the live state; returns the reply text. A line is
-- all or nothing: one that ends in an error undoes what its controls did
-- (`set{temperature = 0.5}; set{noise = -1}` sets no temperature), and its
-- reply says so. Never raises.
function Server:run(code)
  local data = {stats = self.stats_line and json.decode(self.stats_line), ledger = mem.stats(),
                progress = self:progress(), overrides = self.overrides, staged = self.staged}
  local overrides, staged = attach_env.copy(self.overrides), attach_env.copy(self.staged)
  local paused, want_checkpoint = self.paused, self.want_checkpoint
  local text, failed = E.run(code, data, self.controls, self.limited)
  local function same(a, b)
    for k, v in pairs(a) do if b[k] ~= v then return false end end
    for k in pairs(b) do if a[k] == nil then return false end end
    return true
  end
  if failed and not (same(overrides, self.overrides) and same(staged, self.staged) and paused == self.paused
                     and want_checkpoint == self.want_checkpoint) then
    self.overrides, self.staged, self.paused, self.want_checkpoint = overrides, staged, paused, want_checkpoint
    text = text .. "\n(what this line set, unset, paused or asked for before the error is undone)"
  end
  return text
end

local function send_error(srv, client, err)
  attach.reply(srv.handle, client, "error: the reply could not be sent: " ..
                                   (tostring(err):sub(1, 200):gsub("\0", "\\0")))
end

-- text as the reply to `client`; when it cannot be queued (out of memory),
-- a short error reply instead: the client waits for one. Never raises, but
-- for Ctrl-C.
local function reply(srv, client, text)
  local ok, err = pcall(attach.reply, srv.handle, client, text)
  if ok then return end
  pass_interrupt(err)
  pcall(send_error, srv, client, err)
end

-- Publish the snapshot and run every queued control request; while paused,
-- keep running them until resumed.
function Server:answer()
  local timeout = 0
  repeat
    self:publish()
    local ok, reqs, n = pcall(attach.poll, self.handle, timeout)
    if not ok then pass_interrupt(reqs); return end
    for _, r in ipairs(reqs) do
      local okr, text = pcall(self.run, self, r.code)
      if not okr then pass_interrupt(text) end
      self:publish(true)   -- before the reply: the client's next query sees what this one did
      reply(self, r.client, okr and text or ("error: " .. tostring(text)))
    end
    if n == 0 then self.paused = false end
    -- a trainer's step holds the collector (moelua.train): what the
    -- requests and a paused job's publishing leave is collected here
    if #reqs > 0 or self.paused then collectgarbage() end
    timeout = 50
  until not self.paused
end

-- The start of a step: overrides staged during the last step take effect.
function Server:poll(step)
  if next(self.staged) then
    for k, v in pairs(self.staged) do self.overrides[k] = v or nil end   -- false: unset
    self.staged = {}
  end
  self.step, self.phase, self.layer, self.micro = step, "start", nil, nil
  self.stats_line = last_metrics(self.metrics_path)
  self:answer()
end

-- After the last step: the final metrics published (phase "done").
function Server:finish(steps)
  self.step, self.phase, self.layer, self.micro = steps, "done", nil, nil
  self.stats_line = last_metrics(self.metrics_path)
  self:answer()
end

function Server:position(micro, micros) self.micro, self.micros = micro, micros end

-- Inside the step: after a block's forward or backward, or a micro-batch.
function Server:safe_point(phase, layer)
  self.phase, self.layer = phase, layer
  self:answer()
end

function Server:close() attach.close(self.handle) end

return remote
