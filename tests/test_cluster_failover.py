"""A master of a Redis Cluster SIGKILLed while traffic runs: 3 masters with one replica each,
every node appending with fsync always, two API processes and a worker on the cluster (their
URL names every node, so none depends on one), generators and trainers through the Python
client. The master serving the run's slot is killed mid-traffic; its replica must be promoted
by the cluster itself (cluster-node-timeout 1000 ms) and the broker must serve again without
help.

Redis replication is asynchronous, and by default the broker waits for no replica (no WAIT): a
write the killed master acknowledged, and fsynced to its own append-only file, but had not yet
sent to its replica is gone after the failover. The test measures it rather than pretending
otherwise, in two cases: ``in-sync`` (the replica is in sync when its master dies) and
``link-cut`` (the replication link is broken CUT_S before the kill, as in a network partition,
so everything the master acknowledges in between is on the master alone). An extra consumer
group that never reads keeps the run's whole event stream, which is replayed at the end, and
the figures are printed: rollouts the generators were told accepted against those in the stream
(``lost``, and how many the dead master's AOF holds); batches the trainers were told acked
against those the stream records, and rollouts handed to a trainer again after their ack was
lost; acks refused because their lease was lost; how long until the replica was promoted and
until ingest and acks succeeded again.

The ledger in Postgres is not rolled back with Redis: the drain may have applied events it read
from the master before they reached the replica. It must be exactly the replayed stream plus
those events (found in the dead master's AOF by the ids in ``processed_events``), and when
there are none, equal to the live state.

What must hold whatever was lost: the broker serves again by itself; the stream never has a
rollout in two live leases at once; every rollout in it was used exactly once; ``lost`` is
exactly ``told accepted - in the stream``, nothing acknowledged well before the cut is lost,
and with the replica in sync the loss is small next to the traffic.

The same two cases run again with ``BROKER_REDIS_WAIT_REPLICAS=1`` (``-wait``): every answer
that changed state is sent only once the master's replica has it, and the drain commits only
events the replica has. The killed master is started again after the promotion (it rejoins as
the new master's replica; until then the new master has none, and every write is answered
``503``). Then nothing the clients were told is lost, whatever the link did: no rollout, no
ack, no lease; the ledger applied no event the failover rolled back, and equals the live state.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar, cast

import asyncpg
import httpx
import numpy as np
import pytest
from redis import Redis as SyncRedis
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException
from rollout_broker_client import AsyncBrokerClient, BatchSettled, BrokerError, InternalError, Retry

from app import keys
from app.broker.config import RunConfig
from app.broker.notify import Waker
from app.broker.store import RedisStore
from app.events import (
    Event,
    StreamId,
    decode_entry,
)
from app.wiring import cluster_client
from tests.broker.test_store import packed
from tests.processes import ApiProcess, RedisClusterServers
from tests.traffic import GROUP, Replay, brokers, group_of

pytestmark = pytest.mark.slow

PREFIX = "failover"
RUN = "failover-run"
AUDIT = "audit"  # the consumer group that never reads
BEFORE_KILL = 60  # rollouts acked before the master is killed
AFTER_PROMOTION = 80  # and after its replica took over
ENTRY_ID = re.compile(rb"\d+-\d+")  # a stream entry id, as an XADD in the AOF carries it
XADD = re.compile(rb"\*\d+\r\n\$4\r\n(?i:xadd)\r\n")  # the start of an XADD in the AOF
WAIT_STATS = ("cmdstat_wait", "cmdstat_waitaof")  # INFO commandstats of WAIT and WAITAOF
LEASE_TIMEOUT_S = 3  # a batch whose ack was lost comes back after this
CUT_S = 0.3  # link-cut: how long before the kill the replica stops hearing from its master
WAIT_TIMEOUT_MS = 500  # -wait: how long an answer waits for the replica before it is a 503


T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RecordingRetry(Retry):
    """The client's own retry policy, also noting why each resend was made: the status the
    broker answered, or the transport error."""

    resends: Counter[str] = field(default_factory=Counter)

    def pause(
        self,
        call: Any,
        attempt: int,
        elapsed_s: float,
        *,
        error: httpx.TransportError | None = None,
        response: httpx.Response | None = None,
    ) -> float | None:
        wait = Retry.pause(self, call, attempt, elapsed_s, error=error, response=response)
        if wait is not None:
            why = str(response.status_code) if response is not None else type(error).__name__
            self.resends[why] += 1
        return wait


async def through_stale_connections(errors: list[str], call: Callable[[], Awaitable[T]]) -> T:
    """``call()``, sent again after a ``500`` that names a RuntimeError or AttributeError,
    which the test then fails on. After a connection error on a node, redis-py's async cluster
    client closes that node's idle connections while they stay in its free queue; a command
    that takes one meanwhile writes to a closed transport (RuntimeError "the handler is closed"
    under uvloop, AttributeError on plain asyncio). The broker answers that 503 (app/errors.py),
    which the client resends by itself; were it a 500 again, the run goes on to measure the
    rest and the test fails at the end."""
    while True:
        try:
            return await call()
        except InternalError as exc:
            if "RuntimeError" not in str(exc) and "AttributeError" not in str(exc):
                raise
            errors.append(str(exc))
            await asyncio.sleep(0.05)


def slot_owner(port: int, slot: int) -> tuple[int, list[int]]:
    """(master port, replica ports) of ``slot`` as the node of ``port`` sees it."""
    with SyncRedis(port=port, socket_timeout=2) as c:
        for start, end, master, *replicas in c.execute_command("CLUSTER SLOTS"):
            if start <= slot <= end:
                return int(master[1]), [int(r[1]) for r in replicas]
    raise AssertionError(f"slot {slot} is not served")


def wait_replicas_in_sync(servers: RedisClusterServers, within: float = 30) -> None:
    """Until every replica's link to its master is up and it has the master's offset."""
    deadline = time.monotonic() + within
    for port in servers.ports:
        with SyncRedis(port=port) as c:
            while True:
                info = c.info("replication")
                if info["role"] == "master":
                    break
                if info.get("master_link_status") == "up" and not info.get(
                    "master_sync_in_progress"
                ):
                    with SyncRedis(port=int(info["master_port"])) as m:
                        if m.info("replication")["master_repl_offset"] == int(
                            info["slave_repl_offset"]
                        ):
                            break
                assert time.monotonic() < deadline, f"replica {port} not in sync: {info}"
                time.sleep(0.05)


async def applied_event_ids(database_url: str, run_id: str) -> set[StreamId]:
    """The stream ids of the run's events the ledger has applied."""
    conn = await asyncpg.connect(database_url.replace("+asyncpg", "", 1))
    try:
        rows = await conn.fetch(
            "SELECT stream_ms, stream_seq FROM processed_events WHERE run_id = $1", run_id
        )
    finally:
        await conn.close()
    return {StreamId.parse(f"{r['stream_ms']}-{r['stream_seq']}") for r in rows}


