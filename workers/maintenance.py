"""The maintenance loop: expire leases, time out groups, retire what the rules no longer allow,
for every run of the active index, every ``interval`` seconds. Lease calls do the same lazily;
this loop makes it happen for runs nobody is leasing from. A closed run leaves the index once it
has settled (``Broker.sweep_all``), so it costs the loop nothing from then on."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from app.broker.service import Broker

log = logging.getLogger(__name__)


async def run_maintenance(
    broker: Broker,
    interval: float,
    stop: asyncio.Event,
    done: Callable[[], None] = lambda: None,
) -> None:
    """Sweep until ``stop`` is set; ``done`` is called after each pass that succeeded."""
    while not stop.is_set():
        try:
            await broker.sweep_all()
            done()
        except Exception:  # keep sweeping: a Redis blip must not end the loop
            log.exception("maintenance sweep failed")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=interval)
