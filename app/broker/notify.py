"""Wake-ups for long-polling trainers and generators: one Redis pub/sub subscription per process.

The scripts PUBLISH a run's tag (see app/broker/keys.py) on the wake channel whenever units
become ready (ingest, nack, expiry, an ack that returns units), and the tag followed by
``keys.WORK_WAKE`` when prompts or staleness budget became available to generators. Waiters
join their run's line *before* they try, so a wake-up that lands between the try and the wait
is never lost, and a wake-up reaches one waiter at a time (:class:`Waker`). Pub/sub is
fire-and-forget, so waiters also re-check at a slow fallback interval (not a tight loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

from redis.asyncio import Redis

from app.broker import keys

log = logging.getLogger(__name__)

FALLBACK_RECHECK_S = 1.0


@dataclass(eq=False)
class Ticket:
    """One waiting request's place in the line of its run: how much it asks for, and the
    event a wake-up sets."""

    key: tuple[str, str]
    size: int
    event: asyncio.Event = field(default_factory=asyncio.Event)


class Waker:
    """Wakes long-polling requests, one at a time.

    The waiters of a run (per kind: trainers, generators) stand in a line in arrival order. A
    wake-up sets the first waiter not already woken; a waiter that was served passes the wake-up
    on (more may be ready), and one that found too little passes it on only to the first waiter
    that what it found can serve. So one rollout posted to a run with 64 waiting trainers runs
    one or two lease scripts, not 64, and a burst still reaches as many waiters as it can serve.
    """

    def __init__(
        self, redis: Redis, channel: str, prefix: str, fallback_s: float = FALLBACK_RECHECK_S
    ) -> None:
        self._redis = redis
        self._fallback_s = fallback_s
        self._channel = channel
        self._prefix = prefix
        self._lines: dict[tuple[str, str], list[Ticket]] = {}
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

    @contextlib.contextmanager
    def line(self, run_id: str, kind: str = "", size: int = 1) -> Iterator[Ticket]:
        """A place in the run's line for ``kind`` ('' for trainers, ``keys.WORK_WAKE`` for
        generators) asking for ``size``; join it *before* the first try, so a wake-up that lands
        between a try and the wait is never lost. Leaving passes on a wake-up this waiter got
        but did not use."""
        ticket = Ticket((run_id, kind), size)
        self._lines.setdefault(ticket.key, []).append(ticket)
        try:
            yield ticket
        finally:
            line = self._lines.get(ticket.key, [])
            line.remove(ticket)
            if not line:
                self._lines.pop(ticket.key, None)
            if ticket.event.is_set():
                self._wake_next(ticket.key)

    def waiting(self, run_id: str, kind: str = "") -> int:
        """How many requests of this process stand in the run's line."""
        return len(self._lines.get((run_id, kind), ()))

    def trying(self, ticket: Ticket) -> None:
        """The waiter is about to try: a wake-up from now on is a new one."""
        ticket.event.clear()

    def served(self, ticket: Ticket) -> None:
        """The waiter got what it asked for: more may be ready, wake the next one."""
        ticket.event.clear()
        self._wake_next(ticket.key)

    def short(self, ticket: Ticket, found: int | None) -> None:
        """The waiter found ``found`` (None: unknown), too little for it: wake the first other
        waiter that ``found`` can serve, if any."""
        if not found:
            return
        for other in self._lines.get(ticket.key, ()):
            if other is not ticket and not other.event.is_set() and other.size <= found:
                other.event.set()
                return

    def wake(self, run_id: str, kind: str = "") -> None:
        """A wake-up from the channel: the first waiter not woken yet tries."""
        self._wake_next((run_id, kind))

    def _wake_next(self, key: tuple[str, str]) -> None:
        for ticket in self._lines.get(key, ()):
            if not ticket.event.is_set():
                ticket.event.set()
                return

    def wait_window(self, at_most_s: float) -> float:
        """How long one :meth:`wait` lasts at most."""
        return min(at_most_s, self._fallback_s)

    async def wait(self, ticket: Ticket, at_most_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ticket.event.wait(), timeout=self.wait_window(at_most_s))

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
