"""Rollouts as Redis stores them: one msgpack blob with the arrays packed as binary.

Token ids are packed at the narrowest width that holds them (2, 3 or 4 bytes); every current
LLM vocabulary fits in 3. Besides saving a quarter of the bytes, this keeps a 1024-token rollout
inside jemalloc's 8 KiB size class instead of spilling into the 10 KiB one.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import msgpack
import numpy as np
import numpy.typing as npt
from rollout_broker_client.protocol import MAX_TOKEN_ID

from app.broker.tokens import Segments, TokenRules, many_token_rules, token_rules
from app.errors import ValidationFailed

Int32Array = npt.NDArray[np.int32]
Float32Array = npt.NDArray[np.float32]

_F32_MIN = float(np.finfo(np.float32).min)


@dataclass(frozen=True, slots=True)
class PackedRollout:
    """What the ingest script needs of one validated rollout."""

    rollout_id: str
    group_id: str | None
    policy_version: int  # v_old
    tokens: int
    reward_text: str  # repr(float): Lua's tonumber() reads it back exactly; '' = awaits one
    blob: bytes
    v_new: int  # the newest version over trained tokens
    masked: int  # tokens with loss_mask 0
    # The blob's 'gi' (None: it names none; ingest.lua gives one without its work lease's).
    generator_id: str | None

    @property
    def has_generator(self) -> bool:
        return self.generator_id is not None


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
    if arr64.size and not _ids_in_range(int(arr64.min()), int(arr64.max())):
        raise ValidationFailed(f"{what} token ids must be between 0 and {MAX_TOKEN_ID}")
    return arr64.astype(np.int32)


def _ids_in_range(low: int, top: int) -> bool:
    return low >= 0 and top <= MAX_TOKEN_ID


def as_logprobs(value: list[float] | bytes, what: str) -> npt.NDArray[np.floating[Any]]:
    """Logprobs as an array, not yet validated (see :func:`check_logprobs`)."""
    if isinstance(value, bytes):
        if len(value) % 4:
            raise ValidationFailed(f"{what}: logprobs bytes are not a whole number of float32")
        return np.frombuffer(value, dtype="<f4")
    return np.asarray(value, dtype=np.float64)


def check_logprobs(arr: npt.NDArray[np.floating[Any]], what: str) -> Float32Array:
    """Validate per-token logprobs: finite, ≤ 0, representable as float32."""
    # Anything but plainly valid logprobs is looked at check by check, in the order that names
    # the first rule broken.
    if not arr.size or _plainly_valid_logprobs(arr):
        return arr.astype(np.float32, copy=False)
    if not np.isfinite(arr).all():
        raise ValidationFailed(f"{what}: logprobs must be finite (no NaN or Infinity)")
    if arr.size and float(arr.max()) > 0.0:
        raise ValidationFailed(f"{what}: logprobs must be ≤ 0 (they are log-probabilities)")
    if arr.size and float(arr.min()) < _F32_MIN:
        raise ValidationFailed(f"{what}: logprobs are out of float32 range")
    return arr.astype(np.float32, copy=False)


def _plainly_valid_logprobs(arr: npt.NDArray[np.floating[Any]]) -> bool:
    """Valid logprobs pass with two reductions: a NaN makes the maximum NaN, an infinity makes
    the maximum or the minimum fail its bound."""
    return float(arr.max()) <= 0.0 and float(arr.min()) >= _F32_MIN


def logprob_array(value: list[float] | bytes, what: str) -> Float32Array:
    return check_logprobs(as_logprobs(value, what), what)


# A 3-byte little-endian id in the low bytes of a 4-byte record: one copy of the 'x' field
# narrows a whole int32 array to 3 bytes an id.
_U24_IN_I32 = np.dtype({"names": ["x"], "formats": ["V3"], "itemsize": 4})


def pack_ids(arr: Int32Array) -> tuple[bytes, int]:
    width = id_width(int(arr.max()) if arr.size else 0)
    return encode_ids(arr, width), width


def id_width(top: int) -> int:
    """The narrowest width (2, 3 or 4 bytes) that holds ids up to ``top``."""
    return 2 if top < 1 << 16 else 3 if top < 1 << 24 else 4


def encode_ids(arr: npt.NDArray[np.integer[Any]], width: int) -> bytes:
    """Ids (between 0 and MAX_TOKEN_ID) at ``width`` bytes each, little-endian."""
    if width == 2:
        return arr.astype("<u2").tobytes()
    if width == 3:
        return arr.astype("<u4").view(_U24_IN_I32)["x"].tobytes()
    return arr.astype("<i4").tobytes()


def unpack_ids(data: bytes, width: int) -> Int32Array:
    if width == 3:
        return _unpack_u24(bytes(data) + b"\0", len(data) // 3)
    if width == 2:
        return np.frombuffer(data, dtype="<u2").astype(np.int32)
    return np.frombuffer(data, dtype="<i4").astype(np.int32, copy=False)


def _unpack_u24(padded: bytes, n: int) -> Int32Array:
    """``n`` 3-byte ids from ``padded``, their bytes followed by at least one more byte.

    Each id is read as the 4 bytes from its own first one (a stride of 3, over the byte of
    padding at the end), the next id's first byte masked off: 4× faster than copying the
    3-byte fields into 4-byte slots. The mask writes straight into the int32 result."""
    overlapping = np.ndarray((n,), dtype="<u4", buffer=padded, strides=(3,))
    out = np.empty(n, dtype=np.int32)
    np.bitwise_and(overlapping, 0xFFFFFF, out=out.view(np.uint32))
    return out


def unpack_many_ids(parts: list[tuple[bytes, int]]) -> list[Int32Array]:
    """Unpack many (data, width) arrays: one numpy pass per width over their concatenation
    rather than several calls per array; the results are views into that pass's output."""
    out: list[Int32Array] = [_EMPTY_IDS] * len(parts)
    widths = {w for _, w in parts}
    for width in widths:
        idx = (
            range(len(parts))
            if len(widths) == 1
            else [i for i, (_, w) in enumerate(parts) if w == width]
        )
        datas = [parts[i][0] for i in idx]
        if width == 3:
            flat = _unpack_u24(b"".join([*datas, b"\0"]), sum(map(len, datas)) // 3)
        else:
            flat = unpack_ids(b"".join(datas), width)
        at = 0
        for i, data in zip(idx, datas, strict=True):
            end = at + len(data) // width
            out[i] = flat[at:end]
            at = end
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
    reward: float | None,
    finish_reason: str | None,
    metadata: dict[str, Any] | None,
    max_tokens: int,
    loss_mask: list[int] | bytes | None = None,
    versions: Segments | None = None,
    generator_id: str | None = None,
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
    return _packed(
        rid,
        group_id,
        policy_version,
        pack_ids(resp),
        int(resp.size),
        None if prompt is None else pack_ids(prompt),
        None if lp is None else lp.astype("<f4", copy=False).tobytes(),
        reward,
        finish_reason,
        metadata,
        None
        if loss_mask is None and versions is None
        else token_rules(rid, int(resp.size), policy_version, loss_mask, versions),
        generator_id,
    )


def _many_rules(
    rollouts: Sequence[RolloutFields], resp: list[npt.NDArray[np.integer[Any]]]
) -> dict[int, TokenRules]:
    """The token rules of each rollout with a mask or versions, by position: checked in order
    (the first rule broken is raised), their masks packed together."""
    at = [i for i, r in enumerate(rollouts) if r.loss_mask is not None or r.versions is not None]
    args = [(rollouts[i], resp[i].size) for i in at]
    found = many_token_rules(
        [(r.rollout_id, n, r.policy_version, r.loss_mask, r.versions) for r, n in args]
    )
    return dict(zip(at, found, strict=True))


def _packed(
    rid: str,
    group_id: str | None,
    policy_version: int,
    response: tuple[bytes, int],
    tokens: int,
    prompt: tuple[bytes, int] | None,
    logprobs: bytes | None,
    reward: float | None,
    finish_reason: str | None,
    metadata: dict[str, Any] | None,
    rules: TokenRules | None,
    generator_id: str | None,
) -> PackedRollout:
    """The stored blob of a validated rollout: ids as (bytes, width), logprobs as float32."""
    doc: dict[str, Any] = {
        "i": rid,
        "v": policy_version,
        "r": response[0],
        "rw": response[1],
        "w": reward,
    }
    if group_id is not None:
        doc["g"] = group_id
    if prompt is not None:
        doc["p"], doc["pw"] = prompt
    if logprobs is not None:
        doc["l"] = logprobs
    if finish_reason is not None:
        doc["f"] = finish_reason
    if metadata is not None:
        doc["m"] = metadata
    if generator_id is not None:
        doc["gi"] = generator_id
    v_new, masked = policy_version, 0
    if rules is not None:
        if rules.mask is not None:
            doc["k"] = rules.mask
        if rules.versions is not None:
            doc["vs"] = rules.versions
        v_new, masked = rules.v_new, rules.masked
    blob = msgpack.packb(doc, use_bin_type=True)
    reward_text = "" if reward is None else repr(float(reward))
    return PackedRollout(
        rid, group_id, policy_version, tokens, reward_text, blob, v_new, masked, generator_id
    )


class RolloutFields(Protocol):
    """What packing reads of a parsed rollout (the API's JSON and msgpack models)."""

    @property
    def rollout_id(self) -> str: ...
    @property
    def group_id(self) -> str | None: ...
    @property
    def policy_version(self) -> int: ...
    @property
    def prompt_ids(self) -> list[int] | bytes | None: ...
    @property
    def response_ids(self) -> list[int] | bytes: ...
    @property
    def logprobs(self) -> list[float] | bytes | None: ...
    @property
    def reward(self) -> float | None: ...
    @property
    def finish_reason(self) -> str | None: ...
    @property
    def metadata(self) -> dict[str, Any] | None: ...
    @property
    def loss_mask(self) -> list[int] | bytes | None: ...
    @property
    def versions(self) -> Segments | None: ...
    @property
    def generator_id(self) -> str | None: ...


def pack_rollouts(rollouts: Sequence[RolloutFields], max_tokens: int) -> list[PackedRollout]:
    """:func:`pack_rollout` of each rollout: the same blobs, and the same error for the first
    rule a rollout breaks.

    A numpy call costs a few microseconds whatever its size, and one rollout's checks and id
    packing make about six, so a request's rollouts are checked and packed together: their
    arrays joined, their bounds taken in one reduction per array kind. Anything the joint checks
    do not pass goes through :func:`pack_rollout` one by one, which names the rule broken.
    """
    rollouts = list(rollouts)  # what iterating yields (a count alone yields nothing)
    together = _pack_together(rollouts, max_tokens) if len(rollouts) > 1 else None
    return pack_each(rollouts, max_tokens) if together is None else together


def pack_each(rollouts: Sequence[RolloutFields], max_tokens: int) -> list[PackedRollout]:
    """:func:`pack_rollout` of each rollout in turn: the plain path."""
    return [
        pack_rollout(
            rollout_id=r.rollout_id,
            group_id=r.group_id,
            policy_version=r.policy_version,
            prompt_ids=r.prompt_ids,
            response_ids=r.response_ids,
            logprobs=r.logprobs,
            reward=r.reward,
            finish_reason=r.finish_reason,
            metadata=r.metadata,
            max_tokens=max_tokens,
            loss_mask=r.loss_mask,
            versions=r.versions,
            generator_id=r.generator_id,
        )
        for r in rollouts
    ]


def _id_array(value: list[int] | bytes) -> npt.NDArray[np.integer[Any]] | None:
    """The ids as an array, or None when they are not even that (left to pack_rollout)."""
    if isinstance(value, bytes):
        return None if len(value) % 4 else np.frombuffer(value, dtype="<i4")
    try:
        return np.asarray(value, dtype=np.int64)
    except OverflowError:
        return None


def _joint_ids(arrays: list[npt.NDArray[np.integer[Any]]]) -> list[tuple[bytes, int]] | None:
    """Each of the (non-empty) id arrays packed as pack_ids() packs it, or None when one holds
    an id out of range. One reduction of each kind and one encoding per width, for all."""
    joined = np.concatenate(arrays)
    starts = np.cumsum([0] + [a.size for a in arrays[:-1]])
    lows = np.minimum.reduceat(joined, starts)
    tops = np.maximum.reduceat(joined, starts)
    if not _ids_in_range(int(lows.min()), int(tops.max())):
        return None
    widths = [id_width(int(t)) for t in tops.tolist()]
    out: list[tuple[bytes, int]] = [(b"", 0)] * len(arrays)
    for width in set(widths):
        idx = [i for i, w in enumerate(widths) if w == width]
        data = encode_ids(
            joined if len(idx) == len(arrays) else np.concatenate([arrays[i] for i in idx]),
            width,
        )
        for i, part in zip(idx, _split(data, [arrays[i].size * width for i in idx]), strict=True):
            out[i] = (part, width)
    return out


def _split(data: bytes, sizes: list[int]) -> list[bytes]:
    """``data`` cut into consecutive parts of ``sizes`` bytes."""
    ends = itertools.accumulate(sizes)
    return [data[end - size : end] for size, end in zip(sizes, ends, strict=True)]


def _pack_together(
    rollouts: Sequence[RolloutFields], max_tokens: int
) -> list[PackedRollout] | None:
    resp: list[npt.NDArray[np.integer[Any]]] = []
    prompts: dict[int, npt.NDArray[np.integer[Any]]] = {}  # non-empty ones, by position
    lps: dict[int, npt.NDArray[np.floating[Any]]] = {}
    for i, r in enumerate(rollouts):
        ids = _id_array(r.response_ids)
        if ids is None or not 0 < ids.size <= max_tokens:
            return None
        resp.append(ids)
        if r.prompt_ids is not None:
            p = _id_array(r.prompt_ids)
            if p is None or p.size > max_tokens:
                return None
            if p.size:
                prompts[i] = p
        if r.logprobs is not None:
            if isinstance(r.logprobs, bytes) and len(r.logprobs) % 4:
                return None
            lp = as_logprobs(r.logprobs, "")
            if lp.size != ids.size:
                return None
            lps[i] = lp
    packed_resp = _joint_ids(resp)
    packed_prompts = _joint_ids(list(prompts.values())) if prompts else []
    if packed_resp is None or packed_prompts is None:
        return None
    prompt_of = dict(zip(prompts, packed_prompts, strict=True))
    lp_of: dict[int, bytes] = {}
    if lps:
        joined = np.concatenate(list(lps.values()))
        if not _plainly_valid_logprobs(joined):
            return None
        parts = _split(joined.astype("<f4").tobytes(), [4 * lp.size for lp in lps.values()])
        lp_of = dict(zip(lps, parts, strict=True))
    rules = _many_rules(rollouts, resp)
    return [
        _packed(
            r.rollout_id,
            r.group_id,
            r.policy_version,
            packed_resp[i],
            int(resp[i].size),
            None if r.prompt_ids is None else prompt_of.get(i, (b"", 2)),
            lp_of.get(i),
            r.reward,
            r.finish_reason,
            r.metadata,
            rules.get(i),
            r.generator_id,
        )
        for i, r in enumerate(rollouts)
    ]


class StoredRollout(NamedTuple):
    """A rollout read back from Redis, arrays unpacked (a named tuple, quicker to build than a
    frozen dataclass: a lease builds one per rollout)."""

    rollout_id: str
    group_id: str | None
    policy_version: int
    prompt_ids: Int32Array | None
    response_ids: Int32Array
    logprobs: Float32Array | None
    reward: float | None  # None while it awaits its reward: never handed to a trainer
    finish_reason: str | None
    metadata: dict[str, Any] | None
    loss_mask: bytes | None  # a bit per token as stored (tokens.unpack_mask); None: all trained
    versions: Segments | None  # None: every token at policy_version
    generator_id: str | None


def unpack_rollouts(blobs: list[bytes]) -> list[StoredRollout]:
    """Rollouts read back from Redis; the id arrays of all of them are unpacked together."""
    unpackb = msgpack.unpackb
    docs = [unpackb(blob, raw=False) for blob in blobs]
    responses = unpack_many_ids([(d["r"], d["rw"]) for d in docs])
    prompts: list[Int32Array | None] = [None] * len(docs)
    with_prompt = [i for i, d in enumerate(docs) if "p" in d]
    if with_prompt:
        unpacked = unpack_many_ids([(docs[i]["p"], docs[i]["pw"]) for i in with_prompt])
        for i, arr in zip(with_prompt, unpacked, strict=True):
            prompts[i] = arr
    frombuffer = np.frombuffer
    return [
        StoredRollout(
            doc["i"],
            doc.get("g"),
            doc["v"],
            prompt,
            response,
            frombuffer(doc["l"], dtype="<f4") if "l" in doc else None,
            doc["w"],
            doc.get("f"),
            doc.get("m"),
            doc.get("k"),
            doc.get("vs"),
            doc.get("gi"),
        )
        for doc, response, prompt in zip(docs, responses, prompts, strict=True)
    ]
