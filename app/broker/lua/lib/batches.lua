-- requires: units
-- Leased batches. A batch's state is stored as one letter in its hash ('st'); replies name it in
-- words. A leased batch's record keeps its units and rollouts as the lease found them, so that
-- its ack, nack or expiry reads nothing unit by unit. 'units' is a msgpack array of
-- (unit id, record, rollouts) triples; 'rows' one of (rollout id, version, tokens) triples, the
-- units' rollouts in order.
local BATCH_STATE = { l = 'leased', a = 'acked', n = 'nacked', e = 'expired', r = 'rewound' }

-- each_unit(units, rows, fn) calls fn(u, record, its rows).
local function each_unit(units, rows, fn)
  local j = 0
  for i = 1, #units, 3 do
    local part = {}
    for _ = 1, units[i + 2] do
      table.insert(part, { rows[j + 1], rows[j + 2], rows[j + 3] })
      j = j + 3
    end
    fn(units[i], parse_unit(units[i + 1]), part)
  end
end

-- The (rollout id, version, tokens) items of a batch's rows, as its events carry them.
local function batch_items(rows)
  local items = {}
  for j = 1, #rows, 3 do table.insert(items, { rows[j], rows[j + 1], rows[j + 2] }) end
  return items
end

-- Return a live batch's units to the buffer after a nack (state 'n'), an expiry ('e') or a
-- rewind below its version ('r').
local function return_batch(bid, f, state, event)
  local rows = cmsgpack.unpack(f[3])
  emit(event, { batch_id = bid, items = batch_items(rows) })
  each_unit(cmsgpack.unpack(f[2]), rows, settle)
  redis.call('HINCRBY', RUN, 'leased', -tonumber(f[4]))
  redis.call('HSET', bkey(bid), 'st', state, 'end', I(NOW))
  redis.call('HDEL', bkey(bid), 'ml')  -- measured logprobs (measure.lua): no ack will read them
  redis.call('PEXPIRE', bkey(bid), 86400000)
end

-- Return an expired batch's units to the buffer.
local function expire_batch(bid)
  local f = redis.call('HMGET', bkey(bid), 'st', 'units', 'rows', 'n')
  redis.call('ZREM', LEASES, bid)
  if f[1] ~= 'l' then return 0 end
  return_batch(bid, f, 'e', 'expired')
  return 1
end
