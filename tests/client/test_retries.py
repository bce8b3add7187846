"""The client's retries through outages (502/503/504 with Retry-After, lost connections) up to a
deadline, and its writer, which never drops a rollout the broker has not accepted: statuses are
answered in the broker's stead by the :class:`Recorder`, the rest by the app in-process."""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from rollout_broker_client import (
    AsyncBrokerClient,
    BrokerClient,
    BrokerUnreachable,
    InternalError,
    Retry,
    Rollout,
    RunNotFound,
    Unavailable,
)
from rollout_broker_client._wire import Api, Call

from tests.client.recorder import Recorder


def group(name: str, k: int) -> list[Rollout]:
    return [
        Rollout(f"{name}-{i}", 0, [1, 2, 3], float(i), [-0.1, -0.2, -0.3], group_id=name)
        for i in range(k)
    ]


def ids(rollouts: list[Any]) -> list[str]:
    return [r.rollout_id if isinstance(r, Rollout) else r["rollout_id"] for r in rollouts]


def posted_ids(recorder: Recorder) -> list[list[str]]:
    """The rollout ids of each ingest request that reached the broker, in order (JSON bodies)."""
    return [
        [r["rollout_id"] for r in json.loads(body)["rollouts"]]
        for req, body, resp in recorder.exchanges
        if req.url.path.endswith("/rollouts") and resp.status_code == 202
    ]


@pytest.fixture
async def quick(recorder: Recorder) -> AsyncIterator[AsyncBrokerClient]:
    """Through the recorder, with short waits and a deadline of 5 s; JSON bodies."""
    http = httpx.AsyncClient(transport=recorder, base_url="http://broker")
    retry = Retry(deadline_s=5.0, backoff_s=0.001, max_backoff_s=0.01)
    async with AsyncBrokerClient(http=http, retry=retry, format="json") as b:
        yield b
    await http.aclose()


# -- the policy ----------------------------------------------------------------------------------


def _call(idempotent: bool = True, extra_timeout: float = 0.0) -> Call[Any]:
    return Call("GET", "/x", lambda r, b: b, idempotent=idempotent, extra_timeout=extra_timeout)


def _answer(status: int, retry_after: str | None = None) -> httpx.Response:
    headers = {} if retry_after is None else {"retry-after": retry_after}
    return httpx.Response(status, headers=headers, request=httpx.Request("GET", "http://b/x"))


def test_the_policy_honours_retry_after_within_the_deadline() -> None:
    retry = Retry(deadline_s=1.0, backoff_s=0.01, max_backoff_s=0.02)
    wait = retry.pause(_call(), 0, 0.0, response=_answer(503, "0.5"))
    assert wait == 0.5  # longer than the backoff: the broker's word counts
    assert retry.pause(_call(), 0, 0.6, response=_answer(503, "0.5")) is None  # past 1 s
    # A long poll's own wait is not counted against the deadline.
    assert retry.pause(_call(extra_timeout=30), 0, 20.0, response=_answer(503, "1")) == 1.0
    for status in (502, 503, 504):
        wait = retry.pause(_call(), 3, 0.0, response=_answer(status))
        assert wait is not None and 0.005 <= wait <= 0.02  # no Retry-After: the backoff
    for status in (400, 404, 409, 422, 429, 500):
        assert retry.pause(_call(), 0, 0.0, response=_answer(status, "1")) is None


def test_the_policy_retries_lost_answers_only_of_idempotent_calls() -> None:
    retry = Retry(deadline_s=None, retries=2, backoff_s=0.01)
    req = httpx.Request("POST", "http://b/x")
    lost = httpx.RemoteProtocolError("server closed the connection", request=req)
    refused = httpx.ConnectError("refused", request=req)
    assert retry.pause(_call(), 0, 0.0, error=lost) is not None
    assert retry.pause(_call(idempotent=False), 0, 0.0, error=lost) is None
    assert retry.pause(_call(idempotent=False), 0, 0.0, error=refused) is not None  # never sent
    assert retry.pause(_call(), 2, 0.0, error=refused) is None  # retries=2 resends at most
    assert Retry(deadline_s=None).pause(_call(), 10_000, 1e9, error=refused) is not None


