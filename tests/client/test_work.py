"""Prompts and work leases through the client: registration, the generator loop that posts groups
and gives back every prompt it did not post (after the body, at a break, on an exception, when
the client closes), a work lease resent under its own id, and the wire forms underneath."""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx
import numpy as np
import pytest
from redis.asyncio import Redis
from rollout_broker_client import (
    AsyncBrokerClient,
    AsyncWork,
    BrokerClient,
    Prompt,
    RegisterResult,
    Retry,
    Rollout,
    RunClosed,
    SyncASGITransport,
    WorkLeaseNotFound,
    WorkLeaseOver,
    WorkPrompt,
)
from rollout_broker_client._wire import Api, parse_accounting, parse_prompt_state, parse_work

from app.main import create_app
from app.settings import Settings
from tests.client.recorder import Recorder
from workers.drain import DrainContext, drain_once


def group(k: int = 2) -> list[dict[str, object]]:
    """A group as the generator loop takes it: no ids, no version, no group_id."""
    return [{"response_ids": [10 + i, 20 + i], "reward": float(i)} for i in range(k)]


def paths(recorder: Recorder, *suffixes: str) -> list[str]:
    """The requests so far whose path ends with one of ``suffixes``, as 'METHOD suffix'."""
    out = []
    for req, _, _ in recorder.exchanges:
        for s in suffixes:
            if req.url.path.endswith(s):
                out.append(f"{req.method} {s}")
    return out


async def setup_run(broker: AsyncBrokerClient, run: str, n: int, group_size: int = 2) -> None:
    await broker.create_run(run, {"group_size": group_size})
    await broker.register_prompts(run, [f"q{i}" for i in range(n)])


# -- registration --------------------------------------------------------------------------------


async def test_register_prompts_in_every_form_and_idempotent(
    wired: AsyncBrokerClient, recorder: Recorder
) -> None:
    await wired.create_run("reg")
    result = await wired.register_prompts(
        "reg",
        [
            Prompt("a", prompt_ids=np.array([1, 70_000]), data={"answer": 4}),
            {"prompt_id": "b", "prompt_ids": [5]},
            "c",
        ],
        batch_size=2,
    )
    assert (result.accepted, result.duplicates) == (3, 0)
    sent = [json.loads(b) for r, b, _ in recorder.exchanges if r.url.path.endswith("/prompts")]
    assert [[p["prompt_id"] for p in doc["prompts"]] for doc in sent] == [["a", "b"], ["c"]]
    assert sent[0]["prompts"][0] == {
        "prompt_id": "a",
        "prompt_ids": [1, 70_000],
        "data": {"answer": 4},
    }
    assert sent[1] == {"prompts": [{"prompt_id": "c"}], "epochs": 1}

    again = await wired.register_prompts("reg", ["a", "c", "d"])
    assert (again.accepted, again.duplicates) == (1, 2)
    assert await wired.register_prompts("reg", []) == RegisterResult(0, 0)

    lease = await wired.work_lease("reg", 10)
    assert lease is not None
    by_id = {p.prompt_id: p for p in lease.prompts}
    assert sorted(by_id) == ["a", "b", "c", "d"]
    a = by_id["a"]
    assert a.prompt_ids is not None and a.prompt_ids.dtype == np.int32
    np.testing.assert_array_equal(a.prompt_ids, [1, 70_000])
    assert (a.data, a.pass_, a.attempt) == ({"answer": 4}, 1, 1)
    assert by_id["c"].prompt_ids is None and by_id["c"].data is None


async def test_epochs_queue_one_pass_after_another(broker: AsyncBrokerClient) -> None:
    await broker.create_run("ep")
    await broker.register_prompts("ep", ["x", "y"], epochs=3)
    lease = await broker.work_lease("ep", 100)
    assert lease is not None
    assert [(p.prompt_id, p.pass_) for p in lease.prompts] == [
        ("x", 1), ("y", 1), ("x", 2), ("y", 2), ("x", 3), ("y", 3),
    ]  # fmt: skip
    assert len({p.group_id for p in lease.prompts}) == 6


# -- the generator loop ----------------------------------------------------------------------------


