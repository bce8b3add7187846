"""Rewards that arrive later, through the client: rollouts posted without a reward, the reward
worker loop that scores them and gives back what it did not score (after the body, at a break,
on an exception, when the client closes), a lease and a score resent under the same ids, the
checks made before sending, and the wire forms underneath."""

from __future__ import annotations

import json
import math
import secrets
from datetime import UTC, datetime

import httpx
import msgpack
import numpy as np
import pytest
from pydantic import SecretStr
from rollout_broker_client import (
    AsyncBrokerClient,
    AsyncRewardWork,
    BrokerClient,
    Forbidden,
    RewardConflict,
    RewardLeaseNotFound,
    RewardLeaseOver,
    Rollout,
    ScoreResult,
    SyncASGITransport,
    ValidationFailed,
)
from rollout_broker_client._wire import Api, parse_reward_lease, rollout_doc
from rollout_broker_client.protocol import MSGPACK

from app.main import create_app
from app.settings import Settings
from tests.client.recorder import Recorder
from tests.helpers import KNOWN_SECRETS


def unscored(run_groups: int, group_size: int = 2) -> list[Rollout]:
    """``run_groups`` groups of ``group_size`` rollouts, none with a reward; the k-th response
    of a group ends with token k, its reward once judged."""
    return [
        Rollout(f"g{g}-{k}", 0, [g + 1, k], group_id=f"g{g}")
        for g in range(run_groups)
        for k in range(group_size)
    ]


def judge(response_ids: np.ndarray) -> float:
    return float(response_ids[-1])


def sent(recorder: Recorder, suffix: str) -> list[dict[str, object]]:
    """The JSON bodies of the requests so far whose path ends with ``suffix``."""
    return [
        json.loads(body) if body else {}
        for req, body, _ in recorder.exchanges
        if req.method == "POST" and req.url.path.endswith(suffix)
    ]


async def setup_run(broker: AsyncBrokerClient, run: str, groups: int) -> None:
    await broker.create_run(run, {"group_size": 2})
    result = await broker.post_rollouts(run, unscored(groups))
    assert result.accepted == 2 * groups


# -- the loop --------------------------------------------------------------------------------------


async def test_rollouts_posted_without_a_reward_are_scored_by_the_loop(
    wired: AsyncBrokerClient, recorder: Recorder
) -> None:
    await setup_run(wired, "later", 3)
    assert await wired.lease_batch("later", 2) is None  # no trainer gets an unscored rollout
    seen: list[str] = []
    async for lease in wired.reward_work("later", max_rollouts=4, wait_s=0, stop_when_empty=True):
        assert lease.rollouts and len(lease) <= 4
        for r in lease.rollouts:  # typed, with the tokens as posted
            assert r.group_id == r.rollout_id.split("-")[0]
            assert r.response_ids.dtype == np.int32 and r.response_ids.tolist()[0] >= 1
        result = await lease.score({r.rollout_id: judge(r.response_ids) for r in lease.rollouts})
        assert result == ScoreResult(len(lease), 0, [])
        assert lease.unscored == [] and lease.lease_id
        seen += [r.rollout_id for r in lease.rollouts]
    assert sorted(seen) == sorted(r.rollout_id for r in unscored(3))  # each scored once
    answers = {
        resp.headers["content-type"]
        for req, _, resp in recorder.exchanges
        if req.url.path.endswith("/rewards/lease") and resp.status_code == 200
    }
    assert answers == {MSGPACK}  # the tokens came as raw arrays, as a batch's do
    batch = await wired.lease_batch("later", 6)
    assert batch is not None
    assert {r.rollout_id: r.reward for r in batch} == {
        r.rollout_id: float(r.rollout_id[-1]) for r in unscored(3)
    }


async def test_a_body_that_raises_gives_back_the_rest_at_once(
    wired: AsyncBrokerClient, recorder: Recorder, api: httpx.AsyncClient
) -> None:
    await setup_run(wired, "crash", 2)
    with pytest.raises(KeyError, match="reward model crashed"):
        async for lease in wired.reward_work(
            "crash", max_rollouts=4, wait_s=0, stop_when_empty=True
        ):
            async with lease:
                first = lease.rollouts[0]
                await lease.score({first.rollout_id: 1.0})
                raise KeyError("reward model crashed")
    rest = sorted(r.rollout_id for r in lease.rollouts if r.rollout_id != first.rollout_id)
    assert lease.settled and sorted(r.rollout_id for r in lease.returned) == rest
    [back] = sent(recorder, f"/rewards/lease/{lease.lease_id}/return")
    assert sorted(back["rollout_ids"]) == rest  # type: ignore[arg-type]
    # Given back on leaving the block, not counted as an attempt: another worker has them now.
    other = await AsyncBrokerClient(http=api).reward_lease("crash", 10)
    assert other is not None and sorted(r.rollout_id for r in other.rollouts) == rest
    with pytest.raises(RuntimeError, match="settled"):
        await lease.score({rest[0]: 0.0})


