-- recipes/tiny.lua: recipes/longctx.lua at smoke-test size (seconds, not
-- minutes). Options given on the command line override these defaults:
--   ./moelua recipes/tiny.lua [--steps 20 ...]
local defaults = {"--seq-len", "256", "--steps", "12", "--dim", "32", "--ffn", "64", "--warmup", "2",
                  "--run-dir", "runs/tiny", "--ckpt-every", "6"}
local args = {[0] = arg[0]}
for _, a in ipairs(defaults) do args[#args + 1] = a end
for _, a in ipairs(arg) do args[#args + 1] = a end   -- later values win
arg = args
local here = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
dofile(here .. "longctx.lua")
