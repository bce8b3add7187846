"""kl_flush_window: a flush needs that many acked batches in a row with a mean KL above kl_flush.

Every test has one old rollout (version 0) a flush would retire and one fresh rollout (version 1)
that the trainer leases and acks again and again (max_reuse is high), each ack with a chosen KL.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from app import keys
from tests.api.support import assert_error, ids, patch, retired, set_policy
from tests.helpers import ack, lease, make_run, post, rollout

ABOVE, AT = 0.5, 0.1  # kl_flush is 0.1: a mean of 0.1 is not above it


async def _old_and_fresh(api: httpx.AsyncClient, **config: Any) -> None:
    base = {"max_staleness": 5, "max_reuse": 100, "kl_max": 10, "kl_flush": AT}
    await make_run(api, "r1", **{**base, **config})
    await post(api, "r1", rollout("old", 0))
    await set_policy(api, "r1", 1)
    await post(api, "r1", rollout("fresh", 1))


async def _train(api: httpx.AsyncClient, kl: float | None, rid: str = "fresh") -> int:
    """Lease the fresh rollout (freshest first), or the one named, and ack it with this KL
    (None: nothing measured); the ack's `flushed`."""
    b = (await lease(api, "r1", 1)).json()
    assert ids(b) == [rid]
    body = {} if kl is None else {"kl": {rid: kl}}
    resp = await ack(api, "r1", b["batch_id"], **body)
    assert resp.status_code == 200, resp.text
    flushed: int = resp.json()["flushed"]
    return flushed


async def _flushes(api: httpx.AsyncClient, kls: list[float | None]) -> list[int]:
    return [await _train(api, kl) for kl in kls]


async def test_a_window_of_three_flushes_at_the_third_batch_in_a_row(api, redis, prefix):
    await _old_and_fresh(api, kl_flush_window=3)
    assert await _flushes(api, [ABOVE, ABOVE]) == [0, 0]
    assert await retired(redis, prefix, "r1") == {}
    assert await _train(api, ABOVE) == 1
    # The flush's effects are a single batch's: the old one retires `kl_flush`, the floor is at
    # 1, so a rollout of version 0 posted now is stale.
    assert await retired(redis, prefix, "r1") == {"kl_flush": ["old"]}
    resp = await post(api, "r1", rollout("late", 0), rollout("fresh-2", 1))
    assert resp.json()["rejected"] == [{"rollout_id": "late", "reason": "stale"}], resp.text


async def test_a_batch_at_kl_flush_ends_the_streak(api, redis, prefix):
    await _old_and_fresh(api, kl_flush_window=2)
    assert await _flushes(api, [ABOVE, AT, ABOVE]) == [0, 0, 0]
    assert await retired(redis, prefix, "r1") == {}
    assert await _train(api, ABOVE) == 1


async def test_an_ack_with_nothing_measured_leaves_the_streak(api, redis, prefix):
    await _old_and_fresh(api, kl_flush_window=2)
    assert await _flushes(api, [ABOVE, None, ABOVE]) == [0, 0, 1]


async def test_a_window_of_one_flushes_at_every_batch_above(api, redis, prefix):
    await _old_and_fresh(api)  # the default window
    assert await _train(api, ABOVE) == 1
    assert await retired(redis, prefix, "r1") == {"kl_flush": ["old"]}


async def test_after_a_flush_the_next_needs_a_whole_window(api, redis, prefix):
    await _old_and_fresh(api, kl_flush_window=2)
    assert await _flushes(api, [ABOVE, ABOVE]) == [0, 1]
    await set_policy(api, "r1", 2)
    await post(api, "r1", rollout("old-2", 1))  # at the floor: kept
    await set_policy(api, "r1", 3)
    # old-2 goes first at hand-out: of version 1, as the fresh one, with fewer uses.
    assert await _train(api, ABOVE, "old-2") == 0
    # Acked at version 3: everything buffered of version 1 goes, the one made ready by this
    # very ack too.
    assert await _train(api, ABOVE, "old-2") == 2
    assert await retired(redis, prefix, "r1") == {"kl_flush": ["fresh", "old", "old-2"]}


async def test_a_rewind_starts_the_streak_afresh(api, redis, prefix):
    await _old_and_fresh(api, kl_flush_window=2)
    await set_policy(api, "r1", 2)
    assert await _train(api, ABOVE) == 0  # at version 2: a rewind to 1 undoes it
    resp = await api.post("/v1/runs/r1/policy", json={"version": 1, "rewind": True})
    assert resp.status_code == 200, resp.text
    assert await _flushes(api, [ABOVE, ABOVE]) == [0, 1]


async def test_a_patch_of_the_window_or_kl_flush_starts_the_streak_afresh(api, redis, prefix):
    await _old_and_fresh(api, kl_flush_window=2)
    assert await _train(api, ABOVE) == 0
    await patch(api, "r1", kl_flush_window=3)
    assert await _flushes(api, [ABOVE, ABOVE]) == [0, 0]
    await patch(api, "r1", kl_flush=0.2)
    assert await _flushes(api, [ABOVE, ABOVE, ABOVE]) == [0, 0, 1]


async def test_a_patch_of_another_field_keeps_the_streak(api, redis, prefix):
    await _old_and_fresh(api, kl_flush_window=2)
    assert await _train(api, ABOVE) == 0
    await patch(api, "r1", kl_max=20, kl_flush_window=2)  # the window set to what it is
    assert await _train(api, ABOVE) == 1


@pytest.mark.parametrize("window", [0, -1, 1.5, "2", None, 1_000_001])
async def test_a_bad_window_is_422_and_changes_nothing(api, window):
    resp = await api.post("/v1/runs", json={"run_id": "r1", "config": {"kl_flush_window": window}})
    assert_error(resp, 422, "ValidationFailed")
    assert (await api.get("/v1/runs/r1")).status_code == 404
    await make_run(api, "r1", kl_flush_window=4)
    resp = await api.patch("/v1/runs/r1/config", json={"kl_flush_window": window})
    assert_error(resp, 422, "ValidationFailed")
    assert (await api.get("/v1/runs/r1")).json()["config"]["kl_flush_window"] == 4


async def test_a_run_created_before_the_window_flushes_at_one_batch(api, redis, prefix):
    await _old_and_fresh(api)
    run = keys.run_key(prefix, "r1")
    cfg = json.loads(await redis.hget(run, "cfg"))
    del cfg["kl_flush_window"]  # as a run created before the field stored its config
    await redis.hset(run, "cfg", json.dumps(cfg, sort_keys=True))
    assert await _train(api, ABOVE) == 1
