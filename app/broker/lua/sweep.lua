-- requires: cleanup, finish
-- Periodic clean-up of one run (see sweep() in lib/cleanup.lua). ARGV: wake, limit.
-- Returns ok(more, retired) | err('run_missing'); `retired` as retired_counts().
if not load_run() then return err('run_missing') end
local more = sweep(tonumber(ARGV[2]))
if CON.sweep(tonumber(ARGV[2])) then more = 1 end  -- consumers' expired leases
finish()
return ok(more, retired_counts())
