"""Consumers through the client (SPEC "Consumers"): creation, reads and deletion with their
errors, the loop that acks a batch when its body moves on and nacks it when the body raises,
batches in msgpack and JSON with their arrays exact, a lease resent under its batch_id, and the
parsing of preference pairs."""

from __future__ import annotations

import httpx
import msgpack
import numpy as np
import pytest
from rollout_broker_client import (
    AsyncBrokerClient,
    AsyncConsumerLease,
    BrokerClient,
    ConsumerBatch,
    ConsumerConflict,
    ConsumerInfo,
    ConsumerNotFound,
    Retry,
    Rollout,
    RunNotFound,
    SyncASGITransport,
    ValidationFailed,
)
from rollout_broker_client._wire import Api, parse_consumer_batch
from rollout_broker_client.protocol import JSON, MSGPACK

from app.main import create_app
from app.settings import Settings
from tests.client.recorder import Recorder


def scored(n: int, run_tokens: int = 4) -> list[Rollout]:
    """``n`` scored rollouts; the k-th has reward k and responses wider than 16 bits."""
    return [
        Rollout(
            f"r{k}",
            0,
            np.arange(run_tokens) + 70_000 + k,
            float(k),
            -np.linspace(0.5, 1.5, run_tokens, dtype=np.float32),
            prompt_ids=[1, 2, 3],
            loss_mask=[1, 0] + [1] * (run_tokens - 2),
            metadata={"k": k},
            finish_reason="stop",
        )
        for k in range(n)
    ]


async def counts(broker: AsyncBrokerClient, run: str, name: str = "rm") -> tuple[int, ...]:
    c = await broker.get_consumer(run, name)
    return c.delivered, c.acked, c.dropped, c.pending, c.leased


async def setup(broker: AsyncBrokerClient, run: str, n: int) -> None:
    await broker.create_run(run)
    await broker.create_consumer(run, "rm", source="received")
    assert (await broker.post_rollouts(run, scored(n))).accepted == n


# -- creation, reads, deletion -------------------------------------------------------------------


async def test_create_get_and_delete_with_their_errors(broker: AsyncBrokerClient) -> None:
    await broker.create_run("c")
    made = await broker.create_consumer("c", "rm", source="trained", max_lag=3)
    assert isinstance(made, ConsumerInfo) and made.created_at.tzinfo is not None
    assert (made.name, made.kind, made.source, made.max_lag) == ("rm", "rollouts", "trained", 3)
    assert (made.min_margin, made.pairs, made.retention_rollouts) == (None, None, 100_000)
    assert (made.delivered, made.acked, made.dropped, made.pending, made.leased) == (0,) * 5
    again = await broker.create_consumer("c", "rm", source="trained", max_lag=3)
    assert again == made  # the same config: the consumer as it is
    assert await broker.get_consumer("c", "rm") == made
    small = await broker.create_consumer("c", "small", source="received", retention_rollouts=5)
    assert (small.retention_rollouts, small.max_lag) == (5, None)
    with pytest.raises(ConsumerConflict) as conflict:
        await broker.create_consumer("c", "rm", source="received")
    assert conflict.value.status == 409
    with pytest.raises(RunNotFound):
        await broker.create_consumer("nope", "rm", source="received")
    with pytest.raises(ValidationFailed):  # min_margin is for kind preferences
        await broker.create_consumer("c", "bad", source="received", min_margin=0.5)
    with pytest.raises(ConsumerNotFound) as missing:
        await broker.get_consumer("c", "other")
    assert missing.value.status == 404
    await broker.delete_consumer("c", "rm")
    with pytest.raises(ConsumerNotFound):
        await broker.get_consumer("c", "rm")
    with pytest.raises(ConsumerNotFound):
        await broker.delete_consumer("c", "rm")
    with pytest.raises(ConsumerNotFound):
        await broker.consumer("c", "rm").lease_batch(1)


# -- the loop ------------------------------------------------------------------------------------


async def test_the_loop_acks_each_batch_when_its_body_moves_on(broker: AsyncBrokerClient) -> None:
    await setup(broker, "ok", 5)
    consumer = broker.consumer("ok", "rm")
    seen: list[str] = []
    batches: list[AsyncConsumerLease] = []
    async for batch in consumer.batches(2, wait_s=0, stop_when_empty=True):
        assert isinstance(batch, ConsumerBatch) and 1 <= len(batch) <= 2 and not batch.pairs
        assert (await counts(broker, "ok"))[4] == len(batch)  # leased while the body runs
        np.testing.assert_array_equal(
            batch.rewards(), [float(r.rollout_id[1:]) for r in batch.rollouts]
        )
        seen += [r.rollout_id for r in batch.rollouts]
        batches.append(batch)
        assert len(batches) <= 3, "items handed out again: a batch was not acked"
    assert sorted(seen) == [f"r{k}" for k in range(5)]
    assert [b.acked for b in batches] == [len(b) for b in batches]
    assert all(b.settled and b.returned is None for b in batches)
    assert await counts(broker, "ok") == (5, 5, 0, 0, 0)
    assert await consumer.lease_batch(5) is None  # every item acked: nothing comes back


