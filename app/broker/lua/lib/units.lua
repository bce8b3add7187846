-- requires: passes, generators, consumers
-- Units: what is buffered, handed out and retired whole. A single rollout is its own unit,
-- 'r:<rollout_id>'; a group is 'g:<group_id>'. A group lists its members in arrival order
-- (mkey), each entry '<version> <tokens> <rollout_id>'.
--
-- A complete unit, ready or leased, is one field of the run's US hash: its record (version,
-- arrival seq, uses so far, rollouts, tokens of a single rollout (0 for a group: its members
-- carry theirs), KL of its last measured use (none: nil), and the prompt attempt it answers
-- (pk and att; none: nil)), written by unit_record and read by parse_unit. Lease and ack read
-- and write the records of a whole batch in one command each; a group still filling keeps a
-- hash of its own (ukey: need,
-- have, v, seq, rmin, rmax, pk, att) until it completes. A ready unit is also in the ready
-- index of its version, qv(v) (by uses · 2^38 + arrival seq), with its version in VS. (Runs of
-- layout 3 also kept every ready unit in Q, by arrival seq; load_run() removes it.)

local function qv(v) return qvkey(I(v)) end

-- A record is binary: a format byte (1), v and seq (doubles: exact up to 2^53), uses, k and n
-- (int32), kl (a double; NaN: none), att (int32; -1: none), then pk (the rest; empty: none).
-- struct reads it three times quicker than the text records of earlier versions, which
-- 'v,seq,uses,k,n,kl,att,pk' spelled out ('' for none); those are still read, and each is
-- written in the binary form by the next call that changes its unit.
local UNIT_RECORD = '<Bddiiidi'
local NO_KL = 0 / 0

local function unit_record(r)
  return struct.pack(UNIT_RECORD, 1, r.v, r.seq, r.uses, r.k, r.n, r.kl or NO_KL, r.att or -1)
    .. (r.pk or '')
end

local function parse_text_unit(text)
  local v, seq, uses, k, n, kl, att, pk =
    string.match(text, '^(%d+),(%d+),(%d+),(%d+),(%d+),([^,]*),(%d*),(.*)$')
  return {
    v = tonumber(v), seq = tonumber(seq), uses = tonumber(uses), k = tonumber(k),
    n = tonumber(n), kl = tonumber(kl), att = tonumber(att), pk = pk ~= '' and pk or nil,
  }
end