async def test_a_break_gives_back_the_rest_before_the_next_request(
    broker: AsyncBrokerClient,
) -> None:
    await setup_run(broker, "brk", 2)
    async for lease in broker.reward_work("brk", max_rollouts=4, wait_s=0, stop_when_empty=True):
        await lease.score({lease.rollouts[0].rollout_id: 0.0})
        break
    again = await broker.reward_lease("brk", 10)  # the dropped loop's lease goes back first
    assert lease.settled and len(lease.returned) == 3
    assert again is not None and {r.rollout_id for r in again.rollouts} == {
        r.rollout_id for r in lease.returned
    }


async def test_closing_the_client_gives_back_open_reward_leases(api: httpx.AsyncClient) -> None:
    client = AsyncBrokerClient(http=api)
    await setup_run(client, "close", 1)
    leases = client.reward_work("close", max_rollouts=2, wait_s=0, stop_when_empty=True)
    lease = await anext(leases)  # the loop object lives on: only close() can settle it
    await client.close()
    assert lease.settled and len(lease.returned) == 2
    back = await AsyncBrokerClient(http=api).reward_lease("close", 10)
    assert back is not None and len(back.rollouts) == 2


async def test_give_back_some_and_score_the_rest(broker: AsyncBrokerClient) -> None:
    """A group is leased and given back whole: naming one rollout gives back its group."""
    await setup_run(broker, "some", 2)
    lease = await broker.reward_lease("some", 4, lease_id="worker-1-lease-1")
    assert lease is not None and lease.lease_id == "worker-1-lease-1"
    assert await broker.return_rewards("some", lease.lease_id, []) == 0  # none named: none back
    async with AsyncRewardWork(broker, "some", lease) as work:
        a, b = sorted({r.group_id for r in work.rollouts})  # type: ignore[type-var]
        group_a = sorted(r.rollout_id for r in work.rollouts if r.group_id == a)
        b0, b1 = sorted(r.rollout_id for r in work.rollouts if r.group_id == b)
        assert await work.give_back([group_a[0]]) == 2
        assert sorted(r.rollout_id for r in work.returned) == group_a
        assert sorted(r.rollout_id for r in work.unscored) == [b0, b1]
        assert (await work.score({b0: 1.0})).scored == 1
    assert [r.rollout_id for r in work.returned][2:] == [b1]  # the rest, on leaving the block
    again = await broker.reward_lease("some", 4)
    assert again is not None and {r.rollout_id for r in again.rollouts} == {*group_a, b1}
    with pytest.raises(RewardLeaseOver):  # its id is not handed out again once it is over
        await broker.reward_lease("some", 4, lease_id="worker-1-lease-1")
    with pytest.raises(RewardLeaseNotFound):
        await broker.return_rewards("some", "no-such-lease")


# -- resends and refusals --------------------------------------------------------------------------


async def test_a_lost_lease_answer_is_resent_under_the_same_lease_id(
    wired: AsyncBrokerClient, recorder: Recorder
) -> None:
    await setup_run(wired, "lost", 2)
    recorder.lose_answer.add("POST /rewards/lease")
    lease = await wired.reward_lease("lost", 2)
    assert lease is not None and len(lease.rollouts) == 2
    asked = sent(recorder, "/rewards/lease")
    assert len(asked) == 2 and asked[0]["lease_id"] == asked[1]["lease_id"] == lease.lease_id
    rest = await wired.reward_lease("lost", 10)  # none held by a lease nobody knows of
    assert rest is not None and len(rest.rollouts) == 2
    assert not {r.rollout_id for r in rest.rollouts} & {r.rollout_id for r in lease.rollouts}


