-- requires: consumers, pass_keys
-- Consumers of kind preferences (SPEC "Consumers"): their items are pairs of rollouts of one
-- complete group whose rewards differ. A group reaches them whole, at its delivery point
-- (CON.group): source received when the group is complete with every reward in (ingest.lua,
-- score.lua), source trained at its first acked use (ack.lua). Each member's reward is the one
-- this call was given (CON.known) or else the one in its stored blob (CON.stored_reward). A run
-- without a preferences consumer of the source reads and keeps nothing (CON.wants()).
per_call(function() CON.rw = {} end)  -- rollout id -> the reward this call was given (a number)

-- A reward this call was given (`text`, exact): an ingest writes its blobs only at its end, so
-- a group it completes reads the rewards of its own rollouts here.
function CON.known(rid, text)
  if CON.wants('received') then CON.rw[rid] = tonumber(text) end
end

-- The rewards of an ack's samples (its event's items: [rollout_id, ..., reward] with the reward
-- seventh): a group's first acked use gives its members' rewards without a blob read.
function CON.acked_rewards(items)
  if not CON.wants('trained') then return end
  for _, item in ipairs(items) do
    if type(item[7]) == 'number' then CON.rw[item[1]] = item[7] end
  end
end

-- msgpack types by their first byte: those of a fixed size (bytes), and those of a length
-- (its bytes, then the bytes before the payload: ext's type) — bin, str, ext 8/16/32.
CON.MP_FIXED = {
  [0xcc] = 2, [0xd0] = 2, [0xcd] = 3, [0xd1] = 3, [0xca] = 5, [0xce] = 5, [0xd2] = 5,
  [0xcb] = 9, [0xcf] = 9, [0xd3] = 9, [0xd4] = 3, [0xd5] = 4, [0xd6] = 6, [0xd7] = 10,
  [0xd8] = 18,
}
CON.MP_SIZED = {
  [0xc4] = { 1, 0 }, [0xc5] = { 2, 0 }, [0xc6] = { 4, 0 }, [0xd9] = { 1, 0 }, [0xda] = { 2, 0 },
  [0xdb] = { 4, 0 }, [0xc7] = { 1, 1 }, [0xc8] = { 2, 1 }, [0xc9] = { 4, 1 },
}

-- The big-endian length in the n bytes after position i of `s`.
function CON.mp_len(s, i, n)
  local x = 0
  for j = i + 1, i + n do x = x * 256 + (string.byte(s, j) or 0) end
  return x
end

-- The size of the msgpack object at position i of `s` (which holds its first 9 bytes, or to
-- the end): its header and payload bytes, and how many objects are nested in it (array and
-- map entries).
function CON.mp_size(s, i)
  local b = string.byte(s, i)
  if b <= 0x7f or b >= 0xe0 or b == 0xc0 or b == 0xc2 or b == 0xc3 then return 1, 0 end
  if b >= 0xa0 and b <= 0xbf then return b - 0x9f, 0 end  -- fixstr
  if b >= 0x90 and b <= 0x9f then return 1, b - 0x90 end  -- fixarray
  if b >= 0x80 and b <= 0x8f then return 1, 2 * (b - 0x80) end  -- fixmap
  if CON.MP_FIXED[b] then return CON.MP_FIXED[b], 0 end
  local z = CON.MP_SIZED[b]
  if z then return 1 + z[1] + z[2] + CON.mp_len(s, i, z[1]), 0 end
  if b == 0xdc then return 3, CON.mp_len(s, i, 2) end  -- array 16
  if b == 0xdd then return 5, CON.mp_len(s, i, 4) end  -- array 32
  if b == 0xde then return 3, 2 * CON.mp_len(s, i, 2) end  -- map 16
  return 5, 2 * CON.mp_len(s, i, 4)  -- map 32 (0xdf; 0xc1 is never used)
end

-- The reward of a stored rollout, read from its packed blob (docs/design.md "Storage format":
-- a msgpack map whose arrays are binary, which cmsgpack cannot read): the map's entries are
-- walked in windows of 64 bytes read with GETRANGE, each entry skipped by its length, up to the
-- key 'w' (the fifth entry), whose value alone is unpacked. Two reads for a rollout whose id
-- fits in the first. nil when the blob is gone or holds no reward.
function CON.stored_reward(rid)
  local key, buf, base = dkey(rid), '', 0
  local function at(off)  -- the position in `buf` of offset `off`, its next 9 bytes in it
    if off < base or off + 9 > base + #buf then
      buf, base = redis.call('GETRANGE', key, off, off + 63), off
    end
    if off - base >= #buf then return nil end
    return off - base + 1
  end
  local i = at(0)
  if not i then return nil end
  local off, entries = CON.mp_size(buf, i)
  for _ = 1, entries / 2 do
    i = at(off)
    if not i then return nil end
    if string.byte(buf, i) == 0xa1 and string.byte(buf, i + 1) == 0x77 then  -- the key 'w'
      i = at(off + 2)
      if not i or string.byte(buf, i) == 0xc0 then return nil end
      return cmsgpack.unpack(string.sub(buf, i, i + CON.mp_size(buf, i) - 1))
    end
    local left = 2  -- the key, then its value, with what they nest
    while left > 0 do
      i = at(off)
      if not i then return nil end
      local size, inner = CON.mp_size(buf, i)
      off, left = off + size, left - 1 + inner
    end
  end
  return nil
end

-- The pairs consumer `c` takes of a group's members `m` ({rollout_id, version, reward} in
-- arrival order): each {version (the older of the two), chosen, rejected, margin as '%.17g'}.
-- A pair's rewards differ by min_margin or more, and by more than nothing (equal rewards
-- prefer neither), the difference taken in doubles. best_worst: the first member of the
-- highest reward against the first of the lowest; all: every such pair, in arrival order of
-- its earlier member, then of its later one.
function CON.pairs(c, m)
  local out = {}
  local function take(a, b)  -- a above b
    local d = a[3] - b[3]
    if d > 0 and d >= c.min_margin then
      table.insert(out, { math.min(a[2], b[2]), a[1], b[1], string.format('%.17g', d) })
    end
  end
  if c.pairs == 'all' then
    for i = 1, #m - 1 do
      for j = i + 1, #m do
        if m[i][3] >= m[j][3] then take(m[i], m[j]) else take(m[j], m[i]) end
      end
    end
    return out
  end
  local hi, lo = m[1], m[1]
  for i = 2, #m do
    if m[i][3] > hi[3] then hi = m[i] end
    if m[i][3] < lo[3] then lo = m[i] end
  end
  take(hi, lo)
  return out
end

-- A complete group reaches the preferences consumers of `source`: its rollouts `rows`
-- ({rollout_id, version, ...} in arrival order), `pk` the prompt pass it answers (nil: none).
-- A group of one, or one with a member unscored (never, at the delivery points), gives none.
function CON.group(source, rows, pk)
  if not CON.wants(source) or #rows < 2 then return end
  local m = {}
  for i, row in ipairs(rows) do
    local w = CON.rw[row[1]] or CON.stored_reward(row[1])
    if w == nil then return end
    m[i] = { row[1], row[2], w }
  end
  local prompt = pk and pass_prompt(pk) or ''
  for _, c in ipairs(CON.of(source, 'preferences')) do
    for _, p in ipairs(CON.pairs(c, m)) do CON.queue(c, { p[1], p[2], p[3], p[4], prompt }) end
  end
end