def aof_events(folder: Path, stream_key: str) -> list[Event]:
    """Every XADD to ``stream_key`` in the append-only file(s) under ``folder`` (propagated
    with the id the master gave the entry), decoded. Found by pattern, so that an RDB preamble
    or a command cut short at the end of the file is passed over."""
    data = b"".join(p.read_bytes() for p in sorted(folder.rglob("*.aof*")) if p.is_file())
    key = stream_key.encode()
    out = []
    for match in XADD.finditer(data):
        i, args = match.start(), []
        try:
            end = data.index(b"\r\n", i)
            argc, i = int(data[i + 1 : end]), end + 2
            for _ in range(argc):
                end = data.index(b"\r\n", i)
                size = int(data[i + 1 : end])
                args.append(data[end + 2 : end + 2 + size])
                i = end + 2 + size + 2
        except ValueError:
            continue  # cut short
        if len(args) < argc or len(args) < 3 or args[1] != key:
            continue
        at = next(n for n, a in enumerate(args) if n > 1 and ENTRY_ID.fullmatch(a))
        fields = dict(zip(args[at + 1 :: 2], args[at + 2 :: 2], strict=True))
        out.append(decode_entry(RUN, args[at], fields))
    return out


def abbrev(ids: list[str], n: int = 6) -> str:
    return repr(ids) if len(ids) <= n else f"[{', '.join(ids[:n])}, ...]"


