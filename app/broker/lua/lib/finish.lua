-- requires: units
-- The end of every script that changes a run's units or passes: the writes collected during the
-- call, then its events, then the wake-ups.
local function finish()
  write_units()
  write_admission()
  emit_retired()
  emit_passes()
  emit_partials()
  POOL.emit()
  CON.emit()
  wake_waiting()
end
