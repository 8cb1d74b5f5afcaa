-- moelua.plot and `moelua plot RUN_DIR`: SVGs of a real tiny run (with a
-- validation and a rollback) and of a synthetic metrics.jsonl; each file is
-- well-formed XML (a strict checker below) with the expected series; bad
-- input gives a clear error.
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
        phases = {data = 0.01, fwd = 0.1, bwd = 0.2, optim = 0.05, checkpoint = 0,
                  attention = 0.1, router = 0.01, dispatch = 0.02, experts = 0.1, ce = 0.03}}
  end
  for s = 0, 6 do step(s, 5 - s * 0.2) end
  add{event = "validation", step = 3, loss = 4.5}
  add{event = "rollback", step = 6, reason = "loss spike <&>", to = dir .. "/ckpt/step-000004", resume_step = 5}
  for s = 5, 9 do step(s, 4.1 - (s - 5) * 0.1) end
  add{event = "validation", step = 9, loss = 3.9}
  support.write_file(dir .. "/metrics.jsonl", table.concat(lines, "\n") .. "\n")
end

describe("moelua.plot", function()
  local dir
  before_each(function() dir = support.make_tmpdir() end)
  after_each(function() support.remove_dir(dir) end)

  it("plots a synthetic run: series, heatmap cells, rollback marker, escaping", function()
    synthetic(dir)
    local svg = check_all(plot.run(dir))
    -- loss: the two stretches of training loss (the rolled-back one faint), validation, the marker
    assert.are.equal(2, count(svg.loss, 'data%-series="training loss[^"]*"'))
    assert.are.equal(1, count(svg.loss, 'data%-series="validation loss"'))
    assert.are.equal(1, count(svg.loss, 'class="rollback"'))
    assert.truthy(svg.loss:find("rollback @6: loss spike &lt;&amp;&gt; -&gt; step 5", 1, true))
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
    for _, ph in ipairs({"data", "attention", "router", "dispatch", "experts", "ce", "fwd+bwd other", "optim"}) do
      assert.truthy(svg.throughput:find('class="phase" data-series="' .. ph .. '"', 1, true), ph)
    end
    assert.is_nil(svg.throughput:find('data-series="checkpoint"', 1, true))   -- all zero
  end)

  it("plots a real tiny training run (validation, rollback) with plot.run and `moelua plot`", function()
    m.manual_seed(0)
    local model = nn.Transformer.new{vocab = 256, dim = 16, layers = 1, heads = 2, kv_heads = 1, ffn = 24,
                                     experts = 4, topk = 2, seed = 0, checkpoint = "moe"}
    local ds = data.open{glob = "/usr/include/std*.h", seq_len = 64, seed = 0, holdout = 0.01}
    local groups = model:param_groups{weight_decay = 0.1}
    local opt = optim.AdamW(groups, {lr = 3e-3, beta2 = 0.95})
    local r = train.run{model = model, data = ds, optimizer = opt, groups = groups, seq_len = 64, steps = 5,
                        lr = sched.constant(3e-3), clip = 1.0, run_dir = dir, ckpt_every = 1, keep = 5,
                        val_every = 2, val_batches = 1,
                        rollback = {collapse_share = 0.0, collapse_steps = 2}}
    assert.is_true(r.rollbacks >= 1)
    local svg = check_all(plot.run(dir, dir .. "/a"))
    assert.are.equal(r.rollbacks, count(svg.loss, 'class="rollback"'))
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

  it("gives a clear error for a missing run dir, a missing or empty metrics.jsonl", function()
    support.has(support.errmsg(plot.run, dir .. "/nope"), "no run directory")
    support.has(support.errmsg(plot.run, dir), "no metrics.jsonl in " .. dir)
    support.write_file(dir .. "/metrics.jsonl", "")
    support.has(support.errmsg(plot.run, dir), "no step records")
    support.write_file(dir .. "/metrics.jsonl", '{"event":"checkpoint","step":0}\n')
    support.has(support.errmsg(plot.run, dir), "no step records")
    -- the command: status 1, one line, no traceback
    local code, out = support.finish_child(assert(io.popen(support.host_command({"plot", dir .. "/nope"}) .. " 2>&1")))
    assert.are.equal(1, code)
    assert.truthy(out:find("moelua.plot: no run directory", 1, true), out)
    assert.is_nil(out:find("traceback", 1, true), out)
    code, out = support.finish_child(assert(io.popen(support.host_command({"plot"}) .. " 2>&1")))
    assert.are.equal(1, code)
    assert.truthy(out:find("usage: moelua plot", 1, true), out)
  end)

  it("runs a file named plot as a script when there is one", function()
    support.write_file(dir .. "/plot", "print('script', ...)\n")
    local cmd = "cd " .. support.shell_quote(dir) .. " && " .. support.host_command({"plot", "x"}) .. " 2>&1"
    local code, out = support.finish_child(assert(io.popen(cmd)))
    assert.are.equal(0, code, out)
    assert.are.equal("script\tx\n", out)
  end)

  it("the checker rejects malformed XML", function()
    for _, bad in ipairs({"<a><b></a></b>", "<a x=1/>", "<a>&foo;</a>", "<a>x & y</a>", "<a/><b/>",
                          "<a x='1' x='2'/>", "<a>", "text<a/>", "<a x='<'/>"}) do
      assert.is_nil(xml_check(bad), bad)
    end
    assert.is_true(xml_check("<a x='1' y=\"&amp;&#60;\"><b/>t&lt;<!-- c --></a>\n"))
  end)
end)