async def test_loop_posts_every_group_and_stops_when_empty(
    wired: AsyncBrokerClient, recorder: Recorder
) -> None:
    await setup_run(wired, "loop", 5)
    seen: list[WorkPrompt] = []
    async for lease in wired.work("loop", max_prompts=2, wait_s=0, stop_when_empty=True):
        assert len(lease) <= 2 and lease.policy_version == 0
        for p in lease.prompts:
            result = await lease.post(p, group())
            assert (result.accepted, result.rejected) == (2, [])
            seen.append(p)
        assert lease.unposted == [] and lease.posted == lease.prompts
    assert sorted(p.prompt_id for p in seen) == [f"q{i}" for i in range(5)]
    assert {p.attempt for p in seen} == {1}
    assert "POST /return" not in paths(recorder, "/return")  # nothing was left to give back

    batch = await wired.lease_batch("loop", 10)
    assert batch is not None
    groups = batch.groups()
    assert sorted(groups) == sorted(p.group_id for p in seen)
    for gid, members in groups.items():
        assert sorted(r.rollout_id for r in members) == [f"{gid}-0", f"{gid}-1"]
        assert {r.policy_version for r in members} == {0}


async def test_a_group_posted_without_generator_id_comes_back_with_the_loops(
    broker: AsyncBrokerClient,
) -> None:
    await setup_run(broker, "gen", 1)
    async for lease in broker.work("gen", max_prompts=1, generator_id="gen-a", wait_s=0):
        (p,) = lease.prompts
        await lease.post(p, group())
        break
    batch = await broker.lease_batch("gen", 2)
    assert batch is not None
    assert [r.generator_id for r in batch.rollouts] == ["gen-a", "gen-a"]


async def test_prompts_the_body_did_not_post_go_back_before_the_next_lease(
    wired: AsyncBrokerClient, recorder: Recorder
) -> None:
    await setup_run(wired, "next", 3)
    leases: list[AsyncWork] = []
    async for lease in wired.work("next", max_prompts=2, wait_s=0, stop_when_empty=True):
        leases.append(lease)
        if len(leases) == 1:
            await lease.post(lease.prompts[0], group())  # q0 posted, q1 left unposted
            continue
        for p in lease.prompts:
            await lease.post(p, group())
    first = leases[0]
    assert [p.prompt_id for p in first.returned] == ["q1"] and first.settled
    assert paths(recorder, "/work", "/return")[:3] == ["POST /work", "POST /return", "POST /work"]
    # q1 came back at its next attempt, ahead of q2, which had never been handed out.
    assert [(p.prompt_id, p.attempt) for p in leases[1].prompts] == [("q1", 2), ("q2", 1)]
    assert len(leases) == 2


async def test_break_gives_back_the_unposted_prompts(
    wired: AsyncBrokerClient, recorder: Recorder
) -> None:
    await setup_run(wired, "brk", 4)
    async for lease in wired.work("brk", max_prompts=4, wait_s=0):
        await lease.post(lease.prompts[0], group())
        break
    assert lease.settled and lease.returned == []  # the client gives them back before
    again = await wired.work_lease("brk", 10)  # its next request
    assert [p.prompt_id for p in lease.returned] == ["q1", "q2", "q3"]
    assert paths(recorder, "/work", "/return") == ["POST /work", "POST /return", "POST /work"]
    assert again is not None
    assert [(p.prompt_id, p.attempt) for p in again.prompts] == [("q1", 2), ("q2", 2), ("q3", 2)]


async def test_an_exception_in_the_body_gives_back_the_unposted_prompts(
    broker: AsyncBrokerClient, api: httpx.AsyncClient
) -> None:
    await setup_run(broker, "exc", 3)
    with pytest.raises(KeyError, match="generator crashed"):
        async with broker.work("exc", max_prompts=3, wait_s=0) as leases:
            async for lease in leases:
                await lease.post(lease.prompts[1], group())
                raise KeyError("generator crashed")
    assert lease.settled and [p.prompt_id for p in lease.returned] == ["q0", "q2"]
    # Given back on leaving the block: another generator sees them at once.
    other = await AsyncBrokerClient(http=api).work_lease("exc", 10)
    assert other is not None
    assert [(p.prompt_id, p.attempt) for p in other.prompts] == [("q0", 2), ("q2", 2)]


