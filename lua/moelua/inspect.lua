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
--   local d, s = inspect.compare(r, r2, 1)            -- per-expert share changes
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

local M = {}
local Handle = {}
Handle.__index = Handle

local LN2 = math.log(2)

local function fail(fn, fmt, ...) error("moelua.inspect." .. fn .. ": " .. string.format(fmt, ...), 3) end

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

local function read_input(fn, x)
  if type(x) ~= "string" then fail(fn, "expected a text or a file path, got %s", type(x)) end
  if #x < 4096 and not x:find("\n", 1, true) then
    local st = fs.stat(x)
    if st and st.type == "file" then
      local f = assert(io.open(x, "rb"))
      local s = f:read("a")
      f:close()
      return s
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

function Handle:run(x, opts)
  opts = opts or {}
  local s = read_input("run", x)
  local model = self.model
  local S = opts.seq_len or 256
  if math.type(S) ~= "integer" or S < 1 then fail("run", "option 'seq_len' must be an integer >= 1") end
  if #s < 1 then fail("run", "empty input") end
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
  model:_release()
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

local function layer_of(fn, report, l)
  local ls = type(report) == "table" and report.layers and report.layers[l]
  if not ls then fail(fn, "no layer %s in the report (1..%d)", tostring(l), report and report.layers and #report.layers or 0) end
  return ls
end

-- inspect.histogram(report, layer [, {width = 40}]) -> string, one line per expert
function M.histogram(report, l, opts)
  local ls = layer_of("histogram", report, l)
  local width = math.max(1, math.min((opts and opts.width) or 40, 200))
  local mx = 0
  for _, v in ipairs(ls.shares) do mx = math.max(mx, v) end
  local cw = #tostring(math.max(table.unpack(ls.counts)))
  local lines = {}
  for e, sh in ipairs(ls.shares) do
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
  local ls = layer_of("tokens", report, l)
  local color = opts and opts.color
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
  local ls = layer_of("top_tokens", report, l)
  n = n or 5
  local k, s = report.topk, report.text
  local per = {}
  for e = 1, report.experts do per[e] = {} end
  for i, e in ipairs(ls.assign) do
    local c = s:byte((i - 1) // k + 1)
    per[e + 1][c] = (per[e + 1][c] or 0) + 1
  end
  local out, lines = {}, {}
  for e = 1, report.experts do
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

-- inspect.compare(a, b, layer [, layer_b]) -> {[e] = {expert, share_a, share_b, delta,
-- counts_a, counts_b}}, string. layer_b (default layer) lets one compare two layers.
function M.compare(a, b, l, lb)
  local la, lbb = layer_of("compare", a, l), layer_of("compare", b, lb or l)
  if #la.shares ~= #lbb.shares then fail("compare", "expert counts differ (%d, %d)", #la.shares, #lbb.shares) end
  local rows, lines = {}, {}
  for e = 1, #la.shares do
    local d = lbb.shares[e] - la.shares[e]
    rows[e] = {expert = e - 1, share_a = la.shares[e], share_b = lbb.shares[e], delta = d,
               counts_a = la.counts[e], counts_b = lbb.counts[e]}
    local what = d > 0 and "gained" or d < 0 and "lost" or "same"
    lines[e] = string.format("expert %2d: %5.1f%% -> %5.1f%%  %+6.1f pts  %s", e - 1, 100 * la.shares[e],
                             100 * lbb.shares[e], 100 * d, what)
  end
  return rows, table.concat(lines, "\n")
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
  local V = #logits
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
-- seq_len = 256}) -> {text (prompt and continuation), generated, tokens = {bytes},
-- trace = {[i] = {byte =, char =, layers = {[l] = {top-k expert ids}}}}}: trace[i]
-- is the routing, at the position that predicted generated byte i, of every layer.
-- The context is the last seq_len bytes.
function Handle:generate(prompt, o)
  o = o or {}
  if type(prompt) ~= "string" or #prompt == 0 then fail("generate", "expected a non-empty prompt string") end
  local n, S = o.n or 32, o.seq_len or 256
  local go = {greedy = o.greedy, temperature = o.temperature or 1.0, top_p = o.top_p or 1.0}
  if go.temperature < 0 then fail("generate", "option 'temperature' must be >= 0") end
  if not (go.top_p > 0 and go.top_p <= 1) then fail("generate", "option 'top_p' must be in (0, 1]") end
  local rand = rng(math.tointeger(o.seed or 0) or 0)
  local model, L = self.model, self.model.opts.layers
  local bytes, out, trace = {prompt:byte(1, -1)}, {}, {}
  for i = 1, n do
    local from = math.max(1, #bytes - S + 1)
    local ctx = {table.unpack(bytes, from)}
    ctx[#ctx + 1] = 0
    local tokens = tensor.tensor(ctx, {dtype = "i64"})
    model:forward(tokens, 0)
    local lg = model:last_logits()
    local logits = lg:to("f64"):totable()
    lg:free()
    local step = {layers = {}}
    for l = 1, L do
      local idx = model.blocks[l].moe.layer.ctx.idx
      local row = idx:select(1, idx:size(1)):totable()
      for j = 1, #row do row[j] = math.tointeger(row[j]) end
      step.layers[l] = row
    end
    tokens:free()
    local b = sample(logits, go, rand)
    step.byte, step.char = b, string.char(b)
    trace[i], out[i], bytes[#bytes + 1] = step, string.char(b), b
  end
  model:_release()
  local gen = table.concat(out)
  return {text = prompt .. gen, generated = gen, tokens = {gen:byte(1, -1)}, trace = trace}
end

return M
