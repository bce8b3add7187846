"""examples/async_grpo.py, short: the same prompts, trainer and number of steps with free-running
generators and with work leases under the staleness budget. Free-running wastes rollouts to
staleness and trains on shorter responses than it generates; work leases generate (almost)
nothing that goes stale, and train on what they generate. The broker it starts has auth on, and
each role works with a token of its own scope."""

from __future__ import annotations

from typing import Any

import pytest

from tests.example_runs import example_summary

# Two runs of 30 steps, each with its generator processes: once for every test here.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("grpo")]

STEPS = 30
GROUPS_PER_STEP, GROUP = 4, 8  # the example's defaults: a batch is 4 groups of 8 responses


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    summary = example_summary(
        "async_grpo.py", ["--steps", str(STEPS)], tmp_path_factory.mktemp("grpo")
    )
    for mode in ("free", "work"):
        assert summary["runs"][mode]["accounting"] is not None, summary["stdout"]
    return summary


def accounting(run: dict[str, Any], mode: str) -> dict[str, Any]:
    acc: dict[str, Any] = run["runs"][mode]["accounting"]
    return acc


def stale(acc: dict[str, Any]) -> int:
    """Rollouts lost to staleness: retired from the buffer, or refused at ingest."""
    return int(acc["retired"].get("stale", 0) + acc["rejected"].get("stale", 0))


def mean_generated(acc: dict[str, Any]) -> float:
    return float(acc["tokens_generated"] / acc["rollouts_received"])


def mean_trained(acc: dict[str, Any]) -> float:
    return float(acc["tokens_consumed"] / acc["samples_consumed"])


def test_both_modes_train_the_same_steps(run: dict[str, Any]) -> None:
    for mode in ("free", "work"):
        # The time limit is only a guard against a hang: every step must have been trained.
        assert run["runs"][mode]["versions"] == STEPS, run["stdout"]
        acc = accounting(run, mode)
        assert acc["batches"]["acked"] == STEPS
        assert acc["samples_consumed"] == STEPS * GROUPS_PER_STEP * GROUP


def test_work_leases_generate_almost_nothing_that_goes_stale(run: dict[str, Any]) -> None:
    acc = accounting(run, "work")
    assert acc["prompts"]["done"] >= STEPS * GROUPS_PER_STEP, acc["prompts"]
    # At most one group in a hundred rollouts: a generator held up beyond max_staleness steps.
    assert stale(acc) <= acc["rollouts_received"] // 100, (acc, run["stdout"])


def test_free_running_loses_rollouts_to_staleness(run: dict[str, Any]) -> None:
    free, work = accounting(run, "free"), accounting(run, "work")
    # The generators outrun the trainer: a large share of what they post goes stale unused ...
    assert stale(free) >= free["rollouts_received"] // 4, (free, run["stdout"])
    # ... and its tokens are wasted, several times what work leases leave unused at the close.
    assert free["wasted_tokens"] > 5 * work["wasted_tokens"], run["stdout"]


def test_free_running_trains_on_shorter_responses_than_it_generates(run: dict[str, Any]) -> None:
    # A long response starts from an older version and arrives after fresher short ones, so the
    # freshest-first trainer takes the short ones and the long ones go stale.
    # The margin is the bias's direction beyond noise, not its size on one machine: with no bias
    # the mean trained on would be within about 1 token (2 standard errors of 960 samples of
    # lengths 4-53) of the mean generated, some 5% of it; how strong the bias is depends on how
    # fast the trainer steps against the generators (0.85 of the mean on a slow day here).
    free = accounting(run, "free")
    assert mean_trained(free) < 0.9 * mean_generated(free), run["stdout"]
    # Under work leases, what is generated is trained on, long or short.
    work = accounting(run, "work")
    assert mean_trained(work) > 0.9 * mean_generated(work), run["stdout"]


def test_reward_improves_in_both_modes(run: dict[str, Any]) -> None:
    for mode in ("free", "work"):
        r = run["runs"][mode]
        rewards = [x for _, x in r["history"]]
        assert r["final_reward"] > 1.25 * r["initial_reward"], (mode, rewards)
        third = max(1, len(rewards) // 3)
        assert sum(rewards[-third:]) / third > sum(rewards[:third]) / third, (mode, rewards)


def test_accounting_adds_up(run: dict[str, Any]) -> None:
    for mode in ("free", "work"):
        acc = accounting(run, mode)
        assert acc["pending_events"] == 0
        retired = sum(acc["retired"].values())
        assert acc["rollouts_received"] == acc["buffered"] + acc["leased"] + retired
        assert acc["samples_consumed"] == run["runs"][mode]["acked_rollouts"]
        assert acc["buffered"] == acc["leased"] == 0  # the example closes its runs
        assert acc["rollouts_received"] == GROUP * acc["groups_received"]
        assert sum(acc["lag"]["histogram"].values()) == acc["samples_consumed"]


def test_the_comparison_is_printed(run: dict[str, Any]) -> None:
    free, work = accounting(run, "free"), accounting(run, "work")
    lines = {line[:38].strip(): line[38:].split() for line in run["stdout"].splitlines()}
    assert lines["rollouts generated"] == [
        f"{free['rollouts_received']:,}",
        f"{work['rollouts_received']:,}",
    ]
    assert lines["retired stale"] == [f"{stale(free):,}", f"{stale(work):,}"]
    assert lines["mean length trained on"] == [
        f"{mean_trained(free):.1f}",
        f"{mean_trained(work):.1f}",
    ]
    assert lines["length KS distance, generated/trained"] == [
        f"{free['bias']['length']['ks']:.3f}",
        f"{work['bias']['length']['ks']:.3f}",
    ]


def test_the_bias_figures_show_what_free_running_leaves_out(run: dict[str, Any]) -> None:
    """The broker's bias figures: the means are the totals' own, and the length distribution
    trained on is further from the one generated when free-running than under work leases,
    which train on what they generate."""
    free, work = accounting(run, "free"), accounting(run, "work")
    for acc in (free, work):
        length = acc["bias"]["length"]
        assert length["trained_mean"] == pytest.approx(mean_trained(acc))
        assert sum(length["histogram"]["trained"].values()) == acc["samples_consumed"]
    assert free["bias"]["length"]["ks"] > work["bias"]["length"]["ks"], run["stdout"]
    assert work["bias"]["length"]["ks"] < 0.1, run["stdout"]


def test_each_role_acts_with_its_own_token(run: dict[str, Any]) -> None:
    """The example's broker has auth on; the audit log names the token of each role."""
    assert ", auth on" in run["stdout"]
    for mode in ("free", "work"):
        prefix = run["runs"][mode]["run_id"].removesuffix(f"-{mode}")
        assert run["runs"][mode]["audit"] == {
            f"{prefix}-setup run.create": 1,
            f"{prefix}-trainer run.policy": STEPS,
            f"{prefix}-setup run.close": 1,
        }, run["stdout"]
