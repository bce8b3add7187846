"""Rewards and behaviour logprobs are checked by the client before anything is sent, as token ids
are: one bad rollout would have the broker refuse its whole request (SPEC "Rollouts"). A bad one
raises a ValueError or TypeError naming the rollout and the field, and a writer buffers nothing
of the call that held it."""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import numpy as np
import pytest
from rollout_broker_client import AsyncBrokerClient, BrokerClient, Rollout
from rollout_broker_client._wire import Api

from tests.client.recorder import Recorder

BAD: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"reward": math.nan}, ValueError, "reward must be finite"),
    ({"reward": math.inf}, ValueError, "reward must be finite"),
    ({"reward": -math.inf}, ValueError, "reward must be finite"),
    ({"reward": np.float32("nan")}, ValueError, "reward must be finite"),
    ({"reward": 2e12}, ValueError, "reward must be within"),
    ({"reward": "high"}, TypeError, "reward must be a number"),
    ({"reward": [1.0]}, TypeError, "reward must be a number"),
    ({"logprobs": [-0.5, math.nan]}, ValueError, "logprobs must be finite"),
    ({"logprobs": np.array([-0.5, -np.inf], np.float32)}, ValueError, "logprobs must be finite"),
    ({"logprobs": [-0.5, 0.25]}, ValueError, "logprobs must be ≤ 0"),
    ({"logprobs": [-0.5, -1e39]}, ValueError, "out of float32 range"),
    ({"logprobs": [-0.5]}, ValueError, "1 logprobs for 2 response tokens"),
    ({"logprobs": [[-0.5, -0.5]]}, ValueError, "logprobs must be one-dimensional"),
    ({"logprobs": ["a", "b"]}, TypeError, "logprobs must be numbers"),
]


def doc(rid: str = "r-7", **fields: Any) -> dict[str, Any]:
    return {"rollout_id": rid, "policy_version": 0, "response_ids": [1, 2], **fields}


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
@pytest.mark.parametrize(("fields", "error", "match"), BAD)
def test_bad_rewards_and_logprobs_are_refused_naming_the_rollout(
    fmt: str, fields: dict[str, Any], error: type[Exception], match: str
) -> None:
    api = Api(fmt)  # type: ignore[arg-type]
    with pytest.raises(error, match=match) as caught:
        api.post_rollouts("r", [doc("ok"), doc(**fields)])
    assert "rollout 'r-7'" in str(caught.value)
    as_rollout = Rollout("r-7", 0, [1, 2], **fields)
    with pytest.raises(error, match=match):
        api.post_rollouts("r", [as_rollout])


def test_what_the_broker_takes_passes() -> None:
    api = Api("json")
    good = [
        doc("unscored"),  # no reward: it awaits one
        doc("none", reward=None),
        doc("zero", reward=0, logprobs=[0.0, -0.0]),  # a certain token has logprob 0
        doc("numpy", reward=np.float32(-1.5), logprobs=np.array([-1.0, -2.0], np.float64)),
        doc("bound", reward=-1e12, logprobs=[-1e30, -3e38]),
    ]
    body = json.loads(api.post_rollouts("r", good).content or b"")
    sent = {d["rollout_id"]: d for d in body["rollouts"]}
    assert "reward" not in sent["unscored"] and "reward" not in sent["none"]
    assert (sent["zero"]["reward"], sent["numpy"]["reward"]) == (0.0, -1.5)
    assert sent["numpy"]["logprobs"] == [-1.0, -2.0]


def test_a_partial_given_back_is_checked_too() -> None:
    partial = doc(group_id="g", logprobs=[-0.5, 0.5])
    with pytest.raises(ValueError, match="rollout 'r-7': logprobs must be ≤ 0"):
        Api().return_work("r", "lease", ["p"], [partial])


async def test_nothing_is_sent_and_the_writer_keeps_only_good_rollouts(
    wired: AsyncBrokerClient, recorder: Recorder
) -> None:
    await wired.create_run("checks", {"max_reuse": 1})
    with pytest.raises(ValueError, match="rollout 'bad-1': reward must be finite"):
        await wired.post_rollouts(
            "checks", [doc("bad-0", reward=1.0), doc("bad-1", reward=math.nan)]
        )
    w = wired.writer("checks", batch_size=4)
    await w.add(Rollout("a", 0, [1, 2], 1.0, [-0.5, -0.5]))
    with pytest.raises(ValueError, match="rollout 'c': logprobs must be finite"):
        await w.add(Rollout("b", 0, [1, 2], 1.0), Rollout("c", 0, [1, 2], 1.0, [math.nan, -1]))
    assert w.pending == 1 and [r.rollout_id for r in w.unsent if isinstance(r, Rollout)] == ["a"]
    assert not [q for q, _, _ in recorder.exchanges if q.url.path.endswith("/rollouts")]
    await w.add(Rollout("d", 0, [3], None))
    assert (await w.flush()) is not None
    assert (w.accepted, w.pending, w.requests) == (2, 0, 1)  # the bad call never poisons a flush


def test_the_blocking_writer_checks_before_buffering() -> None:
    posted: list[list[str]] = []

    def broker(request: httpx.Request) -> httpx.Response:
        docs = json.loads(request.content)["rollouts"]
        posted.append([d["rollout_id"] for d in docs])
        return httpx.Response(202, json={"accepted": len(docs), "duplicates": 0, "rejected": []})

    http = httpx.Client(transport=httpx.MockTransport(broker), base_url="http://broker")
    with BrokerClient(http=http, format="json") as client:
        with pytest.raises(TypeError, match="rollout 'x': reward must be a number"):
            client.post_rollouts("r", [doc("x", reward="1.0x")])
        with client.writer("r", batch_size=2) as w:
            w.add(doc("a", reward=1.0))
            with pytest.raises(ValueError, match="rollout 'b': logprobs must be ≤ 0"):
                w.add(doc("b", logprobs=[-1.0, 2.0]))
            assert w.pending == 1
            w.add(doc("c"))
    assert posted == [["a", "c"]]
