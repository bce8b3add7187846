"""Per-generator accounting and the β of the adaptive KL penalty: folded from constructed
events in any order, they equal a recompute from the workload's own states; the answer's
shape, its nulls, and the migration."""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from accounting_helpers import (
    T0,
    RunSim,
    apply_batches,
    assert_matches,
    entry,
    event_at,
    register_run,
    xadd_events,
)
from redis.asyncio import Redis
from sqlalchemy import Connection, inspect
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.accounting.models import GeneratorTotals
from app.db import create_engine, downgrade, upgrade_to_head
from app.events import (
    Accepted,
    AcceptedItem,
    Acked,
    AckedGen,
    AckedItem,
    AckStats,
    AckSums,
    Event,
    GeneratorChanged,
    Rewound,
    RewoundGen,
    decode_entry,
)

# The fold and the ledger's reads are the subject here; Redis serves only the reads' pending
# counts, the same on a cluster (the drain's own tests run on both).
pytestmark = pytest.mark.one_node


def _events(run_id: str, raw: Sequence[tuple[str, dict[str, Any]]]) -> list[Event]:
    return [decode_entry(run_id, f"{1000 + i}-0", entry(t, p)) for i, (t, p) in enumerate(raw)]


def _ms(stamp: str | None) -> int | None:
    if stamp is None:
        return None
    return round(datetime.fromisoformat(stamp).astimezone(UTC).timestamp() * 1000)


async def _generators(api: httpx.AsyncClient, run_id: str) -> dict[str, dict[str, Any]]:
    resp = await api.get(f"/v1/runs/{run_id}/accounting/generators")
    assert resp.status_code == 200, resp.text
    rows = resp.json()["generators"]
    assert [r["generator_id"] for r in rows] == sorted(r["generator_id"] for r in rows)
    return {r["generator_id"]: {**r, "last_seen": _ms(r["last_seen"])} for r in rows}


@pytest.mark.parametrize("order", ["in_order", "one_at_a_time_shuffled", "batches_shuffled"])
async def test_generator_figures_equal_a_recompute_whatever_the_order(
    sessionmaker: async_sessionmaker[AsyncSession],
    accounting_api: httpx.AsyncClient,
    run_id: str,
    order: str,
) -> None:
    sim = RunSim(run_id, seed=5, group_size=2, rewinds=True, generators=4, beta=0.2)
    sim.workload(40)
    events = _events(run_id, sim.events)
    # The workload has what the rules are about: uses a rewind undid, quarantines and releases.
    assert any(e.type == "rewound" and any(g.samples for g in e.body.gens) for e in events)
    told = [e.body.quarantined for e in events if e.type == "generator"]
    assert True in told and False in told
    if order == "in_order":
        batches: list[list[Event]] = [events]
    elif order == "one_at_a_time_shuffled":
        batches = [[e] for e in events]
        random.Random(3).shuffle(batches)
    else:
        batches = [events[i : i + 9] for i in range(0, len(events), 9)]
        random.Random(4).shuffle(batches)
    await apply_batches(sessionmaker, run_id, batches)

    expected = sim.expected_generators()
    got = await _generators(accounting_api, run_id)
    assert set(got) == set(expected)
    for generator, want in expected.items():
        assert_matches(got[generator], want, generator)
    assert any(g["quarantined"] for g in got.values())

    # β: the run's after its newest ack, and per version of the trainer that of the newest ack
    # at that version.
    acc = (await accounting_api.get(f"/v1/runs/{run_id}/accounting")).json()
    assert acc["kl_coef"] == pytest.approx(sim.beta)
    versions = (await accounting_api.get(f"/v1/runs/{run_id}/accounting/versions")).json()
    for row in versions["versions"]:
        want_beta = sim.betas.get(row["policy_version"])
        assert row["kl_coef"] == (pytest.approx(want_beta) if want_beta is not None else None)
    training = (await accounting_api.get(f"/v1/runs/{run_id}/accounting/training")).json()
    assert training["versions"]
    for row in training["versions"]:
        assert row["kl_coef"] == pytest.approx(sim.betas[row["policy_version"]])


