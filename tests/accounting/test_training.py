"""The accounting per policy version of the trainer (``/accounting/training``): the real broker
over HTTP with known logprobs, then the real drain; a mixed simulated workload, delivered
again; unknown runs; and the table's migration."""

from __future__ import annotations

import asyncio
import math
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from accounting_helpers import RunSim, drain_all, fields_of, register_run, xadd_events
from redis.asyncio import Redis
from sqlalchemy import func, inspect, select
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.accounting import repository
from app.accounting.models import RunTotals, TrainingTotals
from app.db import create_engine, downgrade, schema_at_head, upgrade_to_head
from app.events import decode_entry
from app.keys import CONSUMER_GROUP, events_key
from tests.helpers import ack, lease, make_run, post, rollout
from workers.drain import DrainContext

CLIP_EPSILON = 0.2  # the run config's default
# Behaviour logprobs and the shifts the trainer's policy puts on them: all exact in float32, so
# log_r = new - old is exactly the shift on every token whatever precision the broker uses.
OLD = (-0.5, -1.0, -0.25, -2.0, -0.75)
FIELDS = ("batches", "samples", "tokens", "kl_mean", "kl_max", "is_ratio_mean", "clip_fraction")


@dataclass
class Expected:
    """What one trainer version's acked batches must add up to, computed here token by token
    (k3 = e^d - 1 - d and r = e^d for a log-ratio d) rather than by the broker's numpy code."""

    batches: int = 0
    samples: int = 0
    tokens: int = 0
    kl_tokens: int = 0
    kl_sum: float = 0.0
    kl_max: float | None = None
    ratio_tokens: int = 0
    ratio_sum: float = 0.0
    clipped: int = 0

    def measured(self, shifts: list[float]) -> None:
        """One rollout acked with logprobs: ``shifts`` are its tokens' log-ratios."""
        kl = [math.expm1(d) - d for d in shifts]
        self.kl_tokens += len(shifts)
        self.kl_sum += sum(kl)
        self.kl_max = max(self.kl_max or 0.0, sum(kl) / len(shifts))
        self.ratio_tokens += len(shifts)
        self.ratio_sum += sum(math.exp(d) for d in shifts)
        self.clipped += sum(abs(math.expm1(d)) > CLIP_EPSILON for d in shifts)

    def ready_made(self, kl: float, tokens: int) -> None:
        """One rollout acked with a ready-made KL: it counts as ``kl × tokens``, no ratios."""
        self.kl_tokens += tokens
        self.kl_sum += kl * tokens
        self.kl_max = max(self.kl_max or 0.0, kl)

    def answer(self) -> dict[str, Any]:
        def ratio(a: float, b: int) -> float | None:
            return a / b if b else None

        return {
            "batches": self.batches,
            "samples": self.samples,
            "tokens": self.tokens,
            "kl_mean": ratio(self.kl_sum, self.kl_tokens),
            "kl_max": self.kl_max,
            "is_ratio_mean": ratio(self.ratio_sum, self.ratio_tokens),
            "clip_fraction": ratio(self.clipped, self.ratio_tokens),
        }


def _close(got: Any, want: Any) -> bool:
    if isinstance(want, float) and isinstance(got, float):
        return math.isclose(got, want, rel_tol=1e-12, abs_tol=1e-15)
    return bool(got == want)


def _assert_version(got: dict[str, Any], want: dict[str, Any], version: int) -> None:
    assert list(got) == ["policy_version", *FIELDS, "kl_coef"]  # β: test_generator_accounting
    assert got["policy_version"] == version
    for name in FIELDS:
        assert _close(got[name], want[name]), (version, name, got[name], want[name])