def aof_holds(folder: Path, needles: list[bytes]) -> int:
    """How many of ``needles`` the append-only file(s) under ``folder`` contain."""
    data = b"".join(p.read_bytes() for p in folder.rglob("*.aof*") if p.is_file())
    return sum(1 for n in needles if n in data)


@pytest.mark.parametrize(
    ("cut", "wait"),
    [(False, False), (True, False), (False, True), (True, True)],
    ids=["in-sync", "link-cut", "in-sync-wait", "link-cut-wait"],
)
async def test_master_failover_loses_at_most_the_unreplicated_writes(
    database_url: str, tmp_path: Path, cut: bool, wait: bool
) -> None:
    """``in-sync``: the replica is in sync when its master dies (what a failover on a healthy
    network is like). ``link-cut``: the replication link is broken CUT_S before the kill (the
    replica cannot authenticate to reconnect), so whatever the master acknowledged in between
    is on the master alone: those writes must be lost, and exactly those. ``-wait``: the same
    with BROKER_REDIS_WAIT_REPLICAS=1, and nothing acknowledged is lost."""
    servers = RedisClusterServers(tmp_path / "cluster", 3, replicas=1, aof=True)
    apis: list[ApiProcess] = []
    worker = None
    clients: list[AsyncBrokerClient] = []
    admin: Redis | None = None
    try:
        await asyncio.to_thread(servers.start)
        await asyncio.to_thread(wait_replicas_in_sync, servers)
        slot = key_slot(keys.run_key(PREFIX, RUN).encode())
        victim, replicas = slot_owner(servers.ports[0], slot)
        assert len(replicas) == 1, replicas
        heir = replicas[0]
        # The killed master's files as the kill left them (with -wait it is started again).
        victim_files = tmp_path / "killed-master" if wait else servers.data_dir / str(victim)
        survivor = next(p for p in servers.ports if p not in (victim, heir))

        cluster_env = {"BROKER_REDIS_URL": servers.seeds, "BROKER_REDIS_CLUSTER": "1"}
        if wait:
            cluster_env |= {
                "BROKER_REDIS_WAIT_REPLICAS": "1",
                "BROKER_REDIS_WAIT_TIMEOUT_MS": str(WAIT_TIMEOUT_MS),
            }
        apis, worker = brokers(cluster_env, database_url, PREFIX, tmp_path)
        await asyncio.gather(*(a.start() for a in apis), worker.start())
        # Short, frequent resends: the time until service resumes is measured through them.
        retry = RecordingRetry(deadline_s=45.0, backoff_s=0.05, max_backoff_s=0.5)
        clients = [AsyncBrokerClient(a.url, retry=retry) for a in apis]
        admin = cast(Redis, cluster_client(servers.seeds))
        # Before the run exists: a drain that read, applied and trimmed the run's first event
        # before this group was made would leave it out of the stream, where the checks below
        # would take it for an event the failover rolled back.
        await admin.xgroup_create(keys.events_key(PREFIX, RUN), AUDIT, id="0", mkstream=True)
        await clients[0].create_run(
            RUN, {"group_size": GROUP, "max_staleness": 1000, "lease_timeout_s": LEASE_TIMEOUT_S}
        )

        sent: dict[str, int] = {}  # rollout_id -> tokens, of every rollout sent
        told_accepted: dict[str, int] = {}  # rollout_id -> tokens, answered accepted/duplicate
        rejected: list[str] = []
        server_errors: list[str] = []  # 500s from a stale connection, sent again
        # (started, finished, rollout ids) of each ingest answered accepted
        ingest_done: list[tuple[float, float, list[str]]] = []
        ack_done: list[tuple[float, float, list[str]]] = []
        handed: Counter[str] = Counter()  # rollout_id -> times a trainer was handed it
        acked_batches: dict[str, list[str]] = {}  # batch_id -> rollout ids, told acked
        refused_acks: dict[str, str] = {}  # batch_id -> error, ack refused
        expired_leases: list[int] = []  # leases whose answer came only after they expired
        acked_total = 0
        t_cut = t_kill = t_promoted = 0.0
        calm = asyncio.Event()
        generating = 2

        async def generate(i: int) -> None:
            nonlocal generating
            rng = np.random.default_rng(i)
            g = 0
            while not calm.is_set():
                chunk = group_of(i, g, rng) + group_of(i, g + 1, rng)
                g += 2
                for r in chunk:
                    sent[r.rollout_id] = int(np.size(r.response_ids))
                started = time.monotonic()
                result = await through_stale_connections(
                    server_errors, partial(clients[i].post_rollouts, RUN, chunk)
                )
                bad = {r.rollout_id for r in result.rejected}
                rejected.extend(bad)
                good = [r.rollout_id for r in chunk if r.rollout_id not in bad]
                ingest_done.append((started, time.monotonic(), good))
                for r in good:
                    told_accepted[r] = sent[r]
                await asyncio.sleep(0.01)
            generating -= 1

        async def live_empty() -> bool:
            acc = await through_stale_connections(server_errors, lambda: clients[0].accounting(RUN))
            return acc.live is not None and (acc.live.buffered, acc.live.leased) == (0, 0)

        async def train(i: int) -> None:
            nonlocal acked_total
            while True:
                try:
                    batch = await through_stale_connections(
                        server_errors,
                        lambda: clients[i].lease_batch(RUN, 4 * GROUP, wait_s=0.5, partial=True),
                    )
                except BatchSettled:
                    # The lease was made but its answer lost in the failover, and the resent
                    # lease came after the batch expired (lease_timeout_s): its rollouts are
                    # back in the queue, and the trainer takes a new batch.
                    expired_leases.append(i)
                    continue
                if batch is None:
                    if not generating and await live_empty():
                        return
                    continue
                ids = [r.rollout_id for r in batch.rollouts]
                handed.update(ids)
                started = time.monotonic()
                try:
                    result = await through_stale_connections(
                        server_errors, partial(clients[i].ack, RUN, batch.batch_id)
                    )
                except BrokerError as exc:  # the lease did not survive the failover
                    refused_acks[batch.batch_id] = type(exc).__name__
                    continue
                ack_done.append((started, time.monotonic(), [batch.batch_id]))
                acked_batches[batch.batch_id] = ids
                acked_total += result.consumed

        async def progressed(rollouts: int) -> None:
            while acked_total < rollouts:  # noqa: ASYNC110 - the trainers make progress
                await asyncio.sleep(0.02)

        async def failover() -> None:
            nonlocal t_kill, t_promoted
            nonlocal t_cut
            await progressed(BEFORE_KILL)
            if cut:
                with SyncRedis(port=heir) as h, SyncRedis(port=victim) as v:
                    h.config_set("masterauth", "not-the-password")
                    t_cut = time.monotonic()
                    # The command as Redis takes it: redis-py 8.0's client_kill_filter knows
                    # the type only by its older name.
                    v.execute_command("CLIENT", "KILL", "TYPE", "replica")
                await asyncio.sleep(CUT_S)
            t_kill = time.monotonic()
            await asyncio.to_thread(servers.kill_node, victim)
            deadline = t_kill + 20
            while slot_owner(survivor, slot)[0] != heir:
                if time.monotonic() > deadline:
                    with SyncRedis(port=heir) as h:
                        state = (h.cluster("INFO"), h.info("replication"))
                    raise AssertionError(f"replica {heir} not promoted within 20 s: {state}")
                await asyncio.sleep(0.02)
            t_promoted = time.monotonic()
            if cut:
                with SyncRedis(port=heir) as h:
                    h.config_set("masterauth", "")
            if wait:
                # Keep its files for the loss checks below, then start it again: it rejoins as
                # the replica that the new master's writes wait for.
                await asyncio.to_thread(
                    shutil.copytree, servers.data_dir / str(victim), victim_files
                )
                await asyncio.to_thread(servers.start_node, victim)
            await progressed(acked_total + AFTER_PROMOTION)
            calm.set()

        await asyncio.wait_for(
            asyncio.gather(generate(0), generate(1), train(0), train(1), failover()), 50
        )
        t_calm = time.monotonic()
        acc = await clients[1].wait_for_accounting(RUN, timeout_s=20)
        t_settled = time.monotonic()

        # -- the whole event stream of the new master, replayed ------------------------------
        entries = cast(
            list[tuple[bytes, dict[bytes, bytes]]],
            await admin.xrange(keys.events_key(PREFIX, RUN)),
        )
        events = [decode_entry(RUN, eid, fields) for eid, fields in entries]
        stream = Replay(events)
        accepted, uses, stream_acked = stream.accepted, stream.uses, stream.acked
        double_leases = stream.double_leases
        # The events the ledger applied (processed_events) that the new master does not have:
        # the drain read them from the killed master before they reached its replica. The
        # killed master's AOF still holds them; the ledger must be exactly the stream plus them.
        applied = await applied_event_ids(database_url, RUN)
        rolled_back = applied - {e.stream_id for e in events}
        from_aof = {e.stream_id: e for e in aof_events(victim_files, keys.events_key(PREFIX, RUN))}
        assert rolled_back <= set(from_aof), "an applied event is in no Redis at all"
        union = Replay(
            sorted(events + [from_aof[i] for i in rolled_back], key=lambda e: e.stream_id)
        )
        lost = sorted(set(told_accepted) - set(accepted))
        in_victim_aof = aof_holds(
            victim_files,
            [keys.member_key(PREFIX, RUN, keys.BLOB, r).encode() for r in lost],
        )
        lost_acks = sorted(set(acked_batches) - stream_acked)
        trained_twice = sum(1 for b in lost_acks for r in acked_batches[b] if handed[r] > 1)
        never_sent_back = set(sent) - set(told_accepted) - set(rejected)

        def resumed(done: list[tuple[float, float, list[str]]]) -> float:
            after = [end for start, end, _ in done if start > t_kill]
            return (min(after) - t_kill) if after else float("inf")

        def longest(done: list[tuple[float, float, list[str]]]) -> float:
            return max(end - start for start, end, _ in done)

        def answered_since(done: list[tuple[float, float, list[str]]], t: float) -> set[str]:
            return {x for _, end, ids in done if end > t for x in ids}

        def master_only(done: list[tuple[float, float, list[str]]]) -> set[str]:
            """What was sent after the link was cut and answered before the kill."""
            return {x for start, end, ids in done if t_cut < start and end < t_kill for x in ids}

        cut_rollouts, cut_acks = (
            (master_only(ingest_done), master_only(ack_done)) if cut else (set(), set())
        )

        ledger = (acc.rollouts_received, acc.samples_consumed, acc.tokens_generated)
        waits = 0  # WAIT / WAITAOF calls the live nodes served (none unless asked for)
        for port in (p for p in servers.ports if p != victim):
            with SyncRedis(port=port) as node:
                stats = node.info("commandstats")
                waits += sum(int(stats.get(c, {}).get("calls", 0)) for c in WAIT_STATS)
        print(
            f"\nfailover ({'link cut' if cut else 'in sync'}"
            f"{', acks wait for a replica' if wait else ''}): killed master {victim} serving "
            f"slot {slot}; replica {heir} promoted {t_promoted - t_kill:.2f} s later; ingest "
            f"resumed after {resumed(ingest_done):.2f} s, acks after {resumed(ack_done):.2f} s; "
            f"accounting settled {t_settled - t_calm:.1f} s after the traffic stopped\n"
            f"  answered while only the master had them: {len(cut_rollouts)} rollouts accepted, "
            f"{len(cut_acks)} batches acked\n"
            f"  rollouts: {len(sent)} sent, {len(told_accepted)} told accepted, "
            f"{len(accepted)} in the stream, lost {len(lost)} {abbrev(lost)} "
            f"({in_victim_aof} of them in the killed master's AOF), {len(rejected)} rejected\n"
            f"  batches: {len(acked_batches)} told acked, {len(stream_acked)} acked in the stream,"
            f" {len(lost_acks)} acks lost ({trained_twice} rollouts handed to a trainer again "
            f"after their ack was lost), {len(refused_acks)} acks refused "
            f"{sorted(Counter(refused_acks.values()).items())}, {len(expired_leases)} leases "
            f"answered only after they expired\n"
            f"  stream: {len(entries)} events, {double_leases} double leases; ledger applied "
            f"{len(rolled_back)} events the failover rolled back "
            f"{sorted(Counter(from_aof[i].type for i in rolled_back).items())}\n"
            f"  ledger received/consumed/tokens {ledger}, stream "
            f"{(sum(accepted.values()), sum(uses.values()), stream.tokens)}, stream + rolled "
            f"back {(sum(union.accepted.values()), sum(union.uses.values()), union.tokens)}\n"
            f"  ledger buffered/leased {acc.buffered}/{acc.leased}, live "
            f"{acc.live.buffered if acc.live else None}/{acc.live.leased if acc.live else None}, "
            f"matches live: {acc.matches_live}; batches acked: ledger {acc.batches.acked}, "
            f"stream {len(stream_acked)}, stream + rolled back {len(union.acked)}; "
            f"dead letters {acc.dead_letters}\n"
            f"  500s: {len(server_errors)} {sorted(set(server_errors))}; WAIT calls "
            f"on the live nodes: {waits}\n"
            f"  resent by the clients, by what the broker answered: "
            f"{sorted(retry.resends.items())}; longest answer, resends included: ingest "
            f"{longest(ingest_done):.2f} s, ack {longest(ack_done):.2f} s"
        )

        # -- what must hold, whatever was lost ---------------------------------------------
        assert t_promoted > t_kill  # the cluster promoted the replica by itself
        assert resumed(ingest_done) < 15 and resumed(ack_done) < 15  # served again by itself
        assert not never_sent_back  # every request got an answer in the end
        assert not rejected
        assert double_leases == 0
        assert set(accepted.values()) <= {1}  # accepted once, whatever was retried
        assert set(accepted) <= set(told_accepted)  # nothing appears that was not sent
        assert len(lost) == len(told_accepted) - len(accepted)  # lost is exactly the gap
        assert in_victim_aof == len(lost)  # fsync always kept them, on the dead master only
        assert uses == Counter(dict.fromkeys(accepted, 1))  # each present one used once
        assert stream_acked <= set(acked_batches)  # no ack nobody was told of
        assert not server_errors  # a connection closed under a command is a 503, resent
        # -- the ledger: exactly the stream plus the events it applied that were rolled back --
        assert acc.pending_events == 0 and acc.dead_letters == 0
        assert ledger == (sum(union.accepted.values()), sum(union.uses.values()), union.tokens)
        assert (acc.buffered, acc.leased) == (union.buffered, union.leased)
        assert acc.batches.acked == len(union.acked)
        assert (waits > 0) == wait  # WAIT is sent when asked for, and only then
        if wait:  # nothing anyone was told is lost, and the ledger is the live state
            assert not cut_rollouts and not cut_acks, "answered while only the master had it"
            assert not lost and not lost_acks
            assert not rolled_back, "the ledger applied events the replica did not have"
            assert acc.matches_live, acc
            assert ledger == (len(accepted), sum(uses.values()), stream.tokens)
            assert acc.buffered == acc.leased == 0
        elif cut:  # what only the master had is gone, and nothing else
            assert cut_rollouts, "no ingest was answered while the link was cut"
            assert cut_rollouts <= set(lost)
            assert cut_acks <= set(lost_acks)
            # and nothing answered well before the cut (replication lags by far less)
            assert set(lost) <= answered_since(ingest_done, t_cut - 0.1)
        else:
            assert len(lost) <= len(told_accepted) // 20  # small next to the traffic
        if not rolled_back:  # then the ledger == the live state == the replayed stream
            assert acc.matches_live, acc
            assert ledger == (len(accepted), sum(uses.values()), stream.tokens)
            assert acc.buffered == acc.leased == 0
    finally:
        for c in clients:
            await c.close()
        stops = [a.stop() for a in apis] + ([worker.stop()] if worker else [])
        await asyncio.gather(*stops, return_exceptions=True)
        if admin is not None:
            await admin.aclose()
        await asyncio.to_thread(servers.kill)


