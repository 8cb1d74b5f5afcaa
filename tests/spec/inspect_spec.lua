-- moelua.inspect on a tiny checkpoint (recipes/tiny.lua in a child host, as
-- eval_spec does): routing counts and shares, bits per byte against
-- recipes/eval.lua, the views, seeded generation, compare.
local m = require "moelua"
local inspect = require "moelua.inspect"
local json = require "dkjson"
local support = require "tests.support"

local SEQ = 32

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
  end)

  it("compare of a report with itself shows no change", function()
    local rows, s = inspect.compare(report, report, 1)
    assert.are.equal(h.model.opts.experts, #rows)
    for _, r in ipairs(rows) do assert.are.equal(0, r.delta) end
    assert.is_nil(s:find("gained") or s:find("lost"))
    local rows2 = inspect.compare(report, report, 1, 2)   -- two layers
    assert.are.equal(h.model.opts.experts, #rows2)
  end)
end)
