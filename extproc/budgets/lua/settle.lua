-- The release and correction of one admitted request (extproc/budgets/redis_store.py encodes the call).
-- KEYS: markers[1..nm]; task (2): hash, active zset; quota (1): the window key charged
-- ARGV[1]: numbers "nm dedupe_ms t_on t_delta active_on idle_score q_on q_delta"; ARGV[2]: token; ARGV[3]: member
local a = {}
for v in string.gmatch(ARGV[1], '%S+') do a[#a + 1] = v end
local nm = tonumber(a[1])
for i = 1, nm do
  if redis.call('GET', KEYS[i]) == ARGV[2] then redis.call('SET', KEYS[i], '0', 'PX', a[2]) end
end
local k = nm
if a[3] == '1' then
  local h = KEYS[k + 1]
  if redis.call('EXISTS', h) == 1 then
    local d = tonumber(a[4])
    if d ~= 0 then
      local v = redis.call('HINCRBY', h, 'tokens', d)
      if v < 0 then redis.call('HSET', h, 'tokens', 0) end
    end
    local inf = redis.call('HINCRBY', h, 'inflight', -1)
    if inf <= 0 then
      redis.call('HSET', h, 'inflight', 0)
      if a[5] == '1' then redis.call('ZADD', KEYS[k + 2], 'XX', a[6], ARGV[3]) end
    end
  end
  k = k + 2
end
if a[7] == '1' then
  local d = tonumber(a[8])
  if d ~= 0 and redis.call('EXISTS', KEYS[k + 1]) == 1 then
    local v = redis.call('INCRBY', KEYS[k + 1], d)
    if v < 0 then redis.call('INCRBY', KEYS[k + 1], -v) end
  end
end
return 0
