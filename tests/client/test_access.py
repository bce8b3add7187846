"""The client against a broker with auth on (the app in-process, through a :class:`Recorder` that
counts the requests): its token on every request, from ``token=`` or ``BROKER_TOKEN``; 401 and
403 as :class:`Unauthorized` and :class:`Forbidden`, never sent again; tokens and the audit log;
and the token never in a repr, an exception or a log line."""

from __future__ import annotations

import contextlib
import logging
import secrets
import traceback
from collections.abc import AsyncIterator, Iterator

import httpx
import numpy as np
import pytest
from pydantic import SecretStr
from rollout_broker_client import (
    AccessToken,
    AsyncBrokerClient,
    BrokerClient,
    BrokerError,
    BrokerHTTPError,
    BrokerUnreachable,
    Forbidden,
    NewToken,
    Retry,
    Rollout,
    SyncASGITransport,
    TokenNotFound,
    Unauthorized,
)
from rollout_broker_client._wire import Api

from app.main import create_app
from app.settings import Settings
from tests.client.recorder import Recorder
from tests.helpers import KNOWN_SECRETS

ADMIN = secrets.token_urlsafe(32)
KNOWN_SECRETS.add(ADMIN)  # the session's log watch fails the run if a log line holds it


@pytest.fixture(autouse=True)
def no_token_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BROKER_TOKEN", raising=False)


@pytest.fixture
def auth_settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"auth": True, "admin_token": SecretStr(ADMIN)})


@pytest.fixture
async def guarded(auth_settings: Settings) -> AsyncIterator[Recorder]:
    """The app with auth on, in-process, behind a recorder."""
    app = create_app(auth_settings)
    async with app.router.lifespan_context(app):
        yield Recorder(httpx.ASGITransport(app=app, raise_app_exceptions=False))


@contextlib.asynccontextmanager
async def client(
    recorder: Recorder, token: str | None = None, **kwargs: object
) -> AsyncIterator[AsyncBrokerClient]:
    """A client through ``recorder`` that would resend at once, and often, what it resends."""
    retry = Retry(retries=5, backoff_s=0.001, max_backoff_s=0.002)
    async with (
        httpx.AsyncClient(transport=recorder, base_url="http://broker") as http,
        AsyncBrokerClient(http=http, retry=retry, token=token, **kwargs) as broker,  # type: ignore[arg-type]
    ):
        yield broker


def sent_tokens(recorder: Recorder) -> list[str | None]:
    return [req.headers.get("authorization") for req, _, _ in recorder.exchanges]


def group(name: str, k: int = 2) -> list[Rollout]:
    return [
        Rollout(f"{name}-{i}", 0, [1, 2], float(i), [-0.5, -0.5], group_id=name) for i in range(k)
    ]


# -- the token on the wire -----------------------------------------------------------------------


async def test_the_client_sends_its_token_on_every_request(guarded: Recorder) -> None:
    async with client(guarded, ADMIN) as broker:
        await broker.create_run("r1")
        await broker.post_rollouts("r1", group("g"))
        assert await broker.lease_batch("r1", 2) is not None
        assert [r.run_id for r in await broker.list_runs()] == ["r1"]
    assert len(guarded.exchanges) == 4
    assert sent_tokens(guarded) == [f"Bearer {ADMIN}"] * 4


