-- moelua.nn.MoEBlock: HF's block_sparse_moe (MixtralSparseMoeBlock) as a
-- module: the moelua.moe layer (chunked fp32 router, dispatch, tiled
-- SwiGLU experts) placed on views the model owns (router wg in the block's
-- dense unit; gate_up and down in its experts unit) and on the model's stack
-- pool (the layer never resets it; the model marks and rewinds).
--   local b = MoEBlock.new(moe_opts, {params = {wg =, gate_up =, down =}, grads = {...}, pool = p})
--   local y, stats = b:forward(x, step)    -- y [S, D] (pool view)
--   local dx = b:backward(dy, coef)        -- coef from moe.aux_loss
local moe = require "moelua.moe"

local MoEBlock = {}
MoEBlock.__index = MoEBlock

function MoEBlock.new(opts, units)
  return setmetatable({layer = moe.new(opts, units)}, MoEBlock)
end

function MoEBlock:forward(x, step, route_only)
  return self.layer:forward(x, step, route_only)
end

function MoEBlock:backward(dy, coef)
  return self.layer:backward(dy, coef)
end

return MoEBlock
