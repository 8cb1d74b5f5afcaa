-- moelua.data (lua/moelua/data.lua) and moelua.fs (host/bindings/l_fs.c): windows
-- equal the files' bytes (read back with io.open), across file boundaries;
-- the order is a pure function of (seed, step); the held-out tail is
-- disjoint from training windows; u16/u32 token files; the fingerprint
-- catches a changed corpus; every fs function, incl. sha256 against
-- sha256sum, and bad-input messages.
local T = require "moelua.tensor"
local fs = require "moelua.fs"
local data = require "moelua.data"
local support = require "tests.support"
local errmsg, has = support.errmsg, support.has

local dir
local function path(name) return dir .. "/" .. name end

-- Deterministic pseudo-random bytes.
local function bytes(n, seed)
  local t = {}
  local x = seed
  for i = 1, n do
    x = (x * 1103515245 + 12345) % 2147483648
    t[i] = string.char((x >> 16) & 255)
  end
  return table.concat(t)
end

local function corpus_bytes(files)
  local parts = {}
  for i, f in ipairs(files) do parts[i] = assert(support.read_file(f)) end
  return table.concat(parts)
end

local function as_bytes(t)
  local v = t:totable()
  local c = {}
  for i = 1, #v do c[i] = string.char(v[i]) end
  return table.concat(c)
end

