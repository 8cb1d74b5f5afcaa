-- moelua.nn.LMHead: the output projection with cross-entropy computed in
-- vocabulary chunks (moelua.ops.cross_entropy_*: never a [T, V] logits
-- tensor; rows x chunk scratch only). weight [V, D] is a view into the
-- model's "final" unit; the loss is the mean over the S rows (f64).
--   local head = LMHead.new{weight = W, grad = dW, rows = 256, chunk = 4096}
--   local loss, lse = head:forward(h, targets)   -- h [S, D], targets i64 [S]
--   local dh = head:backward(h, targets, lse [, dloss = 1])  -- dW += ...
-- profile (optional): a table whose `ce` (seconds) and `ce_flop` (2 S D V
-- forward, 6 S D V backward: logits recomputed, dh, dW) each call adds to.
local ops = require "moelua.ops"
local now = require("moelua.bench").now

local LMHead = {}
LMHead.__index = LMHead

function LMHead.new(o)
  return setmetatable({weight = o.weight, grad = o.grad, profile = o.profile,
                       ce = {rows = o.rows or 256, chunk = o.chunk or 4096}}, LMHead)
end

local function account(self, t0, h, mult)
  local pf = self.profile
  pf.ce = pf.ce + (now(h:device()) - t0)
  pf.ce_flop = pf.ce_flop + mult * h:size(1) * h:size(2) * self.weight:size(1)
end

function LMHead:forward(h, targets)
  local t0 = self.profile and now(h:device())
  local loss, lse = ops.cross_entropy_forward(h, self.weight, targets, self.ce)
  if t0 then account(self, t0, h, 2) end
  return loss, lse
end

function LMHead:backward(h, targets, lse, dloss)
  local opts = {rows = self.ce.rows, chunk = self.ce.chunk, dW = self.grad}
  local t0 = self.profile and now(h:device())
  local dh = ops.cross_entropy_backward(dloss or 1.0, h, self.weight, targets, lse, opts)
  if t0 then account(self, t0, h, 6) end
  return dh
end

return LMHead
