-- requires: run
-- The staleness budget: with step_groups = B, no more than (V + max_staleness + 1) * B groups
-- are admitted at once. The run's 'adm' counts them; it changes only through admit() and
-- release(), summed over the call and written once by finish() (write_admission). A group is
-- admitted when it comes in on its own (a single rollout, a group of no prompt attempt) or when
-- its prompt pass is handed out in a work lease, and released when its attempt ends without a
-- use (it retires unused, expires or is returned) or is done for zero variance.
local ADM_DELTA
per_call(function() ADM_DELTA = 0 end)

local function admit(n) ADM_DELTA = ADM_DELTA + n end
local function release() ADM_DELTA = ADM_DELTA - 1 end

-- Groups that may still be admitted at the run's version (nil: no budget, step_groups is not
-- set).
local function admission_left()
  local B = CFG.step_groups
  if B == nil or B == cjson.null then return nil end
  local adm = tonumber(redis.call('HGET', RUN, 'adm') or '0') + ADM_DELTA
  return (R.ver + CFG.max_staleness + 1) * B - adm
end

local function write_admission()
  if ADM_DELTA ~= 0 then
    redis.call('HINCRBY', RUN, 'adm', ADM_DELTA)
    if ADM_DELTA < 0 then WORK_WOKE = true end  -- budget came free
  end
end
