-- moelua.ckpt - checkpoint directories (DESIGN.md, Files and formats).
--
--   local dir = ckpt.save(root, step, {model = {{name =, tensor =}, ...}, config = {...},
--                         optim = {[name] = {exp_avg =, exp_avg_sq =}} or nil,
--                         optim_steps = {[name] = i64 [E]} or nil,
--                         trainer = {...}}, {keep = K})        -- -> root/step-000123
--   local c = ckpt.load(root_or_dir)   -- {model = {name -> source}, names =, config =,
--                                      --  optim =, optim_steps =, trainer =, dir =}
--   src:dtype(), src:shape(), src:numel()   -- a source: one tensor of the checkpoint, on disk
--   src:read_into(dst)                      -- into a tensor on any device (float dtypes convert)
--   src:read_range(offset, dst)             -- numel(dst) elements from element offset
--   src:read()                              -- a new CPU tensor (f32 for BF16/F16 on disk)
--   ckpt.latest(root), ckpt.last_good(root), ckpt.mark_good(root, dir), ckpt.list(root)
--   ckpt.json_error(v, what)   -- nil, or why v cannot be saved as JSON
--
-- A save writes root/step-NNNNNN.tmp/ (model.safetensors with metadata
-- {"format": "pt"}, config.json, optim/{exp_avg,exp_avg_sq,steps}.safetensors,
-- trainer.json, then MANIFEST.sha256 of every file, in sha256sum's format),
-- fsyncs each file and directory, renames it to step-NNNNNN/ (or, when that
-- step exists, swaps the two with one renameat2 RENAME_EXCHANGE), fsyncs
-- root, then replaces root/latest (a one-line file naming the directory),
-- and root/last_good when the save is good, by write-temp + fsync + rename.
-- keep = K then removes the oldest step-* directories beyond K (each renamed
-- to *.pruned.tmp first), never the ones `latest` or `last_good` name. A failed
-- save removes its temp directory and says that the previous checkpoint is
-- intact; leftover *.tmp directories of a crashed save are ignored by load
-- and removed by the next save.
--
-- JSON goes through dkjson. Integers round-trip exactly (dkjson writes them
-- with %d and reads them back as Lua integers, the full int64 range); floats
-- are written with 17 significant digits (dkjson's own %.14g would lose bits)
-- and always with a '.' or exponent, so they come back as floats.
--
-- Load verifies MANIFEST.sha256 (required for a moelua checkpoint, one with
-- trainer.json; checked when present otherwise), accepts a sharded model
-- (model.safetensors.index.json with a weight_map), and reads no tensor:
-- each is a source, read when its destination asks (src:read_into(dst),
-- straight into a unit's view on any device through bounded host stages,
-- DESIGN.md: never a whole-model host copy; BF16/F16 convert to the
-- destination's dtype). Its files stay open until the checkpoint table is
-- collected. Everything read is untrusted: a missing, corrupted or
-- truncated file is an error naming it.
--
-- Sharded saves (ZeRO, several ranks): state.sharded = {rank =, files =
-- {[relative path] = {{name =, dtype =, shape =}, ...}}, write =
-- function(dir), barrier = function(what)} in place of model/optim. Rank 0
-- makes the directory and every file's header (moelua.io.create, the final
-- size); after barrier, every rank's write(dir) writes its own ranges
-- (moelua.io.open_writer + write_range); after the next barrier rank 0
-- writes the JSON files and the manifest and renames as above; the ranks
-- return after a last barrier, when the checkpoint is complete. The files
-- are ordinary: load (and one-process tools) read them as any other.
--
-- Not here: what to save (the trainer builds the tables), Mixtral name and
-- shape checks against a config (the model loader does those), which
-- ranges a rank owns (moelua.zero).
local fs = require "moelua.fs"
local mio = require "moelua.io"
local json = require "dkjson"
local errors = require "moelua.errors"

local ckpt = {}

-- A bad path, file or argument: a user error (printed without a traceback).
local function fail(fn, fmt, ...)
  errors.user(string.format("moelua.ckpt.%s: " .. fmt, fn, ...))
end

local function join(a, b) return a:sub(-1) == "/" and a .. b or a .. "/" .. b end

local function exists(p) return fs.stat(p) ~= nil end

-- A checkpoint is read from regular files only: opening a FIFO or a
-- device would wait for a writer forever.
local function regular(path, fn)
  local st = fs.stat(path)
  if st and st.type ~= "file" then
    fail(fn or "load", "'%s' is not a regular file (%s)", path,
         st.type == "dir" and "a directory" or "a FIFO, socket or device")
  end
end

local function read_all(path, fn)
  regular(path, fn)
  local f, err = io.open(path, "rb")
  if not f then return nil, err end
  local s = f:read("a")
  f:close()
  return s
end

-- ---- JSON ------------------------------------------------------------------

-- A value's JSON text, written as it stands (a float's shortest exact digits).
local RAW = {__tojson = function(self) return self[1] end}

-- A copy of v that dkjson encodes exactly, with every key checked; path names
-- the value in errors.
local function jsonable(v, path, fn, seen)
  local t = type(v)
  if t == "string" or t == "boolean" then return v end
  if math.type(v) == "integer" then return v end
  if math.type(v) == "float" then
    if v ~= v or v == math.huge or v == -math.huge then
      fail(fn, "%s: %s is not representable in JSON", path, tostring(v))
    end
    local s = string.format("%.17g", v)
    if not s:find("[.eEn]") then s = s .. ".0" end
    return setmetatable({s}, RAW)
  end
  if t ~= "table" then fail(fn, "%s: a %s cannot be saved in JSON", path, t) end
  if seen[v] then fail(fn, "%s: a table that contains itself", path) end
  seen[v] = true
  -- a list is 1..n without holes: JSON's null would read back as a nil
  -- that ends the list there (# of {1, nil, 3} is 1 or 3)
  local n, nkeys, last, out = 0, 0, 0, {}
  for k in pairs(v) do
    nkeys = nkeys + 1
    if math.type(k) == "integer" then
      if k < 1 then fail(fn, "%s: key %d: a table is either a list 1..n or has string keys", path, k) end
      n, last = n + 1, math.max(last, k)
    elseif type(k) ~= "string" then
      fail(fn, "%s: key %s: keys must be strings (or list indices)", path, tostring(k))
    end
  end
  if n ~= last then
    local hole = 1
    while v[hole] ~= nil do hole = hole + 1 end
    fail(fn, "%s: a list with a hole: entry %d is nil (JSON reads the list back cut there)", path, hole)
  end
  if n > 0 and n < nkeys then
    for k in pairs(v) do
      if type(k) == "string" then fail(fn, "%s: mixes list entries and the key '%s'", path, k) end
    end
  end
  if nkeys == 1 and math.type(v.n) == "integer" then   -- dkjson writes {n = 3} as [null, null, null]
    seen[v] = nil
    return setmetatable({string.format('{"n": %d}', v.n)}, RAW)   -- written as it stands
  end
  for k, x in pairs(v) do out[k] = jsonable(x, path .. "." .. tostring(k), fn, seen) end
  seen[v] = nil
  if nkeys == 0 then setmetatable(out, {__jsontype = "object"}) end
  return out
end

-- ckpt.json_error(v, what) -> nil when v can be saved in a checkpoint's
-- JSON (trainer.json's recipe_state), else why not, naming the key.
function ckpt.json_error(v, what)
  local ok, err = pcall(jsonable, v, what, "save", {})
  if not ok then return tostring(err) end
end

local function all_keys(v, keys)
  if type(v) == "table" and getmetatable(v) ~= RAW then
    for k, x in pairs(v) do
      if type(k) == "string" then keys[k] = true end
      all_keys(x, keys)
    end
  end
  return keys
end

local function encode(v, what, fn)
  local x = jsonable(v, what, fn, {})
  local order = {}
  for k in pairs(all_keys(x, {})) do order[#order + 1] = k end
  table.sort(order)
  return json.encode(x, {indent = true, keyorder = order}) .. "\n"
end

local function decode(s, path, fn)
  local v, _, err = json.decode(s, 1, nil)
  if err or v == nil then fail(fn, "'%s': not valid JSON (%s)", path, tostring(err)) end
  return v
end

-- ---- writing ----------------------------------------------------------------

local function write_file(path, s)
  local f, err = io.open(path, "wb")
  if not f then error(string.format("cannot create '%s': %s", path, err), 0) end
  local ok, werr = f:write(s)
  local cok, cerr = f:close()
  if not ok or not cok then
    error(string.format("writing '%s': %s", path, tostring(werr or cerr)), 0)
  end
end

-- Replace the pointer file root/name by a temp file and a rename.
local function write_pointer(root, name, target)
  local tmp = join(root, "." .. name .. ".tmp")
  write_file(tmp, target .. "\n")
  fs.fsync(tmp)
  fs.rename(tmp, join(root, name))
  fs.fsync(root)
end

local function read_pointer(root, name, fn)
  local s = read_all(join(root, name), fn)
  if not s then return nil end
  local target = s:match("^(step%-%d+)\n?$")
  if not target then fail(fn, "'%s' does not name a step directory", join(root, name)) end
  return join(root, target)
end

local function check_tensor(fn, what, t)
  if not (type(t) == "userdata" and require("moelua.tensor").is_tensor(t)) then
    fail(fn, "%s: expected a tensor, got %s", what, type(t))
  end
  return t   -- a device tensor is written through moelua.io's bounded host stage
end

local DTYPE_SIZE = {f64 = 8, i64 = 8, f32 = 4, i32 = 4, bf16 = 2, f16 = 2, u8 = 1}

-- A sharded save's description (see ckpt.save); returns its bytes.
local function check_sharded(sh)
  local fn = "save"
  if type(sh) ~= "table" or math.type(sh.rank) ~= "integer" or type(sh.files) ~= "table"
     or type(sh.write) ~= "function" or type(sh.barrier) ~= "function" then
    fail(fn, "sharded: expected {rank =, files =, write = function, barrier = function}")
  end
  local n = 0
  for rel, entries in pairs(sh.files) do
    if rel ~= "model.safetensors" and not rel:match("^optim/[%w_]+%.safetensors$") then
      fail(fn, "sharded.files: '%s' is not a checkpoint file", tostring(rel))
    end
    for _, e in ipairs(entries) do
      local c = DTYPE_SIZE[e.dtype] or 8
      for _, d in ipairs(e.shape) do c = c * d end
      n = n + c + 256
    end
  end
  return n
end

-- Validate the state table; returns the safetensors tables to write.
local function tables_of(state)
  local fn = "save"
  if type(state) ~= "table" then fail(fn, "argument #3: expected a state table, got %s", type(state)) end
  for k in pairs(state) do
    if not ({model = 1, config = 1, optim = 1, optim_steps = 1, trainer = 1, sharded = 1})[k] then
      fail(fn, "argument #3: unknown field '%s'", tostring(k))
    end
  end
  if state.sharded then return check_sharded(state.sharded) end
  if type(state.model) ~= "table" or #state.model == 0 then
    fail(fn, "model: expected a non-empty list of {name =, tensor =}")
  end
  local model, names = {}, {}
  for i, e in ipairs(state.model) do
    if type(e) ~= "table" or type(e.name) ~= "string" or e.name == "" then
      fail(fn, "model[%d]: expected {name = string, tensor = tensor}", i)
    end
    if model[e.name] then fail(fn, "model[%d]: duplicate name '%s'", i, e.name) end
    model[e.name] = check_tensor(fn, "model['" .. e.name .. "']", e.tensor)
    names[#names + 1] = e.name
  end
  local exp_avg, exp_avg_sq, steps
  if state.optim ~= nil then
    if type(state.optim) ~= "table" then fail(fn, "optim: expected a table, got %s", type(state.optim)) end
    exp_avg, exp_avg_sq = {}, {}
    for name, s in pairs(state.optim) do
      if not model[name] then fail(fn, "optim['%s']: no model tensor has that name", tostring(name)) end
      if type(s) ~= "table" then fail(fn, "optim['%s']: expected {exp_avg =, exp_avg_sq =}", name) end
      exp_avg[name] = check_tensor(fn, "optim['" .. name .. "'].exp_avg", s.exp_avg)
      exp_avg_sq[name] = check_tensor(fn, "optim['" .. name .. "'].exp_avg_sq", s.exp_avg_sq)
    end
  end
  if state.optim_steps ~= nil then
    if type(state.optim_steps) ~= "table" then
      fail(fn, "optim_steps: expected a table, got %s", type(state.optim_steps))
    end
    steps = {}
    for name, t in pairs(state.optim_steps) do
      if not model[name] then fail(fn, "optim_steps['%s']: no model tensor has that name", tostring(name)) end
      steps[name] = check_tensor(fn, "optim_steps['" .. name .. "']", t)
    end
  end
  return model, names, exp_avg, exp_avg_sq, steps
end

local function nbytes(tensors)
  if type(tensors) == "number" then return tensors end   -- a sharded save's
  local n = 0
  for _, t in pairs(tensors or {}) do n = n + t:numel() * DTYPE_SIZE[t:dtype()] + 256 end
  return n
end

-- Files under dir, relative, sorted (dirs walked).
local function files_under(dir, prefix, out)
  out = out or {}
  for _, name in ipairs(fs.listdir(dir)) do
    local p, rel = join(dir, name), prefix and prefix .. "/" .. name or name
    local st = fs.stat(p)
    if st and st.type == "dir" then files_under(p, rel, out) else out[#out + 1] = rel end
  end
  table.sort(out)
  return out
end

local function step_dirs(root)
  local out = {}
  local ok, names = pcall(fs.listdir, root)
  if not ok then return out end
  for _, name in ipairs(names) do
    local n = name:match("^step%-(%d+)$")
    if n then
      local st = fs.stat(join(root, name))
      if st and st.type == "dir" then out[#out + 1] = {step = math.tointeger(tonumber(n)), dir = join(root, name)} end
    end
  end
  table.sort(out, function(a, b) return a.step < b.step end)
  return out
end

-- ckpt.list(root) -> {{step =, dir =}, ...} oldest first (temp dirs excluded)
function ckpt.list(root)
  if type(root) ~= "string" then fail("list", "argument #1 (root): expected a string, got %s", type(root)) end
  return step_dirs(root)
end

function ckpt.latest(root)
  if type(root) ~= "string" then fail("latest", "argument #1 (root): expected a string, got %s", type(root)) end
  return read_pointer(root, "latest", "latest")
end

function ckpt.last_good(root)
  if type(root) ~= "string" then fail("last_good", "argument #1 (root): expected a string, got %s", type(root)) end
  return read_pointer(root, "last_good", "last_good")
end

-- ckpt.mark_good(root, dir): root/last_good names dir (kept by keep-K).
function ckpt.mark_good(root, dir)
  if type(root) ~= "string" then fail("mark_good", "argument #1 (root): expected a string, got %s", type(root)) end
  if type(dir) ~= "string" then fail("mark_good", "argument #2 (dir): expected a string, got %s", type(dir)) end
  local name = dir:match("(step%-%d+)/?$")
  if not name or not exists(join(join(root, name), "MANIFEST.sha256")) then
    fail("mark_good", "'%s' is not a checkpoint under '%s'", dir, root)
  end
  write_pointer(root, "last_good", name)
end

-- The write phase, in dir (the temp directory). fail_at: a test hook naming
-- a stage at which to raise as if the disk had failed.
local function write_all(dir, model, config, exp_avg, exp_avg_sq, steps, trainer, fail_at, sh)
  local function stage(name)
    if fail_at == name then error("injected failure at stage '" .. name .. "'", 0) end
  end
  fs.mkdir_p(dir)
  if sh then   -- the headers here, then every rank writes its ranges
    local rels = {}
    for rel in pairs(sh.files) do rels[#rels + 1] = rel end
    table.sort(rels)
    for _, rel in ipairs(rels) do
      if rel:find("/") then fs.mkdir_p(join(dir, "optim")) end
      mio.create(join(dir, rel), sh.files[rel], {format = "pt"}):close()
    end
    sh.barrier("checkpoint files created")
    sh.write(dir)
    sh.barrier("checkpoint ranges written")
  else
    mio.save(join(dir, "model.safetensors"), model, {format = "pt"})
  end
  stage("model")
  write_file(join(dir, "config.json"), config)
  if exp_avg or steps then
    fs.mkdir_p(join(dir, "optim"))
    if exp_avg then
      mio.save(join(dir, "optim/exp_avg.safetensors"), exp_avg, {format = "pt"})
      mio.save(join(dir, "optim/exp_avg_sq.safetensors"), exp_avg_sq, {format = "pt"})
    end
    if steps then mio.save(join(dir, "optim/steps.safetensors"), steps, {format = "pt"}) end
  end
  stage("optim")
  write_file(join(dir, "trainer.json"), trainer)
  stage("trainer")
  local lines = {}
  for _, rel in ipairs(files_under(dir)) do
    lines[#lines + 1] = fs.sha256(join(dir, rel)) .. "  " .. rel
    fs.fsync(join(dir, rel))
  end
  write_file(join(dir, "MANIFEST.sha256"), table.concat(lines, "\n") .. "\n")
  fs.fsync(join(dir, "MANIFEST.sha256"))
  if exists(join(dir, "optim")) then fs.fsync(join(dir, "optim")) end
  fs.fsync(dir)
  stage("manifest")
end

-- ckpt.save(root, step, state [, opts]) -> the checkpoint directory
-- opts: keep = K (>= 1; nil keeps all), min_free = bytes that must remain
-- free after the save (default 0), good = true: root/last_good names it
-- too (written right after latest, before pruning, so a kill cannot leave
-- a newer good checkpoint unmarked), false: it is not good (last_good, if
-- it named this step, is removed), nil: last_good is left as it is,
-- fail_at = a stage (tests).
function ckpt.save(root, step, state, opts)
  local fn = "save"
  if type(root) ~= "string" or root == "" then fail(fn, "argument #1 (root): expected a path, got %s", type(root)) end
  if math.type(step) ~= "integer" or step < 0 then
    fail(fn, "argument #2 (step): expected a non-negative integer, got %s", tostring(step))
  end
  opts = opts or {}
  if type(opts) ~= "table" then fail(fn, "argument #4: expected an options table, got %s", type(opts)) end
  for k in pairs(opts) do
    if not ({keep = 1, min_free = 1, fail_at = 1, good = 1})[k] then
      fail(fn, "argument #4: unknown option '%s'", tostring(k))
    end
  end
  if opts.good ~= nil and type(opts.good) ~= "boolean" then
    fail(fn, "good: expected a boolean, got %s", type(opts.good))
  end
  if opts.keep ~= nil and (math.type(opts.keep) ~= "integer" or opts.keep < 1) then
    fail(fn, "keep: expected a positive integer, got %s", tostring(opts.keep))
  end
  local min_free = opts.min_free or 0
  if math.type(min_free) ~= "integer" or min_free < 0 then
    fail(fn, "min_free: expected a non-negative integer, got %s", tostring(min_free))
  end
  local model, _, exp_avg, exp_avg_sq, steps = tables_of(state)
  local config = encode(state.config or {}, "config", fn)
  local trainer = encode(state.trainer or {}, "trainer", fn)
  local sh = state.sharded
  local name = string.format("step-%06d", step)
  local final, tmp = join(root, name), join(root, name .. ".tmp")
  if sh and sh.rank > 0 then   -- rank 0 makes the directory and the files; this rank writes its ranges
    sh.barrier("checkpoint files created")
    sh.write(tmp)
    sh.barrier("checkpoint ranges written")
    sh.barrier("checkpoint saved")
    return final
  end

  local prev = read_pointer(root, "latest", fn)
  local intact = prev and ("the previous checkpoint " .. prev .. " is intact") or "no previous checkpoint"
  local made, why = pcall(function()
    fs.mkdir_p(root)
    for _, name in ipairs(fs.listdir(root)) do             -- leftovers of a crashed save
      local aside = name:match("^(step%-%d+)%.replaced%.tmp$")
      if aside and not exists(join(root, aside)) then     -- killed between the fallback's two renames
        fs.rename(join(root, name), join(root, aside))
      elseif name:match("^step%-%d+%.tmp$") or aside or name:match("^step%-%d+%.pruned%.tmp$") then
        fs.remove_tree(join(root, name))
      end
    end
  end)
  if not made then fail(fn, "saving step %d failed: %s; nothing written, %s", step, tostring(why), intact) end

  local need = nbytes(model) + nbytes(exp_avg) + nbytes(exp_avg_sq) + nbytes(steps) + #config +
               #trainer + 65536
  local free = fs.free_bytes(root)
  if free - need < min_free then
    fail(fn, "not enough disk space in '%s' for step %d: %d bytes free, about %d needed " ..
         "(+ min_free %d); nothing written, %s", root, step, free, need, min_free, intact)
  end

  local ok, err = pcall(write_all, tmp, model, config, exp_avg, exp_avg_sq, steps, trainer, opts.fail_at, sh)
  local swapped
  if ok and exists(final) then     -- re-saving a step (after a rollback, a final save): replace it
    ok, swapped = pcall(fs.exchange, tmp, final)   -- in one step: `final` is always a whole checkpoint
    if ok and swapped then
      fs.fsync(root)
      fs.remove_tree(tmp)                          -- the previous version, now under the temp name
    elseif ok then                                 -- a file system without it: aside, then in
      local old = join(root, name .. ".replaced.tmp")
      ok, err = pcall(fs.rename, final, old)
      if ok then
        ok, err = pcall(function() fs.rename(tmp, final); fs.fsync(root) end)
        if ok then
          fs.remove_tree(old)
        else
          pcall(fs.rename, old, final)   -- put the previous version back before reporting
        end
      end
    else
      err = swapped
    end
  elseif ok then
    ok, err = pcall(function() fs.rename(tmp, final); fs.fsync(root) end)
  end
  if not ok then
    local rok, removed = pcall(fs.remove_tree, tmp)   -- false: it was never made
    removed = rok and removed
    fail(fn, "saving step %d failed: %s; %s, %s", step, (tostring(err):gsub("^[^\n]-%.lua:%d+: ", "")),
         removed and ("removed '" .. tmp .. "'") or "nothing written", intact)
  end
  write_pointer(root, "latest", name)
  if opts.good then
    write_pointer(root, "last_good", name)   -- with latest, before any pruning
  elseif opts.good == false then
    local okp, good = pcall(read_pointer, root, "last_good", fn)
    if okp and good == final then os.remove(join(root, "last_good")) end   -- replaced by one that is not
  end

  if opts.keep then
    local protect = {[final] = true}
    for _, p in ipairs({"latest", "last_good"}) do
      local okp, d = pcall(read_pointer, root, p, fn)
      if okp and d then protect[d] = true end
    end
    -- Steps after this one belong to a run that was rolled back past: they
    -- go first; then the oldest beyond `keep`.
    -- Each is renamed first, so no step-N that is half removed is left by a
    -- kill: the next save clears a leftover *.pruned.tmp.
    local function prune(dir)
      local gone = dir .. ".pruned.tmp"
      fs.rename(dir, gone)
      fs.remove_tree(gone)
    end
    local dirs, kept = step_dirs(root), {}
    for _, d in ipairs(dirs) do
      if d.step > step and not protect[d.dir] then prune(d.dir) else kept[#kept + 1] = d end
    end
    for i = 1, #kept - opts.keep do
      if not protect[kept[i].dir] then prune(kept[i].dir) end
    end
  end
  if sh then sh.barrier("checkpoint saved") end
  return final
end

-- ---- loading ----------------------------------------------------------------

local function verify_manifest(dir, required)
  local path = join(dir, "MANIFEST.sha256")
  local s = read_all(path)
  if not s then
    if required then fail("load", "'%s' is missing: the checkpoint is incomplete", path) end
    return
  end
  local n = 0
  for line in s:gmatch("([^\n]*)\n?") do
    if line ~= "" then
      n = n + 1
      local sum, rel = line:match("^(%x+)  (.+)$")
      if not sum or #sum ~= 64 or rel:find("^/") or rel:find("%.%.") then
        fail("load", "'%s': line %d is malformed", path, n)
      end
      local p = join(dir, rel)
      if not exists(p) then fail("load", "'%s' is listed in MANIFEST.sha256 but missing", p) end
      regular(p)
      local readable, got = pcall(fs.sha256, p)
      if not readable then fail("load", "%s", (tostring(got):gsub("^moelua%.fs%.sha256: ", ""))) end
      if got ~= sum:lower() then
        fail("load", "'%s' is corrupted or truncated: its SHA-256 does not match MANIFEST.sha256", p)
      end
    end
  end
  if n == 0 then fail("load", "'%s' is empty", path) end
end

-- A source: one tensor of an open checkpoint file, read on demand.
local Source = {}
Source.__index = Source

function Source:dtype() return self.entry.dtype end

function Source:shape() return {table.unpack(self.entry.shape)} end

function Source:numel()
  local n = 1
  for _, s in ipairs(self.entry.shape) do n = n * s end
  return n
end

function Source:read_into(dst)
  local ok, err = pcall(self.reader.read_into, self.reader, self.name, dst)
  if not ok then fail("load", "%s", tostring(err)) end
  return dst
end

-- src:read_range(offset, dst): numel(dst) elements of the tensor from
-- element offset (row-major), read alone (a rank's shard).
function Source:read_range(offset, dst)
  local ok, err = pcall(self.reader.read_range, self.reader, self.name, offset, dst)
  if not ok then fail("load", "%s", tostring(err)) end
  return dst
end

function Source:read()
  local d = self:dtype()
  local dt = (d == "bf16" or d == "f16") and "f32" or d
  return self:read_into(require("moelua.tensor").empty(self:shape(), {dtype = dt}))
end

function ckpt.is_source(v) return getmetatable(v) == Source end

-- The sources of the safetensors file at path, by name.
local function open_st(path)
  regular(path)
  local ok, reader = pcall(mio.open, path)
  if not ok then fail("load", "%s", tostring(reader)) end
  local out = {}
  for name, entry in pairs(reader:entries()) do
    out[name] = setmetatable({reader = reader, name = name, entry = entry}, Source)
  end
  return out
end

local function safe_name(rel, what)
  if type(rel) ~= "string" or rel == "" or rel:find("^/") or rel:find("%.%.") then
    fail("load", "%s: '%s' is not a file name inside the checkpoint", what, tostring(rel))
  end
  return rel
end

local function load_model(dir)
  local single = join(dir, "model.safetensors")
  local index = join(dir, "model.safetensors.index.json")
  local model = {}
  if exists(single) then
    model = open_st(single)
  elseif exists(index) then
    local idx = decode(assert(read_all(index)), index, "load")
    if type(idx) ~= "table" or type(idx.weight_map) ~= "table" then
      fail("load", "'%s': no weight_map object", index)
    end
    local shards = {}
    for name, file in pairs(idx.weight_map) do
      if type(name) ~= "string" then fail("load", "'%s': weight_map keys must be strings", index) end
      safe_name(file, index .. ": weight_map['" .. name .. "']")
      shards[file] = shards[file] or {}
      shards[file][#shards[file] + 1] = name
    end
    for file, names in pairs(shards) do
      local p = join(dir, file)
      if not exists(p) then fail("load", "'%s': shard '%s' is missing", index, p) end
      local ts = open_st(p)
      for _, name in ipairs(names) do
        if not ts[name] then fail("load", "'%s': tensor '%s' is not in shard '%s'", index, name, p) end
        model[name] = ts[name]
      end
    end
  else
    local hint = exists(join(dir, "ckpt")) and string.format(" (a run directory? its checkpoints are in '%s')",
                                                              join(dir, "ckpt")) or ""
    fail("load", "'%s' has neither model.safetensors nor model.safetensors.index.json%s", dir, hint)
  end
  return model
end

-- A checkpoint's JSON file decoded, or nil when it has none; one that is
-- not a regular file or not JSON is load's error.
local function read_json(path)
  local s = read_all(path)
  return s and decode(s, path, "load") or nil
end

-- ckpt.config(dir): the checkpoint directory's config.json (read_json).
function ckpt.config(dir) return read_json(join(dir, "config.json")) end

-- ckpt.load(root_or_dir)
function ckpt.load(path)
  if type(path) ~= "string" then fail("load", "argument #1: expected a path, got %s", type(path)) end
  local st = fs.stat(path)
  if not st then fail("load", "'%s' does not exist", path) end
  if st.type ~= "dir" then fail("load", "'%s' is not a directory", path) end
  local dir = path
  if exists(join(path, "latest")) then
    dir = read_pointer(path, "latest", "load")
    if not exists(dir) then fail("load", "'%s' names '%s', which does not exist", join(path, "latest"), dir) end
  elseif not exists(join(dir, "model.safetensors")) and not exists(join(dir, "model.safetensors.index.json")) then
    local partial = {}
    for _, name in ipairs(fs.listdir(dir)) do
      if name:match("^step%-%d+%.tmp$") then partial[#partial + 1] = join(dir, name) end
    end
    local steps = step_dirs(dir)
    if #steps > 0 then   -- a checkpoint root whose `latest` is gone: name what it holds
      fail("load", "'%s' is a checkpoint root without its 'latest' pointer; load one of its checkpoints " ..
           "by name: %s%s", dir, steps[#steps].dir, #steps > 1 and string.format(" (the newest of %d)", #steps) or "")
    end
    if #partial > 0 then
      fail("load", "'%s' holds no finished checkpoint: %s %s a save that did not finish (interrupted or " ..
           "killed while writing) and cannot be loaded; the next successful save there removes it",
           dir, table.concat(partial, ", "), #partial > 1 and "are" or "is")
    end
  end
  verify_manifest(dir, exists(join(dir, "trainer.json")))
  local c = {dir = dir}
  c.model = load_model(dir)
  c.names = {}
  for k in pairs(c.model) do c.names[#c.names + 1] = k end
  table.sort(c.names)
  c.config = ckpt.config(dir)
  c.trainer = read_json(join(dir, "trainer.json"))
  local ea = join(dir, "optim/exp_avg.safetensors")
  if exists(ea) then
    local a, b = open_st(ea), open_st(join(dir, "optim/exp_avg_sq.safetensors"))
    c.optim = {}
    for name, t in pairs(a) do
      if not b[name] then fail("load", "optim: exp_avg_sq has no '%s'", name) end
      c.optim[name] = {exp_avg = t, exp_avg_sq = b[name]}
    end
  end
  local sp = join(dir, "optim/steps.safetensors")
  if exists(sp) then c.optim_steps = open_st(sp) end
  return c
end

return ckpt
