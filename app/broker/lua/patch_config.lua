-- Replace a run's config if it is still the one the caller merged into (optimistic check).
-- ARGV: wake, expected_config_json, new_config_json. Returns {'ok'|'missing'|'changed'}.
local current = redis.call('HGET', RUN, 'cfg')
if not current then return { 'missing' } end
if current ~= ARGV[2] then return { 'changed' } end
if ARGV[3] ~= current then
  redis.call('HSET', RUN, 'cfg', ARGV[3])
  run_snapshot('config')
end
return { 'ok' }
