-- The library every script starts with, right after the key prologue. KEYS[1] is the run hash
-- "<prefix>:{<run_id>}:run"; every other key of the run is derived from it, so all of them share
-- the {<run_id>} hash tag and the scripts run unchanged on Redis Cluster. KEYS[2] is the run's
-- never-written guard key: declared so that a cluster refuses a script while the run's slot is
-- being moved (app/keys.py, GUARD), never read or written here. The key locals (RUN, B, TAG,
-- EV, Q, VS, OPEN, OV, LEASES, US, SEEN, GDONE, WAITING, PQ, PSEEN, WLEASES, WWAITING, PWAITING, AUD) and
-- key functions (qvkey, ukey, mkey, dkey, bkey, ppkey, pbkey, wkey) come before this file,
-- generated from app/keys.py. Each script names the libraries it uses in its first line
-- ('-- requires: ...'), and so does each library; app/broker/store.py puts them before the script
-- in dependency order.
--
-- Replies: every script returns ok(...) or err(code, ...); app/broker/replies.py decodes them
-- and maps each code to an HTTP error. Outcomes the caller tells apart ('created' or 'exists')
-- are the first value of an ok; refusals are err codes listed in that module's table.
local function ok(...) return { 'ok', ... } end
local function err(code, ...) return { 'err', code, ... } end

local NOW  -- the call's time in ms, Redis's clock
per_call(function()
  local t = redis.call('TIME')
  NOW = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end)

local function I(x) return string.format('%d', x) end

-- Writes collected during a call are made in a few variadic commands, `step` arguments each.
local function each_chunk(list, step, fn)
  for i = 1, #list, step do fn(unpack(list, i, math.min(i + step - 1, #list))) end
end
