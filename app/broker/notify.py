"""Wake-ups for long-polling trainers and generators: one Redis pub/sub subscription per process.

The scripts PUBLISH a run's tag (see app/keys.py) on the wake channel whenever units
become ready (ingest, nack, expiry, an ack that returns units), the tag followed by
``keys.WORK_WAKE`` when prompts or staleness budget became available to generators, and followed
by ``keys.POLICY_WAKE`` when the policy version moved (it wakes every follower of it). Waiters
join their run's line *before* they try, so a wake-up that lands between the try and the wait
is never lost, and a wake-up reaches one waiter at a time (:class:`Waker`). Pub/sub is
fire-and-forget, so waiters also re-check at a slow fallback interval (not a tight loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

from redis.asyncio import Redis

from app import keys
from app.pubsub import Subscription

log = logging.getLogger(__name__)

FALLBACK_RECHECK_S = 1.0

# Kinds whose wake-up reaches every waiter of the run at once: each waits for its own answer
# (a version other than the one it has; the items of its own consumer), which one waiter's try
# says nothing about.
BROADCAST = frozenset({keys.POLICY_WAKE, keys.CONSUMER_WAKE})

R = TypeVar("R")


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
        # Waiters fall back to re-checking while it is down.
        self._subscription = Subscription(
            redis,
            channel,
            lambda base: self.wake(*keys.run_of_wake(prefix, base)),
            name="broker-waker",
        )

    async def start(self) -> None:
        # Subscribed before the first request is served, so no early wake-up is missed.
        await self._subscription.start()

    async def stop(self) -> None:
        await self._subscription.stop()

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
        """A wake-up from the channel: the first waiter not woken yet tries (every waiter, for
        a kind of :data:`BROADCAST`)."""
        if kind in BROADCAST:
            for ticket in self._lines.get((run_id, kind), ()):
                ticket.event.set()
            return
        self._wake_next((run_id, kind))

    def _wake_next(self, key: tuple[str, str]) -> None:
        if key[1] in BROADCAST:
            return  # its wake-ups reach every waiter: none is passed on
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


@dataclass(frozen=True, slots=True)
class Try:
    """What one try of a long poll is told: whether it is the last, how long the caller will
    wait for a wake-up if it finds too little, and how long the request has waited so far."""

    last: bool
    wait_ms: int
    waited_ms: int


async def long_poll(
    waker: Waker,
    run_id: str,
    kind: str,
    size: int,
    wait_s: float,
    attempt: Callable[[Try], Awaitable[tuple[R | None, int | None]]],
) -> R | None:
    """Try until ``attempt`` gives a result or ``wait_s`` is over, waiting in the run's line
    for ``kind`` between tries. ``attempt`` answers (result, None) or (None, how much it found,
    if it knows)."""
    started = time.monotonic()
    deadline = started + max(wait_s, 0.0)
    with waker.line(run_id, kind, size) as ticket:
        while True:
            waker.trying(ticket)
            remaining = deadline - time.monotonic()
            last = remaining <= 0
            got, found = await attempt(
                Try(
                    last=last,
                    # Ask for wake-ups for as long as the wait below, with a second to spare.
                    wait_ms=0 if last else int(waker.wait_window(remaining) * 1000) + 1000,
                    waited_ms=int((time.monotonic() - started) * 1000),
                )
            )
            if got is not None:
                waker.served(ticket)
                return got
            waker.short(ticket, found)
            if last:
                return None
            await waker.wait(ticket, remaining)
