-- requires: run, audit, pools
-- Replace a run's config if it is still the one the caller merged into (optimistic check). A
-- change of kl_flush or kl_flush_window ends the kl_flush_window streak (ack.lua); a change of
-- kl_coef sets the adaptive KL penalty's β to it. A change of difficulty's thresholds (or
-- turning it on or off) sorts the queued passes into pools again (lib/pools.lua).
-- ARGV: wake, expected_config_json, new_config_json, audit entry (written only when the config
-- changes: lib/audit.lua).
-- Returns ok('replaced') | ok('changed') (another patch came first: merge again)
--       | err('run_missing').
local current = redis.call('HGET', RUN, 'cfg')
if not current then return err('run_missing') end
if current ~= ARGV[2] then return ok('changed') end
if ARGV[3] ~= current then
  redis.call('HSET', RUN, 'cfg', ARGV[3])
  -- The kl_flush_window streak was counted under the old rule: a new kl_flush or window
  -- starts it afresh.
  local was, now = cjson.decode(current), cjson.decode(ARGV[3])
  if was.kl_flush ~= now.kl_flush or (was.kl_flush_window or 1) ~= now.kl_flush_window then
    redis.call('HDEL', RUN, 'klrun')
  end
  if was.kl_coef ~= now.kl_coef then redis.call('HDEL', RUN, 'beta') end  -- β starts from it
  if POOL.thresholds(was.difficulty) ~= POOL.thresholds(now.difficulty) then
    CFG = now
    POOL.rebuild()
  end
  run_snapshot('config')
  audit(ARGV[4])
  if redis.call('EXISTS', WWAITING) == 1 then
    publish_wake(WORK_WAKE)  -- the staleness budget may have changed
  end
end
return ok('replaced')
