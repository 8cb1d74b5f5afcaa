-- Reloadable recipe hooks (train.run{reload = ...}): a recipe file edited
-- while its training runs has its hooks re-read at the next step; a
-- half-written file is retried, and a broken file or a failing hook keeps
-- the previous hooks without stopping the training.
local m = require "moelua"
local nn = require "moelua.nn"
local optim = require "moelua.optim"
local sched = require "moelua.sched"
local data = require "moelua.data"
local fs = require "moelua.fs"
local json = require "dkjson"
local support = require "tests.support"

local SEQ = 32

-- A recipe in the shape of recipes/longctx.lua: hooks first, returned when
-- the trainer re-reads the file, then the training. `body` goes inside the
-- hook (after the temperature is set); `top` runs when the file is loaded.
local function recipe(temperature, body, top)
  return string.format([[
local train = require "moelua.train"
local spec = require "reload_spec.env"   -- the spec's callbacks (package.loaded)
%s
local function hook(step, state, ctl)
  ctl.temperature = %s
  %s
  spec.on_step(step)
end
if MOELUA_RELOAD then return {hook = hook} end
return train.run(spec.cfg{hook = hook, reload = {file = spec.path, names = {"hook"}}})
]], top or "", temperature, body or "")
end

local function write(path, text)   -- in place, like an editor that truncates and writes
  local f = assert(io.open(path, "w"))
  f:write(text)
  f:close()
end

