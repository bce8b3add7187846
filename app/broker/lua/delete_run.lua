-- requires: settled, audit, consumers
-- Delete a closed run whose live state has settled and whose events the accounting has all
-- applied (settled.lua), in bounded steps; call again while it answers 'more'. The first step
-- marks the run deleting and parked: from then on no other script changes it (they find it
-- parked, and wake_run.lua refuses a run being deleted). The last step leaves a tombstone, the
-- run hash with only id, st = 'deleted', created and deleted: the id is not given to a new run
-- (its accounting stays under it), and deleting again is answered 'deleted'.
-- Left alone: the dead letters (accounting the drain could not apply, still readable), the
-- audit outbox (AUD: the step that leaves the tombstone writes the delete's entry there, and the
-- entries wait for their move into Postgres), and batch and work-lease records, which expire
-- 24 h after they settled.
-- ARGV: wake, limit, accounting consumer group, audit entry (lib/audit.lua).
-- Returns ok('deleted') | ok('more') | err('run_missing') | err('run_open')
--       | err('run_busy', what it waits for, in words) | err('run_parked', token) (a parked run
--       whose consumers hold items: wake it, then call again).
local WAITS_FOR = {
  live = 'rollouts are still buffered or leased',
  work = 'work leases are still live',
  prompts = 'prompt passes are still queued (the next sweep cancels them)',
  events = 'the accounting has not applied all its events yet',
  consumers = "what its consumers held was dropped now; the accounting has not applied it yet",
}
local f = redis.call('HMGET', RUN, 'cfg', 'st', 'deleting')
if not f[1] then
  if f[2] == 'deleted' then return ok('deleted') end
  return err('run_missing')
end
if not f[3] then
  load_run()
  if R.st ~= 'closed' then return err('run_open') end
  local why = unsettled(ARGV[3])
  if why then return err('run_busy', WAITS_FOR[why]) end
  -- What consumers still hold is dropped and counted first, and the delete waits for the
  -- accounting to apply that as it waits for any event. A parked run is woken for it first (the
  -- store does that on 'run_parked'): the accounting drains only runs in service.
  if redis.call('EXISTS', CON.CREF) == 1 and redis.call('HEXISTS', RUN, 'parked') == 1 then
    return err('run_parked', redis.call('HGET', RUN, 'tok') or '0')
  end
  for _, name in ipairs(redis.call('HKEYS', CON.CONS)) do CON.free(CON.get(name)) end
  if #CON.acc_order > 0 then
    CON.emit()
    return err('run_busy', WAITS_FOR.consumers)
  end
  redis.call('HSET', RUN, 'deleting', 1, 'parked', 1)
end

-- Registered prompts: each one's packed prompt and its passes '#1', '#2', ... (all written at
-- registration and kept while the run lives) with the partials kept with them, up to `limit`
-- keys a step.
local budget = tonumber(ARGV[2])
while budget > 0 do
  local pids = redis.call('SPOP', PSEEN, math.max(1, math.floor(budget / 4)))
  if #pids == 0 then break end
  for _, pid in ipairs(pids) do
    redis.call('DEL', pbkey(pid))
    local k = 1
    local function gone(pk) return redis.call('DEL', ppkey(pk), ptkey(pk), pmkey(pk)) >= 1 end
    while gone(pid .. '#' .. I(k)) do k = k + 1 end
    budget = budget - k
  end
end
if redis.call('EXISTS', PSEEN) == 1 then return ok('more') end

-- Whole collections: UNLINK frees a large one off the main thread. The indexes of units and
-- leases are empty in a settled run; they go too, in case.
redis.call('UNLINK', SEEN, GDONE, PQ, EV, Q, VS, OPEN, OV, LEASES, US, WLEASES, WAITING, WWAITING,
  ACKED, XV, FLOORS, PWAITING, AW, AUN, AQ, AV, RLEASES, RWAITING, UG, GQ, GW, PMEAN, PQE, PQN,
  PQH, CON.CONS, CON.CREF, CON.CORPH, CON.TD)
local keep = redis.call('HMGET', RUN, 'id', 'created')
redis.call('DEL', RUN)
redis.call('HSET', RUN, 'id', keep[1] or '', 'st', 'deleted', 'created', keep[2] or '0',
  'deleted', I(NOW))
audit(ARGV[4])
return ok('deleted')
