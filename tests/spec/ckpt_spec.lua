-- moelua.ckpt (lua/moelua/ckpt.lua): round trips (bitwise tensors, config,
-- trainer with int64 extremes and exact floats), the atomic write protocol
-- (a leftover .tmp of a crashed save is ignored and cleaned; an injected
-- failure leaves `latest` loadable and says so), keep-K with `latest` and
-- `last_good` protected, MANIFEST.sha256 catching corrupted and truncated
-- files, sharded and BF16/F16 Hugging Face checkpoints, bad inputs.
local T = require "moelua.tensor"
local mio = require "moelua.io"
local fs = require "moelua.fs"
local ckpt = require "moelua.ckpt"
local support = require "tests.support"
local errmsg, has = support.errmsg, support.has

local root

local function state(step, seed)
  local w1 = T.randn({4, 3}, {seed = seed, offset = 0})
  local w2 = T.randn({2, 5}, {seed = seed + 1, offset = 0})
  return {
    model = {{name = "model.layers.0.block_sparse_moe.experts.0.w1.weight", tensor = w1},
             {name = "model.embed_tokens.weight", tensor = w2}},
    config = {model_type = "mixtral", architectures = {"MixtralForCausalLM"}, head_dim = 8,
              tie_word_embeddings = false, rope_theta = 1e6},
    optim = {["model.embed_tokens.weight"] = {exp_avg = w2 * 0.5, exp_avg_sq = w2 * w2}},
    optim_steps = {["model.layers.0.block_sparse_moe.experts.0.w1.weight"] =
                   T.tensor({3, 0, 7, 1}, {dtype = "i64"})},
    trainer = {step = step, rng = {seed = math.maxinteger, offset = (1 << 62) + 1, neg = math.mininteger},
               data = {cursor = step + 1, fingerprint = "abc"}, ema = 0.1 + 0.2, one = 1.0,
               state = {lr = 3e-4, history = {1.5, 2.25}, count = {n = 3}}},
  }
end

