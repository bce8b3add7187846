"""Test helpers: a small broker simulator that emits accounting events through the schema's
encoder (app/accounting/events.py, as docs/events.md describes them), and computes the expected
accounting from its own rollout states (not from the events), so the drain and the queries are
checked independently.
"""

from __future__ import annotations

import math
import random
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.accounting.events import (
    Accepted,
    AcceptedItem,
    Acked,
    AckedItem,
    AckStats,
    AckSums,
    Duplicate,
    Leased,
    LeasedItem,
    Payload,
    Rejected,
    RejectedItem,
    Retired,
    RetiredItem,
    Returned,
    ReturnedItem,
    RunChanged,
    encode_payload,
    lag_of,
)
from app.accounting.stream import events_key, run_key, runs_key
from app.api.accounting import router
from app.errors import BrokerError
from app.settings import Settings
from workers.drain import DrainContext, drain_once

Event = tuple[str, dict[str, Any]]


async def drain_all(ctx: DrainContext, *, max_passes: int = 50, claim: bool | None = None) -> int:
    """Run passes until one reads nothing; return the number of passes."""
    for n in range(1, max_passes + 1):
        counts = await drain_once(ctx, claim=claim)
        if counts.read == 0 and counts.missing == 0:
            return n
    raise AssertionError(f"still reading after {max_passes} passes")


def build_app(sessionmaker: async_sessionmaker[AsyncSession], redis: Redis, prefix: str) -> FastAPI:
    app = FastAPI()
    app.include_router(router)
    app.state.db_sessionmaker = sessionmaker
    app.state.redis = redis
    app.state.settings = Settings(
        redis_prefix=prefix, redis_url="redis://unused", database_url=None
    )

    @app.exception_handler(BrokerError)
    async def _render(request: Request, exc: BrokerError) -> JSONResponse:
        return JSONResponse(
            {"error": exc.name, "detail": exc.detail}, status_code=exc.status, headers=exc.headers
        )

    return app


def pack(payload: dict[str, Any]) -> bytes:
    return msgpack.packb(payload, use_bin_type=True)


def entry(event_type: str, payload: dict[str, Any]) -> dict[bytes, bytes]:
    return {b"e": event_type.encode(), b"d": pack(payload)}


async def register_run(redis: Redis, prefix: str, run_id: str, score: int = 0) -> None:
    """What the broker does on run creation, as far as the drain can see."""
    await redis.zadd(runs_key(prefix), {run_id: score})
    await redis.set(run_key(prefix, run_id), b"1")


async def xadd_events(
    redis: Redis, prefix: str, run_id: str, events: Iterable[Event]
) -> list[bytes]:
    key = events_key(prefix, run_id)
    ids: list[bytes] = []
    batch = list(events)
    for start in range(0, len(batch), 200):
        async with redis.pipeline(transaction=False) as pipe:
            for event_type, payload in batch[start : start + 200]:
                pipe.xadd(key, entry(event_type, payload))
            ids.extend(await pipe.execute())
    return ids


