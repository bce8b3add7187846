"""A small transformer learns, from scratch and through Rollout Broker, to use a calculator
tool: every feature of the broker in one run of about three minutes on two CPU cores (PyTorch).

The task. A prompt is a sum of two numbers written with two digits each, ``^ 2 7 + 4 8 =``
(their sum below 100). The policy has no arithmetic, but it may call a tool: ``CALL`` makes the
environment evaluate the prompt and append the result to the response, which the policy then
copies into its answer. A response is multi-turn::

    CALL | RES 7 5 | ANS 7 5 EOS
    the policy | the tool's output (loss_mask 0) | the policy

The tool's tokens stay in the response with ``loss_mask`` 0: the policy never trains on them
and no statistic of the broker counts them. A verifier scores the answer turn (what the policy
wrote after the tool's output): 0.4 for each right digit of ``ANS d d``, 0.1 more when it ends
there with EOS, -0.1 for a turn with no answer; and 0.1 for a well-formed call (``CALL``
first). A right answer after a call scores 1.0. The policy, a 2-layer transformer (d_model
64), starts from random weights: its first responses are noise (reward about -0.05); it learns
to call, then to answer, then to copy the tool's digits. Its reward passes 0.6 after about 60
trainer steps, a minute or so, and 0.9 by the hundredth.

The processes (each with a token of its own role when the example starts its own broker):

* **2 generators** take prompts on work leases (``client.work``) under the staleness budget
  (``step_groups``, ``max_staleness``), sample 16 responses per prompt a token at a time (a
  token takes ``--token-ms``, a tool call ``--tool-ms``, as on an inference server) and post
  them without a reward. A thread of each follows the policy by long poll
  (``client.follow_policy``); the generator loads the weights file each version names. When a
  new version comes while responses are half done, the generator gives their prompts back with
  the partial responses (``work.give_back(partials=...)``); the lease that next hands such a
  prompt out, to either generator, carries them, and they are continued under the new weights:
  each token keeps the version that sampled it (``versions``).
* **2 verifiers** score the rollouts on reward leases (``client.reward_work``). One lease in
  twenty (and verifier-0's second) is slow: longer than ``reward_timeout_s``, so the lease
  expires and its rollouts are leased and scored again.
* **The trainer** leases batches of whole groups, lays them out with ``batch.padded()`` and
  ``.to_torch()`` and sends its logprobs to ``batch.measure()`` before the update: the broker
  answers truncated importance weights (TIS, the run's ``correction``) and the adaptive KL
  coefficient β (``kl_coef``, steered toward ``kl_target``). The loss is PPO's clipped GRPO
  objective weighted by them, with β times the KL from the behaviour policy, over the tokens of
  ``loss_mask``. It publishes each version's weights (``set_policy(..., weights=path)``) and
  saves a checkpoint every ``--ckpt-every`` versions. At version ``--kill-at`` the example
  SIGKILLs it, and a new trainer loads the last checkpoint and moves the run back to its
  version (``set_policy(..., rewind=True)``): the broker undoes the batches acknowledged above
  it and retires what was sampled above it.
* **A preference consumer** (``create_consumer(kind="preferences")``, a thread of the main
  process) collects pairs of responses to one prompt, as a DPO trainer would.

It ends with the run's accounting: samples consumed against rollouts generated, the partial
rollouts, the rewards and the leases that timed out, what was trained against what was
generated (length, reward), the KL measured per generator, the tool tokens masked and the
samples the rewind gave back.

With no ``--url`` it starts ``rollout-broker serve`` itself (against ``BROKER_REDIS_URL`` /
``BROKER_DATABASE_URL`` when set, else embedded Redis and Postgres in a temporary folder)::

    pip install -e '.[examples]'          # torch
    python examples/tool_calc.py          # about 3 minutes on 2 cores
    python examples/tool_calc.py --quick  # 30 steps in under a minute: it learns to call

That broker has auth on, and each role a token limited to the example's runs: ``setup``
(``operate``: the run, its prompts, the consumer, the accounting), ``trainer`` and
``preferences`` (``train``), ``generators`` (``generate``), ``verifiers`` (``reward``). Against
a broker of yours every role uses ``BROKER_TOKEN`` (unset with auth off), which then needs all
of these scopes (or ``admin``)::

    BROKER_TOKEN=rb_... python examples/tool_calc.py --url http://broker:8000
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import multiprocessing as mp
import os
import random
import secrets
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from async_grpo import (  # the same `rollout-broker serve` on a free port, tokens per role
    own_broker,
    role_tokens,
)
from rollout_broker_client import (
    BrokerClient,
    BrokerError,
    Conflict,
    LeasedBatch,
    LeaseExpired,
    Partial,
    PolicyVersion,
    Prompt,
    RewardRollout,
    Rollout,
    RunClosed,
    Scope,
    TrainArrays,
    ValidationFailed,
    Work,
    WorkPrompt,
)
from torch import nn

# -- the task: tokens, prompts, the tool and the verifier ------------------------------------

NAMES = ["_", "^", "+", "=", "CALL", "RES", "ANS", "EOS", *"0123456789"]
PAD, BOS, PLUS, EQ, CALL, RES, ANS, EOS = range(8)
DIGIT = 8  # the token of digit d is DIGIT + d
VOCAB = len(NAMES)
MAX_POLICY_TOKENS = 6  # a response ends at EOS or after this many tokens of the policy
MAX_LENGTH = 32  # the model's positions: a prompt (7) and a response (6 + the tool's 3)


def digits(n: int) -> list[int]:
    return [DIGIT + n // 10, DIGIT + n % 10]


def prompt_tokens(a: int, b: int) -> list[int]:
    return [BOS, *digits(a), PLUS, *digits(b), EQ]


def tool_output(answer: int) -> list[int]:
    """What the calculator appends after a CALL: the value of the prompt's sum."""
    return [RES, *digits(answer)]


