"""Acknowledged means replicated, when asked (``BROKER_REDIS_WAIT_REPLICAS``): commands run on
the master of a key's slot, then a barrier write and ``WAIT n timeout``, all pipelined on one
connection to that node, in one round trip.

``WAIT`` waits for the replication offset of its connection's own last write that Redis
propagated. A script that changed nothing propagates nothing: a retried ingest answered
``duplicate``, a refused call, a lease that found nothing. ``WAIT`` after it alone would return at
once while the earlier write the answer relies on (the first try's, answered ``503`` because it
was not replicated in time) may still be on the master alone. So a barrier write comes first:
a ``SET`` of the run's sync key (app/keys.py), which always propagates, at an offset above every
write the node made before it. ``WAIT`` counting ``n`` replicas then covers the commands' writes
and all earlier ones of that node. (Redis 6.2 and 7.0 take the offset after a connection's last
command of any kind, so there the barrier only repeats what WAIT does anyway; later versions
take it after the last command that propagated.)

On a Redis Cluster the three commands go to the node that serves the key's slot, on one of its
connections (``WAIT`` sent through the cluster client would go to every master, and on
connections of their own). A redirection, a slot that moved, a cluster that is down or a lost
connection there is not followed: the commands may have run nowhere, or on a node that no longer
serves the slot, and the replicas' count would be some other node's. The call answers ``503``
(the request is idempotent, the client sends it again) once the cluster client has been shown
the way (one ordinary read of the key, through the client's own redirection and topology
handling, which paces its refreshes itself).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import redis.exceptions
from redis.asyncio import Redis
from redis.asyncio.cluster import PipelineCommand, RedisCluster

from app.errors import NotReplicated, Unavailable
from app.functions import function_missing, load_command

__all__ = ["BARRIER_TTL_MS", "Replicas"]

log = logging.getLogger(__name__)

# The barrier key only has to be written: it expires by itself soon after.
BARRIER_TTL_MS = 1000

# Errors of a cluster node that say the slot is not (or no longer, or not yet) served there.
_ROUTING = (
    redis.exceptions.AskError,  # MovedError too
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterError,  # ClusterDownError too
    redis.exceptions.SlotNotCoveredError,
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
)


class Replicas:
    """Runs a call on the master of a key's slot, answered only once ``replicas`` replicas have
    acknowledged it (and every earlier write of that master) within ``timeout_ms``; else
    :class:`~app.errors.NotReplicated` (``503``, ``Retry-After``). The write was still made on
    the master: the request must be idempotent, as every broker write is by its ids."""

    def __init__(
        self, redis: Redis | RedisCluster, replicas: int, timeout_ms: int, retry_after_s: int = 1
    ) -> None:
        if replicas < 1 or timeout_ms < 1:
            raise ValueError("replicas and timeout_ms must be at least 1")
        self.redis = redis
        self.replicas = replicas
        self.timeout_ms = timeout_ms
        self.retry_after_s = retry_after_s

    async def script(
        self, function: str, code: str, barrier: str, keys: Sequence[Any], args: Sequence[Any]
    ) -> Any:
        """The reply of ``function`` (of library ``code``, loaded there first when the node
        lacks it) run with ``keys`` and ``args`` on the master of ``barrier``'s slot, which
        must be that of ``keys``."""
        call = ("FCALL", function, len(keys), *keys, *args)
        reply = await self._run(barrier, call)
        if function_missing(reply):
            # A node without the library (a restart, a failover, FUNCTION FLUSH): load it.
            await self._run(barrier, load_command(code))
            reply = await self._run(barrier, call)
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def barrier(self, barrier: str) -> None:
        """Returns once every write the master of ``barrier``'s slot made so far has reached
        ``replicas`` replicas; NotReplicated when too few acknowledged in time."""
        await self._run(barrier, None)

    async def _run(self, barrier: str, call: tuple[Any, ...] | None) -> Any:
        """The reply of ``call`` (an exception as a value), after the barrier and WAIT."""
        commands = [] if call is None else [call]
        commands += [
            ("SET", barrier, 1, "PX", BARRIER_TTL_MS),
            ("WAIT", self.replicas, self.timeout_ms),
        ]
        if isinstance(self.redis, RedisCluster):
            replies = await self._on_node(self.redis, barrier, commands)
        else:
            async with self.redis.pipeline(transaction=False) as pipe:
                for command in commands:
                    pipe.execute_command(*command)
                replies = await pipe.execute(raise_on_error=False)
        *reply, written, acked = replies
        if reply and function_missing(reply[0]):
            return reply[0]  # not run: nothing to wait for
        for outcome in (written, acked):
            if isinstance(outcome, Exception):
                raise outcome
        if int(acked) < self.replicas:
            raise NotReplicated(
                self.replicas, int(acked), self.timeout_ms, retry_after_s=self.retry_after_s
            )
        return reply[0] if reply else None

    async def _on_node(
        self, cluster: RedisCluster, barrier: str, commands: list[tuple[Any, ...]]
    ) -> list[Any]:
        """The replies of ``commands`` sent on one connection to the node serving ``barrier``'s
        slot; Unavailable when that node does not serve it or cannot be reached."""
        pipeline = [PipelineCommand(i, *command) for i, command in enumerate(commands)]
        try:
            await cluster.initialize()  # at once unless the client has no slot map yet
            node = cluster.get_node_from_key(barrier)
            if node is None:  # typed for the replica it may be asked for; never the master
                raise redis.exceptions.SlotNotCoveredError(barrier)
            await node.execute_pipeline(pipeline)
        except _ROUTING as exc:
            raise await self._lost_way(cluster, barrier, exc) from exc
        replies = [command.result for command in pipeline]
        routing = next((r for r in replies if isinstance(r, _ROUTING)), None)
        if routing is not None:
            raise await self._lost_way(cluster, barrier, routing) from routing
        return replies

    async def _lost_way(
        self, cluster: RedisCluster, barrier: str, exc: BaseException
    ) -> Unavailable:
        """The 503 of a call that did not reach the slot's master, once the cluster client has
        had a chance to learn where the slot is now."""
        try:
            await cluster.exists(barrier)  # routed, redirected and refreshed as any read
        except Exception:  # the client handles what it can of its own error
            log.debug("routing read of %s failed", barrier, exc_info=True)
        return Unavailable(
            f"Redis: the call did not reach the master of the run's slot ({type(exc).__name__}); "
            f"try again in {self.retry_after_s} s",
            retry_after_s=self.retry_after_s,
        )
