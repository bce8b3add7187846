"""The README's set-up commands come first and its Python blocks run as written: the tour and
the guide's tours print what they say they print, and the generator, trainer and mini-batch
loops run against a live broker with stand-ins for the inference engine and the model; the
client README's work loop and consumer loops run as written, with stand-ins for the models."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from rollout_broker_client import AsyncBrokerClient, BrokerClient, PartialCounts, Prompt, Rollout

from tests.client.live import REPO, LiveServer

pytestmark = pytest.mark.slow  # the tour runs in a subprocess against a live broker


def blocks(kind: str, readme: Path = REPO / "README.md") -> list[str]:
    """The README's fenced blocks of language ``kind`` ("" for none), in order."""
    out: list[str] = []
    lang: str | None = None
    lines: list[str] = []
    for line in readme.read_text().splitlines(keepends=True):
        if lang is None and line.startswith("```"):
            lang, lines = line[3:].strip(), []
        elif lang is not None and line.rstrip() == "```":
            if lang == kind:
                out.append("".join(lines))
            lang = None
        elif lang is not None:
            lines.append(line)
    return out


GUIDE = REPO / "docs" / "guide.md"


@pytest.mark.parametrize(
    ("page", "run", "first_line"),
    [
        (REPO / "README.md", "tour-py", "accepted "),
        (GUIDE, "resume-tour", "crashed "),
        (GUIDE, "reward-tour", "unscored: "),
    ],
    ids=["tour", "resuming", "rewards"],
)
def test_python_tour(live_server: LiveServer, page: Path, run: str, first_line: str) -> None:
    """The README's tour, and the guide's sections on resuming a trainer (a rewind's accounting
    before, after and once trained again) and on rewards that arrive later (a reward worker
    that crashes gives back what it did not score)."""
    (code,) = [b for b in blocks("python", page) if f'"{run}"' in b]
    printed = next(b for b in blocks("", page) if b.startswith(first_line))
    code = code.replace("http://127.0.0.1:8000", live_server.url)
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == printed


def test_the_set_up_commands_come_first() -> None:
    """The README opens with the command that serves and the one that tests, which CI runs as
    written, and says which Python they need."""
    readme = (REPO / "README.md").read_text()
    first = readme.index("```")
    assert readme[:first] == "# Rollout Broker\n\n"
    serve, test = blocks("bash")[0].splitlines()
    assert serve.startswith("pip install ./clients/python '.[embedded]' && rollout-broker serve ")
    ci = (REPO / ".ci" / "run").read_text().rstrip("\n").splitlines()[-1]
    assert test.split("  #")[0].rstrip() == ci
    after = readme[readme.index("```", first + 3) : readme.index("## Contents")]
    assert "Python 3.11 or later" in after


V = 16  # the stand-ins' vocabulary
TOOL = V - 1  # the token of a tool's output, never trained
UNIFORM = -math.log(V)  # the logprob of any token under a policy that has not learned yet


@dataclass
class Sampled:
    token_ids: list[int]
    logprobs: list[float]
    loss_mask: list[int]
    finish_reason: str
    text: str


class Engine:
    """A stand-in inference engine. A response is a token, a tool's output and two more tokens.
    While it samples prompt q1 for the first time the trainer publishes version 1 (this engine
    does it, through the broker), and those responses stop after their first two tokens."""

    def __init__(self, url: str, run: str) -> None:
        self.url, self.run = url, run
        self.version = 0
        self.rng = np.random.default_rng(0)
        self.cut: str | None = None  # the group_id of q1's first attempt
        self.loaded: list[tuple[str | None, int]] = []
        self.continued: list[str] = []

    async def sample(self, prompt: Any, partial: Any, stop: asyncio.Event) -> Sampled:
        if partial is not None:
            self.continued.append(partial.rollout_id)
            tail = [int(self.rng.integers(0, TOOL)), 3]
            text = " ".join(map(str, [*partial.response_ids.tolist(), *tail]))
            return Sampled(tail, [UNIFORM] * 2, [1, 1], "stop", text)
        head = [int(prompt.prompt_ids[0]), TOOL]
        if prompt.prompt_id == "q1" and self.cut in (None, prompt.group_id):
            if self.cut is None:
                self.cut = prompt.group_id
                async with AsyncBrokerClient(self.url) as trainer:
                    await trainer.set_policy(self.run, 1, weights="ckpt/1")
            await asyncio.wait_for(stop.wait(), timeout=30)  # the generator follows the version
            return Sampled(head, [UNIFORM] * 2, [1, 0], "abort", "")
        tokens = [*head, int(self.rng.integers(0, TOOL)), 3]
        return Sampled(tokens, [UNIFORM] * 4, [1, 0, 1, 1], "stop", " ".join(map(str, tokens)))

    async def load(self, weights: str | None, version: int) -> None:
        self.loaded.append((weights, version))
        self.version = version