async def test_an_exception_without_async_with_is_given_back_by_the_next_request(
    broker: AsyncBrokerClient,
) -> None:
    await setup_run(broker, "exc2", 2)

    async def generate() -> AsyncWork:
        async for lease in broker.work("exc2", max_prompts=2, wait_s=0):
            raise RuntimeError(lease.lease_id)
        raise AssertionError("no lease")

    with pytest.raises(RuntimeError) as err:
        await generate()
    lid = str(err.value)
    again = await broker.work_lease("exc2", 10)
    assert again is not None and again.lease_id != lid
    assert [(p.prompt_id, p.attempt) for p in again.prompts] == [("q0", 2), ("q1", 2)]


async def test_closing_the_client_gives_back_open_leases(api: httpx.AsyncClient) -> None:
    client = AsyncBrokerClient(http=api)
    await setup_run(client, "close", 2)
    leases = client.work("close", max_prompts=2, wait_s=0)
    lease = await anext(leases)  # the loop object lives on: only close() can settle it
    await client.close()
    assert lease.settled and len(lease.returned) == 2
    back = await AsyncBrokerClient(http=api).work_lease("close", 10)
    assert back is not None and [p.attempt for p in back.prompts] == [2, 2]


async def test_give_back_some_and_go_on(broker: AsyncBrokerClient) -> None:
    await setup_run(broker, "some", 3)
    async for lease in broker.work("some", max_prompts=3, wait_s=0):
        q0, q1, q2 = lease.prompts
        assert await lease.give_back([q1.group_id]) == 1
        assert await lease.give_back([q1]) == 0  # given back already: nothing is sent
        other = await broker.work_lease("some", 10)
        assert other is not None and [(p.prompt_id, p.attempt) for p in other.prompts] == [
            ("q1", 2)
        ]
        await lease.post(q0, group())
        await lease.post(q2, group())
        break
    assert [p.prompt_id for p in lease.returned] == ["q1"] and lease.unposted == []


async def test_post_checks_the_group(broker: AsyncBrokerClient) -> None:
    await setup_run(broker, "chk", 2)
    async for lease in broker.work("chk", max_prompts=2, wait_s=0):
        q0, q1 = lease.prompts
        with pytest.raises(ValueError, match="names group"):
            await lease.post(q0, [Rollout("r", 0, [1], 0.0, group_id=q1.group_id)])
        with pytest.raises(ValueError, match="is not the group_id of a prompt"):
            await lease.post("nope#1.1", group())
        with pytest.raises(ValueError, match="no rollouts"):
            await lease.post(q0, [])
        # A Rollout keeps its own id and version; the group is filled in.
        await lease.post(q0, [Rollout(f"own-{i}", 0, [1, 2], float(i)) for i in range(2)])
        # A group posted in two halves numbers its default ids on.
        await lease.post(q1, group(1))
        await lease.post(q1, group(1))
        break
    assert lease.posted == [q0, q1]
    with pytest.raises(RuntimeError, match="is settled"):
        await lease.post(q0, group())
    batch = await broker.lease_batch("chk", 4)
    assert batch is not None
    assert sorted(r.rollout_id for r in batch) == [
        "own-0",
        "own-1",
        f"{q1.group_id}-0",
        f"{q1.group_id}-1",
    ]
    assert {r.group_id for r in batch if r.rollout_id.startswith("own")} == {q0.group_id}


async def test_a_lost_work_answer_is_resent_under_the_same_lease_id(
    wired: AsyncBrokerClient, recorder: Recorder
) -> None:
    await setup_run(wired, "lost", 3)
    recorder.lose_answer.add("POST /work")
    lease = await wired.work_lease("lost", 2)
    assert lease is not None
    sent = [json.loads(b) for r, b, _ in recorder.exchanges if r.url.path.endswith("/work")]
    assert len(sent) == 2 and sent[0]["lease_id"] == sent[1]["lease_id"] == lease.lease_id
    rest = await wired.work_lease("lost", 10)
    assert rest is not None and [p.prompt_id for p in rest.prompts] == ["q2"]  # none held twice


