-- requires: consumers
-- Read a consumer: its config and live counts. Writes nothing.
-- ARGV: wake, name. Returns ok(config JSON, created ms, delivered, acked, dropped, leased,
--       pending) | err('run_missing') | err('consumer_missing', name).
if redis.call('HEXISTS', RUN, 'cfg') == 0 then return err('run_missing') end
local c = CON.get(ARGV[2])
if not c then return err('consumer_missing', ARGV[2]) end
local f = redis.call('HMGET', CON.ckey(c.name), 'delivered', 'acked', 'dropped', 'leased')
return ok(c.text, I(c.created), tonumber(f[1] or '0'), tonumber(f[2] or '0'),
  tonumber(f[3] or '0'), tonumber(f[4] or '0'), redis.call('ZCARD', CON.qkey(c.name)))
