"""examples/tool_calc.py --quick: a PyTorch policy trained through the broker on a multi-turn
tool task, with every feature in one short run: generators on work leases that follow the
policy and give back partial responses at weight updates, verifiers on reward leases (one lease
left to expire), the trainer's measured importance weights and adaptive KL coefficient, tool
output masked out of the loss, a preference consumer, and a trainer SIGKILLed and resumed from
its checkpoint with a rewind. The broker it starts has auth on, a token per role."""

from __future__ import annotations

import re
from statistics import mean
from typing import Any

import pytest

from tests.example_runs import example_summary

# A broker, a trainer started twice, generators and verifiers: once for every test here.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("tool-calc")]

STEPS, GROUP, GROUPS_PER_STEP = 30, 8, 4  # --quick
BATCH = GROUP * GROUPS_PER_STEP
FIRST, LAST = 4, 6  # the reward of the last steps against the first (the killed trainer's)
LEARNED = 0.12  # what the reward must have risen by, at least (about 0.25 in runs seen)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return example_summary("tool_calc.py", ["--quick"], tmp_path_factory.mktemp("tool-calc"))


def test_the_trainer_reaches_its_last_version_after_the_kill(run: dict[str, Any]) -> None:
    settings, history = run["settings"], run["history"]
    assert (settings["steps"], settings["group"], settings["groups_per_step"]) == (
        STEPS,
        GROUP,
        GROUPS_PER_STEP,
    )
    assert history[-1]["version"] == STEPS, run["stdout"]
    # Both trainers trained: the one killed and the one resumed from the checkpoint.
    assert {h["trainer"] for h in history} == {0, 1}
    assert [h["version"] for h in history if h["trainer"] == 1][-1] == STEPS


def test_the_policy_learned_in_the_short_run(run: dict[str, Any]) -> None:
    # The reward of the batches trained: noise at first (about -0.05), then the policy learns
    # to call the tool first and to answer in the format the verifier scores.
    history = run["history"]
    first = [h for h in history if h["version"] <= FIRST]
    last = [h for h in history if h["version"] > STEPS - LAST]
    assert len(first) == FIRST and len(last) == LAST, history
    before, after = mean(h["reward"] for h in first), mean(h["reward"] for h in last)
    assert after >= before + LEARNED, (before, after, run["stdout"])
    assert mean(h["calls"] for h in last) >= 0.9, run["stdout"]


def test_the_trainer_was_killed_and_the_run_rewound_to_its_checkpoint(
    run: dict[str, Any],
) -> None:
    killed, rewind, acc = run["killed"], run["rewind"], run["accounting"]
    every = run["settings"]["ckpt_every"]
    assert killed["at"] >= run["settings"]["kill_at"], run["stdout"]
    # The resumed trainer went back to the last checkpoint, below the version it was killed at.
    assert rewind["to"] % every == 0 and rewind["to"] < killed["at"], (killed, rewind)
    # The first version the resumed trainer published is the checkpoint's next.
    resumed = [h["version"] for h in run["history"] if h["trainer"] == 1]
    assert resumed[0] == rewind["to"] + 1
    # The batches acknowledged above the checkpoint's version were undone, and what was
    # sampled above it retired.
    assert acc["samples_rewound"] > 0 and acc["samples_rewound"] % BATCH == 0, acc
    assert acc["retired"].get("rewound", 0) == rewind["evicted"] > 0
    assert "SIGKILLed the trainer" in run["stdout"]


def test_the_trainer_trained_around_the_masked_tool_output(run: dict[str, Any]) -> None:
    acc, history = run["accounting"], run["history"]
    # The tool's output was posted with loss_mask 0 (3 tokens a call) ...
    assert acc["tokens_masked"] > 0 and acc["tokens_masked"] % 3 == 0, acc
    # ... and the batches the trainer trained on held such tokens, outside its loss mask.
    assert all(h["masked_tokens"] > 0 for h in history), history
    assert all(h["masked_tokens"] % 3 == 0 for h in history), history
    # The broker counts no masked token as consumed: exactly the tokens the acked batches
    # trained on. The killed trainer's last step may be missing from the history: acked (the
    # broker counted it) or not, as the kill fell.
    trained = sum(h["trained_tokens"] for h in history)
    recorded = {(h["trainer"], h["version"]) for h in history}
    unrecorded = [a for a in run["acking"] if (a["trainer"], a["version"]) not in recorded]
    assert len(unrecorded) <= 1 and all(a["trainer"] == 0 for a in unrecorded), unrecorded
    lost = sum(a["trained_tokens"] for a in unrecorded)
    assert acc["tokens_consumed"] in {trained, trained + lost}, (acc["tokens_consumed"], trained)


