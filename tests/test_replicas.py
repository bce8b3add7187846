"""``BROKER_REDIS_WAIT_REPLICAS``: a state-changing answer is sent only once its write reached the
replicas asked for (app/replicas.py), else ``503`` with ``Retry-After``, and the client's resend
is idempotent; the accounting drain commits a run's events only once they have. On a master and
a replica of the tests' own (the replica SIGSTOPped to hold its acknowledgements back), and on a
3-master cluster with a replica each."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from redis import Redis as SyncRedis
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app import keys
from app.accounting.drain import DrainOptions
from app.broker.config import RunConfig
from app.broker.store import RedisStore
from app.errors import NotReplicated, Unavailable
from app.health import replicas_check
from app.main import create_app
from app.replicas import Replicas
from app.settings import Settings
from app.wiring import broker_for, cluster_client
from tests.broker.test_store import packed
from tests.helpers import drain_heartbeat, lease, make_run, post, rollout, until_long_polling
from tests.processes import RedisClusterServers, RedisServer
from tests.services import delete_prefix, new_prefix
from workers.drain import DrainContext, drain_once

TIMEOUT_MS = 400  # how long a write waits for its replica here


@dataclass
class Pair:
    """A master and its replica; ``master`` is a client of the former."""

    primary: RedisServer
    secondary: RedisServer
    master: Redis
    replica: Redis

    @contextlib.contextmanager
    def replica_frozen(self) -> Iterator[None]:
        """The replica SIGSTOPped: connected, acknowledging nothing."""
        self.secondary.freeze()
        try:
            yield
        finally:
            self.secondary.thaw()


@pytest.fixture(scope="module")
async def pair(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Pair]:
    primary = RedisServer(tmp_path_factory.mktemp("master"))
    secondary = RedisServer(tmp_path_factory.mktemp("replica"))
    await primary.start()
    await secondary.start()
    master, replica = Redis(port=primary.port), Redis(port=secondary.port)
    try:
        await replica.replicaof("127.0.0.1", primary.port)
        await master.set("attached", 1)
        assert await master.execute_command("WAIT", 1, 10_000) == 1  # in sync
        yield Pair(primary, secondary, master, replica)
    finally:
        await master.aclose()
        await replica.aclose()
        await secondary.kill()
        await primary.kill()


@pytest.fixture
async def own_prefix(pair: Pair) -> AsyncIterator[str]:
    p = new_prefix()
    yield p
    await delete_prefix(pair.master, p)


async def test_a_write_is_answered_only_once_its_replica_has_it(pair: Pair, own_prefix: str):
    store = RedisStore(pair.master, own_prefix, Replicas(pair.master, 1, TIMEOUT_MS))
    assert await store.create_run("r", RunConfig()) == "created"
    blob = keys.member_key(own_prefix, "r", keys.BLOB, "a")
    with pair.replica_frozen():
        started = time.monotonic()
        with pytest.raises(NotReplicated) as caught:
            await store.ingest("r", [packed("a")])
        took = time.monotonic() - started
        assert TIMEOUT_MS / 1000 <= took < TIMEOUT_MS / 1000 + 2, took
        assert (caught.value.wanted, caught.value.acknowledged) == (1, 0)
        assert caught.value.headers == {"Retry-After": "1"}
        assert await pair.master.exists(blob) == 1  # made on the master: resends must be idempotent
        # The resend, through another connection (as through another API process), finds a
        # duplicate and changes nothing; it is still not an answer to send while the first
        # try's write is on the master alone.
        async with Redis(port=pair.primary.port) as other:
            again = RedisStore(other, own_prefix, Replicas(other, 1, TIMEOUT_MS))
            with pytest.raises(NotReplicated):
                await again.ingest("r", [packed("a")])
    async with Redis(port=pair.primary.port) as other:
        again = RedisStore(other, own_prefix, Replicas(other, 1, TIMEOUT_MS))
        outcome = await again.ingest("r", [packed("a")])
    assert (outcome.accepted, outcome.duplicates) == (0, 1)
    assert await pair.replica.exists(blob) == 1  # what the answer relied on is on the replica


async def test_a_repeat_that_writes_nothing_waits_for_the_write_it_repeats(
    pair: Pair, own_prefix: str
):
    """A repeated nack changes nothing, so Redis propagates nothing and WAIT alone would count
    the replicas at once; the barrier write makes it wait for the first nack's write."""
    store = RedisStore(pair.master, own_prefix, Replicas(pair.master, 1, TIMEOUT_MS))
    await store.create_run("r", RunConfig())
    await store.ingest("r", [packed("a")])
    got = await store.lease(
        "r", batch_id="b", size=1, policy_version=None, partial=False, trainer_id=None
    )
    assert not isinstance(got, int)
    async with Redis(port=pair.primary.port) as other:  # as another API process's connection
        again = RedisStore(other, own_prefix, Replicas(other, 1, TIMEOUT_MS))
        with pair.replica_frozen():
            with pytest.raises(NotReplicated):
                await store.nack("r", "b")
            with pytest.raises(NotReplicated):
                await again.nack("r", "b")
        assert await again.nack("r", "b") == ("repeat", 1)


