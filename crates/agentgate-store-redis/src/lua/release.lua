-- Release the lease and permit of a turn, if the token holds them.
-- KEYS: turn key
-- ARGV: turn_id, token digest, key prefix
local info = redis.call('HMGET', KEYS[1], 'session', 'user', 'digest')
if not info[1] or info[3] ~= ARGV[2] then
  return 0
end
local skey = ARGV[3] .. 's:' .. info[1]
local held = redis.call('HMGET', skey, 'turn', 'digest')
if held[1] == ARGV[1] and held[2] == ARGV[2] then
  redis.call('DEL', skey)
end
redis.call('DEL', KEYS[1])
redis.call('ZREM', ARGV[3] .. 'u:' .. info[2], ARGV[1])
return 1
