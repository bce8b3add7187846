"""The blocking client over the network, against ``rollout-broker serve`` in a subprocess, and
in-process through SyncASGITransport."""

from __future__ import annotations

import math
import uuid

import httpx
import numpy as np
import pytest
from rollout_broker_client import (
    BrokerClient,
    BrokerUnreachable,
    LeaseExpired,
    Retry,
    Rollout,
    RunNotFound,
    SyncASGITransport,
    TrainingVersion,
    ValidationFailed,
)

from app.main import create_app
from app.settings import Settings
from tests.client.live import LiveServer


def rid() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


def groups(n: int, k: int, version: int = 0) -> list[list[Rollout]]:
    rng = np.random.default_rng(n * 100 + k)
    return [
        [
            Rollout(
                rollout_id=f"g{g}-{i}",
                group_id=f"g{g}",
                policy_version=version,
                prompt_ids=[g],
                response_ids=rng.integers(0, 50_000, size=4),
                logprobs=np.full(4, -1.0, dtype=np.float32),
                reward=float(rng.random()),
            )
            for i in range(k)
        ]
        for g in range(n)
    ]


@pytest.mark.slow
def test_generator_and_trainer_over_the_network(sync_broker: BrokerClient) -> None:
    run = rid()
    sync_broker.create_run(run, {"group_size": 4, "max_reuse": 2, "kl_max": 0.5})
    with sync_broker.writer(run, batch_size=8) as w:
        for g in groups(3, 4):
            w.add(*g)
    assert (w.accepted, w.requests) == (12, 2)

    with sync_broker.lease(run, size=8, wait_s=1.0, trainer_id="t0") as batch:
        assert batch
        grouped = batch.groups()
        assert len(grouped) == 2 and all(len(m) == 4 for m in grouped.values())  # whole groups
        batch.ack_with([np.full(4, -1.1, dtype=np.float32) for _ in batch], step=0)
    assert batch.ack_result is not None and batch.ack_result.consumed == 8
    assert batch.ack_result.stats.kl_max == pytest.approx(np.exp(-0.1) - 1 + 0.1, rel=1e-4)

    with pytest.raises(KeyError), sync_broker.lease(run, size=4) as failing:
        assert failing
        raise KeyError("the trainer crashed")
    left = sync_broker.lease_batch(run, size=12, partial=True)
    assert left is not None and len(left) == 12  # the nacked group went back
    assert sorted(r.uses for r in left) == [0] * 4 + [1] * 8
    sync_broker.nack(run, left.batch_id)


@pytest.mark.slow
def test_errors_over_the_network(sync_broker: BrokerClient) -> None:
    with pytest.raises(RunNotFound) as err:
        sync_broker.lease_batch("no-such-run", 1)
    assert err.value.status == 404 and err.value.error == "RunNotFound"

    run = rid()
    sync_broker.create_run(run, {"group_size": 2})
    with pytest.raises(ValidationFailed, match="multiple of this run's group_size"):
        sync_broker.lease_batch(run, 3)
    with pytest.raises(ValidationFailed, match="group_id"):
        sync_broker.post_rollouts(run, [Rollout("solo", 0, [1], 0.0)])
    assert sync_broker.healthz()


@pytest.mark.slow
def test_ack_after_expiry_is_lease_expired(sync_broker: BrokerClient) -> None:
    run = rid()
    sync_broker.create_run(run, {"lease_timeout_s": 0.05})
    sync_broker.post_rollouts(run, [Rollout("x", 0, [1, 2], 1.0)])
    batch = sync_broker.lease_batch(run, 1)
    assert batch is not None
    # The lease is over once the broker says so: lease again until the rollout is back.
    again = sync_broker.lease_batch(run, 1, wait_s=5.0)
    assert again is not None and again.rollouts[0].rollout_id == "x"
    with pytest.raises(LeaseExpired) as err:
        sync_broker.ack(run, batch.batch_id)
    assert err.value.status == 409


def test_unreachable() -> None:
    with BrokerClient("http://127.0.0.1:9", retry=Retry(retries=2, backoff_s=0.001)) as b:
        with pytest.raises(BrokerUnreachable):
            b.list_runs()
        assert not b.ready()


