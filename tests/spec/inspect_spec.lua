-- moelua.inspect on a tiny checkpoint (recipes/tiny.lua in a child host, as
-- eval_spec does): routing counts and shares, bits per byte against
-- recipes/eval.lua, the views, seeded generation, compare.
local m = require "moelua"
local inspect = require "moelua.inspect"
local json = require "dkjson"
local support = require "tests.support"
local balance = require "moelua.balance"
local errors = require "moelua.errors"
local pretty = require "moelua.pretty"

local SEQ = 32

local function lines_of(s)
  local out = {}
  for l in s:gmatch("[^\n]+") do out[#out + 1] = l end
  return out
end

local function sh(args)
  local p = assert(io.popen(support.host_command(args) .. " 2>&1", "r"))
  return support.finish_child(p)
end

describe("moelua.inspect", function()
  local root, dir, h, text, report
  setup(function()
    root = support.make_tmpdir()
    local code, out = sh{"recipes/tiny.lua", "--steps", "2", "--seq-len", tostring(SEQ), "--warmup", "1",
                         "--data", "/usr/include/std*.h", "--threads", tostring(m.threads()),
                         "--run-dir", root .. "/run", "--ckpt-every", "2", "--keep", "1"}
    assert(code == 0, out)
    dir = root .. "/run/ckpt"
    text = assert(support.read_file("/usr/include/stdio.h")):sub(1, SEQ + 1)   -- one eval window
    h = inspect.open(dir)
    report = h:run(text, {seq_len = SEQ})
  end)
  teardown(function() support.remove_dir(root) end)

  it("loads takes top-k from the checkpoint that ckpt/latest names", function()
    local run = root .. "/run"
    assert.are.equal(tostring(inspect.loads(run, 1, {topk = 2})), tostring(inspect.loads(run, 1)))
  end)

  it("counts sum to tokens x k, shares to 1, per layer", function()
    local cfg = h.model.opts
    assert.are.equal(#text, report.tokens)
    assert.are.equal(cfg.layers, #report.layers)
    for _, ls in ipairs(report.layers) do
      local c, s, p = 0, 0, 0
      for e = 1, cfg.experts do c, s, p = c + ls.counts[e], s + ls.shares[e], p + ls.mean_prob[e] end
      assert.are.equal(#text * cfg.topk, c)
      assert.is_true(math.abs(s - 1) < 1e-12)
      assert.is_true(math.abs(p - 1) < 1e-6)
      assert.are.equal(#text, #ls.top)
      assert.are.equal(#text * cfg.topk, #ls.assign)
      assert.is_true(ls.entropy > 0 and ls.max_share > 0 and ls.max_share <= 1)
      assert.are.equal(0, ls.dropped)
    end
    -- a file path reads the file; long input runs in chunks with the same counts rule
    local f = root .. "/t.txt"
    support.write_file(f, text:rep(3))
    local r3 = h:run(f, {seq_len = 20})
    assert.are.equal(3 * #text, r3.tokens)
    assert.are.equal(math.ceil(3 * #text / 20), r3.chunks)
    local c = 0
    for _, v in ipairs(r3.layers[2].counts) do c = c + v end
    assert.are.equal(3 * #text * h.model.opts.topk, c)
  end)

  it("bits per byte is eval.lua's loss / ln 2 on the same window", function()
    local f = root .. "/win.txt"
    support.write_file(f, text)
    local code, out = sh{"recipes/eval.lua", "--ckpt", dir, "--data", f, "--seq-len", tostring(SEQ), "--json",
                         "--threads", tostring(m.threads())}
    assert(code == 0, out)
    local r = json.decode(out)
    assert.are.equal(1, r.windows)
    support.assert_close({report.bits_per_byte}, {r.loss / math.log(2)}, 1e-6, "bits per byte")
  end)

  it("histogram has one line per expert; tokens has one tag per byte", function()
    local E = h.model.opts.experts
    local hist = inspect.histogram(report, 1)
    local lines = 0
    for _ in hist:gmatch("[^\n]+") do lines = lines + 1 end
    assert.are.equal(E, lines)
    local tv = inspect.tokens(report, 1, {color = false})
    local tags = 0
    for _ in tv:gmatch("%[%d+%]") do tags = tags + 1 end
    assert.are.equal(#text, tags)
    assert.is_nil(tv:find("\27", 1, true))
    assert.is_truthy(inspect.tokens(report, 2, {color = true}):find("\27[48;5;", 1, true))
    local tt, s = inspect.top_tokens(report, 1, 3)
    assert.are.equal(E, #tt)
    assert.is_string(s)
    for _, list in ipairs(tt) do assert.is_true(#list <= 3) end
  end)

  it("greedy generation is deterministic, seeded sampling repeats, with a routing trace", function()
    local a = h:generate("#include", {n = 6, greedy = true})
    local b = h:generate("#include", {n = 6, greedy = true})
    assert.are.equal(a.generated, b.generated)
    assert.are.equal(6, #a.generated)
    assert.are.equal(6, #a.trace)
    assert.are.equal(h.model.opts.layers, #a.trace[1].layers)
    assert.are.equal(h.model.opts.topk, #a.trace[1].layers[1])
    local s1 = h:generate("#include", {n = 8, temperature = 1.5, top_p = 0.95, seed = 7})
    local s2 = h:generate("#include", {n = 8, temperature = 1.5, top_p = 0.95, seed = 7})
    assert.are.equal(s1.generated, s2.generated)
    for i = 1, 8 do assert.are.same(s1.trace[i].layers, s2.trace[i].layers) end
    for _, bad in ipairs{1.5, "a", 2 ^ 70} do   -- never silently seed 0
      support.has(support.errmsg(h.generate, h, "#include", {n = 2, seed = bad}),
                  "moelua.inspect.generate: option 'seed' must be an integer >= 0, got " ..
                  (type(bad) == "number" and tostring(bad) or type(bad)))
    end
    support.has(support.errmsg(h.generate, h, "#include", {n = 2, seed = -1}),
                "moelua.inspect.generate: option 'seed' must be an integer >= 0, got -1")
    assert.is_table(h:run("ab\0c", {seq_len = SEQ}).layers)   -- a short text with a NUL: text, not a path
    -- the combine weights of each token's top-k experts: in (0, 1], summing to 1 (renormalised)
    for _, g in ipairs({a, s1}) do
      for _, step in ipairs(g.trace) do
        assert.are.equal(h.model.opts.layers, #step.weights)
        for l, w in ipairs(step.weights) do
          assert.are.equal(#step.layers[l], #w)
          local sum = 0
          for _, v in ipairs(w) do
            assert.is_true(v > 0 and v <= 1, tostring(v))
            sum = sum + v
          end
          assert.is_true(math.abs(sum - 1) < 1e-6, "weights sum to " .. sum)
        end
      end
    end
  end)

  it("generation decodes with a KV cache: each byte as the full forward of its context, restarts included", function()
    -- seq_len 6: the prompt's last 6 bytes are prefilled, then one byte a
    -- position; a full cache restarts from its last 3 bytes. Each greedy byte
    -- is the argmax of a full forward over the bytes since the last restart.
    local S, n, prompt = 6, 14, "#include <s"
    local g = h:generate(prompt, {n = n, greedy = true, seq_len = S})
    local bytes, from, len = {prompt:byte(1, -1)}, #prompt - S + 1, S
    for i = 1, n do
      local ctx = {table.unpack(bytes, from)}
      assert.are.equal(len, #ctx, "context of byte " .. i)
      ctx[#ctx + 1] = 0
      h.model:forward(m.tensor(ctx):to("i64"), 0)
      local lg = h.model:last_logits():totable()
      h.model:release()
      local best = 1
      for j = 2, 256 do if lg[j] > lg[best] then best = j end end
      assert.are.equal(best - 1, g.tokens[i], "byte " .. i)
      bytes[#bytes + 1] = g.tokens[i]
      if len == S then from, len = #bytes - S // 2 + 1, S // 2 else len = len + 1 end
    end
    assert.are.equal(0, h.model.pool:stats().used)
    local streamed = {}
    local g2 = h:generate(prompt, {n = n, greedy = true, seq_len = S, on_byte = function(c) streamed[#streamed + 1] = c end})
    assert.are.equal(g.generated, table.concat(streamed))
    assert.are.equal(g.generated, g2.generated)
    support.raises("moelua.inspect.generate: option 'seq_len' must be an integer >= 1", h.generate, h, "x",
                   {seq_len = 0})
    support.raises("moelua.inspect.generate: option 'on_byte' must be a function", h.generate, h, "x",
                   {on_byte = "print"})
    support.raises("moelua.inspect.generate: option 'n' must be an integer >= 1", h.generate, h, "x", {n = 0})
    support.raises("moelua.inspect.generate: unknown option 'tempreature'", h.generate, h, "x",
                   {tempreature = 0.5})
    support.raises("moelua.inspect.generate: option 'temperature' must be a finite number >= 0", h.generate, h, "x",
                   {temperature = "hot"})
    support.raises("moelua.inspect.generate: option 'temperature' must be a finite number >= 0", h.generate, h, "x",
                   {temperature = 0 / 0})
    support.raises("moelua.inspect.run: 1 byte of input: a prediction needs 2 (a byte and the next)", h.run, h, "x")
    support.raises("moelua.inspect.run: expected a text or a file path, got an empty string", h.run, h, "")
    -- what names a directory, or looks like a path and names nothing, is not routed as text
    support.raises("moelua.inspect.run: '" .. root .. "' is a directory: give a file, or {text = s}", h.run, h, root)
    support.raises("moelua.inspect.run: '/nonexistent/file.c' looks like a path but names no file (to route these " ..
                   "bytes as text: {text = s})", h.run, h, "/nonexistent/file.c")
    assert.are.equal(#"/nonexistent/file.c", h:run({text = "/nonexistent/file.c"}).tokens)
    support.raises("moelua.inspect.run: {text = s}: unknown key 'txt'", h.run, h, {txt = "abc"})
    support.raises("moelua.inspect.run: {text = s}: expected a non-empty string, got number", h.run, h, {text = 1})
    support.raises("moelua.inspect.run: expected a text, a file path or {text = s}, got nil", h.run, h)
    support.raises("moelua.inspect.run: call it with a colon: h:run(...)", h.run, "abc")
    support.raises("moelua.inspect.generate: call it with a colon: h:generate(...)", h.generate, "abc")
    support.raises("moelua.inspect.run: unknown option 'seqlen' (expected one of: seq_len)", h.run, h, "abc",
                   {seqlen = 8})
    support.raises("moelua.inspect.run: options must be a table, got number", h.run, h, "abc", 8)
  end)

  it("compare of a report with itself shows no change", function()
    local rows, s = inspect.compare(report, report, 1)
    assert.are.equal(h.model.opts.experts, #rows)
    for _, r in ipairs(rows) do assert.are.equal(0, r.delta); assert.is_false(r.changed) end
    assert.is_nil(s:find("gained") or s:find("lost"))
    assert.are.equal("no change beyond noise (3 standard errors) in any of the " .. h.model.opts.experts ..
                     " experts (" .. #text .. " and " .. #text .. " tokens)", s)
    local rows2 = inspect.compare(report, report, 1, 2)   -- two layers
    assert.are.equal(h.model.opts.experts, #rows2)
  end)

  it("summary of a real report: each layer as moelua.balance reads its counts", function()
    local sm = inspect.summary(report)
    local cfg = h.model.opts
    assert.are.same({cfg.experts, cfg.topk, #text, cfg.layers}, {sm.experts, sm.topk, sm.tokens, #sm.layers})
    for l, r in ipairs(sm.layers) do
      local ls, b = report.layers[l], balance.layer(report.layers[l].counts, cfg.topk)
      assert.are.same({l, #text, ls.entropy, b.cv, b.max_ratio, b.busiest, b.topk_ratio, b.dead, b.hot,
                       b.collapsed, ls.dropped},
                      {r.layer, r.tokens, r.entropy, r.cv, r.max_ratio, r.busiest, r.topk_ratio, r.dead, r.hot,
                       r.collapsed, r.dropped})
      -- by hand: max share against even = max count * E / (T k)
      local mx = math.max(table.unpack(ls.counts))
      assert.is_true(math.abs(r.max_ratio - mx * cfg.experts / (#text * cfg.topk)) < 1e-12)
    end
    local shown = tostring(sm)
    assert.are.equal(cfg.layers + 3, #lines_of(shown))
    assert.truthy(shown:find(cfg.experts .. " experts, top-" .. cfg.topk .. ", " .. #text .. " tokens", 1, true))
    assert.are.equal(shown, inspect.format_summary(sm))
    assert.are.equal(shown, pretty.show(sm))          -- the REPL prints it as its text
  end)
end)

describe("moelua.inspect on reports built by hand", function()
  -- E = 4, k = 2, 256 tokens: layer 1 collapsed onto experts 0 and 2 (the
  -- loads of issue 9), layer 2 even, layer 3 with a dead expert.
  local r = {topk = 2, layers = {
    {counts = {231, 3, 255, 23}, entropy = 0.9, dropped = 0},
    {counts = {128, 128, 128, 128}, entropy = 1.38, dropped = 4},
    {counts = {200, 0, 160, 152}, entropy = 1.2, dropped = 0}}}

  it("summary: tokens, entropy, cv, max share against even, dead, hot, collapsed, dropped against hand-computed values",
     function()
    local sm = inspect.summary(r)
    assert.are.same({4, 2, 256}, {sm.experts, sm.topk, sm.tokens})
    local function near(a, b) assert.is_true(math.abs(a - b) < 1e-12, a .. " vs " .. b) end
    local l1, l2, l3 = sm.layers[1], sm.layers[2], sm.layers[3]
    -- layer 1: 512 assignments, even 128; max 255 -> 255/128; top-2 (255 + 231) / 256
    assert.are.same({256, 0.9, 2, {}, {0, 2}, true, 0}, {l1.tokens, l1.entropy, l1.busiest, l1.dead, l1.hot,
                                                        l1.collapsed, l1.dropped})
    near(l1.max_ratio, 255 / 128)
    near(l1.topk_ratio, (255 + 231) / 256)
    local var = ((231 - 128) ^ 2 + (3 - 128) ^ 2 + (255 - 128) ^ 2 + (23 - 128) ^ 2) / 4
    near(l1.cv, math.sqrt(var) / 128)
    near(l1.shares[3], 255 / 512)
    assert.are.same({0, 1, 0, {}, {}, false, 4}, {l2.cv, l2.max_ratio, l2.busiest, l2.dead, l2.hot, l2.collapsed,
                                                  l2.dropped})
    assert.are.same({{1}, {}, false}, {l3.dead, l3.hot, l3.collapsed})
    near(l3.max_ratio, 200 / 128)
    local shown = tostring(sm)
    assert.truthy(shown:find("\n    1     256    0.900  " .. ("%.3f"):format(l1.cv) .. "    1.99 ( 2)     1.90 " ..
                             "-          0,2        YES             0", 1, true), shown)
    assert.truthy(shown:find("\n    3     256    1.200", 1, true) and shown:find(" 1          -          no ", 1, true),
                  shown)
  end)

  it("errors name the function and the argument: a nil report, a report that is not one, a missing layer", function()
    for _, fn in ipairs({"histogram", "tokens", "top_tokens", "compare", "summary"}) do
      local f = inspect[fn]
      local args = fn == "compare" and {r, r} or {}
      support.has(support.errmsg(f, nil, 1),
                  "moelua.inspect." .. fn .. ": argument #1 (report): expected a report from h:run(...), got nil")
      support.has(support.errmsg(f, 42, 1), "moelua.inspect." .. fn .. ": argument #1 (report): expected a report " ..
                                            "from h:run(...), got a number")
      support.has(support.errmsg(f, {loss = 1}, 1), "moelua.inspect." .. fn .. ": argument #1 (report): not a " ..
                                                    "report from h:run(...) (no layers with counts)")
      if fn ~= "summary" then
        local l = fn == "compare" and 3 or 2
        local a = {r, 5}
        if fn == "compare" then a = {r, r, 5} end
        if fn == "tokens" or fn == "top_tokens" then
          local full = {topk = 2, text = "ab", layers = {{counts = {1, 1, 1, 1}, top = {0, 1}, assign = {0, 1, 2, 3}}}}
          a = {full, 5}
          support.has(support.errmsg(f, full, 5), "moelua.inspect." .. fn .. ": argument #2 (layer): no layer 5: " ..
                                                  "the report has 1 layer (1..1)")
        else
          support.has(support.errmsg(f, table.unpack(a)), "moelua.inspect." .. fn .. ": argument #" .. l ..
                                                          " (layer): no layer 5: the report has 3 layers (1..3)")
        end
        support.has(support.errmsg(f, table.unpack(fn == "compare" and {r, r} or {r})), "moelua.inspect." .. fn ..
                    ": argument #" .. l .. " (layer): expected a layer number 1..")
      end
      assert.is_not_nil(args)
    end
    support.has(support.errmsg(inspect.compare, r, nil, 1), "moelua.inspect.compare: argument #2 (report): " ..
                                                            "expected a report from h:run(...), got nil")
    support.has(support.errmsg(inspect.tokens, r, 1), "moelua.inspect.tokens: argument #1 (report): has no " ..
                                                      "per-token routing")
    support.has(support.errmsg(inspect.histogram, r, 1, {bogus = 1}), "moelua.inspect.histogram: unknown option " ..
                                                                      "'bogus' (expected one of: width)")
    support.has(support.errmsg(inspect.histogram, r, 1, {width = -5}), "option 'width' must be an integer >= 1, got -5")
    support.has(support.errmsg(inspect.histogram, r, 1, 5), "moelua.inspect.histogram: options must be a table")
    -- user errors: the host prints them without a traceback
    assert.is_true(errors.is_user(select(2, pcall(inspect.summary, nil))))
  end)

  it("compare flags only share changes beyond 3 standard errors (binomial over the tokens)", function()
    local a = {topk = 2, layers = {{counts = {1000, 1000, 1000, 1000}}}}     -- 2000 tokens
    local b = {topk = 2, layers = {{counts = {1060, 1000, 940, 1000}}}}      -- 2000 tokens
    local c = {topk = 2, layers = {{counts = {1200, 1000, 800, 1000}}}}
    -- by hand, expert 0 of a -> c: 0.5 and 0.6 of the tokens, pooled q = 0.55; se = sqrt(q (1 - q) (2 / 2000)) / 2
    local rows, text = inspect.compare(a, c, 1)
    local se = math.sqrt(0.55 * 0.45 * (2 / 2000)) / 2
    assert.is_true(math.abs(rows[1].se - se) < 1e-15)
    assert.is_true(math.abs(rows[1].delta - 0.05) < 1e-15)
    assert.is_true(math.abs(rows[1].z - 0.05 / se) < 1e-9)
    assert.are.same({true, false, true, false}, {rows[1].changed, rows[2].changed, rows[3].changed, rows[4].changed})
    local ls = lines_of(text)
    assert.are.equal(2, #ls, text)
    assert.are.equal("expert  0:  25.0% ->  30.0%    +5.0 pts (se 0.8, 6.4 se)  gained", ls[1])
    assert.are.equal("expert  2:  25.0% ->  20.0%    -5.0 pts (se 0.8, 6.4 se)  lost", ls[2])
    -- 60 assignments of 4000 moved: 1.5 points, about 1.9 standard errors: noise
    rows, text = inspect.compare(a, b, 1)
    for _, row in ipairs(rows) do assert.is_false(row.changed) end
    assert.are.equal("no change beyond noise (3 standard errors) in any of the 4 experts (2000 and 2000 tokens)", text)
    -- an expert that goes from nothing to something: the side at 0% has no variance of its own, the
    -- pooled one does; 0 of 10 tokens -> 5 of 10 is 2.6 se (Fisher's exact test: p = 0.03), not beyond noise
    rows = inspect.compare({topk = 1, layers = {{counts = {0, 10}}}}, {topk = 1, layers = {{counts = {5, 5}}}}, 1)
    assert.is_false(rows[1].changed)
    assert.is_true(math.abs(rows[1].z - 0.5 / math.sqrt(0.25 * 0.75 * 0.2)) < 1e-12)
    rows = inspect.compare({topk = 1, layers = {{counts = {0, 100}}}}, {topk = 1, layers = {{counts = {50, 50}}}}, 1)
    assert.is_true(rows[1].changed)
    -- an empty report: nothing to compare
    rows = inspect.compare({topk = 1, layers = {{counts = {0, 0}}}}, {topk = 1, layers = {{counts = {5, 5}}}}, 1)
    assert.is_false(rows[1].changed)
  end)

  it("loads reads a run's metrics.jsonl: steps (the replay kept after a rollback), per-expert shares and ratios, " ..
     "a chart", function()
    local dir = support.make_tmpdir()
    finally(function() support.remove_dir(dir) end)
    local function step(s, c1, c2) return json.encode({step = s, loss = 1, loads = {{counts = c1}, {counts = c2}}}) end
    support.write_file(dir .. "/metrics.jsonl", table.concat({
      step(0, {8, 8, 8, 8}, {16, 16, 0, 0}),
      '{"event":"checkpoint","step":0}',
      step(1, {10, 6, 8, 8}, {16, 16, 0, 0}),
      step(2, {30, 2, 0, 0}, {16, 16, 0, 0}),               -- abandoned by the rollback
      '{"event":"rollback","step":2,"resume_step":2}',
      step(2, {12, 4, 8, 8}, {16, 0, 16, 0}),               -- its replay: kept
      step(3, {16, 16, 0, 0}, {8, 8, 8, 8}),
      ""}, "\n"))
    local t = inspect.loads(dir, {topk = 2})
    assert.are.same({0, 1, 2, 3}, t.steps)
    assert.are.same({[2] = true}, t.replayed)
    assert.are.same({2, 4}, {t.topk, t.experts})
    local l1 = t.layers[1]
    assert.are.same({12, 4, 8, 8}, l1[3].counts)
    assert.are.same({12 / 32, 4 / 32, 8 / 32, 8 / 32}, l1[3].shares)
    assert.are.same({1.5, 0.5, 1, 1}, l1[3].ratios)
    assert.are.same({2, 0, 2, 2, {2, 3}}, {l1[4].ratios[1], l1[4].ratios[3], l1[4].max_ratio, l1[4].topk_ratio,
                                           l1[4].dead})
    assert.is_true(l1[4].collapsed and l1[4].hot[1] == 0)
    -- one layer; its chart: a row per expert, a column per step (four steps)
    local one = inspect.loads(dir, 2, {topk = 2})
    assert.is_nil(one.layers[1])
    local chart = inspect.loads_chart(one, 2)
    local ls = lines_of(chart)
    assert.are.equal(5, #ls, chart)
    assert.truthy(ls[1]:find("layer 2, steps 0..3 (4, 1.0 a column)", 1, true), chart)
    -- layer 2, expert 0: ratios 2, 2, 2, 1 -> '+', '+', '+', '-'; expert 3: 0, 0, 0, 1 -> ' ', ' ', ' ', '-'
    assert.are.equal("expert  0 |+++-|  25.0%", ls[2])
    assert.are.equal("expert  2 |  +-|  25.0%", ls[4])
    assert.are.equal("expert  3 |   -|  25.0%", ls[5])
    assert.are.equal(chart, tostring(one))
    assert.are.equal(chart, inspect.loads_chart(one, 2, {width = 10}))
    local narrow = lines_of(inspect.loads_chart(inspect.loads(dir, 1, {topk = 2}), 1, {width = 2}))
    assert.truthy(narrow[1]:find("(4, 2.0 a column)", 1, true))
    -- layer 1, expert 1: ratios 1, .75 (mean .875: '-'), then .5, 2 (mean 1.25: '=')
    assert.are.equal("expert  1 |-=|  50.0%", narrow[3])
    -- options and the layer checked, never ignored
    support.has(support.errmsg(inspect.loads, dir, "1"), "moelua.inspect.loads: argument #2 (layer): expected a " ..
                                                          "layer number (1-based), got string")
    support.has(support.errmsg(inspect.loads, dir, 1, {topk = 9}), "option 'topk' = 9 is more than the run's 4 experts")
    support.has(support.errmsg(inspect.loads, dir, 1, {top = 2}), "unknown option 'top' (expected one of: topk)")
    support.has(support.errmsg(inspect.loads_chart, one, 2, {width = -5}), "option 'width' must be an integer >= 1")
    -- errors
    support.has(support.errmsg(inspect.loads, dir, 3, {topk = 2}), "moelua.inspect.loads: argument #2 (layer): " ..
                                                                  "no layer 3: step 0 logs 2 layers (1..2)")
    support.has(support.errmsg(inspect.loads, dir), "moelua.inspect.loads: no checkpoint config in " .. dir ..
                                                   "/ckpt to read top-k from: pass {topk = k}")
    -- a checkpoint whose config.json is a FIFO: not read (the read would block), the same error
    require("moelua.fs").mkdir_p(dir .. "/ckpt/step-000003")
    support.write_file(dir .. "/ckpt/latest", "step-000003\n")
    assert(os.execute("mkfifo " .. support.shell_quote(dir .. "/ckpt/step-000003/config.json")))
    support.has(support.errmsg(inspect.loads, dir), "moelua.inspect.loads: no checkpoint config in " .. dir ..
                                                   "/ckpt to read top-k from: pass {topk = k}")
    support.has(support.errmsg(inspect.loads, dir .. "/none", {topk = 2}), "moelua.inspect.loads: ")
    support.has(support.errmsg(inspect.loads, nil), "argument #1 (run_dir): expected a run directory, got nil")
  end)
end)
