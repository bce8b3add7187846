"""Masked tokens and per-token versions in the ledger: through HTTP and the real drain, the
accounting counts the tokens posted with loss_mask 0, the trained tokens a lease masked for their
own lag, the trained tokens consumed and their token-weighted lag, exactly; the ack's statistics
are those of the trained tokens; and the ledger still equals the live state."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import pytest
from accounting_helpers import drain_all
from rollout_broker_client._wire import parse_accounting

from app.broker.stats import kl_per_token
from tests.api.support import set_policy
from tests.helpers import ack, lease, make_run, post, rollout

OLD = [-0.5, -1.0, -0.25, -9.0, -7.0, -0.5, -0.75, -1.5]


def spanning(rid: str) -> dict[str, Any]:
    """Sampled at version 2, then 3 after a weight update; a tool's output (mask 0) between."""
    return {
        **rollout(rid, 2, tokens=8, logprobs=OLD),
        "loss_mask": [1, 1, 1, 0, 0, 1, 1, 1],
        "versions": [[0, 2], [4, 3]],
    }


@pytest.mark.parametrize("stale_tokens", ["mask", "keep"])
async def test_masked_tokens_and_token_lag_are_counted_exactly(
    api: httpx.AsyncClient, make_ctx, stale_tokens: str
) -> None:
    run = f"tok-{stale_tokens}"
    await make_run(api, run, max_staleness=2, stale_tokens=stale_tokens, kl_max=1e9, kl_flush=1e9)
    await set_policy(api, run, 3)
    tool = {**rollout("y", 3, tokens=4, logprobs=[-0.5] * 4), "loss_mask": [1, 0, 1, 1]}
    said = (await post(api, run, spanning("x"), tool)).json()
    assert said["accepted"] == 2
    await set_policy(api, run, 5)
    # w: sampled at 4, then 5 from its third token on
    w = {**rollout("w", 4, tokens=4, logprobs=[-0.5] * 4), "versions": [[0, 4], [2, 5]]}
    said = (await post(api, run, rollout("z", 5, tokens=5, logprobs=[-0.5] * 5), w)).json()
    assert said["accepted"] == 2
    got = (await lease(api, run, 4, partial=True)).json()
    masks = {r["rollout_id"]: r["loss_mask"] for r in got["rollouts"]}
    new = {"x": [x - 0.125 for x in OLD], "y": [-0.75] * 4, "z": [-0.5] * 5, "w": [-0.5] * 4}
    answer = (await ack(api, run, got["batch_id"], logprobs={r: new[r] for r in masks})).json()

    # Under 'mask' at V = 5 (floor 3) the version-2 tokens of x are masked; under 'keep' its
    # v_old = 2 has lag 3 > 2 and it retired before the lease.
    if stale_tokens == "mask":
        assert masks["x"] == [0, 0, 0, 0, 0, 1, 1, 1]
        # (trained, masked stale, Σ token lag) per rollout: x (3, 3, 3·2), y (3, 0, 3·2),
        # z (5, 0, 0), w (4, 0, 2·1 + 2·0)
        trained, stale, lag_tokens = 3 + 3 + 5 + 4, 3, 6 + 6 + 0 + 2
    else:
        assert "x" not in masks
        trained, stale, lag_tokens = 3 + 5 + 4, 0, 6 + 0 + 2
    consumed = sorted(masks)
    assert masks["w"] is None
    assert masks["y"] == [1, 0, 1, 1]
    assert masks["z"] is None

    # The ack's statistics: over the trained tokens of the leased rollouts only.
    k = np.concatenate(
        [
            kl_per_token(
                np.array(new[rid])[np.array(masks[rid] or [1] * len(new[rid]), bool)]
                - np.array((OLD if rid == "x" else [-0.5] * len(new[rid])), np.float32).astype(
                    np.float64
                )[np.array(masks[rid] or [1] * len(new[rid]), bool)],
                "k3",
            )
            for rid in consumed
        ]
    )
    assert k.size == trained
    assert answer["stats"]["kl_mean"] == pytest.approx(float(k.mean()), rel=1e-6)

    await drain_all(make_ctx())
    acc = (await api.get(f"/v1/runs/{run}/accounting")).json()
    assert acc["pending_events"] == 0 and acc["dead_letters"] == 0
    assert acc["tokens_generated"] == 8 + 4 + 5 + 4
    assert acc["tokens_masked"] == 2 + 1
    assert acc["tokens_masked_stale"] == stale
    assert acc["tokens_consumed"] == trained
    assert acc["lag"]["token_mean"] == pytest.approx(lag_tokens / trained, rel=1e-12)
    assert acc["samples_consumed"] == len(consumed)
    assert acc["kl"]["mean"] == pytest.approx(float(k.mean()), rel=1e-6)
    retired = acc["retired"]
    assert acc["rollouts_received"] == acc["buffered"] + acc["leased"] + sum(retired.values())
    assert acc["live"] == {"buffered": 0, "leased": 0, "rewards": {"awaiting": 0, "leased": 0}}
    assert parse_accounting(acc).matches_live

    per = (await api.get(f"/v1/runs/{run}/accounting/versions")).json()["versions"]
    for key in ("tokens_generated", "tokens_masked", "tokens_masked_stale", "tokens_consumed"):
        assert sum(v[key] for v in per) == acc[key], key