async def test_the_same_lease_id_is_the_same_lease_until_it_is_over(
    broker: AsyncBrokerClient,
) -> None:
    await setup_run(broker, "same", 3)
    first = await broker.work_lease("same", 2, lease_id="gen0-lease-0001", generator_id="gen0")
    again = await broker.work_lease("same", 2, lease_id="gen0-lease-0001", generator_id="gen0")
    assert first is not None and again is not None
    assert first.lease_id == again.lease_id == "gen0-lease-0001"
    assert [p.group_id for p in first.prompts] == [p.group_id for p in again.prompts]
    assert await broker.return_work("same", first.lease_id, []) == 0  # none named: none back
    assert await broker.return_work("same", first.lease_id) == 2
    with pytest.raises(WorkLeaseOver) as err:
        await broker.work_lease("same", 2, lease_id="gen0-lease-0001")
    assert err.value.status == 409 and "returned" in err.value.detail
    with pytest.raises(WorkLeaseNotFound):
        await broker.return_work("same", "no-such-lease")


@pytest.mark.one_node  # the client's reading of the ledger; the scripts have their own tests
async def test_closing_a_run_cancels_its_queued_prompts_in_the_accounting(
    broker: AsyncBrokerClient, redis: Redis, prefix: str, sessionmaker: Any
) -> None:
    await setup_run(broker, "closing", 3)
    await broker.close_run("closing")
    await drain_once(DrainContext.create(redis, sessionmaker, prefix, consumer="test-drain"))
    prompts = (await broker.accounting("closing")).prompts
    assert (prompts.cancelled, prompts.done, prompts.queued) == (3, 3, 0)
    assert prompts.unaccounted == 0
    cancelled = [p async for p in broker.prompt_states("closing", "cancelled")]
    assert [(p.prompt_id, p.state) for p in cancelled] == [(f"q{i}", "cancelled") for i in range(3)]


async def test_the_loop_ends_with_run_closed(broker: AsyncBrokerClient) -> None:
    await setup_run(broker, "closed", 2)
    await broker.close_run("closed")
    with pytest.raises(RunClosed) as err:
        async for _ in broker.work("closed", wait_s=0):
            raise AssertionError("a closed run hands out no work")
    assert err.value.status == 409


