"""Mismatch attribution over the API: four generators post rollouts, one of them with its
behaviour logprobs perturbed; a trainer acks with the policy's own logprobs. The perturbed one is
quarantined at the ack that fills its KL window, the clean ones never are; then what the
quarantine refuses and retires, and the release."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np

from tests.api.support import assert_error, retired
from tests.helpers import ack, lease, make_run, post

TOKENS = 50  # per rollout
PER_ROUND = 4  # rollouts each generator posts per round
WINDOW = 1000  # generator_window_tokens: the bad generator fills it at its fifth acked batch
KL_MAX = 0.01  # generator_kl_max
CLEAN_SIGMA, BAD_SIGMA = 0.02, 0.25  # k3 ≈ σ²/2 per token: 0.0002 and 0.031 (3 × KL_MAX)
GENERATORS = ("gen-a", "gen-b", "gen-bad", "gen-c")


class Sampler:
    """The policy's true logprobs of each rollout, and what each generator reports as its
    behaviour logprobs: the truth plus its own noise."""

    def __init__(self) -> None:
        self.rng = np.random.default_rng(35)
        self.truth: dict[str, np.ndarray] = {}
        self.told: dict[str, np.ndarray] = {}
        self.n = 0

    def rollout(self, gen: str) -> dict[str, Any]:
        self.n += 1
        rid = f"{gen}-{self.n}"
        truth = self.rng.uniform(-2.0, -0.6, TOKENS)
        sigma = BAD_SIGMA if gen == "gen-bad" else CLEAN_SIGMA
        told = np.minimum(truth + self.rng.normal(0.0, sigma, TOKENS), 0.0)
        # What the broker stores is float32: the recompute starts from the same values.
        self.truth[rid] = truth.astype(np.float32)
        self.told[rid] = told.astype(np.float32)
        return {
            "rollout_id": rid,
            "policy_version": 0,
            "prompt_ids": [1, 2],
            "response_ids": list(range(3, 3 + TOKENS)),
            "logprobs": self.told[rid].tolist(),
            "reward": 1.0,
            "generator_id": gen,
        }

    def k3(self, rid: str) -> np.ndarray:
        log_r = self.truth[rid].astype(np.float64) - self.told[rid].astype(np.float64)
        return np.expm1(log_r) - log_r


async def _round(api: httpx.AsyncClient, s: Sampler, gens: tuple[str, ...]) -> None:
    for gen in gens:
        resp = await post(api, "r1", *(s.rollout(gen) for _ in range(PER_ROUND)))
        assert resp.status_code == 202 and resp.json()["accepted"] == PER_ROUND, resp.text


async def _train(api: httpx.AsyncClient, s: Sampler, n: int) -> list[str]:
    """Lease n rollouts, ack them with the policy's logprobs; the leased ids."""
    b = (await lease(api, "r1", n)).json()
    got = [r["rollout_id"] for r in b["rollouts"]]
    resp = await ack(api, "r1", b["batch_id"], logprobs={rid: s.truth[rid].tolist() for rid in got})
    assert resp.status_code == 200, resp.text
    return got


async def _quarantines(redis, prefix) -> list[dict[str, Any]]:
    from tests.api.support import events

    return [d for e, d in await events(redis, prefix, "r1") if e == "generator"]


async def test_the_perturbed_generator_is_quarantined_and_the_clean_ones_never(
    api: httpx.AsyncClient, redis, prefix
) -> None:
    await make_run(
        api,
        "r1",
        generator_kl_max=KL_MAX,
        generator_window_tokens=WINDOW,
        kl_max=1e6,
        kl_flush=1e6,
        order="fifo",
    )
    s = Sampler()
    per_batch = PER_ROUND * len(GENERATORS)
    trained: list[str] = []
    for rnd in range(1, 5):  # four acked batches: the bad generator has 800 measured tokens
        await _round(api, s, GENERATORS)
        trained += await _train(api, s, per_batch)
        assert await _quarantines(redis, prefix) == [], rnd
    # The fifth: its window fills with this ack. Rollouts posted meanwhile are buffered.
    await _round(api, s, GENERATORS)
    b = (await lease(api, "r1", per_batch)).json()
    await _round(api, s, GENERATORS)  # buffered when the quarantine comes
    buffered_bad = [f"gen-bad-{n}" for n in range(s.n - 2 * PER_ROUND + 1, s.n - PER_ROUND + 1)]
    got = [r["rollout_id"] for r in b["rollouts"]]
    trained += got
    resp = await ack(api, "r1", b["batch_id"], logprobs={rid: s.truth[rid].tolist() for rid in got})
    assert resp.status_code == 200, resp.text

    (mark,) = await _quarantines(redis, prefix)
    assert (mark["generator_id"], mark["quarantined"], mark["window_tokens"]) == (
        "gen-bad",
        1,
        WINDOW,
    )
    bad = [rid for rid in trained if rid.startswith("gen-bad-")]
    assert len(bad) * TOKENS == WINDOW
    expected = float(np.mean(np.concatenate([s.k3(rid) for rid in bad])))
    assert abs(mark["kl_mean"] - expected) <= 1e-9 * expected
    assert expected > 2 * KL_MAX
    # What it had buffered retired; the clean generators' did not (the acked batch's rollouts
    # are used up: max_reuse 1).
    gone = (await retired(redis, prefix, "r1")).get("quarantined", [])
    assert sorted(gone) == sorted(buffered_bad)

    # Its posts and its work are refused, the clean ones go on and are never quarantined.
    detail = assert_error(await post(api, "r1", s.rollout("gen-bad")), 409, "GeneratorQuarantined")
    assert "gen-bad" in detail and "release" in detail
    work = await api.post("/v1/runs/r1/work", json={"max_prompts": 1, "generator_id": "gen-bad"})
    assert_error(work, 409, "GeneratorQuarantined")
    clean = ("gen-a", "gen-b", "gen-c")
    for _ in range(6):
        await _round(api, s, clean)
        await _train(api, s, PER_ROUND * len(clean))
    assert len(await _quarantines(redis, prefix)) == 1

    # The release lifts it; an operator's audit entry follows the broker's.
    resp = await api.post("/v1/runs/r1/generators/gen-bad/release")
    assert resp.status_code == 200 and resp.json() == {"generator_id": "gen-bad", "released": True}
    again = await api.post("/v1/runs/r1/generators/gen-bad/release")
    assert again.json() == {"generator_id": "gen-bad", "released": False}
    assert (await post(api, "r1", s.rollout("gen-bad"))).status_code == 202
    entries = (await api.get("/v1/audit?run_id=r1")).json()["entries"]
    actions = [(e["actor"], e["action"]) for e in entries if e["action"].startswith("generator.")]
    assert actions == [("anonymous", "generator.release"), ("broker", "generator.quarantine")]
