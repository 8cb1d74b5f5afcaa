-- moelua.inspect: look inside a checkpoint's routing (from `moelua -i` or a script).
--
--   local inspect = require "moelua.inspect"
--   local h = inspect.open("runs/tiny/ckpt")          -- model rebuilt from the checkpoint
--   local r = h:run("some text" or "path/to/file", {seq_len = 256})
--   print(r.bits_per_byte, r.layers[1].entropy)
--   print(inspect.histogram(r, 1))                    -- load per expert, bars
--   print(inspect.tokens(r, 1))                       -- each byte tagged by its top expert
--   local tt = inspect.top_tokens(r, 1, 5)            -- per expert its 5 most frequent bytes
--   local g = h:generate("int main", {n = 40, temperature = 0.8, top_p = 0.9, seed = 1})
--   local d, s = inspect.compare(r, r2, 1)            -- per-expert share changes, beyond noise?
--   print(inspect.summary(r))                         -- every layer's balance, one line each
--   print(inspect.loads("runs/tiny", 1))              -- load over the run's steps (metrics.jsonl)
--
-- Everything is plain Lua tables and strings. Conventions: bytes are tokens
-- (vocab >= 256); layers are 1-based; per-expert arrays are indexed 1..E,
-- entry e being expert e-1 (the Hugging Face name `experts.<e-1>`); expert
-- ids inside per-token lists (top, assign, traces) and in printed tags are
-- those 0-based ids.
--
-- run: no gradients; the text is cut into chunks of seq_len routed bytes
-- (each chunk a model forward whose targets are the next bytes: memory is
-- bounded by seq_len whatever the input's length; context restarts at each
-- chunk, as in recipes/eval.lua). Every byte is routed once; every byte but
-- the first is predicted once (the last chunk's extra target is a dummy whose
-- cross-entropy is taken back out). Report:
--   {text, tokens = n bytes, predictions = n - 1, loss (mean nats), bits_per_byte,
--    seq_len, chunks, experts = E, topk = k,
--    layers = {[l] = {counts = {E}, shares = {E} (counts / (n k)), mean_prob = {E},
--                     entropy (mean router entropy, nats), max_share, dropped,
--                     top = {n: top-1 expert id per byte}, assign = {n*k: top-k ids,
--                     byte t at (t-1)*k+1 .. t*k}}}}
-- The per-token ids are the router's own (moe layer ctx.idx of the forward).
local tensor = require "moelua.tensor"
local fs = require "moelua.fs"
local nn = require "moelua.nn"
local ckpt = require "moelua.ckpt"
local balance = require "moelua.balance"
local errors = require "moelua.errors"
local options = require "moelua.options"

local M = {}
local Handle = {}
Handle.__index = Handle

local LN2 = math.log(2)

-- A user's mistake (a bad argument, a missing layer): a user error, its
-- message naming the function and the argument.
local function fail(fn, fmt, ...) errors.user("moelua.inspect." .. fn .. ": " .. string.format(fmt, ...)) end