async def test_figures_per_trainer_version(
    api: httpx.AsyncClient,
    make_ctx: Callable[..., DrainContext],
    sessionmaker: async_sessionmaker[AsyncSession],
) -> None:
    run = "train"
    # No KL gate or flush: every rollout stays until max_reuse, so the leases below are known.
    await make_run(api, run, max_reuse=3, max_staleness=2, kl_max=100.0, kl_flush=100.0)
    expected: dict[int, Expected] = defaultdict(Expected)

    async def give(
        version: int, batch: dict[str, Any], shifts: list[float] | None = None, kl: float = 0.0
    ) -> None:
        """Ack ``batch`` (leased at ``version``) with its tokens' log-ratios taken from
        ``shifts`` in turn, or with a ready-made KL ``kl``, or with nothing; and add what it must
        count to ``expected``."""
        want = expected[version]
        want.batches += 1
        body: dict[str, Any] = {}
        n = 0
        for r in batch["rollouts"]:
            tokens = len(r["logprobs"])
            want.samples += 1
            want.tokens += tokens
            if shifts is not None:
                d = [shifts[(n + i) % len(shifts)] for i in range(tokens)]
                n += tokens
                new = [old + s for old, s in zip(r["logprobs"], d, strict=True)]
                body.setdefault("logprobs", {})[r["rollout_id"]] = new
                want.measured(d)
            elif kl:
                body.setdefault("kl", {})[r["rollout_id"]] = kl
                want.ready_made(kl, tokens)
        resp = await ack(api, run, batch["batch_id"], **body)
        assert resp.status_code == 200, resp.text
        assert resp.json()["consumed"] == len(batch["rollouts"])

    async def take(size: int) -> dict[str, Any]:
        resp = await lease(api, run, size)
        assert resp.status_code == 200, resp.text
        batch: dict[str, Any] = resp.json()
        assert len(batch["rollouts"]) == size
        return batch

    # Version 0: two batches of the three v0 rollouts (4, 5 and 3 tokens).
    for i, tokens in enumerate((4, 5, 3)):
        await post(api, run, rollout(f"a{i}", 0, tokens=tokens, logprobs=list(OLD[:tokens])))
    await give(0, await take(2), [0.25, -0.5, 0.125, -0.375])  # the version's largest KL first
    await give(0, await take(3), [0.0625, 0.0, -0.125])

    # Version 1: a nacked batch, then one of v0 and v1 rollouts together (the trainer's
    # version is not theirs), acked with logprobs; then one acked with a ready-made KL.
    await api.post(f"/v1/runs/{run}/policy", json={"version": 1})
    for i, tokens in enumerate((2, 5)):
        await post(api, run, rollout(f"b{i}", 1, tokens=tokens, logprobs=list(OLD[-tokens:])))
    nacked = await take(2)
    resp = await api.post(f"/v1/runs/{run}/batches/{nacked['batch_id']}/nack")
    assert resp.status_code == 200, resp.text
    mixed = await take(4)
    assert {r["policy_version"] for r in mixed["rollouts"]} == {0, 1}
    await give(1, mixed, [-0.125, 0.1875, 0.0, -0.0625])
    await give(1, await take(2), kl=0.0625)

    # Version 2: acked with neither logprobs nor KL: counted, nothing measured.
    await api.post(f"/v1/runs/{run}/policy", json={"version": 2})
    await give(2, await take(2))

    # Version 3: one batch nacked and one expired, none acked: no row at all.
    await api.post(f"/v1/runs/{run}/policy", json={"version": 3})
    await post(api, run, rollout("c0", 3, tokens=3), rollout("c1", 3, tokens=2))
    nacked = await take(1)
    resp = await api.post(f"/v1/runs/{run}/batches/{nacked['batch_id']}/nack")
    assert resp.status_code == 200, resp.text
    await api.patch(f"/v1/runs/{run}/config", json={"lease_timeout_s": 0.05})
    expiring = await take(1)
    await asyncio.sleep(0.06)  # not a race: the lease's own 50 ms must pass for it to expire
    assert (await ack(api, run, expiring["batch_id"])).status_code == 409

    await drain_all(make_ctx())
    acc = (await api.get(f"/v1/runs/{run}/accounting")).json()
    assert acc["pending_events"] == 0
    assert acc["batches"] == {"leased": 8, "acked": 5, "nacked": 2, "expired": 1}

    resp = await api.get(f"/v1/runs/{run}/accounting/training")
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert list(body) == ["versions", "pending_events"]
    assert body["pending_events"] == 0
    rows = body["versions"]
    assert [r["policy_version"] for r in rows] == [0, 1, 2]  # ascending; none for version 3
    for row in rows:
        _assert_version(row, expected[row["policy_version"]].answer(), row["policy_version"])
    # The cases are what they claim: some tokens clipped, some not; version 2 measured nothing.
    assert 0 < expected[0].clipped < expected[0].ratio_tokens
    assert expected[1].kl_tokens > expected[1].ratio_tokens > 0
    assert rows[2] == {
        "policy_version": 2,
        "batches": 1,
        "samples": 2,
        "tokens": expected[2].tokens,
        "kl_mean": None,
        "kl_max": None,
        "is_ratio_mean": None,
        "clip_fraction": None,
        "kl_coef": None,  # the run has no adaptive KL penalty
    }

    # Summed over the trainer's versions: the run's figures.
    assert sum(r["batches"] for r in rows) == acc["batches"]["acked"]
    assert sum(r["samples"] for r in rows) == acc["samples_consumed"]
    assert sum(r["tokens"] for r in rows) == acc["tokens_consumed"]
    async with sessionmaker() as s:
        stored = (await s.scalars(select(TrainingTotals).where(TrainingTotals.run_id == run))).all()
    kl_tokens = sum(t.kl_tokens for t in stored)
    ratio_tokens = sum(t.ratio_tokens for t in stored)
    assert _close(sum(t.kl_sum for t in stored) / kl_tokens, acc["kl"]["mean"])
    assert max(t.kl_max for t in stored if t.kl_max is not None) == acc["kl"]["max"]
    assert _close(sum(t.ratio_sum for t in stored) / ratio_tokens, acc["is_ratio"]["mean"])
    assert sum(t.ratio_clipped for t in stored) / ratio_tokens == acc["is_ratio"]["clip_fraction"]


