-- The combined check-and-charge of one request (extproc/budgets/redis_store.py encodes the call; the same
-- algorithm in Python: memory_store.py). Every check passes, then everything is charged; or nothing is.
-- KEYS: markers[1..nm]; retry (8): pool a cur/prev, pool r cur/prev, tenant a cur/prev, tenant r cur/prev;
--       task (2): hash, active zset; quota (2): cur, prev
-- ARGV[1]: space-separated numbers (one string: packing 25 separate arguments costs the client more than the
--   server spends splitting): 1 now, 2 nm, 3 inflight_ttl_ms, 4 retry_hint, 5 r_on, 6 share, 7 floor, 8 r_frac,
--   9 r_ttl_ms, 10 t_on, 11 cost, 12 max_calls, 13 max_tokens, 14 max_wall_s, 15 max_active, 16 ttl_ms,
--   17 active_score (now + inflight_ttl), 18 q_on, 19 q_cost, 20 q_limit, 21 q_frac, 22 q_ttl_ms
-- ARGV[2]: charge token; ARGV[3]: task member
-- Returns, admitted: one string, is_retry ('0' / '1') and with the retry check on the 8 retry window counts in
-- KEYS order as they stand after this call, space-separated; refused: {code, is_retry, ...}, a retry refusal
-- ({2, 1, scope, retries, allowed, w}) with the same 8 counts as one such string w. The sidecar mirrors the counts
-- to tell a refused client whether its retry would be admitted. Strings, not arrays of numbers: redis-py parses
-- one bulk reply in a fraction of the time it takes for each element of an array (8 integers: about 35 us).
local a = {}
for v in string.gmatch(ARGV[1], '%S+') do a[#a + 1] = v end
local now = tonumber(a[1])
local nm = tonumber(a[2])
local is_retry = tonumber(a[4])
local r_on = a[5] == '1'
local t_on = a[10] == '1'
local q_on = a[18] == '1'
for i = 1, nm do
  local v = redis.call('GET', KEYS[i])
  if v then
    if v ~= '0' then return {1, 1, KEYS[i]} end
    is_retry = 1
  end
end
local k = nm
local rk = k
local w = {}  -- the retry window counts, read once (KEYS order, as Redis holds them), returned to be mirrored
if r_on then
  k = k + 8
  local m = redis.call('MGET', unpack(KEYS, rk + 1, rk + 8))  -- one call: 8 GETs took twice the server's time
  for i = 1, 8 do w[i] = m[i] or '0' end  -- kept as strings: only a retry's check needs numbers
  if is_retry == 1 then
    local share = tonumber(a[6])
    local floor_ = tonumber(a[7])
    local keep = 1 - tonumber(a[8])
    local scopes = {'pool', 'tenant'}
    for j = 1, 0, -1 do  -- the tenant's own share first; the pool's only past the tenant's floor
      local b = j * 4
      local adm = tonumber(w[b + 1]) + tonumber(w[b + 2]) * keep
      local ret = tonumber(w[b + 3]) + tonumber(w[b + 4]) * keep
      if j == 1 and ret + 1 <= floor_ then break end
      local allowed = math.max(floor_, share * (adm + 1))
      if ret + 1 > allowed then
        return {2, 1, scopes[j + 1], tostring(ret), tostring(allowed), table.concat(w, ' ')}
      end
    end
  end
end
local tk = k
local new_task = false
if t_on then
  k = k + 2
  local h = redis.call('HMGET', KEYS[tk + 1], 'calls', 'tokens', 'first')
  local calls = tonumber(h[1] or '0')
  local tokens = tonumber(h[2] or '0')
  local first = tonumber(h[3] or a[1])
  new_task = h[1] == false
  local lim = tonumber(a[12])
  if lim > 0 and calls + 1 > lim then return {3, is_retry, 'max_calls', tostring(calls), tostring(lim)} end
  lim = tonumber(a[13])
  if lim > 0 and tokens + tonumber(a[11]) > lim then
    return {3, is_retry, 'max_tokens', tostring(tokens), tostring(lim)}
  end
  lim = tonumber(a[14])
  if lim > 0 and now - first > lim then return {3, is_retry, 'max_wall_s', tostring(now - first), tostring(lim)} end
  lim = tonumber(a[15])
  if lim > 0 then
    local sc = redis.call('ZSCORE', KEYS[tk + 2], ARGV[3])
    if (not sc) or tonumber(sc) <= now then
      redis.call('ZREMRANGEBYSCORE', KEYS[tk + 2], '-inf', a[1])  -- expired members only: charges nothing
      local count = redis.call('ZCARD', KEYS[tk + 2])
      if count >= lim then return {3, is_retry, 'max_active_tasks', tostring(count), tostring(lim)} end
    end
  end
end
local qk = k
if q_on then
  local cur = tonumber(redis.call('GET', KEYS[qk + 1]) or '0')
  local prev = tonumber(redis.call('GET', KEYS[qk + 2]) or '0')
  local used = cur + prev * (1 - tonumber(a[21]))
  if used + tonumber(a[19]) > tonumber(a[20]) then
    return {4, is_retry, '', tostring(used), a[20], tostring(cur), tostring(prev)}
  end
end
-- every check passed: charge everything
for i = 1, nm do redis.call('SET', KEYS[i], ARGV[2], 'PX', a[3]) end
if r_on then
  local ttl = a[9]
  local charged = {1, 5}
  if is_retry == 1 then charged = {1, 5, 3, 7} end
  for _, i in ipairs(charged) do
    w[i] = redis.call('INCR', KEYS[rk + i]); redis.call('PEXPIRE', KEYS[rk + i], ttl)
  end
end
if t_on then
  local h = KEYS[tk + 1]
  redis.call('HINCRBY', h, 'calls', 1)
  redis.call('HINCRBY', h, 'tokens', a[11])
  redis.call('HINCRBY', h, 'inflight', 1)
  if new_task then redis.call('HSET', h, 'first', a[1]) end
  redis.call('PEXPIRE', h, a[16])
  if tonumber(a[15]) > 0 then
    redis.call('ZADD', KEYS[tk + 2], a[17], ARGV[3])
    redis.call('PEXPIRE', KEYS[tk + 2], a[16])
  end
end
if q_on then
  redis.call('INCRBY', KEYS[qk + 1], a[19])
  redis.call('PEXPIRE', KEYS[qk + 1], a[22])
end
if r_on then return is_retry .. ' ' .. table.concat(w, ' ') end
return tostring(is_retry)
