-- Issue 9's trainer findings, each planted: rollbacks that converge (a
-- cumulative data skip, max_rollbacks, a back-off that compounds), run
-- directories that are never overwritten silently, every control in
-- metrics.jsonl, balance alarms that fire at top-2 and not on a balanced
-- run, and the console's step numbers.
local m = require "moelua"
local nn = require "moelua.nn"
local optim = require "moelua.optim"
local sched = require "moelua.sched"
local data = require "moelua.data"
local train = require "moelua.train"
local ckpt = require "moelua.ckpt"
local balance = require "moelua.balance"
local json = require "dkjson"
local support = require "tests.support"

local SEQ = 32

-- A tiny model whose loss is NaN on the batches in `bad` (by batch index):
-- a planted bad batch that makes its step skipped, and with max_skipped = 1
-- rolls back. Returns train.run's cfg (overridden by over) and the list of
-- batch indices the run read.
local function planted(bad, over)
  m.manual_seed(0)
  local model = nn.Transformer.new{vocab = 256, dim = 16, layers = 1, heads = 2, kv_heads = 1, ffn = 24,
                                   experts = 4, topk = 2, seed = 0, checkpoint = "moe"}
  local ds = data.open{glob = "/usr/include/std*.h", seq_len = SEQ, seed = 0, holdout = 0.01}
  local read, current = {}, nil
  local batch = ds.batch
  ds.batch = function(self, i) current = i; read[#read + 1] = i; return batch(self, i) end
  local forward = model.forward
  model.forward = function(self, tokens, s)
    local l, st = forward(self, tokens, s)
    if bad[current] then return 0 / 0, st end
    return l, st
  end
  local groups = model:param_groups{weight_decay = 0.1}
  local cfg = {model = model, data = ds, optimizer = optim.AdamW(groups, {lr = 1e-3}), groups = groups,
               seq_len = SEQ, steps = 12, lr = sched.constant(1e-3), ckpt_every = 5, keep = 3,
               rollback = {max_skipped = 1}}
  for k, v in pairs(over or {}) do cfg[k] = v end
  return cfg, read
end

local lines, events = support.metrics, support.metrics

describe("rollbacks", function()
  local dir
  before_each(function() dir = support.make_tmpdir() end)
  after_each(function() support.remove_dir(dir) end)

  it("skip cumulatively: two bad batches after one checkpoint end in two rollbacks, not a loop", function()
    -- checkpoint at step 4; batch 6 is bad (rollback, skip 2), then the replay
    -- reaches batch 8 at step 6: a skip of 2 again (the old code) would read
    -- batch 8 at step 6 forever; cumulative, it skips 4 and goes on
    local cfg, read = planted({[6] = true, [8] = true}, {run_dir = dir})
    local r = train.run(cfg)
    assert.are.equal(2, r.rollbacks)
    local ev = events(dir, "rollback")
    assert.are.equal(2, #ev)
    assert.are.same({2, 4}, {ev[1].data_offset, ev[2].data_offset})
    assert.are.same({5, 5}, {ev[1].resume_step, ev[2].resume_step})
    local n6, n8 = 0, 0
    for _, i in ipairs(read) do
      if i == 6 then n6 = n6 + 1 elseif i == 8 then n8 = n8 + 1 end
    end
    assert.are.same({1, 1}, {n6, n8})        -- each bad batch read once, never again
  end)

  it("skip a step whose router meets a NaN (a kernel's error, not a loss) and roll back past it", function()
    -- batch 6 poisons the router's gate: its forward raises "NaN in router logits"
    local cfg, read = planted({}, {run_dir = dir})
    local gate
    for _, p in ipairs(cfg.model:named_parameters()) do
      if p.name:find("block_sparse_moe.gate.weight", 1, true) then gate = p.tensor end
    end
    local batch = cfg.data.batch
    cfg.data.batch = function(self, i)
      if i == 6 then gate:fill_(0 / 0) end
      return batch(self, i)
    end
    local r = train.run(cfg)
    assert.are.equal(1, r.rollbacks)
    local skipped = {}
    for _, o in ipairs(lines(dir)) do if o.skipped_total and o.nonfinite then skipped[#skipped + 1] = o end end
    assert.are.equal(1, #skipped)
    assert.are.equal("moelua.router.forward: NaN in router logits", skipped[1].nonfinite)
    assert.is_true(r.final_loss == r.final_loss)   -- the restored gate trained on to a finite loss
    local n6 = 0
    for _, i in ipairs(read) do if i == 6 then n6 = n6 + 1 end end
    assert.are.equal(1, n6)
  end)

  it("stop, saying so, when steps are skipped in a row and no good checkpoint exists", function()
    local bad = setmetatable({}, {__index = function(_, i) return i >= 1 end})
    local cfg = planted(bad, {run_dir = dir, rollback = {max_skipped = 2}})
    local err = support.errmsg(train.run, cfg)
    assert.matches("moelua.train: 2 steps skipped in a row at step 2 %(a non%-finite loss or gradient norm%), " ..
                   "and no good checkpoint to roll back to: stopping%. Nothing was saved", err)
    local stop = events(dir, "stopped")
    assert.are.equal(1, #stop)
    assert.are.equal("skipped steps", stop[1].reason)
    assert.is_nil(ckpt.latest(dir .. "/ckpt"))
    -- every step has its line, the one that stopped the run too, before the stop
    local all = lines(dir)
    local last = all[#all - 1]
    assert.are.same({2, true, nil}, {last.step, last.skipped, last.event})
    assert.are.equal("stopped", all[#all].event)
  end)

  it("roll back past checkpoints followed by a skipped step: they are not good", function()
    local cfg = planted({[3] = true, [4] = true, [5] = true}, {run_dir = dir, ckpt_every = 1, keep = 10,
                                                            rollback = {max_skipped = 3}})
    local r = train.run(cfg)
    assert.are.equal(1, r.rollbacks)
    local ev = events(dir, "rollback")
    assert.are.equal(dir .. "/ckpt/step-000001", ev[1].to)   -- step 2's is followed by the first skip
    assert.are.equal(5, ev[1].step)
  end)

  it("roll back past the checkpoint that holds the update a loss spike comes from", function()
    -- the update of step 8 is planted as bad: the loss of step 9, the first
    -- to see its weights, spikes; step 8's checkpoint holds that update, so
    -- the rollback goes to step 7's (which step 8 judged good)
    local cfg = planted({}, {run_dir = dir, ckpt_every = 1, keep = 10, steps = 11,
                             rollback = {window = 3, spike_sigma = 6}})
    local forward, step_of = cfg.model.forward, nil
    cfg.model.forward = function(self, tokens, s)
      local l, st = forward(self, tokens, s)
      step_of = s
      if s == 9 and not self.spiked then self.spiked = true; return l * 100, st end
      return l, st
    end
    -- as a client's set{lr_scale = 0.5} leaves it: the event says what was in force
    cfg.attach = require("moelua.remote").listen(dir, {steps = 11})
    cfg.attach.overrides.lr_scale = 0.5
    finally(function() cfg.attach:close() end)
    local r = train.run(cfg)
    assert.are.equal(1, r.rollbacks)
    local ev = events(dir, "rollback")
    assert.are.equal("loss spike", ev[1].reason)
    assert.are.equal(9, ev[1].step)
    assert.are.equal(dir .. "/ckpt/step-000007", ev[1].to)   -- not step-000008
    assert.are.same({lr_scale = 0.5}, ev[1].overrides)
    assert.are.equal(10, step_of)
  end)

  it("roll back, in a resumed run, to the checkpoint its first step judged good", function()
    train.run((planted({}, {run_dir = dir, steps = 7})))   -- step 4 saved (every 5), step 6 the final
    -- step 4's is good (step 5 stood); step 6's waits for a step after it
    assert.are.equal(dir .. "/ckpt/step-000004", ckpt.last_good(dir .. "/ckpt"))
    local cfg = planted({[8] = true}, {run_dir = dir, resume = dir .. "/ckpt"})
    local r = train.run(cfg)
    assert.are.equal(1, r.rollbacks)
    local ev = events(dir, "rollback")
    assert.are.equal(dir .. "/ckpt/step-000006", ev[1].to)
    assert.are.equal(7, ev[1].resume_step)
  end)

  it("save the last step once when a save every N steps just wrote it", function()
    train.run((planted({}, {run_dir = dir, steps = 10})))   -- saves every 5: steps 4 and 9
    local saves = events(dir, "checkpoint")
    assert.are.same({4, 9}, {saves[1].step, saves[2].step})
    assert.are.equal(2, #saves)
    assert.are.equal(dir .. "/ckpt/step-000004", ckpt.last_good(dir .. "/ckpt"))   -- no step after 9's
  end)

  it("stop after max_rollbacks with a clear message, keeping the last good checkpoint", function()
    local bad = setmetatable({}, {__index = function(_, i) return i >= 6 end})   -- every batch from 6 on
    local cfg = planted(bad, {run_dir = dir, rollback = {max_skipped = 1, max_rollbacks = 2}})
    local err = support.errmsg(train.run, cfg)
    assert.matches("skipped steps at step %d+, and 2 rollbacks to .*step%-000004 did not get past it " ..
                   "%(max_rollbacks 2%): stopping%. The last good checkpoint is .*step%-000004", err)
    assert.are.equal(2, #events(dir, "rollback"))
    local stop = events(dir, "stopped")
    assert.are.equal(1, #stop)
    assert.are.equal(2, stop[1].rollbacks)
    assert.are.equal(dir .. "/ckpt/step-000004", ckpt.last_good(dir .. "/ckpt"))
    assert.is_not_nil(ckpt.load(dir .. "/ckpt/step-000004").trainer)
  end)

  it("log a rollback that a Ctrl-C stops before its replay, and save the restored step", function()
    local pid = math.tointeger(io.open("/proc/self/stat"):read("n"))
    -- pressed in on_rollback, inside the held bookkeeping: the run stops after the restore
    local cfg = planted({[6] = true}, {run_dir = dir,
                                       on_rollback = function() io.popen("kill -INT " .. pid):close() end})
    assert.matches("interrupted at step 5; saved .*step%-000004", support.errmsg(train.run, cfg))
    local ev = events(dir, "rollback")
    assert.are.equal(1, #ev)
    assert.are.same({6, dir .. "/ckpt/step-000004"}, {ev[1].step, ev[1].to})
  end)

  it("give on_rollback the live recipe state: a back-off compounds, and each event carries its lr scale", function()
    local seen = {}
    local cfg = planted({[6] = true, [8] = true}, {
      run_dir = dir, state = {},
      hook = function(_, state, ctl) ctl.lr_scale = state.lr_scale or 1 end,
      on_rollback = function(state, _) state.lr_scale = (state.lr_scale or 1) * 0.5; seen[#seen + 1] = state.lr_scale end,
    })
    train.run(cfg)
    assert.are.same({0.5, 0.25}, seen)
    local ev = events(dir, "rollback")
    assert.are.same({0.5, 0.25}, {ev[1].lr_scale, ev[2].lr_scale})
    assert.are.equal(0.25 * 1e-3, ev[2].lr)
    -- the event is written where the replay starts: right before the resumed step's line
    local ls = lines(dir)
    for i, o in ipairs(ls) do
      if o.event == "rollback" then assert.are.equal(o.resume_step, ls[i + 1].step) end
    end
  end)
end)

describe("run directories", function()
  local dir
  before_each(function() dir = support.make_tmpdir() end)
  after_each(function() support.remove_dir(dir) end)

  it("refuse a directory holding a run, naming --resume and --overwrite, before writing anything", function()
    train.run((planted({}, {run_dir = dir, steps = 2, ckpt_every = 1})))
    local before = support.read_file(dir .. "/metrics.jsonl")
    local ckpts = ckpt.list(dir .. "/ckpt")
    local err = support.errmsg(train.run, (planted({}, {run_dir = dir, steps = 3})))
    assert.matches("run directory '.*' already holds a run %(ckpt, metrics%.jsonl%); nothing was written", err)
    assert.matches("%-%-resume .*/ckpt", err)
    assert.matches("%-%-overwrite", err)
    assert.are.equal(before, support.read_file(dir .. "/metrics.jsonl"))
    assert.are.same(ckpts, ckpt.list(dir .. "/ckpt"))
    -- --overwrite with --resume of the same run would remove the checkpoint it resumes from
    err = support.errmsg(train.run, (planted({}, {run_dir = dir, steps = 3, resume = dir .. "/ckpt", overwrite = true})))
    assert.matches("%-%-overwrite would remove the checkpoint %-%-resume .*/ckpt continues from", err)
    assert.are.equal(before, support.read_file(dir .. "/metrics.jsonl"))
    assert.are.same(ckpts, ckpt.list(dir .. "/ckpt"))
    -- train.plan refuses it too, before planning
    local cfg = planted({}, {run_dir = dir})
    cfg.build = function() return cfg.model, cfg.optimizer, cfg.groups end
    assert.matches("already holds a run", support.errmsg(train.plan, cfg))
    -- a directory of the user's own files is not called a run
    local own = dir .. "/own"
    require("moelua.fs").mkdir_p(own)
    support.write_file(own .. "/notes.txt", "mine\n")
    assert.are.equal("moelua.train: run directory '" .. own .. "' holds other files (notes.txt), not a run; nothing " ..
                     "was written. Choose a new or empty --run-dir (--overwrite would write metrics.jsonl, ckpt and " ..
                     "plots beside them)", support.errmsg(train.run, (planted({}, {run_dir = own}))))
    assert.are.equal("mine\n", support.read_file(own .. "/notes.txt"))
    -- a --resume that names nothing: said before planning, by both
    cfg = planted({}, {run_dir = dir .. "/new", resume = dir .. "/nothing/ckpt"})
    cfg.build = function() return cfg.model, cfg.optimizer, cfg.groups end
    local none = "moelua.train: --resume " .. dir .. "/nothing/ckpt: no such checkpoint (it does not exist); " ..
                 "nothing was written"
    assert.are.equal(none, support.errmsg(train.plan, cfg))
    assert.are.equal(none, support.errmsg(train.run, (planted({}, {run_dir = dir .. "/new",
                                                                   resume = dir .. "/nothing/ckpt"}))))
    assert.is_nil(require("moelua.fs").stat(dir .. "/new"))
    -- a run stopped before its first checkpoint: no --resume to suggest
    local bare = dir .. "/bare"
    require("moelua.fs").mkdir_p(bare)
    support.write_file(bare .. "/metrics.jsonl", "{}\n")
    err = support.errmsg(train.run, (planted({}, {run_dir = bare})))
    assert.matches("already holds a run %(metrics%.jsonl%); nothing was written%. It holds no checkpoint to " ..
                   "continue from: replace it with %-%-overwrite", err)
  end)

  it("refuse a directory another job holds (its lock), resumed or overwritten, before writing anything", function()
    local fs = require "moelua.fs"
    train.run((planted({}, {run_dir = dir, steps = 2, ckpt_every = 1})))
    local before, ckpts = support.read_file(dir .. "/metrics.jsonl"), ckpt.list(dir .. "/ckpt")
    -- another job: a lock of its own on the file (flock is per open file, so this process counts as one)
    local other = assert(fs.lock(dir .. "/lock"))
    for _, over in ipairs({{resume = dir .. "/ckpt", steps = 4}, {overwrite = true}}) do
      over.run_dir = dir
      local err = support.errmsg(train.run, (planted({}, over)))
      local pid = support.read_file(dir .. "/lock"):match("^(%d+)\n$")
      assert.is_true(err:find("run directory '" .. dir .. "' is in use by another job (process " .. pid ..
                              " holds " .. dir .. "/lock)", 1, true) ~= nil, err)
      assert.matches("nothing was written$", err)
      assert.are.equal(before, support.read_file(dir .. "/metrics.jsonl"))
      assert.are.same(ckpts, ckpt.list(dir .. "/ckpt"))
    end
    other:release()   -- the job ended: its directory resumes (the lock file is not a run's content)
    local r = train.run((planted({}, {run_dir = dir, resume = dir .. "/ckpt", steps = 3})))
    assert.are.equal(2, r.first_step)
  end)

  it("append when resuming from a checkpoint of the same run, and refuse one from elsewhere", function()
    train.run((planted({}, {run_dir = dir .. "/a", steps = 2, ckpt_every = 1})))
    train.run((planted({}, {run_dir = dir .. "/b", steps = 2, ckpt_every = 1})))
    local n = #lines(dir .. "/a")
    train.run((planted({}, {run_dir = dir .. "/a", steps = 4, resume = dir .. "/a/ckpt"})))
    local ls = lines(dir .. "/a")
    assert.is_true(#ls > n)
    assert.are.equal("resume", ls[n + 1].event)
    local err = support.errmsg(train.run, (planted({}, {run_dir = dir .. "/a", steps = 5,
                                                        resume = dir .. "/b/ckpt"})))
    assert.matches("is not one of its checkpoints", err)
  end)

  it("--overwrite removes only what a run wrote", function()
    train.run((planted({}, {run_dir = dir, steps = 2, ckpt_every = 1})))
    support.write_file(dir .. "/notes.txt", "mine\n")
    m.fs.mkdir_p(dir .. "/plots")
    train.run((planted({}, {run_dir = dir, steps = 1, overwrite = true})))
    assert.are.equal("mine\n", support.read_file(dir .. "/notes.txt"))
    assert.is_nil(m.fs.stat(dir .. "/plots"))
    local steps = {}
    for _, o in ipairs(lines(dir)) do if not o.event then steps[#steps + 1] = o.step end end
    assert.are.same({0}, steps)                 -- a fresh metrics.jsonl: step 0 once
    local list = ckpt.list(dir .. "/ckpt")
    assert.are.same({dir .. "/ckpt/step-000000"}, {list[1].dir, list[2] and list[2].dir})
  end)
end)

describe("metrics", function()
  it("log every control of every step, and attach's overrides", function()
    local dir = support.make_tmpdir()
    local srv = {overrides = {noise = 0.25}, poll = function() end, position = function() end,
                 safe_point = function() end, finish = function() end}
    local cfg = planted({}, {run_dir = dir, steps = 2, attach = srv,
                             hook = function(_, _, ctl)
                               ctl.temperature, ctl.eps = 0.7, 0.02
                               ctl.aux_weight, ctl.z_weight, ctl.lr_scale = 0.03, 2e-3, 0.5
                             end})
    train.run(cfg)
    for _, o in ipairs(lines(dir)) do
      if not o.event then
        assert.are.same({0.7, 0.25, 0.02, 0.03, 2e-3, 0.5},
                        {o.temperature, o.noise, o.eps, o.aux_weight, o.z_weight, o.lr_scale})
        assert.are.same({noise = 0.25}, o.overrides)
      end
    end
    support.remove_dir(dir)
  end)
end)

describe("balance alarms", function()
  it("use thresholds that fire on the collapsed top-2 layer of issue 9 and not on a balanced one", function()
    local b = balance.layer({231, 3, 255, 23}, 2)
    assert.are.equal(1.75, b.thresholds.hot)
    assert.are.equal(1.8, b.thresholds.collapse)
    assert.are.same({0, 2}, b.hot)
    assert.is_true(b.collapsed)
    assert.near(486 / 512 / 0.5, b.topk_ratio, 1e-12)
    assert.near(255 * 4 / 512, b.max_ratio, 1e-12)
    assert.are.equal(2, b.busiest)
    local even = balance.layer({130, 126, 131, 125}, 2)
    assert.are.same({}, even.hot)
    assert.is_false(even.collapsed)
    assert.are.same({}, even.dead)
    assert.are.same({1}, balance.layer({5, 0, 3, 4}, 1).dead)
    assert.are.equal(1 + 0.75 * 3, balance.thresholds(8, 2).hot)   -- scales with E/k
  end)

  it("fire once per episode as events and callbacks, and roll back on a lasting collapse", function()
    local dir = support.make_tmpdir()
    local got = {}
    -- a collapsed router, planted from step 4 on: layer loads replaced by
    -- [231, 3, 255, 23]. Step 2's checkpoint is good, step 5's (inside the
    -- collapse) is not: the collapse held 4 steps (at step 7) rolls back to
    -- step 2, recurs, and the second rollback is over max_rollbacks.
    local cfg = planted({}, {run_dir = dir, steps = 12, ckpt_every = 3,
                             alarms = {hot_steps = 2, dead_steps = 3},
                             rollback = {collapse_steps = 4, max_rollbacks = 1},
                             on_alarm = function(_, a, model) got[#got + 1] = a.kind; assert.is_table(model.blocks) end})
    support.plant_collapse(cfg.model, 4, math.huge, {231, 3, 255, 23})
    local err = support.errmsg(train.run, cfg)
    assert.matches("router collapse", err)             -- max_rollbacks 1: the second collapse stops the run
    local alarms = events(dir, "alarm")
    local kinds = {}
    for _, a in ipairs(alarms) do kinds[a.kind] = (kinds[a.kind] or 0) + 1 end
    assert.is_true(kinds.hot >= 2 and kinds.collapse >= 1, json.encode(kinds))
    assert.are.equal(#alarms, #got)
    local first = alarms[1]
    assert.are.equal(1, first.layer)
    assert.are.equal(2, first.steps)
    assert.are.equal(1, #events(dir, "rollback"))
    for _, o in ipairs(lines(dir)) do        -- hot 0, hot 2, collapse: listed at every planted step
      if not o.event then assert.are.equal(o.step >= 4 and 3 or 0, #o.alarms) end
    end
    assert.are.equal(dir .. "/ckpt/step-000002", ckpt.last_good(dir .. "/ckpt"))
    support.remove_dir(dir)
  end)
end)

describe("the console", function()
  it("numbers steps as metrics do, shows validation and in-step progress, and never glues a message", function()
    local dir = support.make_tmpdir()
    local out, real = {}, io.stdout
    local fake = {write = function(self, ...) for _, v in ipairs({...}) do out[#out + 1] = tostring(v) end return self end,
                  flush = function() end}
    local cfg = planted({[3] = true}, {run_dir = dir, steps = 6, ckpt_every = 2, val_every = 2, val_batches = 1,
                                        tty = true, progress_after = 0,
                                        on_rollback = function(_, ev) io.stdout:write("rollback at ", ev.step, "\n") end})
    io.stdout = fake
    local ok, err = pcall(train.run, cfg)
    io.stdout = real
    assert.is_true(ok, tostring(err))
    local text = table.concat(out)
    assert.truthy(text:find("\r\27[Krollback at 3\n", 1, true), text)   -- the progress line cleared first
    assert.matches("step 5/5  loss [%d.]+  val [%d.]+", text)   -- the last step is 5, as in metrics.jsonl
    assert.matches("step 2/5  forward, layer 1 of 1", text)
    assert.matches("step 2/5  backward, layer 1 of 1", text)
    local last = 0
    for _, o in ipairs(lines(dir)) do if not o.event then last = o.step end end
    assert.are.equal(5, last)
    support.remove_dir(dir)
  end)

  it("prints a user error (a bad option value) without a traceback, naming the option", function()
    for _, bad in ipairs({{"--steps", "0", "option %-%-steps must be at least 1, got 0"},
                          {"--steps", "-3", "option %-%-steps must be at least 1, got %-3"},
                          {"--eps", "2", "option %-%-eps must be below 1, got 2"},
                          {"--seq-len", "x", "option %-%-seq%-len expects a number, got 'x'"},
                          -- infinity parses as a number: refused here, not by the optimizer's or a save's checks
                          {"--lr", "1e999", "option %-%-lr must be finite, got '1e999'"},
                          {"--clip", "-1e999", "option %-%-clip must be finite, got '%-1e999'"}}) do
      local p = assert(io.popen(support.host_command({"recipes/tiny.lua", bad[1], bad[2]}) .. " 2>&1"))
      local code, text = support.finish_child(p)
      assert.are.equal(1, code, text)
      assert.matches(bad[3], text)
      assert.is_nil(text:find("stack traceback", 1, true), text)
    end
  end)
end)