async def test_a_lost_score_answer_is_resent_and_counts_once(
    wired: AsyncBrokerClient, recorder: Recorder
) -> None:
    await setup_run(wired, "again", 1)
    lease = await wired.reward_lease("again", 2)
    assert lease is not None
    rewards = {r.rollout_id: judge(r.response_ids) for r in lease.rollouts}
    recorder.lose_answer.add("POST /rewards")
    result = await wired.score("again", rewards, lease_id=lease.lease_id)
    first, second = sent(recorder, "/rewards")
    assert first == second == {"rewards": rewards, "lease_id": lease.lease_id}
    assert result == ScoreResult(0, 2, [])  # the resend's answer: both already scored
    batch = await wired.lease_batch("again", 2)
    assert batch is not None and {r.rollout_id: r.reward for r in batch} == rewards


async def test_another_reward_for_a_scored_rollout_is_a_conflict(broker: AsyncBrokerClient) -> None:
    await setup_run(broker, "conflict", 1)
    lease = await broker.reward_lease("conflict", 2)
    assert lease is not None
    rid = lease.rollouts[0].rollout_id
    assert (await broker.score("conflict", {rid: 1.0})).scored == 1  # without the lease: allowed
    assert (await broker.score("conflict", {rid: 1.0})).duplicates == 1
    with pytest.raises(RewardConflict) as err:
        await broker.score("conflict", {rid: 0.5})
    assert err.value.status == 409
    with pytest.raises(ValidationFailed, match="no reward lease"):  # the body names it: 422
        await broker.score("conflict", {rid: 1.0}, lease_id="no-such-lease")
    with pytest.raises(ValidationFailed):
        await broker.score("conflict", {"no-such-rollout": 1.0})


async def test_scores_are_checked_before_sending(
    wired: AsyncBrokerClient, recorder: Recorder
) -> None:
    await setup_run(wired, "checked", 1)
    leases = wired.reward_work("checked", max_rollouts=2, wait_s=0, stop_when_empty=True)
    lease = await anext(leases)
    rid = lease.rollouts[0].rollout_id
    before = len(recorder.exchanges)
    for bad, error in (
        (math.nan, ValueError),
        (math.inf, ValueError),
        (-math.inf, ValueError),
        (1.5e12, ValueError),  # beyond the broker's bound
        ("1.0", TypeError),
        (True, TypeError),
        (None, TypeError),
    ):
        with pytest.raises(error, match=rid):
            await lease.score({rid: bad})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="not rollouts of reward lease"):
        await lease.score({"g9-0": 1.0})
    with pytest.raises(ValueError, match="must be finite"):
        await wired.score("checked", {rid: math.nan})
    assert len(recorder.exchanges) == before and lease.unscored == lease.rollouts
    await lease.score({rid: np.float32(0.25)})  # numpy numbers are numbers
    assert lease.scored == {rid: 0.25}


def test_sync_reward_loop_gives_back_at_break_and_on_exceptions(settings: Settings) -> None:
    with (
        SyncASGITransport(create_app(settings)) as transport,
        httpx.Client(transport=transport, base_url="http://broker") as http,
    ):
        broker = BrokerClient(http=http)
        broker.create_run("sync", {"group_size": 2})
        broker.post_rollouts("sync", unscored(3))
        for lease in broker.reward_work("sync", max_rollouts=2, wait_s=0, stop_when_empty=True):
            first = lease.rollouts[0]
            lease.score({first.rollout_id: judge(first.response_ids)})
            break
        broker.get_run("sync")  # the dropped loop's lease is given back before this request
        assert lease.settled and len(lease.returned) == 1

        with (
            pytest.raises(ZeroDivisionError),
            broker.reward_work("sync", max_rollouts=6, wait_s=0, stop_when_empty=True) as ls,
        ):
            for lease in ls:
                assert lease.rollouts
                1 / 0  # noqa: B018
        assert len(lease.returned) == 5

        done = []
        for lease in broker.reward_work("sync", max_rollouts=6, wait_s=0, stop_when_empty=True):
            lease.score({r.rollout_id: judge(r.response_ids) for r in lease.rollouts})
            done += list(lease.scored)
        assert len(done) == 5
        batch = broker.lease_batch("sync", 6)
        assert batch is not None and sorted(batch.rewards.tolist()) == [0, 0, 0, 1, 1, 1]


# -- the wire --------------------------------------------------------------------------------------


