-- recipes/generate.lua: text from a checkpoint, its experts optionally under a byte budget.
--
-- With --expert-budget the experts live in an expert store
-- (moelua.expert_store, inference: only the routed experts resident, least
-- recently used evicted, the routed layer's experts hinted ahead).
--
--   ./moelua recipes/generate.lua --ckpt runs/longctx/ckpt --prompt "int main" [--n 64]
--   ./moelua recipes/generate.lua --ckpt DIR --expert-budget 32MiB --prompt "..."
--
-- Prints the prompt and its continuation, then one line: bytes per second
-- and, with a budget, the store's hit rate and the bytes it read. Sampling
-- is moelua.inspect's generate (temperature, top-p, a seeded generator;
-- --greedy takes the most likely byte), so a budget changes no byte.
local moelua = require "moelua"
local options = require "moelua.options"
local inspect = require "moelua.inspect"
local errors = require "moelua.errors"
local now = require("moelua.bench").now

local opts = options.parse(arg, {
  {"ckpt", "", "checkpoint: a step directory, a ckpt root with `latest`, or a Mixtral directory"},
  {"prompt", "", "the text to continue"},
  {"n", 64, "bytes to generate", min = 1},
  {"temperature", 0.8, "sampling temperature (0: the most likely byte)", min = 0},
  {"top-p", 0.9, "nucleus sampling: the smallest set of bytes holding this much probability"},
  {"seed", 0, "the sampling generator's seed"},
  {"greedy", false, "always the most likely byte"},
  {"seq-len", 256, "context: the last this many bytes", min = 1},
  {"expert-budget", "", "keep at most this many bytes of experts resident, e.g. 32MiB (default: all)"},
  {"expert-store", "", "the store's backing file, on a disk (default: generate-<pid>.store here; removed at exit)"},
  {"expert-prefetch", 2, "experts the store hints ahead of use", min = 0},
  {"threads", 2, "CPU threads", min = 1},
}, "usage: moelua recipes/generate.lua --ckpt DIR --prompt TEXT [options]")
if opts.ckpt == "" then errors.user("recipes/generate.lua: --ckpt DIR is required") end
if opts.prompt == "" then errors.user("recipes/generate.lua: --prompt TEXT is required") end
moelua.threads(opts.threads)

local extra
if opts.expert_budget ~= "" then
  local pid = io.open("/proc/self/stat"):read("n")
  extra = {store = {budget = options.bytes("expert-budget", opts.expert_budget), prefetch = opts.expert_prefetch,
                    inference = true,
                    path = opts.expert_store ~= "" and opts.expert_store or string.format("generate-%d.store", pid)}}
end
local h = inspect.open(opts.ckpt, extra)
local es = h.model.expert_store
local before = es and es:stats()
local t0 = now()
local g = h:generate(opts.prompt, {n = opts.n, temperature = opts.temperature, top_p = opts.top_p, seed = opts.seed,
                                   greedy = opts.greedy or opts.temperature == 0, seq_len = opts.seq_len})
local seconds = now() - t0
print(g.text)
local line = string.format("%d bytes in %.2f s: %.1f bytes/s", opts.n, seconds, opts.n / seconds)
if es then
  local st = es:stats()
  local hits, misses = st.hits - before.hits, st.misses - before.misses
  line = line .. string.format("; experts: %d of %d resident (%.2f MiB), hit rate %.1f%% (%d hits, %d misses), " ..
                               "%.2f MiB read, %d prefetch hints", st.slots, st.slabs, st.slots * st.slab_bytes / 2^20,
                               100 * hits / math.max(hits + misses, 1), hits, misses,
                               (st.bytes_read - before.bytes_read) / 2^20, st.prefetches - before.prefetches)
  es:close()
end
print(line)
