"""Resharding: a live run's slot moves to another node of a Redis Cluster, twice, while
generators and trainers go on through the Python client against two API processes and a worker.

Two ways of moving a slot, each twice in a run:

- ``one_migrate``: the target is told it imports the slot, then ONE script on the source lists
  every key of the slot, marks it migrating and MIGRATEs all of them in one call, so no command
  is served between the first key leaving and the last; then the slot is given to the target on
  the target, the source and the third node.
- ``key_by_key``: as ``redis-cli --cluster reshard`` does it: the slot is marked importing and
  migrating, then its keys are MIGRATEd 10 at a time while traffic goes on, then the slot is
  given to the target. Every broker script declares the run's never-written guard key beside
  the run hash (app/keys.py, GUARD), so while the run is partly on each node the nodes
  refuse its scripts before they run (TRYAGAIN, or ASK then TRYAGAIN), and the clients are
  answered 503 and retry.
 Between the script and the target taking the slot (a few
ms: the target writes its nodes.conf) the source answers ASK, which the broker's Redis client
retries through; the nodes' error counters printed at the end show that requests met it. Without
the guard key the key-by-key move is not safe: on a migrating source a script that touches a
key the source does not hold, one already moved or one that does not exist yet, fails with "Lua
script attempted to access a non local key" after its earlier writes were made (an ingest that
counted a rollout and stored nothing: lost).

As in the chaos test, a consumer group that never reads keeps the whole event stream; it moves
with the run and is replayed at the end: no rollout the clients were told was accepted is
missing, none was in two live leases at once, each was used exactly once, and the ledger, the
live state and what the clients were told all agree."""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter
from pathlib import Path
from typing import cast

import pytest
from redis import Redis as SyncRedis
from redis.asyncio import Redis
from redis.crc import key_slot
from rollout_broker_client import AsyncBrokerClient

from app import keys
from app.events import decode_entry
from app.wiring import cluster_client
from tests.processes import ApiProcess, RedisClusterServers
from tests.traffic import GROUP, Replay, Traffic, brokers

pytestmark = pytest.mark.slow

PREFIX = "reshard"
RUN = "reshard-run"
MIN_PER_GENERATOR = 160  # rollouts; generators go on until the last move is well behind them
AUDIT = "audit"  # the consumer group that never reads

# On the source, atomically: every key of the slot, the slot marked migrating to the target,
# and all the keys MIGRATEd in one call (they leave together). Replies the number of keys moved
# and the number left behind (none: nothing else ran in between).
MOVE_KEYS = """
redis.replicate_commands()
local slot, host, port, target, timeout = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local held = redis.call('CLUSTER', 'COUNTKEYSINSLOT', slot)
local names = redis.call('CLUSTER', 'GETKEYSINSLOT', slot, held)
redis.call('CLUSTER', 'SETSLOT', slot, 'MIGRATING', target)
if #names > 0 then
  redis.call('MIGRATE', host, port, '', 0, timeout, 'KEYS', unpack(names))
end
return {#names, redis.call('CLUSTER', 'COUNTKEYSINSLOT', slot)}
"""


# The operator's move of a slot, as a program of its own: the traffic of the test's event loop
# (and the GIL) does not stretch the moments between its steps. argv: slot, source port, target
# port, every port; prints the keys moved, how long the move took and how long the source
# redirected with ASK (ms).
MOVE_SLOT = """
import sys, time
from redis import Redis
slot, source, target = (int(a) for a in sys.argv[1:4])
ports = [int(p) for p in sys.argv[4].split(",")]
key_by_key = sys.argv[5] == "key_by_key"
conn = {p: Redis(port=p, decode_responses=True) for p in ports}
ids = {p: c.execute_command("CLUSTER MYID") for p, c in conn.items()}
started = time.monotonic()
conn[target].execute_command("CLUSTER SETSLOT", slot, "IMPORTING", ids[source])
if key_by_key:
    conn[source].execute_command("CLUSTER SETSLOT", slot, "MIGRATING", ids[target])
    moved = 0
    while names := conn[source].execute_command("CLUSTER GETKEYSINSLOT", slot, 10):
        conn[source].migrate("127.0.0.1", target, names, 0, 10_000)
        moved += len(names)
    left = conn[source].execute_command("CLUSTER COUNTKEYSINSLOT", slot)
else:
    moved, left = conn[source].eval(
        sys.stdin.read(), 0, slot, "127.0.0.1", target, ids[target], 10_000
    )
asking = time.monotonic()
# The target first: it takes the slot (and a new epoch); then the others hear of it.
conn[target].execute_command("CLUSTER SETSLOT", slot, "NODE", ids[target])
done = time.monotonic()
for p in [source] + [p for p in ports if p not in (source, target)]:
    conn[p].execute_command("CLUSTER SETSLOT", slot, "NODE", ids[target])
assert left == 0, left
print(moved, 1000 * (done - started), 1000 * (done - asking))
"""


