-- requires: replies
-- The names of prompt passes: a pass '<prompt_id>#<pass>', its attempt's group
-- '<prompt_id>#<pass>.<att>' (see passes.lua).
local function pass_prompt(pk) return string.match(pk, '^(.*)#%d+$') end
local function pass_number(pk) return tonumber(string.match(pk, '#(%d+)$')) end
local function attempt_group(pk, att) return pk .. '.' .. I(att) end