class Policy(torch.nn.Module):
    """A stand-in language model: the logits at a position depend on its token alone; uniform
    before its first step, as the engine's logprobs are."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.zeros(V, V))

    def forward(self, input_ids: torch.Tensor, **_: Any) -> Any:
        return SimpleNamespace(logits=self.table[input_ids])


def readme_block(marker: str) -> str:
    (code,) = [b for b in blocks("python") if marker in b]
    return code


def test_the_readme_generator_and_trainer_loops(
    live_server: LiveServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """The README's generator takes work leases, follows the policy, gives a prompt back with
    its partial responses at a weight update and continues them; its trainer leases, steps,
    acks with the logprobs it started from and publishes each version; the mini-batch variant
    measures a batch, takes several steps and acks it once."""
    url, run = live_server.url, "plug-in"
    generator = readme_block("async def generate(")
    trainer = readme_block("def grpo_loss(")
    mini_batches = readme_block("batch.measure(")
    group, steps = 8, 2
    with BrokerClient(url) as broker:
        broker.create_run(
            run,
            {"group_size": group, "step_groups": 2, "max_staleness": 4, "max_reuse": 2,
             "kl_max": 100.0, "kl_flush": 100.0},
        )  # fmt: skip
        broker.register_prompts(run, [Prompt(f"q{i}", prompt_ids=[i + 1]) for i in range(4)])

    engine = Engine(url, run)

    def score(prompt: Any, out: Sampled) -> float:
        return float(int(out.text.split()[2]) % 2)  # the token after the tool's output

    loop = generator.replace("http://127.0.0.1:8000", url).replace('"my-run"', repr(run))
    assert loop.count("generator_id=generator_id, wait_s=30)") == 1  # it runs for ever
    loop = loop.replace(
        "generator_id=generator_id, wait_s=30)",
        "generator_id=generator_id, wait_s=0, stop_when_empty=True)",
    )
    exec(loop, {"engine": engine, "score": score})

    assert engine.loaded == [("ckpt/1", 1)]
    assert len(engine.continued) == group  # every response of q1, cut short, then continued
    with BrokerClient(url) as broker:
        acc = broker.wait_for_accounting(run, timeout_s=20)
    assert (acc.rollouts_received, acc.groups_received, acc.rejected) == (4 * group, 4, {})
    assert acc.tokens_masked == 4 * group  # one tool token in each response
    assert acc.partials == PartialCounts(
        returned=group, resumed=group, dropped=0, tokens_resumed=2 * group, tokens_dropped=0
    )

    saved: list[int] = []

    def save_weights(model: Policy, version: int) -> str:
        saved.append(version)
        return f"ckpt/{version}"

    model = Policy()
    names: dict[str, Any] = {
        "model": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.5),
        "save_weights": save_weights,
    }
    constants = 'RUN, GROUP, STEP_GROUPS, PAD_ID = "my-run", 8, 16, 0'
    ours = f"RUN, GROUP, STEP_GROUPS, PAD_ID = {run!r}, {group}, 2, 0"
    waiting = "continue  # nothing came within wait_s: ask again"
    for old in (constants, "while True:", waiting):
        assert trainer.count(old) == 1, old
    code = (
        trainer.replace("http://127.0.0.1:8000", url)
        .replace(constants, ours)
        .replace("while True:", f"while version < {1 + steps}:")  # it runs for ever
        .replace(waiting, "raise AssertionError('no batch')")  # the rollouts are all in
    )
    exec(code, names)

    assert saved == [2, 3]
    assert bool(model.table.detach().abs().sum() > 0)  # it took steps
    with BrokerClient(url) as broker:
        assert broker.get_run(run).policy_version == 3
        acc = broker.wait_for_accounting(run, timeout_s=20)
    assert (acc.batches.acked, acc.samples_consumed) == (steps, 4 * group)
    assert acc.kl.mean is not None  # the acks carried the trainer's logprobs

    exec(mini_batches.replace("http://127.0.0.1:8000", url), names)

    assert names["batch"].ack_result.consumed == 2 * group
    with BrokerClient(url) as broker:
        acc = broker.wait_for_accounting(run, timeout_s=20)
        (last,) = [b for b in broker.batches(run) if b["batch_id"] == names["batch"].batch_id]
    assert (acc.batches.acked, acc.samples_consumed) == (steps + 1, 6 * group)  # one ack
    assert last["outcome"] == "acked"
    assert last["kl_mean"] is not None  # the ack measured with the logprobs of the measure
    assert capsys.readouterr().out.startswith("kl_mean ")


@dataclass
class Output:
    token_ids: list[int]
    logprobs: list[float]


def test_client_readme_work_loop(live_server: LiveServer) -> None:
    code = blocks("python", REPO / "clients" / "python" / "README.md")
    (register,) = [b for b in code if "register_prompts(" in b]
    (generate,) = [b for b in code if "async def generate" in b]
    url = live_server.url
    sampled: list[str] = []

    async def sample(prompt_ids: np.ndarray, n: int) -> list[Output]:
        sampled.append(str(prompt_ids.tolist()))
        return [Output([int(prompt_ids[0]), k], [-0.5, -0.25]) for k in range(n)]

    names: dict[str, Any] = {
        "n": 5,
        "tokens": [[i, 1] for i in range(5)],
        "answers": list(range(5)),
        "sample": sample,
        "score": lambda o: float(o.token_ids[1] % 2),
    }
    exec(register.replace("http://broker:8000", url), names)
    # The README's loop runs for ever; this one ends once the queue is empty.
    loop = generate.replace("http://broker:8000", url)
    assert loop.count("wait_s=30") == 1
    exec(loop.replace("wait_s=30", "wait_s=0, stop_when_empty=True"), names)

    assert len(sampled) == 10  # 5 prompts, 2 epochs
    with BrokerClient(url) as broker:
        acc = broker.wait_for_accounting("my-run", timeout_s=20)
        assert (acc.prompts.registered, acc.prompts.in_flight) == (10, 10)
        assert (acc.rollouts_received, acc.groups_received) == (80, 10)


def test_client_readme_reward_model_consumer(
    live_server: LiveServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """The reward-model loop of the client README's consumers section, with a stand-in model."""
    (code,) = [
        b for b in blocks("python", REPO / "clients" / "python" / "README.md") if '"rm"' in b
    ]
    url = live_server.url
    fitted: list[tuple[int, list[float]]] = []

    class Model:
        def fit(self, tokens: list[np.ndarray], rewards: np.ndarray) -> None:
            assert rewards.dtype == np.float64
            fitted.append((len(tokens), rewards.tolist()))

    with BrokerClient(url) as broker:
        broker.create_run("rm-run")  # the work loop's test has "my-run"
        broker.create_consumer("rm-run", "rm", source="received", max_lag=8)  # as the README's
        broker.post_rollouts("rm-run", [Rollout(f"c{k}", 0, [k, 1], float(k)) for k in range(70)])
    assert code.count("wait_s=30") == 1
    loop = (
        code.replace("http://broker:8000", url)
        .replace('"my-run"', '"rm-run"')
        .replace("wait_s=30", "wait_s=0, stop_when_empty=True")
    )
    exec(loop, {"reward_model": Model()})
    assert [n for n, _ in fitted] == [64, 6]
    assert sorted(r for _, rs in fitted for r in rs) == [float(k) for k in range(70)]
    assert capsys.readouterr().out == "70\n"