describe("moelua.ckpt", function()
  before_each(function() root = support.make_tmpdir() .. "/run" end)
  after_each(function() support.remove_dir(root:match("^(.*)/run$")) end)

  it("round-trips tensors bitwise, config and trainer exactly", function()
    local st = state(123, 1)
    local dir = ckpt.save(root, 123, st)
    assert.equal(root .. "/step-000123", dir)
    assert.equal(dir, ckpt.latest(root))
    local c = ckpt.load(root)
    assert.equal(dir, c.dir)
    for _, e in ipairs(st.model) do assert.same(e.tensor:totable(), c.model[e.name]:read():totable()) end
    local o = c.optim["model.embed_tokens.weight"]
    assert.same(st.optim["model.embed_tokens.weight"].exp_avg_sq:totable(), o.exp_avg_sq:read():totable())
    assert.same({3, 0, 7, 1}, c.optim_steps["model.layers.0.block_sparse_moe.experts.0.w1.weight"]:read():totable())
    assert.equal("mixtral", c.config.model_type)
    assert.is_false(c.config.tie_word_embeddings)
    assert.equal(math.maxinteger, c.trainer.rng.seed)
    assert.equal(math.mininteger, c.trainer.rng.neg)
    assert.equal((1 << 62) + 1, c.trainer.rng.offset)
    assert.equal("integer", math.type(c.trainer.step))
    assert.equal(0.1 + 0.2, c.trainer.ema)
    assert.equal("float", math.type(c.trainer.one))
    assert.same({1.5, 2.25}, c.trainer.state.history)
    assert.same({n = 3}, c.trainer.state.count)   -- not a list of length 3 (dkjson's reading of n)
    -- the model file is plain safetensors with {"format": "pt"}
    local _, meta = mio.load(dir .. "/model.safetensors")
    assert.same({format = "pt"}, meta)
    -- the manifest is sha256sum's format
    local p = io.popen("cd " .. support.shell_quote(dir) .. " && sha256sum -c --quiet MANIFEST.sha256 && echo OK")
    assert.equal("OK\n", p:read("a"))
    p:close()
  end)

  it("ignores and cleans a leftover temp dir of a crashed save", function()
    ckpt.save(root, 1, state(1, 1))
    -- a crash between writing step-000002.tmp and its rename
    fs.mkdir_p(root .. "/step-000002.tmp")
    support.write_file(root .. "/step-000002.tmp/model.safetensors", "partial")
    assert.equal(root .. "/step-000001", ckpt.load(root).dir)
    assert.equal(1, #ckpt.list(root))
    ckpt.save(root, 3, state(3, 1))
    assert.is_nil(fs.stat(root .. "/step-000002.tmp"))
    assert.equal(root .. "/step-000003", ckpt.load(root).dir)
  end)

  it("names a half-written first save when there is nothing else to load, and the next save removes it", function()
    fs.mkdir_p(root .. "/step-000003.tmp")        -- a first save that was interrupted
    support.write_file(root .. "/step-000003.tmp/model.safetensors", "partial")
    assert.matches("holds no finished checkpoint: .*/step%-000003%.tmp is a save that did not finish",
                   errmsg(ckpt.load, root))
    ckpt.save(root, 4, state(4, 1))
    assert.is_nil(fs.stat(root .. "/step-000003.tmp"))
    assert.equal(root .. "/step-000004", ckpt.load(root).dir)
  end)

  it("an unreadable file of a checkpoint, or an unusable root, is a user error that names it", function()
    local errors = require "moelua.errors"
    local dir = ckpt.save(root, 1, state(1, 1))
    os.remove(dir .. "/model.safetensors")
    fs.mkdir_p(dir .. "/model.safetensors")        -- a directory where the file was
    local ok, err = pcall(ckpt.load, root)
    assert.is_false(ok)
    assert.is_true(errors.is_user(err), tostring(err))
    has(tostring(err), "moelua.ckpt.load: '" .. dir .. "/model.safetensors' is not a regular file (a directory)")
    -- a FIFO would block the read forever: each file of a checkpoint is refused by name, with or without
    -- a MANIFEST.sha256 (a Hugging Face directory has none)
    local function fifo(path)
      os.remove(path)
      assert(os.execute("mkfifo " .. support.shell_quote(path)))
      has(errmsg(ckpt.load, path:match("^(.*)/[^/]+$")),
          "moelua.ckpt.load: '" .. path .. "' is not a regular file (a FIFO, socket or device)")
      os.remove(path)
    end
    local hf = root:match("^(.*)/run$") .. "/hf"
    fs.mkdir_p(hf)
    mio.save(hf .. "/model.safetensors", {w = T.zeros({2})})
    fifo(hf .. "/config.json")
    fifo(hf .. "/model.safetensors")
    fifo(ckpt.save(root, 3, state(3, 1)) .. "/config.json")   -- listed in its MANIFEST.sha256
    support.write_file(root .. "/latest", "nonsense\n")
    ok, err = pcall(ckpt.latest, root)
    assert.is_true(errors.is_user(err), tostring(err))
    assert.equal("moelua.ckpt.latest: '" .. root .. "/latest' does not name a step directory", tostring(err))
    has(errmsg(ckpt.load, root), "moelua.ckpt.load: '" .. root .. "/latest' does not name a step directory")
    local file = root:match("^(.*)/run$") .. "/a-file"
    support.write_file(file, "x")
    ok, err = pcall(ckpt.save, file .. "/ckpt", 2, state(2, 1))
    assert.is_true(errors.is_user(err), tostring(err))
    has(tostring(err), "moelua.ckpt.save: saving step 2 failed: moelua.fs.mkdir_p: ")
    has(tostring(err), "; nothing written, no previous checkpoint")
  end)

  it("names the checkpoints of a root whose `latest` is gone", function()
    ckpt.save(root, 1, state(1, 1))
    ckpt.save(root, 2, state(2, 1))
    os.remove(root .. "/latest")
    fs.mkdir_p(root .. "/step-000003.tmp")        -- and a save that did not finish
    assert.matches("'.*' is a checkpoint root without its 'latest' pointer; load one of its checkpoints by " ..
                   "name: .*/step%-000002 %(the newest of 2%)", errmsg(ckpt.load, root))
    assert.equal(root .. "/step-000002", ckpt.load(root .. "/step-000002").dir)
  end)

  it("a process killed (SIGKILL) while saving leaves `latest` loadable", function()
    -- a child saves 4 MiB checkpoints in a loop; it is killed at several
    -- moments, and after each kill the newest complete checkpoint loads
    local script = os.tmpname()
    support.write_file(script, string.format([[
      io.stdout:setvbuf("no")
      local T, ckpt = require "moelua.tensor", require "moelua.ckpt"
      print(io.open("/proc/self/stat"):read("n"))
      local w = T.randn({1024, 1024}, {seed = 1})
      for step = 1, 100000 do
        ckpt.save(%q, step, {model = {{name = "model.embed_tokens.weight", tensor = w}},
                             trainer = {step = step}}, {keep = 2})
        if step == 1 then print("ready") end
      end
    ]], root))
    for round, delay in ipairs({0.05, 0.13, 0.31}) do
      local p = assert(io.popen(support.host_command({script}) .. " 2>&1", "r"))
      local pid = p:read("n")
      p:read("l")
      assert.are.equal("ready", p:read("l"))
      require("system").sleep(delay)
      assert(os.execute("kill -KILL " .. math.tointeger(pid)))
      p:read("a")
      p:close()
      local c = ckpt.load(root)                      -- verifies MANIFEST.sha256
      assert.is_true(c.trainer.step >= 1, "round " .. round)
      assert.are.equal(1024 * 1024, c.model["model.embed_tokens.weight"]:numel())
    end
    os.remove(script)
  end)

  it("a failed save removes its temp dir, keeps the previous checkpoint and says so", function()
    ckpt.save(root, 1, state(1, 1))
    for _, stage in ipairs({"model", "optim", "trainer", "manifest"}) do
      local msg = errmsg(ckpt.save, root, 2, state(2, 1), {fail_at = stage})
      has(msg, "moelua.ckpt.save: saving step 2 failed: injected failure at stage '" .. stage .. "'")
      has(msg, "removed '" .. root .. "/step-000002.tmp'")
      has(msg, "the previous checkpoint " .. root .. "/step-000001 is intact")
      assert.is_nil(fs.stat(root .. "/step-000002.tmp"))
      assert.is_nil(fs.stat(root .. "/step-000002"))
      assert.equal(root .. "/step-000001", ckpt.load(root).dir)
    end
    local msg = errmsg(ckpt.save, root, 2, state(2, 1), {min_free = math.maxinteger // 2})
    has(msg, "not enough disk space")
    has(msg, "nothing written, the previous checkpoint " .. root .. "/step-000001 is intact")
  end)

  it("keep-K never removes what latest or last_good names", function()
    ckpt.save(root, 1, state(1, 1))
    ckpt.mark_good(root, root .. "/step-000001")
    for s = 2, 5 do ckpt.save(root, s, state(s, 1), {keep = 2}) end
    local steps = {}
    for _, e in ipairs(ckpt.list(root)) do steps[#steps + 1] = e.step end
    assert.same({1, 4, 5}, steps)
    assert.equal(root .. "/step-000001", ckpt.last_good(root))
    -- re-saving an existing step replaces it
    local st9 = state(4, 9)
    st9.model[1].tensor:fill_(0.5)
    ckpt.save(root, 4, st9, {keep = 2})   -- swapped in at once (renameat2 RENAME_EXCHANGE), the old one removed
    assert.same(st9.model[1].tensor:totable(), ckpt.load(root).model[st9.model[1].name]:read():totable())
    assert.same({"last_good", "latest", "step-000001", "step-000004"}, fs.listdir(root))
    -- a rollback to step 4: step 5 belonged to the abandoned run and goes first
    steps = {}
    for _, e in ipairs(ckpt.list(root)) do steps[#steps + 1] = e.step end
    assert.same({1, 4}, steps)
    has(errmsg(ckpt.mark_good, root, root .. "/step-000009"), "is not a checkpoint under")
  end)

  it("good = true names the save in last_good before pruning; a pruning cut short is cleared", function()
    ckpt.save(root, 1, state(1, 1), {good = true})
    ckpt.save(root, 2, state(2, 1), {keep = 1})
    assert.equal(root .. "/step-000001", ckpt.last_good(root))   -- protected, kept
    ckpt.save(root, 3, state(3, 1), {keep = 1, good = true})
    assert.equal(root .. "/step-000003", ckpt.last_good(root))
    local steps = {}
    for _, e in ipairs(ckpt.list(root)) do steps[#steps + 1] = e.step end
    assert.same({3}, steps)                                        -- step 1 was no longer the good one
    -- a kill while a pruned checkpoint was being removed leaves it under a temp name only
    fs.mkdir_p(root .. "/step-000002.pruned.tmp")
    support.write_file(root .. "/step-000002.pruned.tmp/model.safetensors", "part of it")
    assert.same({3}, (function() local t = {} for _, e in ipairs(ckpt.list(root)) do t[#t + 1] = e.step end
                                 return t end)())
    ckpt.save(root, 4, state(4, 1), {keep = 1})
    assert.is_nil(fs.stat(root .. "/step-000002.pruned.tmp"))
    has(errmsg(ckpt.save, root, 5, state(5, 1), {good = true, bogus = 1}), "argument #4: unknown option 'bogus'")
    has(errmsg(ckpt.save, root, 5, state(5, 1), {good = 1}), "good: expected a boolean, got number")
    -- the good step saved again as not good: last_good no longer names it
    ckpt.save(root, 4, state(4, 2), {good = true})
    assert.equal(root .. "/step-000004", ckpt.last_good(root))
    ckpt.save(root, 4, state(4, 3), {good = false})
    assert.is_nil(ckpt.last_good(root))
  end)

  it("puts a step back that a kill left aside between the two renames of a replace", function()
    ckpt.save(root, 1, state(1, 1))
    ckpt.save(root, 2, state(2, 1))
    -- where renameat2 cannot exchange, a replace moves step-2 aside, then the new copy in: killed between
    assert(os.rename(root .. "/step-000002", root .. "/step-000002.replaced.tmp"))
    fs.mkdir_p(root .. "/step-000002.tmp")
    ckpt.save(root, 3, state(3, 1))
    assert.is_not_nil(fs.stat(root .. "/step-000002/MANIFEST.sha256"))
    assert.is_nil(fs.stat(root .. "/step-000002.replaced.tmp"))
    assert.is_nil(fs.stat(root .. "/step-000002.tmp"))
    assert.equal(2, ckpt.load(root .. "/step-000002").trainer.step)
  end)

  it("corrupted, truncated or missing files are clear errors naming the file", function()
    local dir = ckpt.save(root, 1, state(1, 1))
    local f = dir .. "/model.safetensors"
    local good = support.read_file(f)
    support.write_file(f, good:sub(1, #good - 1) .. string.char((good:byte(#good) + 1) % 256))
    has(errmsg(ckpt.load, root), "'" .. f .. "' is corrupted or truncated")
    support.write_file(f, good:sub(1, #good - 4))
    has(errmsg(ckpt.load, dir), "'" .. f .. "' is corrupted or truncated")
    support.write_file(f, good)
    os.remove(dir .. "/trainer.json")
    has(errmsg(ckpt.load, dir), "trainer.json' is listed in MANIFEST.sha256 but missing")
    os.remove(dir .. "/MANIFEST.sha256")
    support.write_file(dir .. "/trainer.json", "{}")
    has(errmsg(ckpt.load, dir), "MANIFEST.sha256' is missing: the checkpoint is incomplete")
    support.write_file(dir .. "/MANIFEST.sha256", "nonsense\n")
    has(errmsg(ckpt.load, dir), "MANIFEST.sha256': line 1 is malformed")
    support.write_file(root .. "/latest", "../../etc\n")
    has(errmsg(ckpt.load, root), "does not name a step directory")
  end)

  it("loads a model straight into its units: no host copy of the model, bounded stages to convert", function()
    local nn, train, mem = require "moelua.nn", require "moelua.train", require "moelua.mem"
    local function model()
      return nn.Transformer.new{vocab = 256, dim = 64, layers = 2, heads = 4, kv_heads = 2, ffn = 96,
                                experts = 4, topk = 2, seed = 3}
    end
    local a, b = model(), model()
    local named = {}
    for _, p in ipairs(a:named_parameters()) do
      p.tensor:add_(0.5)   -- differ from b's weights
      named[#named + 1] = {name = p.name, tensor = p.tensor}
    end
    ckpt.save(root, 1, {model = named, config = a:config()})
    local bytes = 0
    for _, p in ipairs(b:named_parameters()) do bytes = bytes + 4 * p.tensor:numel() end
    collectgarbage()
    mem.reset_peak()
    local before = mem.stats().cpu.total
    train.init_from(b, root)
    assert.is_true(mem.stats().cpu.total_peak - before < 64 * 1024,
                   string.format("loading %d bytes of weights took %d more", bytes, mem.stats().cpu.total_peak - before))
    for i, p in ipairs(b:named_parameters()) do
      assert.are.equal(0, p.tensor:sub(a:named_parameters()[i].tensor):abs():max():item(), p.name)
    end
  end)

  it("loads sharded and BF16/F16 Hugging Face checkpoints as f32", function()
    local dir = root .. "/hf"
    fs.mkdir_p(dir)
    local a = T.tensor({{1.5, -2}, {0.25, 3}})
    local b = T.tensor({7, -0.5, 1024})
    mio.save(dir .. "/model-00001-of-00002.safetensors", {["a.weight"] = a:to("bf16")})
    mio.save(dir .. "/model-00002-of-00002.safetensors", {["b.weight"] = b:to("f16"), extra = b})
    support.write_file(dir .. "/model.safetensors.index.json", [[
{"metadata": {"total_size": 14}, "weight_map": {
  "a.weight": "model-00001-of-00002.safetensors",
  "b.weight": "model-00002-of-00002.safetensors"}}]])
    support.write_file(dir .. "/config.json", '{"model_type": "mixtral", "num_local_experts": 8}')
    local c = ckpt.load(dir)
    assert.equal("bf16", c.model["a.weight"]:dtype())          -- the source: as on disk
    assert.equal("f32", c.model["a.weight"]:read():dtype())    -- read: converted
    assert.same(a:totable(), c.model["a.weight"]:read():totable())
    assert.same(b:totable(), c.model["b.weight"]:read():totable())
    assert.is_nil(c.model.extra)
    assert.same({"a.weight", "b.weight"}, c.names)
    assert.equal(8, c.config.num_local_experts)
    support.write_file(dir .. "/model.safetensors.index.json",
                       '{"weight_map": {"a.weight": "../../x.safetensors"}}')
    has(errmsg(ckpt.load, dir), "is not a file name inside the checkpoint")
    support.write_file(dir .. "/model.safetensors.index.json",
                       '{"weight_map": {"c.weight": "model-00001-of-00002.safetensors"}}')
    has(errmsg(ckpt.load, dir), "tensor 'c.weight' is not in shard")
    support.write_file(dir .. "/model.safetensors.index.json", '{"weight_map": ')
    has(errmsg(ckpt.load, dir), "not valid JSON")
  end)

  it("rejects bad inputs with messages", function()
    local st = state(1, 1)
    has(errmsg(ckpt.save, 1, 1, st), "moelua.ckpt.save: argument #1 (root)")
    has(errmsg(ckpt.save, root, -1, st), "argument #2 (step): expected a non-negative integer")
    has(errmsg(ckpt.save, root, 1, {model = {}}), "model: expected a non-empty list")
    has(errmsg(ckpt.save, root, 1, {model = {{name = "a", tensor = 3}}}), "model['a']: expected a tensor")
    has(errmsg(ckpt.save, root, 1, {model = {st.model[1], st.model[1]}}), "duplicate name")
    has(errmsg(ckpt.save, root, 1, {model = st.model, optim = {x = {}}}), "optim['x']: no model tensor")
    has(errmsg(ckpt.save, root, 1, {model = st.model, trainer = {f = print}}), "trainer.f: a function cannot be saved")
    has(errmsg(ckpt.save, root, 1, {model = st.model, trainer = {x = 0 / 0}}), "trainer.x: " )
    has(errmsg(ckpt.save, root, 1, {model = st.model, trainer = {[1] = 1, a = 2}}), "mixes list entries")
    has(errmsg(ckpt.save, root, 1, {model = st.model, trainer = {s = {1, nil, 3}}}),
        "trainer.s: a list with a hole: entry 2 is nil (JSON reads the list back cut there)")
    assert.is_nil(ckpt.json_error({a = {n = "x"}, b = {n = 3, m = 1}, c = {n = 0.5}}, "state"))   -- objects
    has(errmsg(ckpt.save, root, 1, {model = st.model, bogus = 1}), "unknown field 'bogus'")
    has(errmsg(ckpt.save, root, 1, st, {keep = 0}), "keep: expected a positive integer")
    has(errmsg(ckpt.save, root, 1, st, {kep = 1}), "unknown option 'kep'")
    has(errmsg(ckpt.load, root .. "/none"), "moelua.ckpt.load: '" .. root .. "/none' does not exist")
    fs.mkdir_p(root .. "/empty")
    support.write_file(root .. "/empty/file", "x")
    has(errmsg(ckpt.load, root .. "/empty/file"), "moelua.ckpt.load: '" .. root .. "/empty/file' is not a directory")
    os.remove(root .. "/empty/file")
    has(errmsg(ckpt.load, root .. "/empty"), "has neither model.safetensors nor")
    assert.is_nil(errmsg(ckpt.load, root .. "/empty"):find("a run directory?", 1, true))
    assert.is_nil(ckpt.latest(root .. "/empty"))
    fs.mkdir_p(root .. "/run/ckpt")   -- a run directory given for its ckpt root: pointed there
    has(errmsg(ckpt.load, root .. "/run"), "model.safetensors.index.json (a run directory? its checkpoints are in '" ..
                                           root .. "/run/ckpt')")
  end)
end)
