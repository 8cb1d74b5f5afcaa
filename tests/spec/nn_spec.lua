-- The model (lua/moelua/nn): each module's gradient by finite differences in
-- f64, the whole tiny model's gradient (every unit, each loss term with
-- weight 1), checkpoint modes giving bitwise-equal gradients,
-- named_parameters as views, config keys, param_groups, overfitting a
-- repeated sequence with plain SGD, and bad options failing before any
-- allocation.
local m = require "moelua"
local nn = require "moelua.nn"
local mem = require "moelua.mem"
local optim = require "moelua.optim"
local support = require "tests.support"

local gen = support.generator(700, "f64")

local function get(t, i) return t:view({t:numel()}):view_at(i, {1}):item() end
local function set(t, i, v) t:view({t:numel()}):view_at(i, {1}):fill_(v) end

-- Central differences of f() at n coordinates of t (spread over it) against
-- the analytic gradient g; asserts the normwise relative error <= tol.
local function fd_check(what, f, t, g, n, tol, h)
  h, n = h or 1e-5, math.min(n or 8, t:numel())
  local num, ana = {}, {}
  local N = t:numel()
  for j = 1, n do
    local i = ((j - 1) * 7919 + 13) % N
    local v = get(t, i)
    set(t, i, v + h); local fp = f()
    set(t, i, v - h); local fm = f()
    set(t, i, v)
    num[j], ana[j] = (fp - fm) / (2 * h), get(g, i)
  end
  support.assert_close(num, ana, tol or 1e-6, what)
end

local function dot(a, b) return a:mul(b):sum():item() end

local TINY = {vocab = 24, dim = 16, layers = 2, heads = 4, kv_heads = 2, ffn = 12, experts = 4,
              topk = 2, init_std = 0.3, seed = 5, dtype = "f64"}
local function tiny(extra)
  local o = {}
  for k, v in pairs(TINY) do o[k] = v end
  for k, v in pairs(extra or {}) do o[k] = v end
  return nn.Transformer.new(o)
end
local TOKENS = {3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4}
local function tokens() return m.tensor(TOKENS):to("i64") end