def test_client_readme_dpo_consumer(live_server: LiveServer) -> None:
    """The DPO loop of the client README's consumers section, with stand-ins for the loss."""
    (code,) = [
        b for b in blocks("python", REPO / "clients" / "python" / "README.md") if '"dpo"' in b
    ]
    url = live_server.url
    losses: list[tuple[list[str], list[str], list[float]]] = []

    def dpo_loss(policy: object, reference: object, chosen: list[Any], rejected: list[Any],
                 weights: np.ndarray) -> float:  # fmt: skip
        assert weights.dtype == np.float64
        ids = [r.rollout_id for r in chosen], [r.rollout_id for r in rejected]
        losses.append((*ids, weights.tolist()))
        return 0.0

    with BrokerClient(url) as broker:
        broker.create_run("dpo-run", {"group_size": 3})
        broker.create_consumer(  # as the README's, before the rollouts come
            "dpo-run", "dpo", source="received", kind="preferences", min_margin=0.2
        )
        rewards = {"a": 1.0, "b": 0.9, "c": 0.0}
        broker.post_rollouts(
            "dpo-run", [Rollout(k, 0, [1], w, group_id="g") for k, w in rewards.items()]
        )
    loop = (
        code.replace("http://broker:8000", url)
        .replace('"my-run"', '"dpo-run"')
        .replace("wait_s=30", "wait_s=0, stop_when_empty=True")
    )
    names = {"dpo_loss": dpo_loss, "step": lambda loss: None, "policy": 0, "reference": 0}
    exec(loop, {"BrokerClient": BrokerClient, **names})  # imported in the block before
    assert losses == [(["a"], ["c"], [1.0])]  # best_worst: one pair of the group
    with BrokerClient(url) as broker:
        assert broker.get_consumer("dpo-run", "dpo").acked == 1
