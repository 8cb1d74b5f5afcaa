-- moelua.plan_cli: `moelua plan RECIPE [--max-seq] [recipe options]`, the
-- memory a training run needs before anything is allocated (DESIGN.md, The
-- memory ledger: the planner).
--
-- The recipe runs as it would, with its options, up to its memory plan:
-- moelua.train.plan, the dry run of the recipe's build and first steps
-- (every kernel skipped, no tensor memory mapped), then prints the account
-- book of every tier at the peak, the phase of the step the peak is in,
-- what a step computes and moves (train.plan's per_step: forward and
-- recomputed matmul FLOPs, the expert store's and the offloaded
-- optimizer's traffic), and ends the program: nothing of the model is
-- allocated. A plan over the budget is the recipe's own error (exit
-- status 1).
--
-- --world N [--rank R]: the plan of rank R of N ranks without mpiexec (a
-- planned world, moelua.dist.plan_world: the recipe's ZeRO stage and
-- expert parallelism shape each rank's units and exchanges as under
-- mpiexec, and no collective moves data). Without --rank every rank is
-- planned, each in a child process: the largest rank's book in full, then
-- every rank's peak.
--
-- --json: the same plan as one JSON object (every book's peak and at_peak
-- per category in bytes, total_peak, the phase, pool_bytes,
-- expert_exchange, per_step, outside: what lies outside the ledger); with
-- --world and no --rank, one line per rank.
--
-- --fit: the recipe's memory knobs, tried in a stated order (KNOBS below)
-- and kept as they add up, until a plan fits, then the kept ones a later
-- one made needless dropped: each try's peak, the options
-- that fit and what each costs (in words, then the chosen plan's FLOPs,
-- traffic and host tiers). Only knobs the recipe offers (its --help) are
-- tried, each in a child process.
--
-- --max-seq: the longest --seq-len whose plan fits the budget (the
-- recipe's --budget-gib, or 90% of the memory available), searched over
-- such plans, each in a child process (a recipe runs once per process: its
-- options and data are set up when it starts). A plan's peak grows almost
-- linearly with seq_len (the activations; the pool and the rest in small
-- steps), so each probe is where the line through two earlier probes meets
-- the budget; a probe that does not halve the bracket (or double the
-- length, before one is over) makes the next a bisection (or a doubling),
-- so the search never takes much more than twice the probes of bisection.
--
-- --preset NAME: a configuration of ../shared/PROBLEM.md as recipe options
-- (PRESETS below; an option given on the command line wins), and, beside
-- the plan, the report's own account book and where it is wrong.
--
-- A plan over the budget prints the book of what it needs (planned with
-- the budgets lifted), then the recipe refuses (exit status 1).
local errors = require "moelua.errors"
local options = require "moelua.options"

local M = {}

local CATEGORIES = {"params", "grads", "optim", "acts", "pool", "comm", "cache", "other"}

local function mib(n) return string.format("%.2f MiB", n / 2^20) end
local bytes = require("moelua.mem").format_bytes

-- FLOPs in the largest unit that keeps a digit before the point (a tiny
-- model's step is MFLOPs, report 1's is PFLOPs)
local function flop(n)
  for _, u in ipairs{{1e15, "PFLOP"}, {1e12, "TFLOP"}, {1e9, "GFLOP"}} do
    if n >= u[1] then return string.format("%.2f %s", n / u[1], u[2]) end
  end
  return string.format("%.2f MFLOP", n / 1e6)
end

local USAGE = "usage: moelua plan RECIPE [--max-seq | --fit] [--world N [--rank R]] [--json] [--preset report1] " ..
              "[recipe options] (e.g. moelua plan recipes/longctx.lua --seq-len 32768)"

-- Field report 1 (PROBLEM.md): the configuration, as recipes/longctx.lua's
-- options, and its account book at 32K (decimal GB, its words).
local PRESETS = {
  report1 = {
    about = "field report 1 (PROBLEM.md): Mixtral-like, hidden 4096, 8 experts top-2, 32 heads / 8 KV heads, " ..
            "vocab 32000, bf16, batch 4 x 32K on one 80 GB GPU (75.5 GiB usable); 32 layers and F 5888 make " ..
            "its 20B parameters; batch 4 runs as 4 accumulated micro-batches of one sequence (the same step)",
    args = {"--device", "cuda", "--dtype", "bf16", "--vocab", "32000", "--dim", "4096", "--layers", "32",
            "--heads", "32", "--kv-heads", "8", "--experts", "8", "--topk", "2", "--ffn", "5888",
            "--seq-len", "32768", "--accum", "4", "--budget-gib", "75.5"},
    book = {params = 15.2e9, acts = 28.6e9, grads = 7.6e9, optim = 22.8e9, outside = "1.2-1.8", total = "about 74"},
  },
}

-- The table of one planned book (mem.stats()'s format): each category's
-- own peak, its bytes at the total's peak and their share.
local function book_lines(name, b, out)
  out[#out + 1] = string.format("  %-8s %14s %14s %7s", name, "peak", "at peak", "share")
  for _, c in ipairs(CATEGORIES) do
    if (b.peak[c] or 0) > 0 then
      out[#out + 1] = string.format("  %-8s %14s %14s %6.1f%%", c, mib(b.peak[c]), mib(b.at_peak[c] or 0),
                                    b.total_peak > 0 and 100 * (b.at_peak[c] or 0) / b.total_peak or 0)
    end
  end
  out[#out + 1] = string.format("  %-8s %14s %14s %6.1f%%", "total", mib(b.total_peak), mib(b.total_peak), 100)
end

local function gb(n) return string.format("%.2f", n / 1e9) end

-- The device memory a CUDA run holds outside the ledger, as measured by
-- tests/spec/gpu_memory_spec.lua (cudaMemGetInfo's used bytes less the
-- allocator's reservations) on an NVIDIA H200, driver 580.159.04, CUDA 13.0
-- (2026-12-04); the 2-step training runs there measured context + cuBLAS
-- as 595-598 MiB (BENCHMARKS.md, "The GPU, measured"). The NCCL figure is
-- a communicator of one rank: with peers NCCL adds buffers per peer and
-- channel, not measured (one GPU), so for 2+ ranks it is a lower bound.
local CUDA_OUTSIDE = {
  where = "measured on an NVIDIA H200, driver 580.159.04, CUDA 13.0: tests/spec/gpu_memory_spec.lua",
  context = math.floor(528.8 * 2^20), cublas = 66 << 20, nccl = 578 << 20,
}

-- What the ledger leaves out, with what this process measured of it: its
-- RSS less its ledger (the plan allocated nothing, so that is the code,
-- the libraries and the Lua heap of the recipe's build: a run has the
-- same and its data); on cuda, the device's share of this run's world
-- (CUDA_OUTSIDE; the NCCL communicator only with 2+ ranks). Bytes, as
-- --json's `outside`.
local function outside(device)
  local out = {host_bytes = require("moelua.mem").stats().cpu.untracked}
  if device == "cuda" then
    local o, world = CUDA_OUTSIDE, require("moelua.dist").world()
    local nccl = world > 1 and o.nccl or 0
    out.cuda = {bytes = o.context + o.cublas + nccl, context = o.context, cublas = o.cublas, nccl = nccl,
                measured = o.where}
  end
  return out
end

local function outside_lines(o)
  local line = string.format("outside the ledger (not planned): the Lua heap and the process's code and libraries " ..
                             "(%s measured in this process: its RSS less its ledger)", mib(o.host_bytes))
  local c = o.cuda
  if not c then return line end
  return line .. string.format("; on the GPU, %s for this run (%s; other GPUs, drivers and versions differ): the " ..
                               "CUDA context %s, cuBLAS's handle and workspace %s, %s", mib(c.bytes), c.measured,
                               mib(c.context), mib(c.cublas), c.nccl > 0 and "an NCCL communicator " .. mib(c.nccl) ..
                               " (one rank's: more with peers, not measured)" or "no NCCL communicator (one rank; " ..
                               mib(CUDA_OUTSIDE.nccl) .. " with 2 or more)")
end

-- The preset's book beside the plan's (at the peak), and where the report
-- is wrong, computed from the plan (PROBLEM.md, "Where the reports are wrong");
-- c: outside()'s cuda part, nil on the CPU.
local function preset_lines(plan, out, c)
  local r, a, n = PRESETS[M.preset].book, plan.at_peak, plan.parameters
  local states = (a.params or 0) + (a.grads or 0) + (a.optim or 0)
  out[#out + 1] = ""
  out[#out + 1] = "report 1's account book beside this plan (GB = 10^9 bytes; the plan's bytes at its peak):"
  out[#out + 1] = string.format("  %-9s %12s %12s", "", "report 1", "this plan")
  for _, c in ipairs{{"params", "params"}, {"grads", "grads"}, {"optim", "optim"}} do
    out[#out + 1] = string.format("  %-9s %12s %12s", c[1], gb(r[c[1]]), gb(a[c[2]] or 0))
  end
  out[#out + 1] = string.format("  %-9s %12s %12s", "acts", gb(r.acts), gb((a.acts or 0) + (a.pool or 0) + (a.comm or 0)))
  out[#out + 1] = string.format("  %-9s %12s %12s", "outside", r.outside, c and gb(c.bytes) or "-")
  out[#out + 1] = string.format("  %-9s %12s %12s", "total", r.total, gb(plan.total_peak))
  if c then
    out[#out + 1] = "  (this plan's outside is measured, not planned, and not in its total: the CUDA context and " ..
                    "cuBLAS" .. (c.nccl > 0 and ", an NCCL communicator" or "") .. ", " .. c.measured .. ")"
  end
  out[#out + 1] = "where report 1 is wrong:"
  out[#out + 1] = string.format("  - %s GB of 2-byte parameters is %.1fB parameters, not 20B; this model's %.2fB " ..
                                "take %s GB in bf16", gb(r.params), r.params / 2 / 1e9, n / 1e9, gb(2 * n))
  out[#out + 1] = string.format("  - AdamW's two fp32 moments of %.2fB parameters are %s GB (with fp32 master weights, " ..
                                "as here: %s GB), not %s GB", n / 1e9, gb(8 * n), gb(12 * n), gb(r.optim))
  out[#out + 1] = string.format("  - its gradients are half its 2-byte parameters; fp32 gradients (as moelua keeps " ..
                                "them) of %.2fB parameters are %s GB", n / 1e9, gb(4 * n))
  out[#out + 1] = string.format("  - model states alone (params, grads, optim) are %s GB here, %.1f bytes per parameter%s",
                                gb(states), states / n, plan.budget_total > 0 and states > plan.budget_total
                                  and string.format(", over the %s budget before any activation: one GPU fits " ..
                                                    "only with states moved to host memory (--offload-optimizer, " ..
                                                    "--expert-budget); ZeRO-3 shards them over ranks (--world N " ..
                                                    "--zero 3); --fit tries both", bytes(plan.budget_total)) or "")
end

-- The books beside the model device's that a plan shows when they hold
-- bytes: host memory (a cuda run's, e.g. offloaded master weights), pinned
-- host memory, files.
local function other_tiers(device)
  if device == "cpu" then return {"pinned", "file"} end
  return {"cpu", "pinned", "file"}
end

-- The lines of train.plan's report: the headline (the peak, or what a plan
-- over the budget needs), the book of the model's device (plan, with
-- train.plan's parameters, pool_bytes and expert_exchange), the other tiers
-- that hold bytes (books), what the ledger leaves out, a preset's book.
local function report(recipe, device, plan, books, over)
  local dist = require "moelua.dist"
  local where = dist.planned() and string.format("%s, rank %d of %d", device, dist.rank(), dist.world()) or device
  local budget = string.format("%s (%d bytes) budget", bytes(plan.budget_total), plan.budget_total)
  local out = {over and string.format("moelua plan: %s (%s): needs %s (%d bytes) at its peak, in %s: over the %s " ..
                                      "(the book planned without budgets; under one, garbage is collected before an " ..
                                      "allocation is refused, so the run may fit in less)", recipe, where,
                                      mib(plan.total_peak), plan.total_peak,
                                      plan.peak_phase ~= "" and plan.peak_phase or "the build", budget)
                    or string.format("moelua plan: %s (%s): peak %s (%d bytes)%s, in %s", recipe, where,
                             mib(plan.total_peak), plan.total_peak,
                             plan.budget_total > 0 and " of a " .. budget or "",
                             plan.peak_phase ~= "" and plan.peak_phase or "the build")}
  if M.preset then out[#out + 1] = "preset " .. M.preset .. ": " .. PRESETS[M.preset].about end
  if plan.parameters then
    local n = plan.parameters
    out[#out + 1] = string.format("the model: %d parameters (%s)", n,
                                  n >= 1e9 and string.format("%.2fB", n / 1e9) or string.format("%.2fM", n / 1e6))
  end
  book_lines(device, plan, out)
  for _, tier in ipairs(other_tiers(device)) do
    local b = books[tier]
    if b and b.total_peak > 0 then
      out[#out + 1] = ""
      book_lines(tier, b, out)
    end
  end
  if plan.pool_bytes then
    out[#out + 1] = string.format("the step's stack pool is reserved at %s (its high-water mark: no step grows it)",
                                  mib(plan.pool_bytes))
  end
  local ps = plan.per_step
  if ps and ps.forward_flop then
    out[#out + 1] = string.format("per step (%d micro-batch%s of %d tokens): %s of forward matmuls, %s " ..
                                  "recomputed in backward (activation checkpointing, expert pre-activations)",
                                  ps.micro_batches, ps.micro_batches == 1 and "" or "es", ps.seq_len,
                                  flop(ps.forward_flop), flop(ps.recompute_flop))
  end
  -- (a plan routes every token to every expert's tiles: the expert store's worst case)
  for _, s in ipairs{{"experts", "the expert store", " with every expert routed (the plan's worst case)"},
                     {"optim", "the offloaded optimizer", ""}} do
    local t = ps and ps[s[1]]
    if t then
      out[#out + 1] = string.format("per step%s: %s reads %s and writes %s (%d acquisitions: %d misses, " ..
                                    "%d prefetches)", s[3], s[2], mib(t.read), mib(t.written), t.hits + t.misses,
                                    t.misses, t.prefetches)
    end
  end
  local ex = plan.expert_exchange
  if ex then
    out[#out + 1] = string.format("expert exchange: each MoE layer's receive buffers planned for %d rows " ..
                                  "(every token of the group to this rank's experts: %d%s)", ex.bound, ex.worst,
                                  ex.capacity and string.format("; capacity of its experts: %d", ex.capacity) or "")
  end
  local o = outside(device)
  out[#out + 1] = outside_lines(o)
  if M.preset and plan.parameters then preset_lines(plan, out, o.cuda) end
  return out
end

-- train.plan's report in plan mode, then the program ends (exit status 0).
function M.finish(recipe, device, plan, books)
  if M.json then return M.finish_json(recipe, device, plan, books) end
  io.stdout:write(table.concat(report(recipe, device, plan, books), "\n"), "\n")
  io.stdout:flush()
  os.exit(0, true)
end

-- A plan over the budget: the book of what it needs (train.plan then
-- returns the refusal the recipe raises).
function M.over_budget(recipe, device, plan, books)
  if M.json then return end
  plan.budget_total = require("moelua.mem").stats()[device].budget_total   -- (planned without: the one refused)
  io.stdout:write(table.concat(report(recipe, device, plan, books, true), "\n"), "\n")
  io.stdout:flush()
end

-- finish's JSON form: one object on stdout, then the program ends.
function M.finish_json(recipe, device, plan, books)
  local dist = require "moelua.dist"
  local function book(b)
    return {peak = b.peak, at_peak = b.at_peak, total_peak = b.total_peak, budget_total = b.budget_total}
  end
  local out = {recipe = recipe, device = device, peak_bytes = plan.total_peak, phase = plan.peak_phase,
               budget_bytes = plan.budget_total, books = {[device] = book(plan)},
               pool_bytes = plan.pool_bytes, expert_exchange = plan.expert_exchange,
               parameters = plan.parameters, preset = M.preset, per_step = plan.per_step,
               outside = outside(device)}
  if dist.planned() then out.rank, out.world = dist.rank(), dist.world() end
  for _, tier in ipairs(other_tiers(device)) do
    local b = books[tier]
    if b and b.total_peak > 0 then out.books[tier] = book(b) end
  end
  io.stdout:write(require("dkjson").encode(out), "\n")
  io.stdout:flush()
  os.exit(0, true)
end

-- The path of this host, for child processes.
local function host_path()
  local p = assert(io.popen("readlink /proc/" .. io.open("/proc/self/stat"):read("n") .. "/exe"))
  local path = p:read("l")
  p:close()
  return path
end

local function quote(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

-- `moelua plan RECIPE args...` in a child: its exit and its words.
local function child(host, recipe, args)
  local words = {quote(host), "plan", quote(recipe)}
  for _, a in ipairs(args) do words[#words + 1] = quote(a) end
  local p = assert(io.popen(table.concat(words, " ") .. " 2>&1"))
  local text = p:read("a")
  return p:close(), text
end

-- The value of option name in args (removed from them), or nil; flag: a
-- boolean option, which `--name` alone sets ("true").
local function take(args, name, flag)
  local function value(v)   -- a boolean as "true" or "false"; what it cannot read, for the child to refuse
    if not flag then return v end
    local b = options.boolean(v)
    return b == nil and v or tostring(b)
  end
  for i = #args, 1, -1 do
    local v = args[i]:match("^%-%-" .. name:gsub("%-", "%%-") .. "=(.*)$")
    if v then
      table.remove(args, i)
      return value(v)
    elseif args[i] == "--" .. name then
      v = args[i + 1]
      if flag and (v == nil or v:match("^%-%-")) then   -- a boolean option alone
        table.remove(args, i)
        return "true"
      end
      if v == nil then errors.user("moelua plan: --" .. name .. " needs a value") end
      table.remove(args, i + 1)
      table.remove(args, i)
      return value(v)
    end
  end
end

-- An integer option's value >= lo, or nil.
-- One of plan's own options (--world, --rank, --preset): once, as what
-- follows goes to the recipe, which does not know it.
local function take_own(args, name)
  local v = take(args, name)
  if v ~= nil and take({table.unpack(args)}, name) ~= nil then
    errors.user("moelua plan: --" .. name .. " is given twice")
  end
  return v
end

local function take_int(args, name, lo)
  local v = take_own(args, name)
  if v == nil then return nil end
  local n = math.tointeger(tonumber(v))
  if not n or n < lo then errors.user(string.format("moelua plan: --%s must be an integer >= %d, got %s", name, lo, v)) end
  return n
end

-- Every rank of a planned world of n ranks, each in a child; with --json,
-- each child's line as it comes.
local function every_rank(recipe, rest, n)
  local host, peaks, largest = host_path(), {}, nil
  for r = 0, n - 1 do
    local args = {table.unpack(rest)}
    for _, a in ipairs{"--world", tostring(n), "--rank", tostring(r), M.json and "--json" or nil} do
      args[#args + 1] = a
    end
    local ok, text = child(host, recipe, args)
    local peak, phase = text:match("^moelua plan: .-: peak ([%d.]+) MiB.-, in ([^\n]*)")
    if M.json or not ok or not peak then   -- (a child that ends without a plan's headline failed too)
      io.stdout:write(text)
      if not ok or not (peak or M.json) then return false end
    else
      peaks[r + 1] = {rank = r, peak = tonumber(peak), phase = phase, text = text}
      if not largest or peaks[r + 1].peak > largest.peak then largest = peaks[r + 1] end
    end
  end
  if M.json then return true end
  io.stdout:write(largest.text)
  print(string.format("every rank of %d (the largest, rank %d, above):", n, largest.rank))
  for _, p in ipairs(peaks) do print(string.format("  rank %d: peak %.2f MiB, in %s", p.rank, p.peak, p.phase)) end
  return true
end

-- One plan in a child: true, its peak (bytes), its words and its budget
-- (bytes; nil without one) when it fits; false, what it needs, its words
-- and the budget when it is over the budget; any other failure is an error:
-- the child's own user error as it said it, else one naming `what` with the
-- child's words; or, when `refusable` (a knob the recipe may refuse in this
-- configuration), nil and the child's last line.
local function probe(host, recipe, args, what, refusable)
  local ok, text = child(host, recipe, args)
  local budget = math.tointeger(text:match("moelua plan: [^\n]- %((%d+) bytes%) budget"))
  local peak = text:match("moelua plan: [^\n]-: peak [%d.]+ MiB %((%d+) bytes%)")
  if ok and peak then return true, math.tointeger(peak), text, budget end
  local need = text:match("moelua plan: [^\n]-: needs [%d.]+ MiB %((%d+) bytes%) at its peak")
  if need then return false, math.tointeger(need), text, budget end
  -- its message: the last line before any traceback, without the program's name
  local last = text:gsub("\nstack traceback:.*$", ""):match("([^\n]*)\n?$")
  local msg, named = last:gsub("^[^:]*moelua: ", "")
  if refusable then return nil, msg end
  if not ok and named == 1 and msg ~= "" and not text:find("\nstack traceback:", 1, true) then
    errors.user(msg)   -- the child's user error, said as without --fit
  end
  errors.user(string.format("moelua plan: the plan %s failed: %s", what, text))
end

-- The plan at one --seq-len.
local function probe_seq(host, recipe, rest, seq_len)
  local args = {table.unpack(rest)}
  args[#args + 1] = "--seq-len"
  args[#args + 1] = tostring(seq_len)
  return probe(host, recipe, args, "at --seq-len " .. seq_len)
end

function M.max_seq(recipe, rest)
  local given = take(rest, "seq-len")
  if given then   -- the probes set it: a value given would be dropped without a word
    errors.user(string.format("moelua plan --max-seq searches --seq-len itself: leave out --seq-len %s", given))
  end
  local host = host_path()
  local limit = 1 << 24
  local lo, hi, hi_need = 64, nil, nil
  local fits, peak, _, budget = probe_seq(host, recipe, rest, lo)
  if not fits then   -- below 64, from 1
    hi, hi_need, lo = lo, peak, 1
    fits, peak = probe_seq(host, recipe, rest, lo)
    if not fits then
      errors.user(string.format("moelua plan --max-seq: not even --seq-len %d fits the budget (it needs %s)", lo,
                                mib(peak)))
    end
  end
  local lo_peak, prev, prev_peak = peak, nil, nil
  local plain = true   -- the first probe doubles: one point makes no line
  while not hi or hi - lo > 1 do
    if not hi and lo >= limit then
      errors.user(string.format("moelua plan --max-seq: --seq-len %d still fits; the search stops there", lo))
    end
    -- the line through the bracket's ends (before one is over: the last two fits)
    local a, pa, b, pb = prev, prev_peak, lo, lo_peak
    if hi then a, pa, b, pb = lo, lo_peak, hi, hi_need end
    local n
    if plain or not budget or pb <= pa then
      n = hi and (lo + hi) // 2 or 2 * lo
    else   -- the last length the line keeps under the budget
      n = a + math.floor((budget - pa) / (pb - pa) * (b - a))
    end
    n = math.max(lo + 1, math.min(n, hi and hi - 1 or limit))
    local old_lo, old_width = lo, hi and hi - lo
    fits, peak = probe_seq(host, recipe, rest, n)
    if fits then prev, prev_peak, lo, lo_peak = lo, lo_peak, n, peak else hi, hi_need = n, peak end
    local halved = old_width and hi - lo <= old_width / 2 or not old_width and (hi ~= nil or lo >= 2 * old_lo)
    plain = not plain and not halved
  end
  print(string.format("moelua plan --max-seq: --seq-len %d fits (peak %s, %d bytes); %d does not (it needs %s, " ..
                      "%d bytes)", lo, mib(lo_peak), lo_peak, hi, mib(hi_need), hi_need))
  return true
end

-- The recipe's options and their defaults, from RECIPE --help.
local function recipe_options(host, recipe)
  local p = assert(io.popen(quote(host) .. " " .. quote(recipe) .. " --help 2>&1"))
  local out = {}
  for line in p:lines() do
    local name, default = line:match("^  %-%-([%w%-]+)%s+(%S*)")
    if name then out[name] = default end
  end
  p:close()
  return out
end

-- A tier book's total in a plan's words (0 without one): "file" (a cpu
-- run's store files), "pinned" (a cuda run's host memory behind its
-- offloaded optimizer and its expert store).
local function tier_bytes(text, tier)
  local book = text:match("\n  " .. tier .. " .-\n  total%s+([%d.]+) MiB")
  return book and tonumber(book) * 2^20 or 0
end

-- The expert store's slots in a plan's words: the `cache` row of the
-- first book (the run's device), 0 without one.
local function cache_bytes(text)
  local peak = text:match("\n  cache%s+([%d.]+) MiB")
  return peak and tonumber(peak) * 2^20 or 0
end

-- The knobs --fit tries, in this order (a value is kept only when it
-- lowers the peak; each knob's last kept value stays when the next is
-- tried): the cheapest recompute first: the expert pre-activations (one
-- GEMM of an expert's three; a checkpointed MoE half recomputes them
-- anyway, so this knob comes before the checkpoints), then the MoE halves
-- (their norm and router on top), attention (its projections and causal
-- core), every layer; then optimizer states offloaded, experts under
-- halving budgets, ZeRO stages (with --world). What each costs, said when
-- it is chosen.
local KNOBS = {
  {"save", {"recompute"}, "recomputes the expert pre-activations in backward"},
  {"checkpoint", {"moe", "attention", "full"}, "recomputes in backward %s"},
  {"offload-optimizer", {"true"}, "keeps the optimizer states in the slower tier (a cpu run's RUN_DIR/optim.store, " ..
                                  "a cuda run's host memory), read and written once per step"},
  {"expert-budget", "halving", "keeps the experts beyond %s in the slower tier (a cpu run's RUN_DIR/experts.store, " ..
                               "a cuda run's pinned host memory): a step moves up to every expert's slab in and out"},
  {"zero", {"1", "2", "3"}, "shards over the ranks (ZeRO-%s): collectives every step"},
}
local WHAT = {attention = "the forward of attention",
              moe = "the MoE layers' norm and routing, and the experts' pre-activations",
              full = "the forward of attention, the MoE layers' norm and routing, and the experts' pre-activations"}

function M.fit(recipe, rest)
  local host = host_path()
  local offered = recipe_options(host, recipe)
  local args = {table.unpack(rest)}
  local function say(line)   -- each try as it ends: a long search shows its progress, and Ctrl-C keeps it
    io.stdout:write(line, "\n")
    io.stdout:flush()
  end
  say("moelua plan --fit: " .. recipe)
  local function flag(name) return offered[name] == "true" or offered[name] == "false" end   -- (--help's default)
  local function set(name, value, into)
    into = into or args
    take(into, name, flag(name))
    into[#into + 1] = "--" .. name
    into[#into + 1] = value
  end
  local function current(name)   -- the value given, else the recipe's default
    local v = take({table.unpack(args)}, name, flag(name))
    if v == nil then return offered[name] end
    return v
  end
  -- a knob's value: fits (true/false), the plan's words and peak, and the
  -- line that says so; or nil and that line when the recipe refuses it
  local function try(label, refusable)
    local fits, peak, text = probe(host, recipe, args, "with " .. label, refusable)
    if fits == nil then return nil, string.format("  %-40s refused: %s", label, peak) end
    return fits, text, peak, string.format("  %-40s %s %s", label, fits and "fits, peak" or "needs", mib(peak))
  end
  local fits, text, peak, line = try("as given")
  say(line)
  local chosen = {}
  local world = tonumber(take({table.unpack(rest)}, "world") or "1")
  for _, k in ipairs(KNOBS) do
    local name = k[1]
    if fits then break end
    if offered[name] ~= nil and (name ~= "zero" or world > 1) then
      local values = k[2]
      if values == "halving" then   -- the experts' bytes first: every slab resident, no device budget
        local all_in = {table.unpack(args)}
        set(name, "1TiB", all_in)
        set("budget-gib", "0", all_in)
        local ok, got, t = probe(host, recipe, all_in, "with every expert in the store", true)
        values = {}
        if ok == nil then
          say(string.format("  %-40s refused: %s", "--" .. name, got))
        else
          local all = cache_bytes(t)
          for d = 1, 20 do
            if all / 2^d < 2^16 then break end
            -- whole KiB, rounded up: `all` is the plan's MiB with two decimals (up to 5 KiB
            -- short), and a half must not fall under the slots it means (81 KiB ones: 2.53 MiB / 32)
            local kib = math.ceil(all / 2^d / 1024)
            values[#values + 1] = kib % 1024 == 0 and string.format("%dMiB", kib // 1024) or string.format("%dKiB", kib)
          end
          if #values == 0 then
            say(string.format("  %-40s not tried: the experts hold %s in all", "--" .. name, mib(all)))
          end
        end
      end
      local last, given = nil, current(name)
      for _, v in ipairs(values) do
        if v ~= given then
          local before = {table.unpack(args)}
          set(name, v)
          local f, t, p, said = try("--" .. name .. " " .. v, true)
          if f == nil then   -- refused here (e.g. not built for this device): the knob is left as it was
            say(t)
            args = before
            break
          end
          if p < peak then   -- kept only when it lowers the peak (an offload's staging may add more than it frees)
            say(said)
            fits, text, peak, last = f, t, p, v
            if fits then break end
          else
            say(said .. ": no lower, not kept")
            args = before
          end
        end
      end
      if last then chosen[#chosen + 1] = {k = k, v = last} end
    end
  end
  -- a later knob may leave an earlier one needless (a checkpointed MoE half
  -- recomputes the pre-activations anyway): each kept knob but the last,
  -- latest first, back as given; dropped when the plan still fits
  for i = fits and #chosen - 1 or 0, 1, -1 do
    local name, v = chosen[i].k[1], chosen[i].v
    local without = {table.unpack(args)}
    local given = take({table.unpack(rest)}, name, flag(name))
    if given ~= nil then set(name, given, without) else take(without, name, flag(name)) end
    local label = "without --" .. name .. " " .. v
    local f, p, t = probe(host, recipe, without, label, true)
    if f then
      say(string.format("  %-40s fits, peak %s: dropped", label, mib(p)))
      args, text, peak = without, t, p
      table.remove(chosen, i)
    elseif f == false then
      say(string.format("  %-40s needs %s: kept", label, mib(p)))
    else
      say(string.format("  %-40s refused: %s: kept", label, p))
    end
  end
  if not fits then
    print("nothing tried fits the budget: lower --seq-len (moelua plan --max-seq finds the longest), raise the budget, " ..
          "or add ranks (--world with --zero)")
    return false
  end
  local costs, words = {}, {}
  for _, c in ipairs(chosen) do
    local name, v, fmt = c.k[1], c.v, c.k[3]
    words[#words + 1] = "--" .. name .. " " .. v
    costs[#costs + 1] = fmt:format(name == "checkpoint" and WHAT[v] or v)
  end
  print(string.format("fits with: %s", #words > 0 and table.concat(words, " ") or "the options as given"))
  for _, c in ipairs(costs) do print("  cost: " .. c) end
  for line in text:gmatch("[^\n]+") do   -- the chosen plan's FLOPs and traffic
    if line:match("^per step") then print("  " .. line) end
  end
  if tier_bytes(text, "file") > 0 then
    print(string.format("  disk: %s of store files (the file tier)", mib(tier_bytes(text, "file"))))
  end
  if tier_bytes(text, "pinned") > 0 then
    print(string.format("  pinned host memory: %s (the tier behind offloaded states and stored experts)",
                        mib(tier_bytes(text, "pinned"))))
  end
  return true
end

function M.main(args)
  local recipe = args[1]
  if recipe == "-h" or recipe == "--help" then print(USAGE); return true end
  if not recipe then errors.user(USAGE) end
  if recipe:match("^%-") then   -- an option of plan's own, or of a recipe, comes after the recipe
    errors.user(string.format("moelua plan: the recipe comes first, got the option %s\n%s", recipe, USAGE))
  end
  if require("moelua.dist").launched() then   -- each rank would plan alone, and --fit's children fight over stdio
    errors.user("moelua plan: plans in one process, not under mpiexec: --world N plans the N ranks of a job " ..
                "(--rank R one of them)")
  end
  local rest, max_seq, fit = {}, false, false
  for i = 2, #args do
    if args[i] == "--max-seq" then max_seq = true
    elseif args[i] == "--fit" then fit = true
    elseif args[i] == "--json" then M.json = true
    else rest[#rest + 1] = args[i] end
  end
  M.preset = take_own(rest, "preset")
  if M.preset then   -- the preset's options where the command line gives none; children get the preset again
    local p = PRESETS[M.preset]
    if not p then errors.user(string.format("moelua plan: --preset %s: unknown (presets: report1)", M.preset)) end
    for i = 1, #p.args, 2 do   -- (not its --seq-len under --max-seq, which searches it)
      if take({table.unpack(rest)}, p.args[i]:sub(3)) == nil and not (max_seq and p.args[i] == "--seq-len") then
        rest[#rest + 1], rest[#rest + 2] = p.args[i], p.args[i + 1]
      end
    end
  end
  if max_seq and fit then
    errors.user("moelua plan: --max-seq and --fit are two searches: give one")
  end
  if M.json and (max_seq or fit) then
    errors.user("moelua plan: --json prints a plan's book; --max-seq and --fit print their search")
  end
  if max_seq then return M.max_seq(recipe, rest) end
  if fit then return M.fit(recipe, rest) end
  local world, rank = take_int(rest, "world", 1), take_int(rest, "rank", 0)
  if rank and not world then errors.user("moelua plan: --rank needs --world") end
  if world and not rank and world > 1 then return every_rank(recipe, rest, world) end
  if world then
    if rank and rank >= world then
      errors.user(string.format("moelua plan: --rank %d of --world %d: ranks are 0 to %d", rank, world, world - 1))
    end
    require("moelua.dist").plan_world(rank or 0, world)
  end
  local fn, err = loadfile(recipe)
  if not fn then errors.user("moelua plan: " .. tostring(err)) end
  require("moelua.train").plan_only = recipe
  arg = {[0] = recipe, table.unpack(rest)}
  fn(table.unpack(rest))
  errors.user("moelua plan: " .. recipe .. " ended without a memory plan (moelua.train.plan)")
end

return M
