"""A slow, sometimes hanging verifier against one that answers at once:
``python -m benchmarks.slow_rewards`` (``--quick``: tiny sizes, about 12 s).

Two arms in one run, on one broker, one ``rollout-broker worker``, a private Redis and a new
Postgres database, each arm on a run of its own with the same seed: the same generators post
groups without a reward at a fixed rate, the same reward workers lease one group at a time and
score it, and the same trainer leases batches (long poll), trains for a fixed step, acks and
moves the policy version. Arm (a): the verifier answers at once. Arm (b): its latency is
lognormal with p99 = 10 × p50, and 1 % of its attempts never answer; the worker holding such a
lease drops it, the lease expires after the run's ``reward_timeout_s`` (swept by the worker's
maintenance loop or the next reward lease) and its unscored rollout is leased again.

The figure is the trainer's idle time (in lease calls, from its first batch on), and the target
is on the idle shares, (b) minus (a): generation runs a little ahead of training, so with the
verifier at once the trainer is almost never idle, and a ratio of two near-zero times would be
noise; the difference of the two shares, in points of the trainer's time, is what a user loses.
Every reward the trainer gets is compared with the verifier's score for that rollout (a pure
function of the seed and the rollout id), and a difference stops the run with an error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson

from app import keys
from benchmarks.harness import ROOT, Row, delete_keys
from benchmarks.load import Http, expect, percentile
from benchmarks.report import machine, summary, table
from benchmarks.reward_load import Plan, Verifier, run_arm
from benchmarks.servers import (
    PG_URL,
    CpuMeter,
    RedisTarget,
    Server,
    database_url,
    postgres_database,
    proc_cpu_s,
    redis_server,
    tree_env,
    uvicorn_server,
)

SECTION = "Slow rewards: a verifier with p99 = 10 × p50 that hangs on 1 % against one at once"
IDLE_NEED_POINTS = 5.0  # the trainer's idle share may grow by at most 5 points of its time
HANG = 0.01


@dataclass(frozen=True)
class Setup:
    """The sizes of a run: the load of both arms and the slow verifier's figures."""

    rounds: int = 2  # of each arm, alternated: a, b, b, a
    duration_s: float = 15.0  # of one round
    p50_s: float = 0.05  # the slow verifier's median; its p99 is ten times this
    reward_timeout_s: float = 2.0  # a few × p99: a hung lease expires then
    generators: int = 2
    groups_per_s: float = 20.0  # per generator: 160 rollouts/s, 1.25 × what the trainer takes
    group_size: int = 4
    tokens: int = 128
    reward_workers: int = 16
    reward_wait_s: float = 0.5
    batch: int = 32
    train_s: float = 0.25
    trainer_wait_s: float = 2.0
    max_staleness: int = 8  # versions: 2 s of training, 4 × the slow verifier's p99


FULL = Setup()
QUICK = Setup(
    rounds=1,
    duration_s=1.5,
    p50_s=0.01,
    reward_timeout_s=0.3,
    groups_per_s=25.0,
    reward_workers=8,
    reward_wait_s=0.2,
    train_s=0.2,
    trainer_wait_s=1.0,
)


@dataclass
class Arm:
    """One arm's figures, summed over its rounds (each a run of its own)."""

    name: str
    totals: dict[str, float] = field(default_factory=dict)
    fills: list[float] = field(default_factory=list)  # seconds to each round's first batch
    lease_p50s: list[float] = field(default_factory=list)  # each round's median lease call
    lease_maxs: list[float] = field(default_factory=list)  # and its longest

    def add(self, tally: dict[str, float]) -> None:
        self.fills.append(tally["fill_s"])
        self.lease_p50s.append(tally["lease_p50_s"])
        self.lease_maxs.append(tally["lease_max_s"])
        for k, v in tally.items():
            self.totals[k] = self.totals.get(k, 0) + v

    def __getitem__(self, key: str) -> float:
        return self.totals.get(key, 0)

    @property
    def idle_share(self) -> float:
        return self["idle_s"] / self["span_s"] if self["span_s"] else float("nan")

    def counts(self, kind: str) -> str:
        """``kind.<name>`` figures as "name n, …"."""
        got = sorted((k.split(".", 1)[1], v) for k, v in self.totals.items() if k.startswith(kind))
        return ", ".join(f"{k} {v:,.0f}" for k, v in got) or "none"


