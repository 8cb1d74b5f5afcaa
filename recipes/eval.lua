-- recipes/eval.lua: evaluate a Mixtral-format checkpoint on a text file.
--
--   ./moelua recipes/eval.lua --ckpt runs/longctx/ckpt --data FILE [--seq-len N] [--json] [--grad-norms]
--
-- The model is rebuilt from the checkpoint's config.json (MixtralConfig keys,
-- nn.Transformer.from_config) and its weights loaded by name
-- (model:load_named: every name, shape and dtype checked). FILE is cut into
-- its full (S+1)-token windows in order, no shuffling (a last partial window
-- is left out). Printed, as one JSON object with --json:
--   loss      mean next-token cross-entropy over the S predictions of every window
--   aux_loss  Hugging Face's load_balancing_loss_func over all layers and windows
--             as one batch: E * sum_e (C_e / N) (P_e / N), N = layers x tokens,
--             C_e top-k assignments, P_e summed router probabilities (unweighted)
--   z_loss    ST-MoE router z-loss: mean over (layer, token) of logsumexp(router logits)^2
--   tokens    predictions counted (windows x S); also windows, seq_len, ckpt, data
-- --grad-norms adds grad_norms = {HF name -> L2 norm of d(loss)/d(tensor)}:
-- the gradient of the mean CE with weight 1 (aux and z weights 0).
-- Routing is deterministic here: temperature 1, no gate noise, no epsilon.
local moelua = require "moelua"
local nn = require "moelua.nn"
local data = require "moelua.data"
local options = require "moelua.options"
local errors = require "moelua.errors"
local optim_c = require "moelua.optim_c"
local json = require "dkjson"
local tensor = moelua

local opts = options.parse(arg, {
  {"ckpt", "", "checkpoint: a step directory, a ckpt root with `latest`, or a Mixtral directory"},
  {"data", "", "the text file to evaluate (read as bytes unless --format says otherwise)"},
  {"format", "bytes", "token format of --data: bytes, u16 or u32 (pre-tokenized .bin)",
   choices = {"bytes", "u16", "u32"}},
  {"seq-len", 1024, "predictions per window (windows are seq-len + 1 tokens)", min = 1},
  {"json", false, "print one JSON object"},
  {"grad-norms", false, "add per-tensor gradient L2 norms of the mean loss, by HF name"},
  {"checkpoint", "none", "activation checkpointing per layer: none, attention, moe, full"},
  {"threads", 2, "CPU threads", min = 1, max = 1024},
}, "usage: moelua recipes/eval.lua --ckpt DIR --data FILE [options]")
if opts.ckpt == "" then errors.user("recipes/eval.lua: --ckpt DIR is required") end
if opts.data == "" then errors.user("recipes/eval.lua: --data FILE is required") end
moelua.threads(opts.threads)

local model, c = nn.Transformer.from_checkpoint(opts.ckpt, {checkpoint = opts.checkpoint})

local S, W = opts.seq_len, opts.seq_len + 1
local st = moelua.fs.stat(opts.data)
if not st or st.type ~= "file" then errors.user("recipes/eval.lua: --data '" .. opts.data .. "' is not a readable file") end
local width = ({bytes = 1, u16 = 2, u32 = 4})[opts.format]
if st.size // width < W then
  errors.user(string.format("recipes/eval.lua: '%s' has %d tokens, fewer than one window of %d (--seq-len %d + 1)",
                            opts.data, st.size // width, W, S))
end
local ds = data.open{paths = {opts.data}, format = opts.format, seq_len = opts.seq_len}
local nwin = ds.n_tokens // W

local E = model.opts.experts
local C = tensor.zeros({E}, {dtype = "f64"})   -- top-k assignments, all layers and windows
local P = tensor.zeros({E}, {dtype = "f64"})   -- summed router probabilities
local loss_sum, z_sum, n_lt = 0, 0, 0
model:zero_grad()
for i = 1, nwin do
  local tokens = ds:window((i - 1) * W)
  if opts.format ~= "bytes" then   -- a token file for another vocabulary: say so, not the embedding's bounds check
    local f = tokens:to("f64")
    local top = math.tointeger(f:max():item())
    f:free()
    if top >= model.opts.vocab then
      errors.user(string.format("recipes/eval.lua: --data '%s' (--format %s) holds token id %d, outside the " ..
                                "checkpoint's vocabulary of %d", opts.data, opts.format, top, model.opts.vocab))
    end
  end
  local loss, st = model:forward(tokens, 0)
  loss_sum = loss_sum + loss
  for _, l in ipairs(st.layers) do
    local cnt = l.counts:to("f64")
    C:add_(cnt)
    cnt:free()
    P:add_(l.psum)
    z_sum = z_sum + l.z * l.tokens
    n_lt = n_lt + l.tokens
  end
  if opts.grad_norms then
    model:backward{ce_weight = 1 / nwin, aux_weight = 0, z_weight = 0}
  end
  tokens:free()
end

local out = {
  loss = loss_sum / nwin,
  aux_loss = E * C:mul(P):sum():item() / (n_lt * n_lt),
  z_loss = z_sum / n_lt,
  tokens = nwin * S, windows = nwin, seq_len = S, ckpt = c.dir, data = opts.data,
}
if opts.grad_norms then
  out.grad_norms = {}
  for _, g in ipairs(model:named_gradients()) do out.grad_norms[g.name] = optim_c.grad_norm({g.tensor}) end
end

local text
if opts.json then
  local keys = {"loss", "aux_loss", "z_loss", "tokens", "windows", "seq_len", "ckpt", "data", "grad_norms"}
  for _, g in ipairs(opts.grad_norms and model:named_gradients() or {}) do keys[#keys + 1] = g.name end
  text = json.encode(out, {keyorder = keys}) .. "\n"
else
  text = string.format("%s on %s: %d windows of %d tokens\n", c.dir, opts.data, nwin, W) ..
         string.format("  loss %.6f (ppl %.3f)  aux_loss %.6f  z_loss %.6f  tokens %d\n",
                       out.loss, math.exp(out.loss), out.aux_loss, out.z_loss, out.tokens)
  if out.grad_norms then
    local total = 0
    for _, v in pairs(out.grad_norms) do total = total + v * v end
    text = text .. string.format("  gradient norm %.6g over %d tensors (--json lists them)\n", math.sqrt(total),
                                 #model:named_gradients())
  end
end
-- one write, checked: a full disk or a closed pipe is an error, not a silent exit 0
errors.written("recipes/eval.lua: writing the result", io.stdout:write(text))
errors.written("recipes/eval.lua: writing the result", io.stdout:flush())
