-- moelua.repl: the Lua side of `moelua -i` (host/bindings/repl.c): how a result
-- prints, and help(). The printer itself is moelua.pretty, shared with
-- `moelua attach`.
--
--   repl.print(...)   each value by pretty.show (a table nested and
--                     bounded, a string as it is), tab-separated, as print
--   repl.help()       -> the text of help(), which host/bindings/repl.c makes a
--                     global of the REPL (unless one is defined already)
local pretty = require "moelua.pretty"

local repl = {}

function repl.print(...)
  local parts = {}
  for i = 1, select("#", ...) do parts[i] = pretty.show((select(i, ...))) end
  print(table.concat(parts, "\t"))
end

local HELP = [[
moelua REPL: each line is Lua; an expression prints its value (tables nested
and bounded by moelua.pretty.show(v, {depth =, items =, string =, width =})).
  m = require "moelua"          tensors: m.tensor, m.zeros, m.ones, m.randn, m.rand, m.matmul,
                                m.manual_seed, m.threads; a tensor prints its shape and a few values
  m.mem.report(), m.mem.stats() the memory ledger (bytes by category, peaks); m.mem.budget{...}
  require "moelua.nn"           nn.Transformer.new{...}, nn.Transformer.from_checkpoint(dir)
  require "moelua.optim"        optim.AdamW(groups, {lr =}), optim.SGD, optim.clip_grad_norm
  require "moelua.data"         data.open{glob =, seq_len =}: ds:batch(i), ds:validation(i)
  require "moelua.train"        train.run{model =, data =, optimizer =, ...}, train.plan{...}
  require "moelua.ckpt"         ckpt.list(dir), ckpt.latest(dir), ckpt.load(dir)
  require "moelua.plot"         plot.run(run_dir [, out_dir]): the run's SVG plots
  inspect = require "moelua.inspect"   routing of a checkpoint:
    h = inspect.open(ckpt_dir)          the model rebuilt from a checkpoint
    r = h:run(text_or_path, {seq_len =})  a report: per layer counts, shares, entropy, per-token ids
    inspect.summary(r)                  every layer: tokens, entropy, cv, max/even, dead, hot, drops
    inspect.histogram(r, layer)         load per expert, as bars
    inspect.tokens(r, layer)            the text, each byte tagged by its top expert
    inspect.top_tokens(r, layer, n)     each expert's n most frequent bytes
    inspect.compare(r1, r2, layer)      per-expert share changes beyond noise (3 standard errors)
    h:generate(prompt, {n =, temperature =, top_p =, seed =})  text, and per token each layer's
                                        top-k experts (trace[i].layers) and weights (trace[i].weights)
    inspect.loads(run_dir [, layer])    per-expert load over a run's steps (metrics.jsonl), as a chart
  help()                        this text
Ctrl-C interrupts a computation; Ctrl-D leaves. A running job: `moelua attach RUN_DIR` (its own help()).]]

function repl.help() return HELP end

return repl
