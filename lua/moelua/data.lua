-- moelua.data - a streaming corpus of (seq_len + 1)-token windows.
--
--   local data = require "moelua.data"
--   local ds = data.open{glob = "/usr/include/**/*.h", seq_len = 1024}
--   local tokens = ds:batch(step)     -- i64 [S+1], a pure function of (seed, step)
--   local v = ds:validation(i)        -- i64 [S+1], 1 <= i <= ds:n_validation()
--   local st = ds:state()             -- saved in trainer.json; ds:set_state(st) on resume
--
-- The corpus is the concatenation of its files (`paths` in the given order,
-- or the sorted matches of `glob`, where "**" matches any depth of
-- directories) read as tokens: "bytes" (byte-level text, vocabulary 256) or
-- pre-tokenized little-endian "u16" / "u32" .bin files. A window is read with
-- moelua.fs.read, pread in 64 KiB chunks of only its byte range, across file
-- boundaries; a whole file is never loaded.
--
-- The held-out slice is the tail of the corpus (fixed by position): the last
-- n_validation() non-overlapping windows, about `holdout` of the tokens. The
-- training part before it is cut into non-overlapping windows; each epoch
-- visits all of them in a seeded pseudo-random order (a Feistel permutation
-- keyed by (seed, epoch), with a per-epoch shift of the window grid), so the
-- window of a global step is a pure function of (seed, step) and of nothing
-- else: not of call order, thread count or resumption.
--
-- The fingerprint (file names, sizes, mtimes and a hash of sampled bytes)
-- is saved with the cursor; set_state refuses a state from another corpus.
-- Its bytes are sampled at the first state() or set_state(), not at open:
-- a run that never saves (a `moelua plan` of the recipe) reads no file.
--
-- Not here: tokenizers, batching several windows (call batch per micro-batch
-- with distinct global indices), shuffling inside a window.
local fs = require "moelua.fs"
local T = require "moelua.tensor"
local errors = require "moelua.errors"
local options = require "moelua.options"
local host = require "moelua.host"

local data = {}

local Dataset = {}
Dataset.__index = Dataset

local WIDTH = {bytes = 1, u8 = 1, u16 = 2, u32 = 4}
local OPTIONS = {paths = true, glob = true, format = true, seq_len = true, seed = true,
                 holdout = true}

-- A bad path, file or argument: a user error (printed without a traceback).
local function fail(fn, fmt, ...)
  errors.user(string.format("moelua.data.%s: " .. fmt, fn, ...))
end

-- splitmix64: a 64-bit mixing function (wrapping integer arithmetic).
local function mix(x)
  x = x + 0x9e3779b97f4a7c15
  x = (x ~ (x >> 30)) * 0xbf58476d1ce4e5b9
  x = (x ~ (x >> 27)) * 0x94d049bb133111eb
  return x ~ (x >> 31)
end

local function hash(seed, a, b)
  return mix(mix(mix(seed) ~ a) ~ b)
end

-- A bijection of [0, n) keyed by (seed, epoch): a 4-round Feistel network
-- on 2h bits with cycle walking.
local function permute(i, n, seed, epoch)
  if n == 1 then return 0 end
  local bits = 1
  while (1 << bits) < n do bits = bits + 1 end
  local h = (bits + 1) // 2
  local mask = (1 << h) - 1
  local key = hash(seed, epoch, 0x5eed)
  local x = i
  repeat
    local l, r = x >> h, x & mask
    for round = 1, 4 do
      l, r = r, l ~ (mix(key ~ (r * 4 + round)) & mask)
    end
    x = (l << h) | r
  until x < n
  return x
end