async def test_a_body_that_raises_nacks_its_batch_and_the_items_come_back(
    broker: AsyncBrokerClient,
) -> None:
    await setup(broker, "crash", 3)
    consumer = broker.consumer("crash", "rm")
    with pytest.raises(KeyError, match="reward model crashed"):
        async with consumer.batches(2, wait_s=0, stop_when_empty=True) as batches:
            async for batch in batches:
                raise KeyError(f"reward model crashed on {len(batch)}")
    assert batch.settled and batch.returned == 2 and batch.acked is None
    assert await counts(broker, "crash") == (3, 0, 0, 3, 0)
    back = await consumer.lease_batch(3)
    assert back is not None
    assert {r.rollout_id for r in batch.rollouts} <= {r.rollout_id for r in back.rollouts}


async def test_a_break_acks_inside_the_block_and_nacks_without_it(
    broker: AsyncBrokerClient,
) -> None:
    await setup(broker, "brk", 4)
    consumer = broker.consumer("brk", "rm")
    async with consumer.batches(1, wait_s=0) as batches:
        async for kept in batches:
            assert len(kept) == 1
            break
    assert kept.acked == 1 and await counts(broker, "brk") == (4, 1, 0, 3, 0)
    async for dropped in consumer.batches(1, wait_s=0):
        assert dropped.returned is None
        break  # the loop cannot tell a break from an exception: the batch goes back
    info = await consumer.info()  # the client's next request: the batch is nacked first
    assert dropped.returned == 1 and (info.acked, info.pending, info.leased) == (1, 3, 0)


async def test_closing_the_client_nacks_the_batch_a_loop_holds(api: httpx.AsyncClient) -> None:
    client = AsyncBrokerClient(http=api)
    await setup(client, "close", 2)
    batch = await anext(client.consumer("close", "rm").batches(2, wait_s=0))
    await client.close()
    assert batch.returned == 2
    assert await counts(AsyncBrokerClient(http=api), "close") == (2, 0, 0, 2, 0)


async def test_hand_driven_lease_ack_and_nack(broker: AsyncBrokerClient) -> None:
    await setup(broker, "hand", 2)
    consumer = broker.consumer("hand", "rm")
    first = await consumer.lease_batch(1, batch_id="rm-batch-0001")
    assert first is not None and first.batch_id == "rm-batch-0001"
    assert await consumer.ack(first) == 1
    assert await consumer.ack("rm-batch-0001") == 1  # a repeat changes nothing
    second = await consumer.lease_batch(1)
    assert second is not None and second.batch_id != first.batch_id
    assert await consumer.nack(second.batch_id) == 1
    assert await counts(broker, "hand") == (2, 1, 0, 1, 0)


# -- the wire ------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
async def test_batches_keep_the_arrays_exact_in_either_format(recorder: Recorder, fmt: str) -> None:
    http = httpx.AsyncClient(transport=recorder, base_url="http://broker")
    async with AsyncBrokerClient(http=http, format=fmt) as broker:  # type: ignore[arg-type]
        await setup(broker, "fmt", 2)
        batch = await broker.consumer("fmt", "rm").lease_batch(2)
    await http.aclose()
    assert batch is not None
    [(_, _, resp)] = [x for x in recorder.exchanges if x[0].url.path.endswith("/rm/batch")]
    assert resp.headers["content-type"] == (MSGPACK if fmt == "msgpack" else JSON)
    sent = {r.rollout_id: r for r in scored(2)}
    for got in batch.rollouts:
        want = sent[got.rollout_id]
        assert got.response_ids.dtype == np.int32 and got.prompt_ids is not None
        assert got.logprobs is not None and got.logprobs.dtype == np.float32
        assert got.loss_mask is not None and got.loss_mask.dtype == np.uint8
        np.testing.assert_array_equal(got.response_ids, want.response_ids)
        np.testing.assert_array_equal(got.logprobs, want.logprobs)
        np.testing.assert_array_equal(got.prompt_ids, [1, 2, 3])
        np.testing.assert_array_equal(got.mask, [1, 0, 1, 1])
        assert (got.reward, got.metadata, got.finish_reason) == (want.reward, want.metadata, "stop")
        assert (got.policy_version, got.versions) == (0, ((0, 0),))


