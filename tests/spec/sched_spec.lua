-- moelua.sched: schedules are pure functions of the step.
local sched = require "moelua.sched"
local support = require "tests.support"
local errmsg = support.errmsg

local function near(a, b) assert.is_true(math.abs(a - b) <= 1e-12 * math.max(1, math.abs(b)), a .. " vs " .. b) end

describe("schedules", function()
  it("warm up linearly, then decay by cosine or linearly to min", function()
    local lr = sched.warmup_cosine{peak = 1.0, warmup = 10, total = 110, min = 0.1}
    near(lr(0), 0.1)
    near(lr(9), 1.0)
    near(lr(10), 1.0)
    near(lr(60), 0.55)
    near(lr(110), 0.1)
    near(lr(500), 0.1)
    local lin = sched.warmup_linear{peak = 2.0, warmup = 0, total = 100}
    near(lin(0), 2.0)
    near(lin(50), 1.0)
    near(lin(100), 0)
  end)

  it("anneal exponentially in steps and piecewise linearly", function()
    local tau = sched.exponential{start = 1.0, factor = 0.99, every = 1000}
    near(tau(999), 1.0)
    near(tau(1000), 0.99)
    near(tau(2500), 0.99 ^ 2)
    local two = sched.piecewise_linear{{0, 2.0}, {50, 1.0}, {100, 0.5}}
    near(two(0), 2.0)
    near(two(25), 1.5)
    near(two(75), 0.75)
    near(two(1000), 0.5)
    near(sched.constant(0.3)(12345), 0.3)
  end)

  it("refuses bad options by name", function()
    local has = support.has
    has(errmsg(sched.warmup_cosine, {warmup = 1, total = 2}),
        "moelua.sched.warmup_cosine: option 'peak' is required")
    has(errmsg(sched.warmup_cosine, {peak = 0 / 0, warmup = 1, total = 2}), "option 'peak' must be a finite number")
    has(errmsg(sched.warmup_cosine, {peak = 1, warmup = 1, total = 2, min = 1 / 0}),
        "option 'min' must be a finite number, got inf")
    -- a misspelt key is named as such, not as the missing one it stands for
    has(errmsg(sched.warmup_linear, {peak = 1, warmup = 1, totl = 3}),
        "moelua.sched.warmup_linear: unknown option 'totl' (expected one of: min, peak, total, warmup)")
    has(errmsg(sched.exponential, {start = 1, factor = 0.5, every = 1, min = 0.1}), "unknown option 'min'")
    has(errmsg(sched.exponential, {start = 1, factor = 0 / 0, every = 1}), "option 'factor' must be a finite number")
    has(errmsg(sched.piecewise_linear, {{0, 1}, {1, 0 / 0}}), "knot 2 must be {step, value}, two finite numbers")
    has(errmsg(sched.constant, 0 / 0), "moelua.sched.constant: expected a finite number")
    assert.matches("need 0 <= warmup < total", errmsg(sched.warmup_cosine, {peak = 1, warmup = 5, total = 5}))
    has(errmsg(sched.exponential, {start = 1, factor = 0.5, every = 0}),
        "option 'every' must be a finite number >= 1, got 0")
    assert.matches("knot steps must increase", errmsg(sched.piecewise_linear, {{0, 1}, {0, 2}}))
    has(errmsg(sched.constant, "x"), "moelua.sched.constant: expected a finite number, got string")
  end)
end)
