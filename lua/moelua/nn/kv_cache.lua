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
local options = require "moelua.options"

local KVCache = {}
KVCache.__index = KVCache

local SIZE = {"integer", min = 1}
local OPTIONS = {layers = SIZE, positions = SIZE, kv_heads = SIZE, head_dim = SIZE, dtype = {"string", false},
                 device = {"string", false}}

-- raised at KVCache.new's caller: past this closure and options.check
local function fail(fmt, ...) error("moelua.nn.KVCache.new: " .. string.format(fmt, ...), 4) end

function KVCache.new(o)
  o = options.check(o, OPTIONS, fail)
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
