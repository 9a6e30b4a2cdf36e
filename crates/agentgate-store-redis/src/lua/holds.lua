-- The live lease of a turn, if the token holds it.
-- KEYS: turn key
-- ARGV: turn_id, token digest, key prefix
-- Returns {session_id, fence, remaining_ms}, or an empty array.
local info = redis.call('HMGET', KEYS[1], 'session', 'digest')
if not info[1] or info[2] ~= ARGV[2] then
  return {}
end
local skey = ARGV[3] .. 's:' .. info[1]
local held = redis.call('HMGET', skey, 'turn', 'digest', 'fence')
if held[1] ~= ARGV[1] or held[2] ~= ARGV[2] then
  return {}
end
return {info[1], held[3], redis.call('PTTL', skey)}