async def test_a_waiter_is_told_to_recheck_when_its_runs_master_fails_over(tmp_path: Path) -> None:
    """A run's waiter in an API process (its run's shard channel subscribed on the master of
    the run's slot) when that master is SIGKILLed: once the replica took over, the waiter is
    woken to re-check by itself (a wake-up may have been lost meanwhile), not only at the
    fallback re-check (an hour here), and the run's subscription has followed the slot to the
    new master, where the next wake-up reaches it."""
    servers = RedisClusterServers(tmp_path / "cluster", 3, replicas=1)
    client: RedisCluster | None = None
    waker: Waker | None = None
    prefix, run = "failover-wake", "wake-run"
    try:
        await asyncio.to_thread(servers.start)
        client = cast(RedisCluster, cluster_client(servers.seeds))
        store = RedisStore(cast(Redis, client), prefix)
        waker = Waker(cast(Redis, client), prefix, fallback_s=3600)
        await waker.start()
        await store.create_run(run, RunConfig())
        # What a long-polling lease does first: it finds nothing and says it will wait.
        got = await store.lease(
            run, batch_id="b0", size=1, policy_version=None, partial=False, trainer_id=None,
            wait_ms=600_000,
        )  # fmt: skip
        assert got == 0
        await asyncio.to_thread(wait_replicas_in_sync, servers)
        channel = keys.wake_channel(prefix, run)
        victim, replicas = slot_owner(servers.ports[0], key_slot(channel.encode()))
        heir = replicas[0]
        survivor = next(p for p in servers.ports if p not in (victim, heir))
        with waker.line(run) as ticket:
            await waker.listening(ticket)
            with SyncRedis(port=victim) as v:
                assert v.execute_command("PUBSUB", "SHARDNUMSUB", channel)[1] == 1
            await asyncio.to_thread(servers.kill_node, victim)
            t_kill = time.monotonic()
            while slot_owner(survivor, key_slot(channel.encode()))[0] != heir:
                assert time.monotonic() < t_kill + 20, "the replica was not promoted"
                await asyncio.sleep(0.05)
            await asyncio.wait_for(ticket.event.wait(), timeout=30)
            told_s = time.monotonic() - t_kill
            waker.trying(ticket)
            with SyncRedis(port=heir) as h:
                while h.execute_command("PUBSUB", "SHARDNUMSUB", channel)[1] != 1:
                    assert time.monotonic() < t_kill + 30, "not subscribed on the new master"
                    await asyncio.sleep(0.05)
            moved_s = time.monotonic() - t_kill
            while True:  # the client's first command may still meet the dead master
                try:
                    await store.ingest(run, [packed("a")])
                    break
                except (RedisConnectionError, RedisClusterException, OSError):
                    assert time.monotonic() < t_kill + 40, "ingest never succeeded"
                    await asyncio.sleep(0.1)
            await asyncio.wait_for(ticket.event.wait(), timeout=10)
        print(f"\nwaiter told to re-check {told_s:.1f} s after the kill, subscribed on the new "
              f"master {moved_s:.1f} s after")  # fmt: skip
    finally:
        if waker is not None:
            await waker.stop()
        if client is not None:
            await client.aclose()
        await asyncio.to_thread(servers.kill)
