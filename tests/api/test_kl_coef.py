"""The adaptive KL penalty: β follows the SPEC's formula after every measured ack, and lease and
ack answers carry it."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.api.support import assert_error, patch
from tests.helpers import ack, lease, make_run, post, rollout

IDS = [f"r{i}" for i in range(6)]


def _next_beta(beta: float, kl_mean: float, n: int, target: float, horizon: int) -> float:
    """The SPEC's step, in float64: e = clip(kl_mean / kl_target − 1, −0.2, 0.2),
    β ← β · (1 + e · n / kl_horizon)."""
    e = min(max(kl_mean / target - 1, -0.2), 0.2)
    return beta * (1 + e * n / horizon)


async def _run(api: httpx.AsyncClient, **config: Any) -> None:
    base = {"max_reuse": 1000, "kl_max": 1e6, "kl_flush": 1e6, "max_staleness": 5}
    await make_run(api, "r1", **{**base, **config})
    await post(api, "r1", *(rollout(rid, 0) for rid in IDS))


async def _train(api: httpx.AsyncClient, n: int, kl: float | None) -> tuple[Any, dict[str, Any]]:
    """Lease n rollouts and ack them all with this KL (None: nothing measured): the lease's
    kl_coef and the ack's answer."""
    b = (await lease(api, "r1", n)).json()
    body = {} if kl is None else {"kl": {r["rollout_id"]: kl for r in b["rollouts"]}}
    resp = await ack(api, "r1", b["batch_id"], **body)
    assert resp.status_code == 200, resp.text
    answer: dict[str, Any] = resp.json()
    answer["batch_id"] = b["batch_id"]
    return b["kl_coef"], answer


# (batch size, KL): below the target and clipped, at it, just above, far above and clipped,
# nothing measured, just below.
STEPS = [(1, 0.0), (2, 0.05), (3, 0.0525), (2, 1.0), (3, None), (1, 0.0375), (3, 0.0475)]


async def test_beta_follows_the_formula_over_a_sequence_of_acks(api):
    target, horizon = 0.05, 7  # not the default target: a step that ignored it fails
    await _run(api, kl_coef=0.1, kl_target=target, kl_horizon=horizon)
    beta = 0.1
    moved = set()
    for n, kl in STEPS:
        at_lease, answer = await _train(api, n, kl)
        assert at_lease == beta
        if kl is not None:
            new = _next_beta(beta, answer["stats"]["kl_mean"], n, target, horizon)
            moved.add(new != beta)
            beta = new
        assert answer["kl_coef"] == beta  # exactly: the broker's double is the recompute's
    assert moved == {True, False}  # some steps moved β, the one at the target did not
    assert beta != pytest.approx(0.1, rel=1e-3)


async def test_a_repeated_ack_answers_the_beta_of_its_first(api):
    await _run(api, kl_coef=0.1, kl_horizon=2)
    _, first = await _train(api, 2, 1.0)
    await _train(api, 2, 1.0)
    again = (await ack(api, "r1", first["batch_id"], kl={"r0": 1.0})).json()
    assert again["kl_coef"] == first["kl_coef"] == 0.1 * (1 + 0.2 * 2 / 2)


async def test_off_by_default_lease_and_ack_carry_null(api):
    await _run(api)
    at_lease, answer = await _train(api, 2, 1.0)
    assert at_lease is None and answer["kl_coef"] is None


async def test_a_patch_of_kl_coef_sets_beta_to_it_and_others_keep_it(api):
    await _run(api, kl_coef=0.1, kl_horizon=1)
    _, answer = await _train(api, 1, 1.0)
    moved = answer["kl_coef"]
    assert moved == 0.1 * 1.2
    await patch(api, "r1", kl_target=0.03, kl_horizon=10)  # the steps change, β stays
    assert (await _train(api, 1, None))[0] == moved
    await patch(api, "r1", kl_coef=0.5)
    assert (await _train(api, 1, None))[0] == 0.5
    await patch(api, "r1", kl_coef=None)  # off
    at_lease, answer = await _train(api, 1, 1.0)
    assert at_lease is None and answer["kl_coef"] is None
    await patch(api, "r1", kl_coef=0.5)  # on again: from kl_coef, not from the β of before
    assert (await _train(api, 1, 0.02))[0] == 0.5


@pytest.mark.parametrize(
    "config",
    [{"kl_coef": -0.1}, {"kl_target": 0}, {"kl_horizon": 0}, {"kl_horizon": 1.5}],
)
async def test_a_bad_controller_setting_is_422_and_changes_nothing(api, config):
    resp = await api.post("/v1/runs", json={"run_id": "r1", "config": config})
    assert_error(resp, 422, "ValidationFailed")
    await make_run(api, "r1", kl_coef=0.3)
    resp = await api.patch("/v1/runs/r1/config", json=config)
    assert_error(resp, 422, "ValidationFailed")
    got = (await api.get("/v1/runs/r1")).json()["config"]
    assert (got["kl_coef"], got["kl_target"], got["kl_horizon"]) == (0.3, 0.02, 10000)
