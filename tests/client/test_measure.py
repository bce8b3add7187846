"""``batch.measure()`` of both clients: weights as float32 arrays in batch order, and the ack on
leaving the lease that then carries no logprobs uses the measured ones."""

from __future__ import annotations

from typing import Any

import httpx
import msgpack
import numpy as np
import pytest
from rollout_broker_client import (
    AsyncBrokerClient,
    BrokerClient,
    BrokerHTTPError,
    Measurement,
    Rollout,
    SyncASGITransport,
)
from rollout_broker_client._wire import Api, parse_measure

from app.main import create_app
from app.settings import Settings

OLD = {"a": [-0.5, -1.0, -0.25], "b": [-2.0, -0.5], "c": [-1.0, -1.0, -1.0, -1.0]}
NEW = {"a": [-0.25, -1.5, -0.25], "b": [-1.0, -0.5], "c": [-1.0, -0.75, -1.25, -1.0]}


def _rollouts() -> list[Rollout]:
    return [
        Rollout(rid, 0, np.arange(len(lp)) + 5, 1.0, lp, generator_id="g1")
        for rid, lp in OLD.items()
    ]


def _expected_token_weights(rid: str) -> np.ndarray[Any, Any]:
    """The SPEC's default correction (token level, truncate at 2)."""
    return np.minimum(np.exp(np.array(NEW[rid]) - np.array(OLD[rid])), 2.0).astype(np.float32)


def _check(m: Measurement, order: list[str]) -> None:
    assert list(m.weights) == order == list(m.sequence_weights)
    for rid in order:
        w = m.weights[rid]
        assert w.dtype == np.float32
        np.testing.assert_allclose(w, _expected_token_weights(rid), rtol=1e-6)
        assert m.sequence_weights[rid] == pytest.approx(float(w.mean()), rel=1e-6)
    assert m.stats.masked_fraction == 0.0
    assert m.stats.chi2 is not None and m.stats.kl_mean is not None
    assert m.kl_coef == 0.1


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
async def test_async_measure_then_an_ack_without_logprobs(api: httpx.AsyncClient, fmt) -> None:
    async with AsyncBrokerClient(http=api, format=fmt) as broker:
        await broker.create_run("m", {"kl_coef": 0.1, "kl_max": 10.0, "kl_flush": 10.0})
        await broker.post_rollouts("m", _rollouts())
        async with broker.lease("m", size=3) as batch:
            assert batch
            order = [r.rollout_id for r in batch]
            # A sequence in batch order, as ack_with takes it.
            m = await batch.measure([np.array(NEW[rid], np.float32) for rid in order])
            _check(m, order)
            again = await batch.measure({rid: NEW[rid] for rid in reversed(order)})
            assert list(again.weights) == order
        assert batch.ack_result is not None
        assert batch.ack_result.stats.kl_mean == pytest.approx(m.stats.kl_mean, rel=1e-12)
        assert batch.ack_result.stats.ess_fraction == pytest.approx(m.stats.ess_fraction, rel=1e-12)


async def test_a_measure_missing_a_rollout_is_refused(api: httpx.AsyncClient) -> None:
    async with AsyncBrokerClient(http=api) as broker:
        await broker.create_run("m")
        await broker.post_rollouts("m", _rollouts())
        async with broker.lease("m", size=3) as batch:
            assert batch
            with pytest.raises(BrokerHTTPError) as err:
                await batch.measure({"a": NEW["a"]})
            assert err.value.status == 422
            with pytest.raises(ValueError, match="batch order"):
                await batch.measure([NEW["a"]])
            batch.ack_with(NEW)


def test_sync_measure_in_process(settings: Settings) -> None:
    with (
        SyncASGITransport(create_app(settings)) as transport,
        httpx.Client(transport=transport, base_url="http://broker") as http,
    ):
        broker = BrokerClient(http=http)
        broker.create_run("m", {"kl_coef": 0.1, "kl_max": 10.0, "kl_flush": 10.0})
        broker.post_rollouts("m", _rollouts())
        with broker.lease("m", size=3) as batch:
            assert batch
            order = [r.rollout_id for r in batch]
            m = batch.measure({rid: NEW[rid] for rid in order})
            _check(m, order)
        assert batch.ack_result is not None
        assert batch.ack_result.stats.kl_mean == pytest.approx(m.stats.kl_mean, rel=1e-12)


def test_weights_come_in_batch_order_from_either_answer() -> None:
    """The answer's weights are put in the batch's order, whatever order the answer has: as
    float32 bytes (a msgpack answer, which the msgpack client asks for) or as lists."""
    order = ["a", "b"]
    stats = {"kl_mean": 0.1, "masked_fraction": 0.0, "chi2": 0.5}
    for weights in (
        {"b": np.float32([2.5]).tobytes(), "a": np.float32([1.5, 0.5]).tobytes()},
        {"b": [2.5], "a": [1.5, 0.5]},
    ):
        body = {"weights": weights, "sequence_weights": {"b": 2.5, "a": 1.0}, "stats": stats}
        m = parse_measure(body, order)
        assert list(m.weights) == list(m.sequence_weights) == order
        assert m.weights["a"].dtype == np.float32
        assert m.weights["a"].tolist() == [1.5, 0.5]
        assert m.stats.chi2 == 0.5 and m.stats.kl_max is None and m.kl_coef is None
    call = Api("msgpack", None, None).measure("r", "b", {"a": [-1.0]}, order)
    assert "application/msgpack" in call.headers["accept"]
    assert msgpack.unpackb(call.content)["logprobs"]["a"] == np.float32([-1.0]).tobytes()
