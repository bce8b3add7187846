-- The run's audit outbox (AUD): the entry of the operator action a script makes (JSON that
-- app/caller.py's action_entry builds, passed as an ARGV), written in the same call as the
-- change, so that neither is ever without the other; the stream id's milliseconds are its time.
-- app/access/audit.py moves the outbox into Postgres. An empty entry writes nothing (a caller
-- that acts as nobody: tests, benchmarks).
local function audit(entry)
  if entry ~= '' then redis.call('XADD', AUD, '*', 'e', entry) end
end