def reward(response: Sequence[int], loss_mask: Sequence[int], answer: int) -> float:
    """The verifier's score of one response (see the module's docstring). The answer turn is
    what follows the tool's last token (loss_mask 0), or the whole response without a call:
    the tool's digits are never the policy's answer."""
    start = max((i + 1 for i, trained in enumerate(loss_mask) if not trained), default=0)
    turn = list(response[start:])
    score = 0.1 if response and response[0] == CALL else 0.0
    if turn[:1] == [ANS] and len(turn) >= 3 and all(t >= DIGIT for t in turn[1:3]):
        score += 0.4 * sum(x == y for x, y in zip(turn[1:3], digits(answer), strict=True))
        if turn[3:] == [EOS]:
            score += 0.1
    else:
        score -= 0.1
    return score


def make_prompts(seed: int, n: int) -> list[Prompt]:
    """``n`` sums whose value is uniform over 0..99: no answer is a good guess."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        total = rng.randrange(100)
        a = rng.randint(0, total)
        data = {"a": a, "b": total - a, "answer": total}
        prompts.append(Prompt(f"q{i:04d}", prompt_ids=prompt_tokens(a, total - a), data=data))
    return prompts


# -- the policy ------------------------------------------------------------------------------


class CalcPolicy(nn.Module):
    """A 2-layer causal transformer over the task's 18 tokens, with learned positions."""

    def __init__(self, d_model: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d_model)
        self.position = nn.Embedding(MAX_LENGTH, d_model)
        block = nn.TransformerEncoderLayer(
            d_model, heads, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(rows, width, vocab)``; those at ``t`` predict the token at ``t + 1``. Rows
        padded on the right need no padding mask: the causal mask keeps every real token from
        seeing the padding after it."""
        width = ids.shape[1]
        if positions is None:
            positions = torch.arange(width).expand_as(ids)
        causal = nn.Transformer.generate_square_subsequent_mask(width)
        h = self.blocks(self.embed(ids) + self.position(positions), mask=causal, is_causal=True)
        logits: torch.Tensor = self.head(self.norm(h))
        return logits


def save_weights(policy: nn.Module, path: Path) -> None:
    """Write atomically: a generator loads the old file or the new one, never a part."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(policy.state_dict(), tmp)
    os.replace(tmp, path)


def load_policy(path: str | Path) -> CalcPolicy:
    policy = CalcPolicy()
    policy.load_state_dict(torch.load(path, weights_only=True))
    return policy


# -- episodes: multi-turn responses, sampled a token at a time -------------------------------


@dataclass
class Episode:
    """One response being sampled: its tokens, the behaviour logprob of each, its loss mask
    (0 on the tool's output) and the version that sampled each token, run-length encoded as
    the broker takes them (``[(offset, version), ...]``)."""

    rollout_id: str
    prompt: list[int]
    answer: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[tuple[int, int]] = field(default_factory=list)

    @classmethod
    def resumed(cls, p: Partial, prompt: list[int], answer: int) -> Episode:
        """A partial response handed out with its prompt, to continue where it stopped."""
        assert p.logprobs is not None  # the generators always send them
        mask = [1] * p.response_ids.size if p.loss_mask is None else p.loss_mask.tolist()
        versions = list(p.versions) or [(0, p.policy_version)]
        tokens, logprobs = p.response_ids.tolist(), p.logprobs.tolist()
        return cls(p.rollout_id, prompt, answer, tokens, logprobs, mask, versions)

    @property
    def done(self) -> bool:
        return bool(self.tokens) and (self.tokens[-1] == EOS or sum(self.mask) >= MAX_POLICY_TOKENS)

    def add(self, tokens: list[int], logprobs: list[float], trained: int, version: int) -> None:
        if not self.versions or self.versions[-1][1] != version:
            self.versions.append((len(self.tokens), version))
        self.tokens += tokens
        self.logprobs += logprobs
        self.mask += [trained] * len(tokens)

    def sampled(self, token: int, logprob: float, version: int) -> bool:
        """Append the policy's token. A first CALL runs the tool, whose output follows with
        loss_mask 0 (and logprob 0, which the broker ignores there); True if it did."""
        self.add([token], [logprob], 1, version)
        if token == CALL and RES not in self.tokens:
            out = tool_output(self.answer)
            self.add(out, [0.0] * len(out), 0, version)
            return True
        return False

    def fields(self) -> dict[str, Any]:
        """The rollout (or partial) as the broker takes it, without a reward: a verifier scores
        it. ``policy_version`` is the oldest version over its tokens."""
        return {
            "rollout_id": self.rollout_id,
            "policy_version": self.versions[0][1],
            "response_ids": np.array(self.tokens, dtype=np.int32),
            "logprobs": np.array(self.logprobs, dtype=np.float32),
            "loss_mask": np.array(self.mask, dtype=np.uint8),
            "versions": [list(v) for v in self.versions] if len(self.versions) > 1 else None,
        }

    def rollout(self) -> Rollout:
        return Rollout(**self.fields(), finish_reason="stop" if EOS in self.tokens else "length")


@torch.no_grad()
def decode_step(
    policy: CalcPolicy, episodes: Sequence[Episode], rng: torch.Generator | None = None
) -> tuple[list[int], list[float]]:
    """A token for each episode, sampled (greedy without ``rng``), and its logprob under
    ``policy``: the behaviour logprobs the trainer's importance weights are measured against."""
    seqs = [e.prompt + e.tokens for e in episodes]
    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [PAD] * (width - len(s)) for s in seqs])
    last = torch.tensor([len(s) - 1 for s in seqs])
    logp = policy(ids)[torch.arange(len(seqs)), last].log_softmax(-1)
    if rng is None:
        tokens = logp.argmax(-1)
    else:
        tokens = torch.multinomial(logp.exp(), 1, generator=rng)[:, 0]
    return tokens.tolist(), logp.gather(-1, tokens[:, None])[:, 0].tolist()


