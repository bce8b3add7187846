"""The README's Python tour runs as written and prints what the README says it prints; the
client README's work loop and reward-model consumer loop run as written, with stand-ins for the
models."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rollout_broker_client import BrokerClient, Rollout

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


@pytest.mark.parametrize(
    ("run", "first_line"),
    [("tour-py", "accepted "), ("resume-tour", "crashed "), ("reward-tour", "unscored: ")],
    ids=["tour", "resuming", "rewards"],
)
def test_python_tour(live_server: LiveServer, run: str, first_line: str) -> None:
    """The tour, the section on resuming a trainer (a rewind's accounting before, after and
    once trained again) and the one on rewards that arrive later (a reward worker that crashes
    gives back what it did not score)."""
    (code,) = [b for b in blocks("python") if f'"{run}"' in b]
    printed = next(b for b in blocks("") if b.startswith(first_line))
    code = code.replace("http://127.0.0.1:8000", live_server.url)
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == printed


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
