-- requires: units, audit
-- The quarantine of a generator (SPEC "Accounting": generator_kl_max, generator_window_tokens):
-- after each ack, each generator's mean KL over its last generator_window_tokens measured
-- trained tokens, judged once it has that many. Its window (GW) keeps one '<tokens> <kl_sum>'
-- pair per acked batch, oldest first, only as far back as the window reaches; the oldest pair
-- counts for the share of its tokens the window still covers.

-- Retire what a newly quarantined generator has buffered: ready, awaiting and filling units.
-- A leased unit retires when its lease ends (GEN.reason() in settle and in the ack). One pass
-- over UG, bounded by the run's live units.
function GEN.retire_of(gen)
  flush_units()  -- units this call made ready are in the indexes, to be seen
  local all = redis.call('HGETALL', UG)
  for i = 1, #all, 2 do
    local u, mine = all[i], false
    for _, w in ipairs(GEN.words(all[i + 1])) do
      if w == gen then mine = true end
    end
    if mine then
      local rec = redis.call('HGET', US, u)
      local r = rec and parse_unit(rec)
      if not r then
        retire_open(u, 'quarantined')
      elseif is_ready(u, r.v) then
        retire_unit(u, 'quarantined', r, true)
      elseif redis.call('HEXISTS', AUN, u) == 1 then
        retire_unit(u, 'quarantined', r, false)
      end
    end
  end
end

-- Quarantine `gen`, whose window of `tokens` trained tokens had mean KL `mean`: refused from now
-- on (ingest, work), its buffered units retired, a 'generator' event and, from `entry` (an audit
-- entry as app/caller.py writes them, '' = none), an audit entry naming the broker.
function GEN.quarantine(gen, mean, tokens, entry)
  redis.call('HSET', GQ, gen, I(NOW))
  redis.call('HDEL', GW, gen)
  GEN.on = true
  emit('generator', { generator_id = gen, quarantined = 1, kl_mean = mean, window_tokens = tokens })
  if entry ~= '' then
    local e = cjson.decode(entry)
    e.detail = {
      generator_id = gen, kl_mean = mean, window_tokens = tokens,
      generator_kl_max = CFG.generator_kl_max,
    }
    audit(cjson.encode(e))
  end
  GEN.retire_of(gen)
end

-- One acked batch's `gens` (its event's items: generator_id, samples, tokens, kl_tokens,
-- kl_sum, ...): each generator's window moves on, and a full window whose mean KL is above
-- generator_kl_max quarantines its generator.
function GEN.judge(gens, entry)
  local max = CFG.generator_kl_max
  if max == nil or max == cjson.null then return end
  local W = CFG.generator_window_tokens or 100000
  for _, g in ipairs(gens) do
    local gen, t, s = g[1], g[4], g[5]
    if t > 0 and redis.call('HEXISTS', GQ, gen) == 0 then
      local p = GEN.words(redis.call('HGET', GW, gen))
      table.insert(p, I(t))
      table.insert(p, string.format('%.17g', s))
      local total = 0
      for i = 1, #p, 2 do total = total + tonumber(p[i]) end
      local first = 1
      while total - tonumber(p[first]) >= W do
        total = total - tonumber(p[first])
        first = first + 2
      end
      p = { unpack(p, first) }
      local mean = nil
      if total >= W then
        local t1 = tonumber(p[1])
        local sum = tonumber(p[2]) * (W - (total - t1)) / t1
        for i = 3, #p, 2 do sum = sum + tonumber(p[i + 1]) end
        mean = sum / W
      end
      if mean and mean > max then
        GEN.quarantine(gen, mean, W, entry)
      else
        redis.call('HSET', GW, gen, table.concat(p, ' '))
      end
    end
  end
end
