"""Loss masks and a version per token, through the API on both backends: what a rollout posts
comes back with its lease, each rule on them is a 422 that stores nothing, and the run's
``stale_tokens`` decides which version judges a rollout sampled across versions."""

from __future__ import annotations

import json
from typing import Any

import msgpack
import numpy as np
import pytest

from tests.api.support import assert_error, retired, set_policy
from tests.helpers import ack, lease, make_run, post, rollout

MASK = [1, 1, 1, 0, 0, 0, 1, 1]  # a turn, a tool's output, the next turn
TOOL = [i for i, m in enumerate(MASK) if not m]


def turns(rid: str = "m", version: int = 0, **fields: Any) -> dict[str, Any]:
    r = rollout(rid, version, tokens=len(MASK))
    r["logprobs"] = [-0.25 - 0.125 * i for i in range(len(MASK))]
    return {**r, "loss_mask": MASK, "generator_id": "gen-7", **fields}


async def post_msgpack(api: Any, run_id: str, *rollouts: dict[str, Any]) -> Any:
    return await api.post(
        f"/v1/runs/{run_id}/rollouts",
        content=msgpack.packb({"rollouts": list(rollouts)}, use_bin_type=True),
        headers={"content-type": "application/msgpack"},
    )


async def test_mask_versions_and_generator_come_back_with_the_lease(api):
    await make_run(api, "r1", max_reuse=2)
    await set_policy(api, "r1", 2)
    sent = turns(version=1, versions=[[0, 1], [6, 2]])
    assert (await post(api, "r1", sent)).json()["accepted"] == 1
    got = (await lease(api, "r1", 1)).json()
    [r] = got["rollouts"]
    assert r["loss_mask"] == MASK
    assert r["versions"] == [[0, 1], [6, 2]]
    assert r["generator_id"] == "gen-7"
    assert r["lag"] == 1  # V - v_old
    await api.post(f"/v1/runs/r1/batches/{got['batch_id']}/nack")
    # msgpack answers carry the mask as raw uint8 bytes, like the other arrays
    resp = await api.get(
        "/v1/runs/r1/batch", params={"size": 1}, headers={"accept": "application/msgpack"}
    )
    [m] = msgpack.unpackb(resp.content, raw=False)["rollouts"]
    assert m["loss_mask"] == np.array(MASK, dtype=np.uint8).tobytes()
    assert m["versions"] == [[0, 1], [6, 2]]


async def test_a_msgpack_mask_may_be_raw_bytes(api):
    await make_run(api, "r1")
    sent = turns(loss_mask=np.array(MASK, dtype=np.uint8).tobytes())
    assert (await post_msgpack(api, "r1", sent)).json()["accepted"] == 1
    [r] = (await lease(api, "r1", 1)).json()["rollouts"]
    assert r["loss_mask"] == MASK
    assert r["versions"] == [[0, 0]]


async def test_a_rollout_with_every_token_trained_comes_back_without_a_mask(api):
    await make_run(api, "r1")
    assert (await post(api, "r1", turns(loss_mask=[1] * len(MASK)))).json()["accepted"] == 1
    [r] = (await lease(api, "r1", 1)).json()["rollouts"]
    assert r["loss_mask"] is None


# -- every rule is a 422 for the whole request, which stores nothing ---------------------------

N = len(MASK)
BAD: list[tuple[str, dict[str, Any], str]] = [
    ("mask_short", {"loss_mask": [1] * (N - 1)}, "loss_mask has 7 values for 8"),
    ("mask_long", {"loss_mask": [1] * (N + 1)}, "loss_mask has 9 values for 8"),
    ("mask_two", {"loss_mask": [1] * (N - 1) + [2]}, "0 or 1"),
    ("mask_negative", {"loss_mask": [-1] + [1] * (N - 1)}, "0 or 1"),
    ("mask_all_zero", {"loss_mask": [0] * N}, "masks every token"),
    ("versions_not_from_0", {"versions": [[1, 0]]}, "start at offset 0"),
    ("versions_offsets_repeat", {"versions": [[0, 0], [3, 0], [3, 1]]}, "strictly increasing"),
    ("versions_offsets_back", {"versions": [[0, 0], [5, 1], [3, 2]]}, "strictly increasing"),
    ("versions_decrease", {"versions": [[0, 1], [3, 0]]}, "must not decrease"),
    ("versions_beyond", {"versions": [[0, 0], [N, 1]]}, "beyond the response"),
    ("versions_empty", {"versions": []}, "versions"),
    ("versions_not_pairs", {"versions": [[0, 0, 1]]}, "versions"),
    ("versions_negative", {"versions": [[0, -1]]}, "versions"),
    # the oldest version over trained tokens is 1: the first segment holds masked tokens only
    (
        "policy_version_not_v_old",
        {"loss_mask": [0, 0, 0, 1, 1, 1, 1, 1], "versions": [[0, 0], [3, 1]]},
        "not the oldest version of its trained tokens (1)",
    ),
    ("policy_version_above_v_old", {"versions": [[0, 0], [3, 1]], "policy_version": 1}, "(0)"),
    ("generator_id_space", {"generator_id": "g 1"}, "generator_id"),
]


