-- requires: passes, finish
-- Register prompts: each new prompt_id is queued for `epochs` passes, pass 1 first; a known
-- prompt_id is a duplicate and changes nothing (whatever its epochs or content).
-- ARGV: wake, epochs, n, then n records of 2: prompt_id, packed prompt.
-- Returns ok(accepted, duplicates) | err('run_missing') | err('run_closed').
if not load_run() then return err('run_missing') end
if R.st == 'closed' then return err('run_closed') end
local epochs, n = tonumber(ARGV[2]), tonumber(ARGV[3])
local items, dups = {}, 0
for i = 1, n do
  local pid, blob = ARGV[2 + 2 * i], ARGV[3 + 2 * i]
  if redis.call('SADD', PSEEN, pid) == 0 then
    dups = dups + 1
  else
    redis.call('SET', pbkey(pid), blob)
    local seq = redis.call('HINCRBY', RUN, 'pseq', 1)
    for pass = 1, epochs do
      local pk = pid .. '#' .. I(pass)
      redis.call('HSET', ppkey(pk), 'st', 'q', 'att', 1, 'tries', 0, 'seq', seq)
      POOL.enqueue(pk, pass_score(pk, seq))
    end
    table.insert(items, { pid, epochs })
  end
end
if #items > 0 then
  emit('registered', { items = items })
  WORK_WOKE = true
end
finish()
return ok(#items, dups)