def test_a_broker_that_never_answered_gets_first_contact_s() -> None:
    retry = Retry(deadline_s=60.0, backoff_s=0.5, max_backoff_s=0.5, first_contact_s=10.0)
    req = httpx.Request("GET", "http://b/x")
    refused = httpx.ConnectError("refused", request=req)
    timed_out = httpx.ConnectTimeout("timed out", request=req)
    lost = httpx.ReadError("connection reset", request=req)
    for error in (refused, timed_out):
        assert not retry.first_contact_over(error, 5.0, 0.5)
        assert retry.first_contact_over(error, 9.8, 0.5)  # the next attempt after 10 s
        assert retry.pause(_call(), 3, 59.0, error=error) is not None  # once answered: 60 s
    # Something took the connection: the broker's outages get the whole deadline.
    assert not retry.first_contact_over(lost, 9.8, 0.5)
    lifted = Retry(deadline_s=60.0, backoff_s=0.5, max_backoff_s=0.5, first_contact_s=None)
    assert not lifted.first_contact_over(refused, 59.0, 0.5)
    assert Retry().first_contact_s == 10.0


def test_a_url_the_client_cannot_send_to_is_not_retried(caplog: pytest.LogCaptureFixture) -> None:
    req = httpx.Request("GET", "http://b/x")
    no_scheme = httpx.UnsupportedProtocol("missing an 'http://'", request=req)
    assert Retry(deadline_s=None).pause(_call(), 0, 0.0, error=no_scheme) is None
    with (
        caplog.at_level(logging.WARNING, logger="rollout_broker.client"),
        BrokerClient("broker:8000", retry=Retry(retries=3, backoff_s=0.001)) as client,
        pytest.raises(BrokerUnreachable, match="broker:8000/v1/runs: UnsupportedProtocol"),
    ):
        client.list_runs()
    assert not caplog.records  # raised at the first attempt, none resent


def _flaky_broker(answering: list[bool], seen: list[str]) -> httpx.MockTransport:
    """A broker that refuses connections, but answers while ``answering[0]``."""

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        if not answering[0]:
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200, json={})

    return httpx.MockTransport(handle)


FIRST_CONTACT = Retry(deadline_s=None, retries=3, backoff_s=0.001, first_contact_s=0.0)


def _check_first_contact_logs(caplog: pytest.LogCaptureFixture, seen: list[str]) -> None:
    resends = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage().split(";")[0] for r in resends] == [
        "GET http://broker:8000/v1/runs/r: ConnectError: connection refused"
    ] * 3
    assert [r.getMessage().split(" s ")[1] for r in resends] == [
        "(attempt 2)",
        "(attempt 3)",
        "(attempt 4)",
    ]
    assert seen == ["/v1/runs/r", "/healthz", *["/v1/runs/r"] * 4]


def test_the_blocking_client_of_a_broker_never_reached_fails_fast(
    caplog: pytest.LogCaptureFixture,
) -> None:
    answering, seen = [False], []
    http = httpx.Client(transport=_flaky_broker(answering, seen))
    client = BrokerClient("http://broker:8000", http=http, retry=FIRST_CONTACT)
    with caplog.at_level(logging.WARNING, logger="rollout_broker.client"):
        with pytest.raises(BrokerUnreachable, match="never answered this client") as first:
            client.get_run("r")  # first_contact_s=0: the first failure is the last
        assert "http://broker:8000/v1/runs/r" in str(first.value)
        assert not caplog.records
        answering[0] = True
        assert client.healthz()
        answering[0] = False  # it answered once: its outage is ridden out, up to retries=3
        with pytest.raises(BrokerUnreachable, match="4 attempts") as later:
            client.get_run("r")
    assert "never answered" not in str(later.value)
    _check_first_contact_logs(caplog, seen)


async def test_the_async_client_of_a_broker_never_reached_fails_fast(
    caplog: pytest.LogCaptureFixture,
) -> None:
    answering, seen = [False], []
    http = httpx.AsyncClient(transport=_flaky_broker(answering, seen))
    client = AsyncBrokerClient("http://broker:8000", http=http, retry=FIRST_CONTACT)
    with caplog.at_level(logging.WARNING, logger="rollout_broker.client"):
        with pytest.raises(BrokerUnreachable, match="never answered this client"):
            await client.get_run("r")
        assert not caplog.records
        answering[0] = True
        assert await client.healthz()
        answering[0] = False
        with pytest.raises(BrokerUnreachable, match="4 attempts") as later:
            await client.get_run("r")
    assert "never answered" not in str(later.value)
    _check_first_contact_logs(caplog, seen)
    await http.aclose()