-- Sorted paths matching pattern; "**" as a whole path component matches
-- zero or more directories (symbolic links to directories are not followed),
-- and the walk's fs.stat of each path it visited (not to stat them twice).
local function expand(pattern)
  local base, rest = pattern:match("^(.-)/%*%*/(.+)$")
  if not base then   -- "**/x": under the current directory, paths as the glob spells them
    rest = pattern:match("^%*%*/(.+)$")
    if rest then base = "." end
  end
  if not base then
    if pattern:find("**", 1, true) then
      fail("open", "glob: '**' must be a whole path component followed by a pattern, got '%s'",
           pattern)
    end
    local ok, paths = pcall(fs.glob, pattern)
    if not ok then fail("open", "%s", tostring(paths)) end
    return paths, {}
  end
  if rest:find("**", 1, true) then
    fail("open", "glob: only one '**' is supported, got '%s'", pattern)
  end
  if base == "" then base = "/" end
  local function under(dir, name)   -- ("." itself is not spelt: "**/*.h" gives "a.h", "sub/b.h")
    if dir == "." then return name end
    return (dir:sub(-1) == "/" and dir or dir .. "/") .. name
  end
  local seen, out, stats = {}, {}, {}
  local function walk(dir, depth)
    for _, p in ipairs(fs.glob(under(dir, rest))) do
      if not seen[p] then seen[p] = true; out[#out + 1] = p end
    end
    if depth > 64 then return end
    local ok, names = pcall(fs.listdir, dir)
    if not ok and host.is_interrupt(names) then error(names, 0) end   -- Ctrl-C, not the directory
    if not ok then return end   -- unreadable directories are skipped, as glob(3) would
    for _, name in ipairs(names) do
      local p = under(dir, name)
      local st = fs.stat(p)
      stats[p] = st
      if st and st.type == "dir" and not st.link then walk(p, depth + 1) end
    end
  end
  local st = fs.stat(base)
  if st and st.type == "dir" then walk(base, 0) end
  table.sort(out)
  return out, stats
end

-- A few bytes of the file (at most 4 samples of 64 bytes) for the fingerprint.
local function sample(fn, path, size)
  local f, err = io.open(path, "rb")
  if not f then fail(fn, "cannot open '%s': %s", path, err) end
  local parts = {}
  for _, at in ipairs({0, size // 3, (2 * size) // 3, math.max(0, size - 64)}) do
    f:seek("set", at)
    parts[#parts + 1] = f:read(64) or ""
  end
  f:close()
  return table.concat(parts)
end

-- data.open(opts) -> a dataset
function data.open(opts)
  if type(opts) ~= "table" then fail("open", "expected an options table, got %s", type(opts)) end
  for k in pairs(opts) do
    if not OPTIONS[k] then fail("open", "%s", options.unknown(k, OPTIONS)) end
  end
  local format = opts.format or "bytes"
  if not WIDTH[format] then
    fail("open", "format: expected \"bytes\", \"u16\" or \"u32\", got %s", tostring(format))
  end
  local S = opts.seq_len
  if math.type(S) ~= "integer" or S < 1 then
    fail("open", "seq_len: expected a positive integer, got %s", tostring(S))
  end
  local seed = opts.seed or 0
  if math.type(seed) ~= "integer" then
    fail("open", "seed: expected an integer, got %s", tostring(seed))
  end
  local holdout = opts.holdout or 0
  if type(holdout) ~= "number" or holdout < 0 or holdout >= 1 then
    fail("open", "holdout: expected a number in [0, 1), got %s", tostring(holdout))
  end

  local paths, stats = nil, {}
  if (opts.paths == nil) == (opts.glob == nil) then
    fail("open", "give exactly one of paths and glob")
  elseif opts.glob ~= nil then
    if type(opts.glob) ~= "string" then
      fail("open", "glob: expected a string, got %s", type(opts.glob))
    end
    paths, stats = expand(opts.glob)
    if #paths == 0 then fail("open", "glob '%s' matches no file", opts.glob) end
  else
    if type(opts.paths) ~= "table" or #opts.paths == 0 then
      fail("open", "paths: expected a non-empty list of file names, got %s", type(opts.paths))
    end
    paths = {}
    for i, p in ipairs(opts.paths) do
      if type(p) ~= "string" then fail("open", "paths[%d]: expected a string, got %s", i, type(p)) end
      paths[i] = p
    end
  end

  local w = WIDTH[format]
  local files, starts, listed = {}, {}, {}
  local n, dirs = 0, 0
  for _, p in ipairs(paths) do
    local st, err = stats[p], nil
    if not st then st, err = fs.stat(p) end
    if not st then fail("open", "cannot read '%s': %s", p, err) end
    if st.type == "dir" then dirs = dirs + 1 end
    if st.type == "file" then           -- a glob may match directories, devices, FIFOs: they are skipped
      if st.size % w ~= 0 then
        fail("open", "'%s': %d bytes is not a whole number of %s tokens", p, st.size, format)
      end
      listed[#listed + 1] = {p, st.size, st.mtime}
      if st.size > 0 then
        files[#files + 1] = p
        starts[#files] = n
        n = n + st.size // w
      end
    elseif opts.paths then
      fail("open", "'%s' is not a regular file", p)
    end
  end
  starts[#files + 1] = n
  if #listed == 0 and opts.glob and dirs > 0 then   -- a glob of directories only, such as a directory's name
    fail("open", "glob '%s' matches no regular file (only directories: a glob such as '%s/**/*' reads the " ..
         "files under one)", opts.glob, (opts.glob:gsub("/$", "")))
  end
  if #listed == 0 and opts.glob then
    fail("open", "glob '%s' matches no regular file (only devices, FIFOs or sockets, which are not read)", opts.glob)
  end

  local W = S + 1
  local nval = 0
  if holdout > 0 then nval = math.max(1, math.floor(n * holdout / W)) end
  local train_end = n - nval * W
  local ntrain = train_end // W
  if ntrain < 1 then
    fail("open", "the corpus has %d tokens: too few for one training window of %d tokens " ..
         "and %d validation window(s)", n, W, nval)
  end

  return setmetatable({
    files = files, starts = starts, format = format, seq_len = S, seed = seed,
    holdout = holdout, n_tokens = n, train_end = train_end, n_train = ntrain, n_val = nval,
    listed = listed, cursor = 0,
  }, Dataset)
end

-- The corpus's fingerprint: every listed file's name, size, mtime (as open
-- saw them) and sampled bytes, hashed once.
local function fingerprint(self, fn)
  if not self.digest then
    local fp = {self.format}
    for i, f in ipairs(self.listed) do
      fp[i + 1] = string.format("%s\0%d\0%d\0%s", f[1], f[2], f[3], sample(fn, f[1], f[2]))
    end
    self.digest = fs.sha256_string(table.concat(fp, "\0\0"))
  end
  return self.digest
end

-- The W tokens at global position pos, read across file boundaries.
function Dataset:window(pos)
  local W = self.seq_len + 1
  local out = T.empty({W}, {dtype = "i64"})
  -- the file holding pos: the last start <= pos (binary search)
  local lo, hi = 1, #self.files
  while lo < hi do
    local mid = (lo + hi + 1) // 2
    if self.starts[mid] <= pos then lo = mid else hi = mid - 1 end
  end
  local got, i = 0, lo
  while got < W do
    local off = pos + got - self.starts[i]
    local take = math.min(W - got, self.starts[i + 1] - self.starts[i] - off)
    fs.read(self.files[i], off, take, self.format, out, got + 1)
    got = got + take
    i = i + 1
  end
  return out
end

-- The start of training window `step` (0-based global step).
function Dataset:position(step)
  if math.type(step) ~= "integer" or step < 0 then
    fail("batch", "step: expected a non-negative integer, got %s", tostring(step))
  end
  local W = self.seq_len + 1
  local epoch, i = step // self.n_train, step % self.n_train
  local slack = self.train_end - self.n_train * W
  local shift = slack > 0 and (hash(self.seed, epoch, 0x5417) >> 1) % (slack + 1) or 0
  return shift + permute(i, self.n_train, self.seed, epoch) * W
end

-- ds:batch(step) -> i64 [S+1]; the cursor becomes step + 1.
function Dataset:batch(step)
  local t = self:window(self:position(step))
  self.cursor = step + 1
  return t
end

-- ds:next() -> ds:batch(cursor)
function Dataset:next()
  return self:batch(self.cursor)
end

function Dataset:n_validation()
  return self.n_val
end

-- ds:validation(i), 1 <= i <= n_validation()
function Dataset:validation(i)
  if math.type(i) ~= "integer" or i < 1 or i > self.n_val then
    fail("validation", "index: expected an integer in [1, %d], got %s", self.n_val, tostring(i))
  end
  return self:window(self.train_end + (i - 1) * (self.seq_len + 1))
end

function Dataset:n_training()
  return self.n_train
end

function Dataset:state()
  return {cursor = self.cursor, fingerprint = fingerprint(self, "state"), seed = self.seed,
          seq_len = self.seq_len, format = self.format, n_tokens = self.n_tokens}
end

-- ds:set_state(st): resume at st.cursor; an error if the corpus changed,
-- or its seed, seq_len or format.
function Dataset:set_state(st)
  if type(st) ~= "table" then fail("set_state", "expected a state table, got %s", type(st)) end
  if math.type(st.cursor) ~= "integer" or st.cursor < 0 then
    fail("set_state", "cursor: expected a non-negative integer, got %s", tostring(st.cursor))
  end
  local now = fingerprint(self, "set_state")
  if st.fingerprint ~= now then
    fail("set_state", "the corpus changed since this state was saved (fingerprint %s, now %s): " ..
         "files, sizes or modification times differ", tostring(st.fingerprint), now)
  end
  -- another order or window size reads other windows: trained ones again, untrained ones never
  for _, k in ipairs({"seed", "seq_len", "format"}) do
    if st[k] ~= nil and st[k] ~= self[k] then
      fail("set_state", "the state was saved with %s %s, this corpus is opened with %s: its windows would be " ..
           "others, some already trained on; keep %s %s%s, or start a new run from the checkpoint's weights " ..
           "(train.run's init_from)", k, tostring(st[k]), tostring(self[k]), k, tostring(st[k]),
           k == "format" and "" or " (a recipe's --" .. k:gsub("_", "-") .. ")")
    end
  end
  self.cursor = st.cursor
end

function Dataset:__tostring()
  return string.format("moelua.data(%d files, %d %s tokens, seq_len %d, %d training and %d " ..
                       "validation windows)", #self.files, self.n_tokens, self.format,
                       self.seq_len, self.n_train, self.n_val)
end

return data