def new_run(http: Http, name: str, s: Setup) -> str:
    run_id = f"rw-{name}-{uuid.uuid4().hex[:6]}"
    config = {
        "group_size": s.group_size,
        "max_staleness": s.max_staleness,
        "reward_timeout_s": s.reward_timeout_s,
        "max_reward_attempts": 3,
        "capacity_rollouts": 1_000_000,
    }
    status, data, _ = http.call(
        "POST",
        "/v1/runs",
        json.dumps({"run_id": run_id, "config": config}).encode(),
        "application/json",
    )
    expect(status, data, 201)
    return run_id


def lease_states(http: Http, run_id: str, lease_ids: list[str]) -> dict[str, str]:
    """How each reward lease ended, as the broker says: one asked for again by its id answers
    409 "reward lease ... was <state>" (scored, expired or returned)."""
    states = {}
    for lid in lease_ids:
        body = json.dumps({"max_rollouts": 1, "lease_id": lid}).encode()
        status, data, _ = http.call(
            "POST", f"/v1/runs/{run_id}/rewards/lease", body, "application/json"
        )
        expect(status, data, 409)
        m = re.search(r" was (\w+);", json.loads(data)["detail"])
        states[lid] = m[1] if m else "?"
    return states


def accounting(http: Http, run_id: str, within_s: float = 60.0) -> dict[str, Any]:
    """The run's accounting once the worker has drained every event of it."""
    deadline = time.monotonic() + within_s
    while True:
        status, data, _ = http.call("GET", f"/v1/runs/{run_id}/accounting")
        expect(status, data, 200)
        doc: dict[str, Any] = json.loads(data)
        if not doc["pending_events"]:
            return doc
        if time.monotonic() > deadline:
            raise RuntimeError(f"the accounting of {run_id} did not catch up: {doc}")
        time.sleep(0.05)


def say(msg: str) -> None:
    print(f"  … {msg}", file=sys.stderr, flush=True)


def warm_up(server: Server, s: Setup) -> None:
    """Every call of the load once on a run of its own, so that neither arm pays for the
    broker's first calls (its scripts loaded, its code paths run once)."""
    http = Http(server.address)
    try:
        run_id = new_run(http, "warm-up", s)
        base = f"/v1/runs/{run_id}"

        def post(path: str, doc: Any) -> Any:
            status, data, _ = http.call("POST", base + path, orjson.dumps(doc), "application/json")
            expect(status, data, 200, 202)
            return orjson.loads(data)

        group = [
            {"rollout_id": f"w{j}", "group_id": "w", "policy_version": 0, "response_ids": [1]}
            for j in range(s.group_size)
        ]
        post("/rollouts", {"rollouts": [{**r, "reward": None} for r in group]})
        lease = post("/rewards/lease", {"max_rollouts": s.group_size})
        post(
            "/rewards",
            {"rewards": {r["rollout_id"]: 0.5 for r in group}, "lease_id": lease["lease_id"]},
        )
        status, data, _ = http.call("GET", f"{base}/batch?size={s.group_size}")
        expect(status, data, 200)
        post(f"/batches/{orjson.loads(data)['batch_id']}/ack", {})
        post("/policy", {"version": 1})
        post("/close", {})
    finally:
        http.close()


