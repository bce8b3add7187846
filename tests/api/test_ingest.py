"""Ingest: JSON and msgpack bodies, duplicates, per-rollout rejections, whole-request errors."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import msgpack
import numpy as np
import pytest

from tests.api.support import (
    assert_error,
    events,
    ids,
    patch,
    post_msgpack,
    post_raw,
    retired,
    set_policy,
    strict_json,
)
from tests.helpers import ack, lease, make_run, post, rollout

# Token ids at every packing width, and float32 logprobs that are not exact in decimal.
TOKENS = [0, 7, 65535, 65536, 16_777_215, 16_777_216, 2**31 - 1]
PROMPT = [1, 300, 70_000, 20_000_000]
LOGPROBS = np.array([-0.1, -1e-7, -3.3, -0.0, -20.25, -1e-30, -7.0], dtype=np.float32)


def _ok_rollout(rid: str = "ok1") -> dict[str, Any]:
    return rollout(rid)


async def _assert_nothing_stored(api, run_id: str = "r1") -> None:
    """Nothing is buffered, and the valid rollout of the refused request is still unknown."""
    assert (await lease(api, run_id, 1, partial=True)).status_code == 204
    resp = await post(api, run_id, _ok_rollout())
    assert resp.status_code == 202, resp.text
    assert resp.json() == {"accepted": 1, "duplicates": 0, "rejected": []}


# -- accepted bodies ----------------------------------------------------------------------------


async def test_json_rollout_round_trips_through_a_lease(api):
    await make_run(api, "r1")
    sent = {
        "rollout_id": "a",
        "group_id": "prompt-7",
        "policy_version": 0,
        "prompt_ids": PROMPT,
        "response_ids": TOKENS,
        "logprobs": [float(x) for x in LOGPROBS],
        "reward": -0.125,
        "finish_reason": "length",
        "metadata": {"task": "gsm8k", "n": [1, 2], "nested": {"ok": True, "x": None}},
    }
    resp = await post(api, "r1", sent)
    assert resp.status_code == 202, resp.text
    assert resp.json() == {"accepted": 1, "duplicates": 0, "rejected": []}
    batch = (await lease(api, "r1", 1)).json()
    [got] = batch["rollouts"]
    lp = got.pop("logprobs")
    assert np.array_equal(np.array(lp, dtype=np.float32), LOGPROBS)
    expected = {k: v for k, v in sent.items() if k != "logprobs"}
    plain = {"loss_mask": None, "versions": [[0, 0]], "generator_id": None}
    assert got == {**expected, **plain, "uses": 0, "lag": 0}


async def test_optional_fields_may_be_absent(api):
    await make_run(api, "r1")
    minimal = {"rollout_id": "m", "policy_version": 0, "response_ids": [5], "reward": 0}
    assert (await post(api, "r1", minimal)).json()["accepted"] == 1
    [got] = (await lease(api, "r1", 1)).json()["rollouts"]
    assert got == {
        "rollout_id": "m",
        "group_id": None,
        "policy_version": 0,
        "prompt_ids": None,
        "response_ids": [5],
        "logprobs": None,
        "loss_mask": None,
        "versions": [[0, 0]],
        "reward": 0.0,
        "generator_id": None,
        "finish_reason": None,
        "metadata": None,
        "uses": 0,
        "lag": 0,
    }


async def test_msgpack_with_raw_arrays_round_trips_in_json_and_msgpack(api):
    await make_run(api, "r1", max_reuse=2)
    sent = {
        "rollout_id": "a",
        "policy_version": 0,
        "prompt_ids": np.array(PROMPT, dtype="<i4").tobytes(),
        "response_ids": np.array(TOKENS, dtype="<i4").tobytes(),
        "logprobs": LOGPROBS.astype("<f4").tobytes(),
        "reward": 0.75,
        "finish_reason": "stop",
        "metadata": {"k": "v"},
    }
    resp = await post_msgpack(api, "r1", [sent])
    assert resp.status_code == 202, resp.text
    assert resp.json() == {"accepted": 1, "duplicates": 0, "rejected": []}

    # JSON view: plain numbers, identical values
    batch = (await lease(api, "r1", 1)).json()
    [got] = batch["rollouts"]
    assert got["response_ids"] == TOKENS
    assert got["prompt_ids"] == PROMPT
    assert np.array_equal(np.array(got["logprobs"], dtype=np.float32), LOGPROBS)
    assert got["reward"] == 0.75
    assert got["metadata"] == {"k": "v"}
    assert (await ack(api, "r1", batch["batch_id"])).status_code == 200

    # msgpack view: raw little-endian bytes that decode to the same numbers
    resp = await api.get(
        "/v1/runs/r1/batch", params={"size": 1}, headers={"accept": "application/msgpack"}
    )
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("application/msgpack")
    doc = msgpack.unpackb(resp.content, raw=False)
    assert set(doc) == {
        "batch_id",
        "policy_version",
        "lease_expires_at",
        "kl_coef",
        "rollouts",
    }
    [m] = doc["rollouts"]
    assert isinstance(m["response_ids"], bytes)
    assert isinstance(m["prompt_ids"], bytes)
    assert isinstance(m["logprobs"], bytes)
    assert np.frombuffer(m["response_ids"], dtype="<i4").tolist() == TOKENS
    assert np.frombuffer(m["prompt_ids"], dtype="<i4").tolist() == PROMPT
    assert np.frombuffer(m["logprobs"], dtype="<f4").tobytes() == LOGPROBS.tobytes()
    assert (m["rollout_id"], m["reward"], m["uses"], m["lag"]) == ("a", 0.75, 1, 0)


async def test_msgpack_with_plain_lists_is_accepted(api):
    await make_run(api, "r1")
    sent = rollout("a", tokens=3, logprobs=[-0.5, -0.25, -1.0])
    assert (await post_msgpack(api, "r1", [sent])).json()["accepted"] == 1
    [got] = (await lease(api, "r1", 1)).json()["rollouts"]
    assert got["response_ids"] == [10, 11, 12]
    assert got["logprobs"] == [-0.5, -0.25, -1.0]


async def test_msgpack_content_type_variants(api):
    await make_run(api, "r1")
    body = msgpack.packb({"rollouts": [rollout("a")]}, use_bin_type=True)
    for i, ctype in enumerate(
        ["application/x-msgpack", "application/vnd.msgpack", "application/msgpack; charset=binary"]
    ):
        body = msgpack.packb({"rollouts": [rollout(f"a{i}")]}, use_bin_type=True)
        resp = await post_raw(api, "r1", body, ctype)
        assert resp.status_code == 202, (ctype, resp.text)
        assert resp.json()["accepted"] == 1


async def test_empty_rollout_list_is_accepted_as_nothing(api):
    await make_run(api, "r1")
    resp = await api.post("/v1/runs/r1/rollouts", json={"rollouts": []})
    assert resp.status_code == 202
    assert resp.json() == {"accepted": 0, "duplicates": 0, "rejected": []}


# -- idempotency and per-rollout rejections -----------------------------------------------------


async def test_duplicates_are_counted_and_change_nothing(api, redis, prefix):
    await make_run(api, "r1")
    resp = await post(api, "r1", rollout("a", reward=1.0), rollout("a", reward=2.0), rollout("b"))
    assert resp.json() == {"accepted": 2, "duplicates": 1, "rejected": []}
    resp = await post(api, "r1", rollout("a", reward=3.0), rollout("b"), rollout("c"))
    assert resp.json() == {"accepted": 1, "duplicates": 2, "rejected": []}
    batch = (await lease(api, "r1", 10, partial=True)).json()
    assert sorted(ids(batch)) == ["a", "b", "c"]
    assert {r["rollout_id"]: r["reward"] for r in batch["rollouts"]}["a"] == 1.0
    # A consumed (and retired) rollout is still known: a repeat is a duplicate.
    assert (await ack(api, "r1", batch["batch_id"])).json()["retired"] == 3
    resp = await post(api, "r1", rollout("a"))
    assert resp.json() == {"accepted": 0, "duplicates": 1, "rejected": []}
    assert (await lease(api, "r1", 1, partial=True)).status_code == 204
    dups = [d for e, d in await events(redis, prefix, "r1") if e == "duplicate"]
    assert [d["n"] for d in dups] == [1, 2, 1]


async def test_rejections_stale_and_future_version(api, redis, prefix):
    await make_run(api, "r1", max_staleness=1)
    await set_policy(api, "r1", 3)
    resp = await post(
        api,
        "r1",
        rollout("v1", 1),  # lag 2 > 1
        rollout("v2", 2),  # lag 1
        rollout("v3", 3),
        rollout("v4", 4),  # above the run's version
        rollout("v0", 0),
    )
    assert resp.status_code == 202, resp.text
    assert resp.json() == {
        "accepted": 2,
        "duplicates": 0,
        "rejected": [
            {"rollout_id": "v1", "reason": "stale"},
            {"rollout_id": "v4", "reason": "future_version"},
            {"rollout_id": "v0", "reason": "stale"},
        ],
    }
    rejected = [d for e, d in await events(redis, prefix, "r1") if e == "rejected"]
    assert [it[:3] for d in rejected for it in d["items"]] == [
        ["v1", "stale", 1],
        ["v4", "future_version", 4],
        ["v0", "stale", 0],
    ]
    # Rejected ids are known ids: a repeat (even one that would now be fine) is a duplicate.
    await set_policy(api, "r1", 4)
    resp = await post(api, "r1", rollout("v4", 4))
    assert resp.json() == {"accepted": 0, "duplicates": 1, "rejected": []}
    batch = (await lease(api, "r1", 10, partial=True)).json()
    assert sorted(ids(batch)) == ["v3"]  # v2 went stale at version 4


# -- malformed bodies ---------------------------------------------------------------------------

OK = json.dumps(_ok_rollout()).encode()


def _raw(bad_rollout: str) -> bytes:
    """A JSON body with the valid rollout `ok1` followed by a hand-written bad one."""
    return b'{"rollouts": [' + OK + b", " + bad_rollout.encode() + b"]}"


def _bad(**fields: Any) -> bytes:
    r: dict[str, Any] = {**rollout("bad"), **fields}
    r = {k: v for k, v in r.items() if v is not _DROP}
    return json.dumps({"rollouts": [_ok_rollout(), r]}).encode()


_DROP = object()
_BASE = '"rollout_id": "bad", "policy_version": 0, "response_ids": [1, 2]'

MALFORMED_JSON = [
    ("reward_string", _bad(reward="high"), "reward"),
    ("response_ids_string", _bad(response_ids="abc"), "response_ids"),
    ("response_ids_missing", _bad(response_ids=_DROP), "response_ids"),
    ("response_ids_floats", _bad(response_ids=[1.5, 2.5]), "response_ids"),
    ("policy_version_negative", _bad(policy_version=-1), "policy_version"),
    ("policy_version_missing", _bad(policy_version=_DROP), "policy_version"),
    ("rollout_id_int", _bad(rollout_id=5), "rollout_id"),
    ("rollout_id_space", _bad(rollout_id="a b"), "rollout_id"),
    ("rollout_id_tab", _bad(rollout_id="a\tb"), "rollout_id"),
    ("rollout_id_newline", _bad(rollout_id="a\n"), "rollout_id"),
    ("rollout_id_empty", _bad(rollout_id=""), "rollout_id"),
    ("rollout_id_too_long", _bad(rollout_id="x" * 257), "rollout_id"),
    ("group_id_space", _bad(group_id="g 1"), "group_id"),
    ("finish_reason_unknown", _bad(finish_reason="eos"), "finish_reason"),
    ("metadata_list", _bad(metadata=[1, 2]), "metadata"),
    ("logprobs_short", _bad(logprobs=[-0.5] * 3), "logprobs"),
    ("logprobs_long", _bad(logprobs=[-0.5] * 5), "logprobs"),
    ("logprobs_positive", _bad(logprobs=[-0.5, 0.1, -0.5, -0.5]), "logprobs"),
    ("logprobs_string", _bad(logprobs="x"), "logprobs"),
    ("empty_response", _bad(response_ids=[], logprobs=[]), "response_ids"),
    ("token_id_2_31", _bad(response_ids=[1, 2, 3, 2**31]), "response_ids"),
    ("token_id_2_64", _bad(response_ids=[1, 2, 3, 2**64]), "response_ids"),
    ("token_id_negative", _bad(response_ids=[1, 2, 3, -1]), "response_ids"),
    ("prompt_id_out_of_range", _bad(prompt_ids=[2**31]), "prompt_ids"),
    ("unknown_rollout_field", _bad(weights=[1]), "weights"),
    ("reward_nan", _raw("{" + _BASE + ', "reward": NaN}'), "reward"),
    ("reward_infinity", _raw("{" + _BASE + ', "reward": Infinity}'), "reward"),
    ("reward_neg_infinity", _raw("{" + _BASE + ', "reward": -Infinity}'), "reward"),
    ("logprobs_nan", _raw("{" + _BASE + ', "reward": 1, "logprobs": [-0.5, NaN]}'), "logprobs"),
    ("logprobs_inf", _raw("{" + _BASE + ', "reward": 1, "logprobs": [Infinity, -1]}'), "logprobs"),
    (
        "logprobs_neg_inf",
        _raw("{" + _BASE + ', "reward": 1, "logprobs": [-Infinity, -1]}'),
        "logprobs",
    ),
    ("logprobs_below_float32", _bad(response_ids=[1], logprobs=[-1e300]), "logprobs"),
    ("reward_overflow", _raw("{" + _BASE + ', "reward": 1e400}'), "reward"),
    # Beyond ±1e12: the ledger's sums of rewards must stay finite (two of 1e308 would not).
    ("reward_beyond_bound", _raw("{" + _BASE + ', "reward": 1.000001e12}'), "reward"),
    ("reward_huge", _raw("{" + _BASE + ', "reward": -1e308}'), "reward"),
    (
        "logprobs_overflow",
        _raw("{" + _BASE + ', "reward": 1, "logprobs": [-1e400, -1]}'),
        "logprobs",
    ),
    ("rollout_id_brace", _bad(rollout_id="a{b}"), "rollout_id"),
    ("unknown_top_level_field", json.dumps({"rollouts": [_ok_rollout()], "x": 1}).encode(), "x"),
    ("rollouts_not_a_list", json.dumps({"rollouts": {"a": 1}}).encode(), "rollouts"),
    ("rollouts_missing", b"{}", "rollouts"),
    ("empty_body", b"", "rollouts"),
    ("body_is_a_list", json.dumps([_ok_rollout()]).encode(), "body"),
    ("invalid_json_syntax", b'{"rollouts": [' + OK, "JSON"),
    ("invalid_json_trailing_comma", b'{"rollouts": [' + OK + b",]}", "JSON"),
    ("invalid_utf8", b'{"rollouts": [{"rollout_id": "\xff\xfe"}]}', "body"),
]


def _echoes_non_finite(detail: str) -> bool:
    return any(s in detail for s in ("NaN,", "NaN]", "NaN}", "Infinity,", "Infinity]", "Infinity}"))


@pytest.mark.one_node  # refused in the parse, before any call to Redis: a cluster adds nothing
@pytest.mark.parametrize(
    ("body", "mentions"), [c[1:] for c in MALFORMED_JSON], ids=[c[0] for c in MALFORMED_JSON]
)
async def test_malformed_json_is_422_for_the_whole_request(api, body, mentions):
    await make_run(api, "r1")
    resp = await post_raw(api, "r1", body)
    detail = assert_error(resp, 422, "ValidationFailed")
    assert mentions in detail, detail
    assert not _echoes_non_finite(detail), detail
    await _assert_nothing_stored(api)


def _mp(*rollouts: dict[str, Any]) -> bytes:
    return msgpack.packb({"rollouts": [_ok_rollout(), *rollouts]}, use_bin_type=True)


def _mp_bad(**fields: Any) -> bytes:
    return _mp({**rollout("bad"), **fields})


MALFORMED_MSGPACK = [
    ("not_msgpack", b"\xc1\xc1", "msgpack"),
    ("truncated", _mp()[:-3], "msgpack"),
    ("trailing_bytes", _mp() + b"\x01", "msgpack"),
    ("top_level_list", msgpack.packb([_ok_rollout()]), "body"),
    ("non_string_map_key", msgpack.packb({1: [_ok_rollout()]}), "msgpack"),
    ("response_bytes_not_int32", _mp_bad(response_ids=b"\x01\x00\x00", logprobs=None), "int32"),
    (
        "response_bytes_negative",
        _mp_bad(response_ids=np.array([1, -5], "<i4").tobytes(), logprobs=None),
        "negative",
    ),
    ("response_bytes_empty", _mp_bad(response_ids=b"", logprobs=None), "empty"),
    ("logprob_bytes_not_float32", _mp_bad(logprobs=b"\x00" * 15), "float32"),
    (
        "logprob_bytes_nan",
        _mp_bad(logprobs=np.array([-1, np.nan, -1, -1], "<f4").tobytes()),
        "finite",
    ),
    (
        "logprob_bytes_inf",
        _mp_bad(logprobs=np.array([-1, -np.inf, -1, -1], "<f4").tobytes()),
        "finite",
    ),
    (
        "logprob_bytes_positive",
        _mp_bad(logprobs=np.array([-1, 0.5, -1, -1], "<f4").tobytes()),
        "logprobs",
    ),
    (
        "logprob_bytes_wrong_count",
        _mp_bad(logprobs=np.array([-1, -1], "<f4").tobytes()),
        "logprobs",
    ),
    ("reward_nan", _mp_bad(reward=float("nan")), "reward"),
    ("reward_beyond_bound", _mp_bad(reward=-1.000001e12), "reward"),
    ("reward_huge", _mp_bad(reward=1e308), "reward"),
    ("logprobs_list_nan", _mp_bad(logprobs=[-1.0, float("nan"), -1.0, -1.0]), "finite"),
    ("reward_bytes", _mp_bad(reward=b"\x00\x00\x80\x3f"), "reward"),
    ("unknown_field", _mp_bad(extra=1), "extra"),
]


@pytest.mark.one_node  # refused in the parse, before any call to Redis: a cluster adds nothing
@pytest.mark.parametrize(
    ("body", "mentions"),
    [c[1:] for c in MALFORMED_MSGPACK],
    ids=[c[0] for c in MALFORMED_MSGPACK],
)
async def test_malformed_msgpack_is_422_for_the_whole_request(api, body, mentions):
    await make_run(api, "r1")
    resp = await post_raw(api, "r1", body, "application/msgpack")
    detail = assert_error(resp, 422, "ValidationFailed")
    assert mentions in detail, detail
    assert not _echoes_non_finite(detail), detail
    await _assert_nothing_stored(api)


async def test_too_many_tokens_in_one_rollout_is_422(api, settings):
    await make_run(api, "r1")
    n = settings.max_tokens_per_rollout + 1
    r = {"rollout_id": "long", "policy_version": 0, "response_ids": [1] * n, "reward": 0}
    body = json.dumps({"rollouts": [_ok_rollout(), r]}).encode()
    assert len(body) < settings.max_body_bytes
    detail = assert_error(await post_raw(api, "r1", body), 422, "ValidationFailed")
    assert "'long'" in detail
    await _assert_nothing_stored(api)


async def test_too_many_rollouts_in_one_request_is_422(api, settings):
    await make_run(api, "r1")
    n = settings.max_rollouts_per_request + 1
    tiny = [
        {"rollout_id": f"t{i}", "policy_version": 0, "response_ids": [1], "reward": 0}
        for i in range(n)
    ]
    resp = await api.post("/v1/runs/r1/rollouts", json={"rollouts": tiny})
    assert_error(resp, 422, "ValidationFailed")
    await _assert_nothing_stored(api)


# -- groups ---------------------------------------------------------------------------------------


async def test_missing_group_id_in_a_group_run_is_422(api):
    await make_run(api, "r1", group_size=2)
    resp = await post(api, "r1", rollout("g-a", group="g"), rollout("g-b", group="g"), rollout("x"))
    detail = assert_error(resp, 422, "ValidationFailed")
    assert "group_id" in detail
    assert (await lease(api, "r1", 2, partial=True)).status_code == 204
    resp = await post(api, "r1", rollout("g-a", group="g"), rollout("g-b", group="g"))
    assert resp.json() == {"accepted": 2, "duplicates": 0, "rejected": []}


async def test_too_many_rollouts_for_a_group_in_one_request_is_422(api):
    await make_run(api, "r1", group_size=2)
    resp = await post(
        api, "r1", rollout("a", group="g"), rollout("b", group="g"), rollout("c", group="g")
    )
    detail = assert_error(resp, 422, "ValidationFailed")
    assert "'g'" in detail
    assert (await lease(api, "r1", 2, partial=True)).status_code == 204
    resp = await post(api, "r1", rollout("a", group="g"), rollout("b", group="g"))
    assert resp.json()["accepted"] == 2


async def test_too_many_rollouts_for_a_complete_group_across_requests_is_422(api):
    await make_run(api, "r1", group_size=2)
    assert (await post(api, "r1", rollout("a", group="g"), rollout("b", group="g"))).json()[
        "accepted"
    ] == 2
    resp = await post(api, "r1", rollout("c", group="g"), rollout("other", group="h"))
    assert_error(resp, 422, "ValidationFailed")
    batch = (await lease(api, "r1", 4, partial=True)).json()
    assert sorted(ids(batch)) == ["a", "b"]
    # "other" was not stored by the refused request
    assert (await post(api, "r1", rollout("other", group="h"))).json()["accepted"] == 1


async def test_too_many_rollouts_for_an_open_group_across_requests_is_422(api):
    await make_run(api, "r1", group_size=2)
    assert (await post(api, "r1", rollout("a", group="g"))).json()["accepted"] == 1
    resp = await post(api, "r1", rollout("b", group="g"), rollout("c", group="g"))
    assert_error(resp, 422, "ValidationFailed")
    assert (await lease(api, "r1", 2, partial=True)).status_code == 204
    # b was not stored: it is not a duplicate, and it completes the group
    assert (await post(api, "r1", rollout("b", group="g"))).json() == {
        "accepted": 1,
        "duplicates": 0,
        "rejected": [],
    }
    assert sorted(ids((await lease(api, "r1", 2)).json())) == ["a", "b"]


async def test_rollout_for_an_already_consumed_group_is_422(api):
    await make_run(api, "r1", group_size=2)
    await post(api, "r1", rollout("a", group="g"), rollout("b", group="g"))
    batch = (await lease(api, "r1", 2)).json()
    assert (await ack(api, "r1", batch["batch_id"])).json()["retired"] == 2
    resp = await post(api, "r1", rollout("c", group="g"))
    assert_error(resp, 422, "ValidationFailed")


async def test_late_member_of_a_timed_out_group_does_not_open_a_new_group(api, redis, prefix):
    await make_run(api, "r1", group_size=2, group_timeout_s=0.2)
    await post(api, "r1", rollout("a", group="g"))
    posted = time.monotonic()
    await asyncio.sleep(max(0.0, posted + 0.3 - time.monotonic()))
    assert (await lease(api, "r1", 2, partial=True)).status_code == 204
    assert (await retired(redis, prefix, "r1")) == {"incomplete_group": ["a"]}
    resp = await post(api, "r1", rollout("b", group="g"))
    assert_error(resp, 422, "ValidationFailed")  # the group retired: it takes no members


# -- limits and content types -------------------------------------------------------------------


def _big_body(min_bytes: int) -> bytes:
    tokens = min_bytes // 7 + 1  # each token is at least 7 bytes of JSON ("1000000, ")
    r = {
        "rollout_id": "big",
        "policy_version": 0,
        "response_ids": [1_000_000] * tokens,
        "reward": 0,
    }
    body = json.dumps({"rollouts": [r]}).encode()
    assert len(body) > min_bytes
    return body


async def test_body_over_max_body_bytes_with_content_length_is_413(api, settings):
    await make_run(api, "r1")
    body = _big_body(settings.max_body_bytes + 1)
    resp = await post_raw(api, "r1", body)
    assert_error(resp, 413, "PayloadTooLarge")
    assert (await lease(api, "r1", 1, partial=True)).status_code == 204
    assert (await post(api, "r1", rollout("big"))).json()["accepted"] == 1


async def test_chunked_body_over_max_body_bytes_is_413(api, settings):
    await make_run(api, "r1")
    body = _big_body(settings.max_body_bytes + 1)
    sent = 0

    async def chunks():
        nonlocal sent
        for i in range(0, len(body), 64 * 1024):
            sent += 1
            yield body[i : i + 64 * 1024]

    resp = await api.post(
        "/v1/runs/r1/rollouts", content=chunks(), headers={"content-type": "application/json"}
    )
    assert resp.request.headers.get("transfer-encoding") == "chunked"
    assert "content-length" not in resp.request.headers
    assert_error(resp, 413, "PayloadTooLarge")
    assert (await lease(api, "r1", 1, partial=True)).status_code == 204
    assert (await post(api, "r1", rollout("big"))).json()["accepted"] == 1


async def test_body_just_under_the_limit_is_accepted(api, settings):
    await make_run(api, "r1")
    tokens = (settings.max_body_bytes - 200) // 9  # "1000000, " is 9 bytes
    r = {
        "rollout_id": "big",
        "policy_version": 0,
        "response_ids": [1_000_000] * tokens,
        "reward": 0,
    }
    body = json.dumps({"rollouts": [r]}).encode()
    assert settings.max_body_bytes - 200 < len(body) <= settings.max_body_bytes
    resp = await post_raw(api, "r1", body)
    assert resp.status_code == 202, resp.text
    assert resp.json()["accepted"] == 1


@pytest.mark.parametrize("ctype", ["text/plain", "application/xml", "multipart/form-data"])
async def test_unsupported_content_type_is_415(api, ctype):
    await make_run(api, "r1")
    resp = await post_raw(api, "r1", json.dumps({"rollouts": [_ok_rollout()]}).encode(), ctype)
    assert_error(resp, 415, "UnsupportedMediaType")
    await _assert_nothing_stored(api)


async def test_over_capacity_is_429_with_retry_after_and_stores_nothing(api, redis, prefix):
    await make_run(api, "r1", capacity_rollouts=3)
    assert (await post(api, "r1", rollout("a"), rollout("b"))).json()["accepted"] == 2
    resp = await post(api, "r1", rollout("c"), rollout("d"))
    assert_error(resp, 429, "OverCapacity")
    assert resp.headers["retry-after"] == "1"
    # exactly at capacity is fine
    assert (await post(api, "r1", rollout("c"))).json()["accepted"] == 1
    resp = await post(api, "r1", rollout("d"))
    assert_error(resp, 429, "OverCapacity")
    # duplicates alone add nothing, so they are not refused
    assert (await post(api, "r1", rollout("a"))).json() == {
        "accepted": 0,
        "duplicates": 1,
        "rejected": [],
    }
    batch = (await lease(api, "r1", 10, partial=True)).json()
    assert sorted(ids(batch)) == ["a", "b", "c"]
    # leased rollouts still count toward capacity
    assert_error(await post(api, "r1", rollout("d")), 429, "OverCapacity")
    assert (await ack(api, "r1", batch["batch_id"])).json()["retired"] == 3
    # the refused ids were never stored: they are accepted now, not duplicates
    assert (await post(api, "r1", rollout("d"))).json() == {
        "accepted": 1,
        "duplicates": 0,
        "rejected": [],
    }
    accepted = [
        it[0] for e, d in await events(redis, prefix, "r1") if e == "accepted" for it in d["items"]
    ]
    assert accepted == ["a", "b", "c", "d"]


async def test_raising_capacity_by_patch_applies_at_once(api):
    await make_run(api, "r1", capacity_rollouts=1)
    await post(api, "r1", rollout("a"))
    assert_error(await post(api, "r1", rollout("b")), 429, "OverCapacity")
    await patch(api, "r1", capacity_rollouts=2)
    assert (await post(api, "r1", rollout("b"))).json()["accepted"] == 1


async def test_ingest_to_unknown_run_is_404(api):
    assert_error(await post(api, "nope", rollout("a")), 404, "RunNotFound")
    resp = await post_msgpack(api, "nope", [rollout("a")])
    assert_error(resp, 404, "RunNotFound")


# -- bugs found ---------------------------------------------------------------------------------


async def test_nan_in_metadata_is_422(api):
    await make_run(api, "r1")
    body = _raw("{" + _BASE + ', "reward": 1, "metadata": {"score": NaN}}')
    assert_error(await post_raw(api, "r1", body), 422, "ValidationFailed")
    await _assert_nothing_stored(api)


async def test_huge_integer_in_metadata_is_not_a_500(api):
    await make_run(api, "r1")
    body = _raw("{" + _BASE + ', "reward": 1, "metadata": {"seed": 1180591620717411303424}}')
    resp = await post_raw(api, "r1", body)
    assert resp.status_code in (202, 422), resp.text


async def test_msgpack_metadata_with_bytes_does_not_break_leasing(api):
    await make_run(api, "r1")
    resp = await post_msgpack(api, "r1", [{**rollout("a"), "metadata": {"blob": b"\x00\x01"}}])
    if resp.status_code == 422:
        return  # refusing such metadata is a valid answer
    assert resp.status_code == 202
    got = await lease(api, "r1", 1)
    assert got.status_code == 200, got.text


@pytest.mark.one_node  # refused in the parse, before any call to Redis: a cluster adds nothing
@pytest.mark.parametrize(
    "fields",
    [
        {"reward": "1.5"},
        {"policy_version": "0"},
        {"response_ids": [True, False, True, True]},
        {"response_ids": ["10", "11", "12", "13"]},
        {"logprobs": ["-0.5", "-0.5", "-0.5", "-0.5"]},
    ],
    ids=["reward_str", "version_str", "token_bool", "token_str", "logprob_str"],
)
async def test_wrongly_typed_json_values_are_422(api, fields):
    await make_run(api, "r1")
    resp = await post_raw(api, "r1", _bad(**fields))
    assert_error(resp, 422, "ValidationFailed")
    await _assert_nothing_stored(api)


def test_strict_json_helper_rejects_nan():
    class R:
        content = b'{"x": NaN}'

    with pytest.raises(AssertionError):
        strict_json(R())  # type: ignore[arg-type]
