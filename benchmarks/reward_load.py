"""The loads of the slow-rewards benchmark (``benchmarks/slow_rewards.py``): generators posting
groups without a reward at a fixed rate, reward workers leasing them and scoring them with a
modelled verifier, and one trainer leasing batches, checking every reward, acking and moving the
policy version. Each role runs in a forked process of its own (generators and reward workers as
threads of theirs), they start together, and every loop stops by itself at a deadline.

The verifier is a pure function of the run's seed and the rollout id (its score) and of the
attempt (its latency, and whether it hangs), so the trainer can check that every reward it gets
is the verifier's score for that very rollout, and both arms of a run see the same rollouts.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import multiprocessing as mp
import random
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import orjson

from benchmarks.load import Address, Http, expect

JSON = "application/json"
SIGMA_P99_OVER_P50 = math.log(10) / 2.326  # lognormal sigma whose p99 is 10 × its p50


@dataclass(frozen=True)
class Verifier:
    """The modelled verifier: latency lognormal around ``p50_s`` (p99 = 10 × p50), or none at
    all (``p50_s`` 0), and a share ``hang`` of the attempts never answered."""

    seed: int
    p50_s: float = 0.0
    hang: float = 0.0

    def score(self, rollout_id: str) -> float:
        """The reward of a rollout: the same for every attempt, in [0, 1)."""
        digest = hashlib.sha256(f"{self.seed}:score:{rollout_id}".encode()).digest()
        return int.from_bytes(digest[:7], "big") / 2**56

    def attempt(self, rollout_id: str, attempt: int) -> float | None:
        """Seconds the ``attempt``-th scoring of a rollout takes, None if it hangs."""
        rng = random.Random(f"{self.seed}:attempt:{rollout_id}:{attempt}")
        if rng.random() < self.hang:
            return None
        if self.p50_s <= 0:
            return 0.0
        return rng.lognormvariate(math.log(self.p50_s), SIGMA_P99_OVER_P50)


@dataclass(frozen=True)
class Plan:
    """One arm's load."""

    address: Address
    run_id: str
    verifier: Verifier
    duration_s: float  # generators and the trainer stop then
    tail_s: float  # reward workers go on this long after, to score what hung again
    generators: int
    groups_per_s: float  # per generator
    group_size: int
    tokens: int  # response tokens of a rollout
    reward_workers: int
    reward_max: int  # max_rollouts of a reward lease
    reward_wait_s: float
    batch: int  # rollouts per trainer batch
    train_s: float  # the trainer's step between lease and ack
    trainer_wait_s: float


@dataclass
class TrainerResult:
    batches: int = 0
    trained: int = 0
    idle_s: float = 0.0  # in lease calls, from the first batch on
    ack_s: float = 0.0  # in ack calls
    policy_s: float = 0.0  # in policy calls
    fill_s: float = 0.0  # from the start to the first batch
    span_s: float = 0.0  # from the first batch to the deadline
    empty: int = 0  # leases answered 204
    checked: int = 0  # rewards compared with the verifier's score
    leases_s: list[float] = field(default_factory=list)  # each lease call from the first batch on
    ids: list[str] = field(default_factory=list)


@dataclass
class RewardResult:
    lease_ids: list[str] = field(default_factory=list)
    scored: int = 0
    duplicates: int = 0
    hung: list[str] = field(default_factory=list)  # rollout ids of attempts that hung
    dropped: list[str] = field(default_factory=list)  # lease ids left with a hung rollout
    late: int = 0  # scores posted after their lease's expires_at
    rescored: list[str] = field(default_factory=list)  # scored on a later attempt than one hung
    attempts: Counter[int] = field(default_factory=Counter)  # attempts per scoring


@dataclass
class GeneratorResult:
    groups: int = 0
    accepted: int = 0
    rejected: Counter[str] = field(default_factory=Counter)


