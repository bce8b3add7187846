"""Asynchronous GRPO on a toy task, on CPU, through Rollout Broker.

The task: for each of ``P`` prompts there is a hidden target sequence of ``L`` tokens from a
vocabulary of ``V``; a response earns the fraction of its tokens that match. The policy is a
table of logits ``theta[prompt, position, token]`` with a softmax per position (numpy only).

* Several generator *processes* sample groups of ``K`` responses per prompt from the policy
  snapshot of the version they last loaded, with the behaviour logprobs, and post them through
  the client's writer (batched, retried, waiting out ``429`` backpressure). They learn of new
  versions from ``GET /v1/runs/{id}`` and load the weights from an ``.npz`` file that the
  trainer replaces atomically.
* One trainer leases batches of whole groups, computes the clipped GRPO objective with
  group-normalised advantages and per-token importance ratios against the behaviour logprobs,
  takes a gradient step, acks with the new policy's logprobs (the broker measures the KL from
  them) and publishes the new version: ``POST /policy`` first, then the weights file, so a
  generator never tags a rollout with a version the broker has not announced yet.
* At the end it closes the run, waits for the accounting to catch up and prints it: how many
  rollouts were generated, how many samples reached a gradient, and where every rollout went.

Run it against a broker with ``--url``, or with none to have it start ``rollout-broker serve``
itself (against ``BROKER_REDIS_URL`` / ``BROKER_DATABASE_URL`` when set, else embedded Redis and
Postgres in a temporary data folder)::

    python examples/async_grpo.py --seconds 30
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from rollout_broker_client import (
    Accounting,
    Batch,
    BrokerClient,
    LeasedRollout,
    NotFound,
    Rollout,
    Run,
    RunNotFound,
)

FloatArray = npt.NDArray[np.float64]

# The task and the policy.
PROMPTS, LENGTH, VOCAB = 8, 5, 10
GROUP = 8  # responses per prompt (K)


def targets(seed: int) -> npt.NDArray[np.int64]:
    return np.random.default_rng(seed).integers(0, VOCAB, size=(PROMPTS, LENGTH))


def log_softmax(theta: FloatArray) -> FloatArray:
    z = theta - theta.max(axis=-1, keepdims=True)
    out: FloatArray = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return out


def expected_reward(theta: FloatArray, target: npt.NDArray[np.int64]) -> float:
    """The policy's exact mean reward: mean over prompts and positions of P(target token)."""
    probs = np.exp(log_softmax(theta))
    picked = np.take_along_axis(probs, target[:, :, None], axis=-1)
    return float(picked.mean())


def prompt_of(r: LeasedRollout) -> int:
    assert r.prompt_ids is not None  # the generators always send the prompt
    return int(r.prompt_ids[0])


def token_logprobs(theta: FloatArray, prompt: int, tokens: npt.NDArray[Any]) -> FloatArray:
    lp = log_softmax(theta[prompt])
    out: FloatArray = lp[np.arange(LENGTH), tokens]
    return out


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


