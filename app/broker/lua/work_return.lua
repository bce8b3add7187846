-- requires: units, finish
-- Give prompts of a work lease back unstarted: each pass still in flight under this lease goes
-- back to the queue at its next attempt (ahead of fresh passes; a return is not a try), and a
-- partial group of it retires ('incomplete_group'). Returning every prompt ends the lease.
-- ARGV: wake, lease_id, n, then n prompt ids (n = 0: all of the lease's prompts).
-- Returns ok(returned) | err('run_missing') | err('work_missing')
--       | err('work_not_in_lease', prompt_id): a prompt this lease was not given.
if not load_run() then return err('run_missing') end
local lid = ARGV[2]
local wk = wkey(lid)
local f = redis.call('HMGET', wk, 'st', 'items')
if not f[1] then return err('work_missing') end
local items = cjson.decode(f[2])
local n = tonumber(ARGV[3])
local wanted = nil
if n > 0 then
  wanted = {}
  local given = {}
  for _, item in ipairs(items) do given[pass_prompt(item[1])] = true end
  for i = 1, n do
    local pid = ARGV[3 + i]
    if not given[pid] then return err('work_not_in_lease', pid) end
    wanted[pid] = true
  end
end

local returned = 0
for _, item in ipairs(items) do
  local pk, att = item[1], item[2]
  if not wanted or wanted[pass_prompt(pk)] then
    local pf = pass_fields(pk)
    if pf[1] == 'w' and pf[4] == lid and tonumber(pf[2]) == att then
      requeue(pk, pf, 'returned', lid, false)
      retire_open('g:' .. attempt_group(pk, att), 'incomplete_group')
      returned = returned + 1
    end
  end
end
if not wanted and f[1] == 'l' then
  redis.call('HSET', wk, 'st', 'r')
  redis.call('ZREM', WLEASES, lid)
  redis.call('PEXPIRE', wk, 86400000)
end
finish()
return ok(returned)
