"""The Redis store: the Lua scripts that change a run's keys atomically, and the reads that
need no script.

Every key of a run shares the hash tag ``{run_id}``; app/broker/keys.py defines the layout.
Each method is one script call (or a short loop of bounded calls); replies are decoded by
app/broker/replies.py, which raises StoreError when a script refuses.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, Literal

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from app.broker import keys
from app.broker.config import RunConfig
from app.broker.packing import PackedRollout
from app.broker.replies import AckAnswer, StoreError, ack_answer, decode, text

__all__ = [
    "LEASE_SWEEP_LIMIT",
    "SWEEP_LIMIT",
    "AckAnswer",
    "BatchMember",
    "BatchView",
    "IngestOutcome",
    "Lease",
    "LeasedRollout",
    "RedisStore",
    "RunState",
    "StoreError",
    "SweepOutcome",
    "WorkItem",
    "WorkLease",
    "scan_limit",
]

SWEEP_LIMIT = 1000  # units retired / leases expired per bounded call
LEASE_SWEEP_LIMIT = 64  # the lazy clean-up a lease call does first
ACK_FLUSH_LIMIT = 10 * SWEEP_LIMIT  # units a kl_flush retires within the ack itself

# A lease call looks at no more than SCAN_PER_ROLLOUT units per rollout asked for, plus
# SCAN_SLACK: enough to step over the units it cannot hand out (retired on the way, of a later
# version than the trainer's, groups too big for what is left of the batch) without letting
# one call walk a whole buffer of them while Redis waits.
SCAN_PER_ROLLOUT = 4
SCAN_SLACK = 256

_SCRIPTS = (
    "create_run",
    "patch_config",
    "set_policy",
    "close_run",
    "ingest",
    "lease",
    "batch_view",
    "ack",
    "nack",
    "sweep",
    "register_prompts",
    "work",
    "work_return",
)


def scan_limit(size: int) -> int:
    return SCAN_PER_ROLLOUT * size + SCAN_SLACK


def _load_scripts() -> dict[str, str]:
    pkg = resources.files("app.broker") / "lua"
    prologue = keys.lua_prologue() + (pkg / "common.lua").read_text()
    return {name: prologue + "\n" + (pkg / f"{name}.lua").read_text() for name in _SCRIPTS}


@dataclass(frozen=True, slots=True)
class RunState:
    run_id: str
    config: RunConfig
    config_json: str
    policy_version: int
    status: Literal["open", "closed"]
    created_at_ms: int
    live: int  # buffered + leased rollouts
    leased: int
    floor: int


@dataclass(frozen=True, slots=True)
class IngestOutcome:
    accepted: int
    duplicates: int
    rejected: list[tuple[str, str]]


@dataclass(frozen=True, slots=True)
class LeasedRollout:
    uses: int
    lag: int
    blob: bytes


@dataclass(frozen=True, slots=True)
class Lease:
    batch_id: str
    policy_version: int
    expires_at_ms: int
    rollouts: list[LeasedRollout]


@dataclass(frozen=True, slots=True)
class BatchMember:
    rollout_id: str
    policy_version: int
    tokens: int
    blob: bytes | None  # only when asked for


@dataclass(frozen=True, slots=True)
class BatchView:
    """A batch as the ack needs it before the ack script runs: leased, or acked already (a
    batch that was nacked or expired is refused with a StoreError)."""

    config: RunConfig  # the run's
    state: Literal["leased", "acked"]
    policy_version: int
    size: int
    answer: AckAnswer | None  # when acked
    members: list[BatchMember]  # while leased, when asked for


@dataclass(frozen=True, slots=True)
class WorkItem:
    prompt_id: str
    pass_: int
    attempt: int
    blob: bytes

    @property
    def group_id(self) -> str:
        """The group a generator posts this attempt's rollouts under (ingest.lua parses it)."""
        return f"{self.prompt_id}#{self.pass_}.{self.attempt}"


@dataclass(frozen=True, slots=True)
class WorkLease:
    lease_id: str
    policy_version: int
    expires_at_ms: int
    items: list[WorkItem]


