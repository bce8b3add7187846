"""How this service listens to Redis pub/sub: a classic channel followed for a process's
lifetime (:class:`Subscription`: token revocations), and shard channels held while someone
needs them (:class:`ShardSubscriptions`: the runs' wake-ups of long polls). Pub/sub is
fire-and-forget, so a listener is told when its subscription is up (from then on it hears every
message) and when it was lost (it may have missed some); subscriptions come back by themselves
with a growing pause."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import RedisCluster

log = logging.getLogger("rollout_broker")

READY_TIMEOUT_S = 5.0
MAX_BACKOFF_S = 5.0


async def wait_at_most(event: asyncio.Event, seconds: float) -> None:
    """Returns once ``event`` is set or after ``seconds``; a cancellation always propagates.
    (Python 3.11's ``asyncio.wait_for`` returns normally when the event is set in the same
    instant as the cancellation, which a long poll then waits out.)"""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(max(seconds, 0.0)):
            await event.wait()


def _nothing() -> None:
    return None


class Subscription:
    """Calls ``on_message(text)`` for each message of ``channel``; ``on_up()`` each time the
    subscription is (re-)established, ``on_lost()`` each time it is lost."""

    def __init__(
        self,
        redis: Redis,
        channel: str,
        on_message: Callable[[str], None],
        *,
        on_up: Callable[[], None] = _nothing,
        on_lost: Callable[[], None] = _nothing,
        name: str = "subscription",
    ) -> None:
        self._redis = redis
        self._channel = channel
        self._on_message = on_message
        self._on_up = on_up
        self._on_lost = on_lost
        self._name = name
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()

    async def start(self) -> None:
        """Subscribe; returns once subscribed (or the first attempt failed, or after
        :data:`READY_TIMEOUT_S`), so a request served after start-up misses no message."""
        self._task = asyncio.create_task(self._listen(), name=self._name)
        await wait_at_most(self._ready, READY_TIMEOUT_S)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _listen(self) -> None:
        backoff = 0.1
        while True:
            pubsub = None
            try:
                if isinstance(self._redis, RedisCluster):
                    # The cluster's pub/sub picks its node from the slot map, which a new
                    # client has not read until its first command.
                    await self._redis.initialize()
                pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
                await pubsub.subscribe(self._channel)
                self._on_up()
                self._ready.set()
                backoff = 0.1
                while True:
                    msg = await pubsub.get_message(timeout=30.0)
                    if msg is not None:
                        data = msg["data"]
                        self._on_message(data.decode() if isinstance(data, bytes) else str(data))
            except asyncio.CancelledError:
                raise
            except Exception:  # connection lost: subscribe again
                log.warning(
                    "%s: subscription to %s lost; reconnecting",
                    self._name,
                    self._channel,
                    exc_info=True,
                )
                self._on_lost()
                self._ready.set()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
            finally:
                if pubsub is not None:
                    with contextlib.suppress(Exception):
                        await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]  # typed in 8.2


# How long one read of the shard channels' listener blocks. On a Redis Cluster a read holds the
# lock of the node's connection that SSUBSCRIBE needs, and the reads of several nodes share it,
# so it is short: it bounds how late a message or a new subscription is seen. One node's
# connection is read and written at once: a read blocks until something comes.
POLL_S = 1.0
CLUSTER_POLL_S = 0.05
RETRY_S = 1.0  # a channel whose SSUBSCRIBE failed is tried again after this


class ShardSubscriptions:
    """Shard channels (``SSUBSCRIBE``, Redis 7) held while someone needs them, and
    ``linger_s`` after the last holder left: :meth:`hold` and :meth:`release` count holders;
    :meth:`ready` waits until a held channel's subscription is confirmed. On a Redis Cluster
    each channel is subscribed on the node that serves its slot (redis-py's ClusterPubSub, one
    connection per node, moved with the slot); on one node, on one connection.

    Calls ``on_message(text)`` for each message; ``on_again(channel)`` when a channel was
    subscribed again by itself (its connection came back, or its slot moved to another master):
    messages sent meanwhile may be lost; ``on_lost()`` when the whole listener was lost (every
    channel may have missed some). The listener and its channels come back by themselves."""

    def __init__(
        self,
        redis: Redis,
        on_message: Callable[[str], None],
        *,
        on_again: Callable[[str], None] = lambda channel: None,
        on_lost: Callable[[], None] = _nothing,
        linger_s: float = 0.0,
        name: str = "shard-subscriptions",
    ) -> None:
        self._redis = redis
        self._cluster = isinstance(redis, RedisCluster)
        self._poll_s = CLUSTER_POLL_S if self._cluster else POLL_S
        self._on_message = on_message
        self._on_again = on_again
        self._on_lost = on_lost
        self._linger_s = linger_s
        self._name = name
        self._holders: dict[str, int] = {}
        self._idle: dict[str, object] = {}  # channels kept after their last holder left
        # Every channel wanted (held or lingering) -> set once its subscription was confirmed,
        # or given up on for now (the holders then fall back to re-checking).
        self._ready: dict[str, asyncio.Event] = {}
        self._sent: set[str] = set()  # SSUBSCRIBEd on the current connection(s)
        self._pubsub: PubSub | None = None
        self._lock = asyncio.Lock()  # one SSUBSCRIBE or SUNSUBSCRIBE at a time, in order
        self._task: asyncio.Task[None] | None = None
        self._syncs: set[asyncio.Task[None]] = set()
        self._started = asyncio.Event()
        self._up = False

    def channels(self) -> set[str]:
        """The channels subscribed (or being subscribed) on the current connection(s)."""
        return set(self._sent)

    async def start(self) -> None:
        """Start listening; returns once up (or the first attempt failed, or after
        :data:`READY_TIMEOUT_S`)."""
        self._task = asyncio.create_task(self._listen(), name=self._name)
        await wait_at_most(self._started, READY_TIMEOUT_S)

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._syncs) if t is not None]
        self._task = None
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def hold(self, channel: str) -> None:
        """One more holder of ``channel``: subscribed from now on, if it was not."""
        self._holders[channel] = self._holders.get(channel, 0) + 1
        self._idle.pop(channel, None)
        if channel not in self._ready:
            self._ready[channel] = asyncio.Event()
            self._sync_soon(channel)

    def release(self, channel: str) -> None:
        """One holder fewer; the last one's leaving unsubscribes ``channel`` after
        ``linger_s``, unless it is held again by then."""
        left = self._holders.pop(channel, 0) - 1
        if left > 0:
            self._holders[channel] = left
            return
        if self._linger_s > 0 and self._task is not None:
            mark = self._idle[channel] = object()
            asyncio.get_running_loop().call_later(self._linger_s, self._expire, channel, mark)
        else:
            self._expire(channel, None)

    async def ready(self, channel: str, at_most_s: float = READY_TIMEOUT_S) -> None:
        """Returns once ``channel``'s subscription is confirmed, at once while the listener is
        down (holders re-check instead), or after ``at_most_s``."""
        event = self._ready.get(channel)
        if event is None or event.is_set() or not self._up:
            return
        await wait_at_most(event, at_most_s)

    def _expire(self, channel: str, mark: object | None) -> None:
        if channel in self._holders or self._idle.get(channel) is not mark:
            return  # held again, or released again later
        self._idle.pop(channel, None)
        self._ready.pop(channel, None)
        self._sync_soon(channel)

    def _sync_soon(self, channel: str) -> None:
        if self._task is None:
            return  # not started: start() subscribes whatever is held
        task = asyncio.create_task(self._sync(channel))
        self._syncs.add(task)
        task.add_done_callback(self._syncs.discard)

    async def _sync(self, channel: str) -> None:
        """Subscribe ``channel`` or unsubscribe it, whichever it needs now."""
        async with self._lock:
            pubsub = self._pubsub
            want = channel in self._ready
            if pubsub is None or want == (channel in self._sent):
                return  # down (the listener subscribes all once back), or as wanted
            try:
                if want:
                    await pubsub.ssubscribe(channel)
                    if self._pubsub is pubsub:
                        self._sent.add(channel)
                else:
                    self._sent.discard(channel)
                    await pubsub.sunsubscribe(channel)
            except Exception:
                log.warning("%s: (un)subscribing %s failed", self._name, channel, exc_info=True)
                if want:
                    event = self._ready.get(channel)
                    if event is not None:
                        event.set()  # its holders re-check meanwhile
                    asyncio.get_running_loop().call_later(RETRY_S, self._sync_soon, channel)
                    if isinstance(self._redis, RedisCluster):
                        # The slot's master may be gone: read the slot map again, or the next
                        # try goes to the same node, unless some other command did.
                        with contextlib.suppress(Exception):
                            await self._redis.nodes_manager.initialize()

    async def _open(self) -> PubSub:
        if isinstance(self._redis, RedisCluster):
            await self._redis.initialize()
            return self._redis.pubsub()
        pubsub = self._redis.pubsub()
        # A read needs a connection, even with nothing subscribed.
        await pubsub.connect()  # type: ignore[no-untyped-call]
        return pubsub

    def _handle(self, msg: dict[str, Any]) -> None:
        kind, channel, data = msg["type"], msg["channel"], msg["data"]
        if isinstance(channel, bytes):
            channel = channel.decode()
        if kind == "smessage":
            self._on_message(data.decode() if isinstance(data, bytes) else str(data))
        elif kind == "ssubscribe":
            event = self._ready.get(channel)
            if event is None:
                return  # no longer wanted
            if event.is_set():
                self._on_again(channel)  # subscribed again by itself: it may have missed some
            event.set()

    async def _listen(self) -> None:
        backoff = 0.1
        while True:
            pubsub = None
            try:
                pubsub = await self._open()
                async with self._lock:
                    self._pubsub = pubsub
                    self._sent.clear()
                for channel in list(self._ready):
                    self._sync_soon(channel)
                self._up = True
                self._started.set()
                backoff = 0.1
                while True:
                    msg = await pubsub.get_sharded_message(timeout=self._poll_s)
                    if msg is not None:
                        self._handle(msg)
            except asyncio.CancelledError:
                raise
            except Exception:  # connection lost: listen again
                log.warning("%s: shard channels lost; reconnecting", self._name, exc_info=True)
            finally:
                self._up = False
                if pubsub is not None:
                    await self._close(pubsub)
            for event in self._ready.values():
                event.set()  # a confirmation after this is a subscription made again
            self._on_lost()
            self._started.set()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)

    async def _close(self, pubsub: PubSub) -> None:
        if self._pubsub is pubsub:
            self._pubsub = None
            self._sent.clear()
        with contextlib.suppress(Exception):
            await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]  # typed in 8.2
