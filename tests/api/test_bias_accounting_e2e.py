"""The bias figures over the real API: rollouts posted with chosen trained lengths and rewards
(some scored later, through a reward lease or without one), leased and acked, the drain caught
up; ``bias`` of GET .../accounting equals a numpy recompute from what was posted and handed
out. Identical distributions give a distance of 0, disjoint ones 1 (under ``stale_tokens:
mask`` a sample's trained tokens at hand-out may be far fewer than at ingest), a mix the KS
distance of the bucketed samples."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import pytest

from app.accounting.bias import EDGES, bucket_of
from tests.api.support import set_policy
from tests.api.test_metrics import scrape, value
from tests.helpers import ack, lease, make_run, post
from workers.drain import DrainContext, drain_once

# The fold and the figures are the subject, not Redis: the same on a cluster.
pytestmark = pytest.mark.one_node


@pytest.fixture
def drain(redis, prefix, sessionmaker):
    return DrainContext.create(redis, sessionmaker, prefix, consumer="test-drain")


def ks_of_samples(x: list[int], y: list[int]) -> float:
    """The two-sample KS statistic of the bucketed lengths, computed directly from the empirical
    CDFs over every bucket either sample takes."""
    bx, by = np.sort(bucket_of(x)), np.sort(bucket_of(y))
    values = np.union1d(bx, by)
    fx = np.searchsorted(bx, values, side="right") / bx.size
    fy = np.searchsorted(by, values, side="right") / by.size
    return float(np.max(np.abs(fx - fy)))


def doc(
    rid: str,
    tokens: int,
    reward: float | None,
    *,
    masked: int = 0,
    versions: list[list[int]] | None = None,
    version: int = 0,
) -> dict[str, Any]:
    """A rollout of ``tokens`` response tokens, the last ``masked`` of them posted with loss_mask
    0 (its trained length at ingest: tokens - masked)."""
    d: dict[str, Any] = {
        "rollout_id": rid,
        "policy_version": version,
        "response_ids": list(range(1, tokens + 1)),
        "reward": reward,
    }
    if masked:
        d["loss_mask"] = [1] * (tokens - masked) + [0] * masked
    if versions is not None:
        d["versions"] = versions
    return d


async def posted(api: httpx.AsyncClient, run: str, *docs: dict[str, Any]) -> None:
    resp = await post(api, run, *docs)
    assert resp.status_code in (200, 202) and resp.json()["accepted"] == len(docs), resp.text


async def lease_and_ack(api: httpx.AsyncClient, run: str, size: int) -> list[dict[str, Any]]:
    """Leases ``size`` rollouts and acks them; returns them as handed out."""
    batch = (await lease(api, run, size)).json()
    assert len(batch["rollouts"]) == size
    assert (await ack(api, run, batch["batch_id"])).status_code == 200
    rollouts: list[dict[str, Any]] = batch["rollouts"]
    return rollouts


def trained_length(r: dict[str, Any]) -> int:
    """A sample's trained tokens as handed out: its loss_mask's ones (every token without one)."""
    mask = r.get("loss_mask")
    return len(r["response_ids"]) if mask is None else int(sum(mask))


async def bias_of(api: httpx.AsyncClient, drain: DrainContext, run: str) -> dict[str, Any]:
    while (await drain_once(drain)).read:
        pass
    acc = (await api.get(f"/v1/runs/{run}/accounting")).json()
    assert acc["pending_events"] == 0 and acc["dead_letters"] == 0
    bias: dict[str, Any] = acc["bias"]
    # GET /metrics tells the same figures.
    samples = await scrape(api)
    assert value(samples, "rollout_broker_bias_length_ks", run=run) == bias["length"]["ks"]
    for side in ("generated", "trained"):
        for figure in ("length", "reward"):
            got = value(samples, f"rollout_broker_bias_{figure}_mean", run=run, side=side)
            assert got == pytest.approx(bias[figure][f"{side}_mean"], rel=1e-15), (figure, side)
    return bias


def assert_bias(
    bias: dict[str, Any],
    generated: list[int],
    trained: list[int],
    rewards_generated: list[float],
    rewards_trained: list[float],
) -> None:
    length, reward = bias["length"], bias["reward"]
    assert length["generated_mean"] == pytest.approx(np.mean(generated), abs=1e-12)
    assert length["trained_mean"] == pytest.approx(np.mean(trained), abs=1e-12)
    assert length["ks"] == pytest.approx(ks_of_samples(generated, trained), abs=1e-12)
    assert reward["generated_mean"] == pytest.approx(np.mean(rewards_generated), abs=1e-12)
    assert reward["trained_mean"] == pytest.approx(np.mean(rewards_trained), abs=1e-12)
    edges = {
        int(b): n for b, n in zip(*np.unique(bucket_of(generated), return_counts=True), strict=True)
    }
    assert length["histogram"]["generated"] == {str(EDGES[b]): int(n) for b, n in edges.items()}
    assert sum(length["histogram"]["trained"].values()) == len(trained)


async def test_nothing_to_average_gives_nulls(api, drain):
    """Rollouts received (one awaiting its reward) and none consumed: the trained side's means
    and the distance are null, and /metrics has no sample for them."""
    run = "bias-none"
    await make_run(api, run)
    await posted(api, run, doc("a", 9, None))
    bias = await bias_of(api, drain, run)
    assert bias == {
        "length": {
            "generated_mean": 9.0,
            "trained_mean": None,
            "ks": None,
            "histogram": {"generated": {str(EDGES[bucket_of([9])[0]]): 1}, "trained": {}},
        },
        "reward": {"generated_mean": None, "trained_mean": None},
    }


async def test_identical_distributions_give_0(api, drain):
    """Every rollout used once as posted: the same lengths and rewards on both sides, rewards
    scored later (one through a reward lease, one without) counted as received."""
    run = "bias-same"
    await make_run(api, run)
    await posted(
        api,
        run,
        doc("a", 5, 0.5),
        doc("b", 40, -1.0, masked=30),  # trained 10
        doc("c", 300, 2.0, masked=1),
        doc("d", 7, None),
        doc("e", 1000, None, masked=999),  # trained 1
    )
    reward_lease = await api.post(f"/v1/runs/{run}/rewards/lease", json={"max_rollouts": 1})
    (leased,) = reward_lease.json()["rollouts"]
    later = {"d": 3.25, "e": -0.75}
    lease_id = reward_lease.json()["lease_id"]
    first = leased["rollout_id"]
    assert (
        await api.post(
            f"/v1/runs/{run}/rewards", json={"rewards": {first: later[first]}, "lease_id": lease_id}
        )
    ).json()["scored"] == 1
    other = "e" if first == "d" else "d"
    assert (
        await api.post(f"/v1/runs/{run}/rewards", json={"rewards": {other: later[other]}})
    ).json()["scored"] == 1
    handed = await lease_and_ack(api, run, 5)
    lengths = [5, 10, 299, 7, 1]
    assert sorted(trained_length(r) for r in handed) == sorted(lengths)
    rewards = [0.5, -1.0, 2.0, 3.25, -0.75]
    bias = await bias_of(api, drain, run)
    assert bias["length"]["ks"] == 0.0
    assert_bias(bias, lengths, lengths, rewards, rewards)


async def stale_masked_run(api: httpx.AsyncClient, run: str) -> None:
    """A run at version 2 whose rollouts' tokens of version 0 are masked at hand-out (their lag
    2 is beyond max_staleness 1)."""
    await make_run(api, run, stale_tokens="mask", max_staleness=1)
    await set_policy(api, run, 2)


async def test_disjoint_distributions_give_1(api, drain):
    """64 trained tokens each at ingest, 4 at hand-out (60 sampled at version 0, masked stale)."""
    run = "bias-apart"
    await stale_masked_run(api, run)
    rewards = [1.0, 0.0, 0.25]
    await posted(
        api,
        run,
        *(doc(f"s{i}", 64, w, versions=[[0, 0], [60, 2]]) for i, w in enumerate(rewards)),
    )
    handed = await lease_and_ack(api, run, 3)
    assert [trained_length(r) for r in handed] == [4, 4, 4]
    bias = await bias_of(api, drain, run)
    assert bias["length"]["ks"] == 1.0
    assert_bias(bias, [64] * 3, [4] * 3, rewards, rewards)


async def test_a_known_shift_gives_the_ks_distance_of_the_bucketed_samples(api, drain):
    """A mix: plain rollouts trained as posted, stale-masked ones far shorter at hand-out, and
    rollouts received after the lease (never trained): the distance, both length means and both
    reward means of a numpy recompute."""
    run = "bias-shift"
    await stale_masked_run(api, run)
    plain = [
        (f"p{i}", n, w) for i, (n, w) in enumerate([(8, 0.1), (16, 0.2), (33, 0.3), (100, 0.4)])
    ]
    stale = [(f"s{i}", 64, w) for i, w in enumerate([1.5, 2.5])]
    await posted(
        api,
        run,
        *(doc(rid, n, w, version=2) for rid, n, w in plain),
        *(doc(rid, n, w, versions=[[0, 0], [60, 2]]) for rid, n, w in stale),
    )
    handed = await lease_and_ack(api, run, 6)
    await posted(api, run, doc("late-0", 2000, 9.0, version=2), doc("late-1", 3, None, version=2))
    assert (await api.post(f"/v1/runs/{run}/rewards", json={"rewards": {"late-1": -4.0}})).json()[
        "scored"
    ] == 1
    generated = [n for _, n, _ in plain] + [64, 64, 2000, 3]
    trained = [trained_length(r) for r in handed]
    assert sorted(trained) == sorted([8, 16, 33, 100, 4, 4])
    rewards = [w for _, _, w in plain] + [w for _, _, w in stale]
    bias = await bias_of(api, drain, run)
    assert 0 < bias["length"]["ks"] < 1
    assert_bias(bias, generated, trained, [*rewards, 9.0, -4.0], rewards)
