-- moelua.plot: SVG plots of a training run, read from run_dir/metrics.jsonl
-- (lua/moelua/train.lua writes it). Pure SVG 1.1 text: no scripts, no
-- external fonts or files; any browser shows them.
--
--   local paths, bad_lines = plot.run(run_dir [, out_dir])   -- out_dir: run_dir/plots; lines not JSON
--   -- paths = {loss = ".../loss.svg", experts = ..., memory = ..., throughput = ...}
--   moelua plot RUN_DIR [OUT_DIR]                  -- the same from the shell (plot.main)
--
--   loss.svg        the kept training loss (and ce when it differs) per step,
--                   its centred moving average, validation loss; the steps a
--                   rollback abandoned (the lines logged before it for steps it
--                   replays) drawn faint, one stretch per rollback; rollbacks as
--                   dashed lines, one label per checkpoint they went back to
--                   ("3 rollbacks to step-000008 (@12, @15)"), in rows above the plot
--                   where no two overlap
--   experts.svg     per layer, a heatmap of each expert's share of the routed
--                   tokens (rows = experts, columns = steps; the last record of
--                   a step wins; more than MAX_COLS steps are averaged in bins)
--   memory.svg      ledger peak bytes per category (one line each) and total, MiB
--   throughput.svg  tokens/s (faint) with its centred moving average, replayed
--                   steps marked, and the step's time by phase as stacked areas
--                   (data, attention, router, dispatch, experts, ce, the rest of
--                   fwd+bwd, optim, and checkpoint: the seconds of the saves
--                   logged after the step's line)
-- Errors (missing run dir or metrics.jsonl, no step records) are raised as
-- "moelua.plot: ..." with level 0.
local json = require "dkjson"

local plot = {}

local MAX_COLS = 400
local PALETTE = {"#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1",
                 "#ff9da7", "#9c755f", "#bab0ac"}
local FONT = 'font-family="sans-serif"'

local function fail(msg, ...) error("moelua.plot: " .. string.format(msg, ...), 0) end

local function esc(s)
  return (tostring(s):gsub("[&<>\"']", {["&"] = "&amp;", ["<"] = "&lt;", [">"] = "&gt;",
                                        ['"'] = "&quot;", ["'"] = "&apos;"}))
end

local function finite(v) return type(v) == "number" and v == v and v ~= math.huge and v ~= -math.huge end

local function num(v) return string.format("%.2f", v):gsub("%.?0+$", "") end

-- ---- reading ----------------------------------------------------------------

-- Which step lines the run kept, from the log's order. A rollback event
-- (resume_step R) or a resume event (step R) abandons every step line and
-- validation logged before it for a step >= R; so does a step line whose step
-- is not above the last kept one (a log without its event), for step lines.
-- Sets r.kept (the kept step records, in step order), r.abandoned (per
-- abandoning line, the step records it abandoned, in log order),
-- r.replayed[step] (a kept step logged before: the replay of an abandoned one),
-- r.val_kept and r.val_abandoned (validation events).
local function trajectory(r)
  local kept, val, logged = {}, {}, {}
  r.abandoned, r.replayed, r.val_abandoned = {}, {}, {}
  local function cut(from, steps_only)
    local gone = {}
    while #kept > 0 and kept[#kept].step >= from do table.insert(gone, 1, table.remove(kept)) end
    if #gone > 0 then r.abandoned[#r.abandoned + 1] = gone end
    while not steps_only and #val > 0 and val[#val].step >= from do
      table.insert(r.val_abandoned, table.remove(val))
    end
  end
  for _, obj in ipairs(r.lines) do
    if obj.event == "rollback" and finite(obj.resume_step) then cut(obj.resume_step)
    elseif obj.event == "resume" and finite(obj.step) then cut(obj.step)
    elseif obj.event == "validation" and finite(obj.step) and finite(obj.loss) then val[#val + 1] = obj
    elseif obj.event == "checkpoint" and finite(obj.seconds) and #kept > 0 and kept[#kept].step == obj.step then
      kept[#kept].save_seconds = (kept[#kept].save_seconds or 0) + obj.seconds   -- saves after the step's line
    elseif not obj.event then
      if #kept > 0 and obj.step <= kept[#kept].step then cut(obj.step, true) end
      kept[#kept + 1] = obj
      logged[obj.step] = (logged[obj.step] or 0) + 1
    end
  end
  for _, m in ipairs(kept) do if logged[m.step] > 1 then r.replayed[m.step] = true end end
  r.kept, r.val_kept = kept, val
end

-- The run's records: {steps = {...in log order}, events = {...}, lines = {both, in log order},
-- last = {step -> record}, order = {sorted steps}}, and what trajectory() sets.
function plot.read(run_dir)
  if type(run_dir) ~= "string" or run_dir == "" then fail("a run directory is required") end
  local path = run_dir .. "/metrics.jsonl"
  local f = io.open(path, "r")
  if not f then
    local st = require("moelua.fs").stat(run_dir)
    if not st then fail("no run directory %s", run_dir) end
    if st.type ~= "dir" then fail("%s is not a run directory (a directory holding metrics.jsonl)", run_dir) end
    fail("no metrics.jsonl in %s", run_dir)
  end
  local text, why = f:read("a")   -- (f:lines() would raise a read error with this file's line)
  f:close()
  if not text then fail("cannot read %s: %s", path, tostring(why)) end
  local r = {steps = {}, events = {}, lines = {}, last = {}, order = {}, bad_lines = 0}
  local n = 0
  for line in text:gmatch("[^\n]+") do
    n = n + 1
    if line:find("%S") then
      local obj = json.decode(line)
      if type(obj) ~= "table" then
        r.bad_lines = r.bad_lines + 1   -- e.g. a half-written last line of a running job
      elseif obj.event then
        r.events[#r.events + 1] = obj
        r.lines[#r.lines + 1] = obj
      elseif finite(obj.step) then
        r.steps[#r.steps + 1] = obj
        r.lines[#r.lines + 1] = obj
        if not r.last[obj.step] then r.order[#r.order + 1] = obj.step end
        r.last[obj.step] = obj
      end
    end
  end
  if #r.steps == 0 then fail("no step records in %s (%d lines)", path, n) end
  table.sort(r.order)
  trajectory(r)
  return r
end

-- ---- drawing ----------------------------------------------------------------

local Svg = {}
Svg.__index = Svg

local function svg_new(w, h, title)
  local s = setmetatable({w = w, h = h, parts = {}}, Svg)
  s:add(string.format('<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d">',
                      w, h, w, h))
  s:add(string.format('<title>%s</title>', esc(title)))
  s:add(string.format('<rect x="0" y="0" width="%d" height="%d" fill="#ffffff"/>', w, h))
  s:text(w / 2, 24, title, {size = 16, anchor = "middle", weight = "bold"})
  return s
end

function Svg:add(s) self.parts[#self.parts + 1] = s end

function Svg:text(x, y, s, o)
  o = o or {}
  self:add(string.format('<text%s x="%s" y="%s" %s font-size="%d" fill="%s"%s%s%s>%s</text>',
                         o.class and (' class="' .. o.class .. '"') or "",
                         num(x), num(y), FONT, o.size or 11, o.fill or "#333333",
                         o.anchor and (' text-anchor="' .. o.anchor .. '"') or "",
                         o.weight and (' font-weight="' .. o.weight .. '"') or "",
                         o.rotate and string.format(' transform="rotate(%d %s %s)"', o.rotate, num(x), num(y)) or "",
                         esc(s)))
end

function Svg:line(x1, y1, x2, y2, stroke, o)
  o = o or {}
  self:add(string.format('<line x1="%s" y1="%s" x2="%s" y2="%s" stroke="%s" stroke-width="%s"%s%s%s/>',
                         num(x1), num(y1), num(x2), num(y2), stroke, o.width or 1,
                         o.dash and (' stroke-dasharray="' .. o.dash .. '"') or "",
                         o.opacity and (' stroke-opacity="' .. o.opacity .. '"') or "",
                         o.class and (' class="' .. o.class .. '"') or ""))
end

function Svg:finish()
  self:add("</svg>")
  return table.concat(self.parts, "\n") .. "\n"
end

-- 1, 2, 5 x 10^k ticks covering [lo, hi].
local function ticks(lo, hi, n)
  if hi <= lo then hi = lo + 1 end
  local raw = (hi - lo) / (n or 5)
  local mag = 10 ^ math.floor(math.log(raw, 10))
  local step = mag
  for _, m in ipairs({1, 2, 5, 10}) do
    if m * mag >= raw then step = m * mag; break end
  end
  local t, v = {}, math.ceil(lo / step - 1e-9) * step
  while v <= hi + step * 1e-9 do
    t[#t + 1] = math.abs(v) < step * 1e-9 and 0 or v
    v = v + step
  end
  return t, step
end

local function fmt(v, step)
  local a = math.abs(v)
  if a >= 1e9 then   -- 2e+13 (a blown-up loss), not 2e+07M; as many digits as the step needs
    local digits = math.floor(math.log(a, 10) + 1e-9) - math.floor(math.log(step, 10) + 1e-9) + 1
    return (string.format("%." .. math.max(1, digits) .. "g", v))
  end
  if a >= 1e6 and step >= 1e5 then return (string.format("%gM", v / 1e6)) end
  if a >= 1e4 and step >= 1e3 then return (string.format("%gk", v / 1e3)) end
  if step >= 1 and v == math.floor(v) then return string.format("%d", math.floor(v)) end
  local digits = math.max(0, -math.floor(math.log(step, 10) + 1e-9))
  return string.format("%." .. digits .. "f", v)
end

-- A plot area at (x, y, w, h) in the SVG with data ranges; returns the mappers.
local Panel = {}
Panel.__index = Panel

local function range(values, zero)
  local lo, hi = math.huge, -math.huge
  for _, v in ipairs(values) do
    if finite(v) then lo, hi = math.min(lo, v), math.max(hi, v) end
  end
  if lo > hi then lo, hi = 0, 1 end
  if zero then lo = math.min(lo, 0) end
  if hi == lo then lo, hi = lo - 0.5, hi + 0.5 end
  local pad = (hi - lo) * 0.05
  return (zero and lo == 0) and 0 or lo - pad, hi + pad
end

local function panel(svg, x, y, w, h, xlo, xhi, ylo, yhi)
  if xhi <= xlo then xlo, xhi = xlo - 0.5, xhi + 0.5 end
  return setmetatable({svg = svg, x = x, y = y, w = w, h = h, xlo = xlo, xhi = xhi, ylo = ylo, yhi = yhi}, Panel)
end

function Panel:px(v) return self.x + (v - self.xlo) / (self.xhi - self.xlo) * self.w end
function Panel:py(v) return self.y + self.h - (v - self.ylo) / (self.yhi - self.ylo) * self.h end

-- Frame, grid, ticks and axis labels.
function Panel:axes(xlabel, ylabel, o)
  o = o or {}
  local s = self.svg
  s:add(string.format('<rect x="%s" y="%s" width="%s" height="%s" fill="#fafafa" stroke="#999999"/>',
                      num(self.x), num(self.y), num(self.w), num(self.h)))
  local yt, ys = ticks(self.ylo, self.yhi, o.yticks or 5)
  for _, v in ipairs(yt) do
    if v >= self.ylo and v <= self.yhi then
      local py = self:py(v)
      s:line(self.x, py, self.x + self.w, py, "#e3e3e3")
      s:line(self.x - 4, py, self.x, py, "#666666")
      s:text(self.x - 7, py + 4, (o.yfmt or fmt)(v, ys), {anchor = "end", size = 10})
    end
  end
  if not o.no_x then
    local xt, xs = ticks(self.xlo, self.xhi, o.xticks or 8)
    for _, v in ipairs(xt) do
      if v >= self.xlo and v <= self.xhi and (xs >= 1 or not o.integer_x) then
        local px = self:px(v)
        s:line(px, self.y, px, self.y + self.h, "#e3e3e3")
        s:line(px, self.y + self.h, px, self.y + self.h + 4, "#666666")
        s:text(px, self.y + self.h + 16, fmt(v, xs), {anchor = "middle", size = 10})
      end
    end
  end
  if xlabel then s:text(self.x + self.w / 2, self.y + self.h + 34, xlabel, {anchor = "middle", size = 12}) end
  if ylabel then s:text(self.x - 50, self.y + self.h / 2, ylabel, {anchor = "middle", size = 12, rotate = -90}) end
  if o.title then s:text(self.x, self.y - 8, o.title, {size = 12, weight = "bold"}) end
end

-- A polyline through (xs[i], ys[i]), broken at non-finite values: one <path>
-- (class "series" and o.class). A lone point is a zero-length segment, which
-- the round caps draw as a dot.
function Panel:series(xs, ys, colour, o)
  o = o or {}
  local d, pen, last = {}, "M", nil
  for i = 1, #xs + 1 do
    if i <= #xs and finite(ys[i]) and finite(xs[i]) then
      last = string.format("%s %s", num(self:px(xs[i])), num(self:py(ys[i])))
      d[#d + 1] = pen .. last
      pen = "L"
    else
      if pen == "L" and d[#d]:sub(1, 1) == "M" then d[#d + 1] = "L" .. last end
      pen = "M"
    end
  end
  if #d == 0 then return end
  self.svg:add(string.format('<path class="series%s" data-series="%s" d="%s" fill="none" stroke="%s" ' ..
                             'stroke-width="%s"%s%s stroke-linejoin="round" stroke-linecap="round"/>',
                             o.class and (" " .. o.class) or "", esc(o.name or ""), table.concat(d, " "),
                             colour, o.width or 1.5,
                             o.dash and (' stroke-dasharray="' .. o.dash .. '"') or "",
                             o.opacity and (' stroke-opacity="' .. o.opacity .. '"') or ""))
  if o.markers then
    for i = 1, #xs do
      if finite(ys[i]) then
        self.svg:add(string.format('<circle cx="%s" cy="%s" r="3" fill="%s"/>',
                                   num(self:px(xs[i])), num(self:py(ys[i])), colour))
      end
    end
  end
end

-- A legend box at the top right of the panel: items = {{name, colour, dash,
-- box = true (a filled swatch) | dot = true (a marker; hollow = true),
-- width = w, opacity = o}}.
function Panel:legend(items, o)
  o = o or {}
  local s = self.svg
  local width = 0
  for _, it in ipairs(items) do width = math.max(width, #it[1]) end
  local bw, bh = width * 6.2 + 40, #items * 16 + 8
  local bx = o.x or (self.x + self.w - bw - 6)
  local by = o.y or (self.y + 6)
  s:add(string.format('<rect x="%s" y="%s" width="%s" height="%s" fill="#ffffff" fill-opacity="0.85" stroke="#cccccc"/>',
                      num(bx), num(by), num(bw), num(bh)))
  for i, it in ipairs(items) do
    local ly = by + 4 + (i - 0.5) * 16
    if it.box then
      s:add(string.format('<rect x="%s" y="%s" width="18" height="10" fill="%s"/>', num(bx + 6), num(ly - 5), it[2]))
    elseif it.dot then
      s:add(string.format('<circle cx="%s" cy="%s" r="3" fill="%s"%s/>', num(bx + 15), num(ly),
                          it.hollow and "#ffffff" or it[2], it.hollow and (' stroke="' .. it[2] .. '"') or ""))
    else
      s:line(bx + 6, ly, bx + 24, ly, it[2], {width = it.width or 2, dash = it[3], opacity = it.opacity})
    end
    s:text(bx + 30, ly + 4, it[1], {size = 10})
  end
end

local function write(path, text)
  local f, err = io.open(path, "w")
  if not f then fail("cannot write %s: %s", path, tostring(err)) end
  f:write(text)
  f:close()
  return path
end

local function xrange(r)
  return r.order[1], r.order[#r.order]
end

-- The smoothing window's half width for n points: a window of 2*half+1, about n/25.
local function smooth_half(n) return math.max(2, math.min(50, n // 50)) end

-- Centred moving average of ys over 2*half+1 points, narrowed symmetrically at
-- the ends (so it starts and ends on the data, with no lag); a non-finite
-- point stays a gap and is left out of its neighbours' averages.
local function smooth(ys, half)
  local out, n = {}, #ys
  for i = 1, n do
    if finite(ys[i]) then
      local h, sum, k = math.min(half, i - 1, n - i), 0, 0
      for j = i - h, i + h do
        if finite(ys[j]) then sum, k = sum + ys[j], k + 1 end
      end
      out[i] = sum / k
    else
      out[i] = 0 / 0
    end
  end
  return out
end

-- ---- the four plots ---------------------------------------------------------

-- Where a rollback label goes in the rows above the plot: beside its line
-- (right of it, or left when it would leave [left, right]), in the first row
-- where it overlaps no label placed so far. Returns the box's x and row, or
-- nil when max_rows are full there.
local function place(rows, x, w, left, right, max_rows)
  local bx = x + 3
  if bx + w > right then bx = x - 3 - w end
  bx = math.max(left, math.min(bx, right - w))
  for row = 1, max_rows do
    rows[row] = rows[row] or {}
    local free = true
    for _, b in ipairs(rows[row]) do
      if bx < b[2] + 4 and b[1] < bx + w + 4 then free = false; break end
    end
    if free then
      table.insert(rows[row], {bx, bx + w})
      return bx, row
    end
  end
end

-- The rollback events grouped by the step they went back to (resume_step),
-- in order of the first one: {{resume = R, events = {...}, at = {distinct steps, ascending}}}.
local function rollback_groups(r)
  local groups, by = {}, {}
  for _, e in ipairs(r.events) do
    if e.event == "rollback" and finite(e.step) then
      local key = finite(e.resume_step) and e.resume_step or ("?" .. e.step)
      local g = by[key]
      if not g then
        g = {resume = e.resume_step, events = {}, at = {}, seen = {}}
        by[key] = g
        groups[#groups + 1] = g
      end
      g.events[#g.events + 1] = e
      if not g.seen[e.step] then g.seen[e.step] = true; g.at[#g.at + 1] = e.step end
    end
  end
  for _, g in ipairs(groups) do table.sort(g.at) end
  return groups
end

-- "rollback @6: loss spike -> step-000004, lr x0.5", or for several to one
-- checkpoint "3 rollbacks to step-000008 (@12, @15): loss spike, lr x0.125"
-- (the last lr scale): the checkpoint, as the event's `to` and the console
-- name it; the replay starts at the step after it.
local function rollback_label(g)
  local reasons, seen = {}, {}
  for _, e in ipairs(g.events) do
    local why = tostring(e.reason or "?")
    if not seen[why] then seen[why] = true; reasons[#reasons + 1] = why end
  end
  local last = g.events[#g.events]
  local lr = finite(last.lr_scale) and last.lr_scale ~= 1 and string.format(", lr x%g", last.lr_scale) or ""
  local to = finite(g.resume) and string.format("step-%06d", g.resume - 1)
  if #g.events == 1 then
    return string.format("rollback @%d: %s%s%s", last.step, reasons[1], to and " -> " .. to or "", lr)
  end
  local at = {}
  for i = 1, math.min(#g.at, 4) do at[i] = "@" .. g.at[i] end
  if #g.at > 4 then at[#at + 1] = "..." end
  return string.format("%d rollbacks to %s (%s): %s%s", #g.events, to or "?",
                       table.concat(at, ", "), table.concat(reasons, ", "), lr)
end

local LOSS_COLOUR, SMOOTH_COLOUR, ABANDONED_COLOUR = PALETTE[1], "#1d3557", "#e15759"
local LABEL_ROWS, ROW_H = 6, 16

function plot.loss_svg(r)
  local W, PH = 900, 370
  -- rollback labels first: they go in rows between the title and the plot, so
  -- they hide no data, and the plot moves down by the rows they take
  local xlo, xhi = xrange(r)
  local p = panel(nil, 80, 0, W - 110, PH, xlo, xhi, 0, 1)
  local groups, rows, labels, hidden = rollback_groups(r), {}, {}, 0
  for _, g in ipairs(groups) do
    local text = rollback_label(g)
    local x = p:px(g.at[#g.at])
    local w = #text * 5.6 + 6
    local bx, row = place(rows, x, w, p.x, p.x + p.w, LABEL_ROWS)
    if bx then labels[#labels + 1] = {text = text, x = x, bx = bx, row = row, w = w} else hidden = hidden + 1 end
  end
  local nrows = 0
  for _, l in ipairs(labels) do nrows = math.max(nrows, l.row) end
  local band = 38
  p.y = math.max(50, band + nrows * ROW_H + 10)
  local H = p.y + PH + 60
  local s = svg_new(W, H, "Loss")
  p.svg = s
  local vals = {}
  local show_ce = false
  for _, m in ipairs(r.steps) do
    vals[#vals + 1] = m.loss
    if finite(m.ce) and finite(m.loss) and math.abs(m.ce - m.loss) > 1e-6 * math.abs(m.loss) then show_ce = true end
  end
  local vsteps, vloss = {}, {}
  for _, e in ipairs(r.val_kept) do vsteps[#vsteps + 1], vloss[#vloss + 1] = e.step, e.loss end
  for _, e in ipairs(r.val_kept) do vals[#vals + 1] = e.loss end
  for _, e in ipairs(r.val_abandoned) do vals[#vals + 1] = e.loss end
  if show_ce then for _, m in ipairs(r.kept) do vals[#vals + 1] = m.ce end end
  p.ylo, p.yhi = range(vals)
  p:axes("step", "loss", {integer_x = true})
  -- rollbacks: a dashed line at each step one fired, under the data; a
  -- connector from each label down to its line
  local drawn = {}
  for _, g in ipairs(groups) do
    for _, st in ipairs(g.at) do
      if not drawn[st] then
        drawn[st] = true
        local x = p:px(st)
        s:line(x, p.y, x, p.y + p.h, PALETTE[4], {width = 1.5, dash = "5 3", class = "rollback"})
      end
    end
  end
  for _, l in ipairs(labels) do
    s:line(l.x, band + (l.row - 0.5) * ROW_H, l.x, p.y, PALETTE[4], {width = 1, dash = "2 2"})
  end
  for _, l in ipairs(labels) do
    local by = band + (l.row - 1) * ROW_H
    s:add(string.format('<rect class="rollback-label" x="%s" y="%s" width="%s" height="14" fill="#ffffff" ' ..
                        'stroke="%s" stroke-width="0.5"/>', num(l.bx), num(by), num(l.w), PALETTE[4]))
    s:text(l.bx + 3, by + 10.5, l.text, {size = 10, fill = PALETTE[4], class = "rollback-label"})
  end
  if hidden > 0 then
    s:text(p.x + p.w, p.y + p.h + 34, string.format("(%d more rollback label%s: no room)", hidden,
                                                    hidden == 1 and "" or "s"), {size = 10, anchor = "end", fill = PALETTE[4]})
  end
  -- what rollbacks abandoned, faint: one line per stretch, a dot on its last
  -- step (where a rollback fired, its line would hide a spike there)
  for _, part in ipairs(r.abandoned) do
    local xs, ys = {}, {}
    for j, m in ipairs(part) do xs[j], ys[j] = m.step, m.loss end
    p:series(xs, ys, ABANDONED_COLOUR, {name = "abandoned steps", class = "abandoned", width = 1.2, opacity = 0.45})
    if finite(ys[#ys]) then
      s:add(string.format('<circle class="abandoned-end" cx="%s" cy="%s" r="2.5" fill="%s" fill-opacity="0.6"/>',
                          num(p:px(xs[#xs])), num(p:py(ys[#ys])), ABANDONED_COLOUR))
    end
  end
  -- the kept trajectory, raw, and its moving average on top
  local xs, ys, cs = {}, {}, {}
  for j, m in ipairs(r.kept) do xs[j], ys[j], cs[j] = m.step, m.loss, m.ce end
  if show_ce then p:series(xs, cs, PALETTE[3], {name = "cross-entropy", width = 1}) end
  p:series(xs, ys, LOSS_COLOUR, {name = "training loss", width = 1})
  local half = smooth_half(#xs)
  local smoothed = #xs >= 3
  if smoothed then
    p:series(xs, smooth(ys, half), SMOOTH_COLOUR, {name = "training loss, moving average", class = "smoothed", width = 2.2})
  end
  if #vsteps > 0 then p:series(vsteps, vloss, PALETTE[2], {name = "validation loss", markers = true, width = 2}) end
  for _, e in ipairs(r.val_abandoned) do   -- validations of abandoned steps: hollow markers
    s:add(string.format('<circle class="validation-abandoned" cx="%s" cy="%s" r="3" fill="#ffffff" stroke="%s"/>',
                        num(p:px(e.step)), num(p:py(e.loss)), PALETTE[2]))
  end
  local items = {{"training loss (kept steps)", LOSS_COLOUR, width = 1}}
  if smoothed then items[#items + 1] = {string.format("centred mean of %d steps", 2 * half + 1), SMOOTH_COLOUR} end
  if #r.abandoned > 0 then items[#items + 1] = {"abandoned by a rollback or resume", ABANDONED_COLOUR, opacity = 0.45} end
  if show_ce then items[#items + 1] = {"cross-entropy", PALETTE[3]} end
  if #vsteps > 0 then items[#items + 1] = {"validation loss", PALETTE[2]} end
  if #r.val_abandoned > 0 then items[#items + 1] = {"validation (abandoned)", PALETTE[2], dot = true, hollow = true} end
  if #groups > 0 then items[#items + 1] = {"rollback", PALETTE[4], "5 3"} end
  p:legend(items)
  return s:finish()
end

-- Viridis, five stops, t in [0, 1].
local VIRIDIS = {{68, 1, 84}, {59, 82, 139}, {33, 145, 140}, {94, 201, 98}, {253, 231, 37}}
local function colour(t)
  t = math.max(0, math.min(1, t))
  local pos = t * (#VIRIDIS - 1)
  local i = math.min(#VIRIDIS - 2, math.floor(pos))
  local f = pos - i
  local a, b = VIRIDIS[i + 1], VIRIDIS[i + 2]
  return string.format("#%02x%02x%02x", math.floor(a[1] + (b[1] - a[1]) * f + 0.5),
                       math.floor(a[2] + (b[2] - a[2]) * f + 0.5), math.floor(a[3] + (b[3] - a[3]) * f + 0.5))
end

function plot.experts_svg(r)
  -- layers and experts from the records that carry loads
  local nl, ne = 0, 0
  for _, st in ipairs(r.order) do
    local m = r.last[st]
    if type(m.loads) == "table" then
      nl = math.max(nl, #m.loads)
      for _, l in ipairs(m.loads) do ne = math.max(ne, type(l.counts) == "table" and #l.counts or 0) end
    end
  end
  -- columns: steps, or bins of steps when there are many
  local nsteps = #r.order
  local ncols = math.min(nsteps, MAX_COLS)
  local cols = {}
  for c = 1, ncols do
    local a = math.floor((c - 1) * nsteps / ncols) + 1
    local b = math.floor(c * nsteps / ncols)
    cols[c] = {a = a, b = b}
  end
  -- share[layer][expert][col], and the colour scale's top
  local share, top = {}, 0
  for li = 1, nl do
    share[li] = {}
    for e = 1, ne do share[li][e] = {} end
    for c, col in ipairs(cols) do
      local sums, n = {}, 0
      for k = col.a, col.b do
        local m = r.last[r.order[k]]
        local l = type(m.loads) == "table" and m.loads[li]
        if l and type(l.counts) == "table" then
          local total = 0
          for e = 1, ne do total = total + (tonumber(l.counts[e]) or 0) end
          if total > 0 then
            n = n + 1
            for e = 1, ne do sums[e] = (sums[e] or 0) + (tonumber(l.counts[e]) or 0) / total end
          end
        end
      end
      for e = 1, ne do
        local v = n > 0 and sums[e] / n or nil
        share[li][e][c] = v
        if v then top = math.max(top, v) end
      end
    end
  end
  if top <= 0 then top = 1 end
  local cell_h = math.max(4, math.min(24, math.floor(240 / math.max(ne, 1))))
  local panel_h = math.max(ne, 1) * cell_h
  local W = 980
  local left, right = 80, 150
  local plot_w = W - left - right
  local H = 50 + math.max(nl, 1) * (panel_h + 60) + 20
  local s = svg_new(W, H, string.format("Expert load: share of routed tokens (%d layer%s, %d experts)",
                                        nl, nl == 1 and "" or "s", ne))
  if nl == 0 or ne == 0 then
    s:text(W / 2, H / 2, "no expert loads in metrics.jsonl", {anchor = "middle", size = 14})
    return s:finish()
  end
  local first, last = xrange(r)
  local cw = plot_w / ncols
  for li = 1, nl do
    local y0 = 50 + (li - 1) * (panel_h + 60) + 14
    s:text(left, y0 - 6, string.format("layer %d", li), {size = 12, weight = "bold"})
    s:add(string.format('<g class="heatmap" data-layer="%d" shape-rendering="crispEdges">', li))
    for e = 1, ne do
      for c = 1, ncols do
        local v = share[li][e][c]
        s:add(string.format('<rect class="cell" x="%s" y="%s" width="%s" height="%d" fill="%s"/>',
                            num(left + (c - 1) * cw), num(y0 + (e - 1) * cell_h), num(cw + 0.05), cell_h,
                            v and colour(v / top) or "#dddddd"))
      end
    end
    s:add("</g>")
    s:add(string.format('<rect x="%d" y="%s" width="%s" height="%d" fill="none" stroke="#666666"/>',
                        left, num(y0), num(plot_w), panel_h))
    -- experts on the y axis (every one when they fit, else a few)
    local every = math.max(1, math.ceil(ne / math.max(1, math.floor(panel_h / 12))))
    for e = 1, ne, every do
      s:text(left - 6, y0 + (e - 0.5) * cell_h + 4, string.format("expert %d", e - 1), {size = 10, anchor = "end"})
    end
    -- steps on the x axis: the step at each tick's column
    local xt, xs = ticks(first, last, 8)
    local xp = panel(s, left, y0, plot_w, panel_h, first - 0.5, last + 0.5, 0, 1)
    if ncols == nsteps then
      -- one column per recorded step: put ticks at column centres of the nearest recorded step
      for _, v in ipairs(xt) do
        local best
        for k, st in ipairs(r.order) do if st >= v then best = k; break end end
        if best and xs >= 1 then
          local px = left + (best - 0.5) * cw
          s:line(px, y0 + panel_h, px, y0 + panel_h + 4, "#666666")
          s:text(px, y0 + panel_h + 15, fmt(r.order[best], xs), {size = 10, anchor = "middle"})
        end
      end
    else
      for _, v in ipairs(xt) do
        if v >= first and v <= last then
          local px = xp:px(v)
          s:line(px, y0 + panel_h, px, y0 + panel_h + 4, "#666666")
          s:text(px, y0 + panel_h + 15, fmt(v, xs), {size = 10, anchor = "middle"})
        end
      end
    end
    s:text(left + plot_w / 2, y0 + panel_h + 30, ncols == nsteps and "step" or
           string.format("step (%d steps in %d columns, averaged)", nsteps, ncols), {size = 11, anchor = "middle"})
  end
  -- colour scale
  local lx, ly, lh = W - right + 30, 64, math.min(200, math.max(80, H - 140))
  s:add('<defs><linearGradient id="scale" x1="0" y1="1" x2="0" y2="0">')
  for i = 0, 10 do
    s:add(string.format('<stop offset="%s" stop-color="%s"/>', num(i / 10), colour(i / 10)))
  end
  s:add('</linearGradient></defs>')
  s:text(lx, ly - 10, "token share", {size = 11, weight = "bold"})
  s:add(string.format('<rect class="legend" x="%d" y="%d" width="16" height="%d" fill="url(#scale)" stroke="#666666"/>',
                      lx, ly, lh))
  local st_, ss = ticks(0, top, 5)
  for _, v in ipairs(st_) do
    if v <= top then
      local py = ly + lh - v / top * lh
      s:line(lx + 16, py, lx + 20, py, "#666666")
      s:text(lx + 23, py + 4, fmt(v, ss), {size = 10})
    end
  end
  local even = 1 / ne
  if even <= top then
    local py = ly + lh - even / top * lh
    s:line(lx - 4, py, lx + 20, py, "#e15759", {width = 1.5})
    s:text(lx + 23, py + 16, string.format("even (1/%d)", ne), {size = 10, fill = "#e15759"})
  end
  s:text(lx, ly + lh + 22, "grey: no data", {size = 10})
  return s:finish()
end

function plot.memory_svg(r)
  local W, H = 900, 480
  local s = svg_new(W, H, "Memory: ledger peak by category")
  local cats, seen = {}, {}
  for _, st in ipairs(r.order) do
    local lp = r.last[st].ledger_peak
    if type(lp) == "table" then
      for k, v in pairs(lp) do
        if k ~= "total" and type(v) == "number" and not seen[k] then seen[k] = true; cats[#cats + 1] = k end
      end
    end
  end
  table.sort(cats)
  local MiB = 2 ^ 20
  local xs, all, series = {}, {}, {}
  for _, k in ipairs(cats) do series[k] = {} end
  series.total = {}
  for i, st in ipairs(r.order) do
    xs[i] = st
    local lp = type(r.last[st].ledger_peak) == "table" and r.last[st].ledger_peak or {}
    for _, k in ipairs(cats) do
      series[k][i] = type(lp[k]) == "number" and lp[k] / MiB or nil
      all[#all + 1] = series[k][i]
    end
    series.total[i] = type(lp.total) == "number" and lp.total / MiB or nil
    all[#all + 1] = series.total[i]
  end
  local ylo, yhi = range(all, true)
  local xlo, xhi = xrange(r)
  local p = panel(s, 80, 50, W - 260, H - 110, xlo, xhi, ylo, yhi)
  p:axes("step", "peak (MiB)", {integer_x = true})
  local items = {}
  for i, k in ipairs(cats) do
    local c = PALETTE[(i - 1) % #PALETTE + 1]
    p:series(xs, series[k], c, {name = k, dash = i > #PALETTE and "4 2" or nil})
    items[#items + 1] = {k, c, i > #PALETTE and "4 2" or nil}
  end
  if #series.total > 0 then
    p:series(xs, series.total, "#222222", {name = "total", width = 2, dash = "6 3"})
    items[#items + 1] = {"total", "#222222", "6 3"}
  end
  if #items == 0 then s:text(W / 2, H / 2, "no ledger peaks in metrics.jsonl", {anchor = "middle", size = 14}) end
  if #items > 0 then p:legend(items, {x = p.x + p.w + 14, y = p.y}) end
  return s:finish()
end

local PHASES = {"data", "attention", "router", "dispatch", "experts", "ce", "fwd+bwd other", "optim", "checkpoint"}

function plot.throughput_svg(r)
  local W, H = 940, 720
  local s = svg_new(W, H, "Throughput and step time by phase")
  local xs, tps = {}, {}
  local stack = {}
  for _, k in ipairs(PHASES) do stack[k] = {} end
  local has = {}
  for i, m in ipairs(r.kept) do
    xs[i], tps[i] = m.step, m.tokens_per_s
    local ph = type(m.phases) == "table" and m.phases or {}
    local inner = 0
    for _, k in ipairs({"attention", "router", "dispatch", "experts", "ce"}) do
      inner = inner + (finite(ph[k]) and ph[k] or 0)
    end
    local fb = (finite(ph.fwd) and ph.fwd or 0) + (finite(ph.bwd) and ph.bwd or 0)
    for _, k in ipairs(PHASES) do
      local v
      if k == "fwd+bwd other" then v = math.max(0, fb - inner)
      elseif k == "checkpoint" then   -- its saves' events (older logs: a phase of the line)
        v = finite(m.save_seconds) and m.save_seconds or finite(ph.checkpoint) and ph.checkpoint or 0
      else v = finite(ph[k]) and ph[k] or 0 end
      stack[k][i] = v
      if v > 0 then has[k] = true end
    end
  end
  local xlo, xhi = xrange(r)
  -- tokens/s
  local tlo, thi = range(tps, true)
  local p1 = panel(s, 80, 56, W - 300, 220, xlo, xhi, tlo, thi)
  p1:axes(nil, "tokens/s", {integer_x = true, title = "tokens per second"})
  -- replayed steps (after a rollback): a band behind each run of them, a marker on each
  local replayed, bands = {}, {}
  for i, st in ipairs(xs) do
    if r.replayed[st] then
      replayed[#replayed + 1] = i
      local b = bands[#bands]
      if b and b.last == i - 1 then b.last = i else bands[#bands + 1] = {first = i, last = i} end
    end
  end
  local half_step = #xs > 1 and p1.w / (#xs - 1) / 2 or 2
  for _, b in ipairs(bands) do
    local x0 = math.max(p1.x, p1:px(xs[b.first]) - half_step)
    local x1 = math.min(p1.x + p1.w, p1:px(xs[b.last]) + half_step)
    s:add(string.format('<rect class="replayed-band" x="%s" y="%s" width="%s" height="%s" fill="%s" fill-opacity="0.1"/>',
                        num(x0), num(p1.y), num(math.max(x1 - x0, 1)), num(p1.h), PALETTE[4]))
  end
  p1:series(xs, tps, PALETTE[1], {name = "tokens/s", class = "raw", width = 1, opacity = 0.4})
  local half = smooth_half(#xs)
  local items = {{"tokens/s, each step", PALETTE[1], width = 1, opacity = 0.4}}
  if #xs >= 3 then
    p1:series(xs, smooth(tps, half), "#1d3557", {name = "tokens/s, moving average", class = "smoothed", width = 2})
    items[#items + 1] = {string.format("centred mean, %d steps", 2 * half + 1), "#1d3557"}
  end
  for _, i in ipairs(replayed) do
    if finite(tps[i]) then
      s:add(string.format('<circle class="replayed" data-step="%d" cx="%s" cy="%s" r="2.5" fill="%s"/>',
                          xs[i], num(p1:px(xs[i])), num(p1:py(tps[i])), PALETTE[4]))
    end
  end
  if #replayed > 0 then items[#items + 1] = {"replayed (rollback)", PALETTE[4], dot = true} end
  p1:legend(items, {x = p1.x + p1.w + 14, y = p1.y})
  -- stacked phases
  local tops, cum = {}, {}
  for i = 1, #xs do cum[i] = 0 end
  local layers = {}
  for _, k in ipairs(PHASES) do
    if has[k] then
      local lo = {}
      for i = 1, #xs do lo[i] = cum[i]; cum[i] = cum[i] + stack[k][i] end
      local hi = {}
      for i = 1, #xs do hi[i] = cum[i] end
      layers[#layers + 1] = {name = k, lo = lo, hi = hi}
    end
  end
  for i = 1, #xs do tops[i] = cum[i] end
  local slo, shi = range(tops, true)
  local p2 = panel(s, 80, 330, W - 300, 320, xlo, xhi, slo, shi)
  p2:axes("step", "seconds per step", {integer_x = true, title = "step time by phase (stacked)"})
  local items = {}
  for li, l in ipairs(layers) do
    local c = PALETTE[(li - 1) % #PALETTE + 1]
    local d = {}
    if #xs == 1 then
      -- one step: a bar
      local x0, x1 = p2.x + p2.w * 0.4, p2.x + p2.w * 0.6
      d[1] = string.format("M%s %s L%s %s L%s %s L%s %s Z", num(x0), num(p2:py(l.lo[1])), num(x1), num(p2:py(l.lo[1])),
                           num(x1), num(p2:py(l.hi[1])), num(x0), num(p2:py(l.hi[1])))
    else
      for i = 1, #xs do d[#d + 1] = string.format("%s%s %s", i == 1 and "M" or "L", num(p2:px(xs[i])), num(p2:py(l.hi[i]))) end
      for i = #xs, 1, -1 do d[#d + 1] = string.format("L%s %s", num(p2:px(xs[i])), num(p2:py(l.lo[i]))) end
      d[#d + 1] = "Z"
    end
    s:add(string.format('<path class="phase" data-series="%s" d="%s" fill="%s" fill-opacity="0.85" stroke="%s" stroke-width="0.5"/>',
                        esc(l.name), table.concat(d, " "), c, c))
    items[#items + 1] = {l.name, c, box = true}
  end
  if #layers == 0 then s:text(p2.x + p2.w / 2, p2.y + p2.h / 2, "no phase times", {anchor = "middle"}) end
  -- legend top-down in stacking order (top layer first)
  local rev = {}
  for i = #items, 1, -1 do rev[#rev + 1] = items[i] end
  if #rev > 0 then p2:legend(rev, {x = p2.x + p2.w + 14, y = p2.y}) end
  s:text(p2.x + p2.w + 14, p2.y + #rev * 16 + 30, "attention .. ce: inside fwd+bwd", {size = 9})
  return s:finish()
end

-- ---- entry points -----------------------------------------------------------

function plot.run(run_dir, out_dir)
  local r = plot.read(run_dir)
  out_dir = out_dir or (run_dir .. "/plots")
  local ok, err = pcall(require("moelua.fs").mkdir_p, out_dir)
  if not ok then fail("cannot create the output directory: %s", tostring(err)) end
  local paths = {}
  for _, name in ipairs({"loss", "experts", "memory", "throughput"}) do
    paths[name] = write(out_dir .. "/" .. name .. ".svg", plot[name .. "_svg"](r))
  end
  return paths, r.bad_lines
end

local USAGE = "usage: moelua plot RUN_DIR [OUT_DIR]   (writes OUT_DIR, default RUN_DIR/plots, *.svg)"

-- `moelua plot RUN_DIR [OUT_DIR]`: args are the words after "plot". Prints
-- the written paths; on an error prints it (no traceback) and returns false.
function plot.main(args)
  args = args or {}
  if args[1] == "-h" or args[1] == "--help" then print(USAGE); return true end
  local bad = #args > 2 and "an extra argument '" .. tostring(args[3]) .. "'"
  for _, a in ipairs(args) do
    if a:match("^%-") then bad = "unknown option '" .. a .. "'" end   -- not a directory to write into
  end
  if #args < 1 or bad then
    io.stderr:write(bad and "moelua plot: " .. bad .. "\n" or "", USAGE, "\n")
    return false
  end
  local ok, paths, bad = pcall(plot.run, args[1], args[2])
  if not ok then
    io.stderr:write(tostring(paths), "\n")
    return false
  end
  if bad > 0 then
    io.stderr:write(string.format("moelua.plot: %d line%s of %s/metrics.jsonl %s not JSON, left out (a running " ..
                                  "job's last line may be half-written)\n", bad, bad == 1 and "" or "s", args[1],
                                  bad == 1 and "is" or "are"))
  end
  for _, name in ipairs({"loss", "experts", "memory", "throughput"}) do print(paths[name]) end
  return true
end

return plot
