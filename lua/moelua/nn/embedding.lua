-- moelua.nn.Embedding: token embedding over a weight view [V, D] the model
-- owns (a slice of its flat "embed" unit). One C call per method
-- (moelua.ops.embedding_*).
--   local emb = Embedding.new{weight = W, grad = dW}     -- [V, D] views
--   local h = emb:forward(ids)        -- ids i64 [T] -> [T, D] (new tensor)
--   emb:backward(dh, ids)             -- dW += scatter of dh (accumulates)
local ops = require "moelua.ops"

local Embedding = {}
Embedding.__index = Embedding

function Embedding.new(o)
  return setmetatable({weight = o.weight, grad = o.grad}, Embedding)
end

function Embedding:forward(ids)
  return ops.embedding_forward(ids, self.weight)
end

function Embedding:backward(dout, ids)
  ops.embedding_backward(dout, ids, self.grad)
end

return Embedding