def test_every_request_of_the_client_is_safe_to_resend() -> None:
    api = Api()
    calls: list[Call[Any]] = [
        api.create_run(None, None),
        api.set_policy("r", 1),
        api.post_rollouts("r", group("g", 1)),
        api.lease("r", 4, policy_version=None, wait_s=1, partial=False, trainer_id=None),
        api.ack("r", "b", logprobs=None, kl=None, step=None),
        api.nack("r", "b"),
        api.work("r", 2, generator_id=None, wait_s=1, lease_id=None),
        api.return_work("r", "l", None),
        api.register_prompts("r", ["p"], 1),
        api.accounting("r"),
    ]
    assert all(c.idempotent and c.retry_statuses == (502, 503, 504) for c in calls)
    assert api.create_run(None, None).content != api.create_run(None, None).content  # own ids
    lease = calls[3]
    assert lease.params is not None and len(lease.params["batch_id"]) == 32


# -- against the app -----------------------------------------------------------------------------


async def test_outage_answers_are_waited_out_as_retry_after_says(
    quick: AsyncBrokerClient, recorder: Recorder
) -> None:
    await quick.create_run("ra", {"max_reuse": 1})
    recorder.answer["POST /rollouts"] = [503, 502, 504]
    recorder.retry_after = "0.2"
    t0 = time.monotonic()
    async with quick.writer("ra") as w:
        await w.add(*group("a", 3))
    waited = time.monotonic() - t0
    assert [s for _, s in recorder.answered] == [503, 502, 504]
    assert (w.accepted, w.pending, w.requests) == (3, 0, 1)
    assert waited >= 0.6  # three times the Retry-After of 0.2 s