local function lines(dir)   -- the run directory is dir/run (dir holds the recipe)
  local steps, events = {}, {}
  for line in io.lines(dir .. "/run/metrics.jsonl") do
    local obj = json.decode(line)
    if obj.event then events[#events + 1] = obj else steps[obj.step] = obj end
  end
  return steps, events
end

local function of_kind(events, kind)
  local out = {}
  for _, e in ipairs(events) do if e.event == kind then out[#out + 1] = e end end
  return out
end

-- The one reload_error of a run: its phase and step checked, the event returned.
local function only_error(events, phase, step)
  local bad = of_kind(events, "reload_error")
  assert.are.equal(1, #bad)
  assert.are.equal(phase, bad[1].phase)
  assert.are.equal(step, bad[1].step)
  return bad[1]
end

describe("train.run reload", function()
  local dir, path, runs, stderr, real_stderr

  -- Run the recipe at `path` in-process; on_step(step) is called from its hook.
  local function start(text, on_step)
    write(path, text)
    runs = 0
    local env = {path = path, on_step = on_step}
    package.loaded["reload_spec.env"] = env
    env.cfg = function(over)
      runs = runs + 1
      m.manual_seed(0)
      local model = nn.Transformer.new{vocab = 256, dim = 16, layers = 1, heads = 2, kv_heads = 1, ffn = 24,
                                       experts = 4, topk = 2, seed = 0, checkpoint = "none"}
      local ds = data.open{glob = "/usr/include/std*.h", seq_len = SEQ, seed = 0, holdout = 0.01}
      local groups = model:param_groups{weight_decay = 0.1}
      local cfg = {model = model, data = ds, optimizer = optim.AdamW(groups, {lr = 3e-3}), groups = groups,
                   seq_len = SEQ, steps = 6, lr = sched.constant(3e-3), run_dir = dir .. "/run", log_every = 1e9}
      for k, v in pairs(over) do cfg[k] = v end
      return cfg
    end
    local r = dofile(path)
    assert.are.equal(1, runs, "re-reading the recipe started another training")
    return r
  end

  local function temperatures(steps)
    local t = {}
    for s = 0, 5 do t[#t + 1] = steps[s].temperature end
    return table.concat(t, " ")
  end

  before_each(function()
    dir = support.make_tmpdir()
    path = dir .. "/recipe.lua"
    stderr = {}
    real_stderr = io.stderr
    io.stderr = {write = function(self, ...)      -- luacheck: ignore 122
      for _, s in ipairs({...}) do stderr[#stderr + 1] = tostring(s) end
      return self
    end}
  end)
  after_each(function()
    io.stderr = real_stderr                        -- luacheck: ignore 122
    package.loaded["reload_spec.env"] = nil
    support.remove_dir(dir)
  end)

  it("takes an edited hook at the next step and logs the reload", function()
    local new = recipe("0.25")
    local r = start(recipe("0.5"), function(step) if step == 2 then write(path, new) end end)
    assert.are.equal(5, #r.losses)
    local steps, events = lines(dir)
    assert.are.equal("0.5 0.5 0.5 0.25 0.25 0.25", temperatures(steps))
    local ev = of_kind(events, "reload")
    assert.are.equal(1, #ev)
    assert.are.equal(3, ev[1].step)
    assert.are.equal(path, ev[1].file)
    assert.are.equal(fs.sha256_string(new), ev[1].hash)
    assert.are.equal(0, #of_kind(events, "reload_error"))
    assert.are.equal("", table.concat(stderr))
  end)

  it("retries a half-written file and keeps the old hooks meanwhile", function()
    local new = recipe("0.25")
    local r = start(recipe("0.5"), function(step)
      if step == 1 then write(path, new:sub(1, #new // 2)) end   -- cut mid-function: a syntax error
      if step == 3 then write(path, new) end
    end)
    assert.are.equal(5, #r.losses)
    local steps, events = lines(dir)
    assert.are.equal("0.5 0.5 0.5 0.5 0.25 0.25", temperatures(steps))
    local bad = of_kind(events, "reload_error")
    assert.are.equal(1, #bad)                        -- reported once, though checked at steps 2 and 3
    assert.are.equal("syntax", bad[1].phase)
    assert.are.equal(2, bad[1].step)
    assert.matches("recipe%.lua", bad[1].error)
    assert.are.equal(4, of_kind(events, "reload")[1].step)
    assert.matches("reload of .* at step 2 failed %(syntax%)", table.concat(stderr))
  end)

  it("keeps the old hooks when the file raises while loading", function()
    local r = start(recipe("0.5"), function(step)
      if step == 1 then write(path, recipe("0.25", nil, "error('not today')")) end
    end)
    assert.are.equal(5, #r.losses)
    local steps, events = lines(dir)
    assert.are.equal("0.5 0.5 0.5 0.5 0.5 0.5", temperatures(steps))
    assert.matches("not today", only_error(events, "load", 2).error)
    assert.are.equal(0, #of_kind(events, "reload"))
    assert.matches("not today", table.concat(stderr))
  end)

  it("goes back to the previous hook when a reloaded one raises", function()
    local r = start(recipe("0.5"), function(step)
      if step == 1 then write(path, recipe("0.25", "if step >= 4 then error('bad hook') end")) end
    end)
    assert.are.equal(5, #r.losses)
    local steps, events = lines(dir)
    -- reloaded at step 2; it raises at step 4, where the old hook runs instead
    assert.are.equal("0.5 0.5 0.25 0.25 0.5 0.5", temperatures(steps))
    assert.are.equal(2, of_kind(events, "reload")[1].step)
    assert.matches("bad hook", only_error(events, "call", 4).error)
    assert.matches("reload of .* at step 4 failed %(call%): hook: .*bad hook", table.concat(stderr))
  end)

  it("goes back to the previous hook when a reloaded one sets a control out of range or unknown", function()
    for _, c in ipairs({{"-0.25", nil, "temperature must be a finite number > 0 .*got %-0%.25"},
                        {"0.25", "ctl.tempreature = 0.2", "unknown control 'tempreature'"}}) do
      local r = start(recipe("0.5"), function(step)
        if step == 1 then write(path, recipe(c[1], c[2])) end
      end)
      assert.are.equal(5, #r.losses)
      local steps, events = lines(dir)
      assert.are.equal("0.5 0.5 0.5 0.5 0.5 0.5", temperatures(steps))
      assert.matches("^hook: " .. c[3], only_error(events, "call", 2).error)
      support.remove_dir(dir .. "/run")
    end
  end)

  it("refuses the recipe's own hook setting an unknown control, before the first step", function()
    local err = support.errmsg(start, recipe("0.5", "ctl.tempreature = 0.2"), function() end)
    assert.matches("moelua.train: step 0: the hook's ctl: unknown control 'tempreature' %(one of temperature, ", err)
  end)

  it("rejects a hook that cannot be reloaded", function()
    assert.matches("not a reloadable hook",
                   support.errmsg(start, recipe("0.5"):gsub('names = {"hook"}', 'names = {"lr"}'),
                                  function() end))
  end)
end)
