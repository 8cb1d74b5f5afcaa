-- moelua: the Lua face of the host. Tensor functions come from the C
-- library moelua.tensor; this module gathers the libraries into one table.
--   local moelua = require "moelua"
--   local x = moelua.randn({4, 8})
--   print(moelua.mem.report())
local tensor = require "moelua.tensor"

local moelua = {}
for k, v in pairs(tensor) do moelua[k] = v end

moelua.mem = require "moelua.mem"
moelua.pool = require "moelua.pool"
moelua.bench = require "moelua.bench"
moelua.router = require "moelua.router"
moelua.experts = require "moelua.experts"
moelua.optim = require "moelua.optim"
moelua.ops = require "moelua.ops"
moelua.fs = require "moelua.fs"
moelua.inspect = require "moelua.inspect"
moelua.dist = require "moelua.dist"

local io = require "moelua.io"
moelua.save, moelua.load = io.save, io.load

return moelua
