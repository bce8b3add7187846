"""The lease's and the ack's per-batch work against the plain computation: unpacking ids,
checking logprobs, writing the answer and the acked event must give exactly what the
straightforward code gives, byte for byte."""

from __future__ import annotations

import math
from typing import Any

import msgpack
import numpy as np
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.api import render
from app.broker.acks import current_logprobs as _current_logprobs
from app.broker.behaviour import BatchRow
from app.broker.endpoints.batches import _raw, batch_body
from app.broker.packing import (
    as_logprobs,
    check_logprobs,
    pack_ids,
    pack_rollout,
    unpack_ids,
    unpack_many_ids,
    unpack_rollouts,
)
from app.broker.service import LeasedBatch
from app.broker.tokens import hand_out, unpack_mask
from app.errors import ValidationFailed

F32_MIN = float(np.finfo(np.float32).min)

# -- token ids --------------------------------------------------------------------------------

# Lists of ids whose largest needs 2, 3 or 4 bytes (or none: empty), mixed in one batch.
id_lists = st.sampled_from([2**16 - 1, 2**24 - 1, 2**31 - 1]).flatmap(
    lambda top: st.lists(st.integers(0, top), max_size=40)
)


@given(st.lists(id_lists, max_size=16))
def test_many_ids_unpack_like_each_array_alone(lists: list[list[int]]) -> None:
    parts = [pack_ids(np.array(ids, dtype=np.int32)) for ids in lists]
    together = unpack_many_ids(parts)
    assert len(together) == len(lists)
    for ids, (data, width), got in zip(lists, parts, together, strict=True):
        assert got.dtype == np.int32
        assert got.tolist() == unpack_ids(data, width).tolist() == ids


# -- logprobs checks --------------------------------------------------------------------------


def _checked_step_by_step(arr: np.ndarray, what: str) -> np.ndarray:
    """Every rule in turn, as the check was first written."""
    if not np.isfinite(arr).all():
        raise ValidationFailed(f"{what}: logprobs must be finite (no NaN or Infinity)")
    if arr.size and float(arr.max()) > 0.0:
        raise ValidationFailed(f"{what}: logprobs must be ≤ 0 (they are log-probabilities)")
    if arr.size and float(arr.min()) < F32_MIN:
        raise ValidationFailed(f"{what}: logprobs are out of float32 range")
    return arr.astype(np.float32, copy=False)


def _outcome(check: Any, arr: np.ndarray) -> tuple[str, Any]:
    try:
        got = check(arr, "w")
    except ValidationFailed as exc:
        return "refused", str(exc)
    return "accepted", (got.dtype.str, got.tobytes())


EDGES = [
    0.0,
    -0.0,
    -1e-45,
    5e-324,
    -5e-324,
    1e-30,
    F32_MIN,
    math.nextafter(F32_MIN, -math.inf),
    -1e39,
    -1e300,
    math.nan,
    math.inf,
    -math.inf,
]
values = st.one_of(st.sampled_from(EDGES), st.floats(allow_nan=True, allow_infinity=True))


@given(st.lists(values, max_size=12), st.sampled_from([np.float64, np.float32]))
def test_logprobs_are_judged_as_rule_by_rule(xs: list[float], dtype: Any) -> None:
    with np.errstate(over="ignore"):  # float32 of a huge double is an infinity: also judged
        arr = np.array(xs, dtype=np.float64).astype(dtype)
    assert _outcome(check_logprobs, arr) == _outcome(_checked_step_by_step, arr)


# -- the lease's answer -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "arr",
    [
        np.arange(5, dtype="<i4"),
        np.arange(5, dtype=">i4"),
        np.linspace(-3, 0, 7).astype("<f4"),
        np.linspace(-3, 0, 7).astype(">f4"),
        np.arange(10, dtype="<i4")[::2],  # not contiguous
        np.arange(10, dtype=">f4")[1::3],
        np.zeros(0, dtype="<f4"),
        np.arange(3, dtype=np.uint8),
        np.arange(6, dtype="<i4").reshape(2, 3),
        np.arange(6, dtype="<i4").reshape(2, 3).T,  # Fortran order
    ],
)
def test_arrays_are_packed_as_their_little_endian_bytes(arr: np.ndarray) -> None:
    plain = arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
    assert msgpack.packb(_raw(arr), use_bin_type=True) == msgpack.packb(plain, use_bin_type=True)


