-- Take a session lease and one of the user's permits together, or neither.
-- KEYS: session key, turn key, user permit set
-- ARGV: turn_id, token digest, fence, ttl_ms, cap, session_id, user_id
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local holder = redis.call('HGET', KEYS[1], 'turn')
if holder then
  return {'busy', holder, redis.call('PTTL', KEYS[1])}
end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
if redis.call('ZCARD', KEYS[3]) >= tonumber(ARGV[5]) then
  local first = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
  return {'capacity', '', tonumber(first[2]) - now}
end
local ttl = tonumber(ARGV[4])
redis.call('HSET', KEYS[1], 'turn', ARGV[1], 'digest', ARGV[2], 'fence', ARGV[3], 'user', ARGV[7])
redis.call('PEXPIRE', KEYS[1], ttl)
redis.call('HSET', KEYS[2], 'session', ARGV[6], 'user', ARGV[7], 'digest', ARGV[2], 'fence', ARGV[3])
redis.call('PEXPIRE', KEYS[2], ttl)
redis.call('ZADD', KEYS[3], now + ttl, ARGV[1])
if redis.call('PTTL', KEYS[3]) < ttl then
  redis.call('PEXPIRE', KEYS[3], ttl)
end
return {'granted', '', ttl}