async def test_a_refusal_waits_too(pair: Pair, own_prefix: str):
    """A refused call relies on earlier writes as much as an accepted one."""
    store = RedisStore(pair.master, own_prefix, Replicas(pair.master, 1, TIMEOUT_MS))
    await store.create_run("r", RunConfig())
    with pair.replica_frozen(), pytest.raises(NotReplicated):
        await store.create_run("r", RunConfig(max_reuse=2))  # else StoreError('run_conflict')


async def test_a_master_that_lost_its_functions_is_given_them_again(pair: Pair, own_prefix: str):
    store = RedisStore(pair.master, own_prefix, Replicas(pair.master, 1, TIMEOUT_MS))
    await pair.master.function_flush()  # as after a restart without persistence
    assert await store.create_run("r", RunConfig()) == "created"
    outcome = await store.ingest("r", [packed("a")])
    assert outcome.accepted == 1


async def test_with_the_setting_off_no_wait_is_sent(pair: Pair, own_prefix: str):
    broker = broker_for(pair.master, Settings(redis_url=pair.primary.url, redis_prefix=own_prefix))
    store = broker.store
    await pair.master.config_resetstat()
    await store.create_run("r", RunConfig())
    await store.ingest("r", [packed("a"), packed("b")])
    got = await store.lease(
        "r", batch_id="b1", size=2, policy_version=None, partial=False, trainer_id=None
    )
    assert not isinstance(got, int)
    stats = await pair.master.info("commandstats")
    assert "cmdstat_fcall" in stats
    assert "cmdstat_wait" not in stats and "cmdstat_set" not in stats


# -- through HTTP and the drain ------------------------------------------------------------------


@pytest.fixture
async def replicated_api(
    pair: Pair, own_prefix: str, database_url: str
) -> AsyncIterator[httpx.AsyncClient]:
    settings = Settings(
        allowed_hosts=("broker",),
        redis_url=pair.primary.url,
        database_url=database_url,
        redis_prefix=own_prefix,
        redis_wait_replicas=1,
        redis_wait_timeout_ms=TIMEOUT_MS,
    )
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://broker") as http:
            yield http


def _drain(pair: Pair, sessionmaker: async_sessionmaker[AsyncSession], prefix: str) -> DrainContext:
    settings = Settings(redis_wait_replicas=1, redis_wait_timeout_ms=TIMEOUT_MS, drain_block_ms=1)
    options = DrainOptions.from_settings(settings)  # as the worker makes them
    return DrainContext.create(pair.master, sessionmaker, prefix, options, consumer="c")


async def test_an_ingest_unreplicated_is_a_503_and_its_resend_counts_once(
    pair: Pair, own_prefix: str, replicated_api: httpx.AsyncClient, sessionmaker: Any
):
    await make_run(replicated_api, "r")
    with pair.replica_frozen():
        resp = await post(replicated_api, "r", rollout("a"))
        assert resp.status_code == 503, resp.text
        assert resp.headers["retry-after"] == "1"
        body = resp.json()
        assert body["error"] == "Unavailable"
        assert "0 of the 1 replicas" in body["detail"], body
    resp = await post(replicated_api, "r", rollout("a"))
    assert resp.status_code == 202, resp.text
    assert resp.json()["duplicates"] == 1
    # A long poll: its lease waits for a rollout, which wakes it.
    polling = asyncio.create_task(lease(replicated_api, "r", 2, wait_s=10))
    await until_long_polling(pair.master, own_prefix, "r")
    assert (await post(replicated_api, "r", rollout("b"))).status_code == 202
    assert len((await polling).json()["rollouts"]) == 2
    await drain_once(_drain(pair, sessionmaker, own_prefix))
    acc = (await replicated_api.get("/v1/runs/r/accounting")).json()
    assert (acc["rollouts_received"], acc["samples_consumed"]) == (2, 0), acc
    assert acc["pending_events"] == 0, acc


async def test_readiness_counts_each_masters_replicas(
    pair: Pair, own_prefix: str, replicated_api: httpx.AsyncClient
):
    await drain_heartbeat(pair.master, own_prefix)  # a worker runs
    resp = await replicated_api.get("/readyz")
    assert resp.status_code == 200, resp.text
    assert resp.json()["checks"]["replicas"] == "ok"
    assert await replicas_check(pair.master, 1) == "ok"
    assert await replicas_check(pair.master, 2) == (
        "1 connected, 2 asked for (BROKER_REDIS_WAIT_REPLICAS)"
    )