@pytest.mark.one_node  # refused in the parse, before any call to Redis: a cluster adds nothing
@pytest.mark.parametrize(("fields", "mentions"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
@pytest.mark.parametrize("encoding", ["json", "msgpack"])
async def test_each_rule_is_422_and_stores_nothing(api, fields, mentions, encoding):
    await make_run(api, "r1")
    bad = turns("bad", **fields)
    if encoding == "json":
        resp = await api.post(
            "/v1/runs/r1/rollouts",
            content=json.dumps({"rollouts": [rollout("ok1"), bad]}),
            headers={"content-type": "application/json"},
        )
    else:
        mask = bad.get("loss_mask")
        if isinstance(mask, list) and all(0 <= x <= 255 for x in mask):
            bad["loss_mask"] = np.array(mask, dtype=np.uint8).tobytes()  # raw bytes
        resp = await post_msgpack(api, "r1", rollout("ok1"), bad)
    detail = assert_error(resp, 422, "ValidationFailed")
    assert mentions in detail, detail
    assert (await lease(api, "r1", 1, partial=True)).status_code == 204
    # the valid rollout of the refused request was not stored either
    assert (await post(api, "r1", rollout("ok1"))).json() == {
        "accepted": 1,
        "duplicates": 0,
        "rejected": [],
    }


# -- staleness: v_old under 'keep', v_new and masked stale tokens under 'mask' -------------------

# Sampled from version 2 and, after a weight update, from version 3; the tool's output (mask 0)
# sits across the update.
SPANNING = {
    "policy_version": 2,
    "loss_mask": [1, 1, 1, 0, 0, 1, 1, 1],
    "versions": [[0, 2], [4, 3]],
}


async def test_keep_retires_a_rollout_by_its_oldest_version(api, redis, prefix):
    await make_run(api, "r1", max_staleness=1, stale_tokens="keep")
    await set_policy(api, "r1", 3)
    assert (await post(api, "r1", turns("x", **SPANNING))).json()["accepted"] == 1
    await set_policy(api, "r1", 4)  # lag by v_old: 2 > max_staleness
    assert (await retired(redis, prefix, "r1")) == {"stale": ["x"]}
    assert (await lease(api, "r1", 1, partial=True)).status_code == 204


async def test_mask_keeps_it_while_its_newest_version_is_fresh_and_masks_the_stale_tokens(
    api, redis, prefix
):
    await make_run(api, "r1", max_staleness=1, stale_tokens="mask", max_reuse=2)
    await set_policy(api, "r1", 3)
    assert (await post(api, "r1", turns("x", **SPANNING))).json()["accepted"] == 1
    await set_policy(api, "r1", 4)  # v_new = 3: lag 1, still fresh
    got = (await lease(api, "r1", 1)).json()
    [r] = got["rollouts"]
    # exactly the tokens of version 2 (lag 2 > 1) are masked, besides the tool's output
    assert r["loss_mask"] == [0, 0, 0, 0, 0, 1, 1, 1]
    assert r["versions"] == [[0, 2], [4, 3]]
    assert r["lag"] == 2  # the SPEC's lag is by v_old
    assert (await ack(api, "r1", got["batch_id"])).status_code == 200
    assert (await retired(redis, prefix, "r1")) == {}
    await set_policy(api, "r1", 5)  # v_new = 3: lag 2, now stale
    assert (await retired(redis, prefix, "r1")) == {"stale": ["x"]}


async def test_mask_at_the_version_it_was_sampled_masks_nothing_more(api):
    await make_run(api, "r1", max_staleness=1, stale_tokens="mask")
    await set_policy(api, "r1", 3)
    assert (await post(api, "r1", turns("x", **SPANNING))).json()["accepted"] == 1
    [r] = (await lease(api, "r1", 1)).json()["rollouts"]
    assert r["loss_mask"] == SPANNING["loss_mask"]


@pytest.mark.parametrize("stale_tokens", ["keep", "mask"])
async def test_future_version_is_judged_on_the_newest_version(api, stale_tokens):
    await make_run(api, "r1", max_staleness=1, stale_tokens=stale_tokens)
    await set_policy(api, "r1", 2)  # v_old = 2 is the run's, v_new = 3 is ahead of it
    said = (await post(api, "r1", turns("x", **SPANNING))).json()
    assert said == {
        "accepted": 0,
        "duplicates": 0,
        "rejected": [{"rollout_id": "x", "reason": "future_version"}],
    }


@pytest.mark.parametrize(("stale_tokens", "verdict"), [("keep", "stale"), ("mask", None)])
async def test_ingest_judges_stale_on_the_governing_version(api, stale_tokens, verdict):
    await make_run(api, "r1", max_staleness=1, stale_tokens=stale_tokens)
    await set_policy(api, "r1", 4)  # v_old = 2: lag 2; v_new = 3: lag 1
    said = (await post(api, "r1", turns("x", **SPANNING))).json()
    if verdict is None:
        assert said["accepted"] == 1
    else:
        assert said["rejected"] == [{"rollout_id": "x", "reason": verdict}]
