-- moelua.measure: the small statistics the benchmark recipes share.
--   measure.median({3, 1, 2}) -> 2
--   measure.peak_rss()        -> the process's peak resident bytes (VmHWM)
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

return measure
