-- moelua.measure: the small statistics the benchmark recipes share.
--   measure.median({3, 1, 2}) -> 2
--   measure.peak_rss()        -> the process's peak resident bytes (VmHWM)
--   measure.cpu()             -> {model = "AMD EPYC ...", flags = {"fma", "avx2", ...}}
local measure = {}

-- The median of a list of numbers (the list is not modified).
function measure.median(xs)
  local s = {}
  for j, v in ipairs(xs) do s[j] = v end
  table.sort(s)
  local n = #s
  return n % 2 == 1 and s[(n + 1) // 2] or (s[n // 2] + s[n // 2 + 1]) / 2
end

function measure.peak_rss()
  for line in io.lines("/proc/self/status") do
    local kb = line:match("^VmHWM:%s+(%d+)")
    if kb then return tonumber(kb) * 1024 end
  end
end

-- The first processor's model name and which of the SIMD flags that pick
-- kernels it has (fma, avx2, avx512f, avx512bw): every benchmark table
-- states them.
local SIMD = {"fma", "avx2", "avx512f", "avx512bw"}
function measure.cpu()
  local out = {model = "unknown", flags = {}}
  local f = io.open("/proc/cpuinfo")
  if not f then return out end
  for line in f:lines() do
    local model, fl = line:match("^model name%s*:%s*(.+)$"), line:match("^flags%s*:%s*(.+)$")
    if model and out.model == "unknown" then out.model = model end
    if fl then
      for _, want in ipairs(SIMD) do
        if (" " .. fl .. " "):find(" " .. want .. " ", 1, true) then out.flags[#out.flags + 1] = want end
      end
      break
    end
  end
  f:close()
  return out
end

return measure
