"""The client posts loss masks, per-token versions and generator ids (numpy in) and hands
leased rollouts' masks and per-token versions back as arrays (numpy out)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from rollout_broker_client import BrokerClient, Rollout, SyncASGITransport

from app.main import create_app
from app.settings import Settings


def test_masks_and_versions_go_out_and_come_back_as_arrays(settings: Settings) -> None:
    with (
        SyncASGITransport(create_app(settings)) as transport,
        httpx.Client(transport=transport, base_url="http://broker") as http,
    ):
        broker = BrokerClient(http=http)
        broker.create_run("turns", {"max_staleness": 1, "stale_tokens": "mask"})
        broker.set_policy("turns", 1)
        old = np.array([-0.5, -0.25, -3.0, -4.0, -0.75, -1.0], np.float32)
        mask = np.array([1, 1, 0, 0, 1, 1], np.uint8)
        sent = Rollout(
            "a", 0, np.arange(6), 1.0, old, loss_mask=mask, versions=[(0, 0), (4, 1)],
            generator_id="gen-1",
        )  # fmt: skip
        assert broker.post_rollouts("turns", [sent]).accepted == 1
        broker.set_policy("turns", 2)  # the version-0 tokens are now too stale to train on
        with broker.lease("turns", size=1) as batch:
            assert batch
            [r] = batch.rollouts
            np.testing.assert_array_equal(r.mask, [0, 0, 0, 0, 1, 1])
            np.testing.assert_array_equal(r.token_versions, [0, 0, 0, 0, 1, 1])
            assert r.versions == ((0, 0), (4, 1)) and r.generator_id == "gen-1"
            batch.ack_with({"a": old - np.float32(0.5)})
        assert batch.ack_result is not None
        # k3 of log_r = -0.5 on the two trained tokens alone
        assert batch.ack_result.stats.kl_mean == pytest.approx(np.expm1(-0.5) + 0.5, rel=1e-6)
