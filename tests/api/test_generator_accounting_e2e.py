"""The accounting per generator over the API: several generators post, a trainer leases and
acks with the policy's logprobs, the drain applies the events; GET .../accounting/generators
equals a recompute from what was posted and acked."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import httpx
import numpy as np
import pytest

from tests.helpers import ack, lease, make_run, post
from workers.drain import DrainContext, drain_once

RUN = "gen-e2e"
# generator -> (rollouts, tokens each, the shift of the policy's logprobs from the behaviour's)
POSTED = {"gen-a": (3, 5, 0.3), "gen-b": (2, 7, 0.0), "gen-c": (1, 4, -0.2)}
UNNAMED = 2  # rollouts posted without a generator_id: counted for none
BEHAVIOUR = -0.9  # every behaviour logprob
EPS = 0.2  # the default clip_epsilon


@pytest.fixture
def drain(redis, prefix, sessionmaker):
    return DrainContext.create(redis, sessionmaker, prefix, consumer="test-drain")


def _rollout(rid: str, tokens: int, generator: str | None) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "rollout_id": rid,
        "policy_version": 0,
        "prompt_ids": [1, 2],
        "response_ids": list(range(3, 3 + tokens)),
        "logprobs": [BEHAVIOUR] * tokens,
        "reward": 1.0,
    }
    if generator is not None:
        doc["generator_id"] = generator
    return doc


async def _traffic(api: httpx.AsyncClient, drain: DrainContext) -> dict[str, Any]:
    """Posts, one batch of everything acked with logprobs shifted per generator; the drain
    caught up. Returns the accounting."""
    await make_run(api, RUN, max_reuse=2)
    shift: dict[str, float] = {}
    for gen, (n, tokens, delta) in POSTED.items():
        docs = [_rollout(f"{gen}-{i}", tokens, gen) for i in range(n)]
        resp = await post(api, RUN, *docs)
        assert resp.status_code in (200, 202) and resp.json()["accepted"] == n, resp.text
        shift |= {d["rollout_id"]: delta for d in docs}
    unnamed = [_rollout(f"none-{i}", 6, None) for i in range(UNNAMED)]
    assert (await post(api, RUN, *unnamed)).status_code in (200, 202)
    shift |= {d["rollout_id"]: 0.1 for d in unnamed}
    batch = (await lease(api, RUN, len(shift))).json()
    assert len(batch["rollouts"]) == len(shift)
    logprobs = {
        r["rollout_id"]: [x + shift[r["rollout_id"]] for x in r["logprobs"]]
        for r in batch["rollouts"]
    }
    assert (await ack(api, RUN, batch["batch_id"], logprobs=logprobs)).status_code == 200
    while (await drain_once(drain)).read:
        pass
    acc = (await api.get(f"/v1/runs/{RUN}/accounting")).json()
    assert acc["pending_events"] == 0
    return acc


def _recompute() -> dict[str, dict[str, Any]]:
    """What each generator's rows must say: k3 KL and ratios per token of the shift (behaviour
    logprobs in float32, as the broker keeps them)."""
    out = {}
    for gen, (n, tokens, delta) in POSTED.items():
        # The lease writes each float32 logprob as its shortest text (-0.9), which the test
        # reads back as a double and shifts: the ack's logprobs are doubles, the kept ones not.
        log_r = (BEHAVIOUR + delta) - float(np.float32(BEHAVIOUR))
        r = float(np.exp(log_r))
        k3 = r - 1 - log_r
        out[gen] = {
            "rollouts": n,
            "tokens": n * tokens,
            "samples_consumed": n,
            "kl": {"mean": pytest.approx(k3, abs=1e-9), "max": pytest.approx(k3, abs=1e-9)},
            "is_ratio": {
                "mean": pytest.approx(r),
                "clip_fraction": 1.0 if abs(r - 1) > EPS else 0.0,
            },
            "masked_fraction": 0.0,  # the default correction (truncate) weighs no token 0
            "quarantined": False,
        }
    return out


async def _generators(api: httpx.AsyncClient) -> dict[str, dict[str, Any]]:
    resp = await api.get(f"/v1/runs/{RUN}/accounting/generators")
    assert resp.status_code == 200, resp.text
    return {g.pop("generator_id"): g for g in resp.json()["generators"]}


async def test_what_each_generator_posted_is_counted_for_it(
    api: httpx.AsyncClient, drain: DrainContext
) -> None:
    acc = await _traffic(api, drain)
    got = await _generators(api)
    assert set(got) == set(POSTED)
    for gen, want in _recompute().items():
        assert (got[gen]["rollouts"], got[gen]["tokens"]) == (want["rollouts"], want["tokens"])
        assert got[gen]["quarantined"] is False
        # Seen at its post, before the newest event (the ack).
        seen = datetime.fromisoformat(got[gen]["last_seen"])
        assert seen <= datetime.fromisoformat(acc["as_of"])
    assert sum(g["rollouts"] for g in got.values()) == acc["rollouts_received"] - UNNAMED


async def test_each_generators_samples_and_mismatch_equal_a_recompute(
    api: httpx.AsyncClient, drain: DrainContext
) -> None:
    await _traffic(api, drain)
    got = await _generators(api)
    for gen, want in _recompute().items():
        assert {k: got[gen][k] for k in want} == want, gen
