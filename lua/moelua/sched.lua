-- moelua.sched: schedules as plain functions of the step, for recipes to
-- call from their per-step hook (learning rate, temperature, gate noise,
-- eps, loss weights). A schedule is a pure function of the step, so a
-- resumed run recomputes every value exactly and nothing needs saving.
--
--   local lr = sched.warmup_cosine{peak = 3e-4, warmup = 100, total = 10000, min = 3e-5}
--   local tau = sched.exponential{start = 1.0, factor = 0.99, every = 1000}
--   local tau2 = sched.piecewise_linear{{0, 2.0}, {5000, 1.0}, {10000, 0.5}}
--   print(lr(0), lr(100), tau(2500))
local options = require "moelua.options"

local sched = {}

local function finite(v) return type(v) == "number" and v == v and v > -math.huge and v < math.huge end

local NUMBER = {"number"}   -- required, finite
local WARMUP = {peak = NUMBER, warmup = NUMBER, total = NUMBER, min = {"number", false}}
local EXPONENTIAL = {start = NUMBER, factor = NUMBER, every = {"number", min = 1}}

-- opts checked against spec (moelua.options.check's): an unknown key is
-- named as such, not as the missing one it stands for.
local function check(opts, fn, spec)
  if opts == nil then error(string.format("moelua.sched.%s: options must be a table, got nil", fn), 3) end
  -- raised at the schedule's caller: past this closure, options.check, check and the schedule
  local function fail(fmt, ...) error("moelua.sched." .. fn .. ": " .. fmt:format(...), 5) end
  local o = options.check(opts, spec, fail)
  return o
end

-- Linear warmup from 0 to peak over `warmup` steps (step 0 gives peak/warmup,
-- so no step trains at lr 0), then `decay(progress)` from peak to min.
local function warmup_then(opts, fn, decay)
  local o = check(opts, fn, WARMUP)
  local peak, warmup, total, min = o.peak, o.warmup, o.total, o.min or 0
  if warmup < 0 or total <= warmup then
    error(string.format("moelua.sched.%s: need 0 <= warmup < total (got %g and %g)", fn, warmup, total), 2)
  end
  return function(step)
    if step < warmup then return peak * (step + 1) / warmup end
    local p = math.min(1, (step - warmup) / (total - warmup))
    return min + (peak - min) * decay(p)
  end
end

function sched.warmup_cosine(opts)
  return warmup_then(opts, "warmup_cosine", function(p) return 0.5 * (1 + math.cos(math.pi * p)) end)
end

function sched.warmup_linear(opts)
  return warmup_then(opts, "warmup_linear", function(p) return 1 - p end)
end

function sched.constant(v)
  if not finite(v) then
    error("moelua.sched.constant: expected a finite number, got " ..
          (type(v) == "number" and tostring(v) or type(v)), 2)
  end
  return function() return v end
end

-- start * factor ^ floor(step / every): report 1's temperature 1.0 x0.99 every 1000 steps
function sched.exponential(opts)
  local o = check(opts, "exponential", EXPONENTIAL)
  local start, factor, every = o.start, o.factor, o.every
  return function(step) return start * factor ^ (step // every) end
end

-- Linear between {step, value} knots, flat outside them: report 3's
-- two-phase temperature {{0, 2.0}, {half, 1.0}, {total, 0.5}}.
function sched.piecewise_linear(knots)
  if type(knots) ~= "table" or #knots < 1 then
    error("moelua.sched.piecewise_linear: expected a list of {step, value} knots", 2)
  end
  for i, k in ipairs(knots) do
    if type(k) ~= "table" or not finite(k[1]) or not finite(k[2]) then
      error(string.format("moelua.sched.piecewise_linear: knot %d must be {step, value}, two finite numbers", i), 2)
    end
    if i > 1 and k[1] <= knots[i - 1][1] then
      error(string.format("moelua.sched.piecewise_linear: knot steps must increase (knot %d)", i), 2)
    end
  end
  return function(step)
    if step <= knots[1][1] then return knots[1][2] end
    for i = 2, #knots do
      local a, b = knots[i - 1], knots[i]
      if step <= b[1] then return a[2] + (b[2] - a[2]) * (step - a[1]) / (b[1] - a[1]) end
    end
    return knots[#knots][2]
  end
end

return sched
