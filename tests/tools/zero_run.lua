-- tests/tools/zero_run.lua: a tiny model trained under moelua.zero, for
-- tests/spec/zero_spec.lua (run by mpiexec -n N ./moelua). Options:
--   --corpus PATH --out DIR --stage 0..3 --accum A --steps K --optim adamw|sgd
--   --prefetch P --reduce-every micro|step --sparse --timeout S
--   --run-dir D --ckpt-every K --resume CKPT --bias-rate R --experts E --topk K
--   --dead-expert e (expert e never routed to: its router bias is -1e30)
--   --ep P (expert-parallel size) --adversarial (rank 0 routes every token
--   to expert 0, every other rank to the last expert: router biases +1e30)
--   --route-all e (every rank routes every token to expert e: bias +1e30)
--   --capacity-factor f (policy "drop"; writes "dropped <layer> <n>", this
--   rank's drops in the last forward)
--   --device cpu|cuda --dtype f32|bf16 (the model's; bf16 on cuda: mixed
--   precision, the saved parameters are its bf16 compute copy, widened)
--   --stop-rank R --stop-at TEXT (rank R stops itself, SIGSTOP, at the first
--   all-to-all whose label contains TEXT, after writing the wall clock to
--   DIR/stopped_at)
-- Writes DIR/rank<R>.txt: the losses of every step ("loss <step> %.17g"),
-- the ledger's bytes per category after the run and at its peak
-- ("cur <cat> <bytes>", "peak <cat> <bytes>"), the planned and measured
-- peaks ("plan total_peak <bytes>", "run total_peak <bytes>"), the unit
-- elements and shards ("unit <name> <numel> <shard>"); and
-- DIR/params.rank<R>.safetensors: every unit's whole parameters as this
-- rank sees them after the run, and the router biases ("bias.<layer>");
-- the experts that ran tokens on this rank in the last step
-- ("mask <layer> 0110...").
local nn = require "moelua.nn"
local optim = require "moelua.optim"
local data = require "moelua.data"
local train = require "moelua.train"
local options = require "moelua.options"
local dist = require "moelua.dist"
local zero = require "moelua.zero"
local tensor = require "moelua.tensor"
local mem = require "moelua.mem"
local mio = require "moelua.io"

local o = options.parse(arg, {
  {"corpus", ""}, {"out", ""}, {"stage", 0}, {"accum", 1}, {"steps", 5}, {"optim", "adamw"},
  {"prefetch", 1}, {"reduce-every", "micro"}, {"sparse", false}, {"timeout", 10.0},
  {"seq-len", 32}, {"lr", 1e-2}, {"run-dir", ""}, {"ckpt-every", 0}, {"resume", ""}, {"bias-rate", 0.0},
  {"experts", 4}, {"topk", 2}, {"dead-expert", -1}, {"ep", 1}, {"adversarial", false},
  {"stop-rank", -1}, {"stop-at", ""}, {"route-all", -1}, {"capacity-factor", 0.0},
  {"device", "cpu"}, {"dtype", "f32"},
})
dist.init{timeout = o.timeout}
require("moelua").threads(1)
local function build()
  local model = nn.Transformer.new{
    vocab = 256, dim = 16, layers = 2, heads = 2, kv_heads = 1, ffn = 24, experts = o.experts, topk = o.topk,
    seed = 3, checkpoint = "moe", device = o.device, dtype = o.dtype,
    moe = {bias_rate = (o.dead_expert >= 0 or o.adversarial or o.route_all >= 0) and 1e-3 or o.bias_rate,
           policy = o.capacity_factor > 0 and "drop" or "dropless", capacity_factor = o.capacity_factor},
    zero = zero.new{stage = o.stage, prefetch = o.prefetch, reduce_every = o.reduce_every, ep = o.ep},
  }
  local rank = dist.rank()
  for _, layer in ipairs(model:moe_layers()) do
    if o.dead_expert >= 0 then layer.bias:narrow(1, o.dead_expert + 1, 1):fill_(-1e30) end
    if o.adversarial then layer.bias:narrow(1, rank == 0 and 1 or o.experts, 1):fill_(1e30) end
    if o.route_all >= 0 then layer.bias:narrow(1, o.route_all + 1, 1):fill_(1e30) end
  end
  if rank == o.stop_rank then
    local z, exchange = model.zero, model.zero.all_to_all
    function z.all_to_all(self, send, sr, recv, rr, what)
      if not mem.planning() and what:find(o.stop_at, 1, true) then
        os.execute("date +%s.%N > " .. o.out .. "/stopped_at")
        os.execute("kill -STOP " .. io.open("/proc/self/stat"):read("n"))
      end
      return exchange(self, send, sr, recv, rr, what)
    end
  end
  local groups = model:param_groups{weight_decay = 0.1, sparse = o.sparse}
  local opt = o.optim == "sgd" and optim.SGD(groups, {lr = o.lr, momentum = 0.9})
    or optim.AdamW(groups, {lr = o.lr, weight_decay = 0.1})
  return model, opt, groups
end
local ds = data.open{glob = o.corpus, seq_len = o.seq_len, seed = 1, holdout = 0}
local cfg = {build = build, data = ds, seq_len = o.seq_len, steps = o.steps, accum = o.accum, clip = 1.0,
             lr = function() return o.lr end, log_every = 1000, run_dir = o.run_dir ~= "" and o.run_dir or nil,
             ckpt_every = o.ckpt_every, keep = 10, resume = o.resume}
local plan = train.plan(cfg)      -- this rank's memory, planned
cfg.model, cfg.optimizer, cfg.groups = build()
cfg.plan = plan
local model = cfg.model
local result = train.run(cfg)

local rank = dist.rank()
local lines = {}
for s = 0, o.steps - 1 do
  if result.losses[s] then lines[#lines + 1] = string.format("loss %d %.17g", s, result.losses[s]) end
end
local st = mem.stats()[o.device]
lines[#lines + 1] = string.format("plan total_peak %d", plan.total_peak)
lines[#lines + 1] = string.format("run total_peak %d", st.total_peak)
for k, v in pairs(st.current) do lines[#lines + 1] = string.format("cur %s %d", k, v) end
for k, v in pairs(st.peak) do lines[#lines + 1] = string.format("peak %s %d", k, v) end
local whole = {}
for _, u in ipairs(model.units) do
  lines[#lines + 1] = string.format("unit %s %d %d", u.name, u.numel, u.part.shard)
  local t = tensor.zeros({u.part.padded}, {dtype = o.dtype, device = o.device})
  if not u.shard_params then t:copy_(u.params)
  elseif u.world == 1 then t:copy_(u.shard_params)
  else u.group:all_gather(u.shard_params, t, "test " .. u.name) end
  whole[u.name] = t:view_at(0, {u.numel}):to({device = "cpu", dtype = zero.grad_dtype(o.dtype)})   -- (bf16: widened)
end
for i, layer in ipairs(model:moe_layers()) do
  if layer.bias then whole["bias." .. i] = layer.bias:to("cpu") end
  if model.layer_stats[i] then   -- (a resume that took no step ran no forward)
    local ran = {}
    for e, x in ipairs(model:active_experts(i):totable()) do ran[e] = x > 0 and "1" or "0" end
    lines[#lines + 1] = string.format("mask %d %s", i, table.concat(ran))
    lines[#lines + 1] = string.format("dropped %d %d", i, layer.stats.dropped)
  end
end
mio.save(string.format("%s/params.rank%d.safetensors", o.out, rank), whole)
local f = assert(io.open(string.format("%s/rank%d.txt", o.out, rank), "w"))
f:write(table.concat(lines, "\n"), "\n")
f:close()
