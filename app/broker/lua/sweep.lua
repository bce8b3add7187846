-- Periodic clean-up of one run (see sweep() in the prologue). ARGV: wake, limit.
-- Returns {'ok'|'missing', more, retired}.
if not load_run() then return { 'missing' } end
local more = sweep(tonumber(ARGV[2]))
finish()
return { 'ok', more, RETIRED_N }