def _told(run_id: str, n: int, generator: str, quarantined: bool) -> Event:
    return event_at(run_id, n, "generator", GeneratorChanged(generator, quarantined, 0.5, 100))


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("together", [False, True])
async def test_the_newest_quarantine_or_release_wins_in_either_order(
    sessionmaker: async_sessionmaker[AsyncSession],
    accounting_api: httpx.AsyncClient,
    run_id: str,
    reverse: bool,
    together: bool,
) -> None:
    events = [
        _told(run_id, 10, "released-last", True),
        _told(run_id, 11, "released-last", False),
        _told(run_id, 12, "quarantined-last", False),
        _told(run_id, 13, "quarantined-last", True),
        _told(run_id, 14, "quarantined-once", True),
    ]
    if reverse:
        events.reverse()
    await apply_batches(sessionmaker, run_id, [events] if together else [[e] for e in events])
    got = await _generators(accounting_api, run_id)
    assert {g: row["quarantined"] for g, row in got.items()} == {
        "quarantined-last": True,
        "quarantined-once": True,
        "released-last": False,
    }
    # Told nothing else: nothing received, nothing measured.
    assert got["quarantined-once"] == {
        "generator_id": "quarantined-once",
        "rollouts": 0,
        "tokens": 0,
        "samples_consumed": 0,
        "kl": {"mean": None, "max": None},
        "is_ratio": {"mean": None, "clip_fraction": None},
        "masked_fraction": None,
        "last_seen": None,
        "quarantined": True,
    }


def _acked(run_id: str, n: int, version: int, kl_coef: float | None) -> Event:
    body = Acked(
        batch_id=f"b-{n}",
        step=None,
        policy_version=version,
        items=(AckedItem(f"r-{version}", version, 4, None),),
        stats=AckStats(),
        sums=AckSums(),
        kl_coef=kl_coef,
    )
    return event_at(run_id, n, "acked", body)


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_beta_per_version_is_the_newest_acks_and_null_once_the_penalty_is_off(
    sessionmaker: async_sessionmaker[AsyncSession],
    accounting_api: httpx.AsyncClient,
    run_id: str,
    seed: int,
) -> None:
    accepted = Accepted(tuple(AcceptedItem(f"r-{v}", f"r-{v}", v, 4, True) for v in (1, 2, 3)))
    events = [
        event_at(run_id, 1, "accepted", accepted),
        _acked(run_id, 5, 1, 0.1),
        _acked(run_id, 6, 2, 0.2),
        _acked(run_id, 7, 1, 0.3),
        _acked(run_id, 8, 3, 0.4),
    ]
    random.Random(seed).shuffle(events)
    await apply_batches(sessionmaker, run_id, [[e] for e in events])
    acc = (await accounting_api.get(f"/v1/runs/{run_id}/accounting")).json()
    assert acc["kl_coef"] == 0.4
    rows = (await accounting_api.get(f"/v1/runs/{run_id}/accounting/versions")).json()
    assert {r["policy_version"]: r["kl_coef"] for r in rows["versions"]} == {
        1: 0.3,
        2: 0.2,
        3: 0.4,
    }
    # The penalty turned off: the newest ack carries no β, and the run's is null.
    await apply_batches(sessionmaker, run_id, [[_acked(run_id, 9, 2, None)]])
    acc = (await accounting_api.get(f"/v1/runs/{run_id}/accounting")).json()
    assert acc["kl_coef"] is None
    rows = (await accounting_api.get(f"/v1/runs/{run_id}/accounting/versions")).json()
    assert {r["policy_version"]: r["kl_coef"] for r in rows["versions"]} == {
        1: 0.3,
        2: None,
        3: 0.4,
    }