async def test_a_lost_lease_answer_is_resent_under_the_same_batch_id(
    recorder: Recorder,
) -> None:
    http = httpx.AsyncClient(transport=recorder, base_url="http://broker")
    async with AsyncBrokerClient(http=http, retry=Retry(retries=2, backoff_s=0.001)) as broker:
        await setup(broker, "lost", 3)
        recorder.lose_answer.add("GET /consumers/rm/batch")
        batch = await broker.consumer("lost", "rm").lease_batch(2)
        asked = [
            req.url.params["batch_id"]
            for req, _, _ in recorder.exchanges
            if req.url.path.endswith("/rm/batch")
        ]
        assert batch is not None and asked == [batch.batch_id, batch.batch_id]
        assert await counts(broker, "lost") == (3, 0, 0, 3, 2)  # one lease, not two
    await http.aclose()


def test_the_lease_request() -> None:
    call = Api("msgpack").consumer_lease("r/1", "rm", 8, wait_s=2.5, batch_id=None)
    assert (call.method, call.path) == ("GET", "/v1/runs/r%2F1/consumers/rm/batch")
    assert call.params is not None and call.params["size"] == "8"
    assert call.params["wait_s"] == "2.5" and len(call.params["batch_id"]) == 32
    assert call.headers["accept"].startswith(MSGPACK) and call.extra_timeout == 2.5
    other = Api("json").consumer_lease("r", "rm", 1, wait_s=0, batch_id="mine")
    assert other.params is not None and other.params["batch_id"] == "mine"
    assert "accept" not in other.headers
    fresh = Api().consumer_lease("r", "rm", 1, wait_s=0, batch_id=None).params
    assert fresh is not None and fresh["batch_id"] != call.params["batch_id"]  # one per lease


# -- preference pairs ----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
async def test_pairs_come_through_the_loop_nacked_and_acked(
    api: httpx.AsyncClient, fmt: str
) -> None:
    broker = AsyncBrokerClient(http=api, format=fmt)  # type: ignore[arg-type]
    await broker.create_run("dpo", {"group_size": 3})
    made = await broker.create_consumer(
        "dpo", "dpo", source="received", kind="preferences", pairs="all", min_margin=0.5
    )
    assert (made.kind, made.pairs, made.min_margin) == ("preferences", "all", 0.5)
    group = [Rollout(k, 0, [10, 70_000 + i], w, [-0.5, -1.0], group_id="g")
             for i, (k, w) in enumerate({"a": 1.0, "b": 0.75, "c": -0.5}.items())]  # fmt: skip
    await broker.post_rollouts("dpo", group)
    consumer = broker.consumer("dpo", "dpo")
    with pytest.raises(RuntimeError, match="diverged"):
        async with consumer.batches(10, wait_s=0) as batches:
            async for failed in batches:
                raise RuntimeError(f"loss diverged on {len(failed)} pairs")
    assert failed.returned == 2 and failed.rollouts == []
    async for batch in consumer.batches(10, wait_s=0, stop_when_empty=True):
        by = {(c.rollout_id, r.rollout_id): m for c, r, m in
              zip(batch.chosen(), batch.rejected(), batch.margins(), strict=True)}  # fmt: skip
        assert by == {("a", "c"): 1.5, ("b", "c"): 1.25}  # b-a is 0.25, under min_margin
        assert batch.margins().dtype == np.float64
        assert {p.pair_id for p in batch.pairs} == {p.pair_id for p in failed.pairs}
        chosen = batch.chosen()[0]
        assert chosen.response_ids.dtype == np.int32 and chosen.response_ids[1] >= 70_000
        assert chosen.logprobs is not None and chosen.logprobs.dtype == np.float32
    assert batch.acked == 2
    info = await consumer.info()
    assert (info.delivered, info.acked, info.pending, info.leased) == (2, 2, 0, 0)


# -- preference pairs (parsed from the wire shape) -----------------------------------------------


def _rollout(rid: str, reward: float, binary: bool) -> dict[str, object]:
    ids = np.array([5, 70_001, 7], dtype="<i4")
    lp = np.array([-0.25, -0.5, -1.0], dtype="<f4")
    mask = np.array([1, 1, 0], dtype="u1")
    return {
        "rollout_id": rid,
        "group_id": "g",
        "policy_version": 3,
        "prompt_ids": np.array([1, 2], "<i4").tobytes() if binary else [1, 2],
        "response_ids": ids.tobytes() if binary else ids.tolist(),
        "logprobs": lp.tobytes() if binary else lp.astype(float).tolist(),
        "loss_mask": mask.tobytes() if binary else mask.tolist(),
        "versions": [[0, 2], [1, 3]],
        "reward": reward,
        "generator_id": "gen-1",
        "finish_reason": "stop",
        "metadata": None,
    }


