-- recipes/demo.lua: a one-second tour of tensors and the memory ledger.
-- Tensors live in the memory ledger: every byte is tagged with a category,
-- and the account book shows current and peak bytes per category.
local moelua = require "moelua"
local mem = moelua.mem
require("moelua.options").parse(arg, {}, "usage: moelua recipes/demo.lua")   -- no options: --help says so

moelua.manual_seed(1234)
local T, D, E, K = 4096, 256, 8, 2   -- tokens, model dim, experts, top-k

-- "parameters": a router weight [E, D], allocated under `params`
local wg = mem.scope("params", moelua.randn, {E, D}, {std = 0.02})

-- "activations": hidden states and router logits [T, E] under `acts`
local x, probs, topv, topi = mem.scope("acts", function()
  local x = moelua.randn({T, D})
  local logits = moelua.matmul(x, wg:t())        -- [T, D] x [D, E], transpose as a BLAS flag
  local probs = logits:softmax()
  local topv, topi = probs:topk(K)               -- ties go to the lower expert index
  return x, probs, topv, topi
end)

-- expert load: how many of the T*K assignments each expert received
local load = moelua.bincount(topi:reshape(T * K), E)
print("router probabilities:", probs)
print("top-k weights:       ", topv)
print("tokens per expert:   ", table.concat(load:totable(), " "))
local share = load:to("f64"):div(T * K):max():item()
print(string.format("largest expert share: %.1f%% (uniform would be %.1f%%)", 100 * share, 100 / E))

-- a transient under `other`, freed at once: the peak remembers it
do
  local scratch <close> = moelua.zeros({T, 4 * D})
end
print(mem.report())
