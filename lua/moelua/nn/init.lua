-- moelua.nn: the model's modules as Torch7-style classes (each method makes
-- C calls through moelua.ops / moelua.moe; no element loops in Lua).
--   local nn = require "moelua.nn"
--   local model = nn.Transformer.new{vocab = 256, dim = 64, layers = 2, ...}
return {
  Embedding = require "moelua.nn.embedding",
  RMSNorm = require "moelua.nn.rmsnorm",
  Attention = require "moelua.nn.attention",
  MoEBlock = require "moelua.nn.moe_block",
  LMHead = require "moelua.nn.lm_head",
  KVCache = require "moelua.nn.kv_cache",
  Transformer = require "moelua.nn.transformer",
}
