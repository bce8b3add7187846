"""A Redis pub/sub channel followed for a process's lifetime: the one way this service listens
(wake-ups of long polls, token revocations). Pub/sub is fire-and-forget, so a listener is told
when its subscription is up (from then on it hears every message) and when it was lost (it may
have missed some); the subscription comes back by itself with a growing pause."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

log = logging.getLogger("rollout_broker")

READY_TIMEOUT_S = 5.0
MAX_BACKOFF_S = 5.0


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
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ready.wait(), timeout=READY_TIMEOUT_S)

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