def _expected_from(sim: RunSim) -> dict[int, dict[str, Any]]:
    """Per trainer version: acked batches, samples and tokens from the simulator's own state;
    the KL and ratio sums from the acks it emitted (the simulator keeps them per run only)."""
    tokens_of = {rid: r.tokens for rid, r in sim.rollouts.items()}
    zero: dict[str, Any] = {
        "batches": 0, "samples": 0, "tokens": 0, "kl_tokens": 0, "kl_sum": 0.0, "kl_max": None,
        "ratio_tokens": 0, "ratio_sum": 0.0, "ratio_clipped": 0,
    }  # fmt: skip
    out: dict[int, dict[str, Any]] = defaultdict(lambda: dict(zero))
    for batch in sim.batches.values():
        if batch.outcome == "acked":
            row = out[batch.version]
            row["batches"] += 1
            row["samples"] += len(batch.rollout_ids)
            row["tokens"] += sum(tokens_of[rid] for rid in batch.rollout_ids)
    for event_type, payload in sim.events:
        if event_type != "acked":
            continue
        row = out[payload["policy_version"]]
        sums = payload.get("sums", {})
        for name, key in (
            ("kl_tokens", "kl_tokens"),
            ("kl_sum", "kl_sum"),
            ("ratio_tokens", "ratio_tokens"),
            ("ratio_sum", "ratio_sum"),
            ("ratio_clipped", "clipped"),
        ):
            row[name] += sums.get(key, 0)
        kl_max = payload.get("stats", {}).get("kl_max")
        if kl_max is not None:
            row["kl_max"] = kl_max if row["kl_max"] is None else max(row["kl_max"], kl_max)
    return dict(out)


async def _training_rows(
    sm: async_sessionmaker[AsyncSession], run_id: str
) -> dict[int, dict[str, Any]]:
    async with sm() as s:
        rows = (
            await s.scalars(select(TrainingTotals).where(TrainingTotals.run_id == run_id))
        ).all()
    return {r.policy_version: fields_of(r) for r in rows}