def test_partial_responses_were_given_back_and_continued(run: dict[str, Any]) -> None:
    partials = run["accounting"]["partials"]
    gens = {k: v for k, v in run["processes"].items() if k.startswith("gen-")}
    assert len(gens) == 2
    given = sum(g.get("partials_given_back", 0) for g in gens.values())
    continued = sum(g.get("partials_continued", 0) for g in gens.values())
    assert given > 0 and continued > 0, (gens, run["stdout"])
    # What the generators gave back is what the broker kept, with the partials a lease handed
    # out that went back to the broker uncompleted (a rewind refused their continuation, or
    # what had been sampled on them), and what they continued is what the broker handed out
    # again: none was lost or handed out twice.
    carried = sum(g.get("partials_carried_back", 0) for g in gens.values())
    assert partials["returned"] == given + carried, (partials, gens)
    assert partials["resumed"] == continued
    assert partials["returned"] == partials["resumed"] + partials["dropped"]
    # A continued response carries the version of each of its tokens: two versions in one.
    assert sum(g.get("rollouts_spanning_versions", 0) for g in gens.values()) > 0
    # The generators followed the policy: each loaded new weights more than once.
    assert all(g["weights_loaded"] > 1 for g in gens.values())


def test_the_verifiers_scored_every_rollout_and_a_reward_lease_expired(
    run: dict[str, Any],
) -> None:
    acc = run["accounting"]
    rewards = acc["rewards"]
    verifiers = {k: v for k, v in run["processes"].items() if k.startswith("verifier-")}
    assert len(verifiers) == 2
    # The generators post no reward: each rollout the broker received was scored once, by a
    # verifier (a second score of the same value, after a lease expired, is a duplicate) ...
    assert rewards["scored"] == sum(v.get("scored", 0) for v in verifiers.values())
    assert rewards["scored"] > 0
    assert rewards["awaiting"] == rewards["leased"] == 0  # the run is closed
    # ... and a slow verifier outlived its lease, which expired: another scored its rollouts.
    assert sum(v.get("slow_leases", 0) for v in verifiers.values()) >= 1
    assert rewards["timed_out"] >= 1, rewards


def test_the_trainer_used_the_measured_weights_and_the_kl_coefficient(
    run: dict[str, Any],
) -> None:
    history, acc = run["history"], run["accounting"]
    for h in history:
        # measure answered weights for every trained token and the statistics of the batch.
        assert h["weight_mean"] > 0 and h["kl_mean"] is not None and h["ess"] is not None
        assert h["kl_coef"] > 0
    # Samples from older weights were reweighted (a weight other than 1).
    assert any(h["weight_off"] > 0 for h in history), history
    # The adaptive KL coefficient moved from the run's kl_coef, as the acks said.
    start = run["config"]["kl_coef"]
    assert history[0]["kl_coef"] == start
    assert acc["kl_coef"] != start
    assert len({h["kl_coef_after"] for h in history}) > 1


def test_the_preference_consumer_got_pairs(run: dict[str, Any]) -> None:
    pairs = run["preferences"]
    assert pairs["pairs"] > 0 and pairs["mean_margin"] >= 0.05, pairs
    consumer = run["accounting"]["consumers"]["preferences"]
    # It acknowledged every pair it collected; none was dropped.
    assert consumer["acked"] == pairs["pairs"] == consumer["delivered"] - consumer["pending"]
    assert consumer["dropped"] == 0


def test_the_accounting_adds_up(run: dict[str, Any]) -> None:
    acc, ok = run["accounting"], run["accounting_ok"]
    assert acc["pending_events"] == 0 and acc["dead_letters"] == 0
    retired = sum(acc["retired"].values())
    assert acc["rollouts_received"] == acc["buffered"] + acc["leased"] + retired
    assert acc["buffered"] == acc["leased"] == 0  # the example closes its run
    assert ok == {"unaccounted": 0, "matches_live": True, "prompts_unaccounted": 0}
    # Every acked batch counts, the undone ones too: STEPS, and the steps the kill lost.
    assert acc["samples_consumed"] == acc["batches"]["acked"] * BATCH
    assert acc["batches"]["acked"] >= STEPS
    assert acc["rollouts_received"] == GROUP * acc["groups_received"]
    # What the generators posted is what the broker received, or refused (a post for a work
    # lease the rewind ended): nothing lost, nothing counted twice.
    posted = [v for k, v in run["processes"].items() if k.startswith("gen-")]
    assert sum(g["rollouts_posted"] for g in posted) == acc["rollouts_received"]
    assert sum(g.get("rollouts_refused", 0) for g in posted) == sum(acc["rejected"].values())
    gens = {g["generator_id"]: g for g in run["generators"]}
    assert set(gens) == {"gen-0", "gen-1"}
    assert sum(g["rollouts"] for g in gens.values()) == acc["rollouts_received"]
    assert all(g["kl"]["mean"] is not None for g in gens.values())


def test_the_accounting_is_printed(run: dict[str, Any]) -> None:
    acc, out = run["accounting"], run["stdout"]
    # A row is its label, then two spaces at least, then its figures.
    rows = [re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in out.splitlines()]
    lines = {row[0]: row[1] for row in rows if len(row) == 2}
    assert lines["rollouts generated"].startswith(f"{acc['rollouts_received']:,} ")
    assert lines["samples consumed (reached a gradient)"] == f"{acc['samples_consumed']:,}"
    assert lines["of the samples, given back by the rewind"] == f"{acc['samples_rewound']:,}"
    p = acc["partials"]
    assert lines["partial rollouts returned / resumed / dropped"].startswith(
        f"{p['returned']:,} / {p['resumed']:,} / {p['dropped']:,}"
    )
    assert lines["received == buffered + leased + Σ retired"].endswith(": yes")
    assert ", auth on" in out
