-- requires: replies
-- The run's accounting events (its stream EV) and the wake-ups of long-polling trainers and
-- generators, sent by finish() (wake_waiting) when a call made units ready or freed prompts or
-- budget.
local WAKE  -- the run's shard channel P:{R}:wake that wakes its long-polling callers (ARGV[1])
local WOKE  -- units were made ready: trainers waiting on the run are woken
local WORK_WOKE  -- prompts or budget came free, or the run closed: generators are woken
local REWARD_WOKE  -- units came to await a reward lease: reward workers are woken
per_call(function() WAKE, WOKE, WORK_WOKE, REWARD_WOKE = ARGV[1], false, false, false end)

local function emit(e, d)
  d['t'] = NOW
  redis.call('XADD', EV, '*', 'e', e, 'd', cmsgpack.pack(d))
end

-- The payload of an event the caller packed (a msgpack map without 't'), with 't' added by
-- rewriting the map's header and appending the pair, and the pairs of `more` ({key, value, ...},
-- optional) after it: no unpacking and packing again. Raises an error for anything but a map,
-- so call it before the first write.
local function timed(payload, more)
  more = more or {}
  local b, n, rest = string.byte(payload, 1), nil, 2
  if b >= 0x80 and b <= 0x8f then
    n = b - 0x80  -- fixmap
  elseif b == 0xde then
    n, rest = string.byte(payload, 2) * 256 + string.byte(payload, 3), 4  -- map16
  else
    return error('event payload is not a msgpack map')
  end
  n = n + 1 + #more / 2
  local head
  if n <= 15 then head = string.char(0x80 + n) else
    head = '\222' .. string.char(math.floor(n / 256), n % 256)
  end
  local parts = { head, string.sub(payload, rest), cmsgpack.pack('t'), cmsgpack.pack(NOW) }
  for _, x in ipairs(more) do table.insert(parts, cmsgpack.pack(x)) end
  return table.concat(parts)
end

local function emit_timed(e, d) redis.call('XADD', EV, '*', 'e', e, 'd', d) end

-- The one way a script wakes a run's long-polling callers: `kind` (TAG, WORK_WAKE, POLICY_WAKE,
-- REWARD_WAKE or CON.WAKE) on the run's shard channel WAKE (keys.wake_channel). It is in the
-- run's slot, so on a Redis Cluster a wake-up stays on the node holding the run and reaches only
-- the API processes where one of its callers waits (app/broker/notify.py).
local function publish_wake(kind) redis.call('SPUBLISH', WAKE, kind) end

-- None is sent while nobody waits.
local function wake_waiting()
  if WOKE and redis.call('EXISTS', WAITING) == 1 then publish_wake(TAG) end
  if WORK_WOKE and redis.call('EXISTS', WWAITING) == 1 then publish_wake(WORK_WAKE) end
  if REWARD_WOKE and redis.call('EXISTS', RWAITING) == 1 then publish_wake(REWARD_WAKE) end
end
