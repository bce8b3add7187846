-- Shared prologue of every broker script. KEYS[1] is the run hash "<prefix>:{<run_id>}:run";
-- every other key of the run is derived from it, so all of them share the {<run_id>} hash tag
-- and the scripts run unchanged on Redis Cluster. KEYS[2] is the run's never-written guard
-- key: declared so that a cluster refuses a script while the run's slot is being moved
-- (app/broker/keys.py, GUARD), never read or written here. The key locals (RUN, B, TAG, EV, Q,
-- VS, OPEN, OV, LEASES, US, SEEN, GDONE, WAITING, PQ, PSEEN, WLEASES, WWAITING) and key functions
-- (qvkey, ukey, mkey, rkey, dkey, bkey, ppkey, pbkey, wkey) come before this file, generated
-- from app/broker/keys.py.
--
-- Replies: every script returns ok(...) or err(code, ...); app/broker/replies.py decodes them
-- and maps each code to an HTTP error. Outcomes the caller tells apart ('created' or 'exists')
-- are the first value of an ok; refusals are err codes listed in that module's table.
redis.replicate_commands()  -- TIME before writes (a no-op on Redis >= 7)

local WAKE = ARGV[1]         -- pub/sub channel that wakes long-polling trainers

local function ok(...) return { 'ok', ... } end
local function err(code, ...) return { 'err', code, ... } end

-- A batch's state is stored as one letter in its hash ('st'); replies name it in words.
local BATCH_STATE = { l = 'leased', a = 'acked', n = 'nacked', e = 'expired' }

local t = redis.call('TIME')
local NOW = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local function I(x) return string.format('%d', x) end
local function qv(v) return qvkey(I(v)) end

-- Units ------------------------------------------------------------------------------------
-- A single rollout is its own unit, 'r:<rollout_id>'; a group is 'g:<group_id>'. A group lists
-- its members in arrival order (mkey), each entry '<version> <tokens> <rollout_id>'.
--
-- A complete unit, ready or leased, is one field of the run's US hash: its record
-- 'v,seq,uses,k,n,kl,att,pk' (version, arrival seq, uses so far, rollouts, tokens of a single
-- rollout (0 for a group: its members carry theirs), KL of its last measured use ('' = none),
-- and the prompt attempt it answers ('' = none)). Lease and ack read and write the records of a
-- whole batch in one command each; a group still filling keeps a hash of its own (ukey: need,
-- have, v, seq, rmin, rmax, pk, att) until it completes.
local function unit_text(r)
  return string.format('%d,%d,%d,%d,%d,%s,%s,%s', r.v, r.seq, r.uses, r.k, r.n,
    r.kl and string.format('%.17g', r.kl) or '', r.att and I(r.att) or '', r.pk or '')
end

local function parse_unit(text)
  local v, seq, uses, k, n, kl, att, pk =
    string.match(text, '^(%d+),(%d+),(%d+),(%d+),(%d+),([^,]*),(%d*),(.*)$')
  return {
    v = tonumber(v), seq = tonumber(seq), uses = tonumber(uses), k = tonumber(k),
    n = tonumber(n), kl = tonumber(kl), att = tonumber(att), pk = pk ~= '' and pk or nil,
  }
end

local function member_entry(v, n, rid) return I(v) .. ' ' .. I(n) .. ' ' .. rid end

-- A unit's rollouts, { {rollout_id, version, tokens}, ... }: a single rollout's from its record
-- `r`, a group's from its member list.
local function rollouts_of(u, r)
  if string.sub(u, 1, 2) == 'r:' then return { { string.sub(u, 3), r.v, r.n } } end
  local out = {}
  for _, e in ipairs(redis.call('LRANGE', mkey(u), 0, -1)) do
    local v, n, rid = string.match(e, '^(%d+) (%d+) (.*)$')
    table.insert(out, { rid, tonumber(v), tonumber(n) })
  end
  return out
end

-- Writes collected during a call and made in a few variadic commands: records to set, units
-- made ready (flush_units), and records and keys to delete (finish). Nothing reads a key after
-- it was queued for deletion; a script that reads the ready indexes or records after making
-- units ready calls flush_units() first.
local US_SET, READY, US_DEL, DELS = {}, {}, {}, {}

local function each_chunk(list, step, fn)
  for i = 1, #list, step do fn(unpack(list, i, math.min(i + step - 1, #list))) end
end

