-- moelua.plot and `moelua plot RUN_DIR`: SVGs of a real tiny run (with a
-- validation and a rollback) and of hand-written metrics.jsonl files (repeated
-- and close rollbacks: which steps are faint, the labels' boxes, the replayed
-- steps' markers, read back from the SVG); each file is well-formed XML (a
-- strict checker below) with the expected series; bad input gives a clear error.
local m = require "moelua"
local nn = require "moelua.nn"
local optim = require "moelua.optim"
local sched = require "moelua.sched"
local data = require "moelua.data"
local train = require "moelua.train"
local plot = require "moelua.plot"
local json = require "dkjson"
local support = require "tests.support"

-- A strict XML 1.0 well-formedness check of the subset SVG uses (no DTD):
-- returns true, or nil and "offset N: what". Checks names, quoted unique
-- attributes, entity and character references, '<' and '&' in text and
-- attributes, nesting, one root element, and nothing but misc after it.
local NAME = "^[%a_:][%w_:%.%-]*"
local function check_refs(s, where)
  for ref in s:gmatch("&([^;]*);?") do
    if not (ref == "amp" or ref == "lt" or ref == "gt" or ref == "quot" or ref == "apos"
            or ref:match("^#%d+$") or ref:match("^#x%x+$")) then
      return nil, where .. ": bad reference &" .. ref
    end
  end
  local i = 1
  while true do
    local a = s:find("&", i, true)
    if not a then break end
    if not s:find("^&[#%w]+;", a) then return nil, where .. ": bare &" end
    i = a + 1
  end
  return true
end

