-- requires: run
-- What a closed run still waits for before it costs the workers nothing (and may be deleted),
-- or nil when it has settled: nothing buffered, leased, in an open group or in a live work or
-- reward lease, no prompt pass queued, and every event of its stream read and acknowledged by
-- the accounting consumer group.

-- Stream ids 'ms-seq' in order (ms is exact as a double up to 2^53).
local function stream_id_le(a, b)
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  am, as, bm, bs = tonumber(am), tonumber(as), tonumber(bm), tonumber(bs)
  return am < bm or (am == bm and as <= bs)
end

-- 'events' while the group has entries pending or not yet delivered; a run whose stream no
-- consumer of the group has read yet waits too, unless the stream holds nothing.
local function undrained(group)
  if redis.call('EXISTS', EV) == 0 then return nil end
  local last = redis.call('XREVRANGE', EV, '+', '-', 'COUNT', 1)
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', EV)) do
    local f = {}
    for i = 1, #g, 2 do f[g[i]] = g[i + 1] end
    if f['name'] == group then
      if tonumber(f['pending']) > 0 then return 'events' end
      if #last > 0 and not stream_id_le(last[1][1], f['last-delivered-id']) then
        return 'events'
      end
      return nil
    end
  end
  if #last == 0 then return nil end
  return 'events'
end

-- nil, or 'open' | 'live' (rollouts buffered, leased or in open groups) | 'work' (live work
-- leases) | 'prompts' (passes still queued) | 'events'. Needs load_run().
local function unsettled(group)
  if R.st ~= 'closed' then return 'open' end
  local f = redis.call('HMGET', RUN, 'live', 'leased')
  if tonumber(f[1] or '0') ~= 0 or tonumber(f[2] or '0') ~= 0 then return 'live' end
  if redis.call('ZCARD', LEASES) > 0 or redis.call('ZCARD', OPEN) > 0
    or redis.call('ZCARD', RLEASES) > 0 then
    return 'live'
  end
  if redis.call('ZCARD', WLEASES) > 0 then return 'work' end
  if redis.call('ZCARD', PQ) > 0 then return 'prompts' end
  return undrained(group)
end