async def test_answer_shape_sums_and_nulls(
    sessionmaker: async_sessionmaker[AsyncSession],
    accounting_api: httpx.AsyncClient,
    run_id: str,
) -> None:
    accepted = Accepted(
        (
            AcceptedItem("r-1", "r-1", 0, 10, True, 0, False, "gen-a"),
            AcceptedItem("r-2", "r-2", 0, 6, True, 0, False, "gen-b"),
            AcceptedItem("r-3", "r-3", 0, 7, True),  # no generator: counted for none
        )
    )
    gens = (
        AckedGen("gen-a", 2, 20, 16, 0.8, 20, 22.0, 5, 2, 0.25),
        # Its samples acked with no logprobs: nothing measured.
        AckedGen("gen-b", 1, 6, 0, 0.0, 0, 0.0, 0, 0),
    )
    acked = Acked(
        batch_id="b-1",
        step=None,
        policy_version=1,
        items=tuple(AckedItem(r, 0, n, None) for r, n in (("r-1", 10), ("r-1", 10), ("r-2", 6))),
        stats=AckStats(),
        sums=AckSums(),
        gens=gens,
    )
    events = [
        event_at(run_id, 1, "accepted", accepted),
        event_at(
            run_id,
            2,
            "accepted",
            Accepted((AcceptedItem("r-4", "r-4", 0, 5, True, 0, False, "gen-a"),)),
        ),
        event_at(run_id, 3, "acked", acked),
        event_at(
            run_id,
            4,
            "acked",
            Acked(
                "b-2",
                None,
                1,
                (),
                AckStats(),
                AckSums(),
                gens=(AckedGen("gen-a", 1, 5, 4, 0.6, 5, 4.0, 1, 1, 0.5),),
            ),
        ),
        event_at(run_id, 5, "rewound", Rewound(1, 0, ("b-1",), (), (RewoundGen("gen-a", 1),))),
    ]
    await apply_batches(sessionmaker, run_id, [events])
    resp = await accounting_api.get(f"/v1/runs/{run_id}/accounting/generators")
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert set(body) == {"generators", "as_of", "pending_events"}
    assert (
        body["as_of"] == (await accounting_api.get(f"/v1/runs/{run_id}/accounting")).json()["as_of"]
    )
    a, b = body["generators"]
    assert a == {
        "generator_id": "gen-a",
        "rollouts": 2,
        "tokens": 15,
        "samples_consumed": 2,  # 2 + 1 acked, 1 undone
        "kl": {"mean": pytest.approx(1.4 / 20), "max": 0.5},
        "is_ratio": {"mean": pytest.approx(26.0 / 25), "clip_fraction": pytest.approx(6 / 25)},
        "masked_fraction": pytest.approx(3 / 25),
        "last_seen": a["last_seen"],
        "quarantined": False,
    }
    assert _ms(a["last_seen"]) == T0 + 2
    assert b == {
        "generator_id": "gen-b",
        "rollouts": 1,
        "tokens": 6,
        "samples_consumed": 1,
        "kl": {"mean": None, "max": None},
        "is_ratio": {"mean": None, "clip_fraction": None},
        "masked_fraction": None,
        "last_seen": b["last_seen"],
        "quarantined": False,
    }
    assert _ms(b["last_seen"]) == T0 + 1


async def test_unknown_run_is_404(accounting_api: httpx.AsyncClient) -> None:
    resp = await accounting_api.get("/v1/runs/no-such-run/accounting/generators")
    assert resp.status_code == 404
    assert resp.json() == {"error": "RunNotFound", "detail": "run 'no-such-run' does not exist"}


async def test_run_known_only_to_redis_has_no_generators(
    accounting_api: httpx.AsyncClient, redis: Redis, prefix: str, run_id: str
) -> None:
    await register_run(redis, prefix, run_id)
    sim = RunSim(run_id)
    sim.create()
    await xadd_events(redis, prefix, run_id, sim.events)
    resp = await accounting_api.get(f"/v1/runs/{run_id}/accounting/generators")
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"generators": [], "as_of": None, "pending_events": len(sim.events)}


def _columns(connection: Connection) -> dict[str, tuple[str, bool]] | None:
    inspector = inspect(connection)
    if "generator_totals" not in inspector.get_table_names():
        return None
    return {
        c["name"]: (str(c["type"]), c["nullable"])
        for c in inspector.get_columns("generator_totals")
    }


async def test_migration_upgrades_and_downgrades(
    database_factory: Callable[[], Awaitable[str]],
) -> None:
    url = await database_factory()
    engine = create_engine(url)
    declared = {
        c.name: (str(c.type.compile(dialect=engine.dialect)), bool(c.nullable))
        for c in GeneratorTotals.__table__.columns
    }
    try:
        await upgrade_to_head(url)
        async with engine.connect() as conn:
            assert await conn.run_sync(_columns) == declared
        await downgrade(url, "0010_rewards")
        async with engine.connect() as conn:
            assert await conn.run_sync(_columns) is None
            run_columns = await conn.run_sync(lambda c: inspect(c).get_columns("run_totals"))
            assert "kl_coef" not in {c["name"] for c in run_columns}
        await upgrade_to_head(url)
        async with engine.connect() as conn:
            assert await conn.run_sync(_columns) == declared
    finally:
        await engine.dispose()
