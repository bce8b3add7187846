"""The asyncio client against the app in-process (httpx.ASGITransport) on real Redis."""

from __future__ import annotations

import time

import httpx
import msgpack
import numpy as np
import pytest
from rollout_broker_client import (
    AsyncBrokerClient,
    BatchSettled,
    BrokerUnreachable,
    Conflict,
    OverCapacity,
    Retry,
    Rollout,
    RunConflict,
    RunNotFound,
    ValidationFailed,
    VersionConflict,
)

from tests.client.recorder import Recorder


def group(name: str, k: int, version: int = 0, tokens: int = 5) -> list[Rollout]:
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    return [
        Rollout(
            rollout_id=f"{name}-{i}",
            group_id=name,
            policy_version=version,
            prompt_ids=np.array([7, 8, 9], dtype=np.int64),
            response_ids=rng.integers(0, 150_000, size=tokens),  # wider than 16 bits
            logprobs=-rng.random(tokens).astype(np.float32) - 0.01,
            reward=float(i),
            finish_reason="stop",
            metadata={"i": i},
        )
        for i in range(k)
    ]


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
async def test_round_trip_keeps_arrays_exact(api: httpx.AsyncClient, fmt: str) -> None:
    broker = AsyncBrokerClient(http=api, format=fmt)  # type: ignore[arg-type]
    run = await broker.create_run("rt", {"group_size": 3, "max_reuse": 2})
    assert run.config["group_size"] == 3
    sent = group("a", 3) + group("b", 3)
    async with broker.writer("rt", batch_size=100) as w:
        await w.add(*sent[:3])
        await w.add(*sent[3:])
        assert w.pending == 6  # nothing sent before the block ends
    assert (w.accepted, w.duplicates, w.requests, w.rejected) == (6, 0, 1, [])

    async with broker.lease("rt", size=6) as batch:
        assert batch
        by_id = {r.rollout_id: r for r in batch}
        for s in sent:
            got = by_id[s.rollout_id]
            assert got.response_ids.dtype == np.int32
            assert got.logprobs is not None and got.logprobs.dtype == np.float32
            np.testing.assert_array_equal(got.response_ids, np.asarray(s.response_ids))
            np.testing.assert_array_equal(got.logprobs, np.asarray(s.logprobs))
            np.testing.assert_array_equal(got.prompt_ids, [7, 8, 9])
            assert (got.group_id, got.reward, got.uses, got.lag) == (s.group_id, s.reward, 0, 0)
            assert got.metadata == s.metadata
        assert sorted(batch.groups()) == ["a", "b"]
        new = {r.rollout_id: r.logprobs - np.float32(0.25) for r in batch if r.logprobs is not None}
        batch.ack_with(new, step=3)
    assert batch.ack_result is not None
    # k3 of a constant log-ratio -0.25 on every token: exp(-0.25) - 1 + 0.25.
    expected_kl = np.exp(-0.25) - 1 + 0.25
    assert batch.ack_result.consumed == 6
    assert batch.ack_result.stats.kl_mean == pytest.approx(expected_kl, rel=1e-4)
    assert batch.ack_result.stats.is_ratio_mean == pytest.approx(np.exp(-0.25), rel=1e-5)

    again = await broker.lease_batch("rt", 6)
    assert again is not None
    assert {r.uses for r in again} == {1}
    assert {r.lag for r in again} == {0}
    await broker.nack("rt", again.batch_id)


async def test_binary_arrays_on_the_wire(wired: AsyncBrokerClient, recorder: Recorder) -> None:
    await wired.create_run("wire")
    sent = Rollout("x", 0, np.array([1, 70_000, 3]), 1.0, np.array([-0.5, -1.5, -2.5]))
    await wired.post_rollouts("wire", [sent])
    req, body, _ = recorder.exchanges[-1]
    assert req.headers["content-type"] == "application/msgpack"
    doc = msgpack.unpackb(body, raw=False)["rollouts"][0]
    assert doc["response_ids"] == np.array([1, 70_000, 3], dtype="<i4").tobytes()
    assert doc["logprobs"] == np.array([-0.5, -1.5, -2.5], dtype="<f4").tobytes()

    batch = await wired.lease_batch("wire", 1)
    req, _, resp = recorder.exchanges[-1]
    assert "application/msgpack" in req.headers["accept"]
    assert resp.headers["content-type"] == "application/msgpack"
    assert isinstance(msgpack.unpackb(resp.content)["rollouts"][0]["response_ids"], bytes)
    assert batch is not None
    np.testing.assert_array_equal(batch.rollouts[0].response_ids, [1, 70_000, 3])

    await wired.ack("wire", batch.batch_id, logprobs={"x": [-0.5, -1.5, -2.5]})
    req, body, resp = recorder.exchanges[-1]
    assert resp.status_code == 200
    assert (
        msgpack.unpackb(body)["logprobs"]["x"]
        == np.array([-0.5, -1.5, -2.5], dtype="<f4").tobytes()
    )