def _post_json(http: Http, path: str, doc: Any, *ok: int) -> tuple[int, Any]:
    status, data, _ = http.call("POST", path, orjson.dumps(doc), JSON)
    expect(status, data, *ok)
    return status, orjson.loads(data) if data else None


# -- generators -----------------------------------------------------------------------------
def generate(plan: Plan, version: Any, start: float) -> GeneratorResult:
    """``plan.generators`` threads, each posting one group of ``group_size`` rollouts without a
    reward every 1 / ``groups_per_s`` s (on a fixed schedule, not after the last answer), at the
    policy version the trainer last set."""
    out = GeneratorResult()
    lock = threading.Lock()
    ids = list(range(plan.tokens))

    def one(g: int) -> None:
        http = Http(plan.address)
        path = f"/v1/runs/{plan.run_id}/rollouts"
        deadline = start + plan.duration_s
        i = 0
        while (due := start + i / plan.groups_per_s) < deadline:
            time.sleep(max(0.0, due - time.perf_counter()))
            gid = f"g{g}-{i:06d}"
            rollouts = [
                {
                    "rollout_id": f"{gid}-{j}",
                    "group_id": gid,
                    "policy_version": version.value,
                    "response_ids": ids,
                    "reward": None,
                }
                for j in range(plan.group_size)
            ]
            _, got = _post_json(http, path, {"rollouts": rollouts}, 202)
            with lock:
                out.groups += 1
                out.accepted += got["accepted"]
                out.rejected.update(r["reason"] for r in got["rejected"])
            i += 1
        http.close()

    _threads(one, plan.generators)
    return out


# -- reward workers -------------------------------------------------------------------------
def reward(plan: Plan, start: float) -> RewardResult:
    """``plan.reward_workers`` threads, each leasing up to ``reward_max`` rollouts (one group),
    scoring them at once as a verifier pool would (the lease takes as long as its slowest
    answer), and posting the answered scores with the lease id. A hung rollout is never
    answered: its worker drops the lease and takes the next, and the broker's expiry of the
    lease (``reward_timeout_s``) brings it back for another attempt."""
    out = RewardResult()
    lock = threading.Lock()
    tries: Counter[str] = Counter()  # attempts made per rollout, across the workers
    hung_before: set[str] = set()
    verifier = plan.verifier

    def one(w: int) -> None:
        http = Http(plan.address)
        base = f"/v1/runs/{plan.run_id}/rewards"
        ask = {"max_rollouts": plan.reward_max, "worker_id": f"w{w}", "wait_s": plan.reward_wait_s}
        deadline = start + plan.duration_s + plan.tail_s
        while time.perf_counter() < deadline:
            status, lease = _post_json(http, f"{base}/lease", ask, 200, 204)
            if status == 204:
                continue
            answers: dict[str, float] = {}
            slowest = 0.0
            hung: list[str] = []
            with lock:
                out.lease_ids.append(lease["lease_id"])
                for r in lease["rollouts"]:
                    rid = r["rollout_id"]
                    tries[rid] += 1
                    took = verifier.attempt(rid, tries[rid])
                    if took is None:
                        hung.append(rid)
                        hung_before.add(rid)
                        continue
                    answers[rid] = verifier.score(rid)
                    slowest = max(slowest, took)
                    out.attempts[tries[rid]] += 1
                    if rid in hung_before:
                        out.rescored.append(rid)
            time.sleep(slowest)
            late = time.time() > _epoch(lease["expires_at"])
            got = {"scored": 0, "duplicates": 0}
            if answers:
                doc = {"rewards": answers, "lease_id": lease["lease_id"]}
                got = _post_json(http, base, doc, 200)[1]
            with lock:
                out.scored += got["scored"]
                out.duplicates += got["duplicates"]
                out.late += int(late and bool(answers))
                out.hung += hung
                if hung:
                    out.dropped.append(lease["lease_id"])
        http.close()

    _threads(one, plan.reward_workers)
    return out