async def move_slot(
    slot: int, source: int, target: int, ports: list[int], how: str
) -> tuple[int, str]:
    """Move ``slot`` with all its keys from the node of ``source`` to that of ``target``: the
    keys moved, and how long it took / how long the source redirected with ASK (ms)."""
    argv = [str(slot), str(source), str(target), ",".join(map(str, ports)), how]
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *("-c", MOVE_SLOT, *argv),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(MOVE_KEYS.encode()), 30)
    assert proc.returncode == 0, out.decode(errors="replace")
    moved, took, asked = out.split()
    return int(moved), f"{float(took):.1f}/{float(asked):.2f}"


def owner(ports: list[int], slot: int) -> int:
    """The port of the node serving ``slot``, as every node sees it."""
    seen = set()
    for port in ports:
        with SyncRedis(port=port) as node:
            for first, last, master, *_ in node.execute_command("CLUSTER SLOTS"):
                if first <= slot <= last:
                    seen.add(int(master[1]))
    assert len(seen) == 1, f"the nodes disagree on who serves slot {slot}: {seen}"
    return seen.pop()


def redirections(ports: list[int]) -> dict[str, int]:
    """The error replies of every node by kind (MOVED, ASK, TRYAGAIN, ...), summed."""
    seen: Counter[str] = Counter()
    for port in ports:
        with SyncRedis(port=port) as node:
            for name, stat in node.info("errorstats").items():
                seen[name.removeprefix("errorstat_")] += int(stat["count"])
    return dict(seen)


def keys_held(port: int, slot: int) -> int:
    with SyncRedis(port=port) as node:
        return int(node.execute_command("CLUSTER COUNTKEYSINSLOT", slot))


@pytest.mark.parametrize("how", ["one_migrate", "key_by_key"])
async def test_a_live_runs_slot_moves_twice_and_nothing_is_lost_or_doubled(
    how: str, database_url: str, tmp_path: Path
) -> None:
    cluster = RedisClusterServers(tmp_path / "cluster", masters=3)
    redis = cast(Redis, cluster_client(cluster.seeds))
    apis: list[ApiProcess] = []
    worker = None
    clients: list[AsyncBrokerClient] = []
    try:
        await asyncio.to_thread(cluster.start)
        cluster_env = {"BROKER_REDIS_URL": cluster.seeds, "BROKER_REDIS_CLUSTER": "1"}
        apis, worker = brokers(cluster_env, database_url, PREFIX, tmp_path)
        await asyncio.gather(*(a.start() for a in apis), worker.start())
        clients = [AsyncBrokerClient(a.url) for a in apis]
        events_key = keys.events_key(PREFIX, RUN)
        # Before the run exists: a drain that read, applied and trimmed its first events before
        # this group was made would leave them out of the replay.
        await redis.xgroup_create(events_key, AUDIT, id="0", mkstream=True)
        await clients[0].create_run(
            RUN, {"group_size": GROUP, "max_staleness": 1000, "lease_timeout_s": 60}
        )
        slot = key_slot(events_key.encode())
        first = owner(cluster.ports, slot)

        traffic = Traffic(clients, RUN, MIN_PER_GENERATOR, pause_s=0.005)
        moves: list[tuple[int, int, int, int]] = []  # (from, to, keys moved, acked by then)
        times: list[str] = []  # of each move: all of it, the ASK window (ms)

        async def reshard() -> None:
            source = first  # to a second node, then to the third, each under traffic
            for _ in range(2):
                await traffic.progressed(sum(traffic.acked) + 60)
                target = next(p for p in cluster.ports if p not in (source, first))
                moved, took = await move_slot(slot, source, target, cluster.ports, how)
                times.append(took)
                moves.append((source, target, moved, sum(traffic.acked)))
                assert owner(cluster.ports, slot) == target
                source = target
            await traffic.progressed(sum(traffic.acked) + 80)  # and on where the run now is
            traffic.calm.set()

        started = time.monotonic()
        await traffic.run(reshard(), 40)
        span = time.monotonic() - started
        acc = await clients[1].wait_for_accounting(RUN, timeout_s=30)

        # -- the slot is where it was moved, whole -------------------------------------------
        last = moves[-1][1]
        assert owner(cluster.ports, slot) == last
        for port in cluster.ports:
            held = keys_held(port, slot)
            assert (held > 0) == (port == last), (port, held)

        # -- the whole event stream, replayed ---------------------------------------------
        entries: list[tuple[bytes, dict[bytes, bytes]]] = await redis.xrange(events_key)  # type: ignore[assignment]
        events = [decode_entry(RUN, eid, fields) for eid, fields in entries]
        replay = Replay(events)
        print(
            f"resharding ({how}): {traffic.summary(replay)}, {len(entries)} events in "
            f"{span:.1f} s; slot {slot} moves (from, to, keys, acked by then): {moves}, ms "
            f"(move/ASK window): {times}; error replies of the nodes: "
            f"{redirections(cluster.ports)}"
        )
        assert len(moves) == 2 and all(m[2] > 0 for m in moves)
        traffic.check(replay, acc)
    finally:
        for client in clients:
            await client.close()
        stopping = [a.stop() for a in apis] + ([worker.stop()] if worker else [])
        await asyncio.gather(*stopping, return_exceptions=True)
        await redis.aclose()
        cluster.kill()