async def test_lease_nacks_when_the_block_raises(broker: AsyncBrokerClient) -> None:
    await broker.create_run("nack", {"max_reuse": 1})
    await broker.post_rollouts("nack", group("n", 2))
    with pytest.raises(ZeroDivisionError):
        async with broker.lease("nack", size=2) as batch:
            assert batch
            leased_id = batch.batch_id
            1 / 0  # noqa: B018
    back = await broker.lease_batch("nack", 2)
    assert back is not None and back.batch_id != leased_id
    assert {r.uses for r in back} == {0}  # returned unused
    with pytest.raises(BatchSettled) as err:  # the nacked batch cannot be acked any more
        await broker.ack("nack", leased_id)
    assert err.value.status == 409 and "nacked" in err.value.detail


async def test_nothing_to_lease_is_an_empty_batch(
    wired: AsyncBrokerClient, recorder: Recorder
) -> None:
    await wired.create_run("empty")
    async with wired.lease("empty", size=4, wait_s=0) as batch:
        assert len(batch) == 0 and not batch and list(batch) == [] and batch.batch_id == ""
        batch.ack_with([r.logprobs for r in batch], step=1)  # harmless
        measured = await batch.measure({})
        assert measured.weights == {} and measured.stats.kl_mean is None
    assert batch.ack_result is None
    with pytest.raises(ZeroDivisionError):
        async with wired.lease("empty", size=4) as batch:
            1 / 0  # noqa: B018
    sent = [f"{q.method} {q.url.path}" for q, _, _ in recorder.exchanges]
    assert sent == ["POST /v1/runs", "GET /v1/runs/empty/batch", "GET /v1/runs/empty/batch"]
    assert await wired.lease_batch("empty", 4, wait_s=0.0) is None  # the request alone: None


async def test_errors_are_named_and_carry_detail(broker: AsyncBrokerClient) -> None:
    with pytest.raises(RunNotFound) as nf:
        await broker.get_run("nope")
    assert (nf.value.status, nf.value.error) == (404, "RunNotFound")
    assert "nope" in nf.value.detail

    await broker.create_run("e1", {"max_reuse": 1})
    assert (await broker.create_run("e1", {"max_reuse": 1})).run_id == "e1"  # idempotent
    with pytest.raises(RunConflict):
        await broker.create_run("e1", {"max_reuse": 3})

    await broker.set_policy("e1", 2)
    with pytest.raises(VersionConflict) as vc:
        await broker.set_policy("e1", 1)
    assert vc.value.error == "VersionConflict" and "below" in vc.value.detail

    bad = Rollout("bad", 0, [], 1.0)  # an empty response
    with pytest.raises(ValidationFailed) as vf:
        await broker.post_rollouts("e1", [bad])
    assert vf.value.status == 422 and "response_ids is empty" in vf.value.detail

    with pytest.raises(ValueError, match="between 0 and"):
        await broker.post_rollouts("e1", [Rollout("neg", 0, [-1], 1.0)])


async def test_writer_records_rejections_and_duplicates(broker: AsyncBrokerClient) -> None:
    await broker.create_run("rej", {"max_staleness": 1})
    await broker.set_policy("rej", 3)
    async with broker.writer("rej", batch_size=3) as w:
        await w.add(Rollout("old", 1, [1], 0.0), Rollout("new", 3, [1], 0.0))
        await w.add(Rollout("future", 9, [1], 0.0))  # the third: a request goes out
        assert w.pending == 0
        await w.add(Rollout("new", 3, [1], 0.0))
    assert (w.accepted, w.duplicates, w.requests) == (1, 1, 2)
    assert sorted((r.rollout_id, r.reason) for r in w.rejected) == [
        ("future", "future_version"),
        ("old", "stale"),
    ]


