-- requires: run, pass_keys
-- Difficulty pools (SPEC "Difficulty"). Each prompt's newest completed group's mean reward is
-- kept in PMEAN (whatever the config: turning pools on later finds the history). While the run
-- has `difficulty`, every queued pass of PQ is also in the zset of its prompt's pool (PQE, PQN,
-- PQH, same scores): a work lease draws a pool with probability weight × passes queued in it,
-- then the pool's first pass in queue order. The pool zsets are rebuilt from PQ whenever the
-- thresholds change (POOL.rebuild, one call: O(passes queued)), and a prompt's queued passes
-- move when its mean does (POOL.scored, O(its passes)).
local POOL = {}
per_call(function()
  POOL.keys, POOL.scored_items = { easy = PQE, normal = PQN, hard = PQH }, {}
end)
POOL.names = { 'easy', 'normal', 'hard' }

function POOL.on() return CFG.difficulty ~= nil and CFG.difficulty ~= cjson.null end

-- What the pools of a config's `difficulty` (a decoded table, nil or null: none) depend on.
function POOL.thresholds(d)
  if d == nil or d == cjson.null then return '' end
  return string.format('%.17g %.17g', d.easy_above, d.hard_below)
end

-- The pool of a prompt whose newest mean is the text `m` (nil: none yet), under `d` (the run's
-- difficulty): above easy_above easy, below hard_below hard, else normal.
function POOL.judge(m, d)
  if not m then return 'normal' end
  local x = tonumber(m)
  if x > d.easy_above then return 'easy' end
  if x < d.hard_below then return 'hard' end
  return 'normal'
end

function POOL.of(pid) return POOL.judge(redis.call('HGET', PMEAN, pid), CFG.difficulty) end

-- A pass joins the queue (and its pool's zset) at `score`.
function POOL.enqueue(pk, score)
  redis.call('ZADD', PQ, score, pk)
  if POOL.on() then redis.call('ZADD', POOL.keys[POOL.of(pass_prompt(pk))], score, pk) end
end

-- A pass leaves the queue (and whichever pool zset holds it).
function POOL.dequeue(pk)
  redis.call('ZREM', PQ, pk)
  if POOL.on() then
    for _, k in pairs(POOL.keys) do redis.call('ZREM', k, pk) end
  end
end

-- The pool zsets again from PQ under the run's current difficulty (none: they go).
function POOL.rebuild()
  redis.call('DEL', PQE, PQN, PQH)
  if not POOL.on() then return end
  local means = {}
  local all = redis.call('ZRANGE', PQ, 0, -1, 'WITHSCORES')
  local adds = { easy = {}, normal = {}, hard = {} }
  for i = 1, #all, 2 do
    local pid = pass_prompt(all[i])
    local pool = means[pid]
    if not pool then
      pool = POOL.of(pid)
      means[pid] = pool
    end
    table.insert(adds[pool], all[i + 1])
    table.insert(adds[pool], all[i])
  end
  for name, l in pairs(adds) do
    each_chunk(l, 1000, function(...) redis.call('ZADD', POOL.keys[name], ...) end)
  end
end

-- The group of pass `pk`'s attempt completed with every reward in: `sum` of its `k` rewards
-- (text or number). The prompt's mean moves, and with it its queued passes' pool.
function POOL.scored(pk, sum, k)
  local pid = pass_prompt(pk)
  local mean = tonumber(sum) / k
  local before = POOL.on() and POOL.of(pid)
  redis.call('HSET', PMEAN, pid, string.format('%.17g', mean))
  table.insert(POOL.scored_items, { pid, mean, k })
  if not before then return end
  local after = POOL.of(pid)
  if after == before then return end
  local p = 1
  while redis.call('EXISTS', ppkey(pid .. '#' .. I(p))) == 1 do
    local q = pid .. '#' .. I(p)
    local score = redis.call('ZSCORE', POOL.keys[before], q)
    if score then
      redis.call('ZREM', POOL.keys[before], q)
      redis.call('ZADD', POOL.keys[after], score, q)
    end
    p = p + 1
  end
end

-- The 'prompt_scored' event of this call's completed groups (by finish()).
function POOL.emit()
  if #POOL.scored_items > 0 then
    emit('prompt_scored', { items = POOL.scored_items })
    POOL.scored_items = {}
  end
end

-- Up to `k` queued passes drawn from the pools, taken out of the queue: each draw picks a pool
-- of positive weight with probability weight × passes queued in it (math.random, seeded by the
-- caller), then that pool's first pass. Pools of weight 0 are not drawn from (POOL.skip).
function POOL.draw(k)
  local w, n = CFG.difficulty.weights, {}
  for _, name in ipairs(POOL.names) do
    n[name] = w[name] > 0 and redis.call('ZCARD', POOL.keys[name]) or 0
  end
  local picked = {}
  while #picked < k do
    local total = 0
    for _, name in ipairs(POOL.names) do total = total + w[name] * n[name] end
    if total <= 0 then break end
    local r, pool = math.random() * total, nil
    for _, name in ipairs(POOL.names) do
      if n[name] > 0 then
        pool = name
        r = r - w[name] * n[name]
        if r < 0 then break end
      end
    end
    local pk = redis.call('ZRANGE', POOL.keys[pool], 0, 0)[1]
    redis.call('ZREM', POOL.keys[pool], pk)
    redis.call('ZREM', PQ, pk)
    n[pool] = n[pool] - 1
    table.insert(picked, pk)
  end
  return picked
end

-- The first `limit` queued passes of every pool of weight 0, taken out of the queue: returned
-- for the caller to mark skipped.
function POOL.zero_weight(limit)
  local out = {}
  for _, name in ipairs(POOL.names) do
    if CFG.difficulty.weights[name] == 0 and #out < limit then
      local l = redis.call('ZRANGE', POOL.keys[name], 0, limit - #out - 1)
      for _, pk in ipairs(l) do
        redis.call('ZREM', POOL.keys[name], pk)
        redis.call('ZREM', PQ, pk)
        table.insert(out, pk)
      end
    end
  end
  return out
end
