"""Packing of rollouts into Redis blobs: lossless, narrow, and strict about bad arrays."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.broker import packing
from app.broker.packing import (
    StoredRollout,
    pack_each,
    pack_ids,
    pack_rollout,
    pack_rollouts,
    unpack_ids,
    unpack_rollouts,
)
from app.broker.tokens import pack_masks
from app.errors import ValidationFailed


def unpack_rollout(blob: bytes) -> StoredRollout:
    """One rollout, read back by itself."""
    return unpack_rollouts([blob])[0]


@pytest.mark.parametrize(
    ("top", "width"), [(65535, 2), (65536, 3), (2**24 - 1, 3), (2**24, 4), (2**31 - 1, 4)]
)
def test_ids_use_the_narrowest_width_and_round_trip(top, width):
    arr = np.array([0, 1, top // 2, top], dtype=np.int32)
    data, w = pack_ids(arr)
    assert w == width
    assert len(data) == width * arr.size
    assert unpack_ids(data, w).tolist() == arr.tolist()


@given(st.lists(st.integers(0, 2**24 - 1), max_size=300).map(lambda ids: [*ids, 2**16]))
def test_three_byte_ids_round_trip_whatever_their_neighbours(ids):
    """The 3-byte unpacking reads 4 bytes an id and masks off its neighbour's first byte."""
    arr = np.array(ids, dtype=np.int32)
    data, width = pack_ids(arr)
    assert width == 3
    got = unpack_ids(data, width)
    assert got.dtype == np.int32 and got.tolist() == ids
    assert unpack_ids(b"", 3).tolist() == []


def _pack(**kw):
    base = dict(
        rollout_id="r",
        group_id=None,
        policy_version=3,
        prompt_ids=None,
        response_ids=[1, 2, 3],
        logprobs=None,
        reward=0.5,
        finish_reason=None,
        metadata=None,
        max_tokens=16,
    )
    base.update(kw)
    return pack_rollout(**base)


def test_rollout_round_trip_with_binary_arrays():
    ids = np.array([5, 150_000, 7], dtype="<i4")
    lps = np.array([-0.1, -2.5, -1e-8], dtype="<f4")
    p = _pack(
        group_id="g",
        prompt_ids=[9, 8],
        response_ids=ids.tobytes(),
        logprobs=lps.tobytes(),
        reward=0.1,
        finish_reason="length",
        metadata={"k": [1, "x"]},
    )
    assert (p.tokens, p.reward_text) == (3, "0.1")
    back = unpack_rollout(p.blob)
    assert back.response_ids.tolist() == ids.tolist()
    assert back.logprobs.tobytes() == lps.tobytes()
    assert back.prompt_ids.tolist() == [9, 8]
    assert (back.group_id, back.policy_version, back.reward, back.finish_reason) == (
        "g",
        3,
        0.1,
        "length",
    )
    assert back.metadata == {"k": [1, "x"]}


def test_a_batch_unpacks_like_its_rollouts_one_by_one():
    """Many rollouts unpack together (one pass per id width); each must come back exactly as
    it went in, whatever mix of widths, lengths, prompts and logprobs the batch holds."""
    rng = np.random.default_rng(3)
    sent = []
    for i in range(30):
        top = [60_000, 151_935, 2**31 - 1][i % 3]  # widths 2, 3 and 4
        n = int(rng.integers(1, 40))
        ids = rng.integers(0, top + 1, size=n).astype(np.int32)
        prompt = rng.integers(0, top + 1, size=i % 4).astype(np.int32) if i % 2 else None
        lps = -rng.random(n).astype(np.float32) if i % 5 else None
        sent.append((ids, prompt, lps))
    blobs = [
        _pack(
            rollout_id=f"r{i}",
            response_ids=ids.tobytes(),
            prompt_ids=None if prompt is None else prompt.tolist(),
            logprobs=None if lps is None else lps.tobytes(),
            max_tokens=64,
        ).blob
        for i, (ids, prompt, lps) in enumerate(sent)
    ]
    back = unpack_rollouts(blobs)
    assert [b.rollout_id for b in back] == [f"r{i}" for i in range(30)]
    for (ids, prompt, lps), got, one in zip(sent, back, map(unpack_rollout, blobs), strict=True):
        assert got.response_ids.dtype == np.int32
        assert got.response_ids.tolist() == ids.tolist() == one.response_ids.tolist()
        if prompt is None:
            assert got.prompt_ids is None
        else:
            assert got.prompt_ids.tolist() == prompt.tolist()
        if lps is None:
            assert got.logprobs is None
        else:
            assert got.logprobs.tobytes() == lps.tobytes()
    assert unpack_rollouts([]) == []


