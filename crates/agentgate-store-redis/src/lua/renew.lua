-- Renew the lease and permit of a turn, if the token still holds them.
-- KEYS: turn key
-- ARGV: turn_id, token digest, ttl_ms, key prefix
-- Returns the new remaining lease in ms, or -1 when the lease is lost.
local info = redis.call('HMGET', KEYS[1], 'session', 'user', 'digest')
if not info[1] or info[3] ~= ARGV[2] then
  return -1
end
local skey = ARGV[4] .. 's:' .. info[1]
local held = redis.call('HMGET', skey, 'turn', 'digest')
if held[1] ~= ARGV[1] or held[2] ~= ARGV[2] then
  return -1
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[3])
redis.call('PEXPIRE', skey, ttl)
redis.call('PEXPIRE', KEYS[1], ttl)
local ukey = ARGV[4] .. 'u:' .. info[2]
redis.call('ZADD', ukey, now + ttl, ARGV[1])
if redis.call('PTTL', ukey) < ttl then
  redis.call('PEXPIRE', ukey, ttl)
end
return ttl
