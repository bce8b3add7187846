"""The event schema: decoding of stream entries, the encoder against the decoder, the docs'
table, and that folding does not depend on the order of batches."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import msgpack
import pytest
from accounting_helpers import RunSim, entry, fields_of, pack
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.accounting import repository
from app.accounting.models import (
    Batch,
    GeneratorTotals,
    LagCount,
    PromptPass,
    ReasonTotals,
    Run,
    RunTotals,
    TrainingTotals,
    VersionTotals,
)
from app.events import (
    EVENT_TYPES,
    Accepted,
    AcceptedItem,
    Acked,
    AckedItem,
    AckStats,
    AckSums,
    EventError,
    Leased,
    Retired,
    RunChanged,
    StreamId,
    decode_entry,
    encode_entry,
    encode_payload,
    markdown_table,
)


def _decode(event_type: str, payload: dict[str, Any]) -> Any:
    return decode_entry("run-1", b"5-1", entry(event_type, {"t": 7, **payload})).body


DOCS = Path(__file__).resolve().parents[2] / "docs" / "events.md"


def test_docs_show_the_schema_table() -> None:
    """docs/events.md's "Types" table is `python -m app.events --markdown`."""
    text = DOCS.read_text()
    section = text[text.index("\n## Types\n") :]
    lines = section.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    assert "\n".join(lines[start:end]) + "\n" == markdown_table()


@pytest.mark.parametrize("lua", [True, False])
def test_encoder_and_decoder_agree_on_every_type(lua: bool) -> None:
    # A seed whose workload has them all.
    sim = RunSim("run-1", seed=12, group_size=2, lua=lua, rewinds=True, generators=3, beta=0.1)
    sim.workload(25, close=True)
    assert {t for t, _ in sim.events} == EVENT_TYPES
    for i, (event_type, payload) in enumerate(sim.events):
        event = decode_entry("run-1", f"{i + 1}-0", entry(event_type, payload))
        again = decode_entry(
            "run-1", f"{i + 1}-0", encode_entry(event_type, event.body, t_ms=event.t_ms)
        )
        assert again == event


def test_encoder_writes_what_lua_writes() -> None:
    """No nil anywhere: an unmeasured kl drops off its item, an empty stats map is left out."""
    body = Acked(
        batch_id="b",
        step=None,
        policy_version=3,
        items=(AckedItem("r1", 3, 10, None), AckedItem("r2", 2, 5, 0.123456789)),
        stats=AckStats(),
        sums=AckSums(kl_tokens=5, kl_sum=1.25),
    )
    assert encode_payload("acked", body) == {
        "batch_id": "b",
        "policy_version": 3,
        "items": [["r1", 3, 10], ["r2", 2, 5, 0.123456789]],
        "sums": {"kl_tokens": 5, "kl_sum": 1.25, "ratio_tokens": 0, "ratio_sum": 0.0, "clipped": 0},
    }
    accepted = Accepted((AcceptedItem("r", "u", 0, 3, True),))
    assert encode_payload("accepted", accepted, t_ms=9) == {"items": [["r", "u", 0, 3, 1]], "t": 9}
    with pytest.raises(TypeError):
        encode_payload("nacked", body)


def test_stream_id_order_and_next() -> None:
    assert StreamId.parse(b"10-2") < StreamId.parse("10-10") < StreamId.parse("11-0")
    assert StreamId.parse("3-4").next() == StreamId(3, 5)
    assert str(StreamId(1, 0)) == "1-0"
    with pytest.raises(EventError):
        StreamId.parse("12")


def test_decodes_what_lua_encoders_write() -> None:
    acked = _decode(
        "acked",
        {
            "batch_id": "b1",
            "policy_version": 4,
            # trailing nil dropped; whole float 0.0 written as integer 0
            "items": [["r1", 3, 10], ["r2", 4, 5, 0]],
            "stats": {"kl_max": 0},
            "sums": {"kl_tokens": 5, "kl_sum": 0},
        },
    )
    assert isinstance(acked, Acked)
    assert [i.kl for i in acked.items] == [None, 0.0]
    assert acked.step is None and acked.stats.kl_mean is None and acked.sums.ratio_tokens == 0

    # Explicit nils, as another msgpack writer may send them.
    explicit = _decode(
        "acked",
        {"batch_id": "b1", "step": None, "policy_version": 4, "items": [["r1", 3, 10, None]],
         "stats": {"kl_mean": None}},
    )  # fmt: skip
    assert isinstance(explicit, Acked) and explicit.items[0].kl is None and explicit.step is None

    # An array with a hole becomes a map keyed 1..n.
    leased = _decode(
        "leased",
        {
            "batch_id": "b1",
            "policy_version": 2,
            "expires_at": 99,
            "items": {1: ["r1", 1, 10, 1, 0], 2: ["r2", 2, 3, 0, 1]},
        },
    )
    assert isinstance(leased, Leased)
    assert leased.trainer_id is None and [i.lag for i in leased.items] == [1, 0]

    # Strings sent as msgpack bin.
    raw = {b"e": b"accepted", b"d": msgpack.packb({"t": 1, "items": [[b"r", b"u", 0, 3, True]]})}
    accepted = decode_entry("run-1", b"1-0", raw).body
    assert isinstance(accepted, Accepted) and accepted.items[0].rollout_id == "r"

    retired = _decode("retired", {"reason": "kl", "items": []})
    assert isinstance(retired, Retired) and retired.items == ()

    run = _decode(
        "run",
        {"run_id": "run-1", "change": "created", "config": {"kl_max": 0.05}, "policy_version": 0,
         "status": "open", "created_at": 5},
    )  # fmt: skip
    assert isinstance(run, RunChanged) and run.config == {"kl_max": 0.05}