def pairs_answer(binary: bool) -> dict[str, object]:
    return {
        "batch_id": "b1",
        "lease_expires_at": "2026-12-06T10:00:00Z",
        "pairs": [
            {
                "pair_id": "g:0:1",
                "prompt_id": "p7",
                "chosen": _rollout("g-0", 1.0, binary),
                "rejected": _rollout("g-1", 0.25, binary),
                "margin": 0.75,
            },
            {
                "pair_id": "h:2:0",
                "chosen": _rollout("h-2", 2.0, binary),
                "rejected": _rollout("h-0", -1.0, binary),
                "margin": 3.0,
            },
        ],
    }


@pytest.mark.parametrize("binary", [True, False], ids=["msgpack", "json"])
def test_pairs_are_parsed_with_their_arrays_and_margins(binary: bool) -> None:
    body = pairs_answer(binary)
    if binary:
        body = msgpack.unpackb(msgpack.packb(body, use_bin_type=True), raw=False)
    batch = parse_consumer_batch(body)
    assert len(batch) == 2 and batch.rollouts == []
    first, second = batch.pairs
    assert (first.pair_id, first.prompt_id, first.margin) == ("g:0:1", "p7", 0.75)
    assert (second.pair_id, second.prompt_id) == ("h:2:0", None)
    margins = batch.margins()
    assert margins.dtype == np.float64 and margins.tolist() == [0.75, 3.0]
    assert [r.rollout_id for r in batch.chosen()] == ["g-0", "h-2"]
    assert [r.rollout_id for r in batch.rejected()] == ["g-1", "h-0"]
    assert [c.reward - r.reward for c, r in zip(batch.chosen(), batch.rejected(), strict=True)] == [
        0.75,
        3.0,
    ]
    chosen = first.chosen
    assert chosen.response_ids.dtype == np.int32 and chosen.response_ids.tolist() == [5, 70_001, 7]
    assert chosen.logprobs is not None and chosen.logprobs.dtype == np.float32
    assert chosen.logprobs.tolist() == [-0.25, -0.5, -1.0]
    assert chosen.mask.tolist() == [1, 1, 0] and chosen.mask.dtype == np.uint8
    assert chosen.prompt_ids is not None and chosen.prompt_ids.tolist() == [1, 2]
    assert (chosen.versions, chosen.generator_id, chosen.policy_version) == (
        ((0, 2), (1, 3)),
        "gen-1",
        3,
    )


def test_a_batch_of_rollouts_has_no_pairs_and_empty_margins() -> None:
    batch = parse_consumer_batch(
        {
            "batch_id": "b",
            "lease_expires_at": "2026-12-06T10:00:00Z",
            "rollouts": [_rollout("a", 0.5, False)],
        }
    )
    assert len(batch) == 1 and batch.pairs == [] and batch.chosen() == []
    assert batch.margins().dtype == np.float64 and batch.margins().size == 0
    assert batch.rewards().tolist() == [0.5]


# -- the blocking client -------------------------------------------------------------------------


def test_sync_consumers_create_loop_ack_and_nack(settings: Settings) -> None:
    with (
        SyncASGITransport(create_app(settings)) as transport,
        httpx.Client(transport=transport, base_url="http://broker") as http,
    ):
        broker = BrokerClient(http=http)
        broker.create_run("sync")
        made = broker.create_consumer("sync", "rm", source="received")
        assert made == broker.create_consumer("sync", "rm", source="received")
        with pytest.raises(ConsumerConflict):
            broker.create_consumer("sync", "rm", source="trained")
        broker.post_rollouts("sync", scored(3))
        consumer = broker.consumer("sync", "rm")
        with (
            pytest.raises(RuntimeError, match="trainer died"),
            consumer.batches(2, wait_s=0) as batches,
        ):
            for failed in batches:
                raise RuntimeError(f"trainer died on {failed.batch_id}")
        assert failed.returned == 2
        assert broker.get_consumer("sync", "rm").pending == 3
        done = [b for b in consumer.batches(2, wait_s=0, stop_when_empty=True)]
        assert sum(b.acked or 0 for b in done) == 3
        info = consumer.info()
        assert (info.delivered, info.acked, info.pending, info.leased) == (3, 3, 0, 0)
        broker.delete_consumer("sync", "rm")
        with pytest.raises(ConsumerNotFound):
            broker.get_consumer("sync", "rm")