@dataclass(frozen=True, slots=True)
class SweepOutcome:
    more: bool  # work was left for another call
    retired: dict[str, int]  # rollouts retired, by reason

    @property
    def total(self) -> int:
        return sum(self.retired.values())


def _counts(rows: Sequence[Any]) -> dict[str, int]:
    """A retired_counts() reply value: {reason: rollouts}."""
    return {text(reason): int(n) for reason, n in rows}


class RedisStore:
    def __init__(self, redis: Redis, prefix: str) -> None:
        self.redis = redis
        self.prefix = prefix
        self.wake_channel = keys.wake_channel(prefix)
        self._scripts: dict[str, AsyncScript] = {
            name: redis.register_script(src) for name, src in _load_scripts().items()
        }

    # -- keys -----------------------------------------------------------------------------
    def run_key(self, run_id: str) -> str:
        return keys.run_key(self.prefix, run_id)

    def events_key(self, run_id: str) -> str:
        return keys.events_key(self.prefix, run_id)

    @property
    def runs_key(self) -> str:
        return keys.runs_key(self.prefix)

    async def _call(self, name: str, run_id: str, *args: Any) -> list[Any]:
        """The body of the script's ok reply; StoreError when it refuses."""
        reply = await self._scripts[name](
            keys=[self.run_key(run_id)], args=[self.wake_channel, *args]
        )
        return decode(name, reply)

    # -- runs -----------------------------------------------------------------------------
    async def create_run(self, run_id: str, config: RunConfig) -> Literal["created", "exists"]:
        """'created', or 'exists' with the same config; StoreError('run_conflict').

        The run index (another slot on a cluster) is written first, idempotently, and its
        score becomes the run's ``created``: a crash before the script leaves an entry of a run
        that does not exist (skipped by its readers; the client's retry creates the run), never
        a run that takes rollouts and leases while the workers, which walk the index, never
        visit it."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zadd(self.runs_key, {run_id: int(time.time() * 1000)}, nx=True)
            pipe.zscore(self.runs_key, run_id)
            _, created = await pipe.execute()
        (outcome,) = await self._call(
            "create_run", run_id, run_id, config.canonical_json(), int(created)
        )
        return "created" if text(outcome) == "created" else "exists"

    async def get_run(self, run_id: str) -> RunState | None:
        f: list[Any] = await self.redis.hmget(
            self.run_key(run_id), "cfg", "ver", "st", "created", "live", "leased", "floor"
        )
        if f[0] is None:
            return None
        cfg = text(f[0])
        return RunState(
            run_id=run_id,
            config=RunConfig.model_validate_json(cfg),
            config_json=cfg,
            policy_version=int(f[1]),
            status="closed" if text(f[2]) == "closed" else "open",
            created_at_ms=int(f[3]),
            live=int(f[4]),
            leased=int(f[5]),
            floor=int(f[6]),
        )

    async def run_ids(self) -> list[str]:
        return [text(x) for x in await self.redis.zrange(self.runs_key, 0, -1)]

    async def list_runs(self) -> list[RunState]:
        runs = []
        for rid in await self.run_ids():
            state = await self.get_run(rid)
            if state is not None:
                runs.append(state)
        return runs

    async def replace_config(
        self, run_id: str, expected_json: str, new: RunConfig
    ) -> Literal["replaced", "changed"]:
        """'replaced', or 'changed' (someone else patched first: merge again)."""
        (outcome,) = await self._call("patch_config", run_id, expected_json, new.canonical_json())
        return "replaced" if text(outcome) == "replaced" else "changed"

    async def set_policy(
        self, run_id: str, version: int, limit: int = SWEEP_LIMIT
    ) -> tuple[int, int]:
        """(policy_version, evicted): the rollouts this change retired as stale, in bounded
        steps of ``limit`` until none is left. Other retirements of the same sweeps (expired
        leases, timed-out groups) are not evictions by the new version."""
        _, current, more, retired = await self._call("set_policy", run_id, str(version), limit)
        evicted = _counts(retired).get("stale", 0)
        while int(more):
            step = await self.sweep(run_id, limit)
            more, evicted = step.more, evicted + step.retired.get("stale", 0)
        return int(current), evicted

    async def close_run(self, run_id: str) -> None:
        (more,) = await self._call("close_run", run_id, SWEEP_LIMIT)
        while int(more):
            more = (await self.sweep(run_id)).more

    async def sweep(self, run_id: str, limit: int = SWEEP_LIMIT) -> SweepOutcome:
        """One bounded clean-up call."""
        try:
            more, retired = await self._call("sweep", run_id, limit)
        except StoreError as err:
            if err.code != "run_missing":
                raise
            return SweepOutcome(False, {})  # deleted by hand: nothing left to clean
        return SweepOutcome(bool(int(more)), _counts(retired))

    # -- rollouts -------------------------------------------------------------------------
    async def ingest(self, run_id: str, rollouts: Sequence[PackedRollout]) -> IngestOutcome:
        args: list[Any] = [len(rollouts)]
        for r in rollouts:
            args += [
                r.rollout_id,
                r.group_id or "",
                str(r.policy_version),
                r.tokens,
                r.reward_text,
                r.blob,
            ]
        accepted, duplicates, rejected = await self._call("ingest", run_id, *args)
        return IngestOutcome(
            accepted=int(accepted),
            duplicates=int(duplicates),
            rejected=[(text(rid), text(reason)) for rid, reason in rejected],
        )

    # -- batches --------------------------------------------------------------------------
    async def lease(
        self,
        run_id: str,
        *,
        batch_id: str,
        size: int,
        policy_version: int | None,
        partial: bool,
        trainer_id: str | None,
        wait_ms: int = 0,
        waited_ms: int = 0,
    ) -> Lease | int:
        """A Lease, or the number of eligible rollouts found when that was not enough; then, with
        ``wait_ms``, units that become ready in the run announce it for that long. ``waited_ms``
        is how long the request has waited so far, recorded as the trainer's wait."""
        outcome, *body = await self._call(
            "lease",
            run_id,
            batch_id,
            size,
            "" if policy_version is None else str(policy_version),
            1 if partial else 0,
            trainer_id or "",
            LEASE_SWEEP_LIMIT,
            scan_limit(size),
            secrets.randbits(31),
            wait_ms,
            waited_ms,
        )
        if text(outcome) == "short":
            (found,) = body
            return int(found)
        bid, version, expires_at, rows = body
        blobs = await self.blobs(run_id, [text(rid) for _, _, rid in rows])
        rollouts = []
        for (uses, lag, _), blob in zip(rows, blobs, strict=True):
            if blob is None:
                # Only a lease that ran out already, and whose rollouts then retired, loses them.
                raise StoreError("lease_lost")
            rollouts.append(LeasedRollout(int(uses), int(lag), blob))
        return Lease(text(bid), int(version), int(expires_at), rollouts)

    async def blobs(self, run_id: str, rollout_ids: Sequence[str]) -> list[bytes | None]:
        """The packed rollouts, in one MGET (None for one that is gone)."""
        if not rollout_ids:
            return []
        got: list[Any] = await self.redis.mget(
            [keys.member_key(self.prefix, run_id, keys.BLOB, rid) for rid in rollout_ids]
        )
        return got

    async def batch_view(
        self, run_id: str, batch_id: str, *, rollouts: Literal["none", "meta", "blobs"]
    ) -> BatchView:
        """The batch's state and, while it is leased and unless ``rollouts`` is 'none', its
        rollouts ('blobs': with their packed rollouts). StoreError for no such run or batch,
        and for a batch that was nacked or expired."""
        state, cfg, version, size, rest = await self._call(
            "batch_view", run_id, batch_id, "none" if rollouts == "none" else "meta"
        )
        config = RunConfig.model_validate_json(cfg)
        if text(state) == "acked":
            return BatchView(config, "acked", int(version), int(size), ack_answer(rest), [])
        rids = [text(rid) for rid, _, _ in rest]
        blobs: list[bytes | None] = [None] * len(rids)
        if rollouts == "blobs":
            blobs = await self.blobs(run_id, rids)
        members = [
            BatchMember(rid, int(v), int(n), blob)
            for rid, (_, v, n), blob in zip(rids, rest, blobs, strict=True)
        ]
        return BatchView(config, "leased", int(version), int(size), None, members)

    async def ack(
        self,
        run_id: str,
        batch_id: str,
        *,
        kl_mean: float | None,
        event: bytes,
        stats_text: str,
    ) -> tuple[Literal["acked", "repeat"], AckAnswer]:
        """('acked', answer), or ('repeat', the answer stored by the first ack); StoreError
        for no such run or batch, and for a batch that was nacked or expired.

        ``event`` is the msgpack payload of the ``acked`` event; its items carry each rollout's
        measured KL, which the script also gates on."""
        outcome, answer = await self._call(
            "ack",
            run_id,
            batch_id,
            "" if kl_mean is None else repr(kl_mean),
            event,
            stats_text,
            ACK_FLUSH_LIMIT,
        )
        return ("acked" if text(outcome) == "acked" else "repeat"), ack_answer(answer)

    async def nack(self, run_id: str, batch_id: str) -> tuple[Literal["nacked", "repeat"], int]:
        """('nacked', rollouts returned), or ('repeat', the same count) for a batch nacked
        before; StoreError for no such run or batch, and for one acked or expired."""
        outcome, returned = await self._call("nack", run_id, batch_id)
        return ("nacked" if text(outcome) == "nacked" else "repeat"), int(returned)

    # -- prompts --------------------------------------------------------------------------
    async def register_prompts(
        self, run_id: str, prompts: Sequence[tuple[str, bytes]], epochs: int
    ) -> tuple[int, int]:
        """(accepted, duplicates) for (prompt_id, packed prompt) pairs."""
        args: list[Any] = [epochs, len(prompts)]
        for pid, blob in prompts:
            args += [pid, blob]
        accepted, duplicates = await self._call("register_prompts", run_id, *args)
        return int(accepted), int(duplicates)

    async def work(
        self,
        run_id: str,
        *,
        lease_id: str,
        max_prompts: int,
        generator_id: str | None,
        wait_ms: int = 0,
        waited_ms: int = 0,
    ) -> WorkLease | None:
        """A work lease, or None when nothing could be handed out; then, with ``wait_ms``,
        prompts or budget coming free in the run announce it for that long."""
        outcome, *body = await self._call(
            "work",
            run_id,
            lease_id,
            max_prompts,
            generator_id or "",
            LEASE_SWEEP_LIMIT,
            wait_ms,
            waited_ms,
        )
        if text(outcome) == "short":
            return None
        lid, version, expires_at, rows = body
        passes = [(text(pk).rpartition("#"), int(att)) for pk, att in rows]
        blobs = await self.prompt_blobs(run_id, [pid for (pid, _, _), _ in passes])
        items = []
        for ((pid, _, pass_), att), blob in zip(passes, blobs, strict=True):
            if blob is None:
                # Prompts are never deleted while their run lives: only a hand could do this.
                raise RuntimeError(f"prompt {pid!r} of run {run_id!r} has no stored data")
            items.append(WorkItem(pid, int(pass_), att, blob))
        return WorkLease(text(lid), int(version), int(expires_at), items)

    async def prompt_blobs(self, run_id: str, prompt_ids: Sequence[str]) -> list[bytes | None]:
        if not prompt_ids:
            return []
        got: list[Any] = await self.redis.mget(
            [keys.member_key(self.prefix, run_id, keys.PROMPT, pid) for pid in prompt_ids]
        )
        return got

    async def return_work(
        self, run_id: str, lease_id: str, prompt_ids: Sequence[str] | None
    ) -> int:
        """Prompts given back (those still in flight under the lease); all when None."""
        ids = list(prompt_ids or [])
        (returned,) = await self._call("work_return", run_id, lease_id, len(ids), *ids)
        return int(returned)
