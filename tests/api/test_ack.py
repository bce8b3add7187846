"""Acknowledging and giving back batches; the off-policy statistics of an ack."""

from __future__ import annotations

import asyncio
import math
import time

import msgpack
import numpy as np
import pytest

from app import keys
from app.broker.stats import FIGURE_CAP
from app.events import Acked, decode_entry
from tests.api.support import (
    MSGPACK,
    assert_error,
    events,
    ids,
    nack,
    patch,
    retired,
    retired_items,
    set_policy,
)
from tests.helpers import ack, lease, make_run, post, rollout

# Values exact in float32, so the broker's float32 storage changes nothing.
OLD = {"A": [-0.5, -1.0, -0.25], "B": [-2.0, -0.5]}
NEW = {"A": [-0.25, -1.5, -0.25], "B": [-1.0, -0.5]}


def _log_r(rid: str) -> list[float]:
    return [n - o for n, o in zip(NEW[rid], OLD[rid], strict=True)]


def _k(estimator: str, x: float) -> float:
    r = math.exp(x)
    return {"k1": -x, "k2": x * x / 2, "k3": (r - 1) - x}[estimator]


def _expected_stats(estimator: str, eps: float) -> dict[str, float]:
    per_rollout = {rid: [_k(estimator, x) for x in _log_r(rid)] for rid in OLD}
    tokens = [x for rid in OLD for x in _log_r(rid)]
    all_k = [k for rid in OLD for k in per_rollout[rid]]
    ratios = [math.exp(x) for x in tokens]
    seq = [math.exp(sum(_log_r(rid))) for rid in OLD]
    return {
        "kl_mean": sum(all_k) / len(all_k),
        "kl_max": max(sum(v) / len(v) for v in per_rollout.values()),
        "is_ratio_mean": sum(ratios) / len(ratios),
        "clip_fraction": sum(abs(r - 1) > eps for r in ratios) / len(ratios),
        "ess_fraction": sum(seq) ** 2 / (len(seq) * sum(w * w for w in seq)),
    }


def _approx(d: dict[str, float]) -> dict[str, object]:
    return {k: pytest.approx(v, rel=1e-9, abs=1e-15) for k, v in d.items()}


async def _two_rollouts(api, **config) -> dict:
    await make_run(api, "r1", **{"kl_max": 1e6, "kl_flush": 1e6, **config})
    await post(
        api,
        "r1",
        rollout("A", tokens=3, logprobs=OLD["A"]),
        rollout("B", tokens=2, logprobs=OLD["B"]),
    )
    resp = await lease(api, "r1", 2)
    assert resp.status_code == 200
    return resp.json()


async def test_ack_answers_consumed_retired_flushed(api, redis, prefix):
    await make_run(api, "r1")
    await post(api, "r1", rollout("a"), rollout("b"), rollout("c"))
    batch = (await lease(api, "r1", 2)).json()
    resp = await ack(api, "r1", batch["batch_id"], step=12)
    assert resp.status_code == 200, resp.text
    assert resp.json() == {
        "consumed": 2,
        "retired": 2,
        "flushed": 0,
        "kl_coef": None,
        "stats": {
            "kl_mean": None,
            "kl_max": None,
            "is_ratio_mean": None,
            "clip_fraction": None,
            "ess_fraction": None,
        },
    }
    assert (await retired(redis, prefix, "r1")) == {"max_reuse": sorted(ids(batch))}
    acked = [d for e, d in await events(redis, prefix, "r1") if e == "acked"]
    assert len(acked) == 1
    assert acked[0]["batch_id"] == batch["batch_id"]
    assert acked[0]["step"] == 12
    assert sorted(item[0] for item in acked[0]["items"]) == sorted(ids(batch))


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
async def test_ack_statistics_match_the_spec(api, estimator):
    batch = await _two_rollouts(api)
    await patch(api, "r1", kl_estimator=estimator)
    resp = await ack(api, "r1", batch["batch_id"], logprobs=NEW)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["consumed"] == 2
    assert body["retired"] == 2  # max_reuse=1
    assert body["flushed"] == 0
    assert body["stats"] == _approx(_expected_stats(estimator, 0.2))


