"""Following the policy version from the client: ``set_policy(..., weights=...)`` and
``follow_policy``, which yields each new version in order, riding out long polls that end with
``204`` and outages (``503``) between them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest
from rollout_broker_client import AsyncBrokerClient, BrokerClient, PolicyVersion, Retry
from rollout_broker_client._wire import Api

from tests.client.recorder import Recorder


@pytest.fixture
async def follower(recorder: Recorder) -> AsyncIterator[AsyncBrokerClient]:
    """Through the recorder, with short waits between resends."""
    http = httpx.AsyncClient(transport=recorder, base_url="http://broker")
    retry = Retry(deadline_s=5.0, backoff_s=0.001, max_backoff_s=0.01)
    async with AsyncBrokerClient(http=http, retry=retry) as b:
        yield b
    await http.aclose()


def _polls(recorder: Recorder, status: int) -> int:
    return sum(
        1
        for q, _, r in recorder.exchanges
        if q.url.path.endswith("/policy") and q.method == "GET" and r.status_code == status
    )


async def _until(recorder: Recorder, status: int, count: int, follower: asyncio.Task) -> None:
    # The follower runs in another task: look again until it has had its answer (or is done,
    # which the test then judges by what it yielded).
    while True:
        if _polls(recorder, status) >= count or follower.done():
            return
        await asyncio.sleep(0.01)


async def test_follow_policy_yields_each_new_version_in_order_across_204s_and_outages(
    follower: AsyncBrokerClient, broker: AsyncBrokerClient, recorder: Recorder
) -> None:
    await broker.create_run("r1")
    await broker.set_policy("r1", 1, weights="ckpt/1")
    versions = follower.follow_policy("r1", after=0, wait_s=0.2)
    first = await anext(versions)
    assert (first.policy_version, first.weights) == (1, "ckpt/1")

    recorder.answer["GET /policy"] = [503, 503]  # an outage, which the follower rides out
    nxt = asyncio.create_task(anext(versions))
    await _until(recorder, 204, 1, nxt)  # then a long poll ends with nothing new: it asks again
    await broker.set_policy("r1", 2, weights="ckpt/2")
    second = await nxt
    assert (second.policy_version, second.weights) == (2, "ckpt/2")
    assert [s for _, s in recorder.answered] == [503, 503]

    nxt = asyncio.create_task(anext(versions))
    await _until(recorder, 204, _polls(recorder, 204) + 1, nxt)
    await broker.set_policy("r1", 3)
    third = await nxt
    assert (third.policy_version, third.weights) == (3, None)
    assert third.set_at >= second.set_at >= first.set_at
    # Each poll after a version asked for the one after it.
    afters = [
        q.url.params.get("after")
        for q, _, r in recorder.exchanges
        if q.url.path.endswith("/policy") and r.status_code == 200
    ]
    assert afters == ["0", "1", "2"]
    await versions.aclose()


async def test_without_after_the_current_version_comes_first(broker: AsyncBrokerClient) -> None:
    await broker.create_run("r1")
    await broker.set_policy("r1", 4, weights="s3://b/4")
    versions = broker.follow_policy("r1", wait_s=0.1)
    got = await anext(versions)
    await versions.aclose()
    assert isinstance(got, PolicyVersion)
    assert (got.policy_version, got.weights) == (4, "s3://b/4")
    assert await broker.policy("r1", after=4, wait_s=0.1) is None  # 204: nothing newer


def test_set_policy_sends_weights_and_rewind_only_when_given() -> None:
    api = Api("json", None, None)
    bodies = [
        json.loads(api.set_policy("r", 3).content or b""),
        json.loads(api.set_policy("r", 3, "ckpt/3").content or b""),
        json.loads(api.set_policy("r", 3, None, True).content or b""),
    ]
    assert bodies == [
        {"version": 3},
        {"version": 3, "weights": "ckpt/3"},
        {"version": 3, "rewind": True},
    ]


@pytest.mark.slow
def test_the_blocking_client_follows_the_policy(sync_broker: BrokerClient) -> None:
    run = "follow-sync"
    sync_broker.create_run(run)
    sync_broker.set_policy(run, 2, weights="ckpt/2")
    versions = sync_broker.follow_policy(run, after=1, wait_s=0.1)
    got = next(versions)
    assert (got.policy_version, got.weights) == (2, "ckpt/2")
    assert sync_broker.policy(run, after=2, wait_s=0.1) is None