@pytest.mark.slow
def test_accounting_over_the_network(sync_broker: BrokerClient) -> None:
    run = rid()
    sync_broker.create_run(run, {"group_size": 2, "max_reuse": 1})
    sync_broker.post_rollouts(run, [r for g in groups(3, 2) for r in g])
    with sync_broker.lease(run, size=4) as batch:
        assert batch
    acc = sync_broker.wait_for_accounting(run, timeout_s=20)
    assert (acc.rollouts_received, acc.groups_received) == (6, 3)
    assert (acc.buffered, acc.leased, acc.samples_consumed) == (2, 0, 4)
    assert acc.retired == {"max_reuse": 4}
    assert acc.unaccounted == 0
    assert acc.batches.acked == 1 and acc.lag.histogram == {0: 4}


@pytest.mark.slow
def test_training_accounting_over_the_network(sync_broker: BrokerClient) -> None:
    run = rid()
    sync_broker.create_run(run, {"max_reuse": 1})
    old = [-1.0, -0.5, -0.25]  # exact in float32, and so are the shifted logprobs below
    sync_broker.post_rollouts(run, [Rollout(f"a{i}", 0, [1, 2, 3], 0.0, old) for i in range(2)])
    with sync_broker.lease(run, size=2) as batch:
        assert batch
        # The policy moved by 0.25 on every token of one rollout, not at all on the other's.
        batch.ack_with([[x + 0.25 for x in old], old])
    sync_broker.set_policy(run, 1)
    sync_broker.post_rollouts(run, [Rollout("b", 0, [1, 2], 0.0)])
    with sync_broker.lease(run, size=1) as batch:  # acked with nothing: counted, not measured
        assert batch
    sync_broker.wait_for_accounting(run, timeout_s=20)

    rows = sync_broker.accounting_training(run)
    assert all(isinstance(r, TrainingVersion) for r in rows)
    # By the trainer's version: the v0 rollout "b" counts under version 1, where it was leased.
    assert [(r.policy_version, r.batches, r.samples, r.tokens) for r in rows] == [
        (0, 1, 2, 6),
        (1, 1, 1, 2),
    ]
    kl = math.expm1(0.25) - 0.25  # k3 of every token of the moved rollout
    v0 = rows[0]
    assert v0.kl_mean == pytest.approx(kl / 2) and v0.kl_max == pytest.approx(kl)
    assert v0.is_ratio_mean == pytest.approx((math.exp(0.25) + 1) / 2)
    assert v0.clip_fraction == pytest.approx(0.5)  # e^0.25 - 1 > the default clip epsilon 0.2
    v1 = rows[1]
    assert (v1.kl_mean, v1.kl_max, v1.is_ratio_mean, v1.clip_fraction) == (None,) * 4
    assert v1.raw["policy_version"] == 1


def test_sync_client_in_process(settings: Settings) -> None:
    with (
        SyncASGITransport(create_app(settings)) as transport,
        httpx.Client(transport=transport, base_url="http://broker") as http,
    ):
        broker = BrokerClient(http=http)
        assert broker.base_url == "http://broker"
        broker.create_run("inproc")
        broker.post_rollouts("inproc", [Rollout("a", 0, np.array([5, 6]), 1.0, [-0.2, -0.3])])
        with broker.lease("inproc", size=1) as batch:
            assert batch
            np.testing.assert_array_equal(batch.rollouts[0].response_ids, [5, 6])
            batch.ack_with({"a": [-0.2, -0.3]})
        assert batch.ack_result is not None
        assert batch.ack_result.stats.kl_mean == pytest.approx(0.0, abs=1e-7)


def test_nothing_to_lease_is_an_empty_batch() -> None:
    sent: list[str] = []

    def broker(request: httpx.Request) -> httpx.Response:
        sent.append(f"{request.method} {request.url.path}")
        return httpx.Response(204)  # nothing qualified

    http = httpx.Client(transport=httpx.MockTransport(broker), base_url="http://broker")
    with BrokerClient(http=http) as client:
        with client.lease("r", size=4, wait_s=0) as batch:
            assert len(batch) == 0 and not batch and list(batch) == [] and batch.batch_id == ""
            batch.ack_with([r.logprobs for r in batch], step=1)  # harmless
            assert batch.measure([]).weights == {}
        assert batch.ack_result is None
        with pytest.raises(KeyError), client.lease("r", size=4) as batch:
            raise KeyError("the trainer failed")
        assert client.lease_batch("r", 4) is None  # the request alone: None
    assert sent == ["GET /v1/runs/r/batch"] * 3  # neither an ack nor a nack


@pytest.mark.slow
def test_live_server_is_real(live_server: LiveServer) -> None:
    assert live_server.proc.poll() is None
    assert "Uvicorn running" in live_server.output()