local function emit(e, d)
  d['t'] = NOW
  redis.call('XADD', EV, '*', 'e', e, 'd', cmsgpack.pack(d))
end

-- The payload of an event the caller packed (a msgpack map without 't'), with 't' added by
-- rewriting the map's header and appending the pair: no unpacking and packing again. Raises an
-- error for anything but a map, so call it before the first write.
local function timed(payload)
  local b, head = string.byte(payload, 1), nil
  local rest = 2
  if b >= 0x80 and b < 0x8f then
    head = string.char(b + 1)  -- fixmap
  elseif b == 0x8f then
    head = '\222\0\16'  -- 15 pairs and 't': map16
  elseif b == 0xde then
    local n = string.byte(payload, 2) * 256 + string.byte(payload, 3) + 1
    head, rest = '\222' .. string.char(math.floor(n / 256), n % 256), 4
  else
    return error('event payload is not a msgpack map')
  end
  return head .. string.sub(payload, rest) .. cmsgpack.pack('t') .. cmsgpack.pack(NOW)
end

local function emit_timed(e, d) redis.call('XADD', EV, '*', 'e', e, 'd', d) end

-- The layout of a run's units: RUN's 'lay' field. A run created before it (no 'lay') has
-- hashes per unit and per rollout, which upgrade_units() converts on its first call.
local LAYOUT = '3'
local upgrade_units  -- defined with the units below

-- The run's state, read once per call.
local R = nil
local CFG = nil
local function load_run()
  local f = redis.call('HMGET', RUN, 'cfg', 'ver', 'st', 'floor', 'lay')
  if not f[1] then return false end
  CFG = cjson.decode(f[1])
  R = { ver = tonumber(f[2]), st = f[3], floor = tonumber(f[4]), cfg = f[1] }
  if f[5] ~= LAYOUT then upgrade_units() end
  return true
end

-- The version rule, in one place. Lowest version still eligible: the staleness bound, raised
-- by the last kl_flush; retire_below() walks the indexes up to it.
local function min_version()
  return math.max(R.ver - CFG.max_staleness, R.floor)
end

-- Why a rollout of version v may not be handed out any more ('stale': its lag is above
-- max_staleness; 'kl_flush': below the floor the last flush raised), or nil.
local function version_reason(v)
  if v >= min_version() then return nil end
  if v < R.ver - CFG.max_staleness then return 'stale' end
  return 'kl_flush'
end

-- Retirements are collected per reason and written as one event per reason at the end.
local RETIRED = {}
local RETIRED_ORDER = {}
local RETIRED_N = 0
local LIVE_DELTA = 0  -- change of the run's 'live' count, written once by finish()
local WOKE = false

-- Take a ready unit out of the ready indexes; a version whose index empties leaves VS.
local function unready(u, v)
  redis.call('ZREM', Q, u)
  local k = qv(v)
  redis.call('ZREM', k, u)
  if redis.call('EXISTS', k) == 0 then redis.call('ZREM', VS, I(v)) end
end

-- unready() for many units { {u, v}, ... } at once: one ZREM per index.
local function unready_many(units)
  local all, by_v = {}, {}
  for _, x in ipairs(units) do
    table.insert(all, x[1])
    local l = by_v[x[2]]
    if not l then l = {} by_v[x[2]] = l end
    table.insert(l, x[1])
  end
  each_chunk(all, 1000, function(...) redis.call('ZREM', Q, ...) end)
  for v, l in pairs(by_v) do
    each_chunk(l, 1000, function(...) redis.call('ZREM', qv(v), ...) end)
    if redis.call('EXISTS', qv(v)) == 0 then redis.call('ZREM', VS, I(v)) end
  end
end

-- A complete unit becomes ready (in the indexes at the next flush_units).
local function make_ready(u, v, seq)
  table.insert(READY, { u, v, seq })
  WOKE = true
end

local function set_unit(u, r) table.insert(US_SET, u) table.insert(US_SET, unit_text(r)) end

local function flush_units()
  if #US_SET > 0 then
    each_chunk(US_SET, 1000, function(...) redis.call('HSET', US, ...) end)
    US_SET = {}
  end
  if #READY == 0 then return end
  local q, by_v = {}, {}
  for _, x in ipairs(READY) do
    table.insert(q, x[3]) table.insert(q, x[1])
    local l = by_v[x[2]]
    if not l then l = {} by_v[x[2]] = l end
    table.insert(l, x[3]) table.insert(l, x[1])
  end
  each_chunk(q, 1000, function(...) redis.call('ZADD', Q, ...) end)
  for v, l in pairs(by_v) do
    each_chunk(l, 1000, function(...) redis.call('ZADD', qv(v), ...) end)
    redis.call('ZADD', VS, I(v), I(v))
  end
  READY = {}