local function parse_unit(rec)
  if string.byte(rec, 1) ~= 1 then return parse_text_unit(rec) end
  local _, v, seq, uses, k, n, kl, att, rest = struct.unpack(UNIT_RECORD, rec)
  return {
    v = v, seq = seq, uses = uses, k = k, n = n, kl = kl == kl and kl or nil,
    att = att >= 0 and att or nil, pk = rest <= #rec and string.sub(rec, rest) or nil,
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
local US_SET, READY, US_DEL, DELS

-- Retirements are collected per reason and written as one event per reason at the end.
local RETIRED, RETIRED_ORDER, RETIRED_N
local LIVE_DELTA  -- change of the run's 'live' count, written once by finish()
per_call(function()
  US_SET, READY, US_DEL, DELS = {}, {}, {}, {}
  RETIRED, RETIRED_ORDER, RETIRED_N, LIVE_DELTA = {}, {}, 0, 0
end)

-- Whether the complete unit u, of version v, is ready (not leased nor awaiting rewards).
local function is_ready(u, v) return redis.call('ZSCORE', qv(v), u) ~= false end

-- Take a ready unit out of the ready indexes; a version whose index empties leaves VS.
local function unready(u, v)
  local k = qv(v)
  redis.call('ZREM', k, u)
  if redis.call('EXISTS', k) == 0 then redis.call('ZREM', VS, I(v)) end
end

-- unready() for many units { {u, v}, ... } at once: one ZREM per index.
local function unready_many(units)
  local by_v = {}
  for _, x in ipairs(units) do
    local l = by_v[x[2]]
    if not l then l = {} by_v[x[2]] = l end
    table.insert(l, x[1])
  end
  for v, l in pairs(by_v) do
    each_chunk(l, 1000, function(...) redis.call('ZREM', qv(v), ...) end)
    if redis.call('EXISTS', qv(v)) == 0 then redis.call('ZREM', VS, I(v)) end
  end
end

-- A complete unit becomes ready (in the indexes at the next flush_units), after `uses` uses
-- (nil: none). Its version's index orders fewer uses first, then arrival (SPEC `order`): its
-- score is uses · 2^38 + seq, exact as a double for max_reuse ≤ 10,000 and 2^38 units a run.
local function make_ready(u, v, seq, uses)
  table.insert(READY, { u, v, (uses or 0) * 274877906944 + seq })
  WOKE = true
end

local function set_unit(u, r) table.insert(US_SET, u) table.insert(US_SET, unit_record(r)) end

-- A unit that completes with a trained token newer than its governing version `v` (`vn`, its
-- newest) is kept in XV by that version, so a rewind below it finds it; write_units() takes the
-- units it deletes out of XV.
local function note_cross(u, v, vn)
  if vn and vn > v then redis.call('ZADD', XV, I(vn), u) end
end

local function flush_units()
  if #US_SET > 0 then
    each_chunk(US_SET, 1000, function(...) redis.call('HSET', US, ...) end)
    US_SET = {}
  end
  if #READY == 0 then return end
  local by_v = {}
  for _, x in ipairs(READY) do
    local l = by_v[x[2]]
    if not l then l = {} by_v[x[2]] = l end
    table.insert(l, I(x[3])) table.insert(l, x[1])
  end
  for v, l in pairs(by_v) do
    each_chunk(l, 1000, function(...) redis.call('ZADD', qv(v), ...) end)
    redis.call('ZADD', VS, I(v), I(v))
  end
  READY = {}
end

-- Rewards (SPEC "Rewards"). A rollout posted without one awaits it: AW maps it to
-- '<ingest ms> <version> <unit>'. A complete unit with unscored members is awaiting, not ready:
-- its record is in US as any unit's, its reward state in AUN (JSON: n unscored members, lo and
-- hi the least and greatest reward it has ('' none), x its expired reward leases, l the live
-- reward lease holding it, if any), and it is in AV (by version: eviction and rewind) and, while
-- in no live reward lease, in AQ (by arrival seq: what reward leases take).
local AWAIT_ON  -- whether the run has unscored rollouts: read once a call, then kept
per_call(function() AWAIT_ON = nil end)
local function awaiting_on()
  if AWAIT_ON == nil then AWAIT_ON = redis.call('EXISTS', AW) == 1 end
  return AWAIT_ON
end

local function note_awaiting(rid, v, u)
  redis.call('HSET', AW, rid, I(NOW) .. ' ' .. I(v) .. ' ' .. u)
  AWAIT_ON = true
end

-- (ingest ms, version, unit) of an unscored rollout's AW entry.
local function parse_awaiting(text)
  local t, v, u = string.match(text, '^(%d+) (%d+) (.*)$')
  return tonumber(t), tonumber(v), u
end

local function reward_state(u)
  local t = redis.call('HGET', AUN, u)
  return t and cjson.decode(t) or nil
end

local function set_reward_state(u, s) redis.call('HSET', AUN, u, cjson.encode(s)) end

