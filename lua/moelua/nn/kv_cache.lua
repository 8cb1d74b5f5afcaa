-- moelua.nn.KVCache: the keys (after RoPE) and values of every layer for
-- the positions decoded so far, so that generating a token runs the model
-- on that one token (nn.Transformer:decode) instead of on the whole
-- context again.
--
--   local cache = KVCache.new{layers =, positions =, kv_heads =, head_dim =
--                             [, dtype = "f32", device = "cpu"]}
--   cache.len                  -- positions filled (0 after new or reset)
--   cache.layers[l].k, .v      -- [positions, kv_heads, head_dim] each
--   cache:reset()              -- len = 0 (the bytes stay reserved)
--   cache:free()
--
-- Memory: 2 * layers * positions * kv_heads * head_dim elements, taken
-- once under the ledger's `acts` (they are activations that outlive a
-- forward). Attention:decode writes rows [len, len + n) of each layer and
-- reads rows [0, len + n); the model advances len.
local tensor = require "moelua.tensor"
local mem = require "moelua.mem"

local KVCache = {}
KVCache.__index = KVCache

local function need(ok, fmt, ...)
  if not ok then error("moelua.nn.KVCache.new: " .. string.format(fmt, ...), 3) end
end

function KVCache.new(o)
  for _, k in ipairs({"layers", "positions", "kv_heads", "head_dim"}) do
    need(math.type(o[k]) == "integer" and o[k] >= 1, "option '%s' must be an integer >= 1, got %s", k, tostring(o[k]))
  end
  local self = setmetatable({len = 0, positions = o.positions, layers = {}}, KVCache)
  local shape, d = {o.positions, o.kv_heads, o.head_dim}, {dtype = o.dtype or "f32", device = o.device or "cpu"}
  for l = 1, o.layers do
    self.layers[l] = {k = mem.scope("acts", tensor.empty, shape, d), v = mem.scope("acts", tensor.empty, shape, d)}
  end
  return self
end

function KVCache:reset() self.len = 0 end

function KVCache:free()
  for _, c in ipairs(self.layers) do c.k:free(); c.v:free() end
  self.layers, self.len = {}, 0
end

return KVCache