def greedy_accuracy(policy: CalcPolicy, prompts: Sequence[Prompt]) -> float:
    """The share of ``prompts`` the policy answers right, decoding greedily."""
    episodes = []
    for p in prompts:
        assert p.data is not None
        a, b = p.data["a"], p.data["b"]
        episodes.append(Episode(p.prompt_id, prompt_tokens(a, b), a + b))
    while live := [e for e in episodes if not e.done]:
        for e, t, lp in zip(live, *decode_step(policy, live), strict=True):
            e.sampled(t, lp, 0)
    return float(np.mean([reward(e.tokens, e.mask, e.answer) > 0.99 for e in episodes]))


# -- what every process is given -------------------------------------------------------------


@dataclass(frozen=True)
class Roles:
    """The token of each role; None: the client's default, ``BROKER_TOKEN`` (or none)."""

    setup: str | None = None  # operate: the run, its prompts, the consumer, the accounting
    trainer: str | None = None  # train: lease, measure, ack, policy versions
    generators: str | None = None  # generate: work leases, rollouts, partials
    verifiers: str | None = None  # reward: reward leases, rewards
    preferences: str | None = None  # train: reads the preference consumer


ROLE_SCOPES: dict[str, Scope] = {
    "setup": "operate",
    "trainer": "train",
    "generators": "generate",
    "verifiers": "reward",
    "preferences": "train",
}


@dataclass(frozen=True)
class Settings:
    url: str
    run_id: str
    roles: Roles
    workdir: str
    seed: int
    steps: int  # trainer steps: the run's last version
    group: int  # responses per prompt
    groups_per_step: int
    max_prompts: int  # prompts per work lease
    lr: float
    epochs: int  # PPO epochs on each batch
    clip: float  # PPO's clip range, also the run's clip_epsilon
    entropy: float  # weight of the entropy bonus
    token_s: float
    tool_s: float
    ckpt_every: int
    kill_at: int  # 0: the trainer is not killed
    log_every: int
    reward_timeout_s: float
    slow_s: float  # how long a slow verifier takes: longer than reward_timeout_s

    @property
    def batch_size(self) -> int:
        return self.group * self.groups_per_step

    def path(self, name: str) -> Path:
        return Path(self.workdir) / name