-- A complete unit that waits for `n` scores (`lo`, `hi`: the rewards it has, '' none; `rs`:
-- their sum as text, for a prompt attempt's group, else nil).
local function await_unit(u, v, seq, n, lo, hi, rs)
  set_reward_state(u, { n = n, lo = lo, hi = hi, x = 0, rs = rs })
  redis.call('ZADD', AQ, I(seq), u)
  redis.call('ZADD', AV, I(v), u)
  REWARD_WOKE = true
end

-- The least and greatest reward of a unit once `rw` is in (texts, compared as doubles, kept
-- exact: Lua would print doubles with 14 digits; nil or '' = none yet).
local function widen(lo, hi, rw)
  if not lo or lo == '' then return rw, rw end
  if tonumber(rw) < tonumber(lo) then lo = rw end
  if tonumber(rw) > tonumber(hi) then hi = rw end
  return lo, hi
end

-- A reward joins a group still filling (its hash `uk`, whose rmin and rmax were `lo`, `hi`).
local function note_reward(uk, rw, lo, hi)
  local l2, h2 = widen(lo, hi, rw)
  if l2 ~= lo or h2 ~= hi then redis.call('HSET', uk, 'rmin', l2, 'rmax', h2) end
end

-- Whether a complete unit of `k` rollouts, all scored, between rewards `lo` and `hi`, retires
-- under drop_zero_variance_groups.
local function zero_variance(k, lo, hi)
  return k > 1 and CFG.drop_zero_variance_groups and lo ~= nil and lo ~= ''
    and tonumber(lo) == tonumber(hi)
end

-- An 'accepted' event's item: `masked` is left out when 0 unless the awaiting flag or the
-- generator (`gen`, '' = none) follows.
local function accepted_item(rid, uid, v, tokens, new_unit, masked, awaits, gen)
  if gen ~= '' then return { rid, uid, v, tokens, new_unit, masked, awaits and 1 or 0, gen } end
  if awaits then return { rid, uid, v, tokens, new_unit, masked, 1 } end
  return { rid, uid, v, tokens, new_unit, masked > 0 and masked or nil }
end

-- A live reward lease's count of unscored rollouts changes by `d`; at 0 it has nothing left to
-- score and ends ('d'one).
local function reward_lease_less(lid, d)
  redis.call('HINCRBY', RUN, 'rwl', d)
  local rk = rlkey(lid)
  if redis.call('HINCRBY', rk, 'left', d) <= 0 and redis.call('HGET', rk, 'st') == 'l' then
    redis.call('HSET', rk, 'st', 'd')
    redis.call('PEXPIRE', rk, 86400000)
    redis.call('ZREM', RLEASES, lid)
  end
end

-- Which of a retiring unit's rollouts (`rows`) are unscored: by position, 1 (in no reward
-- lease) or 2 (in a live one), nil when none is. Their reward state goes.
local function unscored_of(u, rows)
  if not awaiting_on() then return nil end
  local ids = {}
  for i, row in ipairs(rows) do ids[i] = row[1] end
  local got = redis.call('HMGET', AW, unpack(ids))
  local s = reward_state(u)
  local flag = (s and s.l) and 2 or 1
  local out, gone = nil, {}
  for i, x in ipairs(got) do
    if x then
      out = out or {}
      out[i] = flag
      table.insert(gone, ids[i])
    end
  end
  if s then
    redis.call('HDEL', AUN, u)
    redis.call('ZREM', AQ, u)
    redis.call('ZREM', AV, u)
    if s.l and #gone > 0 then reward_lease_less(s.l, -#gone) end
  end
  if #gone > 0 then redis.call('HDEL', AW, unpack(gone)) end
  return out
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
  -- Only a unit never used can have rollouts awaiting a reward: one is handed out scored, and
  -- a reward is never taken back. So an ack's retirements look nothing up.
  local unscored = uses == 0 and unscored_of(u, rows) or nil
  GEN.forget(u)
  for i, row in ipairs(rows) do
    local item = { row[1], row[2], row[3], uses }
    if unscored and unscored[i] then item[5] = unscored[i] end
    table.insert(items, item)
    -- A consumer may still hold it (lib/consumers.lua): its blob goes only when none does.
    if CON.active() then CON.retire(row[1]) else table.insert(DELS, dkey(row[1])) end
  end
  if string.sub(u, 1, 2) == 'g:' then
    table.insert(DELS, mkey(u))
    redis.call('SADD', GDONE, u)
    if pk then
      attempt_retired(pk, att, uses, reason)
    elseif uses == 0 then
      release()
    end
  elseif uses == 0 then
    release()
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

-- A unit back from a nack or an expiry, whose record is `r`: retire it or make it ready again
-- (ack.lua does the same with the use and KL the ack adds).
local function settle(u, r, rows)
  local reason = permanent_reason(r.uses, r.v, r.kl) or GEN.reason(u)
  if reason then
    retire_unit(u, reason, r, false, rows)
  else
    make_ready(u, r.v, r.seq, r.uses)
  end
end

-- What this call retired, per reason in first-retired order: { {reason, rollouts}, ... }.
local function retired_counts()
  local res = {}
  for _, reason in ipairs(RETIRED_ORDER) do table.insert(res, { reason, #RETIRED[reason] }) end
  return res
end

-- The collected writes of units (finish()): records, ready indexes, deletions, the live count.
local function write_units()
  flush_units()
  CON.write()
  CON.settle(DELS)
  each_chunk(US_DEL, 1000, function(...) redis.call('HDEL', US, ...) end)
  if #US_DEL > 0 and redis.call('EXISTS', XV) == 1 then
    each_chunk(US_DEL, 1000, function(...) redis.call('ZREM', XV, ...) end)
  end
  each_chunk(DELS, 1000, function(...) redis.call('DEL', ...) end)
  GEN.drop()
  if LIVE_DELTA ~= 0 then redis.call('HINCRBY', RUN, 'live', LIVE_DELTA) end
end

local function emit_retired()
  for _, reason in ipairs(RETIRED_ORDER) do
    emit('retired', { reason = reason, items = RETIRED[reason] })
  end
end
