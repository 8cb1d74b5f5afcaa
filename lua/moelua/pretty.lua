-- moelua.pretty: a value as text a person reads, for both REPLs: `moelua -i`
-- (lua/moelua/repl.lua prints each result with it) and `moelua attach`
-- (lua/moelua/attach_env.lua shows each reply value with it, in the job's
-- training thread and in the server thread of host/bindings/attach.c). That thread's
-- Lua state has only base, string, table and math and loads this file by its
-- path, so this module uses nothing else and requires nothing. While an
-- attach line runs, the strings' methods are the line's restricted ones, so
-- this file calls the string functions it captured at load, never s:method().
--
--   pretty.show(v [, opts]) -> string
--
-- A table prints as a Lua constructor: the array part 1..#t first, without
-- keys, then the other keys sorted (numbers, then strings, then the rest),
-- `name = v` for identifier keys and `[k] = v` otherwise. A table that fits
-- in `width` columns stays on one line, and so does an array of non-tables
-- however long; otherwise one entry a line, indented. Bounded: `depth`
-- levels of nesting (deeper: `{...}` with its entry count), `items` entries
-- per table (then `... (N more)`), `string` bytes per string (then `...
-- (N bytes)`), `total` entries in the whole text (then `{...}`), and `scan`
-- entries read from one table (a table over that is shown from the entries
-- read, `... (more not read)`). A cycle prints `<cycle>`. A value with a
-- __tostring metamethod (a tensor, a user error) prints as its tostring; any
-- other value (a number, a function, a userdata) as tostring. Strings inside
-- tables are quoted with Lua escapes; show() of a string alone is the string.
local pretty = {}

pretty.DEFAULTS = {depth = 6, items = 40, string = 200, width = 80, total = 2000, scan = 100000}

local concat, sort, fmt = table.concat, table.sort, string.format
local sub, byte, find, rep = string.sub, string.byte, string.find, string.rep
local mtype = math.type

local KEYWORDS = {}
for _, w in ipairs({"and", "break", "do", "else", "elseif", "end", "false", "for", "function", "goto", "if",
                    "in", "local", "nil", "not", "or", "repeat", "return", "then", "true", "until", "while"}) do
  KEYWORDS[w] = true
end

local ESC = {[7] = "\\a", [8] = "\\b", [9] = "\\t", [10] = "\\n", [11] = "\\v", [12] = "\\f", [13] = "\\r",
             [34] = '\\"', [92] = "\\\\"}

local function quote(s, max)
  local n, cut = #s, ""
  if n > max then s, cut = sub(s, 1, max), fmt("... (%d bytes)", n) end
  local out = {}
  for i = 1, #s do
    local c = byte(s, i)
    out[i] = ESC[c] or ((c < 32 or c == 127) and fmt("\\%d", c)) or sub(s, i, i)
  end
  return '"' .. concat(out) .. '"' .. cut
end

local function own_tostring(v)
  local mt = getmetatable(v)
  if type(mt) == "table" and rawget(mt, "__tostring") then
    local ok, s = pcall(tostring, v)
    return ok and type(s) == "string" and s or "<__tostring failed>"
  end
end

-- Keys sorted: numbers, then strings (each sorted by the C comparison: no
-- Lua comparator, whose instructions an attach line's limit would count),
-- then the rest by type.
local function sort_keys(keys)
  local nums, strs, rest = {}, {}, {}
  for _, k in ipairs(keys) do
    local t = type(k)
    local into = t == "number" and k == k and nums or t == "string" and strs or rest
    into[#into + 1] = k
  end
  sort(nums)
  sort(strs)
  sort(rest, function(a, b) return type(a) < type(b) end)
  local out = nums
  for _, list in ipairs({strs, rest}) do
    for _, k in ipairs(list) do out[#out + 1] = k end
  end
  return out
end

local function is_name(k)
  return type(k) == "string" and find(k, "^[%a_][%w_]*$") ~= nil and not KEYWORDS[k]
end

local show

local function show_key(k, o, st)
  if is_name(k) then return k end
  if type(k) == "string" then return "[" .. quote(k, o.string) .. "]" end
  if type(k) == "table" and not own_tostring(k) then return "[{...}]" end
  return "[" .. tostring(k) .. "]"
end

-- The entries of t: the array part 1..n, then the sorted other keys (at
-- most o.scan read); their total count; whether t has more than was read.
local function entries(t, o)
  local n = rawlen(t)   -- a border: a hole below it prints as nil
  local keys, read, more = {}, n, false
  for k in next, t do
    if not (mtype(k) == "integer" and k >= 1 and k <= n) then
      read = read + 1
      if read > o.scan then more = true; break end
      keys[#keys + 1] = k
    end
  end
  keys = sort_keys(keys)
  return n, keys, n + #keys, more
end

local function show_table(t, o, st, level)
  if st.path[t] then return "<cycle>" end
  local n, keys, count, more = entries(t, o)
  if count == 0 then return more and "{... (more not read)}" or "{}" end
  if level >= o.depth or st.items >= o.total then return fmt("{... %d entr%s}", count, count == 1 and "y" or "ies") end
  st.path[t] = true
  local parts, nested = {}, false
  local shown = math.min(count, o.items)
  for i = 1, shown do
    if st.items >= o.total then shown = i - 1; break end
    st.items = st.items + 1
    local k = i <= n and i or keys[i - n]
    local v = rawget(t, k)
    if type(v) == "table" and not own_tostring(v) then nested = true end
    local s = show(v, o, st, level + 1)
    parts[i] = i <= n and s or show_key(k, o, st) .. " = " .. s
  end
  st.path[t] = nil
  if count > shown then parts[#parts + 1] = fmt("... (%d more)", count - shown) end
  if more then parts[#parts + 1] = "... (more not read)" end
  local line = "{" .. concat(parts, ", ") .. "}"
  local multi = false
  for _, p in ipairs(parts) do if find(p, "\n", 1, true) then multi = true; break end end
  -- one line: an array of non-tables whatever its length, anything else that fits
  if not multi and ((#keys == 0 and not nested) or #line + level * 2 <= o.width) then return line end
  local pad = rep("  ", level + 1)
  return "{\n" .. pad .. concat(parts, ",\n" .. pad) .. "\n" .. rep("  ", level) .. "}"
end

function show(v, o, st, level)
  local tv = type(v)
  if tv == "string" then return quote(v, o.string) end
  if tv == "table" then return own_tostring(v) or show_table(v, o, st, level) end
  return tostring(v)
end

function pretty.show(v, opts)
  if type(v) == "string" then return v end
  local o = {}
  for k, d in pairs(pretty.DEFAULTS) do o[k] = type(opts) == "table" and opts[k] or d end
  return show(v, o, {path = {}, items = 0}, 0)
end

return pretty