async def test_a_failed_give_back_is_logged_and_the_loop_goes_on(
    recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    http = httpx.AsyncClient(transport=recorder, base_url="http://broker")
    client = AsyncBrokerClient(http=http, retry=Retry(retries=0))
    await setup_run(client, "fail", 2)
    recorder.refuse.add("POST /return")
    leases = []
    with caplog.at_level(logging.WARNING, logger="rollout_broker.client"):
        async for lease in client.work("fail", max_prompts=1, wait_s=0, stop_when_empty=True):
            leases.append(lease)
            if len(leases) == 2:
                await lease.post(lease.prompts[0], group())
    first = leases[0]
    assert first.settled and first.returned == [] and len(first.unposted) == 1
    assert "could not give back 1 prompts of work lease" in caplog.text
    assert [lease.prompts[0].prompt_id for lease in leases] == ["q0", "q1"]


def test_sync_loop_gives_back_at_break_and_on_exceptions(settings: Settings) -> None:
    with (
        SyncASGITransport(create_app(settings)) as transport,
        httpx.Client(transport=transport, base_url="http://broker") as http,
    ):
        broker = BrokerClient(http=http)
        broker.create_run("sync", {"group_size": 2})
        assert broker.register_prompts("sync", ["a", "b", "c"]).accepted == 3
        for lease in broker.work("sync", max_prompts=2, wait_s=0):
            lease.post(lease.prompts[0], group())
            break
        broker.get_run("sync")  # the dropped loop's lease is given back before this request
        assert lease.settled and [p.prompt_id for p in lease.returned] == ["b"]

        with pytest.raises(ZeroDivisionError), broker.work("sync", max_prompts=5) as leases:
            for lease in leases:
                assert lease.prompts
                1 / 0  # noqa: B018
        assert sorted(p.prompt_id for p in lease.returned) == ["b", "c"]

        done = []
        for lease in broker.work("sync", max_prompts=5, wait_s=0, stop_when_empty=True):
            for p in lease.prompts:
                lease.post(p, group())
                done.append((p.prompt_id, p.attempt))
        assert sorted(done) == [("b", 3), ("c", 2)]


# -- the wire --------------------------------------------------------------------------------------


def test_work_request_and_answer() -> None:
    call = Api("msgpack", generator_id="g-default").work(
        "r1", 4, generator_id=None, wait_s=2, lease_id=None
    )
    assert call.content is not None
    doc = json.loads(call.content)
    assert doc["max_prompts"] == 4 and doc["wait_s"] == 2.0 and doc["generator_id"] == "g-default"
    assert len(doc["lease_id"]) == 32 and call.idempotent and call.extra_timeout == 2.0
    other = Api("json").work("r1", 4, generator_id="g1", wait_s=0, lease_id="mine-0001")
    assert other.content is not None
    assert json.loads(other.content) == {
        "max_prompts": 4, "wait_s": 0.0, "lease_id": "mine-0001", "generator_id": "g1"
    }  # fmt: skip

    raw = np.array([3, 2**31 - 1], dtype="<i4").tobytes()
    lease = parse_work(
        {
            "lease_id": "L",
            "policy_version": 7,
            "expires_at": "2026-01-01T00:00:00+00:00",
            "prompts": [
                {"prompt_id": "p", "pass": 2, "attempt": 3, "group_id": "p#2.3",
                 "prompt_ids": raw, "data": {"k": 1}},
                {"prompt_id": "q", "pass": 1, "attempt": 1, "group_id": "q#1.1",
                 "prompt_ids": [4], "data": None},
            ],
        }
    )  # fmt: skip
    p, q = lease.prompts
    assert (lease.policy_version, p.pass_, p.attempt, p.group_id) == (7, 2, 3, "p#2.3")
    assert p.prompt_ids is not None and p.prompt_ids.tolist() == [3, 2**31 - 1]
    assert q.prompt_ids is not None and q.prompt_ids.dtype == np.int32


def test_prompt_ids_are_checked_before_sending() -> None:
    with pytest.raises(ValueError, match="between 0 and"):
        Api().register_prompts("r", [Prompt("p", [-1])], 1)
    with pytest.raises(TypeError, match="integers"):
        Api().register_prompts("r", [{"prompt_id": "p", "prompt_ids": [0.5]}], 1)


def test_accounting_prompts_and_waits() -> None:
    base = {"rollouts_received": 0, "buffered": 0, "leased": 0, "samples_consumed": 0}
    old = parse_accounting(base)
    assert old.prompts.registered == 0 and old.wait.generator_s == 0.0
    acc = parse_accounting(
        base
        | {
            "prompts": {"registered": 10, "queued": 3, "in_flight": 2, "done": 4, "failed": 1,
                        "retried": 5},
            "wait": {"generator_s": 1.5, "trainer_s": 0.25},
        }
    )  # fmt: skip
    assert (acc.prompts.registered, acc.prompts.in_flight, acc.prompts.retried) == (10, 2, 5)
    assert acc.prompts.unaccounted == 0
    assert (acc.wait.generator_s, acc.wait.trainer_s) == (1.5, 0.25)


def test_accounting_skipped_and_pools_and_the_prompts_by_pool() -> None:
    base = {"rollouts_received": 0, "buffered": 0, "leased": 0, "samples_consumed": 0}
    counts = {"registered": 10, "queued": 3, "in_flight": 2, "done": 4, "failed": 1, "retried": 0}
    old = parse_accounting(base | {"prompts": counts})
    assert (old.prompts.skipped, old.prompts.pools) == (0, None)
    pools = {"easy": 1, "normal": 2, "hard": 0}
    acc = parse_accounting(base | {"prompts": counts | {"skipped": 2, "pools": pools}})
    assert (acc.prompts.skipped, acc.prompts.pools) == (2, pools)
    assert acc.prompts.unaccounted == 0  # done counts the skipped passes
    doc = {"prompt_id": "p", "pass": 1, "attempt": 1, "state": "skipped", "tries": 0}
    assert parse_prompt_state(doc).mean is None
    assert parse_prompt_state(doc | {"mean": 0.25}).mean == 0.25
    call = Api().prompts_page("r", "queued", None, 10, "hard")
    assert call.params == {"limit": "10", "state": "queued", "pool": "hard"}
    assert Api().prompts_page("r", None, None, 10).params == {"limit": "10"}
