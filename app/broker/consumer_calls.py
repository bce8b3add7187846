"""The store's calls on a run's consumers (SPEC "Consumers"), kinds ``rollouts`` and
``preferences``: create, read and delete one (``consumer_create.lua``, ``consumer_view.lua``,
``consumer_delete.lua``), and its leases (``consumer_lease.lua``, ``consumer_ack.lua``,
``consumer_nack.lua``). A part of :class:`app.broker.store.RedisStore`, which gives it its
script calls and rollout reads.
lua/lib/consumers.lua says what is kept where."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from app.broker.replies import StoreError, text
from app.broker.store_parts import StorePart

__all__ = [
    "CONSUMER_SWEEP_LIMIT",
    "DEFAULT_RETENTION",
    "ConsumerCalls",
    "ConsumerLease",
    "ConsumerPair",
    "ConsumerView",
]

DEFAULT_RETENTION = 100_000  # retention_rollouts when the creator names none (SPEC)
CONSUMER_SWEEP_LIMIT = 64  # expired leases a consumer's lease call returns first, at most


@dataclass(frozen=True, slots=True)
class ConsumerView:
    name: str
    config: dict[str, Any]  # kind, source, max_lag, min_margin, pairs, retention_rollouts
    created_ms: int
    delivered: int
    acked: int
    dropped: int
    leased: int
    pending: int


@dataclass(frozen=True, slots=True)
class ConsumerPair:
    """A preference pair of a lease: two rollouts of one complete group, ``chosen`` the one
    with the higher reward."""

    pair_id: str  # unique in the consumer, the same when handed out again
    prompt_id: str | None  # the group's prompt, when it was posted under a work lease
    chosen: str
    rejected: str
    margin: float  # chosen's reward minus rejected's


@dataclass(frozen=True, slots=True)
class ConsumerLease:
    batch_id: str
    expires_at_ms: int
    rollout_ids: list[str]  # kind preferences: each rollout of the pairs once
    blobs: list[bytes]  # the packed rollouts, in the order of rollout_ids
    repeat: bool  # a retried call: the batch leased before under this batch_id
    pairs: list[ConsumerPair] | None = None  # kind preferences: the batch's items


def consumer_config(
    kind: str,
    source: str,
    max_lag: int | None,
    retention_rollouts: int,
    min_margin: float | None = None,
    pairs: str | None = None,
) -> str:
    """The config as the scripts store and compare it: canonical JSON (min_margin and pairs
    null for kind rollouts)."""
    cfg = {
        "kind": kind,
        "source": source,
        "max_lag": max_lag,
        "min_margin": min_margin,
        "pairs": pairs,
        "retention_rollouts": retention_rollouts,
    }
    return json.dumps(cfg, sort_keys=True, separators=(",", ":"))


def _pair(raw: list[Any]) -> ConsumerPair:
    """A pair of consumer_lease.lua's answer: pair_id, prompt_id ('' = none), chosen,
    rejected, margin (exact text)."""
    pair_id, prompt, chosen, rejected, margin = (text(x) for x in raw)
    return ConsumerPair(pair_id, prompt or None, chosen, rejected, float(margin))


class ConsumerCalls(StorePart):
    """The calls on a run's consumers; :class:`app.broker.store.RedisStore` has the rest."""

    async def create_consumer(
        self,
        run_id: str,
        name: str,
        *,
        kind: str = "rollouts",
        source: str,
        max_lag: int | None = None,
        retention_rollouts: int = DEFAULT_RETENTION,
        min_margin: float | None = None,
        pairs: str | None = None,
        entry: bytes = b"",
    ) -> Literal["created", "exists"]:
        """'created', or 'exists' for the same config under the same name; StoreError
        ``consumer_exists`` for another, ``run_closed``, ``run_missing`` and
        ``consumer_invalid`` (kind preferences in a run whose group_size is 1 too). ``entry``:
        the audit log's entry, written when the consumer is created (app.caller.action_entry)."""
        cfg = consumer_config(kind, source, max_lag, retention_rollouts, min_margin, pairs)
        (outcome,) = await self._call("consumer_create", run_id, name, cfg, entry)
        return "created" if text(outcome) == "created" else "exists"

    async def get_consumer(self, run_id: str, name: str) -> ConsumerView | None:
        """The consumer's config and live counts, or None when the run has no such consumer."""
        try:
            cfg, created, delivered, acked, dropped, leased, pending = await self._call(
                "consumer_view", run_id, name
            )
        except StoreError as err:
            if err.code == "consumer_missing":
                return None
            raise
        return ConsumerView(
            name,
            json.loads(text(cfg)),
            int(created),
            int(delivered),
            int(acked),
            int(dropped),
            int(leased),
            int(pending),
        )

    async def delete_consumer(self, run_id: str, name: str, *, entry: bytes = b"") -> bool:
        """Delete the consumer and free what it holds; False when there was none. ``entry``:
        the audit log's entry, written when it is deleted."""
        outcome, _ = await self._call("consumer_delete", run_id, name, entry)
        return text(outcome) == "deleted"

    async def consumer_lease(
        self,
        run_id: str,
        name: str,
        *,
        batch_id: str,
        size: int,
        lease_ms: int | None = None,
        wait_ms: int = 0,
    ) -> ConsumerLease | None:
        """Up to ``size`` pending items as batch ``batch_id`` (the same batch again for a
        retry while it is live), or None when none is pending. The lease lasts ``lease_ms``,
        or the run's ``lease_timeout_s`` when None. When none is pending, with ``wait_ms``, the
        next delivery for ``wait_ms`` wakes the run's waiting readers (keys.CONSUMER_WAKE).
        Kind preferences: the pairs, with each of their rollouts read once."""
        outcome, *body = await self._call(
            "consumer_lease",
            run_id,
            name,
            batch_id,
            size,
            -1 if lease_ms is None else lease_ms,
            CONSUMER_SWEEP_LIMIT,
            wait_ms,
        )
        if text(outcome) == "empty":
            return None
        expires, raw, *more = body
        rids = [text(r) for r in raw]
        got = await self.blobs(run_id, rids)
        blobs = []
        for blob in got:
            if blob is None:  # only a lease that ran out, whose rollouts were then let go
                raise StoreError("lease_lost")
            blobs.append(blob)
        pairs = [_pair(p) for p in more[0]] if more else None
        repeat = text(outcome) == "repeat"
        return ConsumerLease(batch_id, int(expires), rids, blobs, repeat, pairs)

    async def consumer_ack(
        self, run_id: str, name: str, batch_id: str
    ) -> tuple[Literal["acked", "repeat"], int]:
        """('acked', items), or ('repeat', items) for a batch acked before; StoreError for no
        such consumer or batch, and for one nacked or expired."""
        outcome, n = await self._call("consumer_ack", run_id, name, batch_id)
        return ("acked" if text(outcome) == "acked" else "repeat"), int(n)

    async def consumer_nack(
        self, run_id: str, name: str, batch_id: str
    ) -> tuple[Literal["nacked", "repeat"], int]:
        """('nacked', items back to pending), or ('repeat', items); StoreError for no such
        consumer or batch, and for one acked or expired."""
        outcome, n = await self._call("consumer_nack", run_id, name, batch_id)
        return ("nacked" if text(outcome) == "nacked" else "repeat"), int(n)
