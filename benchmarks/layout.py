"""Redis's share of a lease + ack of 256: the broker's scripts against the raw read ceiling
and against two forms of a per-bucket layout, in one private redis-server, one run.

    python -m benchmarks.layout              # about 5–10 s
    python -m benchmarks.layout --quick      # tiny sizes (tests/test_benchmarks_harness.py)

The figure is the redis-server process's CPU time per lease + ack (``used_cpu_user`` +
``used_cpu_sys`` of ``INFO cpu``), so command parsing and socket work count as well as script
work; the ways run interleaved, twice, and the best of each is kept. No HTTP and no API
process: this isolates the part of a lease + ack that Redis does.

- **raw**: the ceiling of the benchmark's read rows (``Bench.raw_read``, benchmarks/harness.py):
  ``LPOP <queue> N``, ``MGET`` of the packed rollouts, ``RPUSH`` of the ids back.
- **broker**: this tree's own scripts through ``RedisStore``: the lease script, the ``MGET``
  of the packed rollouts, the ack script with an ``acked`` event payload of the service's
  shape (every rollout measured, KL far below ``kl_max``).
- **bucket sketch**: what the lease and ack would cost with units kept in one Redis list per
  (policy version, uses) and no per-unit record for the scripts to parse or write: the lease
  pops N list elements (``'<rollout_id> <tokens>'``) from the freshest bucket, records them in
  the batch's hash as one msgpack string and emits it in one event; the ack pushes them into
  the bucket of one more use and emits the ack's payload. It is a sketch of that layout's
  Redis cost, not an implementation: it keeps none of the rules that need more than a
  bucket's version and uses (group units, prompt passes, the per-unit KL gate, 'fifo' and
  'random' order, retirement events), which a real one would have to carry in the list
  elements or in per-bucket structures.
- **bucket zsets**: the same idea with what the rules need of it: one sorted set per (version,
  uses) scored by arrival, so a lease merges a version's sets and keeps arrival order across
  uses as the broker's 'freshest' order does; the versions and each version's sets indexed; the
  batch record per set; the ack writing each unit's measured KL to a hash in one command (what a
  lowered ``kl_max`` would be re-checked against). Still without groups, prompt passes and
  retirements, which would add to it.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar, cast

import msgpack
import redis
import redis.asyncio as aioredis

from app.broker.config import RunConfig
from app.broker.packing import pack_rollout
from app.broker.store import RedisStore
from app.events import Acked, AckedItem, AckStats, AckSums, pack_payload
from benchmarks.payloads import TOKENS, make_payload
from benchmarks.servers import redis_server

PREFIX = "rbl"
RUN = "layout"
VERSION = 5
T = TypeVar("T")

_BUCKET_LEASE = """
local n, uses = tonumber(ARGV[2]), ARGV[3]
local run = redis.call('HMGET', KEYS[1], 'ver', 'stale')
if VERSION < tonumber(run[1]) - tonumber(run[2]) then return {} end
local got = redis.call('LPOP', KEYS[2] .. uses, n)
if not got then return {} end
local packed = cmsgpack.pack(got)
redis.call('HSET', KEYS[3] .. ARGV[1], 'st', 'l', 'v', VERSION, 'u', uses, 'items', packed)
redis.call('ZADD', KEYS[4], ARGV[4], ARGV[1])
redis.call('XADD', KEYS[5], '*', 'e', 'leased', 'd',
  cmsgpack.pack({ batch_id = ARGV[1], v = VERSION, uses = tonumber(uses), items = packed }))