def run_one(server: Server, name: str, s: Setup, verifier: Verifier) -> dict[str, float]:
    """One round of an arm on a new run: the load, then how each reward lease ended and the
    run's accounting once drained; its figures, checked (:func:`tally`)."""
    http = Http(server.address)
    t0 = time.monotonic()
    try:
        run_id = new_run(http, name, s)
        plan = Plan(
            address=server.address,
            run_id=run_id,
            verifier=verifier,
            duration_s=s.duration_s,
            # long enough for a lease dropped at the end to expire, be swept and scored again
            tail_s=s.reward_timeout_s + 2 * s.reward_wait_s + 0.3,
            generators=s.generators,
            groups_per_s=s.groups_per_s,
            group_size=s.group_size,
            tokens=s.tokens,
            reward_workers=s.reward_workers,
            reward_max=s.group_size,
            reward_wait_s=s.reward_wait_s,
            batch=s.batch,
            train_s=s.train_s,
            trainer_wait_s=s.trainer_wait_s,
        )
        cpu0, t1 = proc_cpu_s(server.pid), time.monotonic()
        got = run_arm(plan)
        cpu = {"broker_cpu_s": proc_cpu_s(server.pid) - cpu0, "load_s": time.monotonic() - t1}
        http.close()  # idle for longer than the server keeps a connection
        http = Http(server.address)
        states = lease_states(http, run_id, got["reward"].lease_ids)
        status, data, _ = http.call("POST", f"/v1/runs/{run_id}/close")
        expect(status, data, 200)
        acc = accounting(http, run_id)
        say(f"{name}: {time.monotonic() - t0:.1f} s")
        return {**tally(name, got, states, acc), **cpu}
    finally:
        http.close()


def tally(
    name: str, got: dict[str, Any], states: dict[str, str], acc: dict[str, Any]
) -> dict[str, float]:
    """A round's figures, once what must hold whatever the timing does: every trained rollout
    was checked against its verifier score (the trainer raises on a difference), none was
    trained twice, and every lease left with a hung rollout expired."""
    t, r, g = got["train"], got["reward"], got["generate"]
    if not t.trained or t.checked != t.trained or len(set(t.ids)) != len(t.ids):
        raise RuntimeError(f"{name}: {t.trained} trained, {t.checked} checked, or ids repeated")
    if not_expired := [lid for lid in r.dropped if states[lid] != "expired"]:
        raise RuntimeError(f"{name}: reward leases dropped but not expired: {not_expired}")
    hung = set(r.hung)
    out: dict[str, float] = {
        "idle_s": t.idle_s,
        "span_s": t.span_s,
        "fill_s": t.fill_s,
        "ack_s": t.ack_s,
        "policy_s": t.policy_s,
        "batches": t.batches,
        "trained": t.trained,
        "checked": t.checked,
        "posted": g.accepted,
        "groups": g.groups,
        "leases": len(r.lease_ids),
        "scored": r.scored,
        "duplicates": r.duplicates,
        "late": r.late,
        "hung": len(hung),
        "dropped": len(r.dropped),
        "rescored": len(hung & set(r.rescored)),
        "hung_trained": len(hung & set(t.ids)),
        "dead_letters": acc.get("dead_letters", 0),
        "lease_p50_s": percentile(t.leases_s, 50),
        "lease_max_s": max(t.leases_s, default=0.0),
        **{f"cpu.{k}": got[f"cpu:{k}"] for k in ("generate", "reward", "train")},
    }
    for k, v in acc["retired"].items():
        out[f"retired.{k}"] = v
    for k, v in Counter(states.values()).items():
        out[f"lease.{k}"] = v
    for k, v in g.rejected.items():
        out[f"rejected.{k}"] = v
    return out


CPU_KEYS = ("cpu.generate", "cpu.reward", "cpu.train")


def secs(xs: list[float]) -> str:
    return ", ".join(f"{x:.2f}" for x in xs)


def ms(xs: list[float]) -> str:
    return ", ".join(f"{x * 1e3:.0f}" for x in xs)