def test_packed_1024_token_rollout_stays_under_8_kib():
    ids = list(np.random.default_rng(0).integers(0, 151_000, 1024))
    p = _pack(response_ids=[int(x) for x in ids], logprobs=[-0.5] * 1024, max_tokens=2048)
    assert len(p.blob) < 8192 - 64  # fits jemalloc's 8 KiB class with the sds header


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(response_ids=[]), "empty"),
        (dict(response_ids=[1, -2]), "between 0 and"),
        (dict(response_ids=[2**31]), "between 0 and"),
        (dict(response_ids=[1] * 17), "at most 16"),
        (dict(response_ids=b"\x01\x00\x00"), "whole number of int32"),
        (dict(response_ids=np.array([-1], "<i4").tobytes()), "negative"),
        (dict(logprobs=[-0.1, -0.2]), "2 logprobs for 3"),
        (dict(logprobs=[-0.1, float("nan"), -0.2]), "finite"),
        (dict(logprobs=[-0.1, float("-inf"), -0.2]), "finite"),
        (dict(logprobs=[-0.1, 0.5, -0.2]), "≤ 0"),
        (dict(logprobs=[-0.1, -1e39, -0.2]), "float32 range"),
        (dict(logprobs=b"\x00\x00"), "whole number of float32"),
    ],
)
def test_bad_arrays_are_refused_with_a_readable_reason(kw, message):
    with pytest.raises(ValidationFailed, match=message):
        _pack(**kw)


# -- a request's rollouts packed together -------------------------------------------------------
_MAX_TOKENS = 64
_F32_MIN = float(np.finfo(np.float32).min)


class _Rollout:
    """A parsed rollout as the API hands it to packing (the fields of RolloutMsgpack)."""

    def __init__(self, i: int, fields: dict) -> None:
        self.rollout_id = f"r{i}"
        self.group_id = fields.get("group_id")
        self.policy_version = 3
        self.prompt_ids = fields.get("prompt_ids")
        self.response_ids = fields["response_ids"]
        self.logprobs = fields.get("logprobs")
        self.reward = fields.get("reward", 0.5)
        self.finish_reason = fields.get("finish_reason")
        self.metadata = fields.get("metadata")
        self.loss_mask = fields.get("loss_mask")
        self.versions = fields.get("versions")
        self.generator_id = fields.get("generator_id")


def _as_sent(values: list, dtype: str, as_bytes: bool) -> list | bytes:
    return np.asarray(values, dtype=dtype).tobytes() if as_bytes else values


# Mostly valid rollouts, ids of every width; now and then one array breaks a rule: an id out of
# range, a logprob positive, infinite, NaN or beyond float32, a length off, empty or too long.
_BAD_ID = st.sampled_from([-1, 2**31, 2**40])
_BAD_LOGPROB = st.sampled_from([1e-9, float("inf"), float("-inf"), float("nan"), -1e39])


def _spoil(draw, values: list, bad: st.SearchStrategy) -> list:
    if values and not draw(st.integers(0, 7)):
        values[draw(st.integers(0, len(values) - 1))] = draw(bad)
    return values


