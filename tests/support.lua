-- tests/support.lua - helpers shared by the busted specs (tests/spec/*):
-- error capture and message checks, tensors as flat Lua tables, the
-- normwise relative error, seeded random tensors, files and temporary
-- directories, and the host run as a child process under a timeout.
--
-- Not for helpers that one spec alone needs: those stay local to that spec.
-- Loaded with `local support = require "tests.support"` (the specs run from
-- the repository root, and package.path holds ./?.lua). Defines no globals.
local assert = require "luassert"   -- the same assert busted gives the specs

local support = {}

-- ---- errors ----------------------------------------------------------------

-- Calls f(...), asserts that it raised an error, and returns the error as a
-- string.
function support.errmsg(f, ...)
  local ok, err = pcall(f, ...)
  assert.is_false(ok, "expected an error")
  return tostring(err)
end

-- Asserts that msg contains part (plain text, not a pattern).
function support.has(msg, part)
  assert.is_truthy(msg:find(part, 1, true), "expected '" .. part .. "' in: " .. msg)
end

-- Asserts that f(...) raises an error whose message contains part (plain
-- text, not a pattern).
function support.raises(part, f, ...)
  local ok, err = pcall(f, ...)
  assert(not ok, "expected an error containing: " .. part)
  err = tostring(err)
  assert(err:find(part, 1, true), string.format("error %q does not contain %q", err, part))
end

-- ---- budgets ---------------------------------------------------------------

-- Runs f with the CPU budgets changed by `b` (moelua.mem.budget's table),
-- restoring them even if f fails.
function support.with_budget(b, f)
  local mem = require "moelua.mem"
  local old = mem.budget(b)
  local ok, err = pcall(f)
  mem.budget(old)
  if not ok then error(err, 0) end
end

-- ---- tensors as Lua tables -------------------------------------------------

-- Appends the numbers of a nested table (or a single number) to out, depth
-- first, and returns out (a new table when out is nil).
function support.flatten(v, out)
  out = out or {}
  if type(v) ~= "table" then
    out[#out + 1] = v
  else
    for i = 1, #v do support.flatten(v[i], out) end
  end
  return out
end

-- The values of a CPU tensor in row-major order, as a flat table of Lua
-- numbers (a 0-dim tensor gives one value).
function support.values(t)
  return support.flatten(t:totable())
end

-- ---- normwise relative error -----------------------------------------------

-- ||x - ref|| / ||ref|| over two flat tables of the same length (asserted);
-- against a zero reference, the absolute norm ||x - ref||.
function support.relerr(x, ref)
  assert.are.equal(#ref, #x, "element count")
  local num, den = 0, 0
  for i = 1, #ref do
    num = num + (x[i] - ref[i]) ^ 2
    den = den + ref[i] ^ 2
  end
  if den == 0 then return math.sqrt(num) end
  return math.sqrt(num / den)
end

-- Asserts relerr(x, ref) <= tol. x is a flat table or a CPU tensor (its
-- values); what names the comparison in the failure message.
function support.assert_close(x, ref, tol, what)
  if type(x) ~= "table" then x = support.values(x) end
  local e = support.relerr(x, ref)
  assert(e <= tol, string.format("%s: normwise relative error %.3g > %.3g", what or "", e, tol))
end

-- ---- seeded random tensors -------------------------------------------------

-- A source of reproducible random tensors: every draw takes the next seed
-- after `seed`, so a spec gets the same tensors on every run, whatever
-- order its draws come in. dtype is the default for draws that give none
-- (nil: moelua's default).
--   gen.randn(shape, dtype, std)   normal, mean 0 (std: moelua's default 1)
--   gen.rand(shape, dtype, lo, hi) uniform on [lo, hi) (default [0, 1))
function support.generator(seed, dtype)
  local m = require "moelua"
  local gen = {}
  function gen.randn(shape, dt, std)
    seed = seed + 1
    return m.randn(shape, {dtype = dt or dtype, seed = seed, std = std})
  end
  function gen.rand(shape, dt, lo, hi)
    seed = seed + 1
    return m.rand(shape, {dtype = dt or dtype, seed = seed, lo = lo, hi = hi})
  end
  return gen
end

-- ---- files and directories -------------------------------------------------

-- The contents of a file, or nil and io.open's message when it cannot be
-- opened (so assert(support.read_file(p)) names the file).
function support.read_file(path)
  local f, err = io.open(path, "rb")
  if not f then return nil, err end
  local s = f:read("a")
  f:close()
  return s
end

-- Writes s to a file, replacing what was there.
function support.write_file(path, s)
  local f = assert(io.open(path, "wb"))
  f:write(s)
  f:close()
end

-- s as one word for /bin/sh, in single quotes.
function support.shell_quote(s)
  return "'" .. s:gsub("'", "'\\''") .. "'"
end

-- Writes a corpus that is the same on every machine to path and returns
-- path: n words of a small vocabulary drawn by a linear congruential
-- generator from seed, so a model can learn it.
function support.write_corpus(path, seed, n)
  local words = {"alpha ", "beta ", "gamma ", "delta ", "expert ", "router ", "token ", "\n"}
  local out, x = {}, seed
  for i = 1, n do
    x = (1103515245 * x + 12345) % 2147483648
    out[i] = words[(x >> 16) % #words + 1]
  end
  support.write_file(path, table.concat(out))
  return path
end

-- Makes a new empty directory under the system's temporary directory and
-- returns its path; remove_dir removes it and everything in it.
function support.make_tmpdir()
  local dir = os.tmpname()
  os.remove(dir)
  assert(os.execute("mkdir -p " .. support.shell_quote(dir)))
  return dir
end

function support.remove_dir(dir)
  os.execute("rm -rf " .. support.shell_quote(dir))
end

-- ---- the host as a child process -------------------------------------------

-- The path of the binary running this spec (./moelua, or the ASan build
-- under `make sanitize`), read from /proc/<pid>/exe: children run the same
-- host as the spec.
local host
function support.host_path()
  if host then return host end
  local pid = assert(io.open("/proc/self/stat")):read("n")
  local p = assert(io.popen("readlink /proc/" .. pid .. "/exe"))
  host = p:read("l"):gsub(" %(deleted%)$", "")
  p:close()
  return host
end

-- The shell command that runs the host with `args` (a list of words, quoted
-- here) under `timeout`: TERM after 60 s, KILL 5 s later, so a hang fails
-- its spec instead of blocking the suite. Redirections are the caller's.
function support.host_command(args)
  local words = {support.shell_quote(support.host_path())}
  for _, a in ipairs(args) do words[#words + 1] = support.shell_quote(a) end
  return "timeout -k 5 60 " .. table.concat(words, " ")
end

-- Why jobs under mpiexec cannot run here, or nil: a GPU bundle's machine
-- has no MPICH, and another MPI's mpiexec (Open MPI's) cannot start the
-- ranks of a host linked with MPICH.
function support.mpiexec_missing()
  if not os.execute("command -v mpiexec >/dev/null 2>&1") then
    return "no mpiexec on this machine: MPI jobs skipped"
  end
  if not os.execute("mpiexec --version 2>&1 | grep -q HYDRA") then
    return "this machine's mpiexec is not MPICH's (moelua is built with MPICH): MPI jobs skipped"
  end
end

-- The shell command that runs the host under `mpiexec -n n` with `args` (a
-- list of words, quoted here): one OpenMP and one OpenBLAS thread per rank,
-- killed after `limit` seconds (default 60). Under ASan, leak checks are
-- off in these children: MPICH's MPI_Init leaks 1 KiB from a library it
-- unloads (tests/run.sh says the same). Redirections are the caller's.
function support.mpiexec_command(n, args, limit)
  local words = {}
  for i, a in ipairs(args) do words[i] = support.shell_quote(a) end
  return string.format("OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 " ..
                       "ASAN_OPTIONS=\"${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0\" " ..
                       "timeout -k 1 %d mpiexec -n %d %s %s", limit or 60, n,
                       support.shell_quote(support.host_path()), table.concat(words, " "))
end

-- A new empty directory on a disk, for files that must not be on tmpfs
-- (a store's backing file refuses it, and /tmp may be one): build/<name>.
function support.disk_dir(name)
  local dir = "build/" .. name
  support.remove_dir(dir)
  assert(os.execute("mkdir -p " .. support.shell_quote(dir)))
  return dir
end

-- A moelua.store s of 4 slabs and at least 2 slots: slab i filled with
-- i + 0.5 through slot 0 and written, then each read back into slot 1, in
-- reverse, and every element checked (store_spec, gpu_store_spec).
function support.store_round_trip(s)
  local v0, v1 = s:slot(0), s:slot(1)
  for slab = 0, 3 do
    v0:fill_(slab + 0.5)
    s:write(0, slab)
  end
  for slab = 3, 0, -1 do
    s:read(slab, 1)
    for _, x in ipairs(v1:totable()) do assert.are.equal(slab + 0.5, x) end
  end
end

-- Asserts that two checkpoint directories hold byte-identical files
-- (default: the model and AdamW's two states).
function support.same_checkpoint_files(a, b, files)
  local fs = require "moelua.fs"
  for _, f in ipairs(files or {"model.safetensors", "optim/exp_avg.safetensors", "optim/exp_avg_sq.safetensors"}) do
    assert.is_not_nil(fs.stat(a .. "/" .. f), f)
    assert.are.equal(fs.sha256(a .. "/" .. f), fs.sha256(b .. "/" .. f), f)
  end
end

-- Runs tests/tools/zero_run.lua (a tiny model under moelua.zero) on n
-- ranks over the corpus with the options ({stage = 3, ...}: --stage 3);
-- asserts it exited 0 and returns per rank (0-based) the parsed
-- OUT/rank<R>.txt: {loss = {[step] =}, cur, peak, plan, run = {[what] =
-- bytes}, units = {{name, numel, shard}}, mask = {[layer] = "0110"},
-- dropped = {[layer] = n}}.
function support.zero_run(n, out, corpus, opts)
  os.execute("mkdir -p " .. support.shell_quote(out))
  local args = {"tests/tools/zero_run.lua", "--corpus", corpus, "--out", out}
  for k, v in pairs(opts) do
    args[#args + 1] = "--" .. k
    args[#args + 1] = tostring(v)
  end
  local code, text = support.finish_child(assert(io.popen(support.mpiexec_command(n, args) .. " 2>&1", "r")))
  assert.are.equal(0, code, text)
  local ranks = {}
  for r = 0, n - 1 do
    local rk = {loss = {}, cur = {}, peak = {}, units = {}, plan = {}, run = {}, mask = {}, dropped = {}}
    for line in io.lines(string.format("%s/rank%d.txt", out, r)) do
      local kind, a, b, c = line:match("^(%S+) (%S+) (%S+) ?(%S*)$")
      if kind == "loss" then rk.loss[tonumber(a)] = tonumber(b)
      elseif kind == "mask" then rk.mask[tonumber(a)] = b
      elseif kind == "dropped" then rk.dropped[tonumber(a)] = tonumber(b)
      elseif kind == "unit" then rk.units[#rk.units + 1] = {name = a, numel = tonumber(b), shard = tonumber(c)}
      else rk[kind][a] = tonumber(b) end
    end
    ranks[r] = rk
  end
  return ranks
end

-- The tensors zero_run.lua saved for rank r (its units' whole parameters).
function support.zero_params(out, r)
  return (require("moelua.io").load(string.format("%s/params.rank%d.safetensors", out, r)))
end

-- The largest absolute difference between the tensors of two tables
-- {name -> tensor} (every name of a in b).
function support.max_diff(a, b)
  local worst = 0
  for name, t in pairs(a) do worst = math.max(worst, t:sub(b[name]):abs():max():item()) end
  return worst
end

-- Reads the rest of a child's output from the io.popen handle p, closes it,
-- asserts that the child exited (rather than died by a signal), and returns
-- the exit code and the output.
function support.finish_child(p)
  local out = p:read("a")
  local _, how, code = p:close()
  assert(how == "exit", "child ended by " .. tostring(how) .. " " .. tostring(code))
  return code, out
end

-- Runs `script` in a child host and sends it SIGINT (as Ctrl-C would) once
-- it is busy; returns the exit code and everything it printed (stdout and
-- stderr). The script must print its pid on the first line
-- (io.open("/proc/self/stat"):read("n")) and then "ready" on a line of its
-- own when the work to interrupt starts, with stdout unbuffered; the signal
-- follows `delay` seconds after "ready".
function support.interrupt_child(script, delay)
  local path = os.tmpname()
  support.write_file(path, script)
  local p = assert(io.popen(support.host_command({path}) .. " 2>&1", "r"))
  local pid = p:read("n")
  assert(pid, "the child printed no pid")
  p:read("l")
  assert.are.equal("ready", p:read("l"))
  require("system").sleep(delay)
  assert(os.execute("kill -INT " .. math.tointeger(pid)))
  local code, out = support.finish_child(p)
  os.remove(path)
  return code, out
end

-- ---- a child on a pseudo-terminal ------------------------------------------

-- Runs the shell command `command` on a pty (util-linux `script`, under
-- `timeout -k 2 60`), with keystrokes from a FIFO and the screen copied into
-- a typescript file that the session polls with a deadline. `base` is a
-- path prefix for its three files (.in, .ts, .status); `env` a string of
-- VAR=value words put before the command (already quoted).
--   s = support.pty(dir .. "/s1", support.shell_quote(host) .. " attach run")
--   s:expect("attach> ", true)    -- waits, consumes up to the match, returns it
--   s:line("1 + 1", "attach> ")   -- types a line, returns the output up to the next prompt
--   local status, screen = s:finish()   -- Ctrl-D, then the exit status
-- A run directory's metrics.jsonl, decoded: every line, in order (steps
-- and events), or with kind only the events of that kind.
function support.metrics(dir, kind)
  local json = require "dkjson"
  local out = {}
  for line in io.lines(dir .. "/metrics.jsonl") do
    local o = json.decode(line)
    if kind == nil or o.event == kind then out[#out + 1] = o end
  end
  return out
end

-- A router collapse planted into model: from step `from` on, the next
-- `times` forwards report layer 1's loads as `counts` (default the
-- collapsed top-2 layer {255, 0, 257, 0}), as a collapsed router would.
function support.plant_collapse(model, from, times, counts)
  local tensor = require "moelua.tensor"
  local forward, planted = model.forward, 0
  model.forward = function(self, tokens, s)
    local l, st = forward(self, tokens, s)
    if s >= from and planted < times then
      planted = planted + 1
      st.layers[1].counts = tensor.tensor(counts or {255, 0, 257, 0}, {dtype = "i64"})
    end
    return l, st
  end
end

local Pty = {}
Pty.__index = Pty

function support.pty(base, command, env, timeout)
  local q = support.shell_quote
  local s = setmetatable({fifo = base .. ".in", ts = base .. ".ts", st = base .. ".status", pos = 0,
                          timeout = timeout or 20}, Pty)
  assert(os.execute("mkfifo " .. q(s.fifo)))
  local cmd = string.format(
    "(%s TERM=dumb INPUTRC=/dev/null timeout -k 2 60 script -qfec %s %s <%s >/dev/null 2>&1;" ..
    " echo $? >%s) >/dev/null 2>&1 &",
    env or "", q("exec " .. command), q(s.ts), q(s.fifo), q(s.st))
  assert(os.execute(cmd))
  s.keys = assert(io.open(s.fifo, "r+"))  -- read-write: never blocks, never EOF early
  s.keys:setvbuf("no")
  return s
end

function Pty:send(keys) self.keys:write(keys) end

-- Waits until `pattern` (a Lua pattern, or plain text when `plain`) appears
-- in the screen after what earlier expects consumed; consumes up to the end
-- of the match and returns the text consumed.
function Pty:expect(pattern, plain)
  local system = require "system"
  local deadline = system.gettime() + self.timeout
  while true do
    local out = support.read_file(self.ts) or ""
    local a, b = out:find(pattern, self.pos + 1, plain)
    if a then
      local seen = out:sub(self.pos + 1, b)
      self.pos = b
      return seen
    end
    if system.gettime() > deadline then
      error(string.format("no %q within %d s; the screen after the last match:\n%s",
                          pattern, self.timeout, out:sub(self.pos + 1)), 2)
    end
    system.sleep(0.01)
  end
end

-- Types a line and waits for `prompt` (plain text) after its output;
-- returns the output, the echoed line included.
function Pty:line(text, prompt)
  self:send(text .. "\n")
  return self:expect(prompt, true)
end

-- Ctrl-D, then the exit status of the command and the whole screen.
function Pty:finish()
  local system = require "system"
  self:send("\4")
  local deadline = system.gettime() + self.timeout
  local status
  repeat
    status = support.read_file(self.st)
    if not status or status == "" then
      status = nil
      system.sleep(0.01)
    end
  until status or system.gettime() > deadline
  self.keys:close()
  assert(status, "the command on the pty did not exit after Ctrl-D")
  return tonumber(status), support.read_file(self.ts)
end

return support
