"""The accounting of a rewind of the policy version (SPEC "Policy versions", docs/accounting.md
"Rewinding"): the `rewound` event as the rewind writes it, through the real decoder, fold,
repository and drain into Postgres, and the figures the API then shows. A rewind from 3 to 1
here undoes batches b2 (acked at 2) and b3 (acked at 3), in which rollout x was used twice."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from accounting_helpers import drain_all, entry, fields_of, register_run, xadd_events
from redis.asyncio import Redis
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.accounting import repository
from app.accounting.fold import fold_events
from app.accounting.models import Batch, PromptPass, ReasonTotals, RunTotals, VersionTotals
from app.events import Event, EventError, Rewound, RewoundItem, decode_entry, encode_payload
from app.keys import CONSUMER_GROUP, events_key
from tests.api.support import events
from tests.api.test_rewind import history, rewind
from tests.helpers import live_of_ledger
from workers.drain import DrainContext

T0 = 1_750_000_000_000

# (event type, payload) as the scripts write them; `t` is added by story().
LEASE_AND_ACK = [
    ("accepted", {"items": [["x", "x", 1, 10, 1], ["y", "y", 2, 20, 1], ["z", "z", 3, 30, 1]]}),
    ("leased", {"batch_id": "b1", "policy_version": 1, "expires_at": T0 + 9,
                "items": [["x", 1, 10, 0, 0]]}),
    ("acked", {"batch_id": "b1", "policy_version": 1, "items": [["x", 1, 10]]}),
    ("leased", {"batch_id": "b2", "policy_version": 2, "expires_at": T0 + 9,
                "items": [["x", 1, 10, 1, 1], ["y", 2, 20, 0, 0]]}),
    ("acked", {"batch_id": "b2", "policy_version": 2, "items": [["x", 1, 10], ["y", 2, 20]]}),
    ("leased", {"batch_id": "b3", "policy_version": 3, "expires_at": T0 + 9,
                "items": [["x", 1, 10, 2, 2], ["z", 3, 30, 0, 0]]}),
    ("acked", {"batch_id": "b3", "policy_version": 3, "items": [["x", 1, 10], ["z", 3, 30]]}),
]  # fmt: skip
REWIND = [
    # x's uses in b2 and b3 and y's in b2 given back: x is there twice.
    ("rewound", {"from_version": 3, "to_version": 1, "batches": ["b2", "b3"],
                 "items": [["x", 1, 10, 2], ["y", 2, 20, 2], ["x", 1, 10, 3], ["z", 3, 30, 3]]}),
    # y (2) and z (3) have tokens above 1: y keeps no use, z none either.
    ("retired", {"reason": "rewound", "items": [["y", 2, 20, 0], ["z", 3, 30, 0]]}),
    ("passes", {"cause": "rewound",
                "items": [["p", 1, 2, "queued", 0], ["q", 1, 2, "in_flight", 0]]}),
    ("partials", {"change": "dropped", "reason": "rewound", "lease_id": "w9",
                  "items": [["part", "p", 1, 3, 7]]}),
]  # fmt: skip
PROMPTS = [
    ("registered", {"items": [["p", 1], ["q", 1]]}),
    ("work_leased", {"lease_id": "w1", "policy_version": 2, "expires_at": T0 + 9,
                     "items": [["p", 1, 1], ["q", 1, 1]]}),
    ("passes", {"cause": "acked", "items": [["p", 1, 1, "done", 0], ["q", 1, 1, "done", 0]]}),
]  # fmt: skip


def story(run_id: str, steps: list[tuple[str, dict[str, Any]]], start: int = 1) -> list[Event]:
    return [
        decode_entry(run_id, f"{T0 + n}-0", entry(t, {"t": T0 + n, **payload}))
        for n, (t, payload) in enumerate(steps, start=start)
    ]


def all_events(run_id: str) -> list[Event]:
    return story(run_id, [*LEASE_AND_ACK, *PROMPTS, *REWIND])


# --- the schema ------------------------------------------------------------------------------


def test_the_rewound_event_decodes_as_the_scripts_write_it() -> None:
    (event,) = story("r", REWIND[:1])
    body = event.body
    assert isinstance(body, Rewound)
    assert (body.from_version, body.to_version, body.batches) == (3, 1, ("b2", "b3"))
    assert body.items[0] == RewoundItem("x", 1, 10, 2)
    assert encode_payload("rewound", body) == REWIND[0][1]
    # Nothing undone: Lua packs the empty tables as an empty array or an empty map.
    for empty in ([], {}):
        (none,) = story("r", [("rewound", {"from_version": 5, "to_version": 4,
                                           "batches": empty, "items": empty})])  # fmt: skip
        assert isinstance(none.body, Rewound) and none.body.batches == none.body.items == ()


@pytest.mark.parametrize(
    "payload",
    [
        {"from_version": 3, "to_version": -1, "batches": [], "items": []},
        {"from_version": 3, "to_version": 1, "batches": [], "items": [["x", 1, 10]]},
        {"from_version": 3, "to_version": 1, "batches": [7], "items": []},
        {"from_version": 3, "to_version": 1, "items": []},
    ],
)
def test_a_malformed_rewound_event_is_refused(payload: dict[str, Any]) -> None:
    with pytest.raises(EventError):
        story("r", [("rewound", payload)])


# --- the fold --------------------------------------------------------------------------------


def test_each_use_given_back_counts_once_per_run_and_per_rollout_version() -> None:
    fold = fold_events(all_events("r"))
    assert fold.run.samples_rewound == 4
    assert {v: d.samples_rewound for v, d in fold.versions.items()} == {1: 2, 2: 1, 3: 1}
    # samples_consumed keeps every gradient that happened: 1 + 2 + 2 uses.
    assert fold.run.rollouts_acked == 5
    assert fold.run.batches_acked == 3
    # The retirements and their waste, by reason and rollout version.
    assert fold.run.rollouts_retired == 2 and fold.run.wasted_tokens == 50
    assert {k: (d.rollouts, d.unused) for k, d in fold.reasons.items()} == {
        (2, "retired", "rewound"): (1, 1),
        (3, "retired", "rewound"): (1, 1),
    }
    assert (fold.run.partials_dropped, fold.run.partial_tokens_dropped) == (1, 7)
    # The passes go back to a later attempt, whatever came before.
    assert {k: (s.attempt, s.state) for k, s in fold.passes.items()} == {
        ("p", 1): (2, "queued"),
        ("q", 1): (2, "in_flight"),
    }


def test_the_batch_ledger_marks_the_undone_batches_in_any_order() -> None:
    events = all_events("r")
    rewind_t = next(e.t_ms for e in events if e.type == "rewound")
    for order in (events, events[::-1]):
        batches = fold_events(order).batches
        assert {b: p.rewound_at_ms for b, p in batches.items()} == {
            "b1": None,
            "b2": rewind_t,
            "b3": rewind_t,
        }
        assert {p.outcome for p in batches.values()} == {"acked"}
        # The ledger's order stays the lease's: the rewind's entry comes later.
        leases = [e for e in events if e.type == "leased"]
        assert batches["b2"].first_event == leases[1].stream_id


def test_of_two_rewinds_that_name_a_batch_the_first_is_kept() -> None:
    first, second = story("r", [REWIND[0], REWIND[0]])
    for order in ([first, second], [second, first]):
        assert fold_events(order).batches["b2"].rewound_at_ms == first.t_ms


# --- the repository and the drain ------------------------------------------------------------


async def _rows(sm: async_sessionmaker[AsyncSession], run_id: str) -> dict[str, Any]:
    async with sm() as s:
        out: dict[str, Any] = {}
        for model in (RunTotals, VersionTotals, ReasonTotals, Batch, PromptPass):
            rows = (await s.scalars(select(model).where(model.run_id == run_id))).all()
            out[model.__tablename__] = sorted(
                ({k: v for k, v in fields_of(r).items() if k != "run_id"} for r in rows),
                key=repr,
            )
        return out


async def test_applied_one_event_at_a_time_in_any_order_the_tables_are_the_same(
    sessionmaker: async_sessionmaker[AsyncSession], run_id: str
) -> None:
    """The rewind's patch of a batch may reach the ledger before the batch's lease or ack (a
    claimed batch of entries lands late): each row ends the same, acked with its rewound_at,
    the time of the first rewind that named it (a later one names b3 again)."""
    later = ("rewound", {"from_version": 3, "to_version": 0, "batches": ["b3"], "items": []})
    events = story(run_id, [*LEASE_AND_ACK, *PROMPTS, *REWIND, later])
    batch_events = [e for e in events if e.type in ("leased", "acked", "rewound")]
    orders = {
        "forwards": events,
        "backwards": events[::-1],
        # The rewind first, then b2's ack, then its lease, then the rest.
        "rewind-first": [
            *(e for e in batch_events if e.type == "rewound"),
            *(e for e in batch_events[::-1] if e.type != "rewound"),
            *(e for e in events if e not in batch_events),
        ],
    }
    tables = {}
    for name, order in orders.items():
        run = f"{run_id}-{name}"
        for e in order:
            async with sessionmaker() as s, s.begin():
                await repository.apply_events(
                    s, run, [Event(run, e.stream_id, e.type, e.t_ms, e.body)]
                )
        tables[name] = await _rows(sessionmaker, run)
    first = tables["forwards"]
    assert all(t == first for t in tables.values())
    batches = {b["batch_id"]: b for b in first["batches"]}
    assert {b: (r["outcome"], r["rewound_at"] is not None) for b, r in batches.items()} == {
        "b1": ("acked", False),
        "b2": ("acked", True),
        "b3": ("acked", True),
    }
    first_rewind = next(e.t_ms for e in events if e.type == "rewound")
    for b in ("b2", "b3"):
        assert round(batches[b]["rewound_at"].timestamp() * 1000) == first_rewind
    (run,) = first["run_totals"]
    assert (run["samples_rewound"], run["rollouts_acked"]) == (4, 5)


async def test_the_drain_counts_a_redelivered_rewind_once_and_the_api_shows_it(
    redis: Redis,
    prefix: str,
    run_id: str,
    make_ctx: Callable[..., DrainContext],
    accounting_api: httpx.AsyncClient,
    sessionmaker: async_sessionmaker[AsyncSession],
) -> None:
    await register_run(redis, prefix, run_id)
    steps = [*LEASE_AND_ACK, *PROMPTS, *REWIND]
    await xadd_events(
        redis, prefix, run_id, [(t, {"t": T0 + n, **p}) for n, (t, p) in enumerate(steps)]
    )
    await drain_all(make_ctx(trim=False))

    async def figures() -> dict[str, Any]:
        base = f"/v1/runs/{run_id}"
        acc = (await accounting_api.get(f"{base}/accounting")).json()
        versions = (await accounting_api.get(f"{base}/accounting/versions")).json()["versions"]
        batches = (await accounting_api.get(f"{base}/batches")).json()["batches"]
        return {
            "samples_rewound": acc["samples_rewound"],
            "samples_consumed": acc["samples_consumed"],
            "retired": acc["retired"],
            "wasted_tokens": acc["wasted_tokens"],
            "dropped": acc["partials"]["dropped"],
            "prompts": acc["prompts"],
            "versions": {v["policy_version"]: v["samples_rewound"] for v in versions},
            "rewound_at": {b["batch_id"]: b["rewound_at"] for b in batches},
            "acked": sum(b["size"] for b in batches if b["outcome"] == "acked"),
            "pending": acc["pending_events"],
            "flow": (acc["rollouts_received"], acc["buffered"], acc["leased"]),
        }

    once = await figures()
    assert once["pending"] == 0
    assert once["samples_rewound"] == 4
    assert once["versions"] == {1: 2, 2: 1, 3: 1}
    # samples_consumed == Σ sizes of the acknowledged batches, undone ones too.
    assert once["samples_consumed"] == once["acked"] == 5
    assert once["retired"] == {"rewound": 2} and once["wasted_tokens"] == 50
    assert once["dropped"] == 1
    assert once["prompts"] == {
        "registered": 2, "queued": 1, "in_flight": 1, "done": 0, "failed": 0, "retried": 2,
        "skipped": 0, "cancelled": 0, "pools": None,
    }  # fmt: skip
    received, buffered, leased = once["flow"]
    assert received == buffered + leased + 2
    rewound_at = once["rewound_at"]
    assert rewound_at["b1"] is None and rewound_at["b2"] == rewound_at["b3"] is not None

    # Every entry delivered again: nothing moves.
    await redis.xgroup_setid(events_key(prefix, run_id), CONSUMER_GROUP, "0")
    await drain_all(make_ctx(trim=False))
    assert await figures() == once
    # And the rewind's entry once more, as a new consumer claiming it would read it.
    raw = await redis.xrange(events_key(prefix, run_id))
    rewound = [
        decode_entry(run_id, eid, fields) for eid, fields in raw if fields[b"e"] == b"rewound"
    ]
    assert len(rewound) == 1
    async with sessionmaker() as s, s.begin():
        result = await repository.apply_events(s, run_id, rewound * 2)
    assert (result.applied, result.already) == (0, 2)
    assert await figures() == once


# --- through the real broker -----------------------------------------------------------------


async def test_a_rewind_of_the_broker_is_accounted_exactly(
    api: httpx.AsyncClient, redis: Redis, prefix: str, make_ctx: Callable[..., DrainContext]
) -> None:
    """tests/api/test_rewind.py's run: batches acked at 9 to 12 with reuse, a lease held at 11,
    a work lease at 12, then a rewind to 8; drained before and after."""
    await history(api)
    await drain_all(make_ctx(trim=False))  # the stream keeps the events, to read them below
    before = (await api.get("/v1/runs/r/accounting")).json()
    await rewind(api, "r", 8)
    await drain_all(make_ctx(trim=False))
    after = (await api.get("/v1/runs/r/accounting")).json()
    versions = (await api.get("/v1/runs/r/accounting/versions")).json()["versions"]
    ledger = {b["batch_id"]: b for b in (await api.get("/v1/runs/r/batches")).json()["batches"]}

    # The figures docs/accounting.md gives for this run, before the rewind.
    assert (before["rollouts_received"], before["tokens_consumed"], before["buffered"]) == (
        12,
        64,
        2,
    )
    assert before["retired"] == {"max_reuse": 6} and before["wasted_tokens"] == 0
    assert before["batches"] == {"leased": 5, "acked": 4, "nacked": 0, "expired": 0}
    assert (before["prompts"]["in_flight"], before["prompts"]["retried"]) == (1, 0)
    (undone,) = [d for e, d in await events(redis, prefix, "r") if e == "rewound"]
    # One use given back per rollout per undone batch: 2 + 6 + 6 + 2 at 9, 10, 11, 12.
    assert before["samples_rewound"] == 0 and after["samples_rewound"] == len(undone["items"]) == 16
    by_version = Counter(i[1] for i in undone["items"])
    assert {v["policy_version"]: v["samples_rewound"] for v in versions} == {
        v["policy_version"]: by_version[v["policy_version"]] for v in versions
    }
    assert dict(by_version) == {8: 12, 11: 2, 12: 2}
    # The gradients happened: nothing of them moves.
    for figure in ("samples_consumed", "tokens_consumed", "lag", "batches", "reuse_factor"):
        if figure != "batches":
            assert after[figure] == before[figure], figure
    assert after["batches"] == {**before["batches"], "expired": before["batches"]["expired"] + 1}
    acked = [b for b in ledger.values() if b["outcome"] == "acked"]
    assert after["samples_consumed"] == sum(b["size"] for b in acked) == 16
    assert {b: r["rewound_at"] is not None for b, r in ledger.items()} == {
        "batch-09": True, "batch-10": True, "batch-11": True, "batch-12": True,
        "held-at-11": False,
    }  # fmt: skip
    assert ledger["held-at-11"]["outcome"] == "expired"
    # d, h (tokens at 11) and f (12) retire rewound, with none of their uses left: wasted.
    assert after["retired"] == {**before["retired"], "rewound": 6}
    assert after["wasted_tokens"] == before["wasted_tokens"] + 6 * 4
    # Every pass back in the queue, at a new attempt (d's twice) that is not a try.
    assert (before["prompts"]["done"], after["prompts"]["done"]) == (4, 0)
    assert after["prompts"] == {
        "registered": 5, "queued": 5, "in_flight": 0, "done": 0, "failed": 0,
        "retried": before["prompts"]["retried"] + 6, "skipped": 0, "cancelled": 0, "pools": None,
    }  # fmt: skip
    for acc in (before, after):
        assert acc["rollouts_received"] == (
            acc["buffered"] + acc["leased"] + sum(acc["retired"].values())
        )
        assert acc["pending_events"] == acc["dead_letters"] == 0
        assert acc["live"] == live_of_ledger(acc)
    assert (before["leased"], after["leased"]) == (4, 0)
