"""Wake-ups for long-polling trainers and generators: one Redis pub/sub subscription per process.

The scripts PUBLISH a run's tag (see app/broker/keys.py) on the wake channel whenever units
become ready (ingest, nack, expiry, an ack that returns units), and the tag followed by
``keys.WORK_WAKE`` when prompts or staleness budget became available to generators. Waiters
take the run's current event *before* they try, so a wake-up that lands between the try and the
wait is never lost. Pub/sub is fire-and-forget, so waiters also re-check at a slow fallback
interval (not a tight loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from redis.asyncio import Redis

from app.broker import keys

log = logging.getLogger(__name__)

FALLBACK_RECHECK_S = 1.0


class Waker:
    def __init__(
        self, redis: Redis, channel: str, prefix: str, fallback_s: float = FALLBACK_RECHECK_S
    ) -> None:
        self._redis = redis
        self._fallback_s = fallback_s
        self._channel = channel
        self._prefix = prefix
        self._events: dict[tuple[str, str], asyncio.Event] = {}
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._listen(), name="broker-waker")
        # Subscribed before the first request is served, so no early wake-up is missed.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ready.wait(), timeout=5)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def event(self, run_id: str, kind: str = "") -> asyncio.Event:
        """The event that the run's next wake-up of this kind sets ('' for trainers,
        ``keys.WORK_WAKE`` for generators); take it before checking for work."""
        ev = self._events.get((run_id, kind))
        if ev is None:
            ev = self._events[(run_id, kind)] = asyncio.Event()
        return ev

    def wake(self, run_id: str, kind: str = "") -> None:
        ev = self._events.pop((run_id, kind), None)
        if ev is not None:
            ev.set()

    def wait_window(self, at_most_s: float) -> float:
        """How long one :meth:`wait` lasts at most."""
        return min(at_most_s, self._fallback_s)

    async def wait(self, ev: asyncio.Event, at_most_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ev.wait(), timeout=self.wait_window(at_most_s))

    async def _listen(self) -> None:
        backoff = 0.1
        while True:
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self._channel)
                self._ready.set()
                backoff = 0.1
                while True:
                    msg = await pubsub.get_message(timeout=30.0)
                    if msg is None:
                        continue
                    data = msg["data"]
                    base = data.decode() if isinstance(data, bytes) else str(data)
                    self.wake(*keys.run_of_wake(self._prefix, base))
            except asyncio.CancelledError:
                raise
            except Exception:  # connection lost: resubscribe; waiters fall back meanwhile
                log.warning("wake subscription lost; reconnecting", exc_info=True)
                self._ready.set()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]