def generator(url: str, run_id: str, weights: str, seed: int, name: str) -> None:
    """Sample groups from the last loaded snapshot and post them until the run closes."""
    rng = np.random.default_rng(seed)
    target = targets(0)
    path = Path(weights)
    theta, version = load(path)
    with BrokerClient(url) as broker, broker.writer(run_id, batch_size=2 * GROUP) as out:
        n = 0
        while True:
            run = broker.get_run(run_id)
            if run.status != "open":
                break
            if run.policy_version > version:
                theta, version = load(path)
            prompt = int(rng.integers(PROMPTS))
            probs = np.exp(log_softmax(theta[prompt]))
            group = f"{name}-{n}"
            rollouts = []
            for k in range(GROUP):
                tokens = np.array([rng.choice(VOCAB, p=p) for p in probs])
                rollouts.append(
                    Rollout(
                        rollout_id=f"{group}-{k}",
                        group_id=group,
                        policy_version=version,
                        prompt_ids=np.array([prompt]),
                        response_ids=tokens,
                        logprobs=token_logprobs(theta, prompt, tokens),
                        reward=float((tokens == target[prompt]).mean()),
                        finish_reason="stop",
                    )
                )
            out.add(*rollouts)
            n += 1


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
    ``mean_i mean_t min(r_it A_i, clip(r_it, 1-eps, 1+eps) A_i)``, with ``A_i`` the reward
    normalised inside its group and ``r_it = pi_theta(y_it) / pi_behaviour(y_it)``."""
    grad = np.zeros_like(theta)
    ratios, clipped, lags = [], 0, []
    n = len(batch)
    for members in batch.groups().values():
        rewards = np.array([r.reward for r in members])
        adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        for r, a in zip(members, adv, strict=True):
            prompt = prompt_of(r)
            tokens = r.response_ids
            lp = log_softmax(theta[prompt])
            new = lp[np.arange(LENGTH), tokens]
            assert r.logprobs is not None
            ratio = np.exp(new - r.logprobs.astype(np.float64))
            # The min() keeps the gradient only where the ratio has not left the clip range in
            # the advantage's direction.
            live = ~(((ratio > 1 + eps) & (a > 0)) | ((ratio < 1 - eps) & (a < 0)))
            onehot = np.zeros((LENGTH, VOCAB))
            onehot[np.arange(LENGTH), tokens] = 1.0
            dlogp = onehot - np.exp(lp)  # d log pi(y_t) / d logits, per position
            grad[prompt] += (a * ratio * live)[:, None] * dlogp / (n * LENGTH)
            ratios.append(ratio)
            clipped += int((~live).sum())
            lags.append(r.lag)
    all_ratios = np.concatenate(ratios)
    stats = StepStats(
        reward_mean=float(batch.rewards.mean()),
        lag_mean=float(np.mean(lags)),
        ratio_mean=float(all_ratios.mean()),
        clipped=clipped / all_ratios.size,
    )
    return theta + lr * grad, stats


def train(args: argparse.Namespace, url: str) -> dict[str, Any]:
    run_id = args.run_id or f"grpo-{uuid.uuid4().hex[:8]}"
    target = targets(0)
    config = {
        "group_size": GROUP,
        "max_staleness": args.max_staleness,
        "max_reuse": args.max_reuse,
        "kl_max": args.kl_max,
        "kl_flush": args.kl_flush,
        "clip_epsilon": args.clip,
        "drop_zero_variance_groups": True,
        "capacity_rollouts": args.capacity,
        "lease_timeout_s": 30.0,
    }
    theta = np.zeros((PROMPTS, LENGTH, VOCAB))
    version = 0
    acked_sizes = 0
    workdir = tempfile.TemporaryDirectory(prefix="grpo-")
    weights = Path(workdir.name) / "policy.npz"
    publish(weights, theta, version)

    with workdir, BrokerClient(url, trainer_id="trainer-0") as broker:
        broker.create_run(run_id, config)
        print(f"run {run_id} on {url}: {json.dumps(config)}")
        ctx = mp.get_context("spawn")
        procs = [
            ctx.Process(
                target=generator,
                args=(url, run_id, str(weights), args.seed + 1 + i, f"g{i}"),
                daemon=True,
            )
            for i in range(args.generators)
        ]
        for p in procs:
            p.start()

        initial = expected_reward(theta, target)
        print(f"expected reward of the initial policy: {initial:.3f}")
        history = [(0, initial)]
        t0 = time.monotonic()
        try:
            while version < args.steps and time.monotonic() - t0 < args.seconds:
                with broker.lease(run_id, size=args.batch, wait_s=2.0) as batch:
                    if batch is None:
                        continue
                    theta, stats = grpo_step(theta, batch, args.lr, args.clip)
                    # The new policy's logprobs on the same tokens: the broker measures the KL
                    # from the behaviour policy with them, and retires what drifted too far.
                    batch.ack_with(
                        [token_logprobs(theta, prompt_of(r), r.response_ids) for r in batch],
                        step=version,
                    )
                acked_sizes += len(batch)
                version += 1
                broker.set_policy(run_id, version)
                publish(weights, theta, version)
                if version % args.log_every == 0 or version == 1:
                    ack = batch.ack_result
                    kl = ack.stats.kl_mean if ack is not None else None
                    reward = expected_reward(theta, target)
                    history.append((version, reward))
                    print(
                        f"v{version:>4}  {time.monotonic() - t0:5.1f}s  "
                        f"E[reward] {reward:.3f}  batch reward {stats.reward_mean:.3f}  "
                        f"lag {stats.lag_mean:.2f}  ratio {stats.ratio_mean:.3f}  "
                        f"clipped {stats.clipped:.1%}  KL {kl if kl is None else round(kl, 4)}"
                    )
        finally:
            broker.close_run(run_id)
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.terminate()
        elapsed = time.monotonic() - t0
        final = expected_reward(theta, target)
        print(
            f"\nexpected reward {initial:.3f} -> {final:.3f} after {version} policy versions "
            f"in {elapsed:.1f} s"
        )
        summary: dict[str, Any] = {
            "run_id": run_id,
            "url": url,
            "initial_reward": initial,
            "final_reward": final,
            "versions": version,
            "seconds": elapsed,
            "acked_rollouts": acked_sizes,
            "history": history,
            "accounting": None,
        }
        try:
            acc = broker.wait_for_accounting(run_id, timeout_s=60.0)
        except RunNotFound:
            raise
        except NotFound as err:
            print(f"\nthe broker at {url} serves no accounting ({err.detail})")
            return summary
        summary["accounting"] = acc.raw
        explain(acc, broker.get_run(run_id), acked_sizes)
    return summary


def explain(acc: Accounting, run: Run, acked_sizes: int) -> None:
    from rich.console import Console

    from app.cli import accounting_table

    console = Console(highlight=False)
    console.print()
    console.print(accounting_table(acc, run))
    k = run.config["group_size"]
    retired = acc.retired
    console.print(
        f"Rollouts vs samples: {acc.rollouts_received:,} rollouts were generated "
        f"({acc.groups_received:,} prompts × {k} responses each), "
        f"{acc.samples_consumed:,} samples reached a gradient "
        f"(= {acked_sizes:,}, the sizes of the acked batches), reuse factor "
        f"{acc.reuse_factor:.2f} with max_reuse {run.config['max_reuse']}."
    )
    console.print(
        "Retired: "
        + ", ".join(f"{why} {n:,}" for why, n in sorted(retired.items()))
        + f"; {acc.wasted_tokens:,} tokens of rollouts that never reached a gradient."
    )
    if acc.rejected:
        console.print(
            "Rejected at ingest (never buffered): "
            + ", ".join(f"{why} {n:,}" for why, n in sorted(acc.rejected.items()))
        )


# -- a broker of its own ---------------------------------------------------------------------


@contextlib.contextmanager
def own_broker() -> Iterator[str]:
    """``rollout-broker serve`` on a free port: against BROKER_REDIS_URL/BROKER_DATABASE_URL when
    set (with the workers in process, migrating the database first), else embedded in a
    temporary data folder."""
    cmd = [sys.executable, "-m", "app.cli", "serve", "--port", "0"]
    data = None
    if os.environ.get("BROKER_REDIS_URL") or os.environ.get("BROKER_DATABASE_URL"):
        cmd += ["--with-workers", "--migrate"]
    else:
        data = tempfile.TemporaryDirectory(prefix="rollout-broker-")
        cmd += ["--data-dir", data.name]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL
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
        print(f"started {' '.join(cmd[2:])} at {found[0]}")
        yield found[0]
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        if data is not None:
            data.cleanup()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=os.environ.get("BROKER_URL"), help="broker to use")
    ap.add_argument("--run-id")
    ap.add_argument("--generators", type=int, default=3)
    ap.add_argument("--steps", type=int, default=400, help="policy versions to train")
    ap.add_argument("--seconds", type=float, default=45.0, help="time budget of the training")
    ap.add_argument("--batch", type=int, default=4 * GROUP, help="rollouts per batch")
    ap.add_argument("--lr", type=float, default=8.0)
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--max-staleness", type=int, default=4)
    ap.add_argument("--max-reuse", type=int, default=2)
    ap.add_argument("--kl-max", type=float, default=0.02)
    ap.add_argument("--kl-flush", type=float, default=0.05)
    ap.add_argument("--capacity", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--json-out", type=Path, help="write a JSON summary here")
    args = ap.parse_args(argv)

    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(own_broker())
        summary = train(args, url)
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(summary, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