def arm_note(arm: Arm) -> str:
    span = arm["span_s"]
    cores = "/".join(f"{arm[k] / arm['load_s']:.2f}" for k in CPU_KEYS)
    note = (
        f"idle {100 * arm.idle_share:.2f} % of the trainer's {span:.1f} s from its first batch "
        f"(which came after {secs(arm.fills)} s; lease calls p50 {ms(arm.lease_p50s)} ms, "
        f"longest {ms(arm.lease_maxs)} ms), in ack calls "
        f"{100 * arm['ack_s'] / span:.1f} %, in policy calls {100 * arm['policy_s'] / span:.1f} "
        f"%; {arm['batches']:,.0f} batches, {arm['trained']:,.0f} rollouts trained, every "
        f"reward its verifier score ({arm['checked']:,.0f} checked); {arm['posted']:,.0f} posted "
        f"in {arm['groups']:,.0f} groups; {arm['leases']:,.0f} reward leases (ended: "
        f"{arm.counts('lease.')}), {arm['scored']:,.0f} rollouts scored, "
        f"{arm['duplicates']:,.0f} duplicates; reward leases expired: {arm['lease.expired']:,.0f}; "
        f"retired: {arm.counts('retired.')}; the broker process used "
        f"{arm['broker_cpu_s'] / arm['load_s']:.2f} cores, the generators, reward workers and "
        f"trainer {cores} cores"
    )
    if arm.counts("rejected.") != "none":
        note += f"; rejected at ingest: {arm.counts('rejected.')}"
    if arm["hung"]:
        note += (
            f"; {arm['hung']:,.0f} rollouts hung, their {arm['dropped']:,.0f} leases expired, "
            f"{arm['rescored']:,.0f} of them scored on a later lease, {arm['hung_trained']:,.0f} "
            f"trained; leases answered after their expiry: {arm['late']:,.0f}"
        )
    if arm["dead_letters"]:
        note += f"; accounting dead letters: {arm['dead_letters']:,.0f}"
    return note


def result_rows(fast: Arm, slow: Arm, s: Setup, rounds: int) -> list[Row]:
    """The idle time of each arm (the target on the slow one's share against the other's), and
    the rollouts each trained per second."""
    slow_name = (
        f"verifier lognormal p50 {s.p50_s * 1e3:g} ms / p99 {s.p50_s * 1e4:g} ms, "
        f"{100 * HANG:g} % hung, reward_timeout_s {s.reward_timeout_s:g}"
    )
    fast_name = "verifier answers at once"
    rows = [
        Row(
            "slow_rewards.at_once.idle",
            SECTION,
            f"trainer idle in lease calls, {fast_name}",
            fast["idle_s"] * 1e3,
            "ms",
            note="baseline; " + arm_note(fast),
        ),
        Row(
            "slow_rewards.slow.idle",
            SECTION,
            f"trainer idle in lease calls, {slow_name}",
            slow["idle_s"] * 1e3,
            "ms",
            note=(
                f"idle ×{slow['idle_s'] / fast['idle_s']:.2f} the verifier at once, a ratio of two "
                "small times (the target is on the shares); "
                if fast["idle_s"]
                else ""
            )
            + arm_note(slow),
        ),
    ]
    points = 100 * (slow.idle_share - fast.idle_share)
    rows[1].target(
        f"≤+{IDLE_NEED_POINTS:g} points idle share", points, IDLE_NEED_POINTS, at_most=True
    )
    for arm, key, name in ((fast, "at_once", fast_name), (slow, "slow", slow_name)):
        rows.append(
            Row(
                f"slow_rewards.{key}.trained",
                SECTION,
                f"rollouts trained, {name}",
                arm["trained"] / arm["span_s"],
                "rollouts/s",
                tokens_per_s=arm["trained"] * s.tokens / arm["span_s"],
                note=f"{arm['trained']:,.0f} in {arm['span_s']:.1f} s ({rounds} round(s)); a "
                f"training step of {s.train_s:g} s a batch of {s.batch} allows at most "
                f"{s.batch / s.train_s:,.0f}/s; {s.generators * s.groups_per_s * s.group_size:,.0f}"
                "/s posted",
            )
        )
    return rows


