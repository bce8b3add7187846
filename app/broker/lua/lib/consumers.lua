-- requires: replies, events
-- Consumers (SPEC "Consumers"): readers of a run beside the policy trainer, each with its own
-- queue. CON.CONS maps each consumer's name to '<gen> <created ms> <config JSON>' (gen: the run's
-- consumer counter when it was created, so that a batch record of a deleted consumer is never
-- read as one of a new consumer of the same name). Per consumer: CON.qkey(name), its pending
-- items by delivery seq (the run hash's 'cseq'): for kind rollouts '<version> <rollout_id>', for
-- kind preferences a pair '<version> <pair_id> <margin> <chosen> <rejected> <prompt_id>' (version:
-- the older rollout's; pair_id: its delivery seq; margin as '%.17g'; prompt_id '' when none; ids
-- hold no spaces, so an item of one space is a rollout's; lib/preferences.lua makes the pairs);
-- CON.ckey(name), its counters (delivered, acked, dropped, leased); CON.lkey(name), its live batches
-- by expiry ms; CON.bkey('<name>:<gen>:<batch_id>'), a batch (st l/a/n/e, items as JSON
-- [member, score, ...], exp, n).
--
-- A rollout's packed blob lives while any consumer holds it, pending or leased: CON.CREF counts the
-- holds on each rollout, one per item that names it (a rollout in three pairs of a consumer is
-- held three times). retire_rollouts() (lib/units.lua) hands a retiring rollout's
-- blob to CON.retire() instead of deleting it; CON.settle() deletes the blobs nobody holds and
-- marks the others in CON.CORPH, and the release of the last hold deletes those.
--
-- What each call adds to a consumer's delivered, acked and dropped goes into one 'consumers'
-- event (CON.emit(), by finish() or at the end of a consumer script): CON.acc, by name.
--
-- A run without consumers pays one EXISTS a call (CON.active(), then kept), nothing a rollout.
-- One table, CON, holds this library's state and functions: a script's main chunk may have at
-- most 200 locals.
-- keep_ms: how long a settled batch record is kept, a day, as a trainer's is.
-- The key prologue declares CON with the consumer keys in it (CON.CONS, CON.qkey, ...).
per_call(function()
  CON.on, CON.td, CON.list, CON.out, CON.order, CON.retiring = nil, nil, nil, {}, {}, {}
  CON.acc, CON.acc_order = {}, {}
end)
CON.keep_ms = 86400000
CON.sources = { received = true, trained = true }

-- Whether the run has a consumer: read once a call, then kept.
function CON.active()
  if CON.on == nil then CON.on = redis.call('EXISTS', CON.CONS) == 1 end
  return CON.on
end

-- A consumer's record: its config (kind, source, max_lag, min_margin, pairs, retention_rollouts)
-- with name, gen, created and text (the config JSON as stored); nulls read as nil.
function CON.parse(name, text)
  local gen, created, cfg = string.match(text, '^(%d+) (%d+) (.*)$')
  local c = cjson.decode(cfg)
  c.name, c.gen, c.created, c.text = name, gen, tonumber(created), cfg
  for _, k in ipairs({ 'max_lag', 'min_margin', 'pairs' }) do
    if c[k] == cjson.null then c[k] = nil end
  end
  return c
end

function CON.get(name)
  local text = redis.call('HGET', CON.CONS, name)
  if not text then return nil end
  return CON.parse(name, text)
end

-- The consumers of a source ('received', 'trained') and kind ('rollouts', the default, or
-- 'preferences'), read once a call; nil when the run has none.
function CON.of(source, kind)
  if not CON.active() then return nil end
  if CON.list == nil then
    CON.list = {}
    for _, s in ipairs({ 'received', 'trained' }) do
      CON.list[s] = { rollouts = {}, preferences = {} }
    end
    local all = redis.call('HGETALL', CON.CONS)
    for i = 1, #all, 2 do
      local c = CON.parse(all[i], all[i + 1])
      table.insert(CON.list[c.source][c.kind], c)
    end
  end
  return CON.list[source][kind or 'rollouts']
end

-- Whether the run has a preferences consumer of `source`: all a run without one pays for pairs.
function CON.wants(source)
  local cs = CON.of(source, 'preferences')
  return cs ~= nil and #cs > 0
end

-- Consumer `name`'s `field` (delivered, acked, dropped) grew by n in this call: for its event.
function CON.note(name, field, n)
  if n == 0 then return end
  local a = CON.acc[name]
  if not a then
    a = { delivered = 0, acked = 0, dropped = 0 }
    CON.acc[name] = a
    table.insert(CON.acc_order, name)
  end
  a[field] = a[field] + n
end

-- Add n to consumer `name`'s counter `field` in CON.ckey(name), and to its event.
function CON.count(name, field, n)
  redis.call('HINCRBY', CON.ckey(name), field, n)
  CON.note(name, field, n)
end

-- The 'consumers' event of this call: per consumer whose counts changed, what they grew by.
function CON.emit()
  if #CON.acc_order == 0 then return end
  local items = {}
  for _, name in ipairs(CON.acc_order) do
    local a = CON.acc[name]
    table.insert(items, { name, a.delivered, a.acked, a.dropped })
  end
  emit('consumers', { items = items })
  CON.acc, CON.acc_order = {}, {}
end

-- A pair item's fields: pair_id, chosen, rejected, margin (text), prompt_id ('' = none).
function CON.pair(member)
  local id, margin, chosen, rejected, prompt =
    string.match(member, '^%d+ (%d+) (%S+) (%S+) (%S+) (.*)$')
  return id, chosen, rejected, margin, prompt
end

-- The rollouts an item holds: a rollout item's one, a pair's two.
function CON.held(member)
  local rest = string.match(member, '^%d+ (.*)$')
  if not string.find(rest, ' ', 1, true) then return { rest } end
  local _, chosen, rejected = CON.pair(member)
  return { chosen, rejected }
end

-- Item `x` of consumer `c` is delivered in this call: { version, rollout_id } or a pair's
-- { version, chosen, rejected, margin text, prompt_id or '' }; CON.write() writes it.
function CON.queue(c, x)
  local l = CON.out[c.name]
  if not l then
    l = { c = c, items = {} }
    CON.out[c.name] = l
    table.insert(CON.order, c.name)
  end
  table.insert(l.items, x)
end

-- The item of `x` (CON.queue) delivered at seq `seq`.
function CON.member(x, seq)
  if #x == 2 then return I(x[1]) .. ' ' .. x[2] end
  return table.concat({ I(x[1]), I(seq), x[4], x[2], x[3], x[5] }, ' ')
end

-- A rollout (`rid`, governing version `v`) reaches the rollouts consumers of `source`; written
-- by CON.write() at the end of the call.
function CON.deliver(source, rid, v)
  local cs = CON.of(source)
  if not cs then return end
  for _, c in ipairs(cs) do CON.queue(c, { v, rid }) end
end

-- A rewind gave back every use of unit `u`, whose first one its rollouts' 'trained' consumers
-- were handed: its next first use is not handed to them again (each sees a rollout once).
function CON.rewound(u)
  if CON.active() then redis.call('SADD', CON.TD, u) end
end

-- Whether unit `u`'s first use is its first gradient ever (not one again after a rewind).
function CON.first_use(u)
  if not CON.active() then return true end
  if CON.td == nil then CON.td = redis.call('EXISTS', CON.TD) == 1 end
  return not (CON.td and redis.call('SREM', CON.TD, u) == 1)
end

-- One more hold on `rid` in counts `n`, whose rollouts `order` lists in first-seen order.
function CON.tally(n, order, rid)
  if not n[rid] then
    n[rid] = 0
    table.insert(order, rid)
  end
  n[rid] = n[rid] + 1
end

-- Release the holds of `members`: a retired rollout nobody holds any more loses its blob. The
-- mirror of CON.hold(): a few commands a thousand rollouts, not a few a rollout.
function CON.release(members)
  local n, order = {}, {}
  for _, m in ipairs(members) do
    for _, rid in ipairs(CON.held(m)) do CON.tally(n, order, rid) end
  end
  for i = 1, #order, 1000 do
    local part = { unpack(order, i, math.min(i + 999, #order)) }
    local have = redis.call('HMGET', CON.CREF, unpack(part))
    local keep, gone = {}, {}
    for j, rid in ipairs(part) do
      local left = tonumber(have[j] or '0') - n[rid]
      if left > 0 then
        table.insert(keep, rid)
        table.insert(keep, I(left))
      else
        table.insert(gone, rid)
      end
    end
    if #keep > 0 then redis.call('HSET', CON.CREF, unpack(keep)) end
    if #gone > 0 then
      redis.call('HDEL', CON.CREF, unpack(gone))
      local orphan, dels = redis.call('SMISMEMBER', CON.CORPH, unpack(gone)), {}
      for j, rid in ipairs(gone) do
        if orphan[j] == 1 then table.insert(dels, dkey(rid)) end
      end
      if #dels > 0 then
        redis.call('SREM', CON.CORPH, unpack(gone))
        redis.call('DEL', unpack(dels))
      end
    end
  end
end

-- Pending items of consumer `c` that will not be delivered: counted, their holds released.
function CON.drop(c, members)
  if #members == 0 then return end
  CON.count(c.name, 'dropped', #members)
  CON.release(members)
end

-- Keep at most retention_rollouts pending: the oldest beyond it are dropped.
function CON.trim(c)
  local k = CON.qkey(c.name)
  local excess = redis.call('ZCARD', k) - c.retention_rollouts
  if excess <= 0 then return end
  local got = redis.call('ZPOPMIN', k, excess)
  local members = {}
  for i = 1, #got, 2 do table.insert(members, got[i]) end
  CON.drop(c, members)
end

-- The deliveries of this call: each consumer's new items after its pending ones, a hold on
-- each rollout per item that names it, then the retention trim.
function CON.write()
  if #CON.order == 0 then return end
  local seq = tonumber(redis.call('HGET', RUN, 'cseq') or '0')
  local refs, ref_order = {}, {}
  for _, name in ipairs(CON.order) do
    local items = CON.out[name].items
    local args = {}
    for _, x in ipairs(items) do
      seq = seq + 1
      local m = CON.member(x, seq)
      table.insert(args, I(seq))
      table.insert(args, m)
      for j = 2, math.min(#x, 3) do  -- the rollout, or chosen and rejected
        CON.tally(refs, ref_order, x[j])
      end
    end
    each_chunk(args, 1000, function(...) redis.call('ZADD', CON.qkey(name), ...) end)
    CON.count(name, 'delivered', #items)
  end
  redis.call('HSET', RUN, 'cseq', I(seq))
  CON.hold(refs, ref_order)
  for _, name in ipairs(CON.order) do CON.trim(CON.out[name].c) end
  CON.out, CON.order = {}, {}
  -- None is sent while no reader waits.
  if redis.call('EXISTS', CON.WAITING) == 1 then publish_wake(CON.WAKE) end
end

-- Add refs[rid] holds to each rollout of `order` in CON.CREF: those held by nobody yet are
-- written with one HSET a thousand, the others incremented one by one.
function CON.hold(refs, order)
  for i = 1, #order, 1000 do
    local part = { unpack(order, i, math.min(i + 999, #order)) }
    local have = redis.call('HMGET', CON.CREF, unpack(part))
    local new = {}
    for j, rid in ipairs(part) do
      if have[j] then
        redis.call('HINCRBY', CON.CREF, rid, refs[rid])
      else
        table.insert(new, rid)
        table.insert(new, I(refs[rid]))
      end
    end
    if #new > 0 then redis.call('HSET', CON.CREF, unpack(new)) end
  end
end

-- A retiring rollout's blob (retire_rollouts): kept while a consumer holds the rollout.
function CON.retire(rid) table.insert(CON.retiring, rid) end

-- After CON.write(): the blobs of the retiring rollouts nobody holds join `dels`; the others
-- are marked in CON.CORPH, deleted when their last hold goes.
function CON.settle(dels)
  local rids = CON.retiring
  if #rids == 0 then return end
  CON.retiring = {}
  for i = 1, #rids, 1000 do
    local part = { unpack(rids, i, math.min(i + 999, #rids)) }
    local held = redis.call('HMGET', CON.CREF, unpack(part))
    local kept = {}
    for j, rid in ipairs(part) do
      if held[j] then
        table.insert(kept, rid)
      else
        table.insert(dels, dkey(rid))
      end
    end
    if #kept > 0 then redis.call('SADD', CON.CORPH, unpack(kept)) end
  end
end

function CON.batch_key(c, bid) return CON.bkey(c.name .. ':' .. c.gen .. ':' .. bid) end

-- The live batch `bid` of consumer `name` that an ack or a nack settles: (consumer, items) when
-- it is live; else the script's answer: its repeat when it was settled as `done` ('a' or 'n'),
-- or the refusal (an expired one is returned to the queue on the way).
function CON.live_batch(name, bid, done)
  if redis.call('HEXISTS', RUN, 'cfg') == 0 then return nil, nil, err('run_missing') end
  local c = CON.get(name)
  if not c then return nil, nil, err('consumer_missing', name) end
  local f = redis.call('HMGET', CON.batch_key(c, bid), 'st', 'items', 'exp', 'n')
  if not f[1] then return nil, nil, err('batch_missing') end
  if f[1] == done then return nil, nil, ok('repeat', tonumber(f[4])) end
  if f[1] == 'n' then return nil, nil, err('batch_nacked') end
  if f[1] == 'a' then return nil, nil, err('batch_acked') end
  if f[1] == 'e' then return nil, nil, err('lease_expired') end
  local items = cjson.decode(f[2])
  if tonumber(f[3]) <= NOW then
    CON.back(c, bid, 'e', items)
    return nil, nil, err('lease_expired')
  end
  return c, items, nil
end

-- The members of a batch's items (JSON [member, score, ...]).
function CON.members(items)
  local out = {}
  for i = 1, #items, 2 do table.insert(out, items[i]) end
  return out
end

-- A live batch ends: state `st` ('a' acked, 'n' nacked, 'e' expired), kept a day.
function CON.settle_batch(c, bid, st)
  local bk = CON.batch_key(c, bid)
  redis.call('HSET', bk, 'st', st)
  redis.call('PEXPIRE', bk, CON.keep_ms)
  redis.call('ZREM', CON.lkey(c.name), bid)
end

-- A nacked or expired batch's items go back to pending at their delivery seqs.
function CON.back(c, bid, st, items)
  local args = {}
  for i = 1, #items, 2 do
    table.insert(args, items[i + 1])
    table.insert(args, items[i])
  end
  each_chunk(args, 1000, function(...) redis.call('ZADD', CON.qkey(c.name), ...) end)
  redis.call('HINCRBY', CON.ckey(c.name), 'leased', -(#items / 2))
  CON.settle_batch(c, bid, st)
end

-- Expire up to `limit` of consumer `c`'s leases whose time is up; how many it expired.
function CON.expire(c, limit)
  local due = redis.call('ZRANGEBYSCORE', CON.lkey(c.name), '-inf', I(NOW), 'LIMIT', 0, limit)
  for _, bid in ipairs(due) do
    local items = cjson.decode(redis.call('HGET', CON.batch_key(c, bid), 'items'))
    CON.back(c, bid, 'e', items)
  end
  return #due
end

-- The maintenance sweep's part: expired leases of every consumer, up to `limit` each; whether
-- one had more.
function CON.sweep(limit)
  if not CON.active() then return false end
  local more = false
  for _, src in ipairs({ 'received', 'trained' }) do
    for _, kind in ipairs({ 'rollouts', 'preferences' }) do
      for _, c in ipairs(CON.of(src, kind)) do
        if CON.expire(c, limit) == limit then more = true end
      end
    end
  end
  return more
end

-- Everything consumer `c` holds goes: its live batches, its pending items, its counters. Its
-- pending and leased items are counted dropped in the call's event.
function CON.free(c)
  local cl = CON.lkey(c.name)
  local leased = 0
  for _, bid in ipairs(redis.call('ZRANGE', cl, 0, -1)) do
    local bk = CON.batch_key(c, bid)
    local members = CON.members(cjson.decode(redis.call('HGET', bk, 'items')))
    leased = leased + #members
    CON.release(members)
    redis.call('DEL', bk)
  end
  local pending = redis.call('ZRANGE', CON.qkey(c.name), 0, -1)
  CON.release(pending)
  redis.call('DEL', cl, CON.qkey(c.name), CON.ckey(c.name))
  CON.note(c.name, 'dropped', #pending + leased)
  return #pending
end

-- What a lease answers for its items `members`: kind rollouts their rollout ids; kind
-- preferences each rollout of the pairs once, in first appearance, and the pairs
-- { {pair_id, prompt_id, chosen, rejected, margin}, ... }.
function CON.answer(c, members)
  local rids, pairs, seen = {}, {}, {}
  for _, m in ipairs(members) do
    for _, rid in ipairs(CON.held(m)) do
      if not seen[rid] then
        seen[rid] = true
        table.insert(rids, rid)
      end
    end
    if c.kind == 'preferences' then
      local id, chosen, rejected, margin, prompt = CON.pair(m)
      table.insert(pairs, { id, prompt, chosen, rejected, margin })
    end
  end
  if c.kind == 'preferences' then return rids, pairs end
  return rids
end

-- Why the pair settings of config `cfg` are refused, or nil; `group_size` the run's.
function CON.invalid_pairs(cfg, group_size)
  if cfg.kind ~= 'preferences' then
    if (cfg.min_margin or cjson.null) ~= cjson.null or (cfg.pairs or cjson.null) ~= cjson.null then
      return 'min_margin and pairs apply to kind preferences only'
    end
    return nil
  end
  local m = cfg.min_margin
  if type(m) ~= 'number' or m ~= m or m < 0 or m == math.huge then
    return 'min_margin must be a finite number >= 0'
  end
  if cfg.pairs ~= 'best_worst' and cfg.pairs ~= 'all' then
    return 'pairs must be best_worst or all'
  end
  if group_size < 2 then
    return 'kind preferences needs groups: the run\'s group_size is ' .. I(group_size)
  end
  return nil
end

-- Why a consumer config is refused, or nil. `cfg` decoded from the caller's JSON; `group_size`
-- the run's.
function CON.invalid(name, cfg, group_size)
  if not string.match(name, '^[A-Za-z0-9_.-]+$') or #name > 64 then
    return 'name must be 1 to 64 of A-Z a-z 0-9 _ . -'
  end
  if cfg.kind ~= 'rollouts' and cfg.kind ~= 'preferences' then
    return 'kind must be rollouts or preferences'
  end
  if not CON.sources[cfg.source] then return 'source must be received or trained' end
  local lag = cfg.max_lag
  if lag ~= cjson.null and (type(lag) ~= 'number' or lag < 0 or lag % 1 ~= 0) then
    return 'max_lag must be null or an integer >= 0'
  end
  local keep = cfg.retention_rollouts
  if type(keep) ~= 'number' or keep < 1 or keep % 1 ~= 0 then
    return 'retention_rollouts must be an integer >= 1'
  end
  return CON.invalid_pairs(cfg, group_size)
end
