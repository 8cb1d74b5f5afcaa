-- moelua.io: safetensors save/load (host/bindings/l_io.c, host/runtime/safetensors.c).
-- Round trips of every dtype, scalars, zero-size and non-contiguous
-- tensors; the layout the writer promises (alignment, ordering, padding,
-- metadata); and malformed files crafted byte by byte, each refused with
-- the message that names the problem, without leaking memory or the file.
local T = require "moelua.tensor"
local mem = require "moelua.mem"
local io_ = require "moelua.io"
local lfs = require "lfs"
local support = require "tests.support"
local errmsg, has = support.errmsg, support.has

local base = os.tmpname()
os.remove(base)
local nfile = 0
local function tmp()
  nfile = nfile + 1
  return string.format("%s_%d.safetensors", base, nfile)
end

local function slurp(path) return assert(support.read_file(path)) end
local spit = support.write_file

-- A file: the 8-byte little-endian header length, the header, the data.
local function raw(header, data)
  return string.pack("<I8", #header) .. header .. (data or "")
end

local function cpu_total()
  collectgarbage()
  collectgarbage()
  return mem.stats().cpu.total
end

local function open_fds()
  local n = 0
  for _ in lfs.dir("/proc/self/fd") do n = n + 1 end
  return n
end

-- The writer's header, parsed with string.unpack and patterns of its exact
-- format: length, JSON text, and each tensor's dtype, shape and offsets in
-- file order.
local function header_of(path)
  local s = slurp(path)
  local n = string.unpack("<I8", s)
  local h = s:sub(9, 8 + n)
  local entries = {}
  for name, dtype, shape, b, e in h:gmatch(
      ',"([^"]*)":{"dtype":"(%w+)","shape":%[([%d,]*)%],"data_offsets":%[(%d+),(%d+)%]}') do
    local dims = {}
    for d in shape:gmatch("%d+") do dims[#dims + 1] = tonumber(d) end
    entries[#entries + 1] = {name = name, dtype = dtype, shape = dims,
                             b = tonumber(b), e = tonumber(e)}
  end
  return {len = n, text = h, entries = entries, size = #s}
end

local ELEM = {F64 = 8, I64 = 8, F32 = 4, I32 = 4, BF16 = 2, F16 = 2, U8 = 1}

local values = {
  f32 = {{1.5, -2.25, 3}, {0, 1e-3, -7}},
  f64 = {{1 / 3, -2.5e300, 5e-324}, {0, 1, -1}},
  bf16 = {{1, -2, 0.5}, {3.25, -0.125, 256}},
  f16 = {{1, -2, 0.5}, {65504, -6.103515625e-05, 0.099975586}},
  i32 = {{2147483647, -2147483648, 0}, {1, -1, 7}},
  i64 = {{math.maxinteger, math.mininteger, 0}, {1, -1, 1 << 40}},
  u8 = {{0, 255, 1}, {128, 7, 9}},
}

describe("moelua.io round trips", function()
  after_each(function()
    for i = 1, nfile do os.remove(string.format("%s_%d.safetensors", base, i)) end
  end)

  it("every dtype, bit for bit, with its dtype and shape", function()
    local p = tmp()
    local tensors = {}
    for dt, v in pairs(values) do tensors["w." .. dt] = T.tensor(v, {dtype = dt}) end
    io_.save(p, tensors)
    local back, meta = io_.load(p)
    local n = 0
    for name, t in pairs(back) do
      n = n + 1
      local src = tensors[name]
      assert.is_not_nil(src, name)
      assert.are.equal(src:dtype(), t:dtype())
      assert.are.equal("cpu", t:device())
      assert.are.same({2, 3}, t:shape())
      assert.are.same(src:totable(), t:totable())
    end
    assert.are.equal(7, n)
    assert.are.same({format = "pt"}, meta)
  end)

  it("scalars and zero-size tensors", function()
    local p = tmp()
    io_.save(p, {
      s = T.full({}, 2.5, {dtype = "f64"}),
      k = T.full({}, -3, {dtype = "i32"}),
      z = T.zeros({0, 3}, {dtype = "bf16"}),
      e = T.zeros({0}, {dtype = "u8"}),
      zz = T.zeros({4, 0, 2}, {dtype = "f32"}),
    })
    local back = io_.load(p)
    assert.are.same({}, back.s:shape())
    assert.are.equal(2.5, back.s:item())
    assert.are.equal("f64", back.s:dtype())
    assert.are.equal(-3, back.k:item())
    assert.are.same({0, 3}, back.z:shape())
    assert.are.equal("bf16", back.z:dtype())
    assert.are.same({0}, back.e:shape())
    assert.are.same({4, 0, 2}, back.zz:shape())
    assert.are.equal(0, back.zz:numel())
  end)

  it("non-contiguous input is written contiguously and left untouched", function()
    local p = tmp()
    local a = T.arange(12, {dtype = "f32"}):reshape(3, 4)
    local at, col = a:t(), a:narrow(2, 2, 2)
    local a64 = T.arange(24, {dtype = "i64"}):reshape(2, 3, 4):transpose(1, 3)
    assert.is_false(at:is_contiguous())
    assert.is_false(col:is_contiguous())
    local before = cpu_total()
    io_.save(p, {at = at, col = col, a64 = a64, a = a})
    assert.are.equal(before, cpu_total(), "the contiguous copies are released")
    local back = io_.load(p)
    assert.are.same(at:contiguous():totable(), back.at:totable())
    assert.are.same({4, 3}, back.at:shape())
    assert.are.same(col:contiguous():totable(), back.col:totable())
    assert.are.same(a64:contiguous():totable(), back.a64:totable())
    assert.are.same({4, 3, 2}, back.a64:shape())
    assert.are.same({{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}}, back.a:totable())
    assert.is_false(at:is_contiguous())
    assert.are.same({{0, 4, 8}, {1, 5, 9}, {2, 6, 10}, {3, 7, 11}}, at:totable())
  end)

  it("random data round-trips exactly", function()
    local p = tmp()
    T.manual_seed(7)
    local x = T.randn({37, 11}, {dtype = "f32"})
    io_.save(p, {x = x})
    local y = io_.load(p).x
    local a, b = x:totable(), y:totable()
    for i = 1, 37 do
      for j = 1, 11 do
        assert.are.equal(string.format("%a", a[i][j]), string.format("%a", b[i][j]))
      end
    end
  end)

  it("aligns every tensor to its element size, largest elements first, header padded", function()
    local p = tmp()
    io_.save(p, {
      ["u.odd"] = T.zeros({3}, {dtype = "u8"}),
      ["a.half"] = T.zeros({3}, {dtype = "f16"}),
      ["b.bf"] = T.zeros({1}, {dtype = "bf16"}),
      ["c.f32"] = T.zeros({5}, {dtype = "f32"}),
      ["d.i32"] = T.zeros({1}, {dtype = "i32"}),
      ["e.f64"] = T.zeros({3}, {dtype = "f64"}),
      ["f.i64"] = T.zeros({1}, {dtype = "i64"}),
      ["g.scalar"] = T.full({}, 1, {dtype = "u8"}),
    })
    local h = header_of(p)
    assert.are.equal(0, h.len % 8, "header length is a multiple of 8")
    assert.truthy(h.text:match("^{\"__metadata__\":{\"format\":\"pt\"}"))
    assert.truthy(h.text:match("} *$"))
    assert.are.equal(8, #h.entries)
    local at, prev_size, prev_name = 0, math.huge, ""
    for _, e in ipairs(h.entries) do
      local sz = ELEM[e.dtype]
      assert.are.equal(0, (8 + h.len + e.b) % sz, e.name .. " aligned")
      assert.are.equal(at, e.b, e.name .. " follows the previous tensor")
      assert.is_true(sz < prev_size or (sz == prev_size and e.name > prev_name),
                     e.name .. " ordered by element size, then name")
      at, prev_size, prev_name = e.e, sz, e.name
    end
    assert.are.equal(h.size - 8 - h.len, at, "the data section is covered exactly")
    assert.are.same({"e.f64", "f.i64", "c.f32", "d.i32", "a.half", "b.bf", "g.scalar", "u.odd"},
                    (function() local r = {} for i, e in ipairs(h.entries) do r[i] = e.name end return r end)())
    assert.are.same({}, h.entries[7].shape)
  end)

  it("metadata round-trips, 'format' defaults to pt and can be replaced", function()
    local p = tmp()
    io_.save(p, {x = T.zeros({1})}, {step = "12", note = "h\195\169 \"q\"\n\\"})
    local _, back = io_.load(p)
    assert.are.same({format = "pt", step = "12", note = "h\195\169 \"q\"\n\\"}, back)
    assert.truthy(header_of(p).text:find('{"__metadata__":{"format":"pt","note":"h\195\169 \\"q\\"\\u000a\\\\","step":"12"}', 1, true),
                  "format first, then the pairs sorted by key, JSON-escaped")
    io_.save(p, {x = T.zeros({1})}, {format = "np"})
    _, back = io_.load(p)
    assert.are.same({format = "np"}, back)
  end)

  it("names with quotes, escapes and UTF-8 survive", function()
    local p = tmp()
    local names = {"a\"b", "back\\slash", "tab\tnew\nline", "caf\195\169", "", "__meta"}
    local t = {}
    for i, n in ipairs(names) do t[n] = T.full({1}, i, {dtype = "i32"}) end
    io_.save(p, t)
    local back = io_.load(p)
    for i, n in ipairs(names) do assert.are.same({i}, back[n]:totable(), n) end
  end)

  it("replaces the file atomically, leaving no temporary behind", function()
    local p = tmp()
    io_.save(p, {x = T.zeros({2})})
    io_.save(p, {y = T.ones({3}, {dtype = "f64"})})
    local back = io_.load(p)
    assert.is_nil(back.x)
    assert.are.same({1, 1, 1}, back.y:totable())
    assert.is_nil(io.open(p .. ".tmp", "rb"))
  end)

  it("loads an empty file of tensors, and metadata-free headers", function()
    local p = tmp()
    io_.save(p, {})
    local back, meta = io_.load(p)
    assert.are.same({}, back)
    assert.are.same({format = "pt"}, meta)
    spit(p, raw('{"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}', "\7\9"))
    back, meta = io_.load(p)
    assert.are.same({7, 9}, back.w:totable())
    assert.are.same({}, meta)
  end)
end)

describe("moelua.save refuses", function()
  local p
  before_each(function() p = tmp() end)
  after_each(function() os.remove(p) end)

  it("bad arguments, naming the function", function()
    assert.matches("moelua.save: argument #1 %(path%): expected a string, got nil",
                   errmsg(io_.save, nil, {}))
    assert.matches("moelua.save: argument #2: expected a table of name = tensor, got nil",
                   errmsg(io_.save, p, nil))
    assert.matches("moelua.save: argument #2: expected a table of name = tensor, got a tensor",
                   errmsg(io_.save, p, T.zeros({1})))
    assert.matches("moelua.save: argument #2: tensor names must be strings, got number",
                   errmsg(io_.save, p, {T.zeros({1})}))
    assert.matches("moelua.save: argument #2: tensors%['w'%]: expected a tensor, got number",
                   errmsg(io_.save, p, {w = 3}))
    local f = T.zeros({1})
    f:free()
    assert.matches("moelua.save: argument #2: tensors%['f'%]: the tensor was freed",
                   errmsg(io_.save, p, {f = f}))
    assert.matches("moelua.save: argument #3: expected a table of metadata strings, got string",
                   errmsg(io_.save, p, {}, "pt"))
    assert.matches("moelua.save: argument #3: metadata%['step'%]: expected a string, got number",
                   errmsg(io_.save, p, {}, {step = 3}))
    assert.matches("moelua.save: argument #3: metadata keys must be strings, got number",
                   errmsg(io_.save, p, {}, {"x"}))
    assert.matches("moelua.save: argument #2: a tensor name: contains a NUL byte",
                   errmsg(io_.save, p, {["a\0b"] = T.zeros({1})}))
    assert.matches("moelua.save: argument #1 %(path%): contains a NUL byte",
                   errmsg(io_.save, p .. "\0x", {}))
  end)

  it("names the file format cannot hold", function()
    assert.matches("'__metadata__' cannot name a tensor",
                   errmsg(io_.save, p, {__metadata__ = T.zeros({1})}))
    assert.matches("tensor name '.*' is not valid UTF%-8",
                   errmsg(io_.save, p, {["\255"] = T.zeros({1})}))
    assert.matches("metadata value #1 is not valid UTF%-8",
                   errmsg(io_.save, p, {}, {k = "\192\175"}))
  end)

  it("a directory that does not exist, leaving nothing behind", function()
    local bad = base .. "_missing_dir/x.safetensors"
    assert.matches("moelua.save: " .. bad:gsub("%p", "%%%0") ..
                   ": cannot create .*x.safetensors.tmp: No such file or directory",
                   errmsg(io_.save, bad, {x = T.zeros({1})}))
  end)

  it("a table a finalizer changes mid-save (the collect-and-retry of a copy), naming it", function()
    local nc = T.arange(64, {dtype = "f64"}):reshape(8, 8):t()   -- each entry needs a copy
    local tbl = {a = nc, b = nc:t():t(), c = nc:t():t()}
    local big = T.zeros({1024}, {dtype = "f64"})
    collectgarbage()
    collectgarbage("stop")
    setmetatable({}, {__gc = function()   -- garbage whose finalizer empties the table
      for k in pairs(tbl) do tbl[k] = nil end
      big:free()                            -- so the retried copy fits
    end})
    local old = mem.budget({total = mem.stats().cpu.total + 100})
    local ok, err = pcall(io_.save, p, tbl)
    mem.budget(old)
    collectgarbage("restart")
    assert.is_false(ok)
    assert.matches("moelua.save: argument #2: the table changed while saving", tostring(err))
  end)

  it("without leaking the copies it made before failing", function()
    local before = cpu_total()
    local nc = T.arange(64, {dtype = "f64"}):reshape(8, 8):t()
    local err = errmsg(io_.save, base .. "_missing_dir/x.safetensors", {a = nc, b = nc:t():t()})
    assert.matches("cannot create", err)
    nc = nil
    assert.are.equal(before, cpu_total())
  end)
end)

describe("moelua.load refuses malformed files", function()
  local p
  before_each(function() p = tmp() end)
  after_each(function() os.remove(p) end)

  -- Write bytes to p, load, return the message (asserting the prefix).
  local function load_err(bytes)
    spit(p, bytes)
    local err = errmsg(io_.load, p)
    assert.matches("moelua.load: " .. p:gsub("%p", "%%%0") .. ": ", err)
    return err
  end

  local function entry(name, dtype, shape, b, e)
    return string.format('"%s":{"dtype":"%s","shape":[%s],"data_offsets":[%s,%s]}',
                         name, dtype, shape, b, e)
  end

  it("a file that does not exist or is not a file", function()
    has(errmsg(io_.load, base .. "_nope"), ": cannot open: No such file or directory")
    has(errmsg(io_.load, "/tmp"), "not a regular file")
    has(errmsg(io_.load, {}), "moelua.load: argument #1 (path): expected a string, got table")
  end)

  it("a truncated or impossible header length", function()
    has(load_err(""), "file is 0 bytes, too short for the 8-byte header length")
    has(load_err("\2\0\0\0\0"), "file is 5 bytes, too short for the 8-byte header length")
    has(load_err(string.pack("<I8", 1 << 40) .. "{}"),
        "header length 1099511627776 exceeds the limit of 100000000 bytes")
    has(load_err(string.pack("<i8", -1) .. "{}"),
        "header length 18446744073709551615 exceeds the limit")
    has(load_err(string.pack("<I8", 100) .. "{}  "),
        "header length 100 runs past the end of the file (12 bytes)")
    has(load_err(string.pack("<I8", 0)), "the header is empty")
  end)

  it("a header cut short", function()
    local h = "{" .. entry("w", "F32", "2", 0, 8) .. "}"
    has(load_err(string.pack("<I8", 17) .. h:sub(1, 17)),
        "bad JSON in the header at byte 17: unterminated string")
    has(load_err(string.pack("<I8", 20) .. h:sub(1, 20)),
        "bad JSON in the header at byte 20: expected a string key, got the end of the header")
    has(load_err(string.pack("<I8", #h - 1) .. h:sub(1, -2) .. string.rep("\0", 8)),
        "expected ',' or '}', got the end of the header")
  end)

  it("bad JSON", function()
    local cases = {
      {"[]", "the header must be a JSON object, got an array"},
      {"hello", "bad JSON in the header at byte 0: unexpected character 'h'"},
      {"null", "the header must be a JSON object, got null"},
      {'{"w":{},}', "tensor 'w': missing 'dtype'"},
      {'{"__metadata__":{},}', "bad JSON in the header at byte 19: expected a string key"},
      {"{'a':1}", "expected a string key"},
      {'{"a" 1}', "expected ':', got '1'"},
      {'{"a\\x":{}}', "invalid escape '\\x'"},
      {'{"\\ud834":{}}', "unpaired high surrogate \\ud834"},
      {'{"\\udd1e":{}}', "unpaired low surrogate \\udd1e"},
      {'{"\\u00zz":{}}', "bad hex digit in a \\u escape"},
      {'{"\\u0000":{}}', "\\u0000 in a string is not supported"},
      {'{"a\nb":{}}', "control character 0x0a in a string"},
      {'{"\255":{}}', "invalid UTF-8 in a string"},
      {"{}  x", "at byte 4: trailing characters after the header object"},
      {"{}{}", "trailing characters after the header object"},
      {'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}', "expected ',' or '}', got the end"},
      {'{"a":{"dtype":"F32","shape":[[[[[[1]]]]]],"data_offsets":[0,4]}}',
       "tensor 'a': shape must be a non-negative integer, got an array"},
      {'{"a":{"dtype":{"b":{"c":{"d":{}}}}}}', "tensor 'a': dtype must be a string, got an object"},
      {'{"a":{"dtype":"F32","shape":[01],"data_offsets":[0,4]}}', "leading zero in a number"},
      {'{"a":{"dtype":"F32","shape":[1.0],"data_offsets":[0,4]}}',
       "tensor 'a': shape must be an integer, got a fraction or exponent"},
      {'{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}',
       "tensor 'a': shape must be a non-negative integer, got a negative number"},
      {'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,99999999999999999999]}}',
       "tensor 'a': data_offsets: integer too large (more than 64 bits)"},
      {'{"a":null}', "tensor 'a' must be an object, got null"},
      {'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"extra":[]}}',
       "tensor 'a': unknown key 'extra'"},
      {'{"a":{"dtype":"F32","shape":[1],"shape":[1],"data_offsets":[0,4]}}',
       "tensor 'a': duplicate key 'shape'"},
    }
    for _, c in ipairs(cases) do
      has(load_err(raw(c[1], "\0\0\0\0")), c[2])
    end
  end)

  it("dtypes it does not support, by name", function()
    has(load_err(raw("{" .. entry("mask", "BOOL", "4", 0, 4) .. "}", "\1\0\1\0")),
        "tensor 'mask': dtype BOOL is not supported (F32, F64, BF16, F16, I32, I64, U8)")
    has(load_err(raw("{" .. entry("q", "F8_E5M2", "1", 0, 1) .. "}", "\1")),
        "tensor 'q': dtype F8_E5M2 is not supported")
    has(load_err(raw("{" .. entry("c", "C64", "1", 0, 8) .. "}", string.rep("\0", 8))),
        "tensor 'c': dtype C64 is not supported")
  end)

  it("offsets that do not tile the data section", function()
    local d = string.rep("\0", 24)
    has(load_err(raw("{" .. entry("w", "F32", "2,3", 0, 10) .. "}", d:sub(1, 10))),
        "tensor 'w': data_offsets [0,10] do not match shape [2,3] of F32 (24 bytes)")
    has(load_err(raw("{" .. entry("a", "F64", "2", 0, 16) .. "," .. entry("b", "F64", "2", 8, 24) .. "}", d)),
        "tensor 'b': data_offsets [8,24] overlap tensor 'a' [0,16]")
    has(load_err(raw("{" .. entry("a", "F32", "2", 0, 8) .. "," .. entry("b", "F64", "1", 12, 20) .. "}",
                     d:sub(1, 20))),
        "tensor 'b': data_offsets [12,20] leave a gap of 4 bytes after tensor 'a'")
    has(load_err(raw("{" .. entry("a", "F32", "2", 4, 12) .. "}", d:sub(1, 12))),
        "tensor 'a': data_offsets [4,12] leave a gap of 4 bytes after the start of the data section")
    has(load_err(raw("{" .. entry("a", "F32", "4", 16, 32) .. "}", d)),
        "tensor 'a': data_offsets [16,32] run past the end of the data section (24 bytes)")
    has(load_err(raw("{" .. entry("a", "U8", "7", "18446744073709551608", "18446744073709551615") .. "}", d)),
        "tensor 'a': data_offsets [18446744073709551608,18446744073709551615] run past the end")
    has(load_err(raw("{" .. entry("a", "U8", "8", 8, 0) .. "}", d)),
        "tensor 'a': data_offsets [8,0] end before they begin")
    has(load_err(raw('{"a":{"dtype":"U8","shape":[1],"data_offsets":[0]}}', "\0")),
        "data_offsets must be [begin, end], got 1 integers")
  end)

  it("shapes whose size overflows", function()
    has(load_err(raw("{" .. entry("w", "F32", "4611686018427387904,4", 0, 0) .. "}")),
        "tensor 'w': shape [4611686018427387904,4] has too many elements")
    has(load_err(raw("{" .. entry("w", "F32", "4611686018427387904", 0, 0) .. "}")),
        "tensor 'w': shape [4611686018427387904] has too many elements")
    has(load_err(raw("{" .. entry("w", "U8", "4294967296,4294967296", 0, 0) .. "}")),
        "tensor 'w': shape [4294967296,4294967296] has too many elements")
    has(load_err(raw("{" .. entry("w", "U8", "1,1,1,1,1,1,1,1,1", 0, 1) .. "}", "\0")),
        "tensor 'w': shape has more than 8 dims")
  end)

  it("duplicate keys", function()
    has(load_err(raw("{" .. entry("w", "U8", "1", 0, 1) .. "," .. entry("w", "U8", "1", 1, 2) .. "}", "\0\0")),
        "duplicate tensor name 'w'")
    has(load_err(raw('{"__metadata__":{"format":"pt","format":"np"}}')),
        "duplicate metadata key 'format'")
    has(load_err(raw('{"__metadata__":{},"__metadata__":{}}')),
        "duplicate key '__metadata__'")
  end)

  it("metadata that is not an object of strings", function()
    has(load_err(raw('{"__metadata__":{"format":"pt","step":12}}')),
        "metadata 'step' must be a string, got a number")
    has(load_err(raw('{"__metadata__":{"x":null}}')), "metadata 'x' must be a string, got null")
    has(load_err(raw('{"__metadata__":{"x":{"y":"z"}}}')),
        "metadata 'x' must be a string, got an object")
    has(load_err(raw('{"__metadata__":["format","pt"]}')),
        "'__metadata__' must be an object of strings, got an array")
  end)

  it("trailing bytes after the data", function()
    has(load_err(raw("{" .. entry("w", "F32", "", 0, 4) .. "}", "\0\0\0\0abc")),
        "the tensors cover 4 bytes of the 7-byte data section (3 trailing bytes)")
    local good = tmp()
    io_.save(good, {x = T.zeros({2, 2})})
    has(load_err(slurp(good) .. "\0"), "(1 trailing bytes)")
    os.remove(good)
  end)

  it("every truncation of a valid file", function()
    local good = tmp()
    io_.save(good, {x = T.arange(6, {dtype = "f32"}), s = T.full({}, 1, {dtype = "u8"})},
             {note = "truncate me"})
    local bytes = slurp(good)
    os.remove(good)
    for n = 0, #bytes - 1 do
      spit(p, bytes:sub(1, n))
      local ok, err = pcall(io_.load, p)
      assert.is_false(ok, "truncated to " .. n .. " bytes")
      assert.matches("^.*moelua.load: ", tostring(err))
    end
    spit(p, bytes)
    assert.are.same({0, 1, 2, 3, 4, 5}, io_.load(p).x:totable())
  end)

  it("without leaking tensors or the file when it fails midway", function()
    -- "small" is read first (offset 0), then "big" is refused by the budget.
    local d = string.rep("\0", 512 + 4096)
    spit(p, raw("{" .. entry("big", "F32", "1024", 512, 4608) .. "," ..
                entry("small", "F64", "64", 0, 512) .. "}", d))
    local before, fds = cpu_total(), open_fds()
    local old = mem.budget {total = before + 1024}
    local ok, err = pcall(io_.load, p)
    mem.budget {total = old.total}
    assert.is_false(ok)
    assert.matches("moelua.load: allocating .* would exceed the total budget", tostring(err))
    assert.are.equal(fds, open_fds(), "the file is closed when the error is raised")
    assert.are.equal(before, cpu_total(), "the ledger is back where it started")
    local back = io_.load(p)
    assert.are.equal(1024, back.big:numel())
    assert.are.equal(fds, open_fds())
    back = nil
    assert.are.equal(before, cpu_total())
  end)

  it("malformed files leak nothing", function()
    local before, fds = cpu_total(), open_fds()
    for _ = 1, 20 do
      load_err(raw("{" .. entry("w", "F32", "2,3", 0, 10) .. "}", string.rep("\0", 10)))
    end
    assert.are.equal(fds, open_fds())
    assert.are.equal(before, cpu_total())
  end)
end)

describe("moelua.io.open", function()
  it("reads entries into given tensors, converting float dtypes, through bounded stages", function()
    local path = tmp()
    local a, h = T.randn({3, 5}), T.randn({1000}):to("bf16")
    io_.save(path, {a = a, h = h, i = T.tensor({1, 2, 3}, {dtype = "i64"})}, {note = "x"})
    local r <close> = io_.open(path)
    local e = r:entries()
    assert.are.same({name = "a", dtype = "f32", shape = {3, 5}, numel = 15}, e.a)
    assert.are.same({name = "h", dtype = "bf16", shape = {1000}, numel = 1000}, e.h)
    assert.are.equal("x", r:metadata().note)
    local d = T.zeros({15})                                -- any shape with the entry's element count
    assert.are.equal(d, r:read_into("a", d))
    assert.are.same(a:totable(), d:view({3, 5}):totable())
    local before = cpu_total()
    local f = T.zeros({1000})
    r:read_into("h", f)                                    -- bf16 on disk, f32 here: exact
    assert.are.same(h:to("f32"):totable(), f:totable())
    assert.are.equal(before + 4000, cpu_total())          -- the stage is gone when it returns
    local v = T.zeros({2, 15}):select(1, 2)               -- a contiguous view: read in place
    r:read_into("a", v)
    assert.are.same(d:totable(), v:totable())
  end)

  it("refuses what it cannot read, naming it", function()
    local path = tmp()
    io_.save(path, {a = T.randn({3, 5}), i = T.tensor({1, 2, 3}, {dtype = "i64"})})
    local r = io_.open(path)
    has(errmsg(r.read_into, r, "zz", T.zeros({4})), "Reader:read_into: " .. path .. " has no tensor 'zz'")
    has(errmsg(r.read_into, r, "a", T.zeros({4})), "'a' has 15 elements, the destination 4")
    has(errmsg(r.read_into, r, "i", T.zeros({3})), "'i' is i64 in the file and cannot be converted to f32")
    has(errmsg(r.read_into, r, "a", T.zeros({5, 3}):t()), "'a': the destination must be contiguous")
    has(errmsg(r.read_into, r, "a", "x"), "argument #2 (dst): expected a tensor, got string")
    r:close()
    r:close()                                              -- idempotent
    has(errmsg(r.entries, r), "Reader:entries: the file is closed")
    has(errmsg(io_.open, base .. "_missing"), "cannot open")
  end)
end)

describe("moelua.io files written by ranges", function()
  after_each(function()
    for i = 1, nfile do os.remove(string.format("%s_%d.safetensors", base, i)) end
  end)

  -- Elements [a, b) (0-based) of t, flat: a contiguous view.
  local function slice(t, a, b) return t:view({t:numel()}):narrow(1, a + 1, b - a) end

  local specs = {{name = "a", dtype = "f32", shape = {6, 5}},
                 {name = "h", dtype = "bf16", shape = {7}},
                 {name = "i", dtype = "i64", shape = {4}},
                 {name = "s", dtype = "f64", shape = {}}}

  it("4 writers, then io.load and reads by 3 ranges: io.save's file, byte for byte", function()
    local path, ref = tmp(), tmp()
    local before = cpu_total()
    local src = {a = T.randn({6, 5}), h = T.randn({7}):to("bf16"),
                 i = T.tensor({1, -2, 1 << 40, 7}, {dtype = "i64"}), s = T.tensor(1 / 3, {dtype = "f64"})}
    io_.save(ref, src, {step = "12", note = "x"})
    local ws = {io_.create(path, specs, {step = "12", note = "x"})}
    for k = 2, 4 do ws[k] = io_.open_writer(path) end
    local es = ws[1]:entries()
    assert.are.same({name = "i", dtype = "i64", shape = {4}, numel = 4}, es[1])   -- file order
    assert.are.same({name = "s", dtype = "f64", shape = {}, numel = 1}, es[2])
    assert.are.same({name = "h", dtype = "bf16", shape = {7}, numel = 7}, es[4])
    assert.are.same(es, ws[3]:entries())
    for k = 4, 1, -1 do                          -- writer k owns the k-th quarter of each tensor
      for _, e in ipairs(es) do
        local a, b = (k - 1) * e.numel // 4, k * e.numel // 4
        if e.name == "s" then a, b = k == 1 and 0 or 1, 1 end
        if b > a then ws[k]:write_range(e.name, a, slice(src[e.name], a, b)) end
      end
    end
    for _, w in ipairs(ws) do w:sync(); w:close() end
    ws[1]:close()                                -- idempotent
    assert.are.equal(slurp(ref), slurp(path))
    local got, meta = io_.load(path)             -- an ordinary safetensors file
    assert.are.same({format = "pt", step = "12", note = "x"}, meta)
    for name, t in pairs(src) do assert.are.same(t:totable(), got[name]:totable()) end
    got = nil

    local r <close> = io_.open(path)
    assert.are.same({name = "a", dtype = "f32", shape = {6, 5}, numel = 30}, r:entries().a)
    for _, e in ipairs(es) do
      local cuts = {0, e.numel // 3, 2 * e.numel // 3, e.numel}
      for k = 1, 3 do
        local a, b = cuts[k], cuts[k + 1]
        local d = T.zeros({b - a}, {dtype = e.dtype})
        assert.are.equal(d, r:read_range(e.name, a, d))
        if b > a then assert.are.same(slice(src[e.name], a, b):totable(), d:totable()) end
      end
    end
    local f = T.zeros({3})                       -- bf16 on disk into f32: converted
    r:read_range("h", 2, f)
    assert.are.same(slice(src.h, 2, 5):to("f32"):totable(), f:totable())
    f, src = nil, nil
    assert.are.equal(before, cpu_total())        -- the ledger is back: no stage left behind
  end)

  it("converts float tensors to the entry's dtype, and reads ranges of files io.save wrote", function()
    local path = tmp()
    local x = T.tensor({1, -2, 0.5, 1 + 2 ^ -9, 3.25}, {dtype = "f64"})
    local before = cpu_total()
    local w <close> = io_.create(path, {{name = "h", dtype = "bf16", shape = {5}}})
    w:write_range("h", 0, slice(x, 0, 2))
    w:write_range("h", 2, slice(x, 2, 5))
    w:close()
    assert.are.equal(before, cpu_total())        -- the conversion's stages are released
    local got = io_.load(path).h
    assert.are.equal("bf16", got:dtype())
    assert.are.same({1, -2, 0.5, 1, 3.25}, got:to("f32"):totable())   -- 1 + 2^-9 rounds to 1
    io_.save(path, {v = T.arange(10)})
    local r <close> = io_.open(path)
    local d = r:read_range("v", 7, T.zeros({3}))
    assert.are.same({7, 8, 9}, d:totable())
  end)

  it("refuses bad input, naming the function, the argument and the values", function()
    local path = tmp()
    local w <close> = io_.create(path, specs)
    local function bad(want, ...) has(errmsg(...), want) end
    bad("Writer:write_range: " .. path .. " has no tensor 'zz'", w.write_range, w, "zz", 0, T.zeros({1}))
    bad("Writer:write_range: 'a': 4 elements at element offset 28 do not fit in its 30",
        w.write_range, w, "a", 28, T.zeros({4}))
    bad("Writer:write_range: argument #2 (elem_offset) is negative (-1)", w.write_range, w, "a", -1, T.zeros({1}))
    bad("Writer:write_range: argument #2 (elem_offset): expected an integer, got a fraction",
        w.write_range, w, "a", 0.5, T.zeros({1}))
    bad("Writer:write_range: argument #2 (elem_offset): expected an integer, got string",
        w.write_range, w, "a", "2", T.zeros({1}))
    bad("Writer:write_range: argument #3 (t): expected a tensor, got string", w.write_range, w, "a", 0, "x")
    bad("Writer:write_range: 'i' is i64 in the file and cannot be converted from f32",
        w.write_range, w, "i", 0, T.zeros({2}))
    bad("Writer:write_range: 'a': the source must be contiguous", w.write_range, w, "a", 0, T.zeros({3, 2}):t())
    w:close()
    bad("Writer:write_range: the writer is closed", w.write_range, w, "a", 0, T.zeros({1}))
    bad("Writer:entries: the writer is closed", w.entries, w)
    bad("Writer:sync: the writer is closed", w.sync, w)

    local r <close> = io_.open(path)
    bad("Reader:read_range: 'a': 31 elements at element offset 0 do not fit in its 30",
        r.read_range, r, "a", 0, T.zeros({31}))
    bad("Reader:read_range: " .. path .. " has no tensor 'q'", r.read_range, r, "q", 0, T.zeros({1}))
    bad("Reader:read_range: 'i' is i64 in the file and cannot be converted to f32",
        r.read_range, r, "i", 0, T.zeros({1}))
    bad("Reader:read_range: argument #3 (dst): expected a tensor, got no value", r.read_range, r, "a", 0)

    local c = io_.create
    bad("moelua.io.create: argument #1 (path): expected a string, got nil", c, nil, specs)
    bad("moelua.io.create: argument #2: expected a list of {name =, dtype =, shape =}, got number", c, path, 3)
    bad("moelua.io.create: argument #2: tensors[1]: expected a table {name =, dtype =, shape =}, got string",
        c, path, {"a"})
    bad("moelua.io.create: argument #2: tensors[1].name: expected a string, got nil", c, path, {{dtype = "f32", shape = {1}}})
    bad("moelua.io.create: argument #2: tensors[2].dtype: unknown dtype 'f8' (f32, f64, bf16, f16, i32, i64, u8)",
        c, path, {specs[1], {name = "b", dtype = "f8", shape = {1}}})
    bad("moelua.io.create: argument #2: tensors[1].shape: expected a table of sizes, got number",
        c, path, {{name = "b", dtype = "f32", shape = 3}})
    bad("moelua.io.create: argument #2: tensors[1].shape: size of dim 2 is negative (-1)",
        c, path, {{name = "b", dtype = "f32", shape = {2, -1}}})
    bad(path .. ": duplicate name 'a'", c, path, {specs[1], specs[1]})
    bad("moelua.io.create: argument #3: metadata['k']: expected a string, got number", c, path, specs, {k = 1})
    bad("moelua.io.create: " .. base .. "_none/x.safetensors: cannot create", c, base .. "_none/x.safetensors", specs)

    bad("moelua.io.open_writer: " .. base .. "_missing: cannot open", io_.open_writer, base .. "_missing")
    spit(path, "not a safetensors file")
    bad("moelua.io.open_writer: " .. path .. ": header length", io_.open_writer, path)
  end)

  it("inside mem.plan checks its arguments and writes nothing", function()
    local path = tmp()
    local inside
    local books = mem.plan(function()
      local w <close> = io_.create(path, specs, {step = "1"})
      w:write_range("a", 10, T.zeros({20}))
      inside = {entries = #w:entries(), err = errmsg(w.write_range, w, "a", 20, T.zeros({20}))}
      w:sync()
      local o <close> = io_.open_writer(path)   -- knows no entries: checks offset and tensor only
      o:write_range("a", 0, T.zeros({2}))
      inside.blind = #o:entries()
      inside.neg = errmsg(o.write_range, o, "a", -1, T.zeros({2}))
    end)
    assert.is_table(books)
    assert.are.equal(4, inside.entries)
    has(inside.err, "'a': 20 elements at element offset 20 do not fit in its 30")
    assert.are.equal(0, inside.blind)
    has(inside.neg, "argument #2 (elem_offset) is negative (-1)")
    assert.is_nil(lfs.attributes(path))          -- no file was made
  end)
end)