-- opts (nil or a table) against spec (moelua.options.check's) -> a copy:
-- an unknown key or a wrong value names itself
local function check_opts(fn, opts, spec)
  return options.check(opts, spec, function(fmt, ...) fail(fn, fmt, ...) end)
end

local COUNT = {"integer", false, min = 1}   -- an option counting something, none by default

-- h = inspect.open(dir [, extra]): extra = nn.Transformer options (e.g. ce_rows).
function M.open(dir, extra)
  if type(dir) ~= "string" then fail("open", "argument #1: expected a checkpoint directory") end
  local o = {checkpoint = "none"}   -- frames kept: the router's ids stay readable after forward
  for k, v in pairs(extra or {}) do o[k] = v end
  local model, c = nn.Transformer.from_checkpoint(dir, o)
  if model.opts.vocab < 256 then
    fail("open", "vocab_size = %d: inspect reads bytes as tokens (needs >= 256)", model.opts.vocab)
  end
  return setmetatable({model = model, dir = c.dir, config = c.config, trainer = c.trainer}, Handle)
end

-- x: a text, the path of a file holding it, or {text = s} (s as it is,
-- whatever it looks like). A directory, or a string that looks like a path
-- ("/", "./" or "../" first, no spaces) and names nothing, is refused:
-- routing the path's own bytes would report on the wrong input.
local function read_input(fn, x)
  if type(x) == "table" then
    for k in pairs(x) do
      if k ~= "text" then fail(fn, "{text = s}: unknown key '%s'", tostring(k)) end
    end
    if type(x.text) ~= "string" or #x.text == 0 then
      fail(fn, "{text = s}: expected a non-empty string, got %s",
           type(x.text) == "string" and "an empty string" or type(x.text))
    end
    return x.text
  end
  if type(x) ~= "string" then fail(fn, "expected a text, a file path or {text = s}, got %s", type(x)) end
  if #x == 0 then fail(fn, "expected a text or a file path, got an empty string") end
  if #x < 4096 and not x:find("[\n\0]") then   -- (a path holds neither)
    local st = fs.stat(x)
    if st and st.type == "file" then
      local f = io.open(x, "rb")
      if not f then fail(fn, "'%s' cannot be read", x) end
      local s = f:read("a")
      f:close()
      return s
    end
    if st and st.type == "dir" then fail(fn, "'%s' is a directory: give a file, or {text = s}", x) end
    if not st and x:find("^%.?%.?/") and not x:find("%s") then
      fail(fn, "'%s' looks like a path but names no file (to route these bytes as text: {text = s})", x)
    end
  end
  return x
end

-- logsumexp(l) - l[target+1] over a Lua array of logits
local function ce_of(logits, target)
  local mx = -math.huge
  for _, v in ipairs(logits) do if v > mx then mx = v end end
  local s = 0
  for _, v in ipairs(logits) do s = s + math.exp(v - mx) end
  return mx + math.log(s) - logits[target + 1]
end

-- One forward over bytes s[a..b] (routed) with targets s[a+1..b+1] (a dummy 0
-- past the end). Returns the summed CE of the real targets and the stats.
local function chunk_forward(model, s, a, b)
  local n = #s
  local bytes = {s:byte(a, b)}
  local dummy = b == n
  bytes[#bytes + 1] = dummy and 0 or s:byte(b + 1)
  local tokens = tensor.tensor(bytes, {dtype = "i64"})
  local loss, st = model:forward(tokens, 0)
  local S = b - a + 1
  local sum = loss * S
  if dummy then
    local lg = model:last_logits()
    sum = sum - ce_of(lg:to("f64"):totable(), 0)
    lg:free()
  end
  tokens:free()
  return sum, st
end

-- h.run(x) for h:run(x): said, not read as a missing text
local function check_self(fn, self)
  if getmetatable(self) ~= Handle then fail(fn, "call it with a colon: h:%s(...)", fn) end
end

function Handle:run(x, opts)
  check_self("run", self)
  local S = check_opts("run", opts, {seq_len = {"integer", 256, min = 1}}).seq_len
  local s = read_input("run", x)
  local model = self.model
  if #s < 1 then fail("run", "empty input") end
  if #s < 2 then fail("run", "1 byte of input: a prediction needs 2 (a byte and the next)") end
  local E, k, L, n = model.opts.experts, model.opts.topk, model.opts.layers, #s
  local layers = {}
  for l = 1, L do
    local z = {}
    for e = 1, E do z[e] = 0 end
    layers[l] = {counts = z, psum = {table.unpack(z)}, ent = 0, dropped = 0, top = {}, assign = {}}
  end
  local ce, chunks = 0, 0
  for a = 1, n, S do
    local b = math.min(a + S - 1, n)
    local sum, st = chunk_forward(model, s, a, b)
    ce, chunks = ce + sum, chunks + 1
    for l, ls in ipairs(st.layers) do
      local acc = layers[l]
      local c, p = ls.counts:totable(), ls.psum:totable()
      for e = 1, E do acc.counts[e] = acc.counts[e] + math.tointeger(c[e]); acc.psum[e] = acc.psum[e] + p[e] end
      acc.ent = acc.ent + ls.entropy * ls.tokens
      acc.dropped = acc.dropped + ls.dropped
      local idx = model.blocks[l].moe.layer.ctx.idx:totable()
      for t = 1, #idx do
        local row = idx[t]
        acc.top[#acc.top + 1] = math.tointeger(row[1])
        for j = 1, k do acc.assign[#acc.assign + 1] = math.tointeger(row[j]) end
      end
    end
  end
  model:release()
  local r = {text = s, tokens = n, predictions = n - 1, seq_len = S, chunks = chunks, experts = E,
             topk = k, layers = {}}
  r.loss = n > 1 and ce / (n - 1) or 0 / 0
  r.bits_per_byte = r.loss / LN2
  for l = 1, L do
    local acc = layers[l]
    local shares, mp, mx = {}, {}, 0
    for e = 1, E do
      shares[e] = acc.counts[e] / (n * k)
      mp[e] = acc.psum[e] / n
      mx = math.max(mx, shares[e])
    end
    r.layers[l] = {counts = acc.counts, shares = shares, mean_prob = mp, entropy = acc.ent / n,
                   max_share = mx, dropped = acc.dropped, top = acc.top, assign = acc.assign}
  end
  return r
end

-- The report argument (#1, or #argn) of fn, checked: a table from h:run
-- (or built by hand the same way: layers with counts, and topk).
local function report_of(fn, report, argn)
  argn = argn or 1
  local what = ("argument #%d (report)"):format(argn)
  if report == nil then fail(fn, "%s: expected a report from h:run(...), got nil", what) end
  if type(report) ~= "table" then fail(fn, "%s: expected a report from h:run(...), got a %s", what, type(report)) end
  if type(report.layers) ~= "table" or type(report.layers[1]) ~= "table" or
     type(report.layers[1].counts) ~= "table" then
    fail(fn, "%s: not a report from h:run(...) (no layers with counts)", what)
  end
  if math.type(report.topk) ~= "integer" or report.topk < 1 then
    fail(fn, "%s: not a report from h:run(...) (no topk)", what)
  end
  return report
end

-- Layer l of report (argument #argn of fn), checked.
local function layer_of(fn, report, l, argn, rargn)
  report_of(fn, report, rargn)
  local n = #report.layers
  if math.type(l) ~= "integer" then
    fail(fn, "argument #%d (layer): expected a layer number 1..%d, got %s", argn or 2, n,
         l == nil and "nil" or type(l) == "number" and tostring(l) or "a " .. type(l))
  end
  local ls = report.layers[l]
  if type(ls) ~= "table" then
    fail(fn, "argument #%d (layer): no layer %d: the report has %d layer%s (1..%d)", argn or 2, l, n,
         n == 1 and "" or "s", n)
  end
  return ls
end

-- Layer l for a view of each token: the report must have its text and
-- per-token ids (h:run's do).
local function per_token(fn, report, l)
  local ls = layer_of(fn, report, l)
  if type(report.text) ~= "string" or type(ls.top) ~= "table" or type(ls.assign) ~= "table" then
    fail(fn, "argument #1 (report): has no per-token routing (text, layers[l].top and assign, as h:run's)")
  end
  return ls
end

-- Shares of the counts (each count over their sum).
local function shares_of(counts)
  local n = 0
  for _, c in ipairs(counts) do n = n + c end
  local sh = {}
  for e, c in ipairs(counts) do sh[e] = n > 0 and c / n or 0 end
  return sh, n
end

local function ids(list) return #list == 0 and "-" or table.concat(list, ",") end

-- inspect.summary(report) -> {experts, topk, tokens, thresholds, layers = {[l] = {layer, tokens,
-- entropy, cv, max_ratio, busiest, topk_ratio, dead = {ids}, hot = {ids}, collapsed, dropped,
-- counts, shares}}}: each layer through moelua.balance (what the trainer's
-- alarms read). tostring(summary) (and the REPL) shows it as a table of text.
local Summary = {}
function Summary.__tostring(s) return M.format_summary(s) end

function M.summary(report)
  report_of("summary", report)
  local k = report.topk
  local out = {experts = #report.layers[1].counts, topk = k, layers = {}}
  for l, ls in ipairs(report.layers) do
    local b = balance.layer(ls.counts, k)
    out.thresholds = b.thresholds
    out.layers[l] = {layer = l, tokens = b.tokens, entropy = ls.entropy, cv = b.cv, max_ratio = b.max_ratio,
                     busiest = b.busiest, topk_ratio = b.topk_ratio, dead = b.dead, hot = b.hot,
                     collapsed = b.collapsed, dropped = ls.dropped or 0, counts = ls.counts,
                     shares = (shares_of(ls.counts))}
  end
  out.tokens = out.layers[1].tokens
  return setmetatable(out, Summary)
end

-- The printed form of a summary: a header, then one line per layer.
function M.format_summary(s)
  if getmetatable(s) ~= Summary then fail("format_summary", "argument #1: expected inspect.summary(report)'s table") end
  local th = s.thresholds
  local lines = {
    ("%d experts, top-%d, %d tokens; entropy in nats (at most ln %d = %.3f)"):format(s.experts, s.topk, s.tokens,
                                                                                 s.experts, math.log(s.experts)),
    ("max and top-k: load against the even share 1/%d (moelua.balance); hot at >= %.2f, collapsed at >= %.2f")
      :format(s.experts, th.hot, th.collapse),
    ("%5s %7s %8s %6s %12s %8s %-10s %-10s %-9s %7s"):format("layer", "tokens", "entropy", "cv", "max (expert)",
                                                           "top-k", "dead", "hot", "collapsed", "dropped"),
  }
  for _, r in ipairs(s.layers) do
    lines[#lines + 1] = ("%5d %7d %8.3f %6.3f %7.2f (%2d) %8.2f %-10s %-10s %-9s %7d"):format(r.layer, r.tokens,
      r.entropy or 0 / 0, r.cv, r.max_ratio, r.busiest, r.topk_ratio, ids(r.dead), ids(r.hot),
      r.collapsed and "YES" or "no", r.dropped)
  end
  return table.concat(lines, "\n")
end

-- inspect.histogram(report, layer [, {width = 40}]) -> string, one line per expert
function M.histogram(report, l, opts)
  local ls = layer_of("histogram", report, l)
  local width = math.min(check_opts("histogram", opts, {width = COUNT}).width or 40, 200)
  local shares = shares_of(ls.counts)
  local mx = 0
  for _, v in ipairs(shares) do mx = math.max(mx, v) end
  local cw = #tostring(math.max(table.unpack(ls.counts)))
  local lines = {}
  for e, sh in ipairs(shares) do
    local fill = mx > 0 and math.floor(sh / mx * width + 0.5) or 0
    lines[e] = string.format("expert %2d |%s%s| %" .. cw .. "d %5.1f%%", e - 1, string.rep("#", fill),
                             string.rep(" ", width - fill), ls.counts[e], 100 * sh)
  end
  return table.concat(lines, "\n")
end

-- 256-colour backgrounds, distinct and readable with black text
local PALETTE = {196, 46, 33, 226, 201, 51, 208, 129, 118, 39, 220, 163, 85, 27, 214, 99}

local function show_byte(c)
  if c == 10 then return "\\n\n" end
  if c < 32 or c >= 127 then return string.format("\\x%02x", c) end
  return string.char(c)
end

-- inspect.tokens(report, layer [, {color = bool}]) -> the text, each byte
-- followed by its top expert's tag `[e]` (plain) or on its expert's colour.
function M.tokens(report, l, opts)
  local ls = per_token("tokens", report, l)
  local color = check_opts("tokens", opts, {color = {"boolean", false}}).color
  if color == nil then color = fs.isatty(1) end
  local out, s = {}, report.text
  for t = 1, #ls.top do
    local e = ls.top[t]
    if color then
      out[t] = string.format("\27[48;5;%dm\27[30m%s\27[0m", PALETTE[e % #PALETTE + 1], show_byte(s:byte(t)))
    else
      out[t] = show_byte(s:byte(t)) .. "[" .. e .. "]"
    end
  end
  return table.concat(out)
end

-- inspect.top_tokens(report, layer, n) -> {[e] = {{byte =, char =, count =}, ...}}
-- (each expert's n most frequent bytes over all its top-k assignments), and a string.
function M.top_tokens(report, l, n)
  local ls = per_token("top_tokens", report, l)
  if n ~= nil and (math.type(n) ~= "integer" or n < 1) then
    fail("top_tokens", "argument #3 (n): expected an integer >= 1, got %s", tostring(n))
  end
  n = n or 5
  local k, s, E = report.topk, report.text, #ls.counts
  local per = {}
  for e = 1, E do per[e] = {} end
  for i, e in ipairs(ls.assign) do
    local c = s:byte((i - 1) // k + 1)
    per[e + 1][c] = (per[e + 1][c] or 0) + 1
  end
  local out, lines = {}, {}
  for e = 1, E do
    local list = {}
    for c, cnt in pairs(per[e]) do list[#list + 1] = {byte = c, char = string.char(c), count = cnt} end
    table.sort(list, function(x, y) return x.count > y.count or (x.count == y.count and x.byte < y.byte) end)
    for i = #list, n + 1, -1 do list[i] = nil end
    out[e] = list
    local parts = {}
    for i, it in ipairs(list) do parts[i] = string.format("'%s':%d", (show_byte(it.byte):gsub("\n$", "")), it.count) end
    lines[e] = string.format("expert %2d: %s", e - 1, table.concat(parts, " "))
  end
  return out, table.concat(lines, "\n")
end

-- inspect.compare(a, b, layer [, layer_b]) -> rows, text: per expert {expert, share_a, share_b,
-- delta, se, z, changed, counts_a, counts_b}. A share is counts / (T k); a
-- token picks an expert at most once, so counts / T is a binomial
-- proportion q, and se = sqrt(q (1 - q) (1 / Ta + 1 / Tb)) / k, with q the
-- two reports' pooled proportion, is the standard error of delta when the
-- share did not change (the two-proportion z-test: an expert at 0% or 100%
-- in one small report keeps the variance the other side gives it);
-- changed when |delta| > 3 se (z = |delta| / se).
-- The text lists only the changed experts, or says there is no change
-- beyond noise. layer_b (default layer) compares two layers.
M.NOISE_SE = 3

function M.compare(a, b, l, lb)
  local la, lbb = layer_of("compare", a, l, 3, 1), layer_of("compare", b, lb or l, lb and 4 or 3, 2)
  if #la.counts ~= #lbb.counts then fail("compare", "expert counts differ (%d, %d)", #la.counts, #lbb.counts) end
  if a.topk ~= b.topk then fail("compare", "top-k differs (%d, %d)", a.topk, b.topk) end
  local k = a.topk
  local sa, na = shares_of(la.counts)
  local sb, nb = shares_of(lbb.counts)
  local ta, tb = na / k, nb / k
  local rows, lines = {}, {}
  for e = 1, #la.counts do
    local d = sb[e] - sa[e]
    local q = ta + tb > 0 and (la.counts[e] + lbb.counts[e]) / (ta + tb) or 0
    local var = ta > 0 and tb > 0 and q * (1 - q) * (1 / ta + 1 / tb) or math.huge   -- nothing to compare
    local se = math.sqrt(math.max(var, 0)) / k
    local z = se > 0 and math.abs(d) / se or (d ~= 0 and math.huge or 0)
    local changed = z > M.NOISE_SE
    rows[e] = {expert = e - 1, share_a = sa[e], share_b = sb[e], delta = d, se = se, z = z, changed = changed,
               counts_a = la.counts[e], counts_b = lbb.counts[e]}
    if changed then
      lines[#lines + 1] = ("expert %2d: %5.1f%% -> %5.1f%%  %+6.1f pts (se %.1f, %.1f se)  %s"):format(e - 1,
        100 * sa[e], 100 * sb[e], 100 * d, 100 * se, z, d > 0 and "gained" or "lost")
    end
  end
  if #lines == 0 then
    lines[1] = ("no change beyond noise (%g standard errors) in any of the %d experts (%d and %d tokens)")
      :format(M.NOISE_SE, #rows, math.floor(ta + 0.5), math.floor(tb + 0.5))
  end
  return rows, table.concat(lines, "\n")
end

-- ---- load over a run's steps (metrics.jsonl) -----------------------------------

-- top-k of a run: opts.topk, else num_experts_per_tok of its latest checkpoint.
local function run_topk(fn, run_dir, opts)
  local k = check_opts(fn, opts, {topk = COUNT}).topk
  if k then return k end
  -- `latest` and `last_good` are files naming a step directory (moelua.ckpt)
  for _, pointer in ipairs({ckpt.latest, ckpt.last_good}) do
    local ok, dir = pcall(pointer, run_dir .. "/ckpt")
    if ok and dir then
      local read, c = pcall(ckpt.config, dir)   -- a config that cannot be read tells nothing
      if read and type(c) == "table" and math.type(c.num_experts_per_tok) == "integer" then
        return c.num_experts_per_tok
      end
    end
  end
  fail(fn, "no checkpoint config in %s/ckpt to read top-k from: pass {topk = k}", run_dir)
end

local Loads = {}
function Loads.__tostring(t)
  local parts = {}
  for l in pairs(t.layers) do parts[#parts + 1] = l end
  table.sort(parts)
  for i, l in ipairs(parts) do parts[i] = M.loads_chart(t, l) end
  return table.concat(parts, "\n\n")
end

-- inspect.loads(run_dir [, layer] [, {topk =}]) -> {run_dir, topk, experts, steps = {step numbers},
-- replayed = {[step] = true}, layers = {[l] = {[i] = per step i: balance.layer's result plus
-- counts and shares}}}: every layer, or only `layer`. Reads run_dir/metrics.jsonl
-- through moelua.plot.read: lines with an "event" are events, others steps;
-- after a rollback the steps it abandoned are dropped and the replayed ones
-- kept (each step once, as the run finally took it; replayed marks them).
-- tostring (and the REPL) draws inspect.loads_chart for each layer.
function M.loads(run_dir, l, opts)
  if type(l) == "table" then l, opts = nil, l end
  if type(run_dir) ~= "string" or run_dir == "" then
    fail("loads", "argument #1 (run_dir): expected a run directory, got %s", type(run_dir))
  end
  if l ~= nil and math.type(l) ~= "integer" then
    fail("loads", "argument #2 (layer): expected a layer number (1-based), got %s", type(l))
  end
  local ok, r = pcall(require("moelua.plot").read, run_dir)
  if not ok then fail("loads", "%s", tostring(r):gsub("^[^:]*:%d+: ", "")) end
  local k = run_topk("loads", run_dir, opts)
  local out = {run_dir = run_dir, topk = k, steps = {}, replayed = r.replayed, layers = {}}
  for i, m in ipairs(r.kept) do
    out.steps[i] = m.step
    local loads = m.loads or {}
    if l ~= nil and not loads[l] then
      fail("loads", "argument #2 (layer): no layer %s: step %d logs %d layer%s (1..%d)", tostring(l), m.step,
           #loads, #loads == 1 and "" or "s", #loads)
    end
    for li, ld in ipairs(loads) do
      if k > #ld.counts then
        fail("loads", "option 'topk' = %d is more than the run's %d experts", k, #ld.counts)
      end
      if l == nil or li == l then
        local b = balance.layer(ld.counts, k)
        b.counts, b.shares, b.step = ld.counts, (shares_of(ld.counts)), m.step
        out.layers[li] = out.layers[li] or {}
        out.layers[li][i] = b
        out.experts = #ld.counts
      end
    end
  end
  return setmetatable(out, Loads)
end

-- Shading of a share against even (its ratio), lightest first.
local SHADES = {{0.25, " "}, {0.5, "."}, {0.75, ":"}, {1.25, "-"}, {1.75, "="}, {2.5, "+"}, {3.5, "*"},
                {math.huge, "#"}}
local function shade(r)
  for _, s in ipairs(SHADES) do if r < s[1] then return s[2] end end
end

-- inspect.loads_chart(loads, layer [, {width = 60}]) -> text: one row per
-- expert, one character per bucket of steps (the mean ratio to even there,
-- shaded " .:-=+*#"), and the last step's share.
function M.loads_chart(t, l, opts)
  if getmetatable(t) ~= Loads then fail("loads_chart", "argument #1: expected inspect.loads(run_dir)'s table") end
  local per = t.layers[l]
  if not per then fail("loads_chart", "argument #2 (layer): no layer %s in these loads", tostring(l)) end
  local n, E = #t.steps, t.experts
  local width = math.min(check_opts("loads_chart", opts, {width = COUNT}).width or 60, 400)
  local nb = math.min(n, width)
  local rows = {}
  for e = 1, E do
    local cells = {}
    for b = 1, nb do
      local from, to = (b - 1) * n // nb + 1, b * n // nb
      local sum = 0
      for i = from, to do sum = sum + per[i].ratios[e] end
      cells[b] = shade(sum / (to - from + 1))
    end
    rows[e] = ("expert %2d |%s| %5.1f%%"):format(e - 1, table.concat(cells), 100 * per[n].shares[e])
  end
  local head = ("layer %d, steps %d..%d (%d, %.1f a column); load / even share: ' ' < .25 '.' < .5 ':' < .75 " ..
                "'-' < 1.25 '=' < 1.75 '+' < 2.5 '*' < 3.5 '#'; last step's share at the right")
               :format(l, t.steps[1], t.steps[n], n, n / nb)
  return head .. "\n" .. table.concat(rows, "\n")
end

-- A small seeded generator (splitmix64), independent of math.random.
local function rng(seed)
  local x = seed
  return function()
    x = x + 0x9E3779B97F4A7C15
    local z = x
    z = (z ~ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ~ (z >> 27)) * 0x94D049BB133111EB
    z = z ~ (z >> 31)
    return (z >> 11) * (1.0 / 9007199254740992.0)
  end
end

local function sample(logits, o, rand)
  local V = math.min(#logits, 256)   -- the bytes: ids above 255 (a larger --vocab) are never drawn
  if o.greedy or o.temperature == 0 then
    local best = 1
    for i = 2, V do if logits[i] > logits[best] then best = i end end
    return best - 1
  end
  local mx = -math.huge
  for _, v in ipairs(logits) do mx = math.max(mx, v) end
  local ord, p, tot = {}, {}, 0
  for i = 1, V do p[i] = math.exp((logits[i] - mx) / o.temperature); tot = tot + p[i]; ord[i] = i end
  table.sort(ord, function(x, y) return p[x] > p[y] or (p[x] == p[y] and x < y) end)
  local keep, cum = 0, 0
  for j = 1, V do
    keep, cum = j, cum + p[ord[j]] / tot
    if cum >= o.top_p then break end
  end
  local u = rand() * cum * tot
  local acc = 0
  for j = 1, keep do
    acc = acc + p[ord[j]]
    if u < acc then return ord[j] - 1 end
  end
  return ord[keep] - 1
end

-- g = h:generate(prompt, {n = 32, temperature = 1, top_p = 1, seed = 0, greedy = false,
-- seq_len = 256, on_byte = nil}) -> {text (prompt and continuation), generated, tokens = {bytes},
-- trace = {[i] = {byte =, char =, layers = {[l] = {top-k expert ids}}, weights = {[l] =
-- {their combine weights}}}}}: trace[i] is the routing, at the position that
-- predicted generated byte i, of every layer; weights[l][j] is what expert
-- layers[l][j]'s output is multiplied by (renormalised over the top-k: they
-- sum to 1, unless the model was built with renorm = false).
-- Decoding runs one byte at a time against a KV cache of seq_len positions
-- (model:decode): the prompt's last seq_len bytes are prefilled, then each
-- generated byte is one position. When the cache is full, the context
-- restarts from the last seq_len // 2 bytes (one prefill; llama.cpp's
-- context shift also drops half), so a byte sees between half and all of
-- seq_len bytes before it. on_byte(char), when given, receives each
-- generated byte as soon as it is drawn (to stream it).
local GENERATE_OPTIONS = {n = {"integer", 32, min = 1}, temperature = {"number", 1.0, min = 0},
                          top_p = {"number", 1.0, above = 0}, seed = {"integer", 0, min = 0},
                          greedy = {"boolean", false},
                          seq_len = {"integer", 256, min = 1}, on_byte = {"function", false}}

function Handle:generate(prompt, o)
  check_self("generate", self)
  if type(prompt) ~= "string" or #prompt == 0 then fail("generate", "expected a non-empty prompt string") end
  o = check_opts("generate", o, GENERATE_OPTIONS)
  local n, S = o.n, o.seq_len
  local go = {greedy = o.greedy, temperature = o.temperature, top_p = o.top_p}
  if go.top_p > 1 then fail("generate", "option 'top_p' must be in (0, 1], got %s", go.top_p) end
  local rand = rng(o.seed)
  local model = self.model
  local cache = model:kv_cache(S)
  local bytes, out, trace = {prompt:byte(1, -1)}, {}, {}
  local function decode(from)   -- bytes[from..] at the cache's next positions
    local ids = tensor.tensor({table.unpack(bytes, from)}, {dtype = "i64"})
    local route = {}
    local lg = model:decode(ids, cache, route)
    ids:free()
    local logits = lg:to("f64"):totable()
    lg:free()
    return logits, route
  end
  local logits, route = decode(math.max(1, #bytes - S + 1))
  for i = 1, n do
    local b = sample(logits, go, rand)
    trace[i] = {byte = b, char = string.char(b), layers = route.layers, weights = route.weights}
    out[i], bytes[#bytes + 1] = string.char(b), b
    if o.on_byte then o.on_byte(out[i]) end
    if i < n then
      if cache.len == S then cache:reset() end
      logits, route = decode(cache.len == 0 and #bytes - math.max(1, S // 2) + 1 or #bytes)
    end
  end
  cache:free()
  local gen = table.concat(out)
  return {text = prompt .. gen, generated = gen, tokens = {gen:byte(1, -1)}, trace = trace}
end

return M
