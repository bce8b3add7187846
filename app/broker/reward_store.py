"""Reward leases and scores in Redis (SPEC "Rewards"): the calls of ``reward_lease.lua``,
``score.lua`` and ``reward_return.lua`` and the reads around them.

A score rewrites the rollout's stored form with its reward in. The stored form only changes
there, and only while the rollout awaits its reward, so the script can take a form packed from
a read made before it: it writes it only if the rollout still awaits (and otherwise compares
the reward with the one stored).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack

from app.broker.replies import StoreError, text

if TYPE_CHECKING:
    from app.broker.store import RedisStore

__all__ = ["RewardLease", "RewardRollout", "Scored", "give_back", "lease", "score"]

RACE_TRIES = 5  # reads made again when rollouts changed between the read and the script
SWEEP_LIMIT = 64  # expired leases and stale units a reward lease cleans up first, at most


@dataclass(frozen=True, slots=True)
class RewardRollout:
    """A rollout handed out to be scored: its packed form and its prompt's, if registered."""

    blob: bytes
    prompt_id: str | None
    prompt: bytes | None


@dataclass(frozen=True, slots=True)
class RewardLease:
    lease_id: str
    expires_at_ms: int
    rollouts: list[RewardRollout]


@dataclass(frozen=True, slots=True)
class Scored:
    scored: int
    duplicates: int
    retired: list[str]


async def lease(
    store: RedisStore,
    run_id: str,
    *,
    lease_id: str,
    max_rollouts: int,
    worker_id: str | None,
    wait_ms: int = 0,
) -> RewardLease | None:
    """A reward lease, or None when nothing awaits a reward; then, with ``wait_ms``, units
    coming to await one announce it for that long."""
    outcome, *body = await store.run_script(
        "reward_lease", run_id, lease_id, max_rollouts, worker_id or "", SWEEP_LIMIT, wait_ms
    )
    if text(outcome) == "short":
        return None
    lid, expires_at, rows = body
    rids = [text(rid) for rid, _ in rows]
    pids = [text(pk).rpartition("#")[0] or None for _, pk in rows]
    blobs = await store.blobs(run_id, rids)
    prompts = list(dict.fromkeys(pid for pid in pids if pid))
    prompt_of = dict(zip(prompts, await store.prompt_blobs(run_id, prompts), strict=True))
    out = []
    for blob, pid in zip(blobs, pids, strict=True):
        if blob is None:
            # Retired in between (a run closed, a failover's master without it): lease again.
            raise StoreError("reward_lease_lost")
        out.append(RewardRollout(blob, pid, prompt_of.get(pid) if pid else None))
    return RewardLease(text(lid), int(expires_at), out)


async def score(
    store: RedisStore, run_id: str, lease_id: str | None, rewards: Mapping[str, float]
) -> Scored:
    """Record rewards, all or none: StoreError for the first rollout refused, and
    ``reward_conflict`` for one scored before with another value."""
    rids = list(rewards)
    for _ in range(RACE_TRIES):
        blobs = await store.blobs(run_id, rids)
        args: list[Any] = [lease_id or "", len(rids)]
        for rid, blob in zip(rids, blobs, strict=True):
            args += [rid, *_score_args(rid, blob, float(rewards[rid]))]
        try:
            scored, duplicates, retired = await store.run_script("score", run_id, *args)
        except StoreError as err:
            if err.code == "reward_raced":
                continue  # scored, retired or received since the read: read again
            raise
        return Scored(int(scored), int(duplicates), [text(r) for r in retired])
    raise StoreError("reward_raced")


def _score_args(rid: str, blob: bytes | None, reward: float) -> tuple[str, bytes]:
    """The reward's exact text, and what score.lua is to make of the stored rollout: the form
    to store (it was unscored), b'd' (scored with this reward: a duplicate) or b'' (none)."""
    if blob is None:
        return repr(reward), b""
    doc = msgpack.unpackb(blob, raw=False)
    had = doc.get("w")
    if had is None:
        doc["w"] = reward
        packed: bytes = msgpack.packb(doc, use_bin_type=True)
        return repr(reward), packed
    if float(had) != reward:
        raise StoreError("reward_conflict", rid, repr(float(had)))
    return repr(reward), b"d"


async def give_back(
    store: RedisStore, run_id: str, lease_id: str, rollout_ids: Sequence[str] | None
) -> int:
    """Give back unscored what a reward lease holds (the units of ``rollout_ids``, or all)."""
    ids = list(rollout_ids or [])
    count = -1 if rollout_ids is None else len(ids)
    (returned,) = await store.run_script("reward_return", run_id, lease_id, count, *ids)
    return int(returned)