def _epoch(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


# -- the trainer ----------------------------------------------------------------------------
def train(plan: Plan, version: Any, start: float) -> TrainerResult:
    """Lease a batch (``wait_s`` long poll), check every reward against the verifier's score
    for that rollout (RuntimeError on the first that differs or is missing), train for
    ``train_s``, ack, and set the next policy version. Idle is the time spent in lease calls
    from the first batch on; the wait for the first one (the pipeline filling) is apart."""
    out = TrainerResult()
    http = Http(plan.address)
    base = f"/v1/runs/{plan.run_id}"
    deadline = start + plan.duration_s
    first: float | None = None
    while (now := time.perf_counter()) < deadline:
        wait = min(plan.trainer_wait_s, max(0.0, deadline - now))
        status, data, _ = http.call("GET", f"{base}/batch?size={plan.batch}&wait_s={wait:.3f}")
        got_at = time.perf_counter()
        if first is not None:
            out.idle_s += got_at - now
            out.leases_s.append(got_at - now)
        if status == 204:
            out.empty += 1
            continue
        expect(status, data, 200)
        if first is None:
            first = got_at
            out.fill_s = got_at - start
        doc = orjson.loads(data)
        for r in doc["rollouts"]:
            want = plan.verifier.score(r["rollout_id"])
            if r["reward"] != want:
                raise RuntimeError(
                    f"rollout {r['rollout_id']!r} was handed to the trainer with reward "
                    f"{r['reward']!r}, not its verifier score {want!r}"
                )
            out.checked += 1
            out.ids.append(r["rollout_id"])
        time.sleep(plan.train_s)
        t = time.perf_counter()
        _post_json(http, f"{base}/batches/{doc['batch_id']}/ack", {}, 200)
        out.batches += 1
        out.trained += len(doc["rollouts"])
        out.ack_s += (t2 := time.perf_counter()) - t
        _post_json(http, f"{base}/policy", {"version": version.value + 1}, 200)
        version.value += 1  # only once the broker has it: a generator never posts ahead
        out.policy_s += time.perf_counter() - t2
    out.span_s = deadline - first if first is not None else 0.0
    http.close()
    return out


# -- running the roles ----------------------------------------------------------------------
def _threads(fn: Callable[[int], None], n: int) -> None:
    """Run ``fn(0) … fn(n-1)`` in threads; re-raise the first error once all have stopped."""
    errors: list[BaseException] = []

    def guarded(i: int) -> None:
        try:
            fn(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _role(name: str, plan: Plan, version: Any, barrier: Any, out: Any) -> None:
    try:
        barrier.wait()
        start = time.perf_counter()
        if name == "generate":
            got: Any = generate(plan, version, start)
        elif name == "reward":
            got = reward(plan, start)
        else:
            got = train(plan, version, start)
        out.put((name, "ok", (got, time.process_time())))
    except BaseException:  # the parent re-raises it
        barrier.abort()
        out.put((name, "error", traceback.format_exc()))


def run_arm(plan: Plan, first_version: int = 0) -> dict[str, Any]:
    """The three roles in forked processes, started together; their results by role name, and
    the CPU seconds each process used (``cpu:<name>``)."""
    ctx = mp.get_context("fork")
    version = ctx.Value("q", first_version)
    barrier = ctx.Barrier(3)
    out = ctx.Queue()
    names = ("generate", "reward", "train")
    procs = [ctx.Process(target=_role, args=(n, plan, version, barrier, out)) for n in names]
    for p in procs:
        p.start()
    results: dict[str, Any] = {}
    errors: list[str] = []
    try:
        timeout = plan.duration_s + plan.tail_s + 120
        for _ in procs:
            name, kind, value = out.get(timeout=timeout)
            if kind == "ok":
                results[name], results[f"cpu:{name}"] = value
            else:
                errors.append(f"{name}: {value}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                with contextlib.suppress(Exception):
                    p.join(timeout=5)
    if errors:
        raise RuntimeError("a load process failed:\n" + errors[0])
    return results