def lua_style(value: Any) -> Any:
    """What Redis's Lua msgpack encoder makes of an encoded payload: whole floats become
    integers (the encoder already leaves out nils, as Lua tables hold none)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [lua_style(v) for v in value]
    if isinstance(value, dict):
        return {k: lua_style(v) for k, v in value.items()}
    return value


@dataclass
class SimRollout:
    rollout_id: str
    unit_id: str
    version: int
    tokens: int
    state: str = "buffered"  # buffered | leased | retired
    uses: int = 0
    retired_reason: str | None = None
    kl: float | None = None


@dataclass
class SimBatch:
    batch_id: str
    version: int
    rollout_ids: list[str]
    outcome: str = "leased"


@dataclass
class RunSim:
    """Drives one run through the rollout life cycle and records the events it would emit."""

    run_id: str
    seed: int = 0
    group_size: int = 1
    max_reuse: int = 2
    max_staleness: int = 2
    kl_max: float = 0.05
    kl_flush: float = 0.1
    lua: bool = True
    rng: random.Random = field(init=False)
    t: int = 1_750_000_000_000
    events: list[Event] = field(default_factory=list)
    rollouts: dict[str, SimRollout] = field(default_factory=dict)
    batches: dict[str, SimBatch] = field(default_factory=dict)
    policy: int = 0
    duplicates: int = 0
    rejections: list[tuple[str, int, int]] = field(default_factory=list)  # reason, version, tokens
    samples: list[tuple[int, int]] = field(default_factory=list)  # (rollout version, lag)
    kl_tokens: int = 0
    kl_sum: float = 0.0
    kl_values: list[float] = field(default_factory=list)
    version_kl: dict[int, list[tuple[float, int]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    ratio_tokens: int = 0
    ratio_sum: float = 0.0
    clipped: int = 0
    _n: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    # --- emitting ---------------------------------------------------------------------

    def _id(self, kind: str) -> str:
        self._n += 1
        return f"{kind}-{self._n}"

    def _emit(self, event_type: str, body: Payload) -> None:
        self.t += self.rng.randint(0, 5)
        payload = encode_payload(event_type, body, t_ms=self.t)
        self.events.append((event_type, lua_style(payload) if self.lua else payload))

    def _run_event(self, change: str, status: str = "open") -> None:
        self._emit(
            "run",
            RunChanged(
                run_id=self.run_id,
                change=change,
                config={
                    "max_staleness": self.max_staleness,
                    "max_reuse": self.max_reuse,
                    "kl_max": self.kl_max,
                    "kl_flush": self.kl_flush,
                    "group_size": self.group_size,
                },
                policy_version=self.policy,
                status=status,
                created_at_ms=1_750_000_000_000,
            ),
        )

    def create(self) -> None:
        self._run_event("created")

    # --- the life cycle ---------------------------------------------------------------

    def ingest(self, groups: int, version: int | None = None) -> None:
        """Accept ``groups`` new units, plus some duplicates and policy rejections."""
        version = self.policy if version is None else version
        items: list[AcceptedItem] = []
        for _ in range(groups):
            unit = self._id("g") if self.group_size > 1 else None
            for k in range(self.group_size):
                rid = self._id("r")
                tokens = self.rng.randint(1, 300)
                unit_id = unit or rid
                self.rollouts[rid] = SimRollout(rid, unit_id, version, tokens)
                items.append(AcceptedItem(rid, unit_id, version, tokens, k == 0))
        self._emit("accepted", Accepted(tuple(items)))
        if self.rollouts and self.rng.random() < 0.7:
            ids = self.rng.sample(sorted(self.rollouts), k=min(3, len(self.rollouts)))
            self.duplicates += len(ids)
            self._emit("duplicate", Duplicate(n=len(ids), ids=tuple(ids)))
        if self.rng.random() < 0.6:
            rejected: list[RejectedItem] = []
            for reason, v in (("future_version", self.policy + 1), ("stale", self.policy - 9)):
                tokens = self.rng.randint(1, 50)
                self.rejections.append((reason, v, tokens))
                rejected.append(RejectedItem(self._id("x"), reason, v, tokens))
            self._emit("rejected", Rejected(tuple(rejected)))

    def eligible(self) -> list[SimRollout]:
        return [
            r
            for r in self.rollouts.values()
            if r.state == "buffered"
            and r.uses < self.max_reuse
            and self.policy - r.version <= self.max_staleness
        ]

    def lease(self, size: int, trainer: str | None = "trainer-0") -> str | None:
        pool = self.eligible()
        if not pool:
            return None
        chosen = self.rng.sample(pool, k=min(size, len(pool)))
        batch_id = self._id("b")
        self.batches[batch_id] = SimBatch(batch_id, self.policy, [r.rollout_id for r in chosen])
        for r in chosen:
            r.state = "leased"
        self._emit(
            "leased",
            Leased(
                batch_id=batch_id,
                trainer_id=trainer,
                policy_version=self.policy,
                expires_at_ms=self.t + 300_000,
                items=tuple(
                    LeasedItem(
                        r.rollout_id, r.version, r.tokens, lag_of(self.policy, r.version), r.uses
                    )
                    for r in chosen
                ),
            ),
        )
        return batch_id

    def _return(self, batch: SimBatch) -> list[SimRollout]:
        rollouts = [self.rollouts[rid] for rid in batch.rollout_ids]
        for r in rollouts:
            r.state = "buffered"
        return rollouts

    def ack(self, batch_id: str, *, kl_scale: float = 0.03, measured: bool = True) -> None:
        batch = self.batches[batch_id]
        batch.outcome = "acked"
        rollouts = self._return(batch)
        items: list[AckedItem] = []
        kl_tokens, kl_sum, kls = 0, 0.0, []
        for r in rollouts:
            r.uses += 1
            self.samples.append((r.version, batch.version - r.version))
            kl: float | None = None
            if measured and self.rng.random() < 0.85:
                # Some whole values, which a Lua encoder writes as integers.
                kl = 0.0 if self.rng.random() < 0.1 else self.rng.random() * kl_scale
                kl_tokens += r.tokens
                kl_sum += kl * r.tokens
                kls.append(kl)
                self.version_kl[r.version].append((kl, r.tokens))
            r.kl = kl
            items.append(AckedItem(r.rollout_id, r.version, r.tokens, kl))
        tokens = sum(r.tokens for r in rollouts)
        ratio_tokens = tokens if measured else 0
        ratio_sum = ratio_tokens * (1 + self.rng.uniform(-0.1, 0.1))
        clipped = self.rng.randint(0, ratio_tokens) if ratio_tokens else 0
        self.kl_tokens += kl_tokens
        self.kl_sum += kl_sum
        self.kl_values.extend(kls)
        self.ratio_tokens += ratio_tokens
        self.ratio_sum += ratio_sum
        self.clipped += clipped
        kl_mean = kl_sum / kl_tokens if kl_tokens else None
        self._emit(
            "acked",
            Acked(
                batch_id=batch_id,
                step=self.rng.randint(0, 10_000),
                policy_version=batch.version,
                items=tuple(items),
                stats=AckStats(
                    kl_mean=kl_mean,
                    kl_max=max(kls) if kls else None,
                    is_ratio_mean=ratio_sum / ratio_tokens if ratio_tokens else None,
                    clip_fraction=clipped / ratio_tokens if ratio_tokens else None,
                    ess_fraction=self.rng.uniform(0.5, 1.0) if measured else None,
                ),
                sums=AckSums(
                    kl_tokens=kl_tokens,
                    kl_sum=kl_sum,
                    ratio_tokens=ratio_tokens,
                    ratio_sum=ratio_sum,
                    clipped=clipped,
                ),
            ),
        )
        self.retire([r for r in rollouts if r.uses >= self.max_reuse], "max_reuse")
        self.retire(
            [
                r
                for r in rollouts
                if r.state == "buffered" and r.kl is not None and r.kl > self.kl_max
            ],
            "kl",
        )
        if kl_mean is not None and kl_mean > self.kl_flush:
            self.retire(
                [
                    r
                    for r in self.rollouts.values()
                    if r.state == "buffered" and r.version < batch.version
                ],
                "kl_flush",
            )

    def nack(self, batch_id: str) -> None:
        self._settle(batch_id, "nacked")

    def expire(self, batch_id: str) -> None:
        self._settle(batch_id, "expired")

    def _settle(self, batch_id: str, outcome: str) -> None:
        batch = self.batches[batch_id]
        batch.outcome = outcome
        rollouts = self._return(batch)
        self._emit(
            outcome,
            Returned(
                batch_id, tuple(ReturnedItem(r.rollout_id, r.version, r.tokens) for r in rollouts)
            ),
        )

    def retire(self, rollouts: Sequence[SimRollout], reason: str) -> None:
        rollouts = [r for r in rollouts if r.state == "buffered"]
        if not rollouts:
            return
        for r in rollouts:
            r.state = "retired"
            r.retired_reason = reason
        self._emit(
            "retired",
            Retired(
                reason,
                tuple(RetiredItem(r.rollout_id, r.version, r.tokens, r.uses) for r in rollouts),
            ),
        )

    def set_policy(self, version: int) -> None:
        self.policy = version
        self._run_event("policy")
        self.retire(
            [r for r in self.rollouts.values() if self.policy - r.version > self.max_staleness],
            "stale",
        )

    def close(self) -> None:
        self._run_event("closed", status="closed")
        self.retire(list(self.rollouts.values()), "run_closed")

    def live_batches(self) -> list[str]:
        return [b.batch_id for b in self.batches.values() if b.outcome == "leased"]

    # --- a mixed workload -------------------------------------------------------------

    def workload(self, steps: int, *, close: bool = False) -> None:
        """Ingest, lease, ack (reuse), nack, expire, flush and retire, in random order."""
        if not self.events:
            self.create()
        for step in range(steps):
            self.ingest(self.rng.randint(1, 4))
            for _ in range(self.rng.randint(1, 3)):
                self.lease(self.rng.randint(1, 6) * self.group_size)
            for batch_id in self.live_batches():
                roll = self.rng.random()
                if roll < 0.6:
                    self.ack(batch_id, kl_scale=0.3 if self.rng.random() < 0.15 else 0.06)
                elif roll < 0.7:
                    self.ack(batch_id, measured=False)
                elif roll < 0.8:
                    self.nack(batch_id)
                elif roll < 0.9:
                    self.expire(batch_id)
                # else: stays leased for now
            if step % 7 == 6:
                # Now and then a jump of several versions, which makes buffered rollouts stale.
                self.set_policy(self.policy + (self.max_staleness + 1 if step % 21 == 20 else 1))
            if step % 11 == 10:
                buffered = [r for r in self.rollouts.values() if r.state == "buffered"]
                self.retire(buffered[:2], "incomplete_group")
                self.retire(buffered[2:3], "zero_variance")
        if close:
            for batch_id in self.live_batches():
                self.nack(batch_id)
            self.close()
        else:
            self.lease(2 * self.group_size)  # leave a live lease behind

    # --- what the accounting must say -------------------------------------------------

    def expected(self) -> dict[str, Any]:
        return _expected(
            list(self.rollouts.values()),
            self.rejections,
            self.samples,
            duplicates=self.duplicates,
            batches=Counter(b.outcome for b in self.batches.values()),
            n_batches=len(self.batches),
            kl_tokens=self.kl_tokens,
            kl_sum=self.kl_sum,
            kl_values=self.kl_values,
            ratio=(self.ratio_tokens, self.ratio_sum, self.clipped),
        )

    def expected_versions(self) -> dict[int, dict[str, Any]]:
        versions = {r.version for r in self.rollouts.values()} | {v for _, v, _ in self.rejections}
        result = {}
        for v in sorted(versions):
            pairs = self.version_kl.get(v, [])
            result[v] = _expected(
                [r for r in self.rollouts.values() if r.version == v],
                [x for x in self.rejections if x[1] == v],
                [s for s in self.samples if s[0] == v],
                kl_tokens=sum(t for _, t in pairs),
                kl_sum=sum(k * t for k, t in pairs),
                kl_values=[k for k, _ in pairs],
            )
        return result


def _expected(
    rollouts: list[SimRollout],
    rejections: list[tuple[str, int, int]],
    samples: list[tuple[int, int]],
    *,
    duplicates: int | None = None,
    batches: Counter[str] | None = None,
    n_batches: int = 0,
    kl_tokens: int,
    kl_sum: float,
    kl_values: list[float],
    ratio: tuple[int, float, int] | None = None,
) -> dict[str, Any]:
    received = len(rollouts)
    samples_consumed = sum(r.uses for r in rollouts)
    lags = [lag for _, lag in samples]
    out: dict[str, Any] = {
        "rollouts_received": received,
        "groups_received": len({r.unit_id for r in rollouts}),
        "rejected": dict(Counter(reason for reason, _, _ in rejections)),
        "tokens_generated": sum(r.tokens for r in rollouts),
        "buffered": sum(r.state == "buffered" for r in rollouts),
        "leased": sum(r.state == "leased" for r in rollouts),
        "samples_consumed": samples_consumed,
        "tokens_consumed": sum(r.uses * r.tokens for r in rollouts),
        "reuse_factor": samples_consumed / received if received else 0.0,
        "retired": dict(Counter(r.retired_reason for r in rollouts if r.state == "retired")),
        "wasted_tokens": sum(r.tokens for r in rollouts if r.state == "retired" and r.uses == 0),
        "lag": {
            "mean": sum(lags) / len(lags) if lags else None,
            "max": max(lags) if lags else None,
            "histogram": {str(k): v for k, v in sorted(Counter(lags).items())},
        },
        "kl": {
            "mean": kl_sum / kl_tokens if kl_tokens else None,
            "max": max(kl_values) if kl_values else None,
        },
    }
    if duplicates is not None:
        out["duplicates"] = duplicates
    if batches is not None:
        out["batches"] = {
            "leased": n_batches,
            "acked": batches["acked"],
            "nacked": batches["nacked"],
            "expired": batches["expired"],
        }
    if ratio is not None:
        tokens, total, clipped = ratio
        out["is_ratio"] = {
            "mean": total / tokens if tokens else None,
            "clip_fraction": clipped / tokens if tokens else None,
        }
    return out


def assert_matches(actual: dict[str, Any], expected: dict[str, Any], path: str = "") -> None:
    """Equal, with a relative tolerance for floats (sums of doubles in another order)."""
    for key, want in expected.items():
        where = f"{path}.{key}" if path else key
        assert key in actual, f"{where} missing"
        got = actual[key]
        if isinstance(want, dict):
            assert isinstance(got, dict), f"{where}: {got!r}"
            assert set(got) == set(want), f"{where}: {got!r} != {want!r}"
            assert_matches(got, want, where)
        elif isinstance(want, float) and not isinstance(got, bool) and got is not None:
            assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12), f"{where}: {got} != {want}"
        else:
            assert got == want, f"{where}: {got!r} != {want!r}"
