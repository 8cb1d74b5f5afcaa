-- moelua.balance: how evenly one MoE layer spreads its tokens, measured
-- against the even share. The trainer's balance alarms and
-- inspect.summary both read a layer through this one function.
--
-- With T tokens, top-k and E experts, a layer makes T·k assignments;
-- expert e's load is its share of them, count_e / (T·k), and the even
-- share is 1/E. Its ratio r_e = load_e / (1/E) is 1 when balanced, 0 when
-- the expert gets nothing, and at most E/k (every token picks it: a token
-- picks k distinct experts). Thresholds are in these units:
--   hot       an expert with r_e >= hot
--   collapse  the k busiest experts together hold >= collapse times their
--             even share k/E, i.e. routing has fallen onto k experts
--   dead      an expert with no tokens
-- The defaults sit a fixed part of the way from even (1) to the most top-k
-- allows (E/k): hot 75%, collapse 80%. At E=4, k=2 (at most 2) they are
-- 1.75 and 1.8: loads [231, 3, 255, 23] are hot (1.80, 1.99) and collapsed
-- (1.90); at E=8, k=2 they are 3.25 and 3.4. A fixed multiple would fire
-- on every step of a small-E model or never on a large-E one. (A healthy
-- tiny run, tests/spec/balance_spec.lua, stays under both but for a step
-- or three: the trainer raises an alarm only after `steps` in a row.)
local balance = {}

-- Default thresholds for E experts, top-k; opts {hot =, collapse =} win.
function balance.thresholds(E, k, opts)
  opts = opts or {}
  local reach = E / k - 1
  if reach <= 0 then return {hot = math.huge, collapse = math.huge} end   -- k >= E: every expert, every token
  return {hot = opts.hot or 1 + 0.75 * reach, collapse = opts.collapse or 1 + 0.8 * reach}
end

-- balance.layer(counts, k [, opts]): counts is the list of per-expert
-- assignment counts (expert e at index e+1). Returns {tokens (T), assignments
-- (T·k), ratios = {r_e}, max_ratio, busiest (0-based id), topk_ratio (the k
-- busiest together, against k/E), cv (coefficient of variation of the
-- counts), dead = {ids}, hot = {ids}, collapsed (bool), thresholds}.
function balance.layer(counts, k, opts)
  local E = #counts
  if E == 0 then error("moelua.balance.layer: no experts in counts", 2) end
  local n = 0
  for _, c in ipairs(counts) do n = n + c end
  local th = balance.thresholds(E, k, opts)
  local s = {tokens = n // k, assignments = n, ratios = {}, max_ratio = 0, busiest = 0, dead = {}, hot = {},
             thresholds = th}
  local sorted, mean, var = {}, n / E, 0
  for e, c in ipairs(counts) do
    local r = n > 0 and c * E / n or 0
    s.ratios[e] = r
    if r > s.max_ratio then s.max_ratio, s.busiest = r, e - 1 end
    if c == 0 then s.dead[#s.dead + 1] = e - 1 end
    if n > 0 and r >= th.hot then s.hot[#s.hot + 1] = e - 1 end
    sorted[e] = c
    var = var + (c - mean) ^ 2
  end
  table.sort(sorted, function(a, b) return a > b end)
  local top = 0
  for i = 1, math.min(k, E) do top = top + sorted[i] end
  s.topk_ratio = n > 0 and top / n / (math.min(k, E) / E) or 0
  s.collapsed = n > 0 and s.topk_ratio >= th.collapse
  s.cv = mean > 0 and math.sqrt(var / E) / mean or 0
  return s
end

return balance
