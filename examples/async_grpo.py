"""Asynchronous GRPO on a toy task, on CPU, through Rollout Broker: free-running generators
against generators that take work leases under the staleness budget.

The task: ``PROBLEMS`` problems, each with a hidden target sequence whose length is drawn per
problem (4 to 64 tokens, most of them short) from a vocabulary of ``VOCAB``; a response is as
long as its problem's target and its reward is the share of the target's tokens it reproduces
(the expected reward printed counts them: a long problem is worth more than a short one). The
policy is a table of logits
``theta[problem, position, token]`` with a softmax per position (numpy only). Sampling a
group costs ``--token-ms`` of (simulated) generation time per token of the response, so long
responses take longer to come back, as they do on a real inference server.

The same prompts, the same trainer and the same number of trainer steps run twice:

* **free-running** (``--mode free``): each generator process walks its share of the prompt
  list, samples a group of ``GROUP`` responses with the policy snapshot it last loaded, and posts
  them tagged with that version, whether or not a trainer will want them by then. A long
  response is tagged with the version at which it *started*, so it arrives older than the short
  ones sampled after it; the trainer takes the freshest groups, and what falls more than
  ``max_staleness`` versions behind retires ``stale``.
* **work leases** (``--mode work``): the prompts are registered with the broker, the run's
  ``step_groups`` is the trainer's groups per step, and each generator loops over
  ``client.work(run_id, ...)``: the broker hands out a prompt only while fewer than
  ``(version + max_staleness + 1) * step_groups`` groups are admitted, and the generator posts
  the prompt's group with the ``group_id`` of the lease. Generators wait instead of generating
  rollouts nobody will train on.
* **difficulty pools** (``--mode pools``, or ``--mode all`` for the three): work leases as
  above, with the run's ``difficulty`` sorting each problem by the mean reward of its last
  group: the problems it has learned (above ``--easy-above``) are skipped, those it fails
  (below ``--hard-below``) drawn twice as often as the rest.

The trainer leases batches of ``--groups-per-step`` whole groups, computes the clipped GRPO
objective with group-normalised advantages and per-token importance ratios against the
behaviour logprobs, spends ``--step-ms`` on the step (a stand-in for the backward pass), acks
with the new policy's logprobs and publishes the new version: ``POST /policy`` first, then the
weights file, so a generator never tags a rollout with a version the broker has not announced.

At the end it prints the runs' accounting side by side: rollouts generated, samples that
reached a gradient, rollouts retired stale, wasted tokens, the broker's bias figures (the mean
length and reward of the responses generated against those trained on, and the
Kolmogorov–Smirnov distance between the two length distributions: free-running trains on
shorter responses than it generates), how long generators and trainers waited, the prompt
passes done and skipped, and the expected reward every few steps.

Run it against a broker with ``--url``, or with none to have it start ``rollout-broker serve``
itself (against ``BROKER_REDIS_URL`` / ``BROKER_DATABASE_URL`` when set, else embedded Redis and
Postgres in a temporary data folder)::

    python examples/async_grpo.py

Access control. The broker it starts runs with auth on (``BROKER_AUTH=on``) and a bootstrap
admin token of its own (``BROKER_ADMIN_TOKEN``), with which it creates one token per role, each
limited to the runs of this example (``<prefix>-*``): ``<prefix>-setup`` (scope ``operate``)
creates, closes and reads the accounting of the runs and registers the prompts,
``<prefix>-trainer`` (``train``) leases, acks and announces policy versions, and
``<prefix>-generators`` (``generate``) posts rollouts and takes work. The audit log then names
each role's actions, which the example prints at the end; it revokes the three tokens when it
is done. Against a broker of yours (``--url``) every role uses the token in ``BROKER_TOKEN``
(the clients read it by default), which needs the scopes ``operate``, ``train`` and
``generate`` (or ``admin``) on the runs ``<prefix>-free`` and ``<prefix>-work``; with auth off,
leave it unset::

    BROKER_TOKEN=rb_... python examples/async_grpo.py --url http://broker:8000
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing as mp
import os
import re
import secrets
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from rollout_broker_client import (
    Batch,
    BrokerClient,
    Conflict,
    LeasedRollout,
    NotFound,
    Rollout,
    RunNotFound,
    Scope,
)

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

# The task and the policy.
PROBLEMS, VOCAB = 16, 8
MIN_LENGTH, MAX_LENGTH = 4, 64
GROUP = 8  # responses per prompt (K)
MODES = {"free": "free-running", "work": "work leases", "pools": "difficulty pools"}
BOTH = ("free", "work")  # --mode both


@dataclass(frozen=True)
class Roles:
    """The token of each role; None: the client's default, ``BROKER_TOKEN`` (or none)."""

    setup: str | None = None  # operate: runs, prompts, accounting
    trainer: str | None = None  # train: lease, ack, policy versions
    generators: str | None = None  # generate: rollouts, work leases


