"""Redis that answers but refuses writes is an outage: ``503 Unavailable`` with ``Retry-After``,
never ``500``. A master whose ``min-replicas-to-write`` its replicas do not meet (just after a
failover, until a replica attaches to the promoted master) answers ``NOREPLICAS``; a replica
answers ``READONLY``. The refusal changed nothing, /readyz says so while it lasts, and the
client's retry of the same request is accepted exactly once when Redis takes writes again."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.exceptions
from redis.asyncio import Redis
from redis.crc import key_slot
from rollout_broker_client import AsyncBrokerClient, Retry

from app import keys
from app.errors import outage_of, write_refusal_of
from app.main import create_app
from app.settings import Settings
from tests.api.support import assert_error
from tests.helpers import drain_heartbeat
from tests.processes import KillableRedis, RedisServer

RUN = "r"


def _rollout(rollout_id: str) -> dict[str, Any]:
    return {"rollout_id": rollout_id, "policy_version": 0, "response_ids": [1, 2], "reward": 1.0}


# -- which errors are refusals: real replies of a Redis of the test's own ------------------------


async def _error_of(call: Callable[[], Awaitable[Any]]) -> BaseException:
    with pytest.raises(redis.exceptions.RedisError) as caught:
        await call()
    return caught.value


async def _refusals_of(client: Redis) -> list[BaseException]:
    """What redis-py raises for a refused write: a command, a script whose write comes after a
    read, a pipeline and a transaction (one command refused among others)."""
    script = "redis.call('get', KEYS[1]); return redis.call('set', KEYS[1], 1)"
    found = [
        await _error_of(lambda: client.set("k", 1)),
        await _error_of(lambda: client.eval(script, 1, "k")),
    ]
    for transaction in (False, True):
        async with client.pipeline(transaction=transaction) as pipe:
            pipe.get("k").set("k", 1).eval(script, 1, "k")
            found.append(await _error_of(pipe.execute))
    return found


async def test_a_refused_write_is_a_redis_outage_and_nothing_else_is(tmp_path: Path) -> None:
    master, replica = RedisServer(tmp_path / "m"), RedisServer(tmp_path / "r")
    for server in (master, replica):
        server.data_dir.mkdir()
        await server.start()
    m, r = Redis(port=master.port), Redis(port=replica.port)
    try:
        await m.config_set("min-replicas-to-write", 1)  # and no replica attached yet
        for exc in await _refusals_of(m):
            assert (write_refusal_of(exc), outage_of(exc)) == ("NOREPLICAS", "Redis"), exc
        assert await m.get("k") is None  # the script's read ran, its write did not

        await r.replicaof("127.0.0.1", master.port)  # READONLY at once, synced or not
        for exc in await _refusals_of(r):
            assert (write_refusal_of(exc), outage_of(exc)) == ("READONLY", "Redis"), exc
    finally:
        await m.aclose()
        await r.aclose()
        await master.kill()
        await replica.kill()
    for bug in (
        redis.exceptions.ResponseError("WRONGTYPE Operation against a key"),
        redis.exceptions.ResponseError("ERR unknown key 'NOREPLICAS x'"),
        redis.exceptions.ResponseError("Command # 1 (GET NOREPLICAS ) of pipeline caused error: x"),
    ):
        assert (write_refusal_of(bug), outage_of(bug)) == (None, None), bug


# -- through the API ----------------------------------------------------------------------------


@dataclass
class Refusing:
    """The app in-process on a Redis of the test's own (on a cluster, 3 masters); ``node`` is
    the Redis serving run ``r``, whose ``min-replicas-to-write`` the test sets."""

    http: httpx.AsyncClient
    node: Redis
    redis: Redis
    answered_503: asyncio.Event

    async def snapshot(self, prefix: str) -> dict[bytes, bytes | None]:
        """Every key of the prefix and its serialized value (DUMP)."""
        found = [k async for k in self.redis.scan_iter(match=keys.every_key(prefix))]
        return {k: await self.redis.dump(k) for k in sorted(found)}


class _Watching(httpx.AsyncBaseTransport):
    """A transport that sets ``answered_503`` when an answer is a 503."""

    def __init__(self, inner: httpx.AsyncBaseTransport, answered_503: asyncio.Event) -> None:
        self.inner = inner
        self.answered_503 = answered_503

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if response.status_code == 503:
            self.answered_503.set()
        return response


@pytest.fixture
async def refusing(backend: str, settings: Settings, tmp_path: Path) -> AsyncIterator[Refusing]:
    server = KillableRedis(backend, tmp_path, keys.run_key(settings.redis_prefix, RUN))
    await server.start()
    own = settings.model_copy(
        update={"redis_url": server.backend.url, "redis_cluster": server.backend.cluster}
    )
    port = server.node.port if server.node else server.run_node()
    node, client = Redis(port=port), server.backend.client()
    app = create_app(own)
    answered_503 = asyncio.Event()
    try:
        async with app.router.lifespan_context(app):
            inner = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            transport = _Watching(inner, answered_503)
            async with httpx.AsyncClient(transport=transport, base_url="http://broker") as http:
                yield Refusing(http, node, client, answered_503)
    finally:
        await node.config_set("min-replicas-to-write", 0)
        await node.aclose()
        await client.aclose()
        await server.stop()


async def _set_up(http: httpx.AsyncClient) -> None:
    """Run ``r`` with rollouts, a leased batch ``batch-one``, prompts and a work lease."""
    assert (await http.post("/v1/runs", json={"run_id": RUN})).status_code == 201
    body = {"rollouts": [_rollout("a"), _rollout("b")]}
    assert (await http.post(f"/v1/runs/{RUN}/rollouts", json=body)).status_code == 202
    resp = await http.get(f"/v1/runs/{RUN}/batch?size=1&batch_id=batch-one")
    assert resp.status_code == 200, resp.text
    body = {"prompts": [{"prompt_id": "p0"}, {"prompt_id": "p1"}]}
    assert (await http.post(f"/v1/runs/{RUN}/prompts", json=body)).status_code == 202
    work = {"max_prompts": 1, "lease_id": "work-one"}
    assert (await http.post(f"/v1/runs/{RUN}/work", json=work)).status_code == 200


WRITES: list[tuple[str, str, dict[str, Any]]] = [
    ("POST", f"/v1/runs/{RUN}/rollouts", {"rollouts": [_rollout("c")]}),
    ("POST", f"/v1/runs/{RUN}/policy", {"version": 1}),
    ("GET", f"/v1/runs/{RUN}/batch?size=1&batch_id=batch-two", {}),
    ("POST", f"/v1/runs/{RUN}/batches/batch-one/ack", {}),
    ("POST", f"/v1/runs/{RUN}/batches/batch-one/nack", {}),
    ("POST", f"/v1/runs/{RUN}/prompts", {"prompts": [{"prompt_id": "p2"}]}),
    ("POST", f"/v1/runs/{RUN}/work", {"max_prompts": 1, "lease_id": "work-two"}),
    ("POST", f"/v1/runs/{RUN}/work/work-one/return", {}),
    ("PATCH", f"/v1/runs/{RUN}/config", {"max_reuse": 2}),
    ("POST", f"/v1/runs/{RUN}/close", {}),
]


async def test_writes_redis_refuses_are_503_change_nothing_and_are_retried_once(
    refusing: Refusing, settings: Settings
) -> None:
    http = refusing.http
    await _set_up(http)
    await drain_heartbeat(refusing.redis, settings.redis_prefix)  # a worker runs
    assert (await http.get("/readyz")).status_code == 200
    before = await refusing.snapshot(settings.redis_prefix)

    await refusing.node.config_set("min-replicas-to-write", 1)  # no replica attached
    for method, path, body in WRITES:
        resp = await http.request(method, path, json=body if method != "GET" else None)
        detail = assert_error(resp, 503, "Unavailable")
        assert resp.headers["retry-after"] == "1", path  # BROKER_RETRY_AFTER_S
        assert detail.startswith("Redis refuses writes for now (NOREPLICAS)"), (path, detail)
    assert (await http.get(f"/v1/runs/{RUN}")).status_code == 200  # reads are served
    ready = await http.get("/readyz")
    assert "redis refuses writes: NOREPLICAS" in assert_error(ready, 503, "Unavailable")
    assert await refusing.snapshot(settings.redis_prefix) == before  # nothing stored

    # The client resends a 503 after its Retry-After; Redis takes writes again meanwhile.
    refusing.answered_503.clear()
    client = AsyncBrokerClient(http=http, format="json", retry=Retry(deadline_s=30.0))
    posting = asyncio.create_task(client.post_rollouts(RUN, [_rollout("c")]))
    await refusing.answered_503.wait()
    assert not posting.done()
    await refusing.node.config_set("min-replicas-to-write", 0)
    result = await posting
    assert (result.accepted, result.duplicates, result.rejected) == (1, 0, [])
    again = await client.post_rollouts(RUN, [_rollout("c")])
    assert (again.accepted, again.duplicates) == (0, 1)
    assert (await http.get("/readyz")).status_code == 200


# -- the audit log on a cluster ---------------------------------------------------------------


@pytest.mark.one_node  # a cluster of its own: the test makes one of its masters refuse writes
async def test_a_master_refusing_writes_holds_up_the_audit_of_its_own_runs_only(
    settings: Settings, tmp_path: Path
) -> None:
    """An action's entry once went to one global stream, after the change: while the master
    holding that stream refused writes, a policy change on a run of a healthy master was
    applied, then answered an error, and its entry was lost. The entry is written to the run's
    own slot, with the change."""
    prefix = settings.redis_prefix
    cluster = KillableRedis("cluster", tmp_path, keys.audit_key(prefix))
    await cluster.start()
    refusing = Redis(port=cluster.run_node())  # the master of the old global stream
    own = settings.model_copy(update={"redis_url": cluster.backend.url, "redis_cluster": True})
    app = create_app(own)
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://broker") as http:
                theirs = await _slots_of(refusing)
                run = next(
                    f"run-{n}"
                    for n in range(100)
                    if key_slot(keys.run_key(prefix, f"run-{n}").encode()) not in theirs
                )
                assert (await http.post("/v1/runs", json={"run_id": run})).status_code == 201
                await refusing.config_set("min-replicas-to-write", 1)  # no replica attached
                resp = await http.post(f"/v1/runs/{run}/policy", json={"version": 1})
                assert resp.status_code == 200, resp.text
                entries = (await http.get("/v1/audit")).json()["entries"]
                assert [(e["action"], e["run_id"]) for e in entries] == [
                    ("run.policy", run),
                    ("run.create", run),
                ]
                assert entries[0]["detail"] == {"version": 1}
    finally:
        await refusing.config_set("min-replicas-to-write", 0)
        await refusing.aclose()
        await cluster.stop()


async def _slots_of(node: Redis) -> set[int]:
    """The slots the node serves as a master."""
    port = node.connection_pool.connection_kwargs["port"]
    slots: set[int] = set()
    for first, last, (_, owner, *_), *_ in await node.execute_command("CLUSTER SLOTS"):
        if int(owner) == port:
            slots.update(range(first, last + 1))
    return slots
