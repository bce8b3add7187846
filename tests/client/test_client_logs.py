"""What the client says in its log when all goes through but not as meant: an ack that leaves the
broker nothing to measure KL with (once per client), and rollouts the broker rejected one by one
(one line a request). Async against the app in-process, blocking against a stub broker."""

from __future__ import annotations

import json
import logging

import httpx
import numpy as np
import pytest
from rollout_broker_client import AsyncBrokerClient, BrokerClient, Rollout

LOGGER = "rollout_broker.client"
BARE = "carries no logprobs"


def rollouts(prefix: str, k: int, version: int = 0) -> list[Rollout]:
    return [Rollout(f"{prefix}{i}", version, [1, 2], 1.0, [-0.5, -0.25]) for i in range(k)]


def bare_acks(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if BARE in r.getMessage()]


def rejected_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()]


# -- an ack without figures ----------------------------------------------------------------------


async def test_an_ack_without_logprobs_warns_once_per_client(
    broker: AsyncBrokerClient, api: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    await broker.create_run("bare", {"max_reuse": 10})
    await broker.post_rollouts("bare", rollouts("b", 2))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(3):
            async with broker.lease("bare", size=2) as batch:
                assert batch  # left without ack_with: the ack carries nothing
            assert batch.ack_result is not None and batch.ack_result.stats.kl_mean is None
    (warning,) = bare_acks(caplog)  # three such acks, one line
    assert warning.levelno == logging.WARNING
    text = warning.getMessage()
    assert "bare" in text and "ack_with" in text and "neither KL nor importance ratios" in text

    caplog.clear()
    other = AsyncBrokerClient(http=api)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        async with other.lease("bare", size=2) as batch:
            batch.ack_with([r.logprobs for r in batch])
        async with other.lease("bare", size=2) as batch:
            batch.ack_with(kl=[0.0, 0.0])
        async with other.lease("bare", size=2) as batch:
            await batch.measure([r.logprobs for r in batch])  # the ack uses these
        assert batch.ack_result is not None and batch.ack_result.stats.kl_mean == 0.0
        assert not bare_acks(caplog)
        leased = await other.lease_batch("bare", 2)
        assert leased is not None
        await other.ack("bare", leased.batch_id)
    assert len(bare_acks(caplog)) == 1  # every client warns once


def _stub_trainer(requests: list[httpx.Request]) -> httpx.MockTransport:
    def answer(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        if request.url.path.endswith("/measure"):
            stats = dict.fromkeys(
                ("kl_mean", "kl_max", "is_ratio_mean", "clip_fraction", "ess_fraction")
            )
            body = {"weights": {"a": [1.0]}, "sequence_weights": {"a": 1.0}, "stats": stats}
            return httpx.Response(200, json=body)
        stats = dict.fromkeys(("kl_mean", "kl_max", "is_ratio_mean", "clip_fraction"))
        body = {"consumed": 1, "retired": 0, "flushed": 0, "stats": stats}
        return httpx.Response(200, json=body)

    return httpx.MockTransport(answer)


def test_the_blocking_client_warns_of_a_bare_ack_once(caplog: pytest.LogCaptureFixture) -> None:
    requests: list[httpx.Request] = []
    http = httpx.Client(transport=_stub_trainer(requests), base_url="http://broker")
    with BrokerClient(http=http) as client, caplog.at_level(logging.WARNING, logger=LOGGER):
        client.measure("r", "measured", {"a": [-0.5]})
        client.ack("r", "measured")  # the broker measures with the logprobs it kept
        client.ack("r", "with-logprobs", logprobs={"a": [-0.5]})
        client.ack("r", "with-kl", kl={"a": 0.0})
        assert not bare_acks(caplog)
        client.ack("r", "b1")
        client.ack("r", "b2")
    (warning,) = bare_acks(caplog)
    assert "b1" in warning.getMessage()
    assert len(requests) == 6  # a warning, never a refusal: every ack went out


# -- rejections ----------------------------------------------------------------------------------


async def test_rejections_are_logged_once_a_request(
    broker: AsyncBrokerClient, caplog: pytest.LogCaptureFixture
) -> None:
    await broker.create_run("rej", {"max_staleness": 1})
    await broker.set_policy("rej", 3)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        async with broker.writer("rej", batch_size=100) as w:
            await w.add(*rollouts("old", 2, version=1), *rollouts("fut", 7, version=9))
            await w.add(*rollouts("new", 1, version=3))
        assert (w.accepted, len(w.rejected)) == (1, 9)
        (line,) = rejected_lines(caplog)  # one request, one line
        assert "run rej" in line and "rejected 9 of 10" in line
        assert "future_version: 7, stale: 2" in line
        assert "'old0'" in line and "and 4 more" in line  # a few ids, not all nine

        caplog.clear()
        result = await broker.post_rollouts("rej", rollouts("late", 2, version=0))
        assert len(result.rejected) == 2
        (line,) = rejected_lines(caplog)
        assert "rejected 2 of 2" in line and "stale: 2" in line and "'late0', 'late1'" in line

        caplog.clear()
        await broker.post_rollouts("rej", rollouts("fine", 2, version=3))
        assert not rejected_lines(caplog)  # nothing rejected: nothing said


async def test_rejections_of_a_work_lease_post_are_logged(
    broker: AsyncBrokerClient, caplog: pytest.LogCaptureFixture
) -> None:
    await broker.create_run("wrej", {"group_size": 2})
    await broker.register_prompts("wrej", ["q0"])
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        async for lease in broker.work("wrej", max_prompts=1, wait_s=0, stop_when_empty=True):
            docs = [{"response_ids": [1, 2], "reward": 1.0, "policy_version": 5}] * 2
            result = await lease.post(lease.prompts[0], docs)
            assert [r.reason for r in result.rejected] == ["future_version"] * 2
            break
    (line,) = rejected_lines(caplog)
    assert "run wrej" in line and "future_version: 2" in line
    assert f"'{lease.prompts[0].group_id}-0'" in line


def test_the_blocking_writer_logs_rejections(caplog: pytest.LogCaptureFixture) -> None:
    def broker(request: httpx.Request) -> httpx.Response:
        docs = json.loads(request.content)["rollouts"]
        rejected = [{"rollout_id": d["rollout_id"], "reason": "stale"} for d in docs[1:]]
        return httpx.Response(202, json={"accepted": 1, "duplicates": 0, "rejected": rejected})

    http = httpx.Client(transport=httpx.MockTransport(broker), base_url="http://broker")
    with (
        BrokerClient(http=http, format="json") as client,
        caplog.at_level(logging.WARNING, logger=LOGGER),
    ):
        with client.writer("r", batch_size=3) as w:
            w.add(*rollouts("s", 3))
            w.add(*rollouts("t", 2))
        assert [r.rollout_id for r in w.rejected] == ["s1", "s2", "t1"]
        lines = rejected_lines(caplog)
        assert len(lines) == 2  # two requests
        assert "rejected 2 of 3" in lines[0] and "stale: 2; ids 's1', 's2'" in lines[0]
        client.post_rollouts("r", [Rollout("u", 0, np.array([1]), 0.0)] * 2)
        assert len(rejected_lines(caplog)) == 3
