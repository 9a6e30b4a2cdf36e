-- The live holders of a user's permits.
-- KEYS: user permit set
-- ARGV: key prefix
-- Returns a flat array: session_id, turn_id, fence, remaining_ms, ...
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local turns = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf')
local out = {}
for _, turn in ipairs(turns) do
  local info = redis.call('HMGET', ARGV[1] .. 't:' .. turn, 'session', 'fence')
  if info[1] then
    local skey = ARGV[1] .. 's:' .. info[1]
    if redis.call('HGET', skey, 'turn') == turn then
      table.insert(out, info[1])
      table.insert(out, turn)
      table.insert(out, info[2])
      table.insert(out, redis.call('PTTL', skey))
    end
  end
end
return out