describe("nn modules (f64 finite differences)", function()
  it("RMSNorm: dx and dw", function()
    local x, w, dw = gen.randn({5, 8}), gen.randn({8}), m.zeros({8}, {dtype = "f64"})
    local R = gen.randn({5, 8})
    local n = nn.RMSNorm.new{weight = w, grad = dw, eps = 1e-5}
    local f = function() return dot(n:forward(x), R) end
    local y, r = n:forward(x)
    local dx = n:backward(R, x, r)
    fd_check("rmsnorm dx", f, x, dx, 12)
    fd_check("rmsnorm dw", f, w, dw, 8)
  end)

  it("Embedding: dW", function()
    local W, dW = gen.randn({10, 6}), m.zeros({10, 6}, {dtype = "f64"})
    local ids = m.tensor({1, 3, 3, 9, 0}):to("i64")
    local R = gen.randn({5, 6})
    local e = nn.Embedding.new{weight = W, grad = dW}
    e:backward(R, ids)
    fd_check("embedding dW", function() return dot(e:forward(ids), R) end, W, dW, 20)
  end)

  it("LMHead: dh and dW (chunked CE)", function()
    local h, W, dW = gen.randn({6, 8}), gen.randn({11, 8}), m.zeros({11, 8}, {dtype = "f64"})
    local tg = m.tensor({1, 10, 0, 4, 4, 7}):to("i64")
    local head = nn.LMHead.new{weight = W, grad = dW, rows = 4, chunk = 5}
    local _, lse = head:forward(h, tg)
    local dh = head:backward(h, tg, lse)
    local f = function() return (head:forward(h, tg)) end
    fd_check("lm_head dh", f, h, dh, 16)
    fd_check("lm_head dW", f, W, dW, 20)
  end)

  it("Attention (GQA, RoPE): dx and every projection", function()
    local S, D, H, KV, hd = 7, 8, 4, 2, 4
    local p = {q = gen.randn({H * hd, D}, nil, 0.5), k = gen.randn({KV * hd, D}, nil, 0.5),
               v = gen.randn({KV * hd, D}, nil, 0.5), o = gen.randn({D, H * hd}, nil, 0.5)}
    local g = {}
    for k, t in pairs(p) do g[k] = m.zeros(t:shape(), {dtype = "f64"}) end
    local pool = m.pool.new(1 << 16, {grow = true})
    local att = nn.Attention.new{dim = D, heads = H, kv_heads = KV, head_dim = hd, theta = 100,
                                 params = p, grads = g, pool = pool}
    local x, R = gen.randn({S, D}), gen.randn({S, D})
    local f = function()
      local mk = pool:mark()
      local y, c = att:forward(x)
      local v = dot(y, R)
      att:release(c); pool:rewind(mk)
      return v
    end
    local y, c = att:forward(x)
    local dx = att:backward(R, c):clone()
    att:release(c); pool:reset()
    fd_check("attention dx", f, x, dx, 16)
    for _, k in ipairs{"q", "k", "v", "o"} do fd_check("attention d" .. k, f, p[k], g[k], 12) end
  end)

  it("MoEBlock on views: dx and the router, gate_up, down views", function()
    local D, F, E = 8, 6, 4
    local function mk(shape) return gen.randn(shape, nil, 0.5) end
    local p = {wg = mk({E, D}), gate_up = mk({E, 2 * F, D}), down = mk({E, D, F})}
    local g = {}
    for k, t in pairs(p) do g[k] = m.zeros(t:shape(), {dtype = "f64"}) end
    local pool = m.pool.new(1 << 16, {grow = true})
    local b = nn.MoEBlock.new({dim = D, ffn = F, experts = E, topk = 2, dtype = "f64"},
                              {params = p, grads = g, pool = pool})
    local x, R = gen.randn({9, D}), gen.randn({9, D})
    local f = function()
      pool:reset()
      return dot(b:forward(x, 0), R)
    end
    f()
    local dx = b:backward(R):clone()
    fd_check("moe dx", f, x, dx, 16)
    for _, k in ipairs{"wg", "gate_up", "down"} do fd_check("moe d" .. k, f, p[k], g[k], 16) end
  end)
end)

