"""Rollouts as Redis stores them: one msgpack blob with the arrays packed as binary.

Token ids are packed at the narrowest width that holds them (2, 3 or 4 bytes); every current
LLM vocabulary fits in 3. Besides saving a quarter of the bytes, this keeps a 1024-token rollout
inside jemalloc's 8 KiB size class instead of spilling into the 10 KiB one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt
from rollout_broker_client.protocol import MAX_TOKEN_ID

from app.errors import ValidationFailed

Int32Array = npt.NDArray[np.int32]
Float32Array = npt.NDArray[np.float32]

_F32_MIN = float(np.finfo(np.float32).min)


@dataclass(frozen=True, slots=True)
class PackedRollout:
    """What the ingest script needs of one validated rollout."""

    rollout_id: str
    group_id: str | None
    policy_version: int
    tokens: int
    reward_text: str  # repr(float): Lua's tonumber() reads it back to the exact double
    blob: bytes


def _ids(value: list[int] | bytes | None, what: str, rid: str) -> Int32Array | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        if len(value) % 4:
            raise ValidationFailed(f"rollout {rid!r}: {what} bytes are not a whole number of int32")
        arr = np.frombuffer(value, dtype="<i4")
        if arr.size and int(arr.min()) < 0:
            raise ValidationFailed(f"rollout {rid!r}: {what} has a negative token id")
        return arr.astype(np.int32, copy=False)
    return token_ids(value, f"rollout {rid!r}: {what}")


def token_ids(value: list[int], what: str) -> Int32Array:
    """Token ids given as a list, as int32: each between 0 and MAX_TOKEN_ID, else 422 naming
    ``what`` (rollouts' and registered prompts' ids follow this one rule)."""
    try:
        arr64 = np.asarray(value, dtype=np.int64)
    except OverflowError:
        raise ValidationFailed(f"{what} has a token id out of range") from None
    if arr64.size and (int(arr64.min()) < 0 or int(arr64.max()) > MAX_TOKEN_ID):
        raise ValidationFailed(f"{what} token ids must be between 0 and {MAX_TOKEN_ID}")
    return arr64.astype(np.int32)


def as_logprobs(value: list[float] | bytes, what: str) -> npt.NDArray[np.floating[Any]]:
    """Logprobs as an array, not yet validated (see :func:`check_logprobs`)."""
    if isinstance(value, bytes):
        if len(value) % 4:
            raise ValidationFailed(f"{what}: logprobs bytes are not a whole number of float32")
        return np.frombuffer(value, dtype="<f4")
    return np.asarray(value, dtype=np.float64)


def check_logprobs(arr: npt.NDArray[np.floating[Any]], what: str) -> Float32Array:
    """Validate per-token logprobs: finite, ≤ 0, representable as float32."""
    if not np.isfinite(arr).all():
        raise ValidationFailed(f"{what}: logprobs must be finite (no NaN or Infinity)")
    if arr.size and float(arr.max()) > 0.0:
        raise ValidationFailed(f"{what}: logprobs must be ≤ 0 (they are log-probabilities)")
    if arr.size and float(arr.min()) < _F32_MIN:
        raise ValidationFailed(f"{what}: logprobs are out of float32 range")
    return arr.astype(np.float32, copy=False)


def logprob_array(value: list[float] | bytes, what: str) -> Float32Array:
    return check_logprobs(as_logprobs(value, what), what)


# A 3-byte little-endian id in the low bytes of a 4-byte record: one copy of the 'x' field
# narrows a whole int32 array to 3 bytes an id.
_U24_IN_I32 = np.dtype({"names": ["x"], "formats": ["V3"], "itemsize": 4})


def pack_ids(arr: Int32Array) -> tuple[bytes, int]:
    top = int(arr.max()) if arr.size else 0
    if top < 1 << 16:
        return arr.astype("<u2").tobytes(), 2
    if top < 1 << 24:
        return arr.astype("<u4").view(_U24_IN_I32)["x"].tobytes(), 3
    return arr.astype("<i4").tobytes(), 4


def unpack_ids(data: bytes, width: int) -> Int32Array:
    if width == 2:
        return np.frombuffer(data, dtype="<u2").astype(np.int32)
    if width == 3:
        # Each id read as the 4 bytes from its own first one (a stride of 3, over one byte of
        # padding at the end), the next id's first byte masked off: 4× faster than copying
        # the 3-byte fields into 4-byte slots.
        n = len(data) // 3
        overlapping = np.ndarray((n,), dtype="<u4", buffer=bytes(data) + b"\0", strides=(3,))
        return (overlapping & 0xFFFFFF).astype(np.int32)
    return np.frombuffer(data, dtype="<i4").astype(np.int32, copy=False)


def unpack_many_ids(parts: list[tuple[bytes, int]]) -> list[Int32Array]:
    """Unpack many (data, width) arrays: one numpy pass per width over their concatenation
    rather than several calls per array; the results are views into that pass's output."""
    out: list[Int32Array] = [_EMPTY_IDS] * len(parts)
    for width in {w for _, w in parts}:
        idx = [i for i, (_, w) in enumerate(parts) if w == width]
        flat = unpack_ids(b"".join(parts[i][0] for i in idx), width)
        bounds = np.cumsum([len(parts[i][0]) // width for i in idx[:-1]], dtype=np.int64)
        for i, arr in zip(idx, np.split(flat, bounds), strict=True):
            out[i] = arr
    return out


_EMPTY_IDS: Int32Array = np.zeros(0, dtype=np.int32)


def pack_rollout(
    *,
    rollout_id: str,
    group_id: str | None,
    policy_version: int,
    prompt_ids: list[int] | bytes | None,
    response_ids: list[int] | bytes,
    logprobs: list[float] | bytes | None,
    reward: float,
    finish_reason: str | None,
    metadata: dict[str, Any] | None,
    max_tokens: int,
) -> PackedRollout:
    """Validate one rollout's arrays and pack it; raises ValidationFailed with a readable detail."""
    rid = rollout_id
    resp = _ids(response_ids, "response_ids", rid)
    assert resp is not None
    if resp.size == 0:
        raise ValidationFailed(f"rollout {rid!r}: response_ids is empty")
    if resp.size > max_tokens:
        raise ValidationFailed(
            f"rollout {rid!r}: {resp.size} response tokens, at most {max_tokens}"
        )
    prompt = _ids(prompt_ids, "prompt_ids", rid)
    if prompt is not None and prompt.size > max_tokens:
        raise ValidationFailed(
            f"rollout {rid!r}: {prompt.size} prompt tokens, at most {max_tokens}"
        )
    lp = None
    if logprobs is not None:
        lp = logprob_array(logprobs, f"rollout {rid!r}")
        if lp.size != resp.size:
            raise ValidationFailed(
                f"rollout {rid!r}: {lp.size} logprobs for {resp.size} response tokens"
            )
    r_bytes, r_width = pack_ids(resp)
    doc: dict[str, Any] = {"i": rid, "v": policy_version, "r": r_bytes, "rw": r_width, "w": reward}
    if group_id is not None:
        doc["g"] = group_id
    if prompt is not None:
        doc["p"], doc["pw"] = pack_ids(prompt)
    if lp is not None:
        doc["l"] = lp.astype("<f4", copy=False).tobytes()
    if finish_reason is not None:
        doc["f"] = finish_reason
    if metadata is not None:
        doc["m"] = metadata
    blob = msgpack.packb(doc, use_bin_type=True)
    return PackedRollout(rid, group_id, policy_version, int(resp.size), repr(float(reward)), blob)


@dataclass(frozen=True, slots=True)
class StoredRollout:
    """A rollout read back from Redis, arrays unpacked."""

    rollout_id: str
    group_id: str | None
    policy_version: int
    prompt_ids: Int32Array | None
    response_ids: Int32Array
    logprobs: Float32Array | None
    reward: float
    finish_reason: str | None
    metadata: dict[str, Any] | None


def unpack_rollouts(blobs: list[bytes]) -> list[StoredRollout]:
    """Rollouts read back from Redis; the id arrays of all of them are unpacked together."""
    docs = [msgpack.unpackb(blob, raw=False) for blob in blobs]
    responses = unpack_many_ids([(d["r"], d["rw"]) for d in docs])
    with_prompt = [i for i, d in enumerate(docs) if "p" in d]
    prompts: list[Int32Array | None] = [None] * len(docs)
    unpacked = unpack_many_ids([(docs[i]["p"], docs[i]["pw"]) for i in with_prompt])
    for i, arr in zip(with_prompt, unpacked, strict=True):
        prompts[i] = arr
    return [
        StoredRollout(
            rollout_id=doc["i"],
            group_id=doc.get("g"),
            policy_version=doc["v"],
            prompt_ids=prompt,
            response_ids=response,
            logprobs=np.frombuffer(doc["l"], dtype="<f4") if "l" in doc else None,
            reward=doc["w"],
            finish_reason=doc.get("f"),
            metadata=doc.get("m"),
        )
        for doc, response, prompt in zip(docs, responses, prompts, strict=True)
    ]


def unpack_rollout(blob: bytes) -> StoredRollout:
    return unpack_rollouts([blob])[0]
