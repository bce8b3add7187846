"""Loss masks and per-token versions: the rules a posted rollout's ``loss_mask`` and
``versions`` obey, and what a hand-out makes of them.

A rollout's tokens with ``loss_mask`` 0 (tool output, environment and user turns) are stored and
handed out but never trained on: no statistic counts them. ``versions`` gives the version that
sampled each token, run-length encoded as ``[[offset, version], ...]``. Over the trained tokens,
``v_old`` (the oldest version, which must be the rollout's ``policy_version``) and ``v_new`` (the
newest) are what the run's rules judge (``stale_tokens``, app/broker/lua/lib/run.lua).

At hand-out under ``stale_tokens: mask``, every trained token sampled below the lease's *token
floor* (``V - max_staleness``) is handed out with mask 0 as well, and counted as masked stale.
"""

from __future__ import annotations

import operator
from bisect import bisect_right
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from app.errors import ValidationFailed

U8Array = npt.NDArray[np.uint8]
Segments = list[list[int]]  # [[offset, version], ...]


class TokenRules(NamedTuple):
    """What ingest keeps of a rollout's mask and versions (a named tuple, quicker to build than
    a frozen dataclass: a request builds one per rollout)."""

    mask: bytes | None  # one bit per token (np.packbits); None: every token is trained
    versions: Segments | None  # None: every token at policy_version
    v_new: int  # the newest version over trained tokens
    masked: int  # tokens with loss_mask 0


def mask_bytes(value: list[int] | bytes, n: int, rid: str) -> bytes:
    """A loss mask of ``n`` tokens as uint8 bytes: 0 or 1 each, at least one 1, else 422."""
    if isinstance(value, bytes):
        raw = value
    else:
        try:
            arr = np.asarray(value, dtype=np.int64)
        except OverflowError:
            raise _broken(rid, "loss_mask values must be 0 or 1") from None
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 1):
            raise _broken(rid, "loss_mask values must be 0 or 1")
        raw = arr.astype(np.uint8).tobytes()
    if len(raw) != n:
        raise _broken(rid, f"loss_mask has {len(raw)} values for {n} response tokens")
    ones = raw.count(1)  # bytes.count, find and rfind: C loops, no array made
    if ones + raw.count(0) != n:  # (the caller counts again: cheaper than a tuple back)
        raise _broken(rid, "loss_mask values must be 0 or 1")
    if not ones:
        raise _broken(rid, "loss_mask masks every token; at least one is trained")
    return raw


def _broken(rid: str, rule: str) -> ValidationFailed:
    return ValidationFailed(f"rollout {rid!r}: {rule}")


def version_offsets(segments: Segments, n: int, rid: str) -> tuple[int, ...]:
    """The segments' offsets: strictly increasing from 0 and inside the response, the versions
    non-decreasing, else 422."""
    # One zip splits the pairs (validated as pairs) into offsets and versions, and pairwise
    # comparisons by map check their order: C loops, where Python ones cost a rollout ~5 µs.
    offsets, vs = zip(*segments, strict=True)
    if offsets[0] != 0:
        raise _broken(rid, "versions must start at offset 0")
    if not all(map(operator.lt, offsets, offsets[1:])):
        raise _broken(rid, "versions offsets must be strictly increasing")
    if offsets[-1] >= n:
        raise _broken(rid, f"versions offset {offsets[-1]} is beyond the response ({n} tokens)")
    if not all(map(operator.le, vs, vs[1:])):
        raise _broken(rid, "versions must not decrease")
    return offsets


Tokens = tuple[str, int, int, list[int] | bytes | None, Segments | None]
"""A rollout's (rollout_id, response tokens, policy_version, loss_mask, versions)."""


def token_rules(
    rid: str,
    n: int,
    policy_version: int,
    loss_mask: list[int] | bytes | None,
    versions: Segments | None,
) -> TokenRules:
    """Check a rollout's mask and versions against its ``n`` response tokens (422 naming the
    rule broken) and give what ingest keeps of them."""
    return many_token_rules([(rid, n, policy_version, loss_mask, versions)])[0]


def many_token_rules(rollouts: list[Tokens]) -> list[TokenRules]:
    """:func:`token_rules` of each rollout, the first rule broken raised; the masks kept are
    packed to bits together, in one numpy pass rather than three calls a rollout."""
    checked = [_checked(*r) for r in rollouts]
    bits = pack_masks([c[0] for c in checked])
    return [TokenRules(b, *c[1:]) for b, c in zip(bits, checked, strict=True)]