end

-- A run of the earlier layout: every unit had a hash (ukey: st, v, seq, uses, kl, have, pk,
-- att) and every rollout one (rkey: v, n), and a group's list held bare rollout ids. Converted
-- whole, once, by the first call that loads the run: ready units (Q) and leased ones (live
-- batches, whose 'units' were a JSON list of unit ids) get their records in US, batches their
-- 'units' and 'rows', groups still filling (OPEN) their new member entries.
upgrade_units = function()
  local function convert(u)  -- {rid, v, n} rows of unit u, its member list rewritten
    local rows, rids = {}, nil
    if string.sub(u, 1, 2) == 'r:' then rids = { string.sub(u, 3) } else
      rids = redis.call('LRANGE', mkey(u), 0, -1)
    end
    for _, rid in ipairs(rids) do
      local rf = redis.call('HMGET', rkey(rid), 'v', 'n')
      table.insert(rows, { rid, tonumber(rf[1]), tonumber(rf[2]) })
      redis.call('DEL', rkey(rid))
    end
    if string.sub(u, 1, 2) == 'g:' then
      redis.call('DEL', mkey(u))
      for _, row in ipairs(rows) do redis.call('RPUSH', mkey(u), member_entry(row[2], row[3], row[1])) end
    end
    return rows
  end
  local function record(u, rows)  -- a complete unit's record; its hash goes
    local f = redis.call('HMGET', ukey(u), 'v', 'seq', 'uses', 'kl', 'pk', 'att')
    redis.call('DEL', ukey(u))
    local r = {
      v = tonumber(f[1]), seq = tonumber(f[2]), uses = tonumber(f[3]), k = #rows, n = 0,
      kl = tonumber(f[4]), pk = f[5] or nil, att = tonumber(f[6]),
    }
    if string.sub(u, 1, 2) == 'r:' then r.n = rows[1][3] end
    redis.call('HSET', US, u, unit_text(r))
    return r
  end
  for _, u in ipairs(redis.call('ZRANGE', Q, 0, -1)) do record(u, convert(u)) end
  for _, bid in ipairs(redis.call('ZRANGE', LEASES, 0, -1)) do
    local f = redis.call('HMGET', bkey(bid), 'st', 'units')
    if f[1] == 'l' then
      local units, brows = {}, {}
      for _, u in ipairs(cjson.decode(f[2])) do
        local rows = convert(u)
        table.insert(units, u) table.insert(units, unit_text(record(u, rows)))
        table.insert(units, #rows)
        for _, row in ipairs(rows) do
          table.insert(brows, row[1]) table.insert(brows, row[2]) table.insert(brows, row[3])
        end
      end
      redis.call('HSET', bkey(bid), 'units', cmsgpack.pack(units), 'rows', cmsgpack.pack(brows))
    end
  end
  for _, u in ipairs(redis.call('ZRANGE', OPEN, 0, -1)) do
    convert(u)
    redis.call('HDEL', ukey(u), 'st', 'uses', 'kl', 'b')
  end
  redis.call('HSET', RUN, 'lay', LAYOUT)
end

-- Prompt passes ----------------------------------------------------------------------------
-- A pass '<prompt_id>#<pass>' is queued ('q'), handed out in a work lease ('w'), its group
-- complete and buffered or leased ('b'), done ('d') or failed ('f'). Its attempt 'att' names
-- the group a generator posts: '<prompt_id>#<pass>.<att>'. ADM_DELTA is the change of the
-- run's 'adm' (groups admitted, the staleness budget's count), written once by finish().
local PASS_STATE = { q = 'queued', w = 'in_flight', b = 'in_flight', d = 'done', f = 'failed' }
local WORK_STATE = { l = 'live', c = 'complete', r = 'returned', e = 'expired' }
local ADM_DELTA = 0
local WORK_WOKE = false
local PASS_EVENTS = {}  -- { {cause, lease_id or false, items}, ... } in order, for finish()

local function pass_prompt(pk) return string.match(pk, '^(.*)#%d+$') end
local function pass_number(pk) return tonumber(string.match(pk, '#(%d+)$')) end
local function attempt_group(pk, att) return pk .. '.' .. I(att) end

