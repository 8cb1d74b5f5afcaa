-- tests/tools/cuda_emu/launch.lua - rewrites a .cu file for the emulator
-- (emu.h): each CUDA launch `k<T><<<g, b, s, st>>>(args);` into
-- `emu_launch([=] { k<T>(args); }, g, b, s, st);`, each dynamic shared
-- array into a pointer to the emulator's, and drops nvcc's `#pragma
-- unroll` hints (g++ warns on them; they change no result). Everything
-- else passes through; #line keeps the compiler's and the emulator's line
-- numbers those of the .cu file. Usage (lua5.4, a make deps package):
--   lua5.4 launch.lua in.cu out.cpp

-- The start of the kernel expression that ends just before s[i]: a name
-- (with ::) after balanced template arguments <...>.
local function callee_start(s, i)
  local j = i
  while j > 1 and s:sub(j - 1, j - 1) == ">" do
    local depth = 0
    j = j - 1
    repeat
      local c = s:sub(j, j)
      depth = depth + (c == ">" and 1 or c == "<" and -1 or 0)
      if depth > 0 then j = j - 1 end
    until depth == 0
  end
  while j > 1 and s:sub(j - 1, j - 1):match("[%w_:]") do j = j - 1 end
  return j
end

-- The index just past the bracket that closes the one at s[i].
local function balanced(s, i, open, close)
  local depth = 0
  for j = i, #s do
    local c = s:sub(j, j)
    depth = depth + (c == open and 1 or c == close and -1 or 0)
    if depth == 0 then return j + 1 end
  end
  error(string.format("unbalanced %s at %d", open, i))
end

local function rewrite(s)
  local out, pos = {}, 1
  while true do
    local i = s:find("<<<", pos, true)
    if not i then return table.concat(out) .. s:sub(pos) end
    local k = callee_start(s, i)
    local e = s:find(">>>", i, true)
    local a = s:find("%S", e + 3)
    local b = balanced(s, a, "(", ")")
    out[#out + 1] = s:sub(pos, k - 1)
    out[#out + 1] = string.format("emu_launch([=] { %s%s; }, %s)", s:sub(k, i - 1), s:sub(a, b - 1),
                                  s:sub(i + 3, e - 1))
    pos = b
  end
end

local src, dst = arg[1], arg[2]
local text = assert(io.open(src)):read("a")
-- `extern __shared__ [__align__(n)] T name[];` -> `T *name = (T *)emu_dyn_shared;`
text = text:gsub("extern%s+__shared__%s+([^;%[]-)%s+([%w_]+)%[%];", function(ty, name)
  ty = ty:gsub("^__align__%(%d+%)%s+", "")
  return string.format("%s *%s = (%s *)emu_dyn_shared;", ty, name, ty)
end)
-- `#pragma unroll [n]` -> an empty line (the line numbers stay the .cu's)
text = text:gsub("\n[ \t]*#[ \t]*pragma[ \t]+unroll[^\n]*", "\n")
local f = assert(io.open(dst, "w"))
f:write(string.format('#line 1 "%s"\n', src), rewrite(text))
f:close()
