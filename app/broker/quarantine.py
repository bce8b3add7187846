"""The operators' side of a generator's quarantine (SPEC "Accounting": generator_kl_max): lifting
it. The quarantine itself is the ack's (app/broker/lua/lib/quarantine.lua): it is decided on the
figures an ack measures, in the same script call."""

from __future__ import annotations

from app.broker.replies import ErrorContext, StoreError, error_for
from app.broker.schemas import ReleaseResult
from app.broker.store import RedisStore
from app.caller import Caller, action_entry

__all__ = ["release"]


async def release(store: RedisStore, run_id: str, generator_id: str, by: Caller) -> ReleaseResult:
    """Lift ``generator_id``'s quarantine in the run; the audit log records who did it. Safe to
    repeat: a generator not quarantined is answered ``released: false``."""
    entry = action_entry(by, "generator.release", run_id, {"generator_id": generator_id})
    try:
        outcome = await store.release_generator(run_id, generator_id, entry=entry)
    except StoreError as err:
        raise error_for(err, ErrorContext(run_id)) from None
    return ReleaseResult(generator_id=generator_id, released=outcome == "released")