-- The pass and attempt a group id names, when it names a registered pass: (pk, att) or nil.
local function group_pass(gid)
  local pk, att = string.match(gid, '^(.*#%d+)%.(%d+)$')
  if not pk or redis.call('EXISTS', ppkey(pk)) == 0 then return nil end
  return pk, tonumber(att)
end

-- Queue order: earlier passes first, then registration order. A pass that comes back (returned,
-- expired, retried) therefore goes before every pass of its number never handed out: those are
-- handed out in registration order, so all that are left were registered after it. Exact as a
-- double for passes up to 1000 and 2^40 prompts.
local function pass_score(pk, seq)
  return I(pass_number(pk) * 1099511627776 + seq)
end

local function pass_fields(pk)
  return redis.call('HMGET', ppkey(pk), 'st', 'att', 'tries', 'lease', 'seq')
end

local function note_pass(cause, lease_id, pk, att, st, tries)
  local last = PASS_EVENTS[#PASS_EVENTS]
  if not last or last[1] ~= cause or last[2] ~= (lease_id or false) then
    last = { cause, lease_id or false, {} }
    table.insert(PASS_EVENTS, last)
  end
  table.insert(last[3], { pass_prompt(pk), pass_number(pk), att, PASS_STATE[st], tries })
end

-- A group of the work lease came in whole or left it: the lease ends once none is open.
local function work_settled(lid)
  local wk = wkey(lid)
  if redis.call('HGET', wk, 'st') ~= 'l' then return end
  if redis.call('HINCRBY', wk, 'open', -1) <= 0 then
    redis.call('HSET', wk, 'st', 'c')
    redis.call('ZREM', WLEASES, lid)
    redis.call('PEXPIRE', wk, 86400000)
  end
end

-- An attempt ended without its group reaching a gradient: the pass goes back to the queue at
-- the next attempt, ahead of fresh passes, or is failed once `counts` (a try that retired unused
-- or expired, not a return) brings its tries to max_attempts. `f` = pass_fields(pk).
local function requeue(pk, f, cause, lease_id, counts)
  if f[1] == 'w' then work_settled(f[4]) end
  ADM_DELTA = ADM_DELTA - 1
  local att, tries = tonumber(f[2]), tonumber(f[3])
  if counts then tries = tries + 1 end
  if tries >= CFG.max_attempts then
    redis.call('HSET', ppkey(pk), 'st', 'f', 'tries', tries)
    redis.call('HDEL', ppkey(pk), 'lease')
    note_pass(cause, lease_id, pk, att, 'f', tries)
  else
    att = att + 1
    redis.call('HSET', ppkey(pk), 'st', 'q', 'att', att, 'tries', tries)
    redis.call('HDEL', ppkey(pk), 'lease')
    redis.call('ZADD', PQ, pass_score(pk, tonumber(f[5])), pk)
    note_pass(cause, lease_id, pk, att, 'q', tries)
  end
end

-- The group of a prompt attempt retired (see retire_rollouts()). Unused, it sends its pass back, except
-- `zero_variance`, which makes it done (its data says nothing); used, it was done at its first use.
-- A group of an attempt that has already ended (expired, returned) changes nothing.
local function attempt_retired(pk, att, uses, reason)
  local f = pass_fields(pk)
  if (f[1] ~= 'w' and f[1] ~= 'b') or tonumber(f[2]) ~= att or uses > 0 then return end
  if reason == 'zero_variance' then
    if f[1] == 'w' then work_settled(f[4]) end
    ADM_DELTA = ADM_DELTA - 1
    redis.call('HSET', ppkey(pk), 'st', 'd')
    note_pass('retired', nil, pk, att, 'd', tonumber(f[3]))
  else
    requeue(pk, f, 'retired', nil, true)
  end
end

-- Remove a unit's rollouts: their retirement (one event per reason, written by finish()), their
-- keys, and what the unit counted for. `rows` = rollouts_of(u, ...), `uses` its uses so far,
-- `pk`, `att` the prompt attempt it answers, if any.
local function retire_rollouts(u, reason, rows, uses, pk, att)
  local items = RETIRED[reason]
  if not items then
    items = {}
    RETIRED[reason] = items
    table.insert(RETIRED_ORDER, reason)
  end
  for _, row in ipairs(rows) do
    table.insert(items, { row[1], row[2], row[3], uses })
    table.insert(DELS, dkey(row[1]))
  end
  if string.sub(u, 1, 2) == 'g:' then
    table.insert(DELS, mkey(u))
    redis.call('SADD', GDONE, u)
    if pk then
      attempt_retired(pk, att, uses, reason)
    elseif uses == 0 then
      ADM_DELTA = ADM_DELTA - 1
    end
  elseif uses == 0 then
    ADM_DELTA = ADM_DELTA - 1
  end
  LIVE_DELTA = LIVE_DELTA - #rows
  RETIRED_N = RETIRED_N + #rows
  return #rows
end

-- Retire a complete unit, whose record is `r`: ready (`ready`: in the indexes) or back from a
-- lease (in none). `rows`: its rollouts when the caller has them.
local function retire_unit(u, reason, r, ready, rows)
  if ready then unready(u, r.v) end
  table.insert(US_DEL, u)
  return retire_rollouts(u, reason, rows or rollouts_of(u, r), r.uses, r.pk, r.att)
end

-- Retire a group still filling (0 when it has no rollout yet).
local function retire_open(u, reason)
  local uk = ukey(u)
  local f = redis.call('HMGET', uk, 'have', 'pk', 'att')
  if not f[1] then return 0 end
  redis.call('ZREM', OPEN, u)
  redis.call('ZREM', OV, u)
  table.insert(DELS, uk)
  return retire_rollouts(u, reason, rollouts_of(u), 0, f[2], tonumber(f[3]))
end

-- Why a complete unit can never be handed out again under the current rules, or nil.
local function permanent_reason(uses, v, kl)
  if R.st == 'closed' then return 'run_closed' end
  if uses >= CFG.max_reuse then return 'max_reuse' end
  local vr = version_reason(v)
  if vr then return vr end
  if kl and kl > CFG.kl_max then return 'kl' end
  return nil
end

-- A unit back from a nack or an expiry, whose record is `r`: retire it or make it ready again
-- (ack.lua does the same with the use and KL the ack adds).
local function settle(u, r, rows)
  local reason = permanent_reason(r.uses, r.v, r.kl)
  if reason then
    retire_unit(u, reason, r, false, rows)
  else
    make_ready(u, r.v, r.seq)
  end
end

-- A leased batch's record keeps its units and rollouts as the lease found them, so that its
-- ack, nack or expiry reads nothing unit by unit. 'units' is a msgpack array of
-- (unit id, record, rollouts) triples; 'rows' one of (rollout id, version, tokens) triples, the
-- units' rollouts in order. each_unit(units, rows, fn) calls fn(u, record, its rows).
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

-- Return a live batch's units to the buffer after a nack (state 'n') or an expiry ('e').
local function return_batch(bid, f, state, event)
  local rows = cmsgpack.unpack(f[3])
  emit(event, { batch_id = bid, items = batch_items(rows) })
  each_unit(cmsgpack.unpack(f[2]), rows, settle)
  redis.call('HINCRBY', RUN, 'leased', -tonumber(f[4]))
  redis.call('HSET', bkey(bid), 'st', state, 'end', I(NOW))
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

-- End a work lease whose time ran out: its passes still in flight go back to the queue (a try
-- each), and a partial group of theirs retires ('incomplete_group').
local function expire_work(lid)
  local wk = wkey(lid)
  local f = redis.call('HMGET', wk, 'st', 'items')
  redis.call('ZREM', WLEASES, lid)
  if f[1] ~= 'l' then return 0 end
  redis.call('HSET', wk, 'st', 'e')
  redis.call('PEXPIRE', wk, 86400000)
  for _, item in ipairs(cjson.decode(f[2])) do
    local pk, att = item[1], item[2]
    local pf = pass_fields(pk)
    if pf[1] == 'w' and pf[4] == lid and tonumber(pf[2]) == att then
      requeue(pk, pf, 'expired', lid, true)
      retire_open('g:' .. attempt_group(pk, att), 'incomplete_group')
    end
  end
  return 1
end

-- Retire buffered units below the version floor (everything, in a closed run), at most
-- `budget` units; returns the budget left.
local function retire_below(budget)
  flush_units()  -- units made ready in this call are in the indexes, to be seen
  local floor_v
  if R.st == 'closed' then floor_v = '+inf' else floor_v = '(' .. I(min_version()) end
  local function reason_for(v)
    if R.st == 'closed' then return 'run_closed' end
    return version_reason(v)
  end
  if budget > 0 then
    local open_old = redis.call('ZRANGEBYSCORE', OV, '-inf', floor_v, 'WITHSCORES', 'LIMIT', 0, budget)
    for i = 1, #open_old, 2 do retire_open(open_old[i], reason_for(tonumber(open_old[i + 1]))) end
    budget = budget - #open_old / 2
  end
  while budget > 0 do
    local vs = redis.call('ZRANGEBYSCORE', VS, '-inf', floor_v, 'LIMIT', 0, 1)
    if #vs == 0 then break end
    local v = tonumber(vs[1])
    local units = redis.call('ZRANGE', qv(v), 0, math.min(budget, 1000) - 1)
    if #units == 0 then
      redis.call('ZREM', VS, vs[1])
    else
      local recs = redis.call('HMGET', US, unpack(units))
      for i, u in ipairs(units) do
        if recs[i] then
          retire_unit(u, reason_for(v), parse_unit(recs[i]), true)
        else
          unready(u, v)  -- no record: nothing to hand out
        end
      end
    end
    budget = budget - #units
  end
  return budget
end

-- Bounded clean-up: expired leases, timed-out groups, units below the version floor, and
-- everything buffered in a closed run. Returns 1 when work was left for a later call.
local function sweep(limit)
  local more = 0
  local expired = redis.call('ZRANGEBYSCORE', LEASES, '-inf', I(NOW), 'LIMIT', 0, limit)
  for _, bid in ipairs(expired) do expire_batch(bid) end
  if #expired == limit then more = 1 end
  local work = redis.call('ZRANGEBYSCORE', WLEASES, '-inf', I(NOW), 'LIMIT', 0, limit)
  for _, lid in ipairs(work) do expire_work(lid) end
  if #work == limit then more = 1 end

  local budget = limit
  local cutoff = NOW - CFG.group_timeout_s * 1000
  local late = redis.call('ZRANGEBYSCORE', OPEN, '-inf', I(cutoff), 'LIMIT', 0, budget)
  for _, u in ipairs(late) do retire_open(u, R.st == 'closed' and 'run_closed' or 'incomplete_group') end
  budget = budget - #late

  budget = retire_below(budget)
  if budget <= 0 then more = 1 end
  return more
end

-- What this call retired, per reason in first-retired order: { {reason, rollouts}, ... }.
local function retired_counts()
  local res = {}
  for _, reason in ipairs(RETIRED_ORDER) do table.insert(res, { reason, #RETIRED[reason] }) end
  return res
end

local function finish()
  flush_units()
  each_chunk(US_DEL, 1000, function(...) redis.call('HDEL', US, ...) end)
  each_chunk(DELS, 1000, function(...) redis.call('DEL', ...) end)
  if LIVE_DELTA ~= 0 then redis.call('HINCRBY', RUN, 'live', LIVE_DELTA) end
  if ADM_DELTA ~= 0 then
    redis.call('HINCRBY', RUN, 'adm', ADM_DELTA)
    if ADM_DELTA < 0 then WORK_WOKE = true end  -- budget came free
  end
  for _, reason in ipairs(RETIRED_ORDER) do
    emit('retired', { reason = reason, items = RETIRED[reason] })
  end
  for _, p in ipairs(PASS_EVENTS) do
    local ev = { cause = p[1], items = p[3] }
    if p[2] then ev['lease_id'] = p[2] end
    emit('passes', ev)
  end
  -- Every API process receives every wake-up, so none is sent while nobody waits.
  if WOKE and redis.call('EXISTS', WAITING) == 1 then
    redis.call('PUBLISH', WAKE, TAG)
  end
  if WORK_WOKE and redis.call('EXISTS', WWAITING) == 1 then
    redis.call('PUBLISH', WAKE, WORK_WAKE)
  end
end

-- The staleness budget, in one place: groups that may still be admitted at the run's version
-- (nil: no budget, step_groups is not set).
local function admission_left()
  local B = CFG.step_groups
  if B == nil or B == cjson.null then return nil end
  local adm = tonumber(redis.call('HGET', RUN, 'adm') or '0') + ADM_DELTA
  return (R.ver + CFG.max_staleness + 1) * B - adm
end

local function run_snapshot(change)
  local f = redis.call('HMGET', RUN, 'id', 'cfg', 'ver', 'st', 'created')
  emit('run', {
    run_id = f[1], change = change, config = cjson.decode(f[2]),
    policy_version = tonumber(f[3]), status = f[4], created_at = tonumber(f[5]),
  })
end