@st.composite
def _request(draw) -> list[_Rollout]:
    out = []
    for i in range(draw(st.integers(0, 5))):
        n = draw(st.integers(0, _MAX_TOKENS + 1))
        top = draw(st.sampled_from([2**16 - 1, 2**24 - 1, 2**31 - 1]))
        ids = _spoil(draw, draw(st.lists(st.integers(0, top), min_size=n, max_size=n)), _BAD_ID)
        fields: dict = {}
        as_bytes = draw(st.booleans()) and all(0 <= x < 2**31 for x in ids)
        fields["response_ids"] = _as_sent(ids, "<i4", as_bytes)
        if as_bytes and not draw(st.integers(0, 15)):
            fields["response_ids"] += b"\0"  # not a whole number of int32
        if draw(st.booleans()):
            k = draw(st.integers(0, _MAX_TOKENS + 1))
            p = _spoil(draw, draw(st.lists(st.integers(0, 2**24), min_size=k, max_size=k)), _BAD_ID)
            fields["prompt_ids"] = _as_sent(
                p,
                "<i4",
                draw(st.booleans()) and min(p, default=0) >= 0 and max(p, default=0) < 2**31,
            )
        if draw(st.booleans()):
            k = n if draw(st.integers(0, 9)) else draw(st.integers(0, _MAX_TOKENS))
            lps = _spoil(
                draw, draw(st.lists(st.floats(-30.0, 0.0), min_size=k, max_size=k)), _BAD_LOGPROB
            )
            as_f32 = draw(st.booleans()) and all(x >= _F32_MIN or x != x for x in lps)
            fields["logprobs"] = _as_sent(lps, "<f4", as_f32)
        fields["group_id"] = draw(st.sampled_from([None, "g"]))
        fields["finish_reason"] = draw(st.sampled_from([None, "stop"]))
        fields["metadata"] = draw(st.sampled_from([None, {"k": [1, "x"]}]))
        fields["reward"] = draw(st.floats(-1e300, 1e300))
        out.append(_Rollout(i, fields))
    return out


def _one_by_one(rollouts):
    return pack_each(rollouts, _MAX_TOKENS)


def _outcome(fn, rollouts):
    try:
        return fn(rollouts)
    except ValidationFailed as exc:
        return ("refused", str(exc))


@settings(max_examples=300)
@given(_request())
def test_rollouts_packed_together_equal_them_packed_one_by_one(rollouts):
    """The same blobs byte for byte, or the same refusal of the first rule broken."""
    together = _outcome(lambda rs: pack_rollouts(rs, _MAX_TOKENS), rollouts)
    assert together == _outcome(_one_by_one, rollouts)


def test_a_request_of_valid_rollouts_is_packed_in_one_pass(monkeypatch):
    """Valid rollouts never go one by one (where each costs its own numpy calls)."""
    rollouts = [
        _Rollout(i, {"response_ids": [i, 70_000 * i, 7], "logprobs": [-0.5, -1.0, 0.0]})
        for i in range(3)
    ] + [_Rollout(3, {"response_ids": np.arange(5, dtype="<i4").tobytes(), "prompt_ids": []})]
    expected = _one_by_one(rollouts)

    def refuse(**_):
        raise AssertionError("packed one by one")

    monkeypatch.setattr(packing, "pack_rollout", refuse)
    assert pack_rollouts(rollouts, _MAX_TOKENS) == expected
    assert [p.blob for p in expected] == [p.blob for p in pack_rollouts(rollouts, _MAX_TOKENS)]


_MASK = st.lists(st.sampled_from([0, 1]), max_size=40).map(bytes)


@given(st.lists(st.one_of(st.none(), _MASK), max_size=6))
def test_masks_packed_together_are_each_packed_alone(masks):
    """A bit a token, each mask's last byte zero-padded, whatever the lengths of the others."""
    alone = [
        None if m is None else np.packbits(np.frombuffer(m, np.uint8)).tobytes() for m in masks
    ]
    assert pack_masks(masks) == alone