return got
""".replace("VERSION", str(VERSION))

_BUCKET_ACK = """
local bk = KEYS[3] .. ARGV[1]
local f = redis.call('HMGET', bk, 'st', 'u', 'items')
if f[1] ~= 'l' then return 0 end
local items = cmsgpack.unpack(f[3])
redis.call('ZREM', KEYS[4], ARGV[1])
redis.call('XADD', KEYS[5], '*', 'e', 'acked', 'd', ARGV[2])
for i = 1, #items, 1000 do
  redis.call('RPUSH', KEYS[2] .. (tonumber(f[2]) + 1), unpack(items, i, math.min(i + 999, #items)))
end
redis.call('HSET', bk, 'st', 'a')
redis.call('PEXPIRE', bk, 86400000)
return #items
"""


# The bucket design, closer to what the rules need: one sorted set per (version, uses) scored by
# arrival, so a lease merges a version's sets in arrival order; the sets of a version listed in
# a set of their own; the batch record per set; each unit's last KL written by the ack in one
# HSET (what a lowered kl_max would be re-checked against); one event per lease and per ack.
_ZSET_LEASE = """
local bid, N = ARGV[1], tonumber(ARGV[2])
local run = redis.call('HMGET', KEYS[1], 'ver', 'stale', 'max_reuse')
local V, stale, max_reuse = tonumber(run[1]), tonumber(run[2]), tonumber(run[3])
local parts, picked = {}, 0
for _, v in ipairs(redis.call('ZREVRANGEBYSCORE', KEYS[2], V, V - stale)) do
  local heads = {}
  for _, u in ipairs(redis.call('SMEMBERS', KEYS[3] .. v)) do
    if tonumber(u) < max_reuse then
      local h = redis.call('ZRANGE', KEYS[4] .. v .. ':' .. u, 0, N - picked - 1, 'WITHSCORES')
      if #h > 0 then table.insert(heads, { u = u, h = h, i = 1, taken = {} }) end
    end
  end
  for _, x in ipairs(heads) do  -- scores as numbers, once
    local sc = {}
    for j = 2, #x.h, 2 do sc[j / 2] = tonumber(x.h[j]) end
    x.sc = sc
  end
  while picked < N do  -- merge the version's sets by arrival
    local best, best_sc = nil, nil
    for _, x in ipairs(heads) do
      local c = x.sc[x.i]
      if c and (not best or c < best_sc) then best, best_sc = x, c end
    end
    if not best then break end
    local t = best.taken
    t[#t + 1] = best.h[2 * best.i]
    t[#t + 1] = best.h[2 * best.i - 1]
    best.i = best.i + 1
    picked = picked + 1
  end
  for _, x in ipairs(heads) do
    if #x.taken > 0 then
      local members = {}
      for j = 2, #x.taken, 2 do members[j / 2] = x.taken[j] end
      redis.call('ZREM', KEYS[4] .. v .. ':' .. x.u, unpack(members))
      table.insert(parts, { tonumber(v), tonumber(x.u), x.taken })
    end
  end
  if picked >= N then break end
end
local rec = cmsgpack.pack(parts)
redis.call('HSET', KEYS[5] .. bid, 'st', 'l', 'v', V, 'sets', rec)
redis.call('ZADD', KEYS[6], ARGV[3], bid)
redis.call('XADD', KEYS[7], '*', 'e', 'leased', 'd',
  cmsgpack.pack({ batch_id = bid, policy_version = V, sets = rec }))
return rec
"""

_ZSET_ACK = """
local bk = KEYS[5] .. ARGV[1]
local f = redis.call('HMGET', bk, 'st', 'sets')
if f[1] ~= 'l' then return 0 end
local max_reuse = tonumber(redis.call('HGET', KEYS[1], 'max_reuse'))
redis.call('ZREM', KEYS[6], ARGV[1])
redis.call('XADD', KEYS[7], '*', 'e', 'acked', 'd', ARGV[2])
local n = 0
for _, p in ipairs(cmsgpack.unpack(f[2])) do
  local v, u, taken = p[1], p[2] + 1, p[3]
  n = n + #taken / 2
  if u < max_reuse then
    for i = 1, #taken, 1000 do
      redis.call('ZADD', KEYS[4] .. v .. ':' .. u, unpack(taken, i, math.min(i + 999, #taken)))
    end
    redis.call('SADD', KEYS[3] .. v, u)
  end
end
for i = 3, #ARGV, 1000 do redis.call('HSET', KEYS[8], unpack(ARGV, i, math.min(i + 999, #ARGV))) end
redis.call('HSET', bk, 'st', 'a')
redis.call('PEXPIRE', bk, 86400000)
return n
"""


def _ack_event(batch_id: str, rollout_ids: list[str], tokens: int) -> bytes:
    """The ``acked`` payload the service writes (app/broker/service.py, _acked_event), every
    rollout measured at a KL far below ``kl_max``."""
    items = tuple(AckedItem(rid, VERSION, tokens, 0.001) for rid in rollout_ids)
    stats = AckStats(kl_mean=0.001, kl_max=0.001, is_ratio_mean=1.0, clip_fraction=0.0)
    sums = AckSums(kl_tokens=len(items) * tokens, kl_sum=0.001 * len(items) * tokens)
    return pack_payload(
        "acked",
        Acked(
            batch_id=batch_id,
            step=None,
            policy_version=VERSION,
            items=items,
            stats=stats,
            sums=sums,
        ),
    )


class Ways:
    """The ways, set up on one server: each ``round_*`` does one lease + ack of ``size``."""

    def __init__(self, url: str, buffered: int, size: int, tokens: int) -> None:
        self.size = size
        self.r = redis.Redis.from_url(url)
        self.loop = asyncio.new_event_loop()
        self.ar = aioredis.Redis.from_url(url)
        self.store = RedisStore(self.ar, PREFIX)
        p = make_payload(tokens=tokens)
        rids = [secrets.token_hex(16) for _ in range(buffered)]
        packed = [
            pack_rollout(
                rollout_id=rid,
                group_id=None,
                policy_version=VERSION,
                prompt_ids=None,
                response_ids=p.ids.tobytes(),
                logprobs=p.logprobs.tobytes(),
                reward=1.0,
                finish_reason="stop",
                metadata=None,
                max_tokens=tokens,
            )
            for rid in rids
        ]
        # The broker's run: every rollout reusable far more often than the run lasts.
        cfg = RunConfig(max_staleness=1_000, max_reuse=10_000)
        self._run(self.store.create_run(RUN, cfg))
        self._run(self.store.set_policy(RUN, VERSION))
        for i in range(0, buffered, 64):
            self._run(self.store.ingest(RUN, packed[i : i + 64]))
        # raw: the same blobs under keys of their own and a queue of their ids.
        pipe = self.r.pipeline(transaction=False)
        for i, pr in enumerate(packed):
            pipe.set(f"raw:d:{pr.rollout_id}", pr.blob)
            if i % 512 == 511:
                pipe.execute()
        pipe.execute()
        for i in range(0, buffered, 1000):
            self.r.rpush("raw:q", *rids[i : i + 1000])
            self.r.rpush("bk:b:0", *[f"{x} {tokens}" for x in rids[i : i + 1000]])
        self.r.hset("bk:run", mapping={"ver": VERSION, "stale": 1_000})
        self.r.hset("bz:run", mapping={"ver": VERSION, "stale": 1_000, "max_reuse": 10_000})
        self.r.zadd("bz:vs", {str(VERSION): VERSION})
        self.r.sadd(f"bz:us:{VERSION}", 0)
        for i in range(0, buffered, 1000):
            self.r.zadd(
                f"bz:s:{VERSION}:0",
                {f"{x} {tokens}": i + j for j, x in enumerate(rids[i : i + 1000])},
            )
        self.tokens = tokens
        self.bucket_keys = ["bk:run", "bk:b:", "bk:bt:", "bk:leases", "bk:ev"]
        self.bucket_lease = self.r.register_script(_BUCKET_LEASE)
        self.bucket_ack = self.r.register_script(_BUCKET_ACK)
        self.zset_keys = [
            "bz:run",
            "bz:vs",
            "bz:us:",
            "bz:s:",
            "bz:bt:",
            "bz:leases",
            "bz:ev",
            "bz:kl",
        ]
        self.zset_lease = self.r.register_script(_ZSET_LEASE)
        self.zset_ack = self.r.register_script(_ZSET_ACK)
        self.uses = 0

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def round_raw(self) -> None:
        got = cast(list[bytes], self.r.lpop("raw:q", self.size))
        self.r.mget([b"raw:d:" + x for x in got])
        self.r.rpush("raw:q", *got)

    def round_broker(self) -> None:
        self._run(self._broker())

    async def _broker(self) -> None:
        bid = secrets.token_hex(16)
        lease = await self.store.lease(
            RUN,
            batch_id=bid,
            size=self.size,
            policy_version=None,
            partial=False,
            trainer_id=None,
        )
        assert not isinstance(lease, int), f"only {lease} eligible"
        # As the service acks a batch it leased itself: the state only, the rows kept.
        await self.store.batch_view(RUN, bid, rollouts="none")
        rids = [msgpack.unpackb(r.blob)["i"] for r in lease.rollouts]
        event = _ack_event(bid, rids, self.tokens)
        await self.store.ack(RUN, bid, kl_mean=0.001, event=event, stats_text="{}")

    def round_bucket(self) -> None:
        bid = secrets.token_hex(16)
        args: list[str | int] = [bid, self.size, self.uses, int(time.time() * 1000) + 300_000]
        got: list[bytes] = self.bucket_lease(keys=self.bucket_keys, args=args)
        if len(got) < self.size:  # this bucket ran dry: the next use's holds them all
            if got:
                self.r.rpush(f"bk:b:{self.uses + 1}", *got)
            self.uses += 1
            args[2] = self.uses
            got = self.bucket_lease(keys=self.bucket_keys, args=args)
        rids = self._read([x.split(b" ", 1)[0] for x in got])
        self.bucket_ack(keys=self.bucket_keys, args=[bid, _ack_event(bid, rids, self.tokens)])

    def round_zsets(self) -> None:
        bid = secrets.token_hex(16)
        expires = int(time.time() * 1000) + 300_000
        rec = self.zset_lease(keys=self.zset_keys, args=[bid, self.size, expires])
        members = [m for _, _, taken in msgpack.unpackb(rec, raw=True) for m in taken[1::2]]
        assert len(members) == self.size, len(members)
        rids = self._read([m.split(b" ", 1)[0] for m in members])
        kls: list[str] = []
        for rid in rids:
            kls += [f"r:{rid}", "0.001"]
        self.zset_ack(keys=self.zset_keys, args=[bid, _ack_event(bid, rids, self.tokens), *kls])

    def _read(self, rids: list[bytes]) -> list[str]:
        """What a bucket way's API process reads after its lease: the packed rollouts, in one
        MGET, as the broker's lease does. Returns the ids as text."""
        self.r.mget([b"raw:d:" + x for x in rids])
        return [x.decode() for x in rids]

    def check(self, buffered: int) -> None:
        """Every way gave back all it took: the queue and the buckets still hold every rollout,
        and the broker's run has none left leased."""
        assert self.r.llen("raw:q") == buffered
        in_buckets = sum(self.r.llen(k) for k in self.r.scan_iter(match="bk:b:*"))
        assert in_buckets == buffered, in_buckets
        in_zsets = sum(self.r.zcard(k) for k in self.r.scan_iter(match="bz:s:*"))
        assert in_zsets == buffered, in_zsets
        state = self._run(self.store.get_run(RUN))
        assert state is not None and state.leased == 0 and state.live == buffered, state

    def close(self) -> None:
        self._run(self.ar.aclose())
        self.loop.close()
        self.r.close()


def redis_cpu_s(r: redis.Redis) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def measure(fn: Callable[[], None], rounds: int, r: redis.Redis) -> float:
    """Redis CPU seconds per round of ``fn``."""
    fn()  # warm: scripts loaded, connections open
    c0 = redis_cpu_s(r)
    for _ in range(rounds):
        fn()
    return (redis_cpu_s(r) - c0) / rounds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.layout")
    p.add_argument("--buffered", type=int, default=10_048)
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--tokens", type=int, default=TOKENS)
    p.add_argument("--rounds", type=int, default=150)
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks that it runs")
    args = p.parse_args(argv)
    if args.quick:
        args.buffered, args.size, args.tokens, args.rounds = 96, 32, 64, 20
    with tempfile.TemporaryDirectory() as tmp, redis_server(Path(tmp)) as rt:
        if not rt.private:
            p.error("needs a private redis-server of version 7 or later (its CPU time is read)")
        ways = Ways(rt.url, args.buffered, args.size, args.tokens)
        try:
            best: dict[str, float] = {}
            for _ in range(2):
                for name, fn in (
                    ("raw", ways.round_raw),
                    ("broker", ways.round_broker),
                    ("bucket sketch", ways.round_bucket),
                    ("bucket zsets", ways.round_zsets),
                ):
                    s = measure(fn, args.rounds, ways.r)
                    best[name] = min(best.get(name, s), s)
            ways.check(args.buffered)
        finally:
            ways.close()
    print(
        f"Redis CPU per lease + ack of {args.size} ({args.tokens}-token rollouts, "
        f"{args.buffered:,} buffered, redis {rt.version}, best of 2 × {args.rounds} rounds)"
    )
    print("| way | Redis CPU per lease + ack | ×raw (raw ÷ way) |")
    print("|---|---|---|")
    for name, s in best.items():
        ratio = best["raw"] / s if s > 0 else float("inf")
        print(f"| {name} | {s * 1e6:,.0f} µs | ×{ratio:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