async def test_estimators_give_the_known_values(api):
    """A hand check of the expectation helper: log_r = [0.25, -0.5, 0, 1, 0]."""
    assert _log_r("A") + _log_r("B") == [0.25, -0.5, 0.0, 1.0, 0.0]
    k1 = _expected_stats("k1", 0.2)
    assert k1["kl_mean"] == pytest.approx((-0.25 + 0.5 - 1.0) / 5)
    assert k1["kl_max"] == pytest.approx(0.25 / 3)
    assert k1["clip_fraction"] == pytest.approx(3 / 5)
    k2 = _expected_stats("k2", 0.2)
    assert k2["kl_mean"] == pytest.approx((0.03125 + 0.125 + 0.5) / 5)


async def test_clip_epsilon_patch_changes_clip_fraction(api):
    batch = await _two_rollouts(api)
    await patch(api, "r1", clip_epsilon=0.3)  # |r-1| = .284, .393, 0, 1.718, 0
    body = (await ack(api, "r1", batch["batch_id"], logprobs=NEW)).json()
    assert body["stats"]["clip_fraction"] == pytest.approx(2 / 5)
    assert body["stats"] == _approx(_expected_stats("k3", 0.3))


async def test_ack_logprobs_as_msgpack_float32_bytes(api):
    batch = await _two_rollouts(api)
    payload = {"logprobs": {rid: np.array(v, dtype="<f4").tobytes() for rid, v in NEW.items()}}
    resp = await api.post(
        f"/v1/runs/r1/batches/{batch['batch_id']}/ack",
        content=msgpack.packb(payload, use_bin_type=True),
        headers=MSGPACK,
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["stats"] == _approx(_expected_stats("k3", 0.2))


async def test_ess_fraction_is_stable_for_huge_sequence_weights(api):
    await make_run(api, "r1", kl_max=1e12, kl_flush=1e12)
    await post(
        api,
        "r1",
        rollout("big", tokens=20, logprobs=[-40.0] * 20),
        rollout("one", tokens=2, logprobs=[-0.5, -0.5]),
    )
    batch = (await lease(api, "r1", 2)).json()
    # Σ log_r = 800 for "big": exp(800) overflows a double.
    resp = await ack(
        api, "r1", batch["batch_id"], logprobs={"big": [0.0] * 20, "one": [-0.5, -0.5]}
    )
    assert resp.status_code == 200, resp.text
    stats = resp.json()["stats"]
    # (e^800 + 1)^2 / (2 (e^1600 + 1)) computed with the weights scaled by e^-800
    w = [1.0, math.exp(-800.0)]
    assert stats["ess_fraction"] == pytest.approx(sum(w) ** 2 / (2 * sum(x * x for x in w)))
    assert stats["ess_fraction"] == pytest.approx(0.5)
    assert stats["clip_fraction"] == pytest.approx(20 / 22)
    assert math.isfinite(stats["kl_mean"])
    assert math.isfinite(stats["is_ratio_mean"])


async def test_on_policy_ack_has_unit_ratios(api):
    batch = await _two_rollouts(api)
    body = (await ack(api, "r1", batch["batch_id"], logprobs=OLD)).json()
    assert body["stats"] == {
        "kl_mean": 0.0,
        "kl_max": 0.0,
        "is_ratio_mean": 1.0,
        "clip_fraction": 0.0,
        "ess_fraction": 1.0,
    }


async def test_ready_made_kl_values(api, redis, prefix):
    await make_run(api, "r1", max_reuse=3, kl_max=0.05, kl_flush=1.0)
    await post(api, "r1", rollout("A", tokens=3), rollout("B", tokens=2), rollout("C", tokens=1))
    batch = (await lease(api, "r1", 3)).json()
    resp = await ack(api, "r1", batch["batch_id"], kl={"A": 0.01, "B": 0.2, "C": 0.05})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["consumed"] == 3
    assert body["retired"] == 1
    assert body["flushed"] == 0
    assert body["stats"] == {
        "kl_mean": pytest.approx((0.01 * 3 + 0.2 * 2 + 0.05 * 1) / 6),
        "kl_max": 0.2,
        "is_ratio_mean": None,
        "clip_fraction": None,
        "ess_fraction": None,
    }
    # B is above kl_max and retires; C sits exactly at kl_max and stays eligible
    assert (await retired_items(redis, prefix, "r1")) == {"kl": [["B", 0, 2, 1]]}
    again = (await lease(api, "r1", 3, partial=True)).json()
    assert {r["rollout_id"]: r["uses"] for r in again["rollouts"]} == {"A": 1, "C": 1}


async def test_measured_kl_above_kl_max_retires(api, redis, prefix):
    # k3 KL of A = mean([0.034, 0.1065, 0]) ≈ 0.047; of B = mean([0.718, 0]) ≈ 0.359
    batch = await _two_rollouts(api, max_reuse=2)
    await patch(api, "r1", kl_max=0.05)
    body = (await ack(api, "r1", batch["batch_id"], logprobs=NEW)).json()
    assert body["retired"] == 1
    assert (await retired(redis, prefix, "r1")) == {"kl": ["B"]}
    assert ids((await lease(api, "r1", 2, partial=True)).json()) == ["A"]


async def test_lowering_kl_max_gates_a_measured_rollout(api, redis, prefix):
    await make_run(api, "r1", max_reuse=3, kl_max=0.5, kl_flush=10)
    await post(api, "r1", rollout("A"))
    b = (await lease(api, "r1", 1)).json()
    assert (await ack(api, "r1", b["batch_id"], kl={"A": 0.2})).json()["retired"] == 0
    await patch(api, "r1", kl_max=0.1)
    assert (await lease(api, "r1", 1)).status_code == 204
    assert (await retired(redis, prefix, "r1")) == {"kl": ["A"]}


async def test_ack_without_measurement_clears_the_last_kl(api, redis, prefix):
    await make_run(api, "r1", max_reuse=3, kl_max=0.5, kl_flush=10)
    await post(api, "r1", rollout("A"))
    b = (await lease(api, "r1", 1)).json()
    await ack(api, "r1", b["batch_id"], kl={"A": 0.2})
    b = (await lease(api, "r1", 1)).json()
    await ack(api, "r1", b["batch_id"])  # no kl, no logprobs: no measured KL now
    await patch(api, "r1", kl_max=0.1)
    b = (await lease(api, "r1", 1)).json()
    assert [(r["rollout_id"], r["uses"]) for r in b["rollouts"]] == [("A", 2)]
    assert (await retired(redis, prefix, "r1")) == {}


async def test_kl_mean_above_kl_flush_flushes_older_buffered_rollouts(api, redis, prefix):
    await make_run(api, "r1", max_staleness=5, max_reuse=2, kl_max=10, kl_flush=0.1)
    await post(api, "r1", rollout("old-1", 0), rollout("old-2", 0), rollout("old-3", 0))
    await set_policy(api, "r1", 1)
    await post(api, "r1", rollout("new-1", 1), rollout("new-2", 1))
    # leased old rollout: not buffered at flush time
    old_lease = (await lease(api, "r1", 1, policy_version=1)).json()
    assert ids(old_lease) == ["new-1"]  # freshest first
    b = (await lease(api, "r1", 1)).json()
    assert ids(b) == ["new-2"]
    held = (await lease(api, "r1", 1)).json()
    assert ids(held) == ["old-1"]
    resp = await ack(api, "r1", b["batch_id"], kl={"new-2": 0.5})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["consumed"] == 1
    assert body["retired"] == 0  # new-2: kl 0.5 ≤ kl_max 10, uses 1 < 2
    assert body["flushed"] == 2
    assert (await retired(redis, prefix, "r1")) == {"kl_flush": ["old-2", "old-3"]}
    # the leased old one goes the same way when it returns; version-1 rollouts stay
    await nack(api, "r1", held["batch_id"])
    assert (await retired(redis, prefix, "r1")) == {"kl_flush": ["old-1", "old-2", "old-3"]}
    await nack(api, "r1", old_lease["batch_id"])
    rest = (await lease(api, "r1", 5, partial=True)).json()
    assert sorted(ids(rest)) == ["new-1", "new-2"]


async def test_kl_mean_at_kl_flush_does_not_flush(api, redis, prefix):
    await make_run(api, "r1", max_staleness=5, kl_max=10, kl_flush=0.25)
    await post(api, "r1", rollout("old", 0))
    await set_policy(api, "r1", 1)
    await post(api, "r1", rollout("new", 1))
    b = (await lease(api, "r1", 1)).json()
    body = (await ack(api, "r1", b["batch_id"], kl={"new": 0.25})).json()
    assert body["flushed"] == 0
    assert ids((await lease(api, "r1", 1)).json()) == ["old"]


async def test_repeated_ack_returns_the_same_answer_and_counts_once(api, redis, prefix):
    batch = await _two_rollouts(api, max_reuse=3)
    first = await ack(api, "r1", batch["batch_id"], logprobs=NEW)
    assert first.status_code == 200
    again = await ack(api, "r1", batch["batch_id"], logprobs=OLD)
    assert again.status_code == 200
    assert again.json() == first.json()
    third = await ack(api, "r1", batch["batch_id"])
    assert third.json() == first.json()
    acked = [d for e, d in await events(redis, prefix, "r1") if e == "acked"]
    assert len(acked) == 1
    nxt = (await lease(api, "r1", 2)).json()
    assert {r["uses"] for r in nxt["rollouts"]} == {1}


async def test_ack_after_lease_expiry_is_409_and_rollouts_return_unused(api, redis, prefix):
    await make_run(api, "r1", max_reuse=2)
    await post(api, "r1", rollout("a"), rollout("b"))
    await patch(api, "r1", lease_timeout_s=0.2)
    resp = await lease(api, "r1", 2)
    leased_by = time.monotonic()
    batch = resp.json()
    # The lease ran out 0.2 s after the broker granted it, which was before `leased_by`.
    await asyncio.sleep(max(0.0, leased_by + 0.3 - time.monotonic()))
    assert_error(await ack(api, "r1", batch["batch_id"]), 409, "LeaseExpired")
    assert_error(await ack(api, "r1", batch["batch_id"]), 409, "LeaseExpired")
    assert_error(await nack(api, "r1", batch["batch_id"]), 409, "LeaseExpired")
    await patch(api, "r1", lease_timeout_s=300)
    again = (await lease(api, "r1", 2)).json()
    assert {r["rollout_id"]: r["uses"] for r in again["rollouts"]} == {"a": 0, "b": 0}
    kinds = [e for e, _ in await events(redis, prefix, "r1")]
    assert kinds.count("expired") == 1
    assert "acked" not in kinds


# No worker sweeps here, so no wake-up announces the expiry: the long poll's own re-check finds it.
@pytest.mark.wake_fallback_s(1.0)
async def test_an_expired_lease_is_released_for_other_trainers(api):
    await make_run(api, "r1", lease_timeout_s=2)
    await post(api, "r1", rollout("a"))
    first = (await lease(api, "r1", 1)).json()
    assert (await lease(api, "r1", 1)).status_code == 204  # while the lease lives
    # A long poll is answered once the lease runs out and the rollout is back.
    second = await lease(api, "r1", 1, wait_s=30)
    assert second.status_code == 200
    assert ids(second.json()) == ["a"]
    assert second.json()["batch_id"] != first["batch_id"]
    assert_error(await ack(api, "r1", first["batch_id"]), 409, "LeaseExpired")
    assert (await ack(api, "r1", second.json()["batch_id"])).status_code == 200


async def test_nack_returns_rollouts_unused(api, redis, prefix):
    await make_run(api, "r1", max_reuse=2)
    await post(api, "r1", rollout("a"), rollout("b"))
    b1 = (await lease(api, "r1", 2)).json()
    await ack(api, "r1", b1["batch_id"])  # uses 1 each
    b2 = (await lease(api, "r1", 2)).json()
    resp = await nack(api, "r1", b2["batch_id"])
    assert resp.status_code == 200
    assert resp.json() == {"returned": 2}
    # a repeated nack is a no-op with the same answer
    assert (await nack(api, "r1", b2["batch_id"])).json() == {"returned": 2}
    b3 = (await lease(api, "r1", 2)).json()
    assert {r["rollout_id"]: r["uses"] for r in b3["rollouts"]} == {"a": 1, "b": 1}
    assert (await retired(redis, prefix, "r1")) == {}
    assert [e for e, _ in await events(redis, prefix, "r1")].count("nacked") == 1


async def test_ack_after_nack_is_409_and_nack_after_ack_is_409(api):
    await make_run(api, "r1", max_reuse=3)
    await post(api, "r1", rollout("a"), rollout("b"))
    b1 = (await lease(api, "r1", 1)).json()
    await nack(api, "r1", b1["batch_id"])
    assert_error(await ack(api, "r1", b1["batch_id"]), 409, "BatchSettled")
    b2 = (await lease(api, "r1", 1)).json()
    assert (await ack(api, "r1", b2["batch_id"])).status_code == 200
    assert_error(await nack(api, "r1", b2["batch_id"]), 409, "BatchSettled")


async def test_unknown_batch_is_404(api):
    await make_run(api, "r1")
    assert_error(await ack(api, "r1", "no-such-batch"), 404, "BatchNotFound")
    assert_error(await nack(api, "r1", "no-such-batch"), 404, "BatchNotFound")


async def test_batch_of_another_run_is_404(api):
    await make_run(api, "r1")
    await make_run(api, "r2")
    await post(api, "r1", rollout("a"))
    batch = (await lease(api, "r1", 1)).json()
    assert_error(await ack(api, "r2", batch["batch_id"]), 404, "BatchNotFound")
    assert (await ack(api, "r1", batch["batch_id"])).status_code == 200


@pytest.mark.one_node  # checked against the batch as any ack reads it: a cluster adds nothing
@pytest.mark.parametrize(
    "body",
    [
        {"logprobs": {"zzz": [-0.5, -0.5, -0.5]}},
        {"kl": {"zzz": 0.1}},
        {"logprobs": {"A": [-0.5, -0.5]}},  # wrong length
        {"logprobs": {"A": [-0.5, 0.5, -0.5]}},  # positive
        {"logprobs": {"A": [-0.5, -0.5, -0.5]}, "kl": {"A": 0.1}},  # both for one rollout
        {"logprobs": {"A": "x"}},
        {"kl": {"A": "high"}},
        {"kl": {"A": -1000.0}},  # a KL is never negative: it would pull kl_mean under kl_flush
        {"kl": {"A": -1e-300}},
        {"kl": {"A": 1e308}},  # above the cap: kl × tokens would overflow the accounting
        {"kl": {"A": FIGURE_CAP * 1.000001}},
        {"step": -1},
        {"unknown": 1},
    ],
    ids=[
        "logprobs_unknown_rollout",
        "kl_unknown_rollout",
        "logprobs_wrong_length",
        "logprobs_positive",
        "logprobs_and_kl",
        "logprobs_not_a_list",
        "kl_not_a_number",
        "kl_negative",
        "kl_barely_negative",
        "kl_1e308",
        "kl_above_the_cap",
        "negative_step",
        "unknown_field",
    ],
)
async def test_invalid_ack_is_422_and_the_batch_stays_live(api, redis, prefix, body):
    batch = await _two_rollouts(api, max_reuse=2)
    resp = await ack(api, "r1", batch["batch_id"], **body)
    assert_error(resp, 422, "ValidationFailed")
    assert [e for e, _ in await events(redis, prefix, "r1")].count("acked") == 0
    assert (await ack(api, "r1", batch["batch_id"], logprobs=NEW)).json()["stats"] == _approx(
        _expected_stats("k3", 0.2)
    )


@pytest.mark.one_node  # refused in the parse, before any call to Redis: a cluster adds nothing
@pytest.mark.parametrize(
    "raw",
    [
        b'{"kl": {"A": NaN}}',
        b'{"kl": {"A": Infinity}}',
        b'{"logprobs": {"A": [-0.5, NaN, -0.5]}}',
        b'{"logprobs": {"A": [-0.5, -Infinity, -0.5]}}',
        b'{"kl": ',
    ],
    ids=["kl_nan", "kl_inf", "logprobs_nan", "logprobs_neg_inf", "invalid_json"],
)
async def test_non_finite_ack_values_are_422(api, raw):
    batch = await _two_rollouts(api, max_reuse=2)
    resp = await api.post(
        f"/v1/runs/r1/batches/{batch['batch_id']}/ack",
        content=raw,
        headers={"content-type": "application/json"},
    )
    assert_error(resp, 422, "ValidationFailed")
    assert (await ack(api, "r1", batch["batch_id"])).status_code == 200


async def _acked_events(redis, prefix: str, run_id: str) -> list[Acked]:
    """The run's acked events through the accounting drain's own decoder: one that raises here
    would be dead-lettered."""
    out = []
    for entry_id, fields in await redis.xrange(keys.events_key(prefix, run_id)):
        event = decode_entry(run_id, entry_id, fields)
        if isinstance(event.body, Acked):
            out.append(event.body)
    return out


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
async def test_ack_statistics_stay_finite_at_the_logprob_bounds(api, redis, prefix, estimator):
    """Behaviour logprob -1000 acked with 0 overflowed exp(): the ack answered null statistics
    and its event could not be applied. Now every figure is a number, capped where it would
    overflow, and the far off-policy rollout retires by kl as its true KL demands."""
    f32_min = float(np.finfo(np.float32).min)
    await make_run(api, "r1", kl_estimator=estimator, max_reuse=5, kl_max=1e4, kl_flush=1e12)
    await post(
        api,
        "r1",
        rollout("far", tokens=1, logprobs=[-1000.0]),
        rollout("edge", tokens=2, logprobs=[f32_min, 0.0]),
        rollout("near", tokens=2, logprobs=[-0.5, -0.5]),
    )
    batch = (await lease(api, "r1", 3)).json()
    lp = {"far": [0.0], "edge": [0.0, f32_min], "near": [-0.5, -0.5]}
    resp = await ack(api, "r1", batch["batch_id"], logprobs=lp)
    assert resp.status_code == 200, resp.text
    stats = resp.json()["stats"]
    assert all(v is not None and math.isfinite(v) for v in stats.values()), stats
    assert stats["kl_max"] <= FIGURE_CAP
    assert stats["clip_fraction"] == pytest.approx(3 / 5)
    [acked] = await _acked_events(redis, prefix, "r1")
    assert acked.stats.kl_mean == stats["kl_mean"]
    assert all(item.kl is not None and math.isfinite(item.kl) for item in acked.items)
    if estimator != "k1":  # k1 of 'far' is -1000, of 'edge' 0
        assert (await retired(redis, prefix, "r1"))["kl"] == ["edge", "far"]


async def test_ready_made_kl_at_the_cap_is_accepted_and_recorded(api, redis, prefix):
    await make_run(api, "r1", max_reuse=3, kl_max=1e12, kl_flush=1e12)
    posted = await post(
        api, "r1", rollout("A", tokens=100_000, logprobs=None), rollout("B", tokens=1)
    )
    assert posted.status_code == 202 and posted.json()["accepted"] == 2, posted.text[:300]
    batch = (await lease(api, "r1", 2)).json()
    resp = await ack(api, "r1", batch["batch_id"], kl={"A": FIGURE_CAP, "B": 0.0})
    assert resp.status_code == 200, resp.text
    stats = resp.json()["stats"]
    assert stats["kl_max"] == FIGURE_CAP
    assert stats["kl_mean"] == pytest.approx(FIGURE_CAP * 100_000 / 100_001)
    assert resp.json()["flushed"] == 0 and resp.json()["retired"] == 1
    [acked] = await _acked_events(redis, prefix, "r1")
    assert acked.sums.kl_sum == FIGURE_CAP * 100_000


async def test_ack_with_unsupported_content_type_is_415(api):
    batch = await _two_rollouts(api)
    resp = await api.post(
        f"/v1/runs/r1/batches/{batch['batch_id']}/ack",
        content=b"{}",
        headers={"content-type": "text/plain"},
    )
    assert_error(resp, 415, "UnsupportedMediaType")


async def test_ack_logprobs_for_a_rollout_ingested_without_them_measure_nothing(api, redis, prefix):
    await make_run(api, "r1", max_reuse=2, kl_max=0.0, kl_flush=0.0)
    await post(api, "r1", rollout("a", tokens=2, logprobs=None))
    b = (await lease(api, "r1", 1)).json()
    assert b["rollouts"][0]["logprobs"] is None
    body = (await ack(api, "r1", b["batch_id"], logprobs={"a": [-3.0, -3.0]})).json()
    assert body == {
        "consumed": 1,
        "retired": 0,
        "flushed": 0,
        "kl_coef": None,
        "stats": {
            "kl_mean": None,
            "kl_max": None,
            "is_ratio_mean": None,
            "clip_fraction": None,
            "ess_fraction": None,
        },
    }
    # no measured KL: gated by staleness and reuse alone, even with kl_max = 0
    again = (await lease(api, "r1", 1)).json()
    assert [(r["rollout_id"], r["uses"]) for r in again["rollouts"]] == [("a", 1)]
    assert (await retired(redis, prefix, "r1")) == {}
