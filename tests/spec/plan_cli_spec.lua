-- tests/spec/plan_cli_spec.lua - `moelua plan RECIPE [--max-seq | --fit]`
-- (moelua.plan_cli): the recipe's account book with nothing allocated, the
-- phase of its peak (mem.phase), a rank's book in a planned world, the
-- knobs that make a run fit, and the longest sequence that fits.
local mem = require "moelua.mem"
local m = require "moelua"
local fs = require "moelua.fs"
local support = require "tests.support"

local function host(args)
  local p = assert(io.popen(support.host_command(args) .. " 2>&1"))
  return support.finish_child(p)
end

describe("mem.phase", function()
  it("names the phase the total peaked in, on every book", function()
    collectgarbage()
    mem.reset_peak()
    mem.phase("a small phase")
    local a <close> = m.zeros({16})
    mem.phase("the big phase")
    local b <close> = m.zeros({1 << 16})
    mem.phase("after it")
    local st = mem.stats()
    assert.are.equal("the big phase", st.cpu.peak_phase)
    local books = mem.plan(function()
      mem.phase("planned peak")
      local c = m.zeros({1 << 20})
    end)
    assert.are.equal("planned peak", books.cpu.peak_phase)
    assert.has_error(function() mem.phase() end)
  end)
end)

