-- moelua.nn.RMSNorm: y = x / sqrt(mean(x^2) + eps) * w (HF MixtralRMSNorm;
-- in the parameter dtype, fp32 on CPU runs, statistics in f64). The weight
-- [D] and its gradient are views into the model's flat units.
--   local n = RMSNorm.new{weight = w, grad = dw, eps = 1e-5}
--   local y, rstd = n:forward(x)      -- x [..., D]; rstd f64 [N] (saved)
--   local dx = n:backward(dy, x, rstd) -- dw += (accumulates); dx new
local ops = require "moelua.ops"

local RMSNorm = {}
RMSNorm.__index = RMSNorm

function RMSNorm.new(o)
  return setmetatable({weight = o.weight, grad = o.grad, eps = o.eps or 1e-5}, RMSNorm)
end

function RMSNorm:forward(x)
  return ops.rmsnorm_forward(x, self.weight, self.eps)
end

function RMSNorm:backward(dy, x, rstd)
  local dx = ops.rmsnorm_backward(dy, x, self.weight, rstd, self.grad)
  return dx
end

return RMSNorm