async def test_each_resend_is_logged_with_its_url_error_and_pause(
    quick: AsyncBrokerClient, recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    await quick.create_run("logged")
    recorder.answer["GET /v1/runs/logged"] = [503, 502]
    with caplog.at_level(logging.WARNING, logger="rollout_broker.client"):
        assert (await quick.get_run("logged")).run_id == "logged"
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert [re.sub(r"in [0-9.]+ s", "in _ s", line) for line in lines] == [
        "GET http://broker/v1/runs/logged: 503 Unavailable: canned; resending in _ s (attempt 2)",
        "GET http://broker/v1/runs/logged: 502 HTTP502: canned; resending in _ s (attempt 3)",
    ]


async def test_a_call_gives_up_at_its_deadline(recorder: Recorder) -> None:
    http = httpx.AsyncClient(transport=recorder, base_url="http://broker")
    retry = Retry(deadline_s=0.5, backoff_s=0.02, max_backoff_s=0.05)
    client = AsyncBrokerClient(http=http, retry=retry)
    recorder.answer["GET /v1/runs/gone"] = [503] * 1000
    t0 = time.monotonic()
    with pytest.raises(Unavailable) as err:
        await client.get_run("gone")
    elapsed = time.monotonic() - t0
    assert err.value.status == 503
    assert 0.4 <= elapsed < 1.5
    assert len(recorder.answered) > 5  # retried all along, not a fixed few times
    await http.aclose()


async def test_trainer_and_generator_calls_are_retried_through_an_outage(
    quick: AsyncBrokerClient, recorder: Recorder
) -> None:
    for key in ("POST /v1/runs", "POST /policy", "POST /prompts", "GET /accounting"):
        recorder.answer[key] = [503]
    await quick.create_run("out", {"max_reuse": 1, "group_size": 2})
    assert (await quick.set_policy("out", 0)).policy_version == 0
    assert (await quick.register_prompts("out", ["q0", "q1"])).accepted == 2
    await quick.post_rollouts("out", group("g", 2))

    # A lease is resent with the batch_id the client chose, so it can only ever get one batch.
    recorder.answer["GET /batch"] = [503, 504]
    recorder.answer["POST /ack"] = [503, 502]
    async with quick.lease("out", 2) as batch:
        assert batch
    assert batch.ack_result is not None and batch.ack_result.consumed == 2
    lease_ids = {
        q.url.params["batch_id"] for q, _ in recorder.answered if q.url.path.endswith("/batch")
    }
    assert lease_ids == {batch.batch_id}

    await quick.post_rollouts("out", group("h", 2))
    recorder.answer["POST /nack"] = [503]
    with pytest.raises(RuntimeError, match="trainer failed"):
        async with quick.lease("out", 2) as second:
            assert second
            raise RuntimeError("trainer failed")

    recorder.answer["POST /work"] = [503]
    recorder.answer["POST /return"] = [503]
    async for lease in quick.work("out", max_prompts=2, wait_s=0, stop_when_empty=True):
        assert len(lease) == 2
        break  # the loop's lease goes back before the next request
    await quick.accounting("out")
    assert not any(recorder.answer.values())  # every outage answer was met and waited out
    for suffix in ("/ack", "/nack", "/work", "/return"):
        reached = [r.status_code for q, _, r in recorder.exchanges if q.url.path.endswith(suffix)]
        assert reached == [200], suffix


async def test_a_500_is_not_retried_and_the_writer_keeps_its_rollouts(
    quick: AsyncBrokerClient, recorder: Recorder
) -> None:
    await quick.create_run("five", {"max_reuse": 1})
    recorder.answer["POST /rollouts"] = [500]
    w = quick.writer("five", batch_size=3)
    sent = group("a", 3)
    with pytest.raises(InternalError) as err:
        await w.add(*sent)
    assert len(recorder.answered) == 1  # a bug is not an outage: asked once
    assert ids(err.value.unsent) == ids(sent)
    assert w.pending == 3 and ids(w.unsent) == ids(sent)
    await w.flush()
    assert (w.accepted, w.pending) == (3, 0)
    assert posted_ids(recorder) == [ids(sent)]


async def test_the_writer_keeps_what_it_could_not_send_and_catches_up_in_batches(
    recorder: Recorder,
) -> None:
    http = httpx.AsyncClient(transport=recorder, base_url="http://broker")
    client = AsyncBrokerClient(http=http, retry=Retry(retries=1, backoff_s=0.001), format="json")
    await client.create_run("keep", {"max_reuse": 1})
    w = client.writer("keep", batch_size=4)
    a, b, c = group("a", 3), group("b", 2), group("c", 2)

    recorder.answer["POST /rollouts"] = [503, 503]  # the first and its one resend
    with pytest.raises(Unavailable) as unavailable:
        await w.add(*a, *group("a0", 1))  # four: a request goes out
    assert ids(unavailable.value.unsent) == [*ids(a), "a0-0"]

    recorder.refuse.update({"POST /rollouts", "POST /keep/rollouts"})  # the broker is gone
    with pytest.raises(BrokerUnreachable) as unreachable:
        await w.add(*b)
    assert ids(unreachable.value.unsent) == [*ids(a), "a0-0", *ids(b)]
    assert w.pending == 6

    await w.add(*c)  # back: the buffer goes out oldest first, a whole add() per request
    assert w.pending == 0
    assert posted_ids(recorder) == [[*ids(a), "a0-0"], ids(b) + ids(c)]
    assert (w.accepted, w.duplicates, w.requests) == (8, 0, 2)
    await http.aclose()


async def test_a_request_refused_as_a_whole_leaves_the_buffer_but_names_its_rollouts(
    quick: AsyncBrokerClient,
) -> None:
    w = quick.writer("no-such-run", batch_size=2)
    with pytest.raises(RunNotFound) as err:
        await w.add(*group("x", 2))
    assert ids(err.value.unsent) == ["x-0", "x-1"]
    assert w.pending == 0  # sending it again would fail the same way


def test_the_blocking_writer_keeps_its_rollouts_through_an_outage() -> None:
    outage = True
    seen: list[str] = []

    def broker(request: httpx.Request) -> httpx.Response:
        if outage:
            body = {"error": "Unavailable", "detail": "Redis is unreachable"}
            return httpx.Response(503, headers={"retry-after": "0"}, json=body)
        docs = json.loads(request.content)["rollouts"]
        seen.extend(d["rollout_id"] for d in docs)
        return httpx.Response(202, json={"accepted": len(docs), "duplicates": 0, "rejected": []})

    http = httpx.Client(transport=httpx.MockTransport(broker), base_url="http://broker")
    retry = Retry(deadline_s=0.2, backoff_s=0.01, max_backoff_s=0.02)
    with BrokerClient(http=http, retry=retry, format="json") as client:
        w = client.writer("r", batch_size=2)
        with pytest.raises(Unavailable) as err:
            w.add(*group("s", 2))
        assert ids(err.value.unsent) == ["s-0", "s-1"] and w.pending == 2
        outage = False
        with w:
            w.add(*group("t", 1))
    assert seen == ["s-0", "s-1", "t-0"]
    assert (w.accepted, w.pending) == (3, 0)
