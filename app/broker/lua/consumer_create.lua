-- requires: run, consumers, audit
-- Create a consumer (lib/consumers.lua), idempotently: the same config under the same name is
-- 'exists'; another is refused. Kind preferences needs a run of groups (group_size 2 or more).
-- ARGV: wake, name, config JSON {kind, source, max_lag (null = none), min_margin, pairs (both
--       null for kind rollouts), retention_rollouts}, as the caller canonicalised it (keys
--       sorted): the text compared for idempotency; audit entry (written only when this call
--       creates the consumer: lib/audit.lua).
-- Returns ok('created') | ok('exists') | err('run_missing') | err('run_closed')
--       | err('consumer_exists', name) | err('consumer_invalid', detail).
if not load_run() then return err('run_missing') end
local name, text = ARGV[2], ARGV[3]
local cfg = cjson.decode(text)
local have = CON.get(name)
if have then
  if have.text == text then return ok('exists') end
  return err('consumer_exists', name)
end
if R.st == 'closed' then return err('run_closed') end
local why = CON.invalid(name, cfg, CFG.group_size)
if why then return err('consumer_invalid', why) end
local gen = redis.call('HINCRBY', RUN, 'cgen', 1)
redis.call('HSET', CON.CONS, name, I(gen) .. ' ' .. I(NOW) .. ' ' .. text)
redis.call('HSET', CON.ckey(name), 'delivered', 0, 'acked', 0, 'dropped', 0, 'leased', 0)
audit(ARGV[4])
emit('consumers', { items = { { name, 0, 0, 0 } } })  -- the accounting lists it from now on
return ok('created')