async def test_writer_waits_out_backpressure(
    wired: AsyncBrokerClient, recorder: Recorder, api: httpx.AsyncClient
) -> None:
    await wired.create_run("bp", {"capacity_rollouts": 2, "max_reuse": 1})
    trainer = AsyncBrokerClient(http=api)
    freed: list[int] = []

    async def train_one_batch() -> None:  # runs right after the broker answered 429
        async with trainer.lease("bp", size=2) as batch:
            assert batch
            freed.append(len(batch))

    recorder.on_429 = train_one_batch
    w = wired.writer("bp", batch_size=2)
    await w.add(*[Rollout(f"a{i}", 0, [1, 2], 1.0) for i in range(2)])
    t0 = time.monotonic()
    await w.add(*[Rollout(f"b{i}", 0, [1, 2], 1.0) for i in range(2)])
    waited = time.monotonic() - t0
    statuses = [r.status_code for q, _, r in recorder.exchanges if q.url.path.endswith("/rollouts")]
    assert statuses == [202, 429, 202]
    assert freed == [2]
    assert (w.accepted, w.backpressure_waits) == (4, 1)
    assert waited >= 1.0  # the broker's Retry-After: 1

    stuck = wired.writer("bp", batch_size=10, max_backpressure_s=0)
    await stuck.add(*[Rollout(f"c{i}", 0, [1], 1.0) for i in range(3)])
    with pytest.raises(OverCapacity) as oc:
        await stuck.flush()
    assert oc.value.retry_after_s == 1.0 and oc.value.status == 429
    assert stuck.pending == 3  # kept for a later flush


async def test_lost_answers_are_retried_only_when_safe(
    wired: AsyncBrokerClient, recorder: Recorder
) -> None:
    await wired.create_run("retry", {"max_reuse": 1})
    # The first ingest reaches the broker but its answer is lost: resending is a duplicate.
    recorder.lose_answer.add("POST /rollouts")
    async with wired.writer("retry") as w:
        await w.add(*group("r", 3))
    posts = [r for r, _, _ in recorder.exchanges if r.url.path.endswith("/rollouts")]
    assert len(posts) == 2
    assert (w.accepted, w.duplicates) == (0, 3)

    # A lease whose answer is lost is resent with the same batch_id and gets the same batch,
    # instead of holding a second set of rollouts until it expires.
    recorder.lose_answer.add("GET /batch")
    batch = await wired.lease_batch("retry", 3)
    assert batch is not None and len(batch.rollouts) == 3
    leases = [r for r, _, _ in recorder.exchanges if r.url.path.endswith("/batch")]
    assert len(leases) == 2
    assert leases[0].url.params["batch_id"] == leases[1].url.params["batch_id"] == batch.batch_id
    assert await wired.lease_batch("retry", 3, partial=True) is None  # nothing was leased twice
    await wired.ack("retry", batch.batch_id)

    # An ack is idempotent: a lost answer is resent and gets the same answer.
    await wired.create_run("retry2", {"max_reuse": 1})
    await wired.post_rollouts("retry2", group("s", 2))
    leased = await wired.lease_batch("retry2", 2)
    assert leased is not None
    recorder.lose_answer.add("POST /ack")
    result = await wired.ack("retry2", leased.batch_id, kl={"s-0": 0.0, "s-1": 0.0})
    assert result.consumed == 2
    acks = [r for r, _, _ in recorder.exchanges if r.url.path.endswith(f"{leased.batch_id}/ack")]
    assert len(acks) == 2


async def test_unreachable_broker() -> None:
    broker = AsyncBrokerClient("http://127.0.0.1:9", retry=Retry(retries=1, backoff_s=0.001))
    with pytest.raises(BrokerUnreachable, match="ConnectError"):
        await broker.get_run("x")
    assert not await broker.healthz()
    await broker.close()


async def test_patch_close_and_list(broker: AsyncBrokerClient) -> None:
    await broker.create_run("p1")
    run = await broker.patch_config("p1", max_reuse=4, order="fifo")
    assert (run.config["max_reuse"], run.config["order"]) == (4, "fifo")
    await broker.post_rollouts("p1", [Rollout("z", 0, [1], 0.0)])
    closed = await broker.close_run("p1")
    assert closed.status == "closed"
    assert "p1" in [r.run_id for r in await broker.list_runs()]
    assert await broker.healthz()


async def test_list_runs_reads_every_page_and_delete_needs_a_closed_run(
    broker: AsyncBrokerClient,
) -> None:
    for rid in ("l1", "l2", "l3"):
        await broker.create_run(rid)
    await broker.close_run("l2")
    page, cursor = await broker.send(broker.api.list_runs(limit=2))
    assert len(page) == 2 and cursor is not None
    assert sorted(r.run_id for r in await broker.list_runs()) == ["l1", "l2", "l3"]
    assert [r.run_id for r in await broker.list_runs("closed")] == ["l2"]
    with pytest.raises(Conflict):
        await broker.delete_run("l1")  # open