def write_json(path: Path, value: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


# -- generators ------------------------------------------------------------------------------


class Follower(threading.Thread):
    """Follows the run's policy version by long poll, with a client of its own, so that the
    generator learns of a new version between two tokens without asking."""

    def __init__(self, s: Settings) -> None:
        super().__init__(daemon=True)
        self.s = s
        self.latest: PolicyVersion | None = None

    def run(self) -> None:
        with (
            contextlib.suppress(BrokerError),
            BrokerClient(self.s.url, token=self.s.roles.generators) as broker,
        ):
            for v in broker.follow_policy(self.s.run_id, wait_s=5.0):  # the current one first
                self.latest = v


class Snapshot:
    """A generator's copy of the policy: the weights of the version it loaded last."""

    def __init__(self, s: Settings, follower: Follower) -> None:
        self.initial = s.path("weights-v0.pt")  # version 0's: a run's first version has none
        self.follower = follower
        self.policy = load_policy(self.initial)
        self.loaded: tuple[int, str | None] = (0, None)
        self.loads = 0

    @property
    def version(self) -> int:
        return self.loaded[0]

    def stale(self) -> bool:
        """Another version was set since: a newer one, or an older one after a rewind (the
        weights tell two versions of one number apart)."""
        v = self.follower.latest
        return v is not None and (v.policy_version, v.weights) != self.loaded

    def catch_up(self, at_least: int) -> None:
        """Load the run's version, once it is at least ``at_least`` (a work lease's)."""
        while (v := self.follower.latest) is None or v.policy_version < at_least:
            time.sleep(0.005)
        if (v.policy_version, v.weights) != self.loaded:
            self.policy = load_policy(v.weights or self.initial)
            self.loaded = (v.policy_version, v.weights)
            self.loads += 1


def generator_main(s: Settings, index: int, stop: Event) -> None:
    """Take work leases until told to stop: sample each prompt's group and post it, or give
    the prompts back with their partial responses when a new version comes."""
    torch.set_num_threads(1)
    name = f"gen-{index}"
    rng = torch.Generator().manual_seed(s.seed * 1000 + index)
    stats: Counter[str] = Counter()
    follower = Follower(s)
    follower.start()
    snap = Snapshot(s, follower)
    with BrokerClient(s.url, token=s.roles.generators, generator_id=name) as broker:
        while not stop.is_set():
            try:
                with broker.work(
                    s.run_id, max_prompts=s.max_prompts, wait_s=1.0, stop_when_empty=True
                ) as leases:
                    for lease in leases:
                        snap.catch_up(lease.policy_version)
                        generate(s, lease, snap, rng, stats)
                        if stop.is_set():
                            break
            except RunClosed:
                break
            except Conflict as err:  # a lease the broker ended (a rewind): take another
                print(f"  {name}: {err.detail}", flush=True)
    stats["weights_loaded"] = snap.loads
    write_json(s.path(f"stats-{name}.json"), stats)


def generate(
    s: Settings, lease: Work, snap: Snapshot, rng: torch.Generator, stats: Counter[str]
) -> None:
    """The responses to the prompts of one work lease, decoded together a token at a time. A
    prompt handed out again after an interruption carries partials: they are continued under
    this generator's weights, and the group is completed with new responses."""
    groups: dict[str, list[Episode]] = {}
    for prompt in lease.prompts:
        assert prompt.data is not None and prompt.prompt_ids is not None
        ids, answer = prompt.prompt_ids.tolist(), prompt.data["answer"]
        group = [Episode.resumed(p, ids, answer) for p in prompt.partials]
        stats["partials_continued"] += len(group)
        while len(group) < s.group:
            group.append(Episode(f"{prompt.prompt_id}-{uuid.uuid4().hex[:12]}", ids, answer))
        groups[prompt.group_id] = group
    episodes = [e for group in groups.values() for e in group]
    started = False
    while live := [e for e in episodes if not e.done]:
        if started and snap.stale():
            interrupt(lease, groups, stats)
            return
        tokens, logprobs = decode_step(snap.policy, live, rng)
        calls = 0
        for e, token, logprob in zip(live, tokens, logprobs, strict=True):
            calls += e.sampled(token, logprob, snap.version)
        time.sleep(s.token_s + (s.tool_s if calls else 0.0))
        started = True
    for prompt in lease.prompts:
        group = groups[prompt.group_id]
        result = lease.post(prompt, [e.rollout() for e in group])
        stats["rollouts_posted"] += result.accepted
        stats["rollouts_refused"] += len(result.rejected)  # of a lease a rewind ended, say
        # A refused completion leaves its partial with the broker, which brings it back with
        # the prompt's pass (counted returned again).
        refused = {r.rollout_id for r in result.rejected}
        stats["partials_carried_back"] += sum(p.rollout_id in refused for p in prompt.partials)
        stats["rollouts_spanning_versions"] += sum(len(e.versions) > 1 for e in group)


def interrupt(lease: Work, groups: dict[str, list[Episode]], stats: Counter[str]) -> None:
    """A new version came while the lease's responses are half done (each has a token at
    least): give their prompts back with what was sampled, to be continued by whichever
    generator takes them next, under the new weights."""
    partials: dict[WorkPrompt | str, list[dict[str, Any]]] = {
        gid: [e.fields() for e in group] for gid, group in groups.items()
    }
    n = sum(len(group) for group in groups.values())
    try:
        lease.give_back(partials=partials)
        stats["partials_given_back"] += n
        stats["interruptions"] += 1
    except ValidationFailed:
        # After a rewind, partials with tokens of a version the run went back past are refused
        # (partial_future_version): the prompts go back without them. The partials the lease
        # handed out go back with their prompts: the broker keeps each until a rollout completes
        # it (it counts them returned again, and drops those above the rewind).
        lease.give_back()
        stats["partials_refused"] += n
        stats["partials_carried_back"] += sum(len(p.partials) for p in lease.prompts)


# -- verifiers -------------------------------------------------------------------------------


def verifier_main(s: Settings, index: int, stop: Event) -> None:
    """Score rollouts on reward leases until told to stop. One lease in twenty takes longer
    than the lease lasts: it expires, and its rollouts are leased again."""
    name = f"verifier-{index}"
    rng = random.Random(s.seed * 1000 + 100 + index)
    stats: Counter[str] = Counter()
    with BrokerClient(s.url, token=s.roles.verifiers) as broker:
        while not stop.is_set():
            try:
                with broker.reward_work(
                    s.run_id,
                    max_rollouts=4 * s.group,
                    worker_id=name,
                    wait_s=1.0,
                    stop_when_empty=True,
                ) as leases:
                    for lease in leases:
                        stats["leases"] += 1
                        rewards = {r.rollout_id: score(r) for r in lease.rollouts}
                        if rng.random() < 0.05 or (index, stats["leases"]) == (0, 2):
                            stats["slow_leases"] += 1
                            time.sleep(s.slow_s)
                        result = lease.score(rewards)  # a late score of the same value is
                        stats["scored"] += result.scored  # a duplicate: nothing changes
                        stats["duplicates"] += result.duplicates
                        if stop.is_set():
                            break
            except RunClosed:
                break
            except Conflict as err:  # a lease that ended meanwhile: take another
                print(f"  {name}: {err.detail}", flush=True)
    write_json(s.path(f"stats-{name}.json"), stats)


def score(r: RewardRollout) -> float:
    assert r.data is not None  # the registered prompt's: its answer
    tokens = r.response_ids.tolist()
    mask = [1] * len(tokens) if r.loss_mask is None else r.loss_mask.tolist()
    return reward(tokens, mask, r.data["answer"])


# -- the trainer -----------------------------------------------------------------------------


def token_logprobs(
    policy: CalcPolicy, x: TrainArrays[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy's logprob of every token of the padded rows, and its entropy there. The
    logits at t - 1 predict the token at t, so each logprob sits at its token's own position,
    as the behaviour logprobs do (``x.old_logprobs``); the first position has none (0)."""
    logits = policy(x.input_ids, x.position_ids)[:, :-1].log_softmax(-1)
    logp = logits.gather(-1, x.input_ids[:, 1:, None]).squeeze(-1)
    entropy = -(logits.exp() * logits).sum(-1)
    return F.pad(logp, (1, 0)), F.pad(entropy, (1, 0))


def train_step(
    s: Settings, policy: CalcPolicy, optimizer: torch.optim.Optimizer, batch: LeasedBatch
) -> dict[str, Any]:
    """PPO epochs on one leased batch of whole groups; the step's figures."""
    x = batch.padded(PAD).to_torch()
    assert x.old_logprobs is not None  # the generators send the behaviour logprobs
    # The tokens that train: loss_mask is 1 on the policy's response tokens, 0 on the prompt,
    # the padding and the tool's output, which the policy did not sample.
    mask = x.loss_mask
    # GRPO advantages: each reward less its group's mean, over the group's std. A group's
    # responses answer one prompt: the group is the baseline, no value model needed.
    adv = x.token_advantages

    # Measure before the update. The broker compares the trainer's logprobs (pi_old: the
    # weights before this step) with the behaviour ones (mu: the generator's weights, up to
    # max_staleness versions older, two versions within a continued partial) and answers the
    # run's correction, truncated importance sampling: w_t = min(pi_old(y_t) / mu(y_t), 2) per
    # token, 0 on tokens not trained. w_t is a constant of the loss: it corrects for whose
    # samples these are, not for the update. The broker keeps the logprobs for the ack.
    with torch.no_grad():
        old, _ = token_logprobs(policy, x)
    m = batch.measure(x.split_responses(old))
    weights = x.join_responses([m.weights[r.rollout_id] for r in batch])
    beta = m.kl_coef or 0.0

    for _ in range(s.epochs):
        logp, entropy = token_logprobs(policy, x)
        # PPO's clipped objective on the ratio to the weights the step started from, so that
        # several epochs on one batch cannot take the policy far; weighted by w_t.
        ratio = (logp - old).exp()
        clipped = ratio.clamp(1 - s.clip, 1 + s.clip)
        pg = -weights * torch.min(ratio * adv, clipped * adv)
        # The KL penalty: the k3 estimator of KL(mu || pi) on mu's samples, whose gradient
        # (r - 1) grad(logp) pulls the policy toward what sampled the batch. The broker adapts
        # beta after every ack: up while the measured KL is above kl_target, down below it.
        log_r = logp - x.old_logprobs
        kl = log_r.exp() - 1 - log_r
        # The entropy bonus keeps a policy that starts from random weights exploring.
        loss = ((pg + beta * kl - s.entropy * entropy) * mask).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    trained = mask > 0
    w = weights[trained]
    return {
        "reward": float(x.rewards.mean()),
        "right": float((x.rewards > 0.99).float().mean()),
        "calls": float((x.input_ids == RES).any(-1).float().mean()),
        "kl_coef": beta,
        "kl_mean": m.stats.kl_mean,
        "ess": m.stats.ess_fraction,
        "weight_mean": float(w.mean()),
        "weight_off": float(((w - 1).abs() > 1e-6).float().mean()),  # tokens reweighted
        "truncated": float((w >= 2 - 1e-6).float().mean()),  # at the correction's high
        "masked_tokens": int(((x.token_versions >= 0) & ~trained).sum()),  # the tool's
        "trained_tokens": int(trained.sum()),
        "token_lag": float((batch.policy_version - x.token_versions[trained]).float().mean()),
        "spanning": sum(len(r.versions) > 1 for r in batch),  # sampled across an update
    }


def trainer_main(s: Settings, incarnation: int, resume: bool) -> None:
    """Train until the run is at version ``steps``: a version per batch, a checkpoint every
    ``ckpt_every`` versions. ``resume``: from the checkpoint, moving the run back to it."""
    torch.set_num_threads(1)
    torch.manual_seed(s.seed + incarnation)
    policy = load_policy(s.path("weights-v0.pt"))
    optimizer = torch.optim.Adam(policy.parameters(), lr=s.lr)
    version, weights = 0, str(s.path("weights-v0.pt"))
    fresh = make_prompts(s.seed + 1, 200)
    with BrokerClient(s.url, trainer_id=f"trainer-{incarnation}", token=s.roles.trainer) as broker:
        if resume:
            ckpt = torch.load(s.path("checkpoint.pt"), weights_only=True)
            policy.load_state_dict(ckpt["policy"])
            optimizer.load_state_dict(ckpt["optimizer"])
            version, weights = int(ckpt["version"]), str(ckpt["weights"])
            # The gradients after the checkpoint are lost: the broker gives back the uses of
            # the batches acknowledged above its version, retires what was sampled above it,
            # and sends the generators (following the policy) back to its weights.
            back = broker.set_policy(s.run_id, version, weights=weights, rewind=True)
            print(
                f"trainer-{incarnation}: resumed from the checkpoint of version {version}; the "
                f"run rewound to {back.policy_version}, {back.evicted} rollouts retired",
                flush=True,
            )
            write_json(s.path("rewind.json"), {"to": back.policy_version, "evicted": back.evicted})
        else:
            checkpoint(s, policy, optimizer, version, weights)
            write_json(s.path("eval-start.json"), greedy_accuracy(policy, fresh))
        recent: list[dict[str, Any]] = []
        t0 = time.monotonic()
        while version < s.steps:
            try:
                with broker.lease(
                    s.run_id, s.batch_size, policy_version=version, wait_s=2.0
                ) as batch:
                    if not batch:
                        continue
                    figures = train_step(s, policy, optimizer, batch)
                    # What this ack will count, written first: a kill between the ack and the
                    # history line below leaves a step the broker counted and the history lacks.
                    acking = {
                        "trainer": incarnation,
                        "version": version + 1,
                        "trained_tokens": figures["trained_tokens"],
                    }
                    write_json(s.path(f"acking-t{incarnation}.json"), acking)
                    batch.ack_with(step=version)  # no logprobs: the measured ones serve
            except LeaseExpired:  # too late to ack: the step happened, the broker says not
                continue
            assert batch.ack_result is not None
            version += 1
            path = s.path(f"weights-v{version:04d}-t{incarnation}.pt")
            save_weights(policy, path)
            weights = str(path)
            broker.set_policy(s.run_id, version, weights=weights)  # the file exists by now
            if version % s.ckpt_every == 0:
                checkpoint(s, policy, optimizer, version, weights)
            figures |= {"version": version, "trainer": incarnation, "t": time.monotonic() - t0}
            figures["kl_coef_after"] = batch.ack_result.kl_coef
            with open(s.path("history.jsonl"), "a") as f:
                f.write(json.dumps(figures) + "\n")
            recent.append(figures)
            if version % s.log_every == 0 or version == s.steps:
                print_step(recent)
                recent = []
    write_json(s.path("eval-end.json"), greedy_accuracy(policy, fresh))


def checkpoint(
    s: Settings, policy: nn.Module, optimizer: torch.optim.Optimizer, version: int, weights: str
) -> None:
    state = {"policy": policy.state_dict(), "optimizer": optimizer.state_dict()}
    tmp = s.path(".checkpoint.tmp")
    torch.save(state | {"version": version, "weights": weights}, tmp)
    os.replace(tmp, s.path("checkpoint.pt"))


def print_step(recent: list[dict[str, Any]]) -> None:
    """A line of the reward curve: the means over the batches since the last line."""

    def mean(key: str) -> float:
        values = [f[key] for f in recent if f[key] is not None]
        return float(np.mean(values)) if values else math.nan

    last = recent[-1]
    print(
        f"  v{last['version']:>4} {last['t']:6.1f}s  reward {mean('reward'):6.3f}  "
        f"right {mean('right'):4.0%}  calls {mean('calls'):4.0%}  KL {mean('kl_mean'):.4f}  "
        f"β {last['kl_coef_after'] or 0:.4f}  IS w {mean('weight_mean'):.3f} "
        f"(≠1 {mean('weight_off'):4.0%}, at 2 {mean('truncated'):4.1%})  "
        f"lag {mean('token_lag'):.2f}  tool tokens {sum(f['masked_tokens'] for f in recent)}",
        flush=True,
    )


# -- the preference consumer -----------------------------------------------------------------


def collect_pairs(s: Settings, stop: threading.Event, out: dict[str, Any]) -> None:
    """Lease preference pairs (two responses to one prompt, the better one ``chosen``), as a
    DPO trainer would, until told to stop."""
    margins: list[float] = []
    tool_won = 0
    with BrokerClient(s.url, token=s.roles.preferences) as broker:
        consumer = broker.consumer(s.run_id, "preferences")
        while not stop.is_set():
            with consumer.batches(64, wait_s=1.0, stop_when_empty=True) as batches:
                for batch in batches:
                    margins += batch.margins().tolist()
                    tool_won += sum(
                        RES in p.chosen.response_ids and RES not in p.rejected.response_ids
                        for p in batch.pairs
                    )
    mean_margin = float(np.mean(margins)) if margins else None
    out.update(pairs=len(margins), mean_margin=mean_margin, chosen_called_rejected_not=tool_won)


# -- the run ---------------------------------------------------------------------------------


def run_config(s: Settings) -> dict[str, Any]:
    return {
        "group_size": s.group,
        "step_groups": s.groups_per_step,  # the staleness budget: groups per trainer step
        "max_staleness": 2,
        "max_reuse": 1,
        "clip_epsilon": s.clip,  # the share of ratios beyond it is reported as clip_fraction
        "drop_zero_variance_groups": True,  # all rewards equal: no advantage, nothing to learn
        # measure's importance weights: per token, truncated at 2 (TIS).
        "correction": {"level": "token", "mode": "truncate", "low": 0.0, "high": 2.0},
        # The adaptive KL penalty: β starts at kl_coef and takes its full step (±20 %) over
        # kl_horizon samples, 16 batches here.
        "kl_coef": 0.05,
        "kl_target": 0.01,
        "kl_horizon": 16 * s.batch_size,
        "kl_max": 1.0,  # a rollout retires on its measured KL only above this ...
        "kl_flush": 2.0,  # ... and a batch flushes the older ones only above this
        "reward_timeout_s": s.reward_timeout_s,
        "work_timeout_s": 30.0,
        "lease_timeout_s": 30.0,
    }


def start(ctx: Any, target: Any, *args: Any) -> Any:
    proc = ctx.Process(target=target, args=args, name=target.__name__, daemon=True)
    proc.start()
    return proc


def run(s: Settings, seconds: float) -> dict[str, Any]:
    """Set the run up and start every process; kill the trainer once and start another from
    its checkpoint; wait for the last version and stop everything. The run's figures."""
    config = run_config(s)
    prompts = make_prompts(s.seed, 1000)
    torch.manual_seed(s.seed)
    save_weights(CalcPolicy(), s.path("weights-v0.pt"))  # every process starts from these
    # Each process forks from a server process that imported torch once, instead of importing
    # it anew: 2 s of CPU each, and 2 more for torch._dynamo, which the first optimizer loads.
    methods = mp.get_all_start_methods()
    ctx = mp.get_context("forkserver" if "forkserver" in methods else "spawn")
    if "forkserver" in methods:
        ctx.set_forkserver_preload(["torch", "torch._dynamo", "rollout_broker_client"])
    with BrokerClient(s.url, token=s.roles.setup) as ops:
        ops.create_run(s.run_id, config)
        print(f"run {s.run_id}: {json.dumps(config)}", flush=True)
        # Passes enough for the run: once the policy is good most groups answer every response
        # right, retire zero_variance (they teach nothing) and use their pass up.
        epochs = math.ceil(15 * s.steps * s.groups_per_step / len(prompts)) + 1
        ops.register_prompts(s.run_id, prompts, epochs=epochs)
        ops.create_consumer(
            s.run_id, "preferences", source="received", kind="preferences", min_margin=0.05
        )
        stop = ctx.Event()
        t0 = time.monotonic()
        trainer = start(ctx, trainer_main, s, 0, False)
        workers = [start(ctx, generator_main, s, i, stop) for i in range(2)]
        workers += [start(ctx, verifier_main, s, i, stop) for i in range(2)]
        pairs: dict[str, Any] = {}
        pairs_stop = threading.Event()
        consumer = threading.Thread(target=collect_pairs, args=(s, pairs_stop, pairs))
        consumer.start()
        killed: dict[str, Any] = {}
        seen = 0
        try:
            while trainer.exitcode is None:
                if time.monotonic() - t0 > seconds:
                    raise TimeoutError(f"the run did not reach version {s.steps} in {seconds} s")
                if ended := [p.name for p in workers if p.exitcode is not None]:
                    raise RuntimeError(f"{', '.join(ended)} ended before the trainer")
                got = ops.policy(s.run_id, after=seen, wait_s=0.5)
                seen = seen if got is None else got.policy_version
                if s.kill_at and not killed and seen >= s.kill_at:
                    os.kill(trainer.pid, signal.SIGKILL)
                    trainer.join()
                    killed = {"at": seen, "seconds": time.monotonic() - t0}
                    print(f"SIGKILLed the trainer at version {seen}; starting another", flush=True)
                    trainer = start(ctx, trainer_main, s, 1, True)
            if trainer.exitcode != 0:
                raise RuntimeError(f"the trainer failed (exit code {trainer.exitcode})")
        finally:
            elapsed = time.monotonic() - t0
            stop.set()
            pairs_stop.set()
            for p in [trainer, *workers]:
                p.join(20)
                if p.is_alive():
                    p.terminate()
            consumer.join(20)
            ops.close_run(s.run_id)
        acc = ops.wait_for_accounting(s.run_id, timeout_s=60.0)
        generators = [g.raw for g in ops.accounting_generators(s.run_id)]
    history = []
    for line in s.path("history.jsonl").read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # a line the kill cut short
            history.append(json.loads(line))
    rewind = s.path("rewind.json")
    return {
        "run_id": s.run_id,
        "config": config,
        "seconds": elapsed,
        "history": history,
        "acking": [json.loads(p.read_text()) for p in sorted(Path(s.workdir).glob("acking-*"))],
        "killed": killed,
        "rewind": json.loads(rewind.read_text()) if rewind.exists() else None,
        "processes": {
            p.stem.removeprefix("stats-"): json.loads(p.read_text())
            for p in sorted(Path(s.workdir).glob("stats-*.json"))
        },
        "preferences": pairs,
        "eval": [json.loads(s.path(f"eval-{w}.json").read_text()) for w in ("start", "end")],
        "accounting": acc.raw,
        "accounting_ok": {
            "unaccounted": acc.unaccounted,
            "matches_live": acc.matches_live,
            "prompts_unaccounted": acc.prompts.unaccounted,
        },
        "generators": generators,
    }


# -- the report ------------------------------------------------------------------------------


def fmt(value: Any, spec: str = ",") -> str:
    return "-" if value is None else format(value, spec)


def report(out: dict[str, Any], log_every: int) -> None:
    """The reward curve and the run's accounting, for a person."""
    acc, history = out["accounting"], out["history"]
    rewards = [h["reward"] for h in history]
    means = [np.mean(rewards[i : i + log_every]) for i in range(0, len(rewards), log_every)]
    print(f"\nreward of the batches trained, mean of every {log_every} steps (the kill's too):")
    print("  " + " ".join(f"{r:.2f}" for r in means))
    start, end = out["eval"]
    print(
        f"greedy answers right on 200 prompts drawn anew: {start:.0%} at the start, "
        f"{end:.0%} at the end"
    )

    def row(label: str, *values: Any) -> None:
        print(f"  {label:<52}  {' '.join(str(v) for v in values)}")

    retired, partials, rewards_acc = acc["retired"], acc["partials"], acc["rewards"]
    bias, lag, kl, ratio = acc["bias"], acc["lag"], acc["kl"], acc["is_ratio"]
    scored, wait = rewards_acc["scored"], acc["wait"].get("reward_s")
    print(f"\naccounting of {out['run_id']} ({out['seconds']:.0f} s):")
    row(
        "rollouts generated",
        f"{acc['rollouts_received']:,}",
        f"({acc['groups_received']:,} groups)",
    )
    row("samples consumed (reached a gradient)", f"{acc['samples_consumed']:,}")
    row("reuse factor (samples / rollouts)", f"{acc['reuse_factor']:.3f}")
    row("of the samples, given back by the rewind", f"{acc['samples_rewound']:,}")
    row("retired", ", ".join(f"{k} {v:,}" for k, v in sorted(retired.items())))
    row("rejected at ingest", ", ".join(f"{k} {v:,}" for k, v in acc["rejected"].items()) or "-")
    row(
        "partial rollouts returned / resumed / dropped",
        f"{partials['returned']:,} / {partials['resumed']:,} / {partials['dropped']:,}",
        f"(tokens resumed {partials['tokens_resumed']:,}, dropped {partials['tokens_dropped']:,})",
    )
    row(
        "rewards scored / timed out in a reward lease",
        f"{scored:,} / {rewards_acc['timed_out']:,}",
        f"(mean wait {wait / scored:.2f} s)" if wait and scored else "",
    )
    row(
        "tokens generated / tool output (masked) / trained",
        f"{acc['tokens_generated']:,} / {acc['tokens_masked']:,} / {acc['tokens_consumed']:,}",
    )
    length, rew = bias["length"], bias["reward"]
    row(
        "mean length generated / trained (KS distance)",
        f"{fmt(length['generated_mean'], '.2f')} / {fmt(length['trained_mean'], '.2f')}",
        f"({fmt(length['ks'], '.3f')})",
    )
    row(
        "mean reward generated / trained",
        f"{fmt(rew['generated_mean'], '.3f')} / {fmt(rew['trained_mean'], '.3f')}",
    )
    row(
        "lag mean / max / per trained token",
        f"{fmt(lag['mean'], '.2f')} / {lag['max']} / {fmt(lag['token_mean'], '.2f')}",
    )
    row(
        "KL mean / max, IS ratio mean / clip fraction",
        f"{fmt(kl['mean'], '.4f')} / {fmt(kl['max'], '.4f')},",
        f"{fmt(ratio['mean'], '.3f')} / {fmt(ratio['clip_fraction'], '.3f')}",
    )
    first = history[0]["kl_coef"] if history else None
    row(
        "KL coefficient β at the first step / now",
        fmt(first, ".4f"),
        "/",
        fmt(acc["kl_coef"], ".4f"),
    )
    ok = out["accounting_ok"]
    row(
        "received == buffered + leased + Σ retired",
        f"{acc['rollouts_received']:,} == {acc['buffered']} + {acc['leased']} +",
        f"{sum(retired.values()):,}:",
        "yes" if ok["unaccounted"] == 0 else f"NO, {ok['unaccounted']} apart",
    )
    row("the ledger matches the live state", "yes" if ok["matches_live"] else "NO")
    print("\n  generator   rollouts   samples   KL mean   KL max   IS ratio   clip fraction")
    for g in out["generators"]:
        kl, ratio = g["kl"], g["is_ratio"]
        print(
            f"  {g['generator_id']:<10}{g['rollouts']:>10,}{g['samples_consumed']:>10,}"
            f"{fmt(kl['mean'], '.4f'):>10}{fmt(kl['max'], '.3f'):>9}"
            f"{fmt(ratio['mean'], '.3f'):>11}{fmt(ratio['clip_fraction'], '.3f'):>16}"
        )
    pairs, killed, rewind = out["preferences"], out["killed"], out["rewind"]
    print(
        f"\n  preference pairs: {pairs['pairs']:,}, mean margin {fmt(pairs['mean_margin'], '.3f')};"
        f" in {pairs['chosen_called_rejected_not']:,} the chosen response called the tool and "
        "the rejected one did not"
    )
    if killed and rewind:
        print(
            f"  the trainer, SIGKILLed at version {killed['at']}, was resumed from the checkpoint "
            f"of version {rewind['to']}: {rewind['evicted']:,} rollouts retired by the rewind"
        )
    for name, c in out["processes"].items():
        if name.startswith("gen-"):
            print(
                f"  {name}: posted {c.get('rollouts_posted', 0):,} rollouts (refused: "
                f"{c.get('rollouts_refused', 0)}); gave back "
                f"{c.get('partials_given_back', 0):,} partial responses at "
                f"{c.get('interruptions', 0)} weight updates and continued "
                f"{c.get('partials_continued', 0):,} ({c.get('rollouts_spanning_versions', 0):,} "
                f"posted with tokens of two versions); loaded {c['weights_loaded']} versions"
            )
        else:
            print(
                f"  {name}: scored {c.get('scored', 0):,} rollouts in {c.get('leases', 0):,} "
                f"reward leases; {c.get('slow_leases', 0)} outlived their lease; "
                f"{c.get('duplicates', 0):,} scores came second"
            )


# -- tokens and the command line -------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=os.environ.get("BROKER_URL"), help="broker to use")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="30 smaller steps: every feature, and the reward rising",
    )
    ap.add_argument("--steps", type=int, help="trainer steps (policy versions)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kill-at", type=int, help="version at which the trainer is killed (0: no)")
    ap.add_argument("--ckpt-every", type=int, help="versions between checkpoints")
    ap.add_argument("--token-ms", type=float, help="generation time per token")
    ap.add_argument("--tool-ms", type=float, help="time of a tool call")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seconds", type=float, help="time limit of the run")
    ap.add_argument("--json-out", type=Path, help="write a JSON summary here")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the broker, revoke tokens
    quick = args.quick
    prefix = f"tool-calc-{uuid.uuid4().hex[:8]}"
    with contextlib.ExitStack() as stack:
        if args.url:
            url, roles = args.url, Roles()
        else:
            admin_token = secrets.token_urlsafe(32)
            url = stack.enter_context(own_broker(admin_token))
            roles = Roles(**stack.enter_context(role_tokens(url, admin_token, prefix, ROLE_SCOPES)))
        s = Settings(
            url=url,
            run_id=f"{prefix}-run",
            roles=roles,
            workdir=stack.enter_context(tempfile.TemporaryDirectory(prefix="tool-calc-")),
            seed=args.seed,
            steps=args.steps or (30 if quick else 100),
            group=8 if quick else 16,
            groups_per_step=4 if quick else 8,
            max_prompts=2 if quick else 4,
            lr=args.lr,
            epochs=4,
            clip=0.2,
            entropy=0.03,
            # Slower generation in the short run, so that weight updates come while responses
            # are half done there too.
            token_s=(args.token_ms or (25.0 if quick else 5.0)) / 1000,
            tool_s=(args.tool_ms or (80.0 if quick else 20.0)) / 1000,
            ckpt_every=args.ckpt_every or (4 if quick else 10),
            kill_at=args.kill_at if args.kill_at is not None else (7 if quick else 55),
            log_every=2 if quick else 10,
            reward_timeout_s=1.5,
            slow_s=3.0,
        )
        print(
            f"{s.steps} steps of {s.groups_per_step} groups of {s.group} responses; a checkpoint "
            f"every {s.ckpt_every} versions; the trainer killed at version {s.kill_at or '-'}",
            flush=True,
        )
        out = run(s, args.seconds or (120.0 if quick else 600.0))
    report(out, s.log_every)
    if args.json_out is not None:
        settings = dataclasses.asdict(s) | {"roles": None}  # no secret in the file
        args.json_out.write_text(json.dumps({"settings": settings, **out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
