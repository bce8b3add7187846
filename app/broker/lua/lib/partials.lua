-- requires: run, pass_keys
-- Partial rollouts: what a generator sampled of a prompt's responses before it gave the prompt
-- back (work_return.lua). They stay with the prompt pass, in its hash ptkey(pk): rollout_id ->
-- the packed partial, in the packed rollout format of app/broker/packing.py (and pmkey(pk): its
-- version and tokens). The lease that
-- next hands the pass out carries them ('resumed'; one whose version is already too stale is
-- 'dropped' there instead); the rollout posted complete under the same rollout_id takes its
-- place (ingest.lua). An attempt that ends unfinished brings those still kept back with its
-- pass ('returned' again); the attempt's group completing without them, or the pass failing,
-- drops them. Each change is one 'partials' event per kind, written by finish().
local PARTIAL_EVENTS  -- { {kind, reason or false, lease_id or false, items}, ... }
per_call(function() PARTIAL_EVENTS = {} end)

local function note_partial(kind, reason, lid, pk, rid, v, tokens)
  local last = PARTIAL_EVENTS[#PARTIAL_EVENTS]
  if not last or last[1] ~= kind or last[2] ~= (reason or false) or last[3] ~= (lid or false) then
    last = { kind, reason or false, lid or false, {} }
    table.insert(PARTIAL_EVENTS, last)
  end
  table.insert(last[4], { rid, pass_prompt(pk), pass_number(pk), v, tokens })
end

-- A partial kept with pass pk: its packed form, and '<version> <tokens> <newest version>'
-- beside it (Lua's msgpack cannot read the packed form's binary arrays).
local function keep_partial(pk, rid, v, tokens, blob, vn)
  redis.call('HSET', ptkey(pk), rid, blob)
  redis.call('HSET', pmkey(pk), rid, I(v) .. ' ' .. I(tokens) .. ' ' .. I(vn))
end

local function forget_partial(pk, rid)
  redis.call('HDEL', ptkey(pk), rid)
  redis.call('HDEL', pmkey(pk), rid)
end

-- The partials kept with pass pk: { {rollout_id, blob, version, tokens, newest version}, ... }
-- (a partial kept before the newest version was: its version).
local function partials_of(pk)
  local flat = redis.call('HGETALL', ptkey(pk))
  local out = {}
  for i = 1, #flat, 2 do
    local meta = redis.call('HGET', pmkey(pk), flat[i])
    local v, n, vn = string.match(meta, '^(%d+) (%d+) ?(%d*)$')
    v = tonumber(v)
    table.insert(out, { flat[i], flat[i + 1], v, tonumber(n), tonumber(vn) or v })
  end
  return out
end

-- Every partial of pass pk leaves, counted 'dropped' for `reason`.
local function drop_partials(pk, reason, lid)
  local kept = partials_of(pk)
  if #kept == 0 then return end
  for _, p in ipairs(kept) do note_partial('dropped', reason, lid, pk, p[1], p[3], p[4]) end
  redis.call('DEL', ptkey(pk), pmkey(pk))
end

-- The attempt of pass pk ended unfinished and the pass goes back to the queue: the partials it
-- was handed out with, and not completed, go back with it.
local function partials_back(pk, lid)
  for _, p in ipairs(partials_of(pk)) do note_partial('returned', nil, lid, pk, p[1], p[3], p[4]) end
end

-- Pass pk is handed out in work lease lid: its partials go with it, { blob, ... }, except those
-- whose version is already too stale to be trained on (judged by the rollout's oldest version,
-- its policy_version, under stale_tokens 'keep'), or that hold a token of a version the run was
-- rewound below ('rewound'): dropped, their responses start afresh.
local function hand_out_partials(pk, lid)
  local out = {}
  for _, p in ipairs(partials_of(pk)) do
    local why = (p[5] > R.ver and 'rewound')
      or (CFG.stale_tokens ~= 'mask' and version_reason(p[3]))
    if why then
      forget_partial(pk, p[1])
      note_partial('dropped', why, lid, pk, p[1], p[3], p[4])
    else
      note_partial('resumed', nil, lid, pk, p[1], p[3], p[4])
      table.insert(out, p[2])
    end
  end
  return out
end

local function emit_partials()
  for _, p in ipairs(PARTIAL_EVENTS) do
    local ev = { change = p[1], items = p[4] }
    if p[2] then ev['reason'] = p[2] end
    if p[3] then ev['lease_id'] = p[3] end
    emit('partials', ev)
  end
end