def test_a_rollout_without_a_reward_is_sent_without_one() -> None:
    doc = rollout_doc(Rollout("a", 0, [1, 2]), binary=True)
    assert "reward" not in doc and doc["response_ids"] == np.array([1, 2], "<i4").tobytes()
    mapping = {"rollout_id": "b", "policy_version": 0, "response_ids": [1], "reward": None}
    assert "reward" not in rollout_doc(mapping, binary=False)
    assert rollout_doc(Rollout("c", 0, [1], 0.0), binary=False)["reward"] == 0.0  # 0 is a reward


def test_reward_lease_request_and_answer() -> None:
    call = Api("msgpack").reward_lease("r1", 4, worker_id=None, wait_s=2, lease_id=None)
    doc = json.loads(call.content or b"")
    assert call.path == "/v1/runs/r1/rewards/lease" and call.method == "POST"
    assert doc["max_rollouts"] == 4 and doc["wait_s"] == 2.0 and "worker_id" not in doc
    assert len(doc["lease_id"]) == 32 and call.idempotent and call.extra_timeout == 2.0
    assert call.headers["accept"].startswith("application/")  # msgpack asked for first
    other = Api("json").reward_lease("r1", 1, worker_id="rm-0", wait_s=0, lease_id="mine-1")
    assert json.loads(other.content or b"") == {
        "max_rollouts": 1, "wait_s": 0.0, "lease_id": "mine-1", "worker_id": "rm-0"
    }  # fmt: skip
    assert "accept" not in other.headers
    body = msgpack.unpackb(
        msgpack.packb(
            {
                "lease_id": "L",
                "expires_at": "2026-01-01T00:00:30+00:00",
                "rollouts": [
                    {
                        "rollout_id": "a",
                        "group_id": "g",
                        "prompt_id": "p",
                        "prompt_ids": np.array([7, 8], "<i4").tobytes(),
                        "response_ids": np.array([1, 2, 3], "<i4").tobytes(),
                        "loss_mask": bytes([1, 0, 1]),
                        "data": {"answer": 3},
                    },
                    {"rollout_id": "b", "response_ids": [4], "prompt_ids": None},
                ],
            },
            use_bin_type=True,
        ),
        raw=False,
    )
    lease = parse_reward_lease(body)
    assert lease.expires_at == datetime(2026, 1, 1, 0, 0, 30, tzinfo=UTC)
    a, b = lease.rollouts
    assert (a.group_id, a.prompt_id, a.data) == ("g", "p", {"answer": 3})
    assert a.prompt_ids is not None and a.prompt_ids.tolist() == [7, 8]
    assert a.response_ids.tolist() == [1, 2, 3]
    assert a.loss_mask is not None and a.loss_mask.tolist() == [1, 0, 1]
    assert (b.group_id, b.prompt_id, b.prompt_ids, b.loss_mask) == (None, None, None, None)


def test_score_and_return_requests() -> None:
    call = Api().score("r/1", {"a": 1, "b": np.float64(0.5)}, "L1")
    assert call.path == "/v1/runs/r%2F1/rewards" and call.idempotent
    assert json.loads(call.content or b"") == {"rewards": {"a": 1.0, "b": 0.5}, "lease_id": "L1"}
    assert "lease_id" not in json.loads(Api().score("r", {"a": 1.0}, None).content or b"")
    back = Api().return_rewards("r", "L 1", ["a"])
    assert back.path == "/v1/runs/r/rewards/lease/L%201/return"
    assert json.loads(back.content or b"") == {"rollout_ids": ["a"]}
    assert json.loads(Api().return_rewards("r", "L", None).content or b"") == {}


async def test_a_reward_scoped_token_scores_and_does_nothing_else(settings: Settings) -> None:
    admin_token = secrets.token_urlsafe(32)
    KNOWN_SECRETS.add(admin_token)  # the test run's log watch fails if a log line holds it
    auth = settings.model_copy(update={"auth": True, "admin_token": SecretStr(admin_token)})
    app = create_app(auth)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://broker") as http,
    ):
        admin = AsyncBrokerClient(http=http, token=admin_token)
        await setup_run(admin, "scoped", 1)
        made = await admin.create_token("rm-0", "reward", "scoped")
        assert made.scopes == ["reward"]
        worker = AsyncBrokerClient(http=http, token=made.token)
        scored = []
        async for lease in worker.reward_work("scoped", wait_s=0, stop_when_empty=True):
            await lease.score({r.rollout_id: judge(r.response_ids) for r in lease.rollouts})
            scored += list(lease.scored)
        assert sorted(scored) == ["g0-0", "g0-1"]
        with pytest.raises(Forbidden):
            await worker.post_rollouts("scoped", unscored(2))