async def test_the_drain_commits_no_event_its_replica_lacks(
    pair: Pair, own_prefix: str, replicated_api: httpx.AsyncClient, sessionmaker: Any
):
    await make_run(replicated_api, "r")
    plain = RedisStore(pair.master, own_prefix)  # writes without waiting for the replica
    drain = _drain(pair, sessionmaker, own_prefix)
    await drain_once(drain)  # the run's group exists before the events come
    with pair.replica_frozen():
        await plain.ingest("r", [packed("a"), packed("b")])  # on the master alone
        counts = await drain_once(drain)
        assert counts.read > 0 and (counts.applied, counts.unreplicated) == (0, counts.read)
        acc = (await replicated_api.get("/v1/runs/r/accounting")).json()
        assert acc["rollouts_received"] == 0 and acc["pending_events"] == counts.read, acc
    again = await drain_once(drain)  # read again from this consumer's pending entries
    assert (again.applied, again.unreplicated) == (counts.read, 0)
    acc = (await replicated_api.get("/v1/runs/r/accounting")).json()
    assert (acc["rollouts_received"], acc["pending_events"]) == (2, 0), acc


# -- on a cluster: the WAIT of the run's own master, on the connection of its write --------------


@pytest.fixture(scope="module")
def replicated_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterServers]:
    servers = RedisClusterServers(tmp_path_factory.mktemp("cluster"), 3, replicas=1)
    try:
        servers.start()
        yield servers
    finally:
        servers.kill()


def _replica_port(servers: RedisClusterServers, key: str) -> int:
    """The port of the replica of the master serving ``key``'s slot."""
    with SyncRedis(port=servers.ports[0]) as probe:
        slot = int(probe.execute_command("CLUSTER KEYSLOT", key))
        for first, last, _, *replicas in probe.execute_command("CLUSTER SLOTS"):
            if first <= slot <= last:
                return int(replicas[0][1])
    raise AssertionError(f"no replica serves slot {slot}")


async def test_on_a_cluster_the_runs_own_master_waits_for_its_replica(
    replicated_cluster: RedisClusterServers,
):
    prefix = new_prefix()
    cluster: RedisCluster = cluster_client(replicated_cluster.url)
    store = RedisStore(cluster, prefix, Replicas(cluster, 1, TIMEOUT_MS))  # type: ignore[arg-type]
    other: RedisCluster = cluster_client(replicated_cluster.url)  # as another API process's
    again = RedisStore(other, prefix, Replicas(other, 1, TIMEOUT_MS))  # type: ignore[arg-type]
    replica = _replica_port(replicated_cluster, keys.run_key(prefix, "r"))
    frozen = replicated_cluster.procs[replica]
    try:
        assert await store.create_run("r", RunConfig()) == "created"
        frozen.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(NotReplicated):
                await store.ingest("r", [packed("a")])
            with pytest.raises(NotReplicated):
                await again.ingest("r", [packed("a")])  # another connection: a duplicate
        finally:
            frozen.send_signal(signal.SIGCONT)
        outcome = await again.ingest("r", [packed("a")])
        assert (outcome.accepted, outcome.duplicates) == (0, 1)
        assert await replicas_check(cluster, 1) == "ok"
        assert (await replicas_check(cluster, 2)).startswith("1 connected")
        with SyncRedis(port=replica) as r:
            r.execute_command("READONLY")
            assert r.exists(keys.member_key(prefix, "r", keys.BLOB, "a")) == 1
    finally:
        await delete_prefix(cluster, prefix)  # type: ignore[arg-type]
        await cluster.aclose()
        await other.aclose()


async def test_on_a_cluster_a_call_that_reached_another_node_is_a_503(
    replicated_cluster: RedisClusterServers, monkeypatch: pytest.MonkeyPatch
):
    """A stale slot map sends the call to a master that does not serve the run: its MOVED is not
    followed (WAIT there would count that node's replicas), the answer is 503 with Retry-After,
    and the resend, on the right node, is the first to write."""
    prefix = new_prefix()
    cluster: RedisCluster = cluster_client(replicated_cluster.url)
    store = RedisStore(cluster, prefix, Replicas(cluster, 1, TIMEOUT_MS))  # type: ignore[arg-type]
    try:
        await store.create_run("r", RunConfig())
        right = cluster.get_node_from_key(keys.sync_key(prefix, "r"))
        wrong = next(n for n in cluster.get_primaries() if n is not right)
        with monkeypatch.context() as stale:
            stale.setattr(cluster, "get_node_from_key", lambda key, replica=False: wrong)
            with pytest.raises(Unavailable) as caught:
                await store.ingest("r", [packed("a")])
        assert not isinstance(caught.value, NotReplicated)
        assert caught.value.headers == {"Retry-After": "1"}
        assert "MovedError" in caught.value.detail
        assert (await store.ingest("r", [packed("a")])).accepted == 1
    finally:
        await delete_prefix(cluster, prefix)  # type: ignore[arg-type]
        await cluster.aclose()