@pytest.mark.parametrize(
    ("event_type", "payload"),
    [
        ("accepted", {"items": [["r", "u", 0, True, 1]]}),  # bool is not a token count
        ("accepted", {"items": [["r", "u", 0, -1, 1]]}),  # negative tokens
        ("accepted", {"items": [["r", "u", 2**63, 1, 1]]}),  # beyond int64
        ("accepted", {"items": [["r", "u", 0, 1, 2]]}),  # new_unit must be 0/1
        ("accepted", {"items": [["r\x00", "u", 0, 1, 1]]}),  # NUL cannot be stored
        ("accepted", {"items": "r"}),
        ("retired", {"reason": "kl", "items": [["r", 0, 1]]}),  # uses missing
        ("acked", {"batch_id": "b", "policy_version": 0, "items": [["r", 0, 1, float("inf")]]}),
        ("acked", {"batch_id": "b", "policy_version": 0, "items": [], "stats": [1]}),
        ("leased", {"batch_id": 5, "policy_version": 0, "expires_at": 1, "items": []}),
        ("duplicate", {"n": "3"}),
        ("run", {"run_id": "other", "change": "created", "config": {}, "policy_version": 0,
                 "status": "open", "created_at": 1}),
        ("run", {"run_id": "run-1", "change": "created", "config": {"x": float("nan")},
                 "policy_version": 0, "status": "open", "created_at": 1}),
        ("nope", {}),
    ],
)  # fmt: skip
def test_rejects_malformed_payloads(event_type: str, payload: dict[str, Any]) -> None:
    with pytest.raises(EventError):
        _decode(event_type, payload)


def test_rejects_malformed_entries() -> None:
    for fields in (
        {b"e": b"accepted"},
        {b"d": pack({"t": 1})},
        {b"e": b"accepted", b"d": b"\x93\x01"},  # truncated msgpack
        {b"e": b"accepted", b"d": pack({"items": []})},  # no t
        {b"e": b"accepted", b"d": msgpack.packb([1, 2])},
        {b"e": b"\xff", b"d": pack({"t": 1})},
    ):
        with pytest.raises(EventError):
            decode_entry("run-1", b"1-0", fields)


async def _rows(sm: async_sessionmaker[AsyncSession], run_id: str) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    async with sm() as s:
        for model in (
            Run,
            RunTotals,
            VersionTotals,
            TrainingTotals,
            ReasonTotals,
            LagCount,
            Batch,
            PromptPass,
            GeneratorTotals,
        ):
            rows = (await s.scalars(select(model).where(model.run_id == run_id))).all()
            out[model.__tablename__] = sorted(
                (
                    tuple(
                        round(v, 9) if isinstance(v, float) else v
                        for k, v in fields_of(r).items()
                        if k != "run_id"
                    )
                    for r in rows
                ),
                key=repr,
            )
    return out


async def test_batches_applied_in_any_order_give_the_same_tables(
    sessionmaker: async_sessionmaker[AsyncSession],
) -> None:
    """A claimed batch may land after later ones; the result must not change."""
    tag = random.Random().getrandbits(32)
    in_order, shuffled = f"in-order-{tag}", f"shuffled-{tag}"

    def events_of(run_id: str) -> list[Any]:
        # Same seed: the same workload.
        sim = RunSim(run_id, seed=9, group_size=2, rewinds=True, generators=3, beta=0.1)
        sim.workload(30)
        return [
            decode_entry(run_id, f"{1000 + i}-0", entry(t, p))
            for i, (t, p) in enumerate(sim.events)
        ]

    async with sessionmaker() as s, s.begin():
        await repository.apply_events(s, in_order, events_of(in_order))

    events = events_of(shuffled)
    chunks = [events[i : i + 7] for i in range(0, len(events), 7)]
    random.Random(2).shuffle(chunks)
    for chunk in chunks:
        async with sessionmaker() as s, s.begin():
            await repository.apply_events(s, shuffled, chunk)

    a, b = await _rows(sessionmaker, in_order), await _rows(sessionmaker, shuffled)
    assert a["runs"] and a["batches"] and a["reason_totals"] and a["prompt_passes"]
    assert a["generator_totals"]
    assert any(e.type == "rewound" and e.body.batches for e in events)
    assert a == b
