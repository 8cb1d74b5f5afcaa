-- tests/spec/plan_cli_spec.lua - `moelua plan RECIPE [--max-seq]`
-- (moelua.plan_cli): the recipe's account book with nothing allocated, the
-- phase of its peak (mem.phase), and the longest sequence that fits.
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
    assert.is_not_nil(out:find("^moelua plan: recipes/longctx.lua %(cpu%): peak [%d.]+ MiB of a [%d.]+ MiB budget, " ..
                               "in backward, layer %d of %d\n"), out)
    for _, part in ipairs{"\n  cpu                peak        at peak   share\n", "\n  cache    ",
                          "\n  file               peak", "the step's stack pool is reserved at",
                          "outside the ledger (not planned)"} do
      support.has(out, part)
    end
    assert.is_nil(out:find("moelua longctx:", 1, true), "the run was not made: " .. out)
    assert.is_nil(fs.stat(run_dir), "nothing was written")
  end)

  it("refuses a plan over the budget with the recipe's own error", function()
    local code, out = host({"plan", "recipes/longctx.lua", "--seq-len", "65536", "--budget-gib", "0.05"})
    assert.are.equal(1, code, out)
    support.has(out, "--seq-len 65536 needs ")
    support.has(out, "over the budget of 51.2 MiB (--budget-gib 0.05)")
  end)

  it("needs a recipe", function()
    local code, out = host({"plan"})
    assert.are.equal(1, code, out)
    support.has(out, "usage: moelua plan RECIPE [--max-seq] [recipe options]")
  end)

  it("--max-seq: the answer trains under the budget, 1.1 x the answer is refused", function()
    local budget = {"--budget-gib", "0.08", "--dim", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1",
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
