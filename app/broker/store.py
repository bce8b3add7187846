"""The Redis store: key layout and the Lua scripts that change it atomically.

Every key of a run shares the hash tag ``{run_id}``; see docs/design.md for the layout. Each
method is one script call (or a short loop of bounded calls); the Python side only packs
arguments and unpacks replies.
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

from app.broker.config import RunConfig
from app.broker.packing import PackedRollout

SWEEP_LIMIT = 1000  # units retired / leases expired per bounded call
LEASE_SWEEP_LIMIT = 64  # the lazy clean-up a lease call does first
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
)


def _load_scripts() -> dict[str, str]:
    pkg = resources.files("app.broker") / "lua"
    common = (pkg / "common.lua").read_text()
    return {name: common + "\n" + (pkg / f"{name}.lua").read_text() for name in _SCRIPTS}


class StoreError(Exception):
    """A script refused the call; ``code`` says why (the service maps it to an HTTP error)."""

    def __init__(self, code: str, *args: str) -> None:
        super().__init__(code, *args)
        self.code = code
        self.args_ = args


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
    """A batch as the ack needs it before the ack script runs."""

    config: RunConfig  # the run's
    state: str  # 'l' leased, 'a' acked, 'n' nacked, 'e' expired
    policy_version: int
    size: int
    answer: str | None
    members: list[BatchMember]  # while leased


def _s(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


class RedisStore:
    def __init__(self, redis: Redis, prefix: str) -> None:
        self.redis = redis
        self.prefix = prefix
        self.wake_channel = f"{prefix}:wake"
        self._scripts: dict[str, AsyncScript] = {
            name: redis.register_script(src) for name, src in _load_scripts().items()
        }

    # -- keys -----------------------------------------------------------------------------
    def base(self, run_id: str) -> str:
        return f"{self.prefix}:{{{run_id}}}:"

    def run_key(self, run_id: str) -> str:
        return self.base(run_id) + "run"

    def events_key(self, run_id: str) -> str:
        return self.base(run_id) + "events"

    @property
    def runs_key(self) -> str:
        return f"{self.prefix}:runs"

    async def _call(self, name: str, run_id: str, *args: Any) -> list[Any]:
        reply = await self._scripts[name](
            keys=[self.run_key(run_id)], args=[self.wake_channel, *args]
        )
        return list(reply)

    # -- runs -----------------------------------------------------------------------------
    async def create_run(self, run_id: str, config: RunConfig) -> str:
        """'created', 'exists' (same config) or 'conflict'."""
        reply = await self._call("create_run", run_id, run_id, config.canonical_json())
        outcome = _s(reply[0])
        if outcome != "conflict":
            # The index is a separate slot (listing only); adding again on a retry is harmless.
            await self.redis.zadd(self.runs_key, {run_id: time.time() * 1000}, nx=True)
        return outcome

    async def get_run(self, run_id: str) -> RunState | None:
        f: list[Any] = await self.redis.hmget(
            self.run_key(run_id), "cfg", "ver", "st", "created", "live", "leased", "floor"
        )
        if f[0] is None:
            return None
        cfg = _s(f[0])
        return RunState(
            run_id=run_id,
            config=RunConfig.model_validate_json(cfg),
            config_json=cfg,
            policy_version=int(f[1]),
            status="closed" if _s(f[2]) == "closed" else "open",
            created_at_ms=int(f[3]),
            live=int(f[4]),
            leased=int(f[5]),
            floor=int(f[6]),
        )

    async def run_ids(self) -> list[str]:
        return [_s(x) for x in await self.redis.zrange(self.runs_key, 0, -1)]

    async def list_runs(self) -> list[RunState]:
        runs = []
        for rid in await self.run_ids():
            state = await self.get_run(rid)
            if state is not None:
                runs.append(state)
        return runs

    async def replace_config(self, run_id: str, expected_json: str, new: RunConfig) -> str:
        """'ok', 'missing' or 'changed' (someone else patched first: merge again)."""
        reply = await self._call("patch_config", run_id, expected_json, new.canonical_json())
        return _s(reply[0])

    async def set_policy(self, run_id: str, version: int) -> tuple[str, int, int]:
        """(outcome, policy_version, evicted); evicts in bounded steps until done."""
        reply = await self._call("set_policy", run_id, str(version), SWEEP_LIMIT)
        outcome = _s(reply[0])
        if outcome != "ok":
            return outcome, int(reply[1]) if len(reply) > 1 else 0, 0
        evicted = int(reply[3])
        more = int(reply[2])
        while more:
            more, n = await self.sweep(run_id)
            evicted += n
        return outcome, int(reply[1]), evicted

    async def close_run(self, run_id: str) -> bool:
        reply = await self._call("close_run", run_id, SWEEP_LIMIT)
        if _s(reply[0]) == "missing":
            return False
        more = int(reply[1])
        while more:
            more, _ = await self.sweep(run_id)
        return True

    async def sweep(self, run_id: str, limit: int = SWEEP_LIMIT) -> tuple[int, int]:
        """One bounded clean-up call: (more work left 0/1, rollouts retired)."""
        reply = await self._call("sweep", run_id, limit)
        if _s(reply[0]) == "missing":
            return 0, 0
        return int(reply[1]), int(reply[2])

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
        reply = await self._call("ingest", run_id, *args)
        if _s(reply[0]) == "err":
            raise StoreError(*[_s(x) for x in reply[1:]])
        rest = [_s(x) for x in reply[3:]]
        return IngestOutcome(
            accepted=int(reply[1]),
            duplicates=int(reply[2]),
            rejected=list(zip(rest[0::2], rest[1::2], strict=True)),
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
    ) -> Lease | int:
        """A Lease, or the number of eligible rollouts found when that was not enough; then, with
        ``wait_ms``, units that become ready in the run announce it for that long."""
        reply = await self._call(
            "lease",
            run_id,
            batch_id,
            size,
            "" if policy_version is None else str(policy_version),
            1 if partial else 0,
            trainer_id or "",
            LEASE_SWEEP_LIMIT,
            4 * size + 256,
            secrets.randbits(31),
            wait_ms,
        )
        head = _s(reply[0])
        if head == "err":
            raise StoreError(*[_s(x) for x in reply[1:]])
        if head == "none":
            return int(reply[1])
        rest = reply[5:]
        rids = [_s(rid) for rid in rest[2::3]]
        rollouts = []
        for uses, lag, blob in zip(
            rest[0::3], rest[1::3], await self.blobs(run_id, rids), strict=True
        ):
            if blob is None:
                # Only a lease that ran out already, and whose rollouts then retired, loses them.
                raise StoreError("gone", _s(reply[1]))
            rollouts.append(LeasedRollout(int(uses), int(lag), blob))
        return Lease(_s(reply[1]), int(reply[2]), int(reply[3]), rollouts)

    async def blobs(self, run_id: str, rollout_ids: Sequence[str]) -> list[bytes | None]:
        """The packed rollouts, in one MGET (None for one that is gone)."""
        if not rollout_ids:
            return []
        base = self.base(run_id)
        got: list[Any] = await self.redis.mget([f"{base}d:{rid}" for rid in rollout_ids])
        return got

    async def batch_view(
        self, run_id: str, batch_id: str, *, rollouts: Literal["none", "meta", "blobs"]
    ) -> BatchView | None:
        """The batch's state and, while it is leased and unless ``rollouts`` is 'none', its
        rollouts ('blobs': with their packed rollouts); None when there is no such batch.
        Raises StoreError('missing') when there is no such run."""
        reply = await self._call(
            "batch_view", run_id, batch_id, "none" if rollouts == "none" else "meta"
        )
        if not reply:
            raise StoreError("missing")
        config, reply = RunConfig.model_validate_json(reply[0]), reply[1:]
        if not reply:
            return None
        rest = reply[4:]
        rids = [_s(rid) for rid in rest[0::3]]
        blobs: list[bytes | None] = [None] * len(rids)
        if rollouts == "blobs":
            blobs = await self.blobs(run_id, rids)
        return BatchView(
            config=config,
            state=_s(reply[0]),
            policy_version=int(reply[1]),
            size=int(reply[2]),
            answer=_s(reply[3]) if reply[3] is not None else None,
            members=[
                BatchMember(rid, int(v), int(n), blob)
                for rid, v, n, blob in zip(rids, rest[1::3], rest[2::3], blobs, strict=True)
            ],
        )

    async def ack(
        self,
        run_id: str,
        batch_id: str,
        *,
        kl_mean: float | None,
        event: bytes,
        stats_text: str,
    ) -> tuple[str, str | None]:
        """('ok'|'acked', answer) or ('missing'|'batch_missing'|'nacked'|'expired', None).

        ``event`` is the msgpack payload of the ``acked`` event; its items carry each rollout's
        measured KL, which the script also gates on."""
        reply = await self._call(
            "ack",
            run_id,
            batch_id,
            "" if kl_mean is None else repr(kl_mean),
            event,
            stats_text,
            SWEEP_LIMIT * 10,
        )
        head = _s(reply[0])
        if head == "err":
            return _s(reply[1]), None
        return head, _s(reply[1])

    async def nack(self, run_id: str, batch_id: str) -> tuple[str, int]:
        reply = await self._call("nack", run_id, batch_id)
        head = _s(reply[0])
        if head == "err":
            return _s(reply[1]), 0
        return head, int(reply[1])