def _plain_body(batch: LeasedBatch, as_msgpack: bool) -> dict[str, Any]:
    """The answer as it was first written: every array copied to little-endian bytes."""

    def arr(a: Any) -> Any:
        if a is None:
            return None
        return a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes() if as_msgpack else a

    return {
        "batch_id": batch.batch_id,
        "policy_version": batch.policy_version,
        "lease_expires_at": batch.lease_expires_at,
        "kl_coef": batch.kl_coef,
        "rollouts": [
            {
                "rollout_id": r.rollout_id,
                "group_id": r.group_id,
                "policy_version": r.policy_version,
                "prompt_ids": arr(r.prompt_ids),
                "response_ids": arr(r.response_ids),
                "logprobs": arr(r.logprobs),
                "loss_mask": arr(mask),
                "versions": r.versions or [[0, r.policy_version]],
                "reward": r.reward,
                "generator_id": r.generator_id,
                "finish_reason": r.finish_reason,
                "metadata": r.metadata,
                "uses": uses,
                "lag": lag,
            }
            for r, uses, lag, mask, _ in batch.rollouts
        ],
    }


rollout_parts = st.tuples(
    id_lists.filter(bool),  # response ids
    st.none() | id_lists,  # prompt ids
    st.booleans(),  # with logprobs
    st.booleans(),  # with a loss mask and two versions (when there are two tokens)
    st.none() | st.text(max_size=5),  # group
    st.none()
    | st.dictionaries(
        st.text(max_size=3), st.integers(-(2**63), 2**63 - 1), max_size=2
    ),  # metadata
)


def _mask(r: Any) -> Any:
    return None if r.loss_mask is None else unpack_mask(r.loss_mask, len(r.response_ids))


@given(st.lists(rollout_parts, max_size=8), st.booleans())
def test_the_lease_answer_is_what_the_plain_encoding_gives(parts: list[Any], as_msgpack: bool):
    blobs = [
        pack_rollout(
            rollout_id=f"r{i}",
            group_id=group,
            policy_version=i,
            prompt_ids=prompt,
            response_ids=np.array(resp, dtype="<i4").tobytes(),
            logprobs=(-np.arange(len(resp), dtype="<f4") / 7).tobytes() if lp else None,
            reward=i / 3,
            finish_reason="stop" if i % 2 else None,
            metadata=meta,
            max_tokens=64,
            loss_mask=[1] + [0] * (len(resp) - 1) if masked else None,
            versions=[[0, i], [1, i + 1]] if masked and len(resp) > 1 else None,
            generator_id=f"g{i}" if masked else None,
        ).blob
        for i, (resp, prompt, lp, masked, group, meta) in enumerate(parts)
    ]
    rollouts = unpack_rollouts(blobs)
    batch = LeasedBatch(
        "b",
        3,
        "2026-01-01T00:00:00Z",
        0.125,
        [
            (
                r,
                i % 3,
                i % 2,
                None if r.loss_mask is None else unpack_mask(r.loss_mask, len(r.response_ids)),
                None,
            )
            for i, r in enumerate(rollouts)
        ],
    )
    plain = _plain_body(batch, as_msgpack)
    if as_msgpack:
        expected = msgpack.packb(plain, use_bin_type=True)
    else:
        expected = orjson.dumps(plain, option=orjson.OPT_SERIALIZE_NUMPY)
    got = render(batch_body(batch, as_msgpack), as_msgpack=as_msgpack)
    assert bytes(got.body) == expected
    assert got.headers["content-length"] == str(len(expected))


# -- the ack ----------------------------------------------------------------------------------


def _plain_current(rows: list[BatchRow], given: dict[str, Any]) -> dict[str, np.ndarray]:
    """The ack's logprobs read one by one through the general parser."""
    arrays = {}
    for row in rows:
        value = given.get(row.rollout_id)
        if value is None:
            continue
        what = f"ack logprobs of rollout {row.rollout_id!r}"
        arr = as_logprobs(value, what)
        if arr.size != row.tokens:
            raise ValidationFailed(f"{what}: {arr.size} values for {row.tokens} tokens")
        arrays[row.rollout_id] = arr
    for rid, arr in arrays.items():
        check_logprobs(arr, f"ack logprobs of rollout {rid!r}")
    return arrays


def _read(fn: Any, rows: list[BatchRow], given: dict[str, Any]) -> Any:
    try:
        got = fn(rows, given)
    except ValidationFailed as exc:
        return str(exc)
    return {rid: (arr.dtype.str, arr.tobytes()) for rid, arr in got.items()}


ack_values = st.one_of(
    st.none(),
    st.integers(0, 6).map(lambda n: (-np.arange(n, dtype="<f4") / 5).tobytes()),  # any length
    st.binary(max_size=14),  # whatever bytes: NaN, positive, ragged
    st.lists(st.sampled_from([-0.5, -1e-3, 0.0, 0.5, -1e39, math.nan]), max_size=5),
)


@given(st.lists(ack_values, min_size=1, max_size=6), st.integers(0, 5))
def test_ack_logprobs_are_read_as_the_general_parser_reads_them(values: list[Any], tokens: int):
    plain = hand_out(None, None, 0, tokens, 0, None)
    rows = [BatchRow(f"r{i}", 0, tokens, None, plain) for i in range(len(values))]
    given = {f"r{i}": v for i, v in enumerate(values) if v is not None}
    assert _read(_current_logprobs, rows, given) == _read(_plain_current, rows, given)