def pack_masks(masks: list[bytes | None]) -> list[bytes | None]:
    """Each uint8 mask as np.packbits packs it (a bit a token, the last byte zero-padded): the
    masks, each zero-padded to whole bytes of bits, packed at once and cut apart."""
    kept = [m for m in masks if m is not None]
    if not kept:
        return [None] * len(masks)
    joined = b"".join([m + bytes(-len(m) % 8) for m in kept])
    packed = np.packbits(np.frombuffer(joined, np.uint8)).tobytes()
    out: list[bytes | None] = []
    at = 0
    for m in masks:
        if m is None:
            out.append(None)
        else:
            end = at + (len(m) + 7) // 8
            out.append(packed[at:end])
            at = end
    return out


def _checked(
    rid: str,
    n: int,
    policy_version: int,
    loss_mask: list[int] | bytes | None,
    versions: Segments | None,
) -> tuple[bytes | None, Segments | None, int, int]:
    """The rules of :func:`token_rules`: the uint8 mask to store (None: every token trained),
    then the other fields of its :class:`TokenRules`."""
    mask = None if loss_mask is None else mask_bytes(loss_mask, n, rid)
    masked = 0 if mask is None else n - mask.count(1)
    # Stored a bit a token: an eighth of the bytes Redis would hold as uint8.
    kept = mask if mask and masked else None
    if versions is None:
        return kept, None, policy_version, masked
    offsets = version_offsets(versions, n, rid)
    if mask is not None and masked:
        v_old = versions[bisect_right(offsets, mask.find(1)) - 1][1]
        v_new = versions[bisect_right(offsets, mask.rfind(1)) - 1][1]
    else:
        v_old, v_new = versions[0][1], versions[-1][1]
    if v_old != policy_version:
        raise _broken(
            rid,
            f"policy_version {policy_version} is not the oldest version of its trained tokens "
            f"({v_old})",
        )
    return kept, None if len(versions) == 1 else versions, v_new, masked


def unpack_mask(bits: bytes, n: int) -> U8Array:
    """A stored mask (a bit a token) as uint8 0/1 per token."""
    return np.unpackbits(np.frombuffer(bits, np.uint8), count=n)


class HandOut(NamedTuple):
    """A rollout's tokens as one lease hands them out (a named tuple: a lease builds one per
    rollout)."""

    mask: U8Array | None  # None: every token trained
    trained: int  # tokens with mask 1
    stale: int  # trained tokens masked for their own lag
    lag_sum: int  # Σ over trained tokens of V - the token's version


def hand_out(
    mask: bytes | None,
    versions: Segments | None,
    policy_version: int,
    n: int,
    V: int,
    floor: int | None,
) -> HandOut:
    """The mask, trained tokens and token lag of a stored rollout of ``n`` tokens handed out at
    version ``V``; with a token ``floor``, trained tokens sampled below it are masked too."""
    if floor is None or policy_version >= floor:  # no token below the floor: nothing masked
        if mask is None:  # every token trained: each segment's tokens by its offsets
            if versions is None:  # the plain rollout: one version, every token trained
                return HandOut(None, n, 0, n * (V - policy_version))
            segs = versions
            ends = [o for o, _ in segs[1:]] + [n]
            lag = sum((end - o) * (V - v) for (o, v), end in zip(segs, ends, strict=True))
            return HandOut(None, n, 0, lag)
        if versions is None:  # one version: its trained tokens are the mask's ones
            trained = int.from_bytes(mask, "big").bit_count()  # packbits pads with 0 bits
            return HandOut(unpack_mask(mask, n), trained, 0, trained * (V - policy_version))
    return _hand_out_arrays(mask, versions, policy_version, n, V, floor)


def _hand_out_arrays(
    mask: bytes | None,
    versions: Segments | None,
    policy_version: int,
    n: int,
    V: int,
    floor: int | None,
) -> HandOut:
    """:func:`hand_out` in arrays: what a mask over several versions, or a floor, needs."""
    segs = versions or [[0, policy_version]]
    starts = np.array([o for o, _ in segs], dtype=np.int64)
    vers = np.array([v for _, v in segs], dtype=np.int64)
    arr = None if mask is None else unpack_mask(mask, n)
    if arr is None:
        counts = np.diff(np.append(starts, n))
    else:
        counts = np.add.reduceat(arr.astype(np.int64), starts)
    stale = 0
    if floor is not None and int(vers[0]) < floor:
        old = vers < floor
        stale = int(counts[old].sum())
        out = np.ones(n, dtype=np.uint8) if arr is None else arr.copy()
        cut = int(starts[np.flatnonzero(~old)[0]]) if (~old).any() else n
        out[:cut] = 0
        arr, counts = out, np.where(old, 0, counts)
    return HandOut(arr, int(counts.sum()), stale, int((counts * (V - vers)).sum()))