ROLE_SCOPES: dict[str, Scope] = {"setup": "operate", "trainer": "train", "generators": "generate"}


@dataclass(frozen=True)
class Task:
    lengths: IntArray  # per problem: the length of its target and of every response to it
    targets: IntArray  # [problem, position]; positions past the problem's length are unused
    order: list[int]  # the prompt list: every problem once, in a shuffled order

    @property
    def long(self) -> npt.NDArray[np.bool_]:
        """The longer half of the problems."""
        out = np.zeros(PROBLEMS, dtype=np.bool_)
        out[np.argsort(self.lengths, kind="stable")[PROBLEMS // 2 :]] = True
        return out


def make_task(seed: int) -> Task:
    rng = np.random.default_rng(seed)
    # Log-uniform lengths: most targets short, a few long.
    u = rng.random(PROBLEMS)
    lengths = np.round(MIN_LENGTH * (MAX_LENGTH / MIN_LENGTH) ** u).astype(np.int64)
    targets = rng.integers(0, VOCAB, size=(PROBLEMS, MAX_LENGTH))
    order = [int(p) for p in rng.permutation(PROBLEMS)]
    return Task(lengths, targets, order)


def prompt_id(problem: int) -> str:
    return f"q{problem:02d}"


def log_softmax(theta: FloatArray) -> FloatArray:
    z = theta - theta.max(axis=-1, keepdims=True)
    out: FloatArray = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return out


def expected_rewards(theta: FloatArray, task: Task) -> FloatArray:
    """The policy's exact expected reward on each problem: Σ over its positions of
    P(target token)."""
    probs = np.exp(log_softmax(theta))
    picked = np.take_along_axis(probs, task.targets[:, :, None], axis=-1)[:, :, 0]
    mask = np.arange(MAX_LENGTH)[None, :] < task.lengths[:, None]
    out: FloatArray = (picked * mask).sum(axis=1)
    return out


def token_logprobs(theta: FloatArray, problem: int, tokens: npt.NDArray[Any]) -> FloatArray:
    lp = log_softmax(theta[problem, : len(tokens)])
    out: FloatArray = lp[np.arange(len(tokens)), tokens]
    return out


def problem_of(r: LeasedRollout) -> int:
    assert r.prompt_ids is not None  # the generators always send the prompt
    return int(r.prompt_ids[0])


# -- weights shared with the generators ------------------------------------------------------


def publish(path: Path, theta: FloatArray, version: int) -> None:
    """Write the weights atomically: readers see the old file or the new one, never a part."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.savez(f, theta=theta, version=np.int64(version))
    os.replace(tmp, path)


def load(path: Path) -> tuple[FloatArray, int]:
    with np.load(path) as z:
        return np.array(z["theta"]), int(z["version"])


# -- generators ------------------------------------------------------------------------------


@dataclass
class Sampler:
    """A generator's policy snapshot and its sampling of groups."""

    task: Task
    weights: Path
    rng: np.random.Generator
    token_s: float
    theta: FloatArray = field(init=False)
    version: int = field(init=False)

    def __post_init__(self) -> None:
        self.theta, self.version = load(self.weights)

    def refresh(self, at_least: int = 0) -> None:
        """Load the newest weights; wait for a file of version ``at_least`` (the trainer
        announces a version just before it writes the file)."""
        while True:
            theta, version = load(self.weights)
            if version > self.version:
                self.theta, self.version = theta, version
            if self.version >= at_least:
                return
            time.sleep(0.001)

    def group(self, problem: int, name: str) -> list[Rollout]:
        """``GROUP`` responses to ``problem`` with the snapshot loaded now, taking
        ``token_s`` per token: the version they carry is the one they started from."""
        length = int(self.task.lengths[problem])
        probs = np.exp(log_softmax(self.theta[problem, :length]))
        u = self.rng.random((GROUP, length, 1))
        tokens = np.minimum((np.cumsum(probs, axis=-1)[None] < u).sum(axis=-1), VOCAB - 1)
        target = self.task.targets[problem, :length]
        version, theta = self.version, self.theta
        time.sleep(self.token_s * length)  # every response of the group decodes in parallel
        return [
            Rollout(
                rollout_id=f"{name}-{k}",
                group_id=name,
                policy_version=version,
                prompt_ids=np.array([problem]),
                response_ids=tokens[k],
                logprobs=token_logprobs(theta, problem, tokens[k]),
                reward=float((tokens[k] == target).mean()),
                finish_reason="stop",
            )
            for k in range(GROUP)
        ]


def free_generator(
    url: str,
    run_id: str,
    weights: str,
    seed: int,
    index: int,
    token_s: float,
    ready: Barrier,
    count: int,
    token: str | None,
) -> None:
    """Walk this generator's share of the prompt list, pass after pass, and post every group
    tagged with the version it was sampled at, until the run closes."""
    task = make_task(seed)
    sampler = Sampler(task, Path(weights), np.random.default_rng([seed, index]), token_s)
    with (
        BrokerClient(url, token=token) as broker,
        broker.writer(run_id, batch_size=GROUP) as out,
    ):
        ready.wait()
        n = index
        while True:
            run = broker.get_run(run_id)
            if run.status != "open":
                break
            if run.policy_version > sampler.version:
                sampler.refresh()
            problem = task.order[n % PROBLEMS]
            result = out.add(*sampler.group(problem, f"{prompt_id(problem)}-g{index}-{n}"))
            if result is not None and any(r.reason == "run_closed" for r in result.rejected):
                break
            n += count


def work_generator(
    url: str,
    run_id: str,
    weights: str,
    seed: int,
    index: int,
    token_s: float,
    ready: Barrier,
    max_prompts: int,
    token: str | None,
) -> None:
    """Take work leases until the run closes; post each prompt's group with the lease's
    ``group_id``, sampled at the lease's version or later."""
    task = make_task(seed)
    sampler = Sampler(task, Path(weights), np.random.default_rng([seed, index]), token_s)
    with BrokerClient(url, generator_id=f"g{index}", token=token) as broker:
        ready.wait()
        # Conflict: the run closed, the trainer is done.
        with (
            contextlib.suppress(Conflict),
            broker.work(run_id, max_prompts=max_prompts, wait_s=1.0) as leases,
        ):
            for lease in leases:
                sampler.refresh(lease.policy_version)
                for prompt in lease.prompts:
                    assert prompt.data is not None
                    lease.post(prompt, sampler.group(prompt.data["problem"], prompt.group_id))


# -- the trainer -----------------------------------------------------------------------------


@dataclass
class StepStats:
    reward_mean: float
    lag_mean: float
    ratio_mean: float
    clipped: float


def grpo_step(
    theta: FloatArray, batch: Batch, lr: float, eps: float
) -> tuple[FloatArray, StepStats]:
    """One ascent step on the clipped GRPO objective
    ``(1/n) Σ_i Σ_t min(r_it A_i, clip(r_it, 1-eps, 1+eps) A_i)`` over the batch's ``n``
    responses, with ``A_i`` the reward normalised inside its group and
    ``r_it = pi_theta(y_it) / pi_behaviour(y_it)``. Summed over tokens, not averaged, so every
    token weighs alike whatever the length of its response."""
    grad = np.zeros_like(theta)
    ratios: list[FloatArray] = []
    lags: list[int] = []
    clipped = 0
    n = len(batch)
    for members in batch.groups().values():
        rewards = np.array([r.reward for r in members])
        adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        problem = problem_of(members[0])
        tokens = np.stack([r.response_ids for r in members]).astype(np.int64)
        length = tokens.shape[1]
        lp = log_softmax(theta[problem, :length])
        new = lp[np.arange(length)[None, :], tokens]
        old = np.stack([np.asarray(r.logprobs, dtype=np.float64) for r in members])
        ratio = np.exp(new - old)
        a = adv[:, None]
        # The min() keeps the gradient only where the ratio has not left the clip range in
        # the advantage's direction.
        live = ~(((ratio > 1 + eps) & (a > 0)) | ((ratio < 1 - eps) & (a < 0)))
        onehot = np.zeros((len(members), length, VOCAB))
        np.put_along_axis(onehot, tokens[:, :, None], 1.0, axis=-1)
        dlogp = onehot - np.exp(lp)[None]  # d log pi(y_t) / d logits, per position
        grad[problem, :length] += ((a * ratio * live)[:, :, None] * dlogp).sum(axis=0)
        ratios.append(ratio.ravel())
        clipped += int((~live).sum())
        lags.extend(r.lag for r in members)
    grad /= n
    all_ratios = np.concatenate(ratios)
    stats = StepStats(
        reward_mean=float(batch.rewards.mean()),
        lag_mean=float(np.mean(lags)),
        ratio_mean=float(all_ratios.mean()),
        clipped=clipped / all_ratios.size,
    )
    return theta + lr * grad, stats


def run_config(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """The two runs differ in the rules of work leases: the staleness budget and the order."""
    config: dict[str, Any] = {
        "group_size": GROUP,
        "max_staleness": args.max_staleness,
        "max_reuse": 1,
        "drop_zero_variance_groups": True,
        "clip_epsilon": args.clip,
        "lease_timeout_s": 30.0,
    }
    if mode in ("work", "pools"):
        # The default order (auto) takes the oldest groups first while step_groups is set, as
        # the budget's promise needs (docs/design.md), and freshest first without it, free
        # running's best setting.
        config |= {"step_groups": args.groups_per_step, "work_timeout_s": 30.0}
    if mode == "pools":
        weights = {"easy": 0.0, "normal": 1.0, "hard": 2.0}
        config["difficulty"] = {
            "easy_above": args.easy_above,
            "hard_below": args.hard_below,
            "weights": weights,
        }
    return config


def train(
    args: argparse.Namespace, url: str, mode: str, prefix: str, roles: Roles
) -> dict[str, Any]:
    task = make_task(args.seed)
    run_id = f"{prefix}-{mode}"
    config = run_config(args, mode)
    size = args.groups_per_step * GROUP
    theta = np.zeros((PROBLEMS, MAX_LENGTH, VOCAB))
    version = 0
    acked_sizes = 0
    workdir = tempfile.TemporaryDirectory(prefix="grpo-")
    weights = Path(workdir.name) / "policy.npz"
    publish(weights, theta, version)

    with (
        workdir,
        BrokerClient(url, token=roles.setup) as ops,
        BrokerClient(url, trainer_id="trainer-0", token=roles.trainer) as broker,
    ):
        ops.create_run(run_id, config)
        print(f"\n{MODES[mode]}: run {run_id}: {json.dumps(config)}")
        if mode != "free":
            # The same prompt list, every problem once a pass, for more passes than needed.
            epochs = math.ceil(3 * args.steps * args.groups_per_step / PROBLEMS) + 1
            ops.register_prompts(
                run_id,
                [
                    {"prompt_id": prompt_id(p), "prompt_ids": [p], "data": {"problem": p}}
                    for p in task.order
                ],
                epochs=epochs,
            )
        ctx = mp.get_context("spawn")
        ready = ctx.Barrier(args.generators + 1)
        token_s = args.token_ms / 1000
        procs = [
            ctx.Process(
                target=free_generator if mode == "free" else work_generator,
                args=(
                    url,
                    run_id,
                    str(weights),
                    args.seed,
                    i,
                    token_s,
                    ready,
                    args.generators if mode == "free" else args.max_prompts,
                    roles.generators,
                ),
                daemon=True,
            )
            for i in range(args.generators)
        ]
        for p in procs:
            p.start()

        rewards = expected_rewards(theta, task)
        initial = float(rewards.mean())
        history = [(0, initial)]
        ready.wait(120)  # every generator has started: the clocks start together
        t0 = time.monotonic()
        try:
            while version < args.steps and time.monotonic() - t0 < args.seconds:
                with broker.lease(run_id, size=size, wait_s=2.0) as batch:
                    if not batch:  # nothing came within wait_s
                        continue
                    started = time.monotonic()
                    theta, stats = grpo_step(theta, batch, args.lr, args.clip)
                    # The new policy's logprobs on the same tokens: the broker measures the KL
                    # from the behaviour policy with them.
                    batch.ack_with(
                        [token_logprobs(theta, problem_of(r), r.response_ids) for r in batch],
                        step=version,
                    )
                    time.sleep(max(0.0, args.step_ms / 1000 - (time.monotonic() - started)))
                acked_sizes += len(batch)
                version += 1
                broker.set_policy(run_id, version)
                publish(weights, theta, version)
                if version % args.log_every == 0:
                    rewards = expected_rewards(theta, task)
                    history.append((version, float(rewards.mean())))
                if version % (4 * args.log_every) == 0 or version == args.steps:
                    ack = batch.ack_result
                    kl = ack.stats.kl_mean if ack is not None else None
                    print(
                        f"  v{version:>4}  {time.monotonic() - t0:5.1f}s  "
                        f"E[reward] {expected_rewards(theta, task).mean():5.2f}  "
                        f"batch reward {stats.reward_mean:5.2f}  lag {stats.lag_mean:.2f}  "
                        f"ratio {stats.ratio_mean:.3f}  clipped {stats.clipped:.1%}  "
                        f"KL {kl if kl is None else round(kl, 4)}"
                    )
        finally:
            elapsed = time.monotonic() - t0
            ops.close_run(run_id)
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.terminate()
        rewards = expected_rewards(theta, task)
        summary: dict[str, Any] = {
            "mode": mode,
            "run_id": run_id,
            "config": config,
            "initial_reward": initial,
            "final_reward": float(rewards.mean()),
            # Share of the target tokens reproduced, on the longer and the shorter half.
            "final_long": float(rewards[task.long].sum() / task.lengths[task.long].sum()),
            "final_short": float(rewards[~task.long].sum() / task.lengths[~task.long].sum()),
            "versions": version,
            "seconds": elapsed,
            "acked_rollouts": acked_sizes,
            "history": history,
            "accounting": None,
            "audit": audit_summary(ops, run_id),
        }
        try:
            acc = ops.wait_for_accounting(run_id, timeout_s=60.0)
        except RunNotFound:
            raise
        except NotFound as err:
            print(f"the broker at {url} serves no accounting ({err.detail})")
            return summary
        summary["accounting"] = acc.raw
    return summary


def audit_summary(ops: BrokerClient, run_id: str) -> dict[str, int]:
    """How many times each token did each action to the run, from the audit log; printed."""
    done = Counter(f"{e.actor} {e.action}" for e in ops.audit_entries(run_id))
    print(f"  audit log of {run_id}: " + ", ".join(f"{k} ×{n}" for k, n in sorted(done.items())))
    return dict(done)


# -- the comparison --------------------------------------------------------------------------


def figures(s: dict[str, Any]) -> dict[str, Any]:
    """The figures of one run that the comparison prints, from its accounting. Rejected
    rollouts (at ingest, never buffered) are counted with the retired ones of the same reason."""
    acc = s["accounting"] or {}
    gone = dict(acc.get("retired", {}))
    for why, n in acc.get("rejected", {}).items():
        gone[why] = gone.get(why, 0) + n
    gone.pop("max_reuse", None)  # trained on: every rollout that reached a gradient once
    received = acc.get("rollouts_received", 0)
    samples = acc.get("samples_consumed", 0)
    wait = acc.get("wait") or {}
    prompts = (acc.get("prompts") or {}) if s["mode"] != "free" else {}
    bias = acc.get("bias") or {}
    length, reward = bias.get("length") or {}, bias.get("reward") or {}
    return {
        "steps": s["versions"],
        "seconds": s["seconds"],
        "received": received,
        "samples": samples,
        "stale": gone.pop("stale", 0),
        "closed": gone.pop("run_closed", 0),
        "other": gone,
        "wasted_tokens": acc.get("wasted_tokens", 0),
        "len_generated": length.get("generated_mean"),
        "len_trained": length.get("trained_mean"),
        "lag": (acc.get("lag") or {}).get("mean"),
        "generator_wait": wait.get("generator_s"),
        "trainer_wait": wait.get("trainer_s"),
        "prompts_done": prompts.get("done"),
        "prompts_skipped": prompts.get("skipped"),
        "ks": length.get("ks"),
        "reward_generated": reward.get("generated_mean"),
        "reward_trained": reward.get("trained_mean"),
    }


def compare(summaries: dict[str, dict[str, Any]], log_every: int) -> None:
    """Print the runs' figures side by side, one column per mode."""
    modes = list(summaries)
    f = {m: figures(summaries[m]) for m in modes}

    def row(label: str, key: str, fmt: str = ",", of: dict[str, dict[str, Any]] = f) -> None:
        cells = [of[m].get(key) for m in modes]
        text = ["-" if c is None else format(c, fmt) for c in cells]
        print(f"{label:<38}" + "".join(f"{t:>18}" for t in text))

    print()
    print(" " * 38 + "".join(f"{MODES[m]:>18}" for m in modes))
    row("trainer steps", "steps")
    row("wall time of the steps (s)", "seconds", ".1f")
    row("rollouts generated", "received")
    row("samples that reached a gradient", "samples")
    row("retired stale", "stale")
    row("left unused when the run closed", "closed")
    for why in sorted({why for m in modes for why in f[m]["other"]}):
        for m in modes:
            f[m][why] = f[m]["other"].get(why, 0)
        row(f"retired {why}", why)
    row("wasted tokens (never trained on)", "wasted_tokens")
    row("mean length generated", "len_generated", ".1f")
    row("mean length trained on", "len_trained", ".1f")
    row("length KS distance, generated/trained", "ks", ".3f")
    row("mean reward generated", "reward_generated", ".3f")
    row("mean reward trained on", "reward_trained", ".3f")
    row("mean lag trained on", "lag", ".2f")
    row("generator wait (s, all generators)", "generator_wait", ".1f")
    row("trainer wait (s)", "trainer_wait", ".1f")
    row("prompt passes done", "prompts_done")
    row("of them skipped (pool of weight 0)", "prompts_skipped")
    row("E[reward] at the end", "final_reward", ".2f", summaries)
    row("target tokens hit, long half", "final_long", ".1%", summaries)
    row("target tokens hit, short half", "final_short", ".1%", summaries)
    first = summaries[modes[0]]["initial_reward"]
    print(f"\nE[reward] every {log_every} steps, from {first:.2f}:")
    for m in modes:
        series = " ".join(f"{r:.2f}" for _, r in summaries[m]["history"][1:])
        print(f"  {MODES[m]:<17} {series}")


# -- a broker of its own ---------------------------------------------------------------------


@contextlib.contextmanager
def own_broker(admin_token: str) -> Iterator[str]:
    """``rollout-broker serve`` on a free port with auth on and ``admin_token`` as its bootstrap
    admin token: against BROKER_REDIS_URL/BROKER_DATABASE_URL when set (with the workers in
    process, migrating the database first), else embedded in a temporary data folder."""
    env = dict(os.environ, BROKER_AUTH="on", BROKER_ADMIN_TOKEN=admin_token)
    cmd = [sys.executable, "-m", "app.cli", "serve", "--port", "0"]
    data = None
    if os.environ.get("BROKER_REDIS_URL") or os.environ.get("BROKER_DATABASE_URL"):
        cmd += ["--with-workers", "--migrate"]
    else:
        data = tempfile.TemporaryDirectory(prefix="rollout-broker-")
        cmd += ["--data-dir", data.name]
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    found: list[str] = []
    ready = threading.Event()
    lines: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            m = re.search(r"Uvicorn running on (http://\S+)", line)
            if m and not found:
                found.append(m.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        ready.wait(180)
        if not found:
            raise RuntimeError("the broker did not start:\n" + "".join(lines))
        print(f"started {' '.join(cmd[2:])} at {found[0]}, auth on")
        yield found[0]
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        if data is not None:
            data.cleanup()


@contextlib.contextmanager
def role_tokens(
    url: str, admin_token: str, prefix: str, scopes: Mapping[str, Scope]
) -> Iterator[dict[str, str]]:
    """One token per role (``scopes``: each role's scope), limited to the runs named
    ``<prefix>-*``, created with the admin token and revoked on the way out."""
    runs = [f"{prefix}-*"]
    with BrokerClient(url, token=admin_token) as admin:
        made = {
            role: admin.create_token(f"{prefix}-{role}", [scope], runs)
            for role, scope in scopes.items()
        }
        print("tokens: " + ", ".join(f"{t.name} ({t.scopes[0]})" for t in made.values()))
        try:
            yield {role: t.token for role, t in made.items()}
        finally:
            for t in made.values():
                admin.revoke_token(t.token_id)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=os.environ.get("BROKER_URL"), help="broker to use")
    ap.add_argument("--mode", choices=["both", "all", *MODES], default="both")
    ap.add_argument("--run-prefix", help="run ids are <prefix>-<mode>")
    ap.add_argument("--generators", type=int, default=4)
    ap.add_argument("--steps", type=int, default=60, help="trainer steps (policy versions)")
    ap.add_argument("--groups-per-step", type=int, default=4, help="groups per batch")
    ap.add_argument("--token-ms", type=float, default=2.0, help="generation time per token")
    ap.add_argument("--step-ms", type=float, default=150.0, help="time of one trainer step")
    ap.add_argument("--max-prompts", type=int, default=1, help="prompts per work lease")
    ap.add_argument("--seconds", type=float, default=120.0, help="time limit of each run")
    ap.add_argument("--lr", type=float, default=4.0)
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--max-staleness", type=int, default=2)
    ap.add_argument("--easy-above", type=float, default=0.6, help="pools: learned above this")
    ap.add_argument("--hard-below", type=float, default=0.2, help="pools: failed below this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--json-out", type=Path, help="write a JSON summary here")
    args = ap.parse_args(argv)

    task = make_task(args.seed)
    print(
        f"{PROBLEMS} problems, target lengths {sorted(task.lengths.tolist())} "
        f"(mean {task.lengths.mean():.1f}); {GROUP} responses per prompt, "
        f"{args.groups_per_step} groups per step, {args.steps} steps, "
        f"{args.generators} generators at {args.token_ms:g} ms per token"
    )
    prefix = args.run_prefix or f"grpo-{uuid.uuid4().hex[:8]}"
    summaries: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        if args.url:
            url, roles = args.url, Roles()  # every role: BROKER_TOKEN, if set
        else:
            admin_token = secrets.token_urlsafe(32)
            url = stack.enter_context(own_broker(admin_token))
            roles = Roles(**stack.enter_context(role_tokens(url, admin_token, prefix, ROLE_SCOPES)))
        modes = {"both": BOTH, "all": tuple(MODES)}.get(args.mode, (args.mode,))
        for mode in modes:
            summaries[mode] = train(args, url, mode, prefix, roles)
    compare(summaries, args.log_every)
    if args.json_out is not None:
        out = {"settings": vars(args), "runs": summaries}
        args.json_out.write_text(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