async def test_the_token_defaults_to_broker_token_and_an_empty_one_sends_none(
    guarded: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BROKER_TOKEN", ADMIN)
    async with client(guarded) as broker:
        assert await broker.list_runs() == []
    async with client(guarded, token="") as broker:
        with pytest.raises(Unauthorized):
            await broker.list_runs()
    assert sent_tokens(guarded) == [f"Bearer {ADMIN}", None]


def test_a_token_that_cannot_be_a_header_is_refused_without_being_quoted() -> None:
    bad = "rb_0123456789abcdef_sec ret\n"
    with pytest.raises(ValueError) as caught:
        BrokerClient("http://127.0.0.1:9", token=bad)
    assert "sec" not in str(caught.value) and "BROKER_TOKEN" in str(caught.value)


# -- 401 and 403: typed, and sent once ------------------------------------------------------------


async def test_401_and_403_are_typed_and_never_sent_again(guarded: Recorder) -> None:
    async with client(guarded) as anonymous:
        with pytest.raises(Unauthorized) as no_token:
            await anonymous.list_runs()
    err = no_token.value
    assert isinstance(err, BrokerHTTPError) and isinstance(err, BrokerError)
    assert (err.status, err.error) == (401, "Unauthorized")
    assert "Bearer" in err.detail and err.headers["www-authenticate"] == "Bearer"
    assert len(guarded.exchanges) == 1

    async with client(guarded, "rb_0123456789abcdef_" + "x" * 43) as unknown:
        with pytest.raises(Unauthorized, match="unknown or revoked token"):
            await unknown.create_run("r1")
    assert len(guarded.exchanges) == 2

    async with client(guarded, ADMIN) as admin:
        await admin.create_run("r1")
        generator = await admin.create_token("gen", ["generate"], ["r1"])
    assert len(guarded.exchanges) == 4
    async with client(guarded, generator.token) as gen:
        with pytest.raises(Forbidden) as lacking:
            await gen.set_policy("r1", 1)
        assert (lacking.value.status, lacking.value.error) == (403, "Forbidden")
        assert "scope" in lacking.value.detail
        assert len(guarded.exchanges) == 5
        with pytest.raises(Forbidden, match="may not touch run"):
            await gen.post_rollouts("r2", group("g"))
        assert len(guarded.exchanges) == 6
        # The writer raises as well, at once, with the rollouts the broker did not take.
        writer = gen.writer("r2", batch_size=2)
        with pytest.raises(Forbidden) as refused:
            await writer.add(*group("h"))
        assert [r.rollout_id for r in refused.value.unsent] == ["h-0", "h-1"]  # type: ignore[union-attr]
        assert len(guarded.exchanges) == 7
        assert (await gen.post_rollouts("r1", group("g"))).accepted == 2


async def test_a_401_or_403_of_a_proxy_is_typed_by_its_status(guarded: Recorder) -> None:
    guarded.answer["GET /v1/runs"] = [401, 403]
    async with client(guarded, ADMIN) as broker:
        with pytest.raises(Unauthorized):
            await broker.list_runs()
        with pytest.raises(Forbidden):
            await broker.list_runs()
        assert await broker.list_runs() == []
    assert [status for _, status in guarded.answered] == [401, 403]


# -- tokens and the audit log --------------------------------------------------------------------


async def test_tokens_are_created_listed_and_revoked(guarded: Recorder) -> None:
    async with client(guarded, ADMIN) as admin:
        new = await admin.create_token("trainer-7", "train", "team-*")
        assert isinstance(new, NewToken)
        assert (new.name, new.scopes, new.runs) == ("trainer-7", ["train"], ["team-*"])
        assert new.token.startswith(f"rb_{new.token_id}_")
        assert new.token not in repr(new) and new.token not in str(new)

        [listed] = await admin.list_tokens()
        assert isinstance(listed, AccessToken)
        assert (listed.token_id, listed.name, listed.scopes) == (
            new.token_id,
            "trainer-7",
            ["train"],
        )
        assert (listed.runs, listed.created_by, listed.revoked) == (["team-*"], "bootstrap", False)
        assert listed.created_at == new.created_at

        async with client(guarded, new.token) as trainer:
            await admin.create_run("team-1")
            assert (await trainer.set_policy("team-1", 1)).policy_version == 1
            # Given the whole token, revoke_token sends only its id: no secret in a URL.
            await admin.revoke_token(new.token)
            req = guarded.exchanges[-1][0]
            assert req.url.path == f"/v1/tokens/{new.token_id}"
            await admin.revoke_token(new.token_id)  # again: nothing changes
            with pytest.raises(Unauthorized):
                await trainer.set_policy("team-1", 2)
        with pytest.raises(TokenNotFound):
            await admin.revoke_token("0000000000000000")
        [revoked] = await admin.list_tokens()
        assert revoked.revoked and revoked.revoked_at is not None


async def test_a_token_creation_whose_answer_is_lost_is_not_sent_again(guarded: Recorder) -> None:
    guarded.lose_answer.add("POST /v1/tokens")
    async with client(guarded, ADMIN) as admin:
        with pytest.raises(BrokerUnreachable):
            await admin.create_token("lost", ["generate"])
        assert sum(req.url.path == "/v1/tokens" for req, _, _ in guarded.exchanges) == 1
        # It was created (its secret is lost): revoke it.
        [orphan] = await admin.list_tokens()
        await admin.revoke_token(orphan.token_id)
    assert not Api().create_token("x", ["train"], None).idempotent


async def test_the_audit_log_reads_a_page_at_a_time(guarded: Recorder) -> None:
    async with client(guarded, ADMIN) as admin:
        ops = await admin.create_token("alice", ["operate"])
        trainer = await admin.create_token("trainer-0", ["train"], ["a"])
    async with client(guarded, ops.token) as alice, client(guarded, trainer.token) as t0:
        await alice.create_run("a")
        await alice.create_run("b")
        await t0.set_policy("a", 1)
        await alice.close_run("a")

        first = await alice.audit(limit=3)
        assert len(first) == 3 and first.next_cursor is not None
        got = [(e.actor, e.action, e.run_id) for e in first]
        assert got == [("alice", "run.close", "a"), ("trainer-0", "run.policy", "a"),
                       ("alice", "run.create", "b")]  # fmt: skip
        assert first.entries[1].detail == {"version": 1}
        assert [e.token_id for e in first] == [ops.token_id, trainer.token_id, ops.token_id]
        rest = []
        cursor: str | None = first.next_cursor
        while cursor is not None:  # the last page may be empty: the broker cannot tell sooner
            page = await alice.audit(limit=3, cursor=cursor)
            rest += page.entries
            cursor = page.next_cursor
        assert [e.action for e in rest] == ["run.create", "token.create", "token.create"]
        assert [e.token_id for e in rest] == [ops.token_id, "bootstrap", "bootstrap"]

        every = [e async for e in alice.audit_entries(page_size=2)]
        assert [e.id for e in every] == [e.id for e in [*first, *rest]]
        assert every == sorted(every, key=lambda e: e.id, reverse=True)
        of_a = [(e.actor, e.action) async for e in alice.audit_entries("a", page_size=1)]
        assert of_a == [
            ("alice", "run.close"),
            ("trainer-0", "run.policy"),
            ("alice", "run.create"),
        ]
        with pytest.raises(Forbidden):
            await t0.audit()  # the audit log is for operators


# -- the token never shows -----------------------------------------------------------------------


def _text_of(err: BaseException) -> str:
    return "".join(traceback.format_exception(err)) + repr(err) + str(err)


async def test_the_token_is_in_no_repr_exception_or_log_line(
    guarded: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    secret = "rb_0123456789abcdef_" + secrets.token_urlsafe(32)
    async with client(guarded, secret) as broker:
        assert secret not in repr(broker) and secret not in str(broker)
        assert "token='***'" in repr(broker)
        assert "__dict__" not in dir(broker) or secret not in str(vars(broker))
        guarded.answer["GET /v1/runs"] = [503]  # a resend, which is logged
        with pytest.raises(Unauthorized) as caught:
            await broker.list_runs()
    assert secret not in _text_of(caught.value)
    assert "resending" in caplog.text and secret not in caplog.text
    async with client(guarded) as anonymous:
        assert repr(anonymous).endswith("token=None)")


def test_a_proxy_that_echoes_the_request_does_not_reveal_the_token(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    secret = secrets.token_urlsafe(32)

    def echo(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/runs":
            return httpx.Response(502, text=f"bad gateway for {request.headers['authorization']}")
        raise httpx.ConnectError(f"refused {request.headers['authorization']}", request=request)

    http = httpx.Client(transport=httpx.MockTransport(echo), base_url="http://proxy")
    with BrokerClient(http=http, token=secret, retry=Retry(retries=1, backoff_s=0.001)) as broker:
        with pytest.raises(BrokerHTTPError) as gateway:
            broker.list_runs()
        assert gateway.value.status == 502 and "Bearer ***" in gateway.value.detail
        with pytest.raises(BrokerUnreachable) as refused:
            broker.get_run("r")
    assert secret not in _text_of(gateway.value)
    # The transport's own exception stays the cause, as httpx raised it (httpx never quotes a
    # header in one; this transport does, to show that the client's text does not).
    assert "refused Bearer ***" in str(refused.value)
    assert secret not in str(refused.value) + repr(refused.value)
    assert secret not in caplog.text


# -- the blocking client -------------------------------------------------------------------------


@pytest.fixture
def sync_transport(auth_settings: Settings) -> Iterator[SyncASGITransport]:
    with SyncASGITransport(create_app(auth_settings)) as transport:
        yield transport


def test_the_blocking_client_sends_its_token_and_raises_the_same(
    sync_transport: SyncASGITransport, monkeypatch: pytest.MonkeyPatch
) -> None:
    with httpx.Client(transport=sync_transport, base_url="http://broker") as http:
        with pytest.raises(Unauthorized):
            BrokerClient(http=http).list_runs()
        monkeypatch.setenv("BROKER_TOKEN", ADMIN)
        admin = BrokerClient(http=http)
        gen = admin.create_token("gen", ["generate"])
        admin.create_run("s1")
        generator = BrokerClient(http=http, token=gen.token)
        with generator.writer("s1", batch_size=2) as w:
            w.add(*group("g"))
        assert w.accepted == 2
        with pytest.raises(Forbidden):
            generator.lease_batch("s1", 2)
        batch = admin.lease_batch("s1", 2)
        assert batch is not None
        np.testing.assert_array_equal(batch.rollouts[0].response_ids, [1, 2])
        assert [t.name for t in admin.list_tokens()] == ["gen"]
        actions = [e.action for e in admin.audit_entries()]
        assert actions == ["run.create", "token.create"]
