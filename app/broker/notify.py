"""Wake-ups for long-polling trainers, generators, version followers, reward workers and
consumers' readers: Redis 7 sharded pub/sub, one shard channel per run.

The scripts SPUBLISH a run's tag (see app/keys.py) on the run's own channel
(``keys.wake_channel``, ``<prefix>:{<run_id>}:wake``, in the slot of the run's keys)
whenever units become ready (ingest, nack, expiry, an ack that returns units), the tag followed
by ``keys.WORK_WAKE`` when prompts or staleness budget became available to generators, and
followed by ``keys.POLICY_WAKE`` when the policy version moved (it wakes every follower of it);
``keys.REWARD_WAKE`` and ``keys.CONSUMER_WAKE`` likewise. On a Redis Cluster a wake-up thus stays
on the node that holds the run instead of crossing the cluster bus to every node, and reaches
only the API processes where one of the run's requests waits: a process subscribes (SSUBSCRIBE)
to a run's channel when the first of its requests joins the run's line, and unsubscribes
:data:`LINGER_S` after the last one left (:class:`app.pubsub.ShardSubscriptions`).

Waiters join their run's line, and the run's subscription is confirmed, *before* they try, so a
wake-up that lands between the try and the wait is never lost, and a wake-up reaches one waiter
at a time (:class:`Waker`). Pub/sub is fire-and-forget, so waiters also re-check at a slow
fallback interval (not a tight loop), and a subscription that was lost, or made again by itself
(a dropped connection; on a cluster, the run's slot moving to another master after a failover
or a reshard), wakes the waiters it concerns to re-check at once.
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
from app.pubsub import READY_TIMEOUT_S, ShardSubscriptions, wait_at_most

log = logging.getLogger(__name__)

FALLBACK_RECHECK_S = 1.0
# How long a run's channel stays subscribed after its last waiter in this process left. A
# trainer's or generator's next long poll usually follows its last within this (lease, work,
# ack, lease again), and a waiter whose run is still subscribed tries at once, where one whose
# run is not waits a round trip for SSUBSCRIBE first; a subscription held by nobody costs only
# the messages no one waits for, which the scripts send only while someone long-polls the run.
LINGER_S = 5.0

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
        self,
        redis: Redis,
        prefix: str,
        fallback_s: float = FALLBACK_RECHECK_S,
        linger_s: float = LINGER_S,
    ) -> None:
        self._fallback_s = fallback_s
        self._prefix = prefix
        self._lines: dict[tuple[str, str], list[Ticket]] = {}
        self._subscriptions = ShardSubscriptions(
            redis,
            lambda message: self.wake(*keys.run_of_wake(prefix, message)),
            on_again=lambda channel: self._recheck(keys.run_of_wake_channel(prefix, channel)),
            on_lost=self._recheck,
            linger_s=linger_s,
            name="broker-waker",
        )

    async def start(self) -> None:
        await self._subscriptions.start()

    async def stop(self) -> None:
        await self._subscriptions.stop()

    def subscribed(self) -> set[str]:
        """The run ids whose wake-ups this process listens to."""
        return {keys.run_of_wake_channel(self._prefix, c) for c in self._subscriptions.channels()}

    @contextlib.contextmanager
    def line(
        self, run_id: str, kind: str = "", size: int = 1, *, listen: bool = True
    ) -> Iterator[Ticket]:
        """A place in the run's line for ``kind`` ('' for trainers, ``keys.WORK_WAKE`` for
        generators) asking for ``size``; join it, and await :meth:`listening`, *before* the
        first try, so a wake-up that lands between a try and the wait is never lost. Leaving
        passes on a wake-up this waiter got but did not use. A waiter that will not wait
        (``listen`` false) does not subscribe to the run's wake-ups."""
        ticket = Ticket((run_id, kind), size)
        self._lines.setdefault(ticket.key, []).append(ticket)
        channel = keys.wake_channel(self._prefix, run_id)
        if listen:
            self._subscriptions.hold(channel)
        try:
            yield ticket
        finally:
            if listen:
                self._subscriptions.release(channel)
            line = self._lines.get(ticket.key, [])
            line.remove(ticket)
            if not line:
                self._lines.pop(ticket.key, None)
            if ticket.event.is_set():
                self._wake_next(ticket.key)

    async def listening(self, ticket: Ticket, at_most_s: float = READY_TIMEOUT_S) -> None:
        """Returns once the wake-ups of the ticket's run reach this process (its channel's
        subscription is confirmed: at once if it already was), or after ``at_most_s`` (and
        never later than a fallback re-check would come), or at once while the subscriptions
        are down (the waiter re-checks meanwhile)."""
        channel = keys.wake_channel(self._prefix, ticket.key[0])
        limit = min(at_most_s, self._fallback_s, READY_TIMEOUT_S)
        await self._subscriptions.ready(channel, limit)

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

    def _recheck(self, run_id: str | None = None) -> None:
        """Every waiter of ``run_id`` (of every run, for None) tries again: a subscription was
        lost or made again, so a wake-up meant for them may have been lost."""
        for (run, _), line in self._lines.items():
            if run_id is None or run == run_id:
                for ticket in line:
                    ticket.event.set()

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
        await wait_at_most(ticket.event, self.wait_window(at_most_s))


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
    with waker.line(run_id, kind, size, listen=wait_s > 0) as ticket:
        if wait_s > 0:
            await waker.listening(ticket, wait_s)
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