describe("moelua.data", function()
  local files
  before_each(function()
    dir = support.make_tmpdir()
    files = {path("a.txt"), path("b.txt"), path("c.txt")}
    support.write_file(files[1], bytes(1000, 1))
    support.write_file(files[2], bytes(37, 2))      -- shorter than a window: windows cross it
    support.write_file(files[3], bytes(2500, 3))
  end)
  after_each(function() support.remove_dir(dir) end)

  it("training windows equal the corpus bytes, across file boundaries", function()
    local all = corpus_bytes(files)
    local ds = data.open{paths = files, seq_len = 63, seed = 7}
    assert.equal(#all, ds.n_tokens)
    local crossed = 0
    for step = 0, ds:n_training() - 1 do
      local pos = ds:position(step)
      local t = ds:batch(step)
      assert.same({64}, t:shape())
      assert.equal("i64", t:dtype())
      assert.equal(all:sub(pos + 1, pos + 64), as_bytes(t))
      if pos < 1000 and pos + 64 > 1000 or pos < 1037 and pos + 64 > 1037 then crossed = crossed + 1 end
    end
    assert.is_true(crossed > 0, "no window crossed a file boundary")
  end)

  it("every epoch visits each training window once, in an order fixed by (seed, step)", function()
    local ds = data.open{paths = files, seq_len = 31, seed = 3}
    local n = ds:n_training()
    for epoch = 0, 2 do
      local seen = {}
      local shift = ds:position(epoch * n) % 32
      for s = epoch * n, epoch * n + n - 1 do
        local p = ds:position(s)
        assert.equal(shift, p % 32)
        assert.is_nil(seen[p])
        seen[p] = true
      end
    end
    -- independent of call order and of the object: a fresh dataset, reversed
    local a, b = data.open{paths = files, seq_len = 31, seed = 3}, data.open{paths = files, seq_len = 31, seed = 3}
    local fwd = {}
    for s = 0, 40 do fwd[s] = as_bytes(a:batch(s)) end
    for s = 40, 0, -1 do assert.equal(fwd[s], as_bytes(b:batch(s))) end
    -- another seed, another order
    local c = data.open{paths = files, seq_len = 31, seed = 4}
    local same = 0
    for s = 0, 40 do if as_bytes(c:batch(s)) == fwd[s] then same = same + 1 end end
    assert.is_true(same < 10)
  end)

  it("holds out the corpus tail, disjoint from every training window", function()
    local all = corpus_bytes(files)
    local ds = data.open{paths = files, seq_len = 49, holdout = 0.1}
    local nv = ds:n_validation()
    assert.is_true(nv >= 1)
    local tail = #all - nv * 50
    for i = 1, nv do
      assert.equal(all:sub(tail + (i - 1) * 50 + 1, tail + i * 50), as_bytes(ds:validation(i)))
    end
    for s = 0, 3 * ds:n_training() do
      assert.is_true(ds:position(s) + 50 <= tail)
    end
    has(errmsg(ds.validation, ds, nv + 1), "moelua.data.validation: index: expected an integer in [1, " .. nv)
    assert.equal(0, data.open{paths = files, seq_len = 49}:n_validation())
  end)

  it("reads u16 and u32 little-endian token files", function()
    local toks = {}
    for i = 1, 300 do toks[i] = (i * 2654435761) % 4294967296 end
    local s16, s32 = {}, {}
    for i, v in ipairs(toks) do
      s16[i] = string.pack("<I2", v % 65536)
      s32[i] = string.pack("<I4", v)
    end
    support.write_file(path("t16.bin"), table.concat(s16, "", 1, 150))
    support.write_file(path("u16.bin"), table.concat(s16, "", 151, 300))
    support.write_file(path("t32.bin"), table.concat(s32))
    local d16 = data.open{paths = {path("t16.bin"), path("u16.bin")}, format = "u16", seq_len = 19}
    local d32 = data.open{paths = {path("t32.bin")}, format = "u32", seq_len = 19}
    for step = 0, 20 do
      local p, v = d16:position(step), d16:batch(step):totable()
      for j = 1, 20 do assert.equal(toks[p + j] % 65536, v[j]) end
      p, v = d32:position(step), d32:batch(step):totable()
      for j = 1, 20 do assert.equal(toks[p + j], v[j]) end
    end
    support.write_file(path("odd.bin"), "abc")
    has(errmsg(data.open, {paths = {path("odd.bin")}, format = "u16", seq_len = 1}),
        "3 bytes is not a whole number of u16 tokens")
  end)

  it("saves a cursor and detects a changed corpus", function()
    local ds = data.open{paths = files, seq_len = 15}
    ds:batch(0); ds:batch(1); ds:next()
    local st = ds:state()
    assert.equal(3, st.cursor)
    local again = data.open{paths = files, seq_len = 15}
    again:set_state(st)
    assert.equal(as_bytes(ds:next()), as_bytes(again:next()))
    -- another window size or order would read other windows
    has(errmsg(data.open{paths = files, seq_len = 16}.set_state, data.open{paths = files, seq_len = 16}, st),
        "moelua.data.set_state: the state was saved with seq_len 15, this corpus is opened with 16: its windows " ..
        "would be others, some already trained on; keep seq_len 15 (a recipe's --seq-len), or start a new run " ..
        "from the checkpoint's weights (train.run's init_from)")
    local seeded = data.open{paths = files, seq_len = 15, seed = 7}
    has(errmsg(seeded.set_state, seeded, st), "the state was saved with seed 0, this corpus is opened with 7")
    -- same size, one byte changed and the mtime moved
    support.write_file(files[3], bytes(2499, 3) .. "!")
    assert(os.execute("touch -d '2001-01-01' " .. support.shell_quote(files[3])))
    local changed = data.open{paths = files, seq_len = 15}
    assert.are_not.equal(st.fingerprint, changed:state().fingerprint)
    has(errmsg(changed.set_state, changed, st), "moelua.data.set_state: the corpus changed")
  end)

  it("reads the fingerprint's samples at the first state(), not at open (a plan reads no file)", function()
    support.write_file(path("late"), bytes(300, 9))
    local ds = data.open{paths = {path("late")}, seq_len = 15}
    local gone = data.open{paths = {path("late")}, seq_len = 15}
    local st = ds:state()
    assert(os.remove(path("late")))
    has(errmsg(gone.state, gone), "moelua.data.state: cannot open '" .. path("late"))
    assert.same(st, ds:state(), "taken once")
  end)

  it("expands globs, including '**'", function()
    assert(os.execute("mkdir -p " .. support.shell_quote(path("x/y/z"))))
    support.write_file(path("x/one.h"), bytes(100, 4))
    support.write_file(path("x/y/z/two.h"), bytes(100, 5))
    support.write_file(path("x/y/skip.c"), bytes(100, 6))
    local ds = data.open{glob = path("x/**/*.h"), seq_len = 9}
    assert.same({path("x/one.h"), path("x/y/z/two.h")}, ds.files)
    local ds2 = data.open{glob = path("*.txt"), seq_len = 9}
    assert.same(files, ds2.files)
    -- "**" first: under the current directory, the paths as the glob spells them
    local p = assert(io.popen("cd " .. support.shell_quote(path("x")) .. " && " ..
                              support.shell_quote(support.host_path()) .. " -e " ..
                              support.shell_quote('print(table.concat(require("moelua.data").open{glob = "**/*.h", ' ..
                                                  'seq_len = 9}.files, " "))') .. " 2>&1"))
    local code, out = support.finish_child(p)
    assert.are.equal(0, code, out)
    assert.are.equal("one.h y/z/two.h\n", out)
  end)

  it("rejects bad options with messages", function()
    has(errmsg(data.open, "x"), "moelua.data.open: expected an options table")
    has(errmsg(data.open, {paths = files, seq_len = 0}), "seq_len: expected a positive integer")
    has(errmsg(data.open, {paths = files, seq_len = 4, format = "u8x"}), "format: expected")
    has(errmsg(data.open, {paths = files, seq_len = 4, bogus = 1}), "unknown option 'bogus'")
    has(errmsg(data.open, {paths = files, glob = "*", seq_len = 4}), "exactly one of paths and glob")
    has(errmsg(data.open, {paths = files, seq_len = 4, holdout = 1}), "holdout: expected a number in [0, 1)")
    has(errmsg(data.open, {paths = {path("nope")}, seq_len = 4}), "cannot read '" .. path("nope"))
    has(errmsg(data.open, {glob = path("*.none"), seq_len = 4}), "matches no file")
    fs.mkdir_p(path("sub"))
    has(errmsg(data.open, {glob = path("sub"), seq_len = 4}), "glob '" .. path("sub") .. "' matches no regular " ..
        "file (only directories: a glob such as '" .. path("sub") .. "/**/*' reads the files under one)")
    has(errmsg(data.open, {glob = "/dev/null", seq_len = 4}), "glob '/dev/null' matches no regular file (only " ..
        "devices, FIFOs or sockets, which are not read)")
    has(errmsg(data.open, {paths = files, seq_len = 5000}), "too few for one training window")
    local ds = data.open{paths = files, seq_len = 4}
    has(errmsg(ds.batch, ds, -1), "moelua.data.batch: step: expected a non-negative integer")
    has(errmsg(ds.set_state, ds, {cursor = 1.5}), "cursor: expected a non-negative integer")
  end)
end)

describe("moelua.fs", function()
  before_each(function() dir = support.make_tmpdir() end)
  after_each(function() support.remove_dir(dir) end)

  it("reads a token range into a fresh or a given tensor", function()
    support.write_file(path("f"), "\1\2\3\4\5\6\7\8")
    assert.same({3, 4, 5}, fs.read(path("f"), 2, 3):totable())
    assert.same({0x0403, 0x0605}, fs.read(path("f"), 1, 2, "u16"):totable())
    assert.same({0x08070605}, fs.read(path("f"), 1, 1, "u32"):totable())
    local out = T.zeros({5}, {dtype = "i64"})
    fs.read(path("f"), 0, 2, "bytes", out, 3)
    assert.same({0, 0, 1, 2, 0}, out:totable())
    assert.same({}, fs.read(path("f"), 8, 0):totable())
    local big = bytes(200000, 9)         -- several 64 KiB chunks
    support.write_file(path("big"), big)
    assert.equal(big:sub(70001, 200000), as_bytes(fs.read(path("big"), 70000, 130000)))
  end)

  it("sha256 matches sha256sum", function()
    support.write_file(path("h"), bytes(100000, 11))
    local p = io.popen("sha256sum " .. support.shell_quote(path("h")))
    local want = p:read("a"):match("^(%x+)")
    p:close()
    assert.equal(want, fs.sha256(path("h")))
    assert.equal("e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855", fs.sha256_string(""))
  end)

  it("mkdir_p, listdir, stat, rename, exchange, fsync, glob, free_bytes, remove_tree", function()
    fs.mkdir_p(path("a/b/c"))
    fs.mkdir_p(path("a/b/c"))                  -- exists: fine
    support.write_file(path("a/b/f1"), "xyz")
    support.write_file(path("a/b/f0"), "")
    assert.same({"c", "f0", "f1"}, fs.listdir(path("a/b")))
    local st = fs.stat(path("a/b/f1"))
    assert.equal("file", st.type); assert.equal(3, st.size); assert.is_true(st.mtime > 0)
    assert.equal("dir", fs.stat(path("a")).type)
    local none, msg = fs.stat(path("missing"))
    assert.is_nil(none); has(msg, "No such file")
    -- a link is followed (its target's type and size) and says it is one; a dangling one is missing
    assert(os.execute("ln -s b/f1 " .. support.shell_quote(path("a/l1")) .. " && ln -s nowhere " ..
                      support.shell_quote(path("a/l2")) .. " && ln -s b " .. support.shell_quote(path("a/l3"))))
    st = fs.stat(path("a/l1"))
    assert.equal("file", st.type); assert.equal(3, st.size); assert.is_true(st.link)
    assert.is_false(fs.stat(path("a/b/f1")).link)
    assert.equal("dir", fs.stat(path("a/l3")).type)
    none, msg = fs.stat(path("a/l2"))
    assert.is_nil(none); has(msg, "a/l2': No such file")
    for _, l in ipairs{"l1", "l2", "l3"} do assert(os.remove(path("a/" .. l))) end
    fs.rename(path("a/b/f1"), path("a/f2"))
    assert.same({"b", "f2"}, fs.listdir(path("a")))
    fs.fsync(path("a/f2")); fs.fsync(path("a"))
    assert.is_true(fs.exchange(path("a/b"), path("a/f2")))   -- a directory and a file swap names at once
    assert.equal("file", fs.stat(path("a/b")).type)
    assert.same({"c", "f0"}, fs.listdir(path("a/f2")))
    assert.is_true(fs.exchange(path("a/b"), path("a/f2")))
    has(errmsg(fs.exchange, path("a/b"), path("a/none")), "moelua.fs.exchange: '" .. path("a/b") .. "' <-> ")
    assert.same({path("a/b/f0"), path("a/f2")}, fs.glob(path("a/{b/f0,f2}")))
    assert.same({}, fs.glob(path("a/*.none")))
    assert.is_true(fs.free_bytes(dir) > 0)
    assert.is_true(fs.remove_tree(path("a")))
    assert.is_false(fs.remove_tree(path("a")))
    assert.is_nil(fs.stat(path("a")))
  end)

  it("rejects bad arguments, naming the function", function()
    support.write_file(path("f"), "abcd")
    has(errmsg(fs.read, 1, 0, 1), "moelua.fs.read: argument #1 (path): expected a string")
    has(errmsg(fs.read, path("f"), -1, 1), "moelua.fs.read: argument #2 (offset): must be >= 0")
    has(errmsg(fs.read, path("f"), 0, 1.5), "argument #3 (count): expected an integer, got a float")
    has(errmsg(fs.read, path("f"), 0, 1, "u64"), "argument #4 (format)")
    has(errmsg(fs.read, path("f"), 0, 3, "u16"), "read past the end of")
    has(errmsg(fs.read, path("nope"), 0, 1), "moelua.fs.read: cannot open")
    has(errmsg(fs.read, dir, 0, 1), "is not a regular file")
    has(errmsg(fs.read, path("f"), 0, 3, "bytes", T.zeros({2}, {dtype = "i64"})), "do not fit")
    has(errmsg(fs.read, path("f"), 0, 1, "bytes", T.zeros({2})), "moelua.fs.read")
    has(errmsg(fs.read, "a\0b", 0, 1), "contains a NUL byte")
    has(errmsg(fs.sha256, path("nope")), "moelua.fs.sha256: cannot open")
    has(errmsg(fs.mkdir_p, path("f") .. "/x"), "moelua.fs.mkdir_p: cannot create")
    has(errmsg(fs.rename, path("nope"), path("x")), "moelua.fs.rename:")
    has(errmsg(fs.listdir, path("nope")), "moelua.fs.listdir: cannot open directory")
    has(errmsg(fs.remove_tree, "/"), "refusing to remove '/'")
    has(errmsg(fs.fsync, path("nope")), "moelua.fs.fsync: cannot open")
    has(errmsg(fs.free_bytes, path("nope")), "moelua.fs.free_bytes:")
    has(errmsg(fs.glob, {}), "moelua.fs.glob: argument #1 (pattern): expected a string")
    has(errmsg(fs.lock, 3), "moelua.fs.lock: argument #1 (path): expected a string")
    has(errmsg(fs.lock, path("nope/lock")), "moelua.fs.lock: '" .. path("nope/lock") .. "': No such file")
  end)

  it("locks a file for one holder at a time, naming the holder's pid", function()
    local a = assert(fs.lock(path("lock")))
    local pid = support.read_file(path("lock")):match("^(%d+)\n$")
    assert.is_not_nil(pid)
    local none, holder = fs.lock(path("lock"))   -- a second open file: refused, even in this process
    assert.is_nil(none)
    assert.are.equal(tonumber(pid), holder)
    a:release()
    a:release()                                 -- idempotent
    local b = assert(fs.lock(path("lock")))
    do local c <close> = b end                  -- __close drops it too
    assert.is_not_nil((fs.lock(path("lock"))))
  end)
end)
