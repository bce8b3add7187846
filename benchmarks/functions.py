"""Redis's CPU per call of the broker's scripts as one function library (``FCALL``) against the
same code sent as a script (``EVALSHA`` of the text ``lua_source()`` builds: the key names, the
libraries the script requires and ``begin``, compiled by Redis once and run whole at every
call, as the scripts ran before the library). One private redis-server, one run; the two ways
alternate in rounds and the best round of each is kept.

    python -m benchmarks.functions            # about 10 s
    python -m benchmarks.functions --quick    # tiny sizes

The figure is Redis's own ``usec_per_call`` of ``INFO commandstats`` for FCALL and EVALSHA.
Rows: ``policy_view`` (reads the run's hash: what a call costs beyond its work), an ingest of
one rollout of 1,024 tokens (a new rollout id each call) and ``sweep`` of a run with nothing
to sweep.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from app import keys
from app.broker.config import RunConfig
from app.broker.packing import pack_rollout
from app.broker.scripts import LIBRARY, guarded, lua_source
from app.broker.store import RedisStore
from benchmarks.payloads import TOKENS
from benchmarks.servers import redis_server

PREFIX = "rbfn"


def eval_text(name: str) -> str:
    """Script ``name`` as a script to EVAL: the libraries it requires and ``begin``, then its
    body in a function of its own, as in the library (the main chunk holds the libraries'
    locals)."""
    body = guarded(name)
    requires = next((x for x in body.splitlines() if x.startswith("-- requires:")), "")
    return lua_source(f"{requires}\nreturn (function()\n{body}\nend)()")


async def usec_per_call(r: Redis, command: str) -> float:
    stats = await r.info("commandstats")
    return float(stats[f"cmdstat_{command}"]["usec_per_call"])


async def measure(r: Redis, calls: list[tuple[str, list[Any]]], via: str) -> float:
    """µs of Redis CPU per call of ``calls`` ([(script, args)]) made ``via`` FCALL or EVALSHA."""
    run_keys = keys.script_keys(PREFIX, "r")
    await r.config_resetstat()
    for name, args in calls:
        argv = [keys.wake_channel(PREFIX, "r"), *args]
        if via == "fcall":
            await r.fcall(LIBRARY.functions[name], len(run_keys), *run_keys, *argv)
        else:
            await r.register_script(eval_text(name))(keys=run_keys, args=argv)
    return await usec_per_call(r, via)


def ingest_args(i: int, tokens: int) -> list[Any]:
    p = pack_rollout(
        rollout_id=f"r{i:031d}",
        group_id=None,
        policy_version=0,
        prompt_ids=None,
        response_ids=list(range(tokens)),
        logprobs=[-0.5] * tokens,
        reward=1.0,
        finish_reason="stop",
        metadata=None,
        max_tokens=1 << 20,
    )
    return [1, p.rollout_id, "", "0", str(p.v_new), p.tokens, p.masked, p.reward_text, p.blob, ""]


async def run(url: str, calls: int, tokens: int) -> dict[str, dict[str, float]]:
    r = Redis.from_url(url)
    store = RedisStore(r, PREFIX)
    await store.create_run("r", RunConfig(max_reuse=1))
    rows = {
        "policy_view": lambda i: ("policy_view", ["", 0]),
        "ingest, 1 rollout": lambda i: ("ingest", ingest_args(i, tokens)),
        "sweep, nothing to sweep": lambda i: ("sweep", [64]),
    }
    best: dict[str, dict[str, float]] = {row: {} for row in rows}
    n = 0
    for _ in range(3):
        for row, make in rows.items():
            for via in ("fcall", "evalsha"):
                batch = [make(n + i) for i in range(calls)]
                n += calls
                us = await measure(r, batch, via)
                best[row][via] = min(best[row].get(via, us), us)
    await r.aclose()
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.functions")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--tokens", type=int, default=TOKENS)
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks that it runs")
    args = p.parse_args(argv)
    if args.quick:
        args.calls, args.tokens = 50, 16
    with tempfile.TemporaryDirectory() as tmp, redis_server(Path(tmp)) as rt:
        if not rt.private:
            p.error("needs a private redis-server of version 7 or later (its stats are read)")
        best = asyncio.run(run(rt.url, args.calls, args.tokens))
    print(f"Redis CPU per call (redis {rt.version}, best of 3 rounds of {args.calls:,} calls)")
    print("| script | FCALL (library) | EVALSHA (same code as a script) | saved per call |")
    print("|---|---|---|---|")
    for row, got in best.items():
        saved = got["evalsha"] - got["fcall"]
        print(f"| {row} | {got['fcall']:.1f} µs | {got['evalsha']:.1f} µs | {saved:.1f} µs |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