async def test_mixed_workload_adds_up_once_whatever_is_delivered_again(
    redis: Redis,
    prefix: str,
    run_id: str,
    make_ctx: Callable[..., DrainContext],
    accounting_api: httpx.AsyncClient,
    sessionmaker: async_sessionmaker[AsyncSession],
) -> None:
    sim = RunSim(run_id, seed=21, group_size=2, max_reuse=3)
    sim.workload(60)
    # Then a trainer version whose batches are all given back or expire.
    sim.set_policy(sim.policy + 1)
    sim.ingest(2)
    for settle in (sim.nack, sim.expire):
        batch_id = sim.lease(2 * sim.group_size)
        assert batch_id is not None
        settle(batch_id)
    # Acks with and without measures at several trainer versions, and one with none.
    outcomes: dict[int, set[str]] = defaultdict(set)
    for batch in sim.batches.values():
        outcomes[batch.version].add(batch.outcome)
    assert sum("acked" in o for o in outcomes.values()) >= 3
    assert outcomes[sim.policy] == {"nacked", "expired"}
    await register_run(redis, prefix, run_id)
    ids = await xadd_events(redis, prefix, run_id, sim.events)
    await drain_all(make_ctx(trim=False, batch_size=23))

    expected = _expected_from(sim)
    stored = await _training_rows(sessionmaker, run_id)
    assert set(stored) == set(expected)  # a version with no acked batch has no row
    assert sim.policy not in stored
    for version, want in expected.items():
        got = stored[version]
        assert got["run_id"] == run_id and got["policy_version"] == version
        for name, value in want.items():
            assert _close(got[name], value), (version, name, got[name], value)

    # The API reads the rows, and they add up to the run's totals.
    body = (await accounting_api.get(f"/v1/runs/{run_id}/accounting/training")).json()
    assert [r["policy_version"] for r in body["versions"]] == sorted(expected)
    async with sessionmaker() as s:
        run = await s.get(RunTotals, run_id)
        assert run is not None
        for name, column in (
            ("batches", "batches_acked"),
            ("samples", "rollouts_acked"),
            ("tokens", "tokens_consumed"),
            ("kl_tokens", "kl_tokens"),
            ("ratio_tokens", "ratio_tokens"),
            ("ratio_clipped", "ratio_clipped"),
        ):
            total = await s.scalar(
                select(func.sum(getattr(TrainingTotals, name))).where(
                    TrainingTotals.run_id == run_id
                )
            )
            assert total == getattr(run, column), name
        for name in ("kl_sum", "ratio_sum"):
            total = await s.scalar(
                select(func.sum(getattr(TrainingTotals, name))).where(
                    TrainingTotals.run_id == run_id
                )
            )
            assert _close(total, getattr(run, name)), name
        kl_max = await s.scalar(
            select(func.max(TrainingTotals.kl_max)).where(TrainingTotals.run_id == run_id)
        )
        assert kl_max == run.kl_max

    # Every entry delivered again, to a new consumer: nothing changes.
    key = events_key(prefix, run_id)
    await redis.xgroup_setid(key, CONSUMER_GROUP, "0")
    await drain_all(make_ctx(trim=False, batch_size=31))
    assert await _training_rows(sessionmaker, run_id) == stored
    # Committed but never acknowledged (the crash window), applied again, even twice in one
    # batch: nothing changes.
    await redis.xgroup_setid(key, CONSUMER_GROUP, "0")
    raw = await redis.xreadgroup(CONSUMER_GROUP, "ghost", {key: ">"}, count=len(ids))
    events = [decode_entry(run_id, eid, fields) for eid, fields in raw[0][1]]
    assert any(e.type == "acked" for e in events)
    async with sessionmaker() as s, s.begin():
        result = await repository.apply_events(s, run_id, [*events, *events])
    assert result.applied == 0
    assert await _training_rows(sessionmaker, run_id) == stored
    await drain_all(make_ctx(trim=False, claim_idle_ms=0), claim=True)
    assert await _training_rows(sessionmaker, run_id) == stored


async def test_unknown_run_is_404(accounting_api: httpx.AsyncClient) -> None:
    resp = await accounting_api.get("/v1/runs/no-such-run/accounting/training")
    assert resp.status_code == 404
    body = resp.json()
    assert set(body) == {"error", "detail"}
    assert body["error"] == "RunNotFound"
    assert "no-such-run" in body["detail"]


async def test_run_known_only_to_redis_has_no_versions(
    accounting_api: httpx.AsyncClient, redis: Redis, prefix: str, run_id: str
) -> None:
    await register_run(redis, prefix, run_id)
    sim = RunSim(run_id)
    sim.create()
    await xadd_events(redis, prefix, run_id, sim.events)
    resp = await accounting_api.get(f"/v1/runs/{run_id}/accounting/training")
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"versions": [], "pending_events": len(sim.events)}


def _columns(connection: Connection) -> dict[str, tuple[str, bool]] | None:
    inspector = inspect(connection)
    if "training_totals" not in inspector.get_table_names():
        return None
    return {
        c["name"]: (str(c["type"]), c["nullable"]) for c in inspector.get_columns("training_totals")
    }


async def test_migration_upgrades_and_downgrades(
    database_factory: Callable[[], Awaitable[str]],
) -> None:
    url = await database_factory()
    engine = create_engine(url)
    declared = {
        c.name: (str(c.type.compile(dialect=engine.dialect)), bool(c.nullable))
        for c in TrainingTotals.__table__.columns
    }
    try:
        await upgrade_to_head(url)
        async with engine.connect() as conn:
            assert await conn.run_sync(_columns) == declared

        await downgrade(url, "0004_access")
        assert not await schema_at_head(engine)
        async with engine.connect() as conn:
            assert await conn.run_sync(_columns) is None
            assert "run_totals" in await conn.run_sync(lambda c: inspect(c).get_table_names())

        await upgrade_to_head(url)
        assert await schema_at_head(engine)
        async with engine.connect() as conn:
            assert await conn.run_sync(_columns) == declared
    finally:
        await engine.dispose()
