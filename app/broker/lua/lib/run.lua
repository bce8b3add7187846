-- requires: events
-- The run's state and config, read once per call, and the rules that judge a rollout by them.

local R, CFG
per_call(function() R, CFG = nil, nil end)
local function load_run()
  local f = redis.call('HMGET', RUN, 'cfg', 'ver', 'st', 'floor', 'lay')
  if not f[1] then return false end
  if f[5] == '3' then  -- layout 3 kept every ready unit in Q too, which nothing reads now
    redis.call('UNLINK', Q)
    redis.call('HSET', RUN, 'lay', '4')
  end
  CFG = cjson.decode(f[1])
  R = { ver = tonumber(f[2]), st = f[3], floor = tonumber(f[4]), cfg = f[1] }
  return true
end

-- The adaptive KL penalty's β, or nil when kl_coef is null (off): the run hash's 'beta', absent
-- until an ack first moves it from kl_coef (and again after a patch changes kl_coef).
local function kl_beta()
  local c = CFG.kl_coef
  if c == nil or c == cjson.null then return nil end
  local b = redis.call('HGET', RUN, 'beta')
  if b then return tonumber(b) end
  return c
end

-- β as a reply or a stored answer carries it: '' when off, else 17 digits (exact for a double).
local function beta_text(beta)
  if beta == nil then return '' end
  return string.format('%.17g', beta)
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

-- The version a rollout is judged by: v_old (its policy_version) under stale_tokens 'keep', its
-- newest trained token's v_new under 'mask' (whose older tokens are masked at hand-out instead).
local function governing_version(v_old, v_new)
  if CFG.stale_tokens == 'mask' then return v_new end
  return v_old
end

-- The oldest version a token handed out at V may have and stay trained under stale_tokens
-- 'mask' (the tokens below are handed out with loss_mask 0), or nil under 'keep'.
local function token_floor(V)
  if CFG.stale_tokens == 'mask' then return V - CFG.max_staleness end
  return nil
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

-- The run's policy version becomes v, with the location of its weights ('' for none: those of
-- the version before belong to it) and the time of the change; the followers of the version
-- (GET .../policy?after=) are woken, if any waits.
local function move_version(v, weights)
  redis.call('HSET', RUN, 'ver', I(v), 'vat', I(NOW))
  if weights ~= '' then
    redis.call('HSET', RUN, 'wts', weights)
  else
    redis.call('HDEL', RUN, 'wts')
  end
  R.ver = v
  if redis.call('EXISTS', PWAITING) == 1 then publish_wake(POLICY_WAKE) end
end

local function run_snapshot(change)
  local f = redis.call('HMGET', RUN, 'id', 'cfg', 'ver', 'st', 'created')
  emit('run', {
    run_id = f[1], change = change, config = cjson.decode(f[2]),
    policy_version = tonumber(f[3]), status = f[4], created_at = tonumber(f[5]),
  })
end