@contextlib.contextmanager
def worker_process(app_dir: Path, env: dict[str, str], log_path: Path) -> Iterator[int]:
    """``rollout-broker worker`` (the accounting drain and the maintenance loop that sweeps
    expired reward leases) in a subprocess; yields its pid."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "worker"],
            cwd=app_dir,
            env=tree_env(app_dir, env),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            yield proc.pid
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


@contextlib.contextmanager
def services(
    args: argparse.Namespace, work: Path
) -> Iterator[tuple[RedisTarget, Server, list[int]]]:
    """A private Redis, a new database, the broker and one worker on them. The broker opens
    the database only when it first needs it, so it starts while the database is created and
    migrated; the worker starts after."""
    app_dir = Path(args.app_dir).resolve()
    with redis_server(work, args.redis_url) as rt, contextlib.ExitStack() as stack:
        prefix = f"rbslow{uuid.uuid4().hex[:8]}"
        rc = rt.client()
        stack.callback(rc.close)
        stack.callback(
            lambda: delete_keys(rc, list(rc.scan_iter(match=keys.every_key(prefix), count=2000)))
        )
        name = f"rbbench_{uuid.uuid4().hex[:12]}"
        env = {
            "BROKER_REDIS_URL": rt.url,
            "BROKER_REDIS_PREFIX": prefix,
            "BROKER_DATABASE_URL": database_url(args.pg_url, name),
        }
        with ThreadPoolExecutor(1) as pool:
            db = pool.submit(
                stack.enter_context, postgres_database(args.pg_url, app_dir, work, name)
            )
            broker = stack.enter_context(
                uvicorn_server(
                    "broker", "app.main:create_app", cwd=app_dir, workdir=work, env=env,
                    factory=True,
                )
            )  # fmt: skip
            db.result()
        worker = stack.enter_context(worker_process(app_dir, env, work / "worker.log"))
        yield rt, broker, [p for p in (rt.pid, broker.pid, worker) if p]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.slow_rewards", description=__doc__)
    p.add_argument("--quick", action="store_true", help="tiny sizes, about 12 s")
    p.add_argument("--seconds", type=float, help="each round's length (default 15, quick 1.5)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", metavar="PATH", help="also write the rows and arms as JSON")
    p.add_argument("--redis-url", help="use this Redis instead of a private redis-server")
    p.add_argument("--app-dir", default=str(ROOT), help="the broker source tree to benchmark")
    p.add_argument("--pg-url", default=os.environ.get("BENCH_PG_URL", PG_URL))
    args = p.parse_args(argv)
    s = QUICK if args.quick else FULL
    if args.seconds:
        s = replace(s, duration_s=args.seconds)
    started = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix="rb-slow-rewards-") as tmp,
        services(args, Path(tmp)) as (rt, broker, pids),
    ):
        say(f"services up after {time.monotonic() - started:.1f} s")
        warm_up(broker, s)
        meter = CpuMeter(pids)
        meter.start()
        fast, slow = Arm("at-once"), Arm("slow")
        verifiers = {"at-once": Verifier(args.seed), "slow": Verifier(args.seed, s.p50_s, HANG)}
        for i in range(s.rounds):  # a, b, b, a, …: neither arm always runs first
            for arm in (fast, slow) if i % 2 == 0 else (slow, fast):
                arm.add(run_one(broker, arm.name, s, verifiers[arm.name]))
        info = machine(rt, Path(args.app_dir).resolve())
        info["cpu load"] = meter.report()
    rows = result_rows(fast, slow, s, s.rounds)
    print(f"Slow rewards ({'quick' if args.quick else 'full'}, {time.monotonic() - started:.0f} s)")
    print("\n".join(f"- {k}: {v}" for k, v in info.items()))
    print()
    print(table(rows))
    print()
    print(summary(rows))
    if args.json:
        doc = {
            "machine": info,
            "quick": args.quick,
            "rows": [r.to_json() for r in rows],
            "arms": {arm.name: arm.totals for arm in (fast, slow)},
        }
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
