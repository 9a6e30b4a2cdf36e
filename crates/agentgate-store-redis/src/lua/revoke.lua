-- Revoke the lease and permit of a turn, whoever holds its token: an
-- operator's force-release (the SQL store already bumped the session's
-- fence, so the old holder's writes are refused).
-- KEYS: turn key
-- ARGV: turn_id, key prefix
local info = redis.call('HMGET', KEYS[1], 'session', 'user')
if not info[1] then
  return 0
end
local skey = ARGV[2] .. 's:' .. info[1]
if redis.call('HGET', skey, 'turn') == ARGV[1] then
  redis.call('DEL', skey)
end
redis.call('DEL', KEYS[1])
redis.call('ZREM', ARGV[2] .. 'u:' .. info[2], ARGV[1])
return 1
