"""The ledger is checked against the broker's live counts, not against itself: an event the
ledger could not apply shows as ledger != live once nothing is pending, and the drain logs and
counts that mismatch (issue 10, item 2)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import httpx
import pytest
from accounting_helpers import drain_all, miscount_entries_read
from redis.asyncio import Redis
from rollout_broker_client._models import LiveCounts
from rollout_broker_client._wire import parse_accounting
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.accounting import drain as drain_module
from app.accounting import ledger, queries
from app.accounting.drain import DrainCounts
from app.accounting.stream import EventStream, LiveSnapshot
from app.events import EventError
from app.keys import CONSUMER_GROUP, run_key
from tests.helpers import ack, lease, live_of_ledger, make_run, post, rollout
from workers.drain import DrainContext, drain_once

RUN = "ledger"


async def _drain(ctx: DrainContext, **kw: Any) -> DrainCounts:
    """Passes until one reads nothing (that quiet pass checks the ledger); their counts."""
    total = DrainCounts()
    for _ in range(50):
        counts = await drain_once(ctx, **kw)
        total.add(counts)
        if counts.read == 0 and counts.missing == 0:
            return total
    raise AssertionError("still reading after 50 passes")


async def _workload(api: httpx.AsyncClient) -> None:
    """Rollouts in every state: retired, buffered, and leased (one lease left open)."""
    await make_run(api, RUN, max_reuse=1)
    assert (await post(api, RUN, *[rollout(f"r{i}", 0) for i in range(6)])).status_code == 202
    first = (await lease(api, RUN, 2)).json()
    assert (await ack(api, RUN, first["batch_id"])).status_code == 200  # both retire: max_reuse
    nacked = (await lease(api, RUN, 1)).json()
    assert (await api.post(f"/v1/runs/{RUN}/batches/{nacked['batch_id']}/nack")).status_code == 200
    assert (await lease(api, RUN, 2)).status_code == 200  # left open


def _refuse(monkeypatch: pytest.MonkeyPatch, event_type: bytes) -> None:
    """Make the drain unable to apply every entry of ``event_type``, as if it were malformed."""
    decode = drain_module.decode_entry

    def refusing(run_id: str, entry_id: bytes, fields: Any) -> Any:
        if fields.get(b"e") == event_type:
            raise EventError(f"refused by the test: {event_type.decode()}")
        return decode(run_id, entry_id, fields)

    monkeypatch.setattr(drain_module, "decode_entry", refusing)


async def test_the_ledger_agrees_with_the_live_counts(
    api: httpx.AsyncClient, make_ctx: Callable[..., DrainContext]
) -> None:
    await _workload(api)
    ctx = make_ctx()
    counts = await _drain(ctx)
    acc = (await api.get(f"/v1/runs/{RUN}/accounting")).json()

    assert acc["pending_events"] == 0 and acc["dead_letters"] == 0
    assert (acc["buffered"], acc["leased"], acc["retired"]) == (2, 2, {"max_reuse": 2})
    assert acc["live"] == {"buffered": 2, "leased": 2, "rewards": {"awaiting": 0, "leased": 0}}
    assert (counts.checked, counts.mismatched, ctx.drainer.mismatches) == (1, 0, 0)
    # Checked once per quiet period: the next quiet pass has nothing new to check.
    assert (await drain_once(ctx)).checked == 0
    # The client reads both, and tells a checked ledger from one that only adds up.
    parsed = parse_accounting(acc)
    assert (parsed.dead_letters, parsed.live) == (0, LiveCounts(buffered=2, leased=2))
    assert parsed.matches_live
    assert not replace(parsed, pending_events=1).matches_live


@pytest.mark.parametrize(
    ("refused", "ledger", "live"),
    [
        # (buffered, leased) of the ledger without the refused events, and of the broker:
        # 6 accepted, 5 leased in 3 leases, 2 of them acked (and retired), 1 nacked.
        (b"leased", (7, -3), (2, 2)),
        (b"acked", (0, 4), (2, 2)),
        (b"retired", (4, 2), (2, 2)),
        (b"accepted", (-4, 2), (2, 2)),
    ],
)
async def test_a_dead_letter_shows_as_ledger_against_live(
    api: httpx.AsyncClient,
    make_ctx: Callable[..., DrainContext],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    refused: bytes,
    ledger: tuple[int, int],
    live: tuple[int, int],
) -> None:
    await _workload(api)
    _refuse(monkeypatch, refused)
    ctx = make_ctx(max_deliveries=1)
    with caplog.at_level(logging.ERROR, logger="app.accounting.drain"):
        counts = await _drain(ctx)
    acc = (await api.get(f"/v1/runs/{RUN}/accounting")).json()

    assert acc["pending_events"] == 0 and acc["dead_letters"] > 0
    # The ledger's own sum still adds up: it cannot tell that anything is missing ...
    assert acc["rollouts_received"] == acc["buffered"] + acc["leased"] + sum(
        acc["retired"].values()
    )
    # ... the live counts can.
    assert (acc["buffered"], acc["leased"]) == ledger
    assert (acc["live"]["buffered"], acc["live"]["leased"]) == live
    assert (counts.checked, counts.mismatched, ctx.drainer.mismatches) == (1, 1, 1)
    parsed = parse_accounting(acc)
    assert parsed.unaccounted == 0 and not parsed.matches_live
    [line] = [r.getMessage() for r in caplog.records if "disagrees with the live" in r.message]
    assert f"run {RUN}" in line and f"{acc['dead_letters']} dead letters" in line


async def test_a_run_with_events_pending_is_checked_once_they_are_applied(
    api: httpx.AsyncClient, make_ctx: Callable[..., DrainContext], redis: Redis, prefix: str
) -> None:
    await _workload(api)
    ctx = make_ctx()
    await drain_all(ctx)
    # Another consumer holds an event, unacknowledged, while later ones are drained: the
    # ledger lags the live state, and that is no mismatch.
    assert (await post(api, RUN, rollout("held", 0))).status_code == 202
    assert await EventStream(redis, prefix).read_new([RUN], "elsewhere", 10, None)
    assert (await post(api, RUN, rollout("later", 0))).status_code == 202
    counts = await _drain(ctx, claim=False)
    assert counts.applied > 0 and (counts.checked, counts.mismatched) == (0, 0)
    acc = (await api.get(f"/v1/runs/{RUN}/accounting")).json()
    assert acc["pending_events"] == 1
    assert acc["live"] == {**live_of_ledger(acc), "buffered": acc["buffered"] + 1}

    # Once it is claimed and applied, the run is checked, and agrees.
    claimer = make_ctx(claim_idle_ms=0)
    counts = await _drain(claimer, claim=True)
    assert (counts.checked, counts.mismatched) == (1, 0)
    acc = (await api.get(f"/v1/runs/{RUN}/accounting")).json()
    assert acc["pending_events"] == 0
    assert (
        acc["live"]
        == live_of_ledger(acc)
        == {"buffered": 4, "leased": 2, "rewards": {"awaiting": 0, "leased": 0}}
    )


async def test_the_live_counts_and_the_ledger_describe_one_moment(
    api: httpx.AsyncClient,
    make_ctx: Callable[..., DrainContext],
    redis: Redis,
    prefix: str,
    sessionmaker: async_sessionmaker[AsyncSession],
) -> None:
    """Events posted and drained between the read of Redis and the read of Postgres would
    put the ledger ahead of ``live`` with nothing pending: a false mismatch. The answer reads
    both again instead."""
    await _workload(api)
    ctx = make_ctx()
    await drain_all(ctx)
    races = 0

    class PostedAndDrainedMeanwhile(EventStream):
        async def live_snapshot(self, run_id: str) -> LiveSnapshot:
            nonlocal races
            snapshot = await super().live_snapshot(run_id)
            if races < 2:  # twice in a row
                races += 1
                assert (await post(api, RUN, rollout(f"meanwhile-{races}", 0))).status_code == 202
                await drain_all(ctx)
            return snapshot

    stream = PostedAndDrainedMeanwhile(redis, prefix)
    async with sessionmaker() as session:
        acc = await queries.run_accounting(session, stream, RUN)
    assert races == 2
    assert acc.pending_events == 0 and acc.live is not None
    assert (acc.buffered, acc.leased) == (acc.live.buffered, acc.live.leased) == (4, 2)
    async with sessionmaker() as session:
        check = await ledger.check_ledger(session, stream, RUN)
    assert check.settled and not check.mismatch


async def test_runs_read_together_answer_as_each_read_alone(
    api: httpx.AsyncClient,
    make_ctx: Callable[..., DrainContext],
    redis: Redis,
    prefix: str,
    sessionmaker: async_sessionmaker[AsyncSession],
) -> None:
    """``checked_accounting_of`` (GET /metrics) against ``checked_accounting``, run by run:
    a drained run with reasons and lags, one whose ledger disagrees with live, one whose read
    raced the drain (read again on its own), one with an event pending, and one that does not
    exist."""
    await _workload(api)  # RUN: retired, buffered and leased, with lags
    for run_id in ("off", "other", "pending"):
        await make_run(api, run_id)
        assert (await post(api, run_id, rollout(f"{run_id}-0", 0))).status_code == 202
    ctx = make_ctx()
    await drain_all(ctx)
    await redis.hincrby(run_key(prefix, "off"), "live", 1)  # live no longer what the ledger says
    raced = False

    class PostedAndDrainedMeanwhile(EventStream):
        async def live_snapshot(self, run_id: str) -> LiveSnapshot:
            nonlocal raced
            snapshot = await super().live_snapshot(run_id)
            if run_id == "other" and not raced:  # its batched read is not of one moment
                raced = True
                assert (await post(api, "other", rollout("meanwhile", 0))).status_code == 202
                await drain_all(ctx)
                assert (await post(api, "pending", rollout("pending-1", 0))).status_code == 202
            return snapshot

    ids = [RUN, "off", "other", "pending", "missing"]
    stream = PostedAndDrainedMeanwhile(redis, prefix)
    async with sessionmaker() as session:
        together = await queries.checked_accounting_of(session, stream, ids)
    assert raced
    alone = {}
    for run_id in ids[:-1]:
        async with sessionmaker() as session:
            alone[run_id] = await queries.checked_accounting(session, stream, run_id)
    assert list(together) == ids[:-1]  # in order, the missing run left out
    for run_id in ids[:-1]:
        assert together[run_id].accounting == alone[run_id].accounting, run_id
        assert together[run_id].check == alone[run_id].check, run_id
    assert together[RUN].accounting.lag.histogram and together[RUN].accounting.retired
    assert together["off"].check.mismatch
    assert together["other"].check.settled and together["other"].accounting.rollouts_received == 2
    assert together["pending"].accounting.pending_events == 1


async def test_a_wrong_group_lag_neither_holds_back_nor_hides_a_mismatch(
    api: httpx.AsyncClient,
    make_ctx: Callable[..., DrainContext],
    redis: Redis,
    prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """After a failover onto a replica that joined by full sync, Redis 7.0 keeps the group's
    ``entries-read`` wrong for good, and with it ``XINFO GROUPS``'s ``lag`` (issue 31, finding
    3). ``XGROUP SETID ... ENTRIESREAD`` leaves the group in that state: everything drained,
    and a lag of 2 that reading more never clears."""
    await _workload(api)
    ctx = make_ctx()
    assert (await _drain(ctx)).checked == 1
    key = EventStream(redis, prefix).events_key(RUN)
    await miscount_entries_read(redis, key, CONSUMER_GROUP, 1)

    # More traffic, and a live count the ledger cannot know of: a real mismatch.
    assert (await post(api, RUN, rollout("after", 0))).status_code == 202
    await redis.hincrby(run_key(prefix, RUN), "live", 1)
    with caplog.at_level(logging.ERROR, logger="app.accounting.drain"):
        counts = await _drain(ctx)
    [group] = await redis.xinfo_groups(key)
    assert group["pending"] == 0 and group["lag"] > 0  # the lag is still wrong

    acc = (await api.get(f"/v1/runs/{RUN}/accounting")).json()
    assert acc["pending_events"] == 0
    assert acc["live"] == {**live_of_ledger(acc), "buffered": acc["buffered"] + 1}
    assert (counts.checked, counts.mismatched, ctx.drainer.mismatches) == (1, 1, 1)
    assert any("disagrees with the live" in r.getMessage() for r in caplog.records)
