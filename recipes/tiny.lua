-- recipes/tiny.lua: recipes/longctx.lua at smoke-test size (seconds, not
-- minutes). These defaults replace longctx's (--help lists them); options
-- given on the command line override them:
--   ./moelua recipes/tiny.lua [--steps 20 ...]
arg.defaults = {["seq-len"] = 256, steps = 12, dim = 32, ffn = 64, warmup = 2, ["run-dir"] = "runs/tiny",
                ["ckpt-every"] = 6}
local here = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
dofile(here .. "longctx.lua")