describe("nn.Transformer", function()
  it("gradient of every unit for ce, aux and z separately (f64 finite differences)", function()
    local model = tiny()
    local toks = tokens()
    local _, s0 = model:forward(toks, 0)
    local counts0 = {}
    for i, l in ipairs(s0.layers) do counts0[i] = support.values(l.counts) end
    for _, term in ipairs{"ce", "aux", "z"} do
      local w = {aux_weight = term == "aux" and 1 or 0, z_weight = term == "z" and 1 or 0,
                 ce_weight = term == "ce" and 1 or 0}
      local f = function()
        local _, s = model:forward(toks, 0)
        for i, l in ipairs(s.layers) do    -- routing must not flip under the perturbation
          assert.are.same(counts0[i], support.values(l.counts))
        end
        return s[term]
      end
      model:zero_grad()
      model:forward(toks, 0)
      model:backward(w)
      for _, u in ipairs(model.units) do
        local g = u.grads:clone()
        if term == "ce" or u.kind ~= "final" then   -- aux and z do not reach the head
          fd_check(term .. " " .. u.name, f, u.params, g, 10, 1e-6)
        else
          assert.are.equal(0, g:abs():max():item())
        end
      end
    end
  end)

  it("checkpoint modes: bitwise-identical gradients, the experts run once (f32, gate noise, save or recompute)", function()
    local grads, losses
    for _, c in ipairs{{"none"}, {"attention"}, {"moe"}, {"full"}, {{"full", "none"}}, {"moe", "recompute"},
                       {"full", "recompute"}} do
      local model = tiny{dtype = "f32", checkpoint = c[1], moe = {noise = 0.3, save = c[2]}}
      local loss = model:forward(tokens(), 3)
      model:backward{aux_weight = 0.1, z_weight = 0.01}
      -- a checkpointed MoE half routes again in backward but runs no expert GEMM
      assert.are.equal(18 * TINY.dim * TINY.ffn * (#TOKENS - 1) * TINY.topk * TINY.layers,
                       model.profile.experts_flop, tostring(c[1]))
      if not grads then
        grads, losses = {}, loss
        for i, u in ipairs(model.units) do grads[i] = u.grads:clone() end
      else
        assert.are.equal(losses, loss)
        for i, u in ipairs(model.units) do
          assert.are.equal(0, u.grads:sub(grads[i]):abs():max():item(), u.name)
        end
      end
    end
  end)

  it("a checkpointed MoE half keeps no pre-activations: save and recompute plan the same peak", function()
    local long = {}
    for i = 1, 257 do long[i] = TOKENS[(i - 1) % #TOKENS + 1] end
    local ids = m.tensor(long):to("i64")
    local function peak(ck, save)
      return mem.plan(function()
        local model = tiny{dtype = "f32", ffn = 256, checkpoint = ck, moe = {save = save}}   -- h [512, 512] f32: 1 MiB
        model:forward(ids, 1)
        model:backward{aux_weight = 0.1, z_weight = 0.01}
      end).cpu.total_peak
    end
    for _, ck in ipairs{"moe", "full"} do assert.are.equal(peak(ck, "recompute"), peak(ck, "save"), ck) end
  end)

  it("forward and backward leave no [S, *] tensor to the collector (the trainer holds it through a step)", function()
    local long = {}
    for i = 1, 513 do long[i] = TOKENS[(i - 1) % #TOKENS + 1] end
    local ids = m.tensor(long):to("i64")
    for _, ck in ipairs{"none", "full"} do
      local model = tiny{dtype = "f32", checkpoint = ck}
      collectgarbage(); collectgarbage("stop")
      model:forward(ids, 1)
      model:backward{aux_weight = 0.1, z_weight = 0.01}
      local held = mem.stats().cpu.total
      collectgarbage(); collectgarbage("restart")
      -- what the collector frees: the aux loss's [E] temporaries only (an [S, D] f32 tensor is 32 KiB)
      local garbage = held - mem.stats().cpu.total
      assert.is_true(garbage < 1024, ck .. ": " .. garbage .. " bytes")
    end
  end)

  it("named_parameters are HF-named views that partition the units", function()
    local model = tiny{dtype = "f32"}
    local np = model:named_parameters()
    assert.are.equal(1 + 2 * (6 + 1 + 3 * 4) + 2, #np)
    assert.are.equal("model.embed_tokens.weight", np[1].name)
    assert.are.equal("lm_head.weight", np[#np].name)
    local byname = {}
    for _, e in ipairs(np) do byname[e.name] = e.tensor end
    for _, u in ipairs(model.units) do u.params:zero_() end
    for _, e in ipairs(np) do e.tensor:add_(1) end
    for _, u in ipairs(model.units) do            -- each element in exactly one named view
      assert.are.equal(1, u.params:min():item(), u.name)
      assert.are.equal(1, u.params:max():item(), u.name)
    end
    -- write through a name, read through the unit: w3 of expert 2, layer 1 = gate_up[2] rows F..2F-1
    local F, D = TINY.ffn, TINY.dim
    byname["model.layers.1.block_sparse_moe.experts.2.w3.weight"]:fill_(7)
    assert.are.same({F, D}, byname["model.layers.1.block_sparse_moe.experts.2.w3.weight"]:shape())
    local ux = model.units[5]
    assert.are.equal("layers.1.experts", ux.name)
    assert.are.equal(7 * F * D, ux.params:view_at((2 * 2 * F + F) * D, {F * D}):sum():item())
    byname["model.layers.0.self_attn.k_proj.weight"]:fill_(3)
    assert.are.same({2 * 4, D}, byname["model.layers.0.self_attn.k_proj.weight"]:shape())
    assert.are.equal(3, model.units[2].params:view_at(4 * 4 * D, {1}):item())
    byname["model.norm.weight"]:fill_(5)
    assert.are.equal(5 * D, model.units[6].params:view_at(TINY.vocab * D, {D}):sum():item())
  end)

  it("config has MixtralConfig keys", function()
    local c = tiny{dtype = "f32"}:config()
    assert.are.equal("mixtral", c.model_type)
    assert.are.same({"MixtralForCausalLM"}, c.architectures)
    local want = {vocab_size = 24, hidden_size = 16, intermediate_size = 12, num_hidden_layers = 2,
                  num_attention_heads = 4, num_key_value_heads = 2, head_dim = 4,
                  num_local_experts = 4, num_experts_per_tok = 2, rms_norm_eps = 1e-5,
                  tie_word_embeddings = false, torch_dtype = "float32"}
    for k, v in pairs(want) do assert.are.equal(v, c[k], k) end
    for _, k in ipairs{"rope_theta", "router_aux_loss_coef", "max_position_embeddings"} do
      assert.is_number(c[k], k)
    end
  end)

  it("param_groups: no decay on norms and embeddings, router lr, freezing, expert slices", function()
    local model = tiny{dtype = "f32"}
    local groups = model:param_groups{weight_decay = 0.1, router_lr_mult = 0.5, sparse = true,
                                      freeze = {attention = true}}
    local by = {}
    local n = 0
    for _, g in ipairs(groups) do by[g.name] = g; n = n + g.params:numel() end
    local total = 0
    for _, u in ipairs(model.units) do total = total + u.params:numel() end
    assert.are.equal(total, n)
    assert.are.equal(0, by.embed.weight_decay)
    assert.are.equal(0, by["layers.0.norms"].weight_decay)
    assert.are.equal(0, by.norm.weight_decay)
    assert.are.equal(0.1, by.lm_head.weight_decay)
    assert.are.equal(0.5, by["layers.1.router"].lr_mult)
    assert.is_true(by["layers.0.attention"].frozen)
    assert.are.equal(4, by["layers.1.experts.gate_up"].experts)
    assert.are.equal(4, by["layers.1.experts.down"].experts)
    model:forward(tokens(), 0)
    model:backward{}
    local opt = optim.AdamW(groups, {lr = 1e-3})
    local before = model.units[2].params:clone()
    opt:step(1e-3, model:active_masks(groups))
    local qn = 4 * 4 * 16 * 2 + 2 * 4 * 16 * 2   -- attention q,k,v,o of layer 0 unchanged (frozen)
    assert.are.equal(0, model.units[2].params:view_at(0, {qn}):sub(before:view_at(0, {qn})):abs():max():item())
    assert.is_true(model.units[2].params:sub(before):abs():max():item() > 0)
    -- dense groups work with SGD
    optim.SGD(model:param_groups{}, {lr = 0.1}):step(0.1)
    assert.are.same({4}, model:active_experts(1):shape())
    -- an unknown or bad option is named, with the ones it takes
    support.has(support.errmsg(model.param_groups, model, {weight_decay = 0.1, foo = 1}),
                "moelua.nn.Transformer:param_groups: unknown option 'foo' (expected one of: freeze, offload, " ..
                "router_lr_mult, sparse, weight_decay)")
    support.has(support.errmsg(model.param_groups, model, {weight_decay = -1}),
                "moelua.nn.Transformer:param_groups: option 'weight_decay' must be a finite number >= 0, got -1")
    support.has(support.errmsg(model.param_groups, model, {freeze = {experts = 1}}),
                "moelua.nn.Transformer:param_groups: bad option 'freeze.experts'")
    -- the model's own methods name their own arguments
    support.has(support.errmsg(model.reinit_expert, model, 1, 9, 0, 0.01),
                "moelua.nn.Transformer:reinit_expert: argument #2 (dead): expected an expert id in 0..3, got 9")
    support.has(support.errmsg(model.flops, model, "x"),
                "moelua.nn.Transformer:flops: argument #1 (seq_len): expected an integer >= 1, got x")
  end)

  it("a tiny model overfits a repeated sequence with plain SGD", function()
    local model = tiny{dtype = "f32", vocab = 16, init_std = 0.1, seed = 1}
    local seq = {}
    for i = 1, 33 do seq[i] = (i * 5) % 16 end
    local toks = m.tensor(seq):to("i64")
    local first, loss
    for step = 1, 40 do
      model:zero_grad()
      loss = model:forward(toks, step)
      first = first or loss
      model:backward{aux_weight = 0.01}
      for _, u in ipairs(model.units) do u.params:sub_(u.grads:mul(0.5)) end
    end
    assert(first > 2.5, "initial loss " .. first)
    assert(loss < 0.5, string.format("loss %.3f after 40 steps (from %.3f)", loss, first))
  end)

  it("set_router changes the routing settings of every layer", function()
    local model = tiny{dtype = "f32"}
    model:set_router{temperature = 2, noise = 0.5, eps = 0.1}
    for _, b in ipairs(model.blocks) do
      assert.are.equal(2, b.moe.layer.router_opts.temperature)
      assert.are.equal(0.5, b.moe.layer.router_opts.noise)
    end
    support.raises("'capacity_factor'", model.set_router, model, {capacity_factor = 1.25})
    support.raises("'temp'", model.set_router, model, {temp = 1})
  end)

  it("steps leave the ledger where it was and the warmed-up pool does not grow", function()
    local model = tiny{dtype = "f32", checkpoint = {"attention", "moe"}}
    local toks = tokens()
    local function step(i)
      model:zero_grad(); model:forward(toks, i); model:backward{aux_weight = 0.01, z_weight = 0.001}
      collectgarbage(); collectgarbage()
      return mem.stats().cpu
    end
    step(1)
    local a = step(2)
    local b = step(3)
    assert.are.equal(a.allocs.pool, b.allocs.pool)
    for k, v in pairs(a.current) do assert.are.equal(v, b.current[k], k) end
    assert.are.equal(0, model.pool:stats().used)
  end)

  it("decode with a KV cache gives each position's logits and routing of a full forward", function()
    -- f64: the cached attention row is bitwise the square one's; the
    -- projections and experts run GEMMs of other shapes (normwise 1e-12).
    -- f32: 1e-5. A prefill of 5 tokens, then one token at a time.
    for _, c in ipairs({{"f64", 1e-12}, {"f32", 1e-5}}) do
      local model, N = tiny{dtype = c[1]}, #TOKENS
      local function full(p)   -- logits and routing at position p of tokens 1..p
        local ctx = {table.unpack(TOKENS, 1, p)}
        ctx[p + 1] = 0
        model:forward(m.tensor(ctx):to("i64"), 0)
        local lg, layers = model:last_logits(), {}
        for l, b in ipairs(model.blocks) do
          local row = b.moe.layer.ctx.idx:select(1, p):totable()
          for j = 1, #row do row[j] = math.tointeger(row[j]) end
          layers[l] = row
        end
        model:release()
        return lg, layers
      end
      local cache = model:kv_cache(N)
      local p = 5
      local route = {}
      local lg = model:decode(m.tensor({table.unpack(TOKENS, 1, p)}):to("i64"), cache, route)
      while true do
        assert.are.equal(p, cache.len)
        local ref, layers = full(p)
        support.assert_close(support.values(lg), support.values(ref), c[2], c[1] .. " logits at " .. p)
        assert.are.same(layers, route.layers, c[1] .. " routing at " .. p)
        if p == N then break end
        p = p + 1
        lg = model:decode(m.tensor({TOKENS[p]}):to("i64"), cache, route)
      end
      support.raises("20 positions cached and 1 new exceed the cache's 20", model.decode, model,
                     m.tensor({1}):to("i64"), cache)
      cache:reset()
      assert.are.equal(0, cache.len)
      cache:free()
    end
  end)

  it("flops: forward matmuls by hand, and what each checkpoint mode and recomputed pre-activations add", function()
    local S, D, V, L, H, KV, F, E, k = 10, TINY.dim, TINY.vocab, TINY.layers, TINY.heads, TINY.kv_heads, TINY.ffn,
        TINY.experts, TINY.topk
    local hd = D // H
    local attn = 2 * S * D * (2 * H * hd + 2 * KV * hd) + 2 * H * hd * S * (S + 1)
    local router, experts = 2 * S * D * E, 6 * S * k * D * F
    local pre = 4 * S * k * D * F   -- a checkpointed MoE half runs its router again, its experts not
    for _, c in ipairs({{"none", "save", 0}, {"none", "recompute", L * pre}, {"attention", "save", L * attn},
                        {"moe", "save", L * (router + pre)}, {"full", "recompute", L * (attn + router + pre)}}) do
      local f = tiny{checkpoint = c[1], moe = {save = c[2]}}:flops(S)
      assert.are.equal(2 * S * D * V + L * (attn + router + experts), f.forward, c[1])
      assert.are.equal(c[3], f.recompute, c[1] .. ", " .. c[2])
    end
  end)

  it("decode: bad arguments are errors naming them; the cache is booked under acts and freed", function()
    local model = tiny{dtype = "f32"}
    collectgarbage(); collectgarbage()
    local before = mem.stats().cpu.current
    local cache = model:kv_cache(8)
    local acts = mem.stats().cpu.current.acts - before.acts
    assert.are.equal(2 * TINY.layers * 8 * TINY.kv_heads * (TINY.dim // TINY.heads) * 4, acts)
    local fn = "moelua.nn.Transformer:decode: "
    support.raises(fn .. "ids must be an i64 tensor [n] with n >= 1", model.decode, model, m.tensor({1, 2}), cache)
    support.raises(fn .. "ids must be an i64 tensor [n] with n >= 1", model.decode, model,
                   m.zeros({0}, {dtype = "i64"}), cache)
    support.raises(fn .. "argument #2: expected this model's KV cache", model.decode, model,
                   m.tensor({1}):to("i64"), {len = 0})
    local other = tiny{dtype = "f32", layers = 1}:kv_cache(8)
    support.raises(fn .. "argument #2: expected this model's KV cache", model.decode, model,
                   m.tensor({1}):to("i64"), other)
    support.raises("moelua.nn.KVCache.new: option 'positions' must be an integer >= 1, got 0", model.kv_cache,
                   model, 0)
    model:decode(m.tensor({1, 2, 3}):to("i64"), cache)
    other:free(); cache:free()
    collectgarbage(); collectgarbage()
    for k, v in pairs(before) do assert.are.equal(v, mem.stats().cpu.current[k], k) end
  end)

  it("bad options fail with the option's name before any allocation", function()
    collectgarbage()
    local before = mem.stats().cpu.allocs
    local cases = {
      {{dim = 15}, "'heads'"}, {{kv_heads = 3}, "'kv_heads'"}, {{dtype = "bf16"}, "'dtype'"},
      {{checkpoint = "some"}, "option 'checkpoint' must be \"none\", \"attention\", \"moe\" or \"full\", got some"},
      {{checkpoint = {"none", "sum"}}, "option 'checkpoint'[2] must be"}, {{checkpoint = {"none"}}, "'checkpoint'"},
      {{moe = {polcy = "drop"}}, "'moe.polcy'"}, {{moe = {policy = "drop"}}, "capacity_factor"},
      {{topk = 9}, "'topk'"}, {{layers = "2"}, "'layers'"}, {{vocabulary = 3}, "'vocabulary'"},
      {{ffn = 0}, "'ffn'"}, {{moe = {save = "bogus"}}, "'save'"},
      -- a head_dim the model derived names what it came from (a recipe has no --head-dim)
      {{dim = 15, heads = 5, kv_heads = 1}, "option 'head_dim' = 3 (dim 15 / heads 5) must be even and in [2, 256]"},
      {{dim = 16, heads = 4, head_dim = 3}, "option 'head_dim' = 3 must be even and in [2, 256]"},
    }
    for _, c in ipairs(cases) do
      local msg = support.errmsg(tiny, c[1])
      support.has(msg, "moelua.nn.Transformer.new")
      support.has(msg, c[2])
    end
    local after = mem.stats().cpu.allocs
    for k, v in pairs(before) do assert.are.equal(v, after[k], k) end
  end)
end)
