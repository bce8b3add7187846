-- requires: replies
-- Generators (SPEC "Accounting": generator_kl_max). UG maps each live unit (buffered, leased or
-- filling) whose rollouts name generators to them, space-separated; GQ maps each quarantined
-- generator to the ms it was quarantined at. An entry of UG goes when its unit retires
-- (retire_rollouts), so UG is bounded by what is live. One table, GEN, holds this library's
-- state and functions: a script's main chunk may have at most 200 locals.
local GEN = {}
per_call(function() GEN.add, GEN.order, GEN.del, GEN.on = {}, {}, {}, nil end)

-- Whether the run has a quarantined generator: read once a call, then kept.
function GEN.quarantine_on()
  if GEN.on == nil then GEN.on = redis.call('EXISTS', GQ) == 1 end
  return GEN.on
end

-- The first of `gens` (a list) that is quarantined, or nil.
function GEN.quarantined_of(gens)
  if #gens == 0 or not GEN.quarantine_on() then return nil end
  local got = redis.call('HMGET', GQ, unpack(gens))
  for i, x in ipairs(got) do
    if x then return gens[i] end
  end
  return nil
end

function GEN.words(text)
  local out = {}
  for w in string.gmatch(text or '', '%S+') do table.insert(out, w) end
  return out
end

-- A rollout of unit `u` names generator `gen` (ingest); written by GEN.write().
function GEN.note(u, gen)
  local s = GEN.add[u]
  if not s then
    s = {}
    GEN.add[u] = s
    table.insert(GEN.order, u)
  end
  s[gen] = true
end

-- Merge what GEN.note() collected into UG: a single rollout's unit is new, a group's may have
-- generators already.
function GEN.write()
  if #GEN.order == 0 then return end
  local groups, had = {}, {}
  for _, u in ipairs(GEN.order) do
    if string.sub(u, 1, 2) == 'g:' then table.insert(groups, u) end
  end
  if #groups > 0 then
    local got = redis.call('HMGET', UG, unpack(groups))
    for i, u in ipairs(groups) do had[u] = got[i] end
  end
  local out = {}
  for _, u in ipairs(GEN.order) do
    local words, known, changed = GEN.words(had[u]), {}, false
    for _, w in ipairs(words) do known[w] = true end
    for gen in pairs(GEN.add[u]) do
      if not known[gen] then
        table.insert(words, gen)
        changed = true
      end
    end
    if changed then
      table.sort(words)
      table.insert(out, u)
      table.insert(out, table.concat(words, ' '))
    end
  end
  each_chunk(out, 1000, function(...) redis.call('HSET', UG, ...) end)
  GEN.add, GEN.order = {}, {}
end

-- A retiring unit's entry goes with it, with the call's other deletions (GEN.drop()).
function GEN.forget(u) table.insert(GEN.del, u) end

function GEN.drop()
  if #GEN.del == 0 then return end
  each_chunk(GEN.del, 1000, function(...) redis.call('HDEL', UG, ...) end)
  GEN.del = {}
end

-- 'quarantined' when one of unit `u`'s generators is quarantined, else nil: a unit back from a
-- lease (settle, ack) retires rather than being handed out again.
function GEN.reason(u)
  if not GEN.quarantine_on() then return nil end
  if GEN.quarantined_of(GEN.words(redis.call('HGET', UG, u))) then return 'quarantined' end
  return nil
end
