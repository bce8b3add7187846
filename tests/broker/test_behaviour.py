"""Behaviour logprobs kept from the lease until the ack: bounded, and never a different answer
from reading them back out of Redis."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from redis.asyncio import Redis

from app.broker.behaviour import BatchRow, BehaviourCache
from app.broker.config import RunConfig
from app.broker.schemas import AckBody, RolloutJSON
from app.broker.service import Broker
from app.broker.store import RedisStore
from app.broker.tokens import hand_out
from app.errors import LeaseExpired
from app.settings import Settings
from tests.broker.test_store import events
from tests.helpers import OPS
from workers.runner import broker_for


def rows(n: int, tokens: int = 10) -> list[BatchRow]:
    old = np.full(tokens, -1.0, dtype=np.float32)  # tokens * 4 bytes
    return [
        BatchRow(f"x{i}", 0, tokens, old, hand_out(None, None, 0, tokens, 0, None))
        for i in range(n)
    ]


def test_the_cache_keeps_to_its_byte_budget_dropping_the_oldest() -> None:
    one = 128 + 40  # a row of 10 tokens: its fixed cost and its logprobs
    cache = BehaviourCache(max_bytes=5 * one)
    cache.put("r", "b1", rows(2))
    cache.put("r", "b2", rows(2))
    assert cache.nbytes == 4 * one
    cache.put("r", "b3", rows(1))
    assert cache.nbytes == 5 * one  # at the budget: nothing dropped yet
    cache.put("r", "b4", rows(1))  # over it: b1, the oldest, goes
    assert cache.get("r", "b1") is None
    assert [r.rollout_id for r in cache.get("r", "b2") or []] == ["x0", "x1"]
    assert cache.nbytes == 4 * one
    cache.put("r", "big", rows(6))  # larger than the budget: not kept, nothing dropped
    assert cache.get("r", "big") is None and cache.nbytes == 4 * one
    cache.put("r", "b2", rows(1))  # a new lease under the same id replaces the old one
    assert cache.nbytes == 3 * one
    cache.pop("r", "b2")
    cache.pop("r", "b2")  # idempotent
    assert cache.nbytes == 2 * one and cache.get("other-run", "b3") is None


def rollouts(n: int) -> list[RolloutJSON]:
    rng = np.random.default_rng(n)
    return [
        RolloutJSON(
            rollout_id=f"x{i}",
            policy_version=0,
            response_ids=list(range(1, 9)),
            logprobs=(-rng.random(8)).tolist(),
            reward=1.0,
        )
        for i in range(n)
    ]


def current(batch) -> AckBody:  # type: ignore[no-untyped-def]
    return AckBody(
        logprobs={
            r.rollout_id: (r.logprobs.astype(np.float64) - 0.05).tolist()
            for r, *_ in batch.rollouts
        }
    )


@pytest.fixture
def brokers(redis: Redis, prefix: str) -> tuple[Broker, Broker]:
    settings = Settings(redis_url="redis://unused", redis_prefix=prefix, database_url=None)
    return broker_for(redis, settings), broker_for(redis, settings)


async def test_an_ack_on_another_replica_measures_the_same(
    brokers: tuple[Broker, Broker], monkeypatch: pytest.MonkeyPatch
) -> None:
    leaser, other = brokers
    await leaser.create_run("r", None, OPS)
    await leaser.ingest_packed("r", leaser.pack(rollouts(8)))
    asked: list[bool] = []
    real = RedisStore.batch_view

    async def spy(self: RedisStore, run_id: str, batch_id: str, *, rollouts: str, **kw):  # type: ignore[no-untyped-def]
        asked.append(rollouts)
        return await real(self, run_id, batch_id, rollouts=rollouts, **kw)

    monkeypatch.setattr(RedisStore, "batch_view", spy)

    a = await leaser.lease(
        "r", size=4, policy_version=None, wait_s=0, partial=False, trainer_id=None
    )
    b = await leaser.lease(
        "r", size=4, policy_version=None, wait_s=0, partial=False, trainer_id=None
    )
    assert a is not None and b is not None
    # Each answer against the SPEC's figures: new - old is -0.05 on every token.
    same = await leaser.training.ack("r", a.batch_id, current(a))  # kept from its lease
    assert asked == ["none"]
    other_answer = await other.training.ack("r", b.batch_id, current(b))  # read back from Redis
    assert asked == ["none", "blobs"]
    for batch, answer in ((a, same), (b, other_answer)):
        # The ack's lists are float64; the behaviour logprobs were stored as float32.
        log_r = np.concatenate([np.full(8, -0.05) for _ in batch.rollouts])
        k3 = np.expm1(log_r) - log_r
        assert answer.stats.kl_mean == pytest.approx(k3.mean(), rel=1e-9)
        assert answer.stats.is_ratio_mean == pytest.approx(np.exp(log_r).mean(), rel=1e-9)
    # An ack with ready-made KL elsewhere reads the blobs too: they say which tokens trained.
    await leaser.ingest_packed("r", leaser.pack(rollouts(12)[8:]))
    c = await leaser.lease(
        "r", size=4, policy_version=None, wait_s=0, partial=False, trainer_id=None
    )
    assert c is not None
    kl = {r.rollout_id: 0.01 for r, *_ in c.rollouts}
    assert (
        await other.training.ack("r", c.batch_id, AckBody(kl=kl))
    ).stats.kl_mean == pytest.approx(0.01)
    assert asked == ["none", "blobs", "blobs"]
    leaser.behaviour.pop("r", c.batch_id)
    # The acked batch is let go; the one acked elsewhere waits for the byte budget to drop it.
    assert leaser.behaviour.get("r", a.batch_id) is None
    assert leaser.behaviour.nbytes == 4 * (128 + 8 * 4)


async def test_nack_and_settled_acks_let_the_batch_go(brokers: tuple[Broker, Broker]) -> None:
    broker, _ = brokers
    await broker.create_run("r", None, OPS)
    await broker.ingest_packed("r", broker.pack(rollouts(2)))
    got = await broker.lease(
        "r", size=2, policy_version=None, wait_s=0, partial=False, trainer_id=None
    )
    assert got is not None and broker.behaviour.nbytes == 2 * (128 + 8 * 4)
    await broker.training.nack("r", got.batch_id)
    assert broker.behaviour.nbytes == 0


async def test_a_lease_that_runs_out_before_delivery_is_never_handed_out(
    brokers: tuple[Broker, Broker], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The packed rollouts are read right after the lease script. A lease that runs out in
    between and whose rollouts then retire (here: the run closes) loses them: the broker leases
    afresh when it chose the batch id, and tells a trainer that chose one to lease again; it
    never hands out a batch with holes."""
    broker, _ = brokers
    real = RedisStore.blobs

    async def closed_meanwhile(self: RedisStore, run_id: str, rollout_ids):  # type: ignore[no-untyped-def]
        await asyncio.sleep(0.05)  # the lease's own clock has to run out
        await self.close_run(run_id)  # its sweep expires the lease, the rollouts retire
        return await real(self, run_id, rollout_ids)

    monkeypatch.setattr(RedisStore, "blobs", closed_meanwhile)
    for run, batch_id in (("server-chosen", None), ("client-chosen", "my-batch-0001")):
        await broker.create_run(run, RunConfig(lease_timeout_s=0.01), OPS)
        await broker.ingest_packed(run, broker.pack(rollouts(2)))
        lease = broker.lease(
            run,
            size=2,
            policy_version=None,
            wait_s=0,
            partial=False,
            trainer_id=None,
            batch_id=batch_id,
        )
        if batch_id is None:
            assert await lease is None  # leased afresh: nothing left in the closed run
        else:
            with pytest.raises(LeaseExpired, match="lease again"):
                await lease
        kinds = [e for e, _ in await events(broker.store, run)]
        assert kinds.count("expired") == 1 and "retired" in kinds
