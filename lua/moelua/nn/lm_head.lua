-- moelua.nn.LMHead: the output projection with cross-entropy computed in
-- vocabulary chunks (moelua.ops.cross_entropy_*: never a [T, V] logits
-- tensor; rows x chunk scratch only). weight [V, D] is a view into the
-- model's "final" unit; the loss is the mean over the S rows (f64).
--   local head = LMHead.new{weight = W, grad = dW, rows = 256, chunk = 4096}
--   local loss, lse = head:forward(h, targets)   -- h [S, D], targets i64 [S]
--   local dh = head:backward(h, targets, lse [, dloss = 1])  -- dW += ...
local ops = require "moelua.ops"

local LMHead = {}
LMHead.__index = LMHead

function LMHead.new(o)
  return setmetatable({weight = o.weight, grad = o.grad,
                       ce = {rows = o.rows or 256, chunk = o.chunk or 4096}}, LMHead)
end

function LMHead:forward(h, targets)
  return ops.cross_entropy_forward(h, self.weight, targets, self.ce)
end

function LMHead:backward(h, targets, lse, dloss)
  local opts = {rows = self.ce.rows, chunk = self.ce.chunk, dW = self.grad}
  local dh = ops.cross_entropy_backward(dloss or 1.0, h, self.weight, targets, lse, opts)
  return dh
end

return LMHead