local function xml_check(doc)
  local pos, stack, roots = 1, {}, 0
  if doc:sub(1, 5) == "<?xml" then
    local e = doc:find("?>", 1, true)
    if not e then return nil, "unterminated XML declaration" end
    pos = e + 2
  end
  while pos <= #doc do
    local lt = doc:find("<", pos, true)
    local text = doc:sub(pos, (lt or #doc + 1) - 1)
    if #stack == 0 and text:find("%S") then return nil, "offset " .. pos .. ": text outside the root" end
    local ok, err = check_refs(text, "offset " .. pos)
    if not ok then return nil, err end
    if text:find(">", 1, true) and text:find("]]>", 1, true) then return nil, "offset " .. pos .. ": ]]> in text" end
    if not lt then break end
    pos = lt
    if doc:sub(pos, pos + 3) == "<!--" then
      local e = doc:find("-->", pos + 4, true)
      if not e then return nil, "offset " .. pos .. ": unterminated comment" end
      pos = e + 3
    elseif doc:sub(pos, pos + 8) == "<![CDATA[" then
      if #stack == 0 then return nil, "CDATA outside the root" end
      local e = doc:find("]]>", pos, true)
      if not e then return nil, "unterminated CDATA" end
      pos = e + 3
    elseif doc:sub(pos, pos + 1) == "</" then
      local name = doc:match(NAME, pos + 2)
      if not name then return nil, "offset " .. pos .. ": bad end tag" end
      local e = doc:match("^%s*>()", pos + 2 + #name)
      if not e then return nil, "offset " .. pos .. ": bad end tag " .. name end
      local open = table.remove(stack)
      if open ~= name then
        return nil, string.format("offset %d: </%s> closes <%s>", pos, name, tostring(open))
      end
      pos = e
    else
      local name = doc:match(NAME, pos + 1)
      if not name then return nil, "offset " .. pos .. ": bad start tag" end
      if #stack == 0 then
        roots = roots + 1
        if roots > 1 then return nil, "offset " .. pos .. ": a second root element" end
      end
      local p = pos + 1 + #name
      local seen = {}
      while true do
        local ws, q = doc:match("^(%s*)()", p)
        p = q
        if doc:sub(p, p) == ">" then stack[#stack + 1] = name; p = p + 1; break end
        if doc:sub(p, p + 1) == "/>" then p = p + 2; break end
        if ws == "" then return nil, "offset " .. p .. ": no space before an attribute in <" .. name .. ">" end
        local an = doc:match(NAME, p)
        if not an then return nil, "offset " .. p .. ": bad attribute in <" .. name .. ">" end
        if seen[an] then return nil, "offset " .. p .. ": duplicate attribute " .. an end
        seen[an] = true
        local quote, value, after = doc:match("^%s*=%s*(['\"])()", p + #an)
        if not quote then return nil, "offset " .. p .. ": attribute " .. an .. " not quoted" end
        local close = doc:find(quote, value, true)
        if not close then return nil, "offset " .. p .. ": unterminated attribute " .. an end
        local v = doc:sub(value, close - 1)
        if v:find("<", 1, true) then return nil, "offset " .. p .. ": '<' in attribute " .. an end
        local okv, errv = check_refs(v, "attribute " .. an)
        if not okv then return nil, errv end
        p = close + 1
        local _ = after
      end
      pos = p
    end
  end
  if #stack > 0 then return nil, "unclosed <" .. stack[#stack] .. ">" end
  if roots ~= 1 then return nil, "no root element" end
  return true
end

local function count(s, pat)
  local n = 0
  for _ in s:gmatch(pat) do n = n + 1 end
  return n
end

local function check_all(paths)
  local out = {}
  for _, name in ipairs({"loss", "experts", "memory", "throughput"}) do
    assert.is_string(paths[name], name)
    local s = assert(support.read_file(paths[name]))
    local ok, err = xml_check(s)
    assert(ok, name .. ".svg: " .. tostring(err))
    assert.truthy(s:find('^<svg xmlns="http://www.w3.org/2000/svg"'), name)
    assert.is_nil(s:find("<script", 1, true), name)
    assert.is_nil(s:find("@import", 1, true), name)
    assert.is_nil(s:find("href", 1, true), name)
    out[name] = s
  end
  return out
end

-- A synthetic run: 2 layers x 3 experts, steps 0..9, a rollback at step 6
-- back to step 4 (steps 5..9 repeat), two validations, categories with
-- characters XML must escape.
local function synthetic(dir)
  local lines = {}
  local function add(obj) lines[#lines + 1] = json.encode(obj) end
  local function step(s, loss)
    add{step = s, loss = loss, ce = loss - 0.01, aux = 0.01, z = 0, lr = 1e-3, temperature = 1,
        tokens_per_s = 1000 + s * 10, skipped = false,
        ledger_peak = {total = (30 + s) * 2^20, params = 10 * 2^20, ["acts<&>"] = (20 + s) * 2^20},
        loads = {{counts = {10, 20, 30 + s}, max_share = 0.5, entropy = 1, dropped = 0},
                 {counts = {20, 20, 20}, max_share = 0.33, entropy = 1.1, dropped = 0}},
        phases = {data = 0.01, fwd = 0.1, bwd = 0.2, optim = 0.05,
                  attention = 0.1, router = 0.01, dispatch = 0.02, experts = 0.1, ce = 0.03}}
  end
  for s = 0, 6 do
    step(s, 5 - s * 0.2)
    if s == 4 then add{event = "checkpoint", step = 4, seconds = 0.3, reason = "every"} end   -- after its line
  end
  add{event = "validation", step = 3, loss = 4.5}
  add{event = "rollback", step = 6, reason = "loss spike <&>", to = dir .. "/ckpt/step-000004", resume_step = 5}
  for s = 5, 9 do step(s, 4.1 - (s - 5) * 0.1) end
  add{event = "validation", step = 9, loss = 3.9}
  support.write_file(dir .. "/metrics.jsonl", table.concat(lines, "\n") .. "\n")
end

-- The attributes of each <tag ...> in an SVG whose class list has cls.
local function elements(svg, tag, cls)
  local out = {}
  for attrs in svg:gmatch("<" .. tag .. "%s([^>]*)>") do
    local a = {}
    for k, v in attrs:gmatch('([%w%-:]+)="([^"]*)"') do a[k] = v end
    local classes = " " .. (a.class or "") .. " "
    if not cls or classes:find(" " .. cls .. " ", 1, true) then out[#out + 1] = a end
  end
  return out
end

-- The x of each point of a <path> d ("M x y L x y ...").
local function path_xs(d)
  local xs = {}
  for x in d:gmatch("[ML](%-?[%d%.]+) %-?[%d%.]+") do xs[#xs + 1] = tonumber(x) end
  return xs
end

-- One <path> of class series whose data-series is name.
local function series(svg, name)
  local found
  for _, a in ipairs(elements(svg, "path", "series")) do
    if a["data-series"] == name then
      assert.is_nil(found, "two series named " .. name)
      found = a
    end
  end
  assert.is_table(found, "no series " .. name)
  return found
end

-- A run with repeated and close rollbacks: steps 0..12 logged, rollback at
-- 12 to step 9; 9..12 again, rollback at 12 to 9; 9..15, rollback at 15 to 9;
-- 9..16, rollback at 16 to 14; 14..19. Validations at 5, 11 (abandoned by the
-- first rollback) and 19, and alarm lines in between.
local function repeated(dir)
  local lines = {}
  local function add(obj) lines[#lines + 1] = json.encode(obj) end
  local pass = 0
  local function steps(a, b)
    pass = pass + 1
    for s = a, b do
      if s == 5 or s == 11 or s == 19 then add{event = "validation", step = s, loss = 4 - s * 0.05} end
      add{step = s, loss = 5 - s * 0.1 + pass * 0.01, ce = 5 - s * 0.1, tokens_per_s = 1000 + 100 * (s % 3),
          phases = {data = 0.01, fwd = 0.1, bwd = 0.2, optim = 0.05}}
    end
  end
  local function rollback(s, r, scale)
    add{event = "rollback", step = s, reason = "loss spike", to = dir .. "/ckpt/step-" .. (r - 1),
        resume_step = r, data_offset = s, lr_scale = scale}
  end
  steps(0, 12); rollback(12, 9, 0.5)
  add{event = "alarm", step = 9, kind = "hot", layer = 1}
  steps(9, 12); rollback(12, 9, 0.25)
  steps(9, 15); rollback(15, 9, 0.125)
  steps(9, 16); rollback(16, 14, 0.0625)
  steps(14, 19)
  support.write_file(dir .. "/metrics.jsonl", table.concat(lines, "\n") .. "\n")
end

local function overlap(a, b)
  local ax, ay, aw, ah = tonumber(a.x), tonumber(a.y), tonumber(a.width), tonumber(a.height)
  local bx, by, bw, bh = tonumber(b.x), tonumber(b.y), tonumber(b.width), tonumber(b.height)
  return ax < bx + bw and bx < ax + aw and ay < by + bh and by < ay + ah
end

describe("moelua.plot", function()
  local dir
  before_each(function() dir = support.make_tmpdir() end)
  after_each(function() support.remove_dir(dir) end)

  it("plots a synthetic run: series, heatmap cells, rollback marker, escaping", function()
    synthetic(dir)
    local svg = check_all(plot.run(dir))
    -- loss: the kept training loss and its average, the rolled-back steps 5..6 faint, validation, the marker
    assert.are.equal(1, count(svg.loss, 'data%-series="training loss"'))
    assert.are.equal(1, count(svg.loss, 'data%-series="training loss, moving average"'))
    assert.are.equal(1, count(svg.loss, 'class="series abandoned"'))
    assert.are.equal(1, count(svg.loss, 'data%-series="validation loss"'))
    assert.are.equal(1, count(svg.loss, 'class="rollback"'))
    assert.truthy(svg.loss:find("rollback @6: loss spike &lt;&amp;&gt; -&gt; step-000004", 1, true))
    -- experts: 2 layers x 3 experts x 10 steps
    assert.are.equal(2, count(svg.experts, 'class="heatmap"'))
    assert.are.equal(2 * 3 * 10, count(svg.experts, 'class="cell"'))
    assert.truthy(svg.experts:find("token share", 1, true))
    -- memory: one line per category plus the total
    assert.are.equal(3, count(svg.memory, 'class="series"'))
    assert.truthy(svg.memory:find('data-series="acts&lt;&amp;&gt;"', 1, true))
    assert.truthy(svg.memory:find("MiB", 1, true))
    -- throughput: tokens/s and the stacked phases
    assert.are.equal(1, count(svg.throughput, 'data%-series="tokens/s"'))
    for _, ph in ipairs({"data", "attention", "router", "dispatch", "experts", "ce", "fwd+bwd other", "optim",
                         "checkpoint"}) do   -- checkpoint: step 4's save event
      assert.truthy(svg.throughput:find('class="phase" data-series="' .. ph .. '"', 1, true), ph)
    end
  end)

  it("plots a real tiny training run (validation, rollback) with plot.run and `moelua plot`", function()
    m.manual_seed(0)
    local model = nn.Transformer.new{vocab = 256, dim = 16, layers = 1, heads = 2, kv_heads = 1, ffn = 24,
                                     experts = 4, topk = 2, seed = 0, checkpoint = "moe"}
    local ds = data.open{glob = "/usr/include/std*.h", seq_len = 64, seed = 0, holdout = 0.01}
    local groups = model:param_groups{weight_decay = 0.1}
    local opt = optim.AdamW(groups, {lr = 3e-3, beta2 = 0.95})
    support.plant_collapse(model, 2, 4)   -- collapses at steps 2 and 3, twice: two rollbacks to step 0's
                                          -- checkpoint (step 1's is judged by step 2, collapsed)
    local r = train.run{model = model, data = ds, optimizer = opt, groups = groups, seq_len = 64, steps = 5,
                        lr = sched.constant(3e-3), clip = 1.0, run_dir = dir, ckpt_every = 1, keep = 5,
                        val_every = 2, val_batches = 1, alarms = {hot_steps = 1}, rollback = {collapse_steps = 2}}
    assert.are.equal(2, r.rollbacks)
    local svg = check_all(plot.run(dir, dir .. "/a"))
    assert.truthy(svg.loss:find(">2 rollbacks to step-000000 (@3): router collapse", 1, true))
    local rd, fired, nfired = plot.read(dir), {}, 0
    for _, e in ipairs(rd.events) do
      if e.event == "rollback" and not fired[e.step] then fired[e.step] = true; nfired = nfired + 1 end
    end
    assert.are.equal(nfired, count(svg.loss, 'class="rollback"'))   -- one line per step a rollback fired at
    assert.are.equal(#rd.abandoned, count(svg.loss, 'class="series abandoned"'))
    assert.truthy(svg.loss:find("router collapse", 1, true))
    assert.truthy(svg.loss:find('data-series="validation loss"', 1, true))
    assert.are.equal(4 * 5, count(svg.experts, 'class="cell"'))
    assert.truthy(svg.memory:find('data-series="params"', 1, true))
    -- the command line, from the run directory's parent; prints the paths
    local cmd = "cd " .. support.shell_quote(dir) .. " && " .. support.host_command({"plot", ".", "b"}) .. " 2>&1"
    local code, out = support.finish_child(assert(io.popen(cmd)))
    assert.are.equal(0, code, out)
    assert.truthy(out:find("b/loss.svg", 1, true), out)
    local again = check_all({loss = dir .. "/b/loss.svg", experts = dir .. "/b/experts.svg",
                             memory = dir .. "/b/memory.svg", throughput = dir .. "/b/throughput.svg"})
    assert.are.equal(svg.experts, again.experts)
  end)

  it("reads which steps a rollback abandoned from the log's order, and which kept steps are replays", function()
    repeated(dir)
    local r = plot.read(dir)
    local kept, loss = {}, {}
    for i, m in ipairs(r.kept) do kept[i], loss[m.step] = m.step, m.loss end
    assert.are.same({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19}, kept)
    -- the last pass over each step is the kept one
    assert.are.near(5 - 0.8 + 0.01, loss[8], 1e-12)
    assert.are.near(5 - 1.0 + 0.04, loss[10], 1e-12)
    assert.are.near(5 - 1.5 + 0.05, loss[15], 1e-12)
    assert.are.near(5 - 1.9 + 0.05, loss[19], 1e-12)
    local gone = {}
    for i, part in ipairs(r.abandoned) do
      gone[i] = {}
      for j, m in ipairs(part) do gone[i][j] = m.step end
    end
    assert.are.same({{9, 10, 11, 12}, {9, 10, 11, 12}, {9, 10, 11, 12, 13, 14, 15}, {14, 15, 16}}, gone)
    local replayed = {}
    for st in pairs(r.replayed) do replayed[#replayed + 1] = st end
    table.sort(replayed)
    assert.are.same({9, 10, 11, 12, 13, 14, 15, 16}, replayed)
    local vk, va = {}, {}
    for i, e in ipairs(r.val_kept) do vk[i] = e.step end
    for i, e in ipairs(r.val_abandoned) do va[i] = e.step end
    assert.are.same({5, 11, 19}, vk)
    assert.are.same({11, 11, 11}, va)
    -- a resume over logged steps abandons them too; so does a repeated step without an event
    support.write_file(dir .. "/metrics.jsonl", table.concat({
      '{"step":0,"loss":3}', '{"step":1,"loss":2}', '{"step":2,"loss":1}',
      '{"event":"resume","step":2,"from":"ckpt/step-000001"}', '{"step":2,"loss":1.5}', '{"step":3,"loss":1.4}',
      '{"step":3,"loss":1.3}', '{"step":4,"loss":1.2}'}, "\n") .. "\n")
    r = plot.read(dir)
    assert.are.equal(5, #r.kept)
    assert.are.equal(1.3, r.kept[4].loss)
    assert.are.equal(2, #r.abandoned)
    assert.are.equal(1, r.abandoned[1][1].loss)
    assert.are.equal(1.4, r.abandoned[2][1].loss)
  end)

  it("loss.svg: only the abandoned steps are faint, one line per abandoned stretch, and a moving average", function()
    repeated(dir)
    local svg = check_all(plot.run(dir)).loss
    local kept = series(svg, "training loss")
    assert.is_nil(kept["stroke-opacity"])
    local kx = path_xs(kept.d)
    assert.are.equal(20, #kx)   -- steps 0..19, each once
    local step_at = {}
    for i, x in ipairs(kx) do step_at[string.format("%.2f", x)] = i - 1 end
    -- every faint path is an abandoned stretch, at the x of the steps it abandoned
    local faint = {}
    for _, a in ipairs(elements(svg, "path")) do
      if a["stroke-opacity"] and tonumber(a["stroke-opacity"]) < 1 then
        assert.truthy((" " .. a.class .. " "):find(" abandoned ", 1, true), a["data-series"])
        local steps = {}
        for i, x in ipairs(path_xs(a.d)) do steps[i] = step_at[string.format("%.2f", x)] end
        faint[#faint + 1] = steps
      end
    end
    assert.are.same({{9, 10, 11, 12}, {9, 10, 11, 12}, {9, 10, 11, 12, 13, 14, 15}, {14, 15, 16}}, faint)
    assert.are.equal(4, #elements(svg, "path", "abandoned"))
    -- the moving average over the kept steps, named in the legend
    local sm = series(svg, "training loss, moving average")
    assert.truthy(sm.class:find("smoothed", 1, true))
    assert.are.same(kx, path_xs(sm.d))
    assert.truthy(svg:find("centred mean of 5 steps", 1, true))
    assert.truthy(svg:find("abandoned by a rollback or resume", 1, true))
    -- validation: the kept ones as a line, the abandoned ones as hollow markers
    assert.are.equal(3, #path_xs(series(svg, "validation loss").d))
    assert.are.equal(3, #elements(svg, "circle", "validation-abandoned"))
  end)

  it("loss.svg: repeated rollbacks to one step share one label, and no two labels overlap", function()
    repeated(dir)
    local svg = check_all(plot.run(dir)).loss
    local kx = path_xs(series(svg, "training loss").d)
    -- one dashed line at each step a rollback fired (12 twice, 15, 16)
    local lines = elements(svg, "line", "rollback")
    assert.are.equal(3, #lines)
    for i, st in ipairs({12, 15, 16}) do assert.are.equal(kx[st + 1], tonumber(lines[i].x1)) end
    assert.truthy(svg:find(">3 rollbacks to step-000008 (@12, @15): loss spike, lr x0.125</text>", 1, true))
    assert.truthy(svg:find(">rollback @16: loss spike -&gt; step-000013, lr x0.0625</text>", 1, true))
    assert.are.equal(2, #elements(svg, "text", "rollback-label"))
    local boxes = elements(svg, "rect", "rollback-label")
    assert.are.equal(2, #boxes)
    assert.is_false(overlap(boxes[1], boxes[2]))
    -- six rollbacks on six neighbouring steps: six labels, stacked clear of each other, above the plot
    local lines_ = {}
    local function add(obj) lines_[#lines_ + 1] = json.encode(obj) end
    for s = 0, 11 do add{step = s, loss = 3 - s * 0.1, tokens_per_s = 1000} end
    for s = 11, 16 do
      add{event = "rollback", step = s, reason = "skipped steps", to = "x", resume_step = s}
      add{step = s, loss = 2, tokens_per_s = 900}
      add{step = s + 1, loss = 2, tokens_per_s = 900}
    end
    support.write_file(dir .. "/metrics.jsonl", table.concat(lines_, "\n") .. "\n")
    svg = check_all(plot.run(dir)).loss
    boxes = elements(svg, "rect", "rollback-label")
    assert.are.equal(6, #boxes)
    local frame
    for _, a in ipairs(elements(svg, "rect")) do if a.fill == "#fafafa" then frame = a end end
    assert.is_table(frame)
    local rows = {}
    for i = 1, #boxes do
      for j = i + 1, #boxes do assert.is_false(overlap(boxes[i], boxes[j]), i .. " and " .. j) end
      assert.is_true(tonumber(boxes[i].y) + tonumber(boxes[i].height) < tonumber(frame.y))
      assert.is_true(tonumber(boxes[i].x) >= tonumber(frame.x))
      assert.is_true(tonumber(boxes[i].x) + tonumber(boxes[i].width) <= tonumber(frame.x) + tonumber(frame.width))
      rows[boxes[i].y] = true
    end
    assert.is_true(next(rows, next(rows)) ~= nil)   -- stacked: more than one row
    -- each abandoned stretch is one step: drawn as a dot (a zero-length segment)
    local faint = elements(svg, "path", "abandoned")
    assert.are.equal(6, #faint)
    for _, a in ipairs(faint) do
      local xs = path_xs(a.d)
      assert.are.equal(2, #xs)
      assert.are.equal(xs[1], xs[2])
    end
  end)

  it("throughput.svg: raw tokens/s faint, a moving average, replayed steps marked", function()
    repeated(dir)
    local svg = check_all(plot.run(dir)).throughput
    local raw = series(svg, "tokens/s")
    assert.truthy(tonumber(raw["stroke-opacity"]) < 1)
    local rx = path_xs(raw.d)
    assert.are.equal(20, #rx)
    local sm = series(svg, "tokens/s, moving average")
    assert.truthy(sm.class:find("smoothed", 1, true))
    assert.are.same(rx, path_xs(sm.d))
    -- a marker on each replayed step (9..16) at its x, none on first-time steps; one band behind them
    local marked = {}
    for i, a in ipairs(elements(svg, "circle", "replayed")) do
      marked[i] = tonumber(a["data-step"])
      assert.are.equal(rx[marked[i] + 1], tonumber(a.cx))
    end
    assert.are.same({9, 10, 11, 12, 13, 14, 15, 16}, marked)
    assert.are.equal(1, #elements(svg, "rect", "replayed-band"))
    assert.truthy(svg:find("replayed (rollback)", 1, true))
    assert.truthy(svg:find("centred mean, 5 steps", 1, true))
    -- the phases stay
    assert.truthy(svg:find('class="phase" data-series="fwd+bwd other"', 1, true))
    -- no rollback: no markers, no band, no legend entry
    support.write_file(dir .. "/metrics.jsonl", '{"step":0,"tokens_per_s":10}\n{"step":1,"tokens_per_s":12}\n' ..
                       '{"step":2,"tokens_per_s":11}\n')
    svg = check_all(plot.run(dir)).throughput
    assert.are.equal(0, #elements(svg, "circle", "replayed"))
    assert.is_nil(svg:find("replayed", 1, true))
  end)

  it("labels a blown-up loss's axis in plain exponents (2e+13, not 2e+07M)", function()
    support.write_file(dir .. "/metrics.jsonl", '{"step":0,"loss":5}\n{"step":1,"loss":2e13}\n{"step":2,"loss":3e12}\n')
    local svg = check_all(plot.run(dir)).loss
    assert.truthy(svg:find(">2e+13<", 1, true), svg)
    assert.is_nil(svg:find("e%+%d+M<"), svg)
    -- a narrow range up there: labels as distinct as the ticks
    support.write_file(dir .. "/metrics.jsonl", '{"step":0,"loss":1.0000e9}\n{"step":1,"loss":1.0008e9}\n')
    svg = check_all(plot.run(dir)).loss
    assert.truthy(svg:find(">1.0004e+09<", 1, true), svg)
  end)

  it("gives a clear error for a missing run dir, a missing or empty metrics.jsonl", function()
    support.has(support.errmsg(plot.run, dir .. "/nope"), "no run directory")
    support.has(support.errmsg(plot.run, dir), "no metrics.jsonl in " .. dir)
    support.write_file(dir .. "/metrics.jsonl", "")
    support.has(support.errmsg(plot.run, dir), "no step records")
    support.write_file(dir .. "/metrics.jsonl", '{"event":"checkpoint","step":0}\n')
    support.has(support.errmsg(plot.run, dir), "no step records")
    support.write_file(dir .. "/metrics.jsonl", '{"step":0,"loss":1}\n')
    support.has(support.errmsg(plot.run, dir, dir .. "/metrics.jsonl"),
                "moelua.plot: cannot create the output directory: moelua.fs.mkdir_p: '" .. dir ..
                "/metrics.jsonl' exists and is not a directory")
    -- the command: status 1, one line, no traceback
    local code, out = support.finish_child(assert(io.popen(support.host_command({"plot", dir .. "/nope"}) .. " 2>&1")))
    assert.are.equal(1, code)
    assert.truthy(out:find("moelua.plot: no run directory", 1, true), out)
    assert.is_nil(out:find("traceback", 1, true), out)
    code, out = support.finish_child(assert(io.popen(support.host_command({"plot"}) .. " 2>&1")))
    assert.are.equal(1, code)
    assert.truthy(out:find("usage: moelua plot", 1, true), out)
    -- an option is no output directory; the bad word is named
    code, out = support.finish_child(assert(io.popen(support.host_command({"plot", dir, "--bogus"}) .. " 2>&1")))
    assert.are.equal(1, code)
    support.has(out, "moelua plot: unknown option '--bogus'\nusage: moelua plot")
    assert.is_nil(require("moelua.fs").stat("--bogus"))
    support.write_file(dir .. "/file", "x")
    support.has(support.errmsg(plot.run, dir .. "/file"), "is not a run directory (a directory holding metrics.jsonl)")
    -- a metrics.jsonl that cannot be read: said as such, not with plot.lua's line
    require("moelua.fs").mkdir_p(dir .. "/d/metrics.jsonl")
    assert.are.equal("moelua.plot: cannot read " .. dir .. "/d/metrics.jsonl: Is a directory",
                     support.errmsg(plot.run, dir .. "/d"))
    -- lines that are not JSON are left out, and said so
    support.write_file(dir .. "/metrics.jsonl", '{"step":0,"loss":1}\nnot json {\n{"step":1,"loss":0.5}\n')
    code, out = support.finish_child(assert(io.popen(support.host_command({"plot", dir}) .. " 2>&1")))
    assert.are.equal(0, code, out)
    support.has(out, "moelua.plot: 1 line of " .. dir .. "/metrics.jsonl is not JSON, left out (a running job's " ..
                     "last line may be half-written)\n")
  end)

  it("runs a file named plot as a script when there is one", function()
    support.write_file(dir .. "/plot", "print('script', ...)\n")
    local cmd = "cd " .. support.shell_quote(dir) .. " && " .. support.host_command({"plot", "x"}) .. " 2>&1"
    local code, out = support.finish_child(assert(io.popen(cmd)))
    assert.are.equal(0, code, out)
    assert.are.equal("script\tx\n", out)
    -- a directory named plot is no script: the subcommand runs
    os.remove(dir .. "/plot")
    require("moelua.fs").mkdir_p(dir .. "/plot")
    code, out = support.finish_child(assert(io.popen(cmd)))
    assert.are.equal(1, code, out)
    support.has(out, "moelua.plot: no run directory x")
  end)

  it("the checker rejects malformed XML", function()
    for _, bad in ipairs({"<a><b></a></b>", "<a x=1/>", "<a>&foo;</a>", "<a>x & y</a>", "<a/><b/>",
                          "<a x='1' x='2'/>", "<a>", "text<a/>", "<a x='<'/>"}) do
      assert.is_nil(xml_check(bad), bad)
    end
    assert.is_true(xml_check("<a x='1' y=\"&amp;&#60;\"><b/>t&lt;<!-- c --></a>\n"))
  end)
end)