describe("moelua plan", function()
  local dir
  setup(function() dir = support.make_tmpdir() end)
  teardown(function() support.remove_dir(dir) end)

  it("prints the recipe's planned book, the phase of its peak, and allocates and writes nothing", function()
    local run_dir = dir .. "/never"
    local code, out = host({"plan", "recipes/longctx.lua", "--seq-len", "2048", "--run-dir", run_dir,
                            "--expert-budget", "1MiB"})
    assert.are.equal(0, code, out)
    assert.is_not_nil(out:find("^moelua plan: recipes/longctx.lua %(cpu%): peak [%d.]+ MiB %(%d+ bytes%) of a " ..
                               "[%d.]+ GiB %(%d+ bytes%) budget, in backward, [%w ,]+\n"), out)
    for _, part in ipairs{"\n  cpu                peak        at peak   share\n", "\n  cache    ",
                          "\n  file               peak", "the step's stack pool is reserved at",
                          "outside the ledger (not planned)"} do
      support.has(out, part)
    end
    assert.is_nil(out:find("moelua longctx:", 1, true), "the run was not made: " .. out)
    assert.is_nil(fs.stat(run_dir), "nothing was written")
  end)

  it("plans a recipe whose run directory already holds a run (planning writes nothing there)", function()
    support.write_file(dir .. "/metrics.jsonl", "{}\n")
    local code, out = host({"plan", "recipes/tiny.lua", "--run-dir", dir})
    assert.are.equal(0, code, out)
    support.has(out, "moelua plan: recipes/tiny.lua (cpu): peak ")
    assert.are.equal("{}\n", support.read_file(dir .. "/metrics.jsonl"))
  end)

  it("--json: the same book as one JSON object, in bytes; with --world, one line per rank", function()
    local json = require "dkjson"
    local args = {"plan", "recipes/longctx.lua", "--seq-len", "512", "--expert-budget", "1MiB"}
    local code, text = host(args)
    assert.are.equal(0, code, text)
    table.insert(args, 3, "--json")
    local out
    code, out = host(args)
    assert.are.equal(0, code, out)
    local b = assert(json.decode(out), out)
    assert.are.equal("recipes/longctx.lua", b.recipe)
    assert.are.equal("cpu", b.device)
    -- the printed book's bytes, its categories adding up, and the file tier beside it
    assert.is_not_nil(text:find("peak [%d.]+ MiB %(" .. b.peak_bytes .. " bytes%)"), text)
    assert.are.equal(b.peak_bytes, b.books.cpu.total_peak)
    local sum = 0
    for _, v in pairs(b.books.cpu.at_peak) do sum = sum + v end
    assert.are.equal(b.peak_bytes, sum)
    assert.is_true(b.books.cpu.peak.cache > 0 and b.books.file.total_peak > 0)
    assert.are.equal(text:match(", in ([^\n]*)"), b.phase)
    assert.is_true(b.pool_bytes > 0)
    code, out = host({"plan", "recipes/longctx.lua", "--json", "--world", "2", "--zero", "3", "--seq-len", "512"})
    assert.are.equal(0, code, out)
    local ranks = {}
    for line in out:gmatch("[^\n]+") do ranks[#ranks + 1] = assert(json.decode(line), line) end
    assert.are.equal(2, #ranks)
    for r, one in ipairs(ranks) do
      assert.are.same({r - 1, 2}, {one.rank, one.world})
      assert.is_true(one.books.cpu.peak.comm > 0)
    end
    code, out = host({"plan", "recipes/longctx.lua", "--json", "--fit"})
    assert.are.equal(1, code, out)
    support.has(out, "moelua plan: --json prints a plan's book; --max-seq and --fit print their search")
    code, out = host({"plan", "recipes/longctx.lua", "--max-seq", "--fit"})
    assert.are.equal(1, code, out)
    support.has(out, "moelua plan: --max-seq and --fit are two searches: give one")
    -- under mpiexec (PMI_SIZE is how a process knows, before MPI starts)
    local p = assert(io.popen("PMI_SIZE=2 " .. support.host_command({"plan", "recipes/tiny.lua"}) .. " 2>&1"))
    code, out = support.finish_child(p)
    assert.are.equal(1, code, out)
    support.has(out, "moelua plan: plans in one process, not under mpiexec: --world N plans the N ranks of a job")
  end)

  it("refuses a plan over the budget with the recipe's own error", function()
    local code, out = host({"plan", "recipes/longctx.lua", "--seq-len", "65536", "--budget-gib", "0.05"})
    assert.are.equal(1, code, out)
    support.has(out, "--seq-len 65536 needs ")
    support.has(out, "over the budget of 51.20 MiB (--budget-gib 0.05)")
  end)

  it("--preset report1: report 1's model in bf16 on cuda, its book beside the plan's, where it is wrong", function()
    local json = require "dkjson"
    -- two of its 32 layers at 1024 tokens (all 32 at 32K plan in about a minute): the same widths
    local args = {"plan", "recipes/longctx.lua", "--preset", "report1", "--layers", "2", "--seq-len", "1024"}
    local jargs = {table.unpack(args)}
    jargs[#jargs + 1] = "--json"
    local code, text = host(jargs)
    assert.are.equal(0, code, text)
    local j = json.decode(text:match("([^\n]*)\n?$"))
    -- Mixtral's parameters from the shapes: embedding and head V D each, the final norm, per layer two
    -- norms, q and o D x D, k and v D x (KV hd), the router E x D and the experts 3 E F D
    local V, D, L, E, F, KV, hd = 32000, 4096, 2, 8, 5888, 8, 128
    local n = 2 * V * D + D + L * (2 * D + 2 * D * D + 2 * D * KV * hd + E * D + 3 * E * F * D)
    assert.are.equal(n, j.parameters)
    assert.are.equal("report1", j.preset)
    assert.are.equal("cuda", j.device)
    local peak = j.books.cuda.peak
    assert.are.equal(2 * n, peak.params)   -- bf16 weights
    assert.are.equal(4 * n, peak.grads)    -- f32 gradients
    assert.are.equal(12 * n, peak.optim)   -- f32 masters and AdamW's two moments
    assert.are.equal(math.floor(75.5 * 2^30), j.budget_bytes)
    code, text = host(args)
    assert.are.equal(0, code, text)
    support.has(text, "\npreset report1: field report 1 (PROBLEM.md): Mixtral-like, hidden 4096")
    support.has(text, string.format("\nthe model: %d parameters (%.2fB)\n", n, n / 1e9))
    support.has(text, "\n  params           15.20 " .. string.format("%12.2f", 2 * n / 1e9) .. "\n")
    support.has(text, "15.20 GB of 2-byte parameters is 7.6B parameters, not 20B")
    -- outside the ledger: the H200's measured context + cuBLAS (tests/spec/gpu_memory_spec.lua), one GPU
    support.has(text, "\n  outside        1.2-1.8         0.62\n")
    support.has(text, "; on the GPU, 594.80 MiB for this run (measured on an NVIDIA H200, driver 580.159.04, CUDA " ..
                      "13.0: tests/spec/gpu_memory_spec.lua; other GPUs, drivers and versions differ): the CUDA " ..
                      "context 528.80 MiB, cuBLAS's handle and workspace 66.00 MiB, no NCCL communicator (one rank; " ..
                      "578.00 MiB with 2 or more)")
    support.has(text, string.format("model states alone (params, grads, optim) are %.2f GB here, 18.0 bytes per " ..
                                    "parameter", 18 * n / 1e9))
    local small = {table.unpack(args)}
    small[#small + 1], small[#small + 2] = "--budget-gib", "10"
    code, text = host(small)
    assert.are.equal(1, code, text)   -- the book of what it needs, then the recipe refuses
    support.has(text, "parameter, over the 10.00 GiB budget before any activation: one GPU fits only with states " ..
                      "moved to host memory (--offload-optimizer, --expert-budget); ZeRO-3 shards them over ranks " ..
                      "(--world N --zero 3); --fit tries both")
    code, text = host({"plan", "recipes/longctx.lua", "--preset", "report2"})
    assert.are.equal(1, code, text)
    support.has(text, "moelua plan: --preset report2: unknown (presets: report1)")
  end)

  it("on cuda lists the device memory outside the ledger as measured on a GPU, NCCL's with 2 or more ranks", function()
    local code, text = host({"plan", "recipes/longctx.lua", "--device", "cuda", "--world", "2", "--zero", "3",
                             "--seq-len", "256"})
    assert.are.equal(0, code, text)
    support.has(text, "; on the GPU, 1172.80 MiB for this run (measured on an NVIDIA H200, driver 580.159.04, " ..
                      "CUDA 13.0: tests/spec/gpu_memory_spec.lua; other GPUs, drivers and versions differ): " ..
                      "the CUDA context 528.80 MiB, cuBLAS's handle and workspace 66.00 MiB, an NCCL communicator " ..
                      "578.00 MiB (one rank's: more with peers, not measured)")
    code, text = host({"plan", "recipes/longctx.lua", "--seq-len", "256"})
    assert.are.equal(0, code, text)
    assert.is_nil(text:find("on the GPU", 1, true), text)
    -- --json: the same in bytes (528.8, 66 and 578 MiB), the host's share measured in the planning process
    local json = require "dkjson"
    for _, world in ipairs{1, 2} do
      code, text = host({"plan", "recipes/longctx.lua", "--device", "cuda", "--seq-len", "256", "--json",
                         "--world", tostring(world), "--rank", "0"})
      assert.are.equal(0, code, text)
      local o = json.decode(text).outside
      local nccl = world > 1 and 578 * 2^20 or 0
      assert.are.same({bytes = 554486988 + 66 * 2^20 + nccl, context = 554486988, cublas = 66 * 2^20, nccl = nccl,
                       measured = "measured on an NVIDIA H200, driver 580.159.04, CUDA 13.0: " ..
                                  "tests/spec/gpu_memory_spec.lua"}, o.cuda)
      assert.is_true(o.host_bytes > 0 and o.host_bytes < 1 << 30, text)
    end
    code, text = host({"plan", "recipes/longctx.lua", "--seq-len", "256", "--json"})
    assert.are.equal(0, code, text)
    assert.is_nil(json.decode(text).outside.cuda)
  end)

  it("needs a recipe; --rank needs --world; --max-seq sets --seq-len itself", function()
    local code, out = host({"plan"})
    assert.are.equal(1, code, out)
    support.has(out, "usage: moelua plan RECIPE [--max-seq | --fit] [--world N [--rank R]] [--json] [--preset report1] " ..
                     "[recipe options]")
    code, out = host({"plan", "--fit", "recipes/longctx.lua"})
    assert.are.equal(1, code, out)
    support.has(out, "moelua plan: the recipe comes first, got the option --fit\nusage: moelua plan RECIPE")
    code, out = host({"plan", "recipes/tiny.lua", "--world", "2", "--world=3"})
    assert.are.equal(1, code, out)
    support.has(out, "moelua plan: --world is given twice")
    code, out = host({"plan", "--help"})   -- asked for: on stdout, status 0
    assert.are.equal(0, code, out)
    support.has(out, "usage: moelua plan RECIPE [--max-seq | --fit]")
    code, out = host({"plan", "recipes/longctx.lua", "--rank", "1"})
    assert.are.equal(1, code, out)
    support.has(out, "moelua plan: --rank needs --world")
    code, out = host({"plan", "recipes/longctx.lua", "--world", "2", "--rank", "2"})
    assert.are.equal(1, code, out)
    support.has(out, "moelua plan: --rank 2 of --world 2: ranks are 0 to 1")
    -- --fit's plans say a user error as it is, once
    code, out = host({"plan", "recipes/tiny.lua", "--fit", "--world", "2", "--rank", "2"})
    assert.are.equal(1, code, out)
    assert.are.equal("moelua plan --fit: recipes/tiny.lua\nmoelua plan: --rank 2 of --world 2: ranks are 0 to 1\n",
                     (out:gsub("\n[^:\n]*moelua: ", "\n")))
    code, out = host({"plan", "recipes/longctx.lua", "--world", "4", "--ep", "3"})
    assert.are.equal(1, code, out)
    support.has(out, "--ep 3: the expert-parallel size must divide the number of ranks (4)")
    code, out = host({"plan", "recipes/longctx.lua", "--max-seq", "--seq-len", "4096"})
    assert.are.equal(1, code, out)
    support.has(out, "moelua plan --max-seq searches --seq-len itself: leave out --seq-len 4096")
    -- a preset's own --seq-len gives way to the search
    code, out = host({"plan", "recipes/longctx.lua", "--preset", "report1", "--max-seq", "--budget-gib", "1"})
    assert.are.equal(1, code, out)
    support.has(out, "moelua plan --max-seq: not even --seq-len 1 fits the budget (it needs ")
    -- below 64 too: the longest that fits, where 64 does not
    code, out = host({"plan", "recipes/tiny.lua", "--max-seq", "--budget-gib", "0.00178"})
    assert.are.equal(0, code, out)
    local n = tonumber(out:match("moelua plan %-%-max%-seq: %-%-seq%-len (%d+) fits"))
    assert.is_true(n and n > 1 and n < 64, out)
    -- FLOPs in a unit that shows them: a tiny step's are MFLOPs
    code, out = host({"plan", "recipes/tiny.lua", "--seq-len", "64"})
    assert.are.equal(0, code, out)
    assert.is_truthy(out:find("per step %(1 micro%-batch of 64 tokens%): %d+%.%d%d MFLOP of forward matmuls, " ..
                              "%d+%.%d%d MFLOP recomputed in backward"), out)
  end)

  it("a planned world: a rank's groups by shape, no collective outside a plan, no split", function()
    local code, out = host({"-e", [[
local dist = require "moelua.dist"
dist.plan_world(1, 4)
dist.init{timeout = 5}
assert(dist.rank() == 1 and dist.world() == 4 and dist.planned() and not dist.launched())
local g = dist.planned_group(0, 2, "ep")
assert(g:rank() == 0 and g:world() == 2)
print(select(2, pcall(dist.barrier, "step end")))
print(select(2, pcall(dist.split, 0, 0, "g")))
print(select(2, pcall(dist.plan_world, 0, 2)))
local mem, m = require "moelua.mem", require "moelua"
assert(mem.plan(function() dist.all_reduce(m.zeros({8}), "planned sum") end))
]]})
    assert.are.equal(0, code, out)
    support.has(out, "moelua.dist.barrier: step end: a planned world of 4 ranks (moelua plan --world) runs " ..
                     "collectives only inside a memory plan")
    support.has(out, "moelua.dist.split: a planned world (moelua plan --world) cannot split")
    support.has(out, "moelua.dist.plan_world: moelua.dist.init has run: a planned world is chosen before it")
  end)

  it("--world 2 --zero 3 --ep 2: each rank's plan is that rank's measured peak under mpiexec, to the byte", function()
    if support.mpiexec_missing() then return pending(support.mpiexec_missing()) end
    local opts = {"--zero", "3", "--ep", "2", "--seq-len", "1024", "--dim", "32", "--ffn", "64"}
    local run_dir = dir .. "/mp"
    local args = {"recipes/longctx.lua", "--steps", "2", "--ckpt-every", "0", "--run-dir", run_dir}
    for _, a in ipairs(opts) do args[#args + 1] = a end
    local code, out = support.finish_child(assert(io.popen(support.mpiexec_command(2, args) .. " 2>&1")))
    assert.are.equal(0, code, out)
    local last
    for line in io.lines(run_dir .. "/metrics.jsonl") do
      local mm = require("dkjson").decode(line)
      if mm.ledger_peak then last = mm end
    end
    for r = 0, 1 do
      local a = {"plan", "recipes/longctx.lua", "--world", "2", "--rank", tostring(r)}
      for _, o in ipairs(opts) do a[#a + 1] = o end
      local c, text = host(a)
      assert.are.equal(0, c, text)
      local planned = tonumber(text:match("^moelua plan: .-%(cpu, rank " .. r .. " of 2%): peak [%d.]+ MiB %((%d+) bytes%)"))
      assert.are.equal(last.ledger_peak.ranks[r + 1].total, planned, "rank " .. r)
    end
  end)

  it("--fit: the knobs in order until the plan fits, each one's cost; the answer fits, nothing fitting is an error", function()
    local code, out = host({"plan", "recipes/longctx.lua", "--fit", "--seq-len", "16384", "--budget-gib", "0.095",
                            "--checkpoint", "none", "--save", "save"})
    assert.are.equal(0, code, out)
    support.has(out, "\n  as given                                 needs ")
    support.has(out, "\n  --save recompute                         needs ")
    support.has(out, "\n  --checkpoint moe                         fits, peak ")
    -- a checkpointed MoE half recomputes the pre-activations anyway: the earlier knob is dropped
    support.has(out, "\n  without --save recompute                 fits, peak ")
    support.has(out, "\nfits with: --checkpoint moe\n" ..
                     "  cost: recomputes in backward the MoE layers' norm and routing, and the experts' " ..
                     "pre-activations\n" ..
                     "  per step (1 micro-batch of 16384 tokens): ")
    -- the answer is a plan that fits
    code, out = host({"plan", "recipes/longctx.lua", "--seq-len", "16384", "--budget-gib", "0.095",
                      "--checkpoint", "moe", "--save", "save"})
    assert.are.equal(0, code, out)
    code, out = host({"plan", "recipes/longctx.lua", "--fit", "--seq-len", "200000", "--budget-gib", "0.05"})
    assert.are.equal(1, code, out)
    support.has(out, "nothing tried fits the budget")
    -- a knob that does not lower the peak is not kept (here the optimizer's staging outweighs its states)
    code, out = host({"plan", "recipes/longctx.lua", "--fit", "--budget-gib", "0.031"})
    assert.are.equal(0, code, out)
    support.has(out, "\n  --offload-optimizer true                 needs ")
    support.has(out, ": no lower, not kept\n")
    support.has(out, "\n  without --checkpoint full                needs ")   -- tried away, kept: needed
    support.has(out, "\nfits with: --checkpoint full --expert-budget ")
    assert.is_nil(out:find("fits with: [^\n]*offload", 1), out)
    -- under a budget too small for the optimizer's store: its book, not a refusal blamed on the option;
    -- and experts under 2 MiB in all are still halved
    code, out = host({"plan", "recipes/tiny.lua", "--threads", "1", "--fit", "--budget-gib", "0.0019"})
    assert.are.equal(0, code, out)
    support.has(out, "\n  --offload-optimizer true                 needs ")
    support.has(out, "\n  --expert-budget 384KiB                   fits, peak ")
    -- a boolean knob given alone (or as 1) is taken as given, the option after it untouched
    for _, given in ipairs{{"--offload-optimizer"}, {"--offload-optimizer", "1"}} do
      local args = {"plan", "recipes/tiny.lua", "--threads", "1", "--fit", table.unpack(given)}
      table.move({"--budget-gib", "0.0019"}, 1, 2, #args + 1, args)
      code, out = host(args)
      assert.are.equal(0, code, out)
      assert.is_nil(out:find("--offload-optimizer true  ", 1, true), out)
      support.has(out, "fits with: --checkpoint full --expert-budget 384KiB\n")
    end
  end)

  it("--fit on cuda: halving expert budgets (the store's slots), its backing in pinned host memory", function()
    local model = {"--device", "cuda", "--dtype", "bf16", "--dim", "1024", "--layers", "4", "--experts", "8",
                   "--ffn", "2048", "--seq-len", "4096"}
    local code, out = host({"plan", "recipes/longctx.lua", "--fit", "--budget-gib", "1", table.unpack(model)})
    assert.are.equal(0, code, out)
    -- a bf16 slab is 18 bytes per parameter: 3 D F 18 = 108 MiB, 32 of them 3456 MiB; halving from there
    support.has(out, "\n  --expert-budget 1728MiB                  needs ")
    support.has(out, "\n  --expert-budget 432MiB                   fits, peak ")
    -- the offloaded optimizer was needed before the experts went to the store, not after
    support.has(out, "\n  without --offload-optimizer true         fits, peak ")
    support.has(out, "\nfits with: --checkpoint full --expert-budget 432MiB\n")
    support.has(out, "a cuda run's pinned host memory): a step moves up to every expert's slab in and out")
    support.has(out, "\n  pinned host memory: 3456.00 MiB (the tier behind offloaded states and stored experts)")
    -- what the chosen knobs move and recompute per step (the plan's second step)
    support.has(out, "\n  per step with every expert routed (the plan's worst case): the expert store reads ")
    assert.is_nil(out:find("the offloaded optimizer reads", 1, true), out)
    code, out = host({"plan", "recipes/longctx.lua", "--budget-gib", "1", "--checkpoint", "full",
                      "--expert-budget", "432MiB", table.unpack(model)})
    assert.are.equal(0, code, out)
  end)

  it("--max-seq: the answer trains under the budget, 1.1 x the answer is refused", function()
    local budget = {"--budget-gib", "0.04", "--dim", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1",
                    "--ffn", "64", "--experts", "4"}
    local code, out = host({"plan", "recipes/longctx.lua", "--max-seq", table.unpack(budget)})
    assert.are.equal(0, code, out)
    local n = tonumber(out:match("%-%-seq%-len (%d+) fits"))
    assert.is_not_nil(n, out)
    local function train(seq)
      local args = {"recipes/longctx.lua", "--steps", "1", "--ckpt-every", "0", "--seq-len", tostring(seq),
                    "--run-dir", dir .. "/run" .. seq, table.unpack(budget)}
      return host(args)
    end
    local c1, o1 = train(n)
    assert.are.equal(0, c1, o1)
    local c2, o2 = train(math.floor(1.1 * n))
    assert.are.equal(1, c2, o2)
    support.has(o2, "over the budget")
  end)
end)
