-- recipes/eval.lua, --init-from (model:load_named) and the per-phase profile
-- in metrics.jsonl. One tiny training run (recipes/tiny.lua in a child host)
-- makes the checkpoint every test reads.
local m = require "moelua"
local nn = require "moelua.nn"
local ckpt = require "moelua.ckpt"
local train = require "moelua.train"
local json = require "dkjson"
local support = require "tests.support"

local SEQ = 32
local NWIN = 5
-- recipes/tiny.lua's model (recipes/longctx.lua's options with tiny's defaults)
local TINY = {vocab = 256, dim = 32, layers = 2, heads = 4, kv_heads = 2, ffn = 64, experts = 4, topk = 2}

local function sh(args)
  local p = assert(io.popen(support.host_command(args) .. " 2>&1", "r"))
  return support.finish_child(p)
end

local function tiny_run(run_dir, extra)
  local args = {"recipes/tiny.lua", "--steps", "3", "--seq-len", tostring(SEQ), "--warmup", "1",
                "--data", "/usr/include/std*.h", "--threads", tostring(m.threads()),
                "--run-dir", run_dir, "--ckpt-every", "1", "--keep", "1"}
  for _, a in ipairs(extra or {}) do args[#args + 1] = a end
  local code, out = sh(args)
  assert(code == 0, out)
  return out
end

-- Parent and child compare at a tolerance a different summation order would
-- meet (f32 sums): a wrong definition misses it by orders of magnitude.
local XTOL = 1e-6

local function eval_json(dir, file, extra)
  local args = {"recipes/eval.lua", "--ckpt", dir, "--data", file, "--seq-len", tostring(SEQ), "--json",
                "--threads", tostring(m.threads())}
  for _, a in ipairs(extra or {}) do args[#args + 1] = a end
  local code, out = sh(args)
  assert(code == 0, out)
  local obj = json.decode(out)
  assert(type(obj) == "table", "eval printed no JSON object: " .. out)
  return obj
end

-- The windows of `file` as i64 tensors, read here with io (not moelua.data).
local function windows(file)
  local s = assert(support.read_file(file))
  local out = {}
  for i = 1, #s // (SEQ + 1) do
    local bytes = {s:byte((i - 1) * (SEQ + 1) + 1, i * (SEQ + 1))}
    out[i] = m.tensor(bytes, {dtype = "i64"})
  end
  return out
end

-- A model with the checkpoint's weights, copied here without load_named.
local function hand_model(dir)
  local c = ckpt.load(dir)
  local model = nn.Transformer.new(TINY)
  for _, p in ipairs(model:named_parameters()) do c.model[p.name]:read_into(p.tensor) end
  return model
end

local function max_diff(a, b)
  local d = a:sub(b):abs()
  local v = d:max():item()
  d:free()
  return v
end

local function close(x, ref, tol, what) support.assert_close({x}, {ref}, tol, what) end

-- The checkpoint's tensors, read (CPU, f32).
local function params_of(dir)
  local out = {}
  for name, src in pairs(ckpt.load(dir).model) do out[name] = src:read() end
  return out
end

describe("eval, init-from and the profile", function()
  local root, base, file, evaluated
  -- eval's JSON with --grad-norms (one child run shared by two tests)
  local function result()
    evaluated = evaluated or eval_json(base .. "/ckpt", file, {"--grad-norms"})
    return evaluated
  end

  setup(function()
    root = support.make_tmpdir()
    base = root .. "/base"
    tiny_run(base)
    -- NWIN full windows and a partial one (left out)
    local text = assert(support.read_file("/usr/include/stdio.h"))
    file = root .. "/text.txt"
    support.write_file(file, text:sub(1, NWIN * (SEQ + 1) + 7))
  end)
  teardown(function() support.remove_dir(root) end)

  it("eval's loss, aux_loss and z_loss are the model's over the file's windows", function()
    local r = result()
    assert.are.equal(NWIN * SEQ, r.tokens)
    assert.are.equal(NWIN, r.windows)
    local model = hand_model(base .. "/ckpt")
    local E, L = TINY.experts, TINY.layers
    local C, P = m.zeros({E}, {dtype = "f64"}), m.zeros({E}, {dtype = "f64"})
    local loss, z, N = 0, 0, 0
    for i, w in ipairs(windows(file)) do
      local l, st = model:forward(w, 0)
      loss = loss + l / NWIN
      assert.are.equal(L, #st.layers)
      local lz, lN = 0, 0
      for _, ls in ipairs(st.layers) do
        C:add_(ls.counts:to("f64")); P:add_(ls.psum)
        z, N = z + ls.z * ls.tokens, N + ls.tokens
        lz, lN = lz + ls.z * ls.tokens, lN + ls.tokens
      end
      if i == 1 then   -- one window: the model's own aux and z (moe.aux_loss) are these definitions
        local c1 = m.zeros({E}, {dtype = "f64"})
        local p1 = m.zeros({E}, {dtype = "f64"})
        for _, ls in ipairs(st.layers) do c1:add_(ls.counts:to("f64")); p1:add_(ls.psum) end
        close(st.aux, E * c1:mul(p1):sum():item() / (lN * lN), 1e-12, "aux, one window")
        close(st.z, lz / lN, 1e-12, "z, one window")
        -- C_e counts top-k assignments: they sum to layers x tokens x k
        assert.are.equal(L * SEQ * TINY.topk, math.tointeger(c1:sum():item()))
      end
    end
    close(r.loss, loss, XTOL, "loss")
    close(r.aux_loss, E * C:mul(P):sum():item() / (N * N), XTOL, "aux_loss")
    close(r.z_loss, z / N, XTOL, "z_loss")
  end)

  it("without --json prints a short summary; a too-short file is a clear error", function()
    local code, out = sh{"recipes/eval.lua", "--ckpt", base .. "/ckpt", "--data", file, "--seq-len", tostring(SEQ)}
    assert.are.equal(0, code, out)
    support.has(out, NWIN .. " windows of " .. (SEQ + 1) .. " tokens")
    assert.is_truthy(out:match("loss %d+%.%d+"), out)
    assert.is_truthy(out:match("aux_loss %d+%.%d+"), out)
    -- a full disk under stdout: an error, not a silent exit 0
    local p = assert(io.popen(support.host_command{"recipes/eval.lua", "--ckpt", base .. "/ckpt", "--data", file,
                                                    "--seq-len", tostring(SEQ), "--json"} .. " 2>&1 >/dev/full"))
    code, out = support.finish_child(p)
    assert.are.equal(1, code, out)
    support.has(out, "recipes/eval.lua: writing the result: No space left on device")
    code, out = sh{"recipes/eval.lua", "--ckpt", base .. "/ckpt", "--data", file, "--seq-len", "100000"}
    assert.are_not.equal(0, code)
    support.has(out, "fewer than one window of 100001")
    assert.is_nil(out:find("traceback", 1, true), out)
    code, out = sh{"recipes/eval.lua", "--data", file}
    assert.are.equal(1, code, out)
    support.has(out, "recipes/eval.lua: --ckpt DIR is required")
    assert.is_nil(out:find("traceback", 1, true), out)
    -- a token file for a larger vocabulary: the text's byte pairs read as u16 ids
    code, out = sh{"recipes/eval.lua", "--ckpt", base .. "/ckpt", "--data", file, "--seq-len", "8", "--format", "u16"}
    assert.are.equal(1, code, out)
    support.has(out, "recipes/eval.lua: --data '" .. file .. "' (--format u16) holds token id ")
    support.has(out, ", outside the checkpoint's vocabulary of 256")
    assert.is_nil(out:find("traceback", 1, true), out)
  end)

  it("a Mixtral directory with a missing or wrong config.json: one line naming the file's key", function()
    local fs = require "moelua.fs"
    local cfg = json.decode(support.read_file(base .. "/ckpt/step-000002/config.json"))
    local weights = base .. "/ckpt/step-000002/model.safetensors"
    for i, c in ipairs{
      {nil, "moelua.nn.Transformer.from_checkpoint: " .. root .. "/hf1 has no config.json"},
      {{num_local_experts = json.null}, "from_config: config.json: 'num_local_experts' is missing"},
      {{hidden_act = "gelu"}, "from_config: config.json: hidden_act 'gelu' is not supported (silu only)"},
      {{hidden_size = "32"}, "config.json: 'hidden_size' must be an integer in [1, 2147483647], got \"32\" (a string)"},
      {{num_local_experts = 4000000000000},
       "config.json: 'num_local_experts' must be an integer in [1, 2147483647], got 4000000000000"},
      {{num_attention_heads = 3}, "option 'kv_heads' = 2 must divide heads = 3 (config.json's num_key_value_heads)"},
    } do
      local dir = root .. "/hf" .. i
      assert(os.execute("mkdir -p " .. support.shell_quote(dir)))
      support.write_file(dir .. "/model.safetensors", support.read_file(weights))
      if c[1] then
        local mod = {}
        for k, v in pairs(cfg) do mod[k] = v end
        for k, v in pairs(c[1]) do mod[k] = v ~= json.null and v or nil end
        support.write_file(dir .. "/config.json", json.encode(mod))
      end
      local code, out = sh{"recipes/eval.lua", "--ckpt", dir, "--data", file, "--seq-len", tostring(SEQ)}
      assert.are.equal(1, code, out)
      support.has(out, c[2])
      assert.is_nil(out:find("traceback", 1, true), out)
      assert.is_not_nil(fs.stat(dir .. "/model.safetensors"))
    end
  end)

  it("--grad-norms: HF names, the norms of the mean CE's gradient", function()
    local r = result()
    local model = hand_model(base .. "/ckpt")
    local ws = windows(file)
    model:zero_grad()
    for _, w in ipairs(ws) do
      model:forward(w, 0)
      model:backward{ce_weight = 1 / #ws, aux_weight = 0, z_weight = 0}
    end
    local names, n = {}, 0
    for _, g in ipairs(model:named_gradients()) do
      names[g.name] = true
      n = n + 1
      local ref = math.sqrt(g.tensor:to("f64"):mul(g.tensor:to("f64")):sum():item())
      assert.is_number(r.grad_norms[g.name], "no norm for " .. g.name)
      close(r.grad_norms[g.name], ref, XTOL, g.name)
    end
    for k in pairs(r.grad_norms) do assert.is_true(names[k], "unexpected key " .. k) end
    assert.is_true(names["model.layers.1.block_sparse_moe.experts.3.w2.weight"])
    assert.is_true(names["lm_head.weight"])
    assert.are.equal(2 + TINY.layers * (7 + 3 * TINY.experts) + 1, n)
    assert.is_true(r.grad_norms["lm_head.weight"] > 0)
  end)

  it("--init-from starts a run from a checkpoint's weights", function()
    local run = root .. "/fine"
    local said = tiny_run(run, {"--init-from", base .. "/ckpt", "--lr", "0", "--steps", "1", "--seed", "7"})
    assert.is_nil(said:find("has no config.json", 1, true), said)
    local a, b = params_of(base .. "/ckpt"), params_of(run .. "/ckpt")
    local n = 0
    for name, t in pairs(a) do
      assert.are.equal(0, max_diff(t, b[name]), name)
      n = n + 1
    end
    assert.are.equal(2 + TINY.layers * (7 + 3 * TINY.experts) + 1, n)
    local saw = false
    for line in io.lines(run .. "/metrics.jsonl") do
      if json.decode(line).event == "init_from" then saw = true end
    end
    assert.is_true(saw, "no init_from event in metrics.jsonl")
    -- weights without config.json: loaded, saying what could not be checked
    local bare = root .. "/bare"
    os.execute("mkdir -p " .. support.shell_quote(bare))
    m.save(bare .. "/model.safetensors", a)
    local out = tiny_run(root .. "/fine2", {"--init-from", bare, "--lr", "0", "--steps", "1", "--seed", "7"})
    support.has(out, "moelua.train: warning: " .. bare .. " has no config.json: its weights' names, shapes and " ..
                     "dtypes were checked, not the math they were trained with (rope_theta, rms_norm_eps, ...)")
  end)

  it("--init-from names a missing, unexpected or mismatched tensor and changes nothing", function()
    local src = params_of(base .. "/ckpt")
    local model = nn.Transformer.new(TINY)
    local before = model:named_parameters()[1].tensor:clone()
    local function case(edit, want)
      local dir = root .. "/bad"
      support.remove_dir(dir)
      os.execute("mkdir -p " .. support.shell_quote(dir))
      local t = {}
      for k, v in pairs(src) do t[k] = v end
      edit(t)
      m.save(dir .. "/model.safetensors", t)
      local msg = support.errmsg(train.init_from, model, dir)
      assert.is_truthy(msg, "no error for " .. want)
      support.has(msg, want)
      assert.are.equal(0, max_diff(before, model:named_parameters()[1].tensor))
    end
    local w1 = "model.layers.1.block_sparse_moe.experts.2.w1.weight"
    case(function(t) t[w1] = nil end, "missing tensor '" .. w1 .. "' (shape [64, 32])")
    case(function(t) t["model.layers.2.input_layernorm.weight"] = m.ones({32}) end,
         "unexpected tensor 'model.layers.2.input_layernorm.weight'")
    case(function(t) t["model.layers.0.self_attn.k_proj.weight"] = m.zeros({32, 32}) end,
         "'model.layers.0.self_attn.k_proj.weight' has shape [32, 32], the model expects [16, 32]")
    case(function(t) t["model.norm.weight"] = m.zeros({32}, {dtype = "i32"}) end,
         "'model.norm.weight' has dtype I32")
    -- a config.json of another shape is named too
    local dir = root .. "/cfg"
    os.execute("mkdir -p " .. support.shell_quote(dir))
    m.save(dir .. "/model.safetensors", src)
    support.write_file(dir .. "/config.json", '{"hidden_size": 48, "num_local_experts": 4}')
    local msg = support.errmsg(train.init_from, model, dir)
    support.has(msg, "config.json has hidden_size = 48, the model has 32")
    -- and one of the same shapes whose math differs
    support.write_file(dir .. "/config.json", '{"hidden_size": 32, "rope_theta": 10000.0, "rms_norm_eps": 1e-6}')
    msg = support.errmsg(train.init_from, model, dir)
    support.has(msg, "config.json has rope_theta = 10000.0, the model has 1000000.0 (the same shapes, other math)")
    support.has(msg, "config.json has rms_norm_eps = 1e-06, the model has 1e-05")
    assert.are.equal(0, max_diff(before, model:named_parameters()[1].tensor))
  end)

  it("--init-from loads BF16 and sharded checkpoints", function()
    local src = params_of(base .. "/ckpt")
    local dir = root .. "/bf16"
    os.execute("mkdir -p " .. support.shell_quote(dir))
    local a, b, map, i = {}, {}, {}, 0
    for k, v in pairs(src) do   -- two shards
      i = i + 1
      local half = i % 2 == 0 and a or b
      half[k] = v:to("bf16")
      map[k] = i % 2 == 0 and "model-00001-of-00002.safetensors" or "model-00002-of-00002.safetensors"
    end
    m.save(dir .. "/model-00001-of-00002.safetensors", a)
    m.save(dir .. "/model-00002-of-00002.safetensors", b)
    support.write_file(dir .. "/model.safetensors.index.json", json.encode({metadata = {}, weight_map = map}))
    local model = nn.Transformer.new(TINY)
    train.init_from(model, dir)
    for _, p in ipairs(model:named_parameters()) do
      local want = src[p.name]:to("bf16"):to("f32")
      assert.are.equal(0, max_diff(p.tensor, want), p.name)
    end
  end)

  it("metrics carry a per-phase profile that fits in the step", function()
    local n, steps, saved = 0, {}, {}
    for line in io.lines(base .. "/metrics.jsonl") do
      local r = json.decode(line)
      if r.event == "checkpoint" then
        saved[r.step] = r.seconds
      elseif not r.event then
        n = n + 1
        steps[n] = r.step
        local ph = r.phases
        local inner = 0
        for _, k in ipairs{"attention", "router", "dispatch", "experts", "ce"} do
          assert.is_number(ph[k], "phases lack " .. k)
          assert.is_true(ph[k] >= 0, k)
          inner = inner + ph[k]
        end
        for _, k in ipairs{"data", "fwd", "bwd", "optim"} do
          assert.is_number(ph[k], "phases lack " .. k)
          assert.is_true(ph[k] >= 0, k)
        end
        assert.is_true(ph.attention > 0 and ph.experts > 0 and ph.ce > 0)
        assert.is_true(inner <= ph.fwd + ph.bwd, string.format("%g > fwd + bwd", inner))
        assert.is_true(inner + ph.data + ph.optim <= r.step_seconds + 1e-9)
        for _, k in ipairs{"attention", "experts", "ce"} do
          assert.is_true(r.gflops[k] > 0, "gflops." .. k)
        end
      end
    end
    assert.are.equal(3, n)
    for _, st in ipairs(steps) do   -- --ckpt-every 1: a save after every step, its time in its event
      assert.is_true(saved[st] > 0, "step " .. st .. "'s checkpoint event")
    end
  end)
end)
