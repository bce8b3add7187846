"""Partial rollouts (SPEC "Partial rollouts"): what a generator sampled of a prompt's responses
before it gave the prompt back. Their validation and stored form (the packed rollout format of
packing.py, so that a prefix compares like with like), their form in a work answer, and the
check that a rollout completing one starts with it. lua/lib/partials.lua keeps them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from app.broker.packing import (
    PackedRollout,
    RolloutFields,
    StoredRollout,
    pack_each,
    unpack_rollouts,
)
from app.broker.schemas import PartialJSON, PartialMsgpack
from app.broker.tokens import unpack_mask
from app.errors import ValidationFailed

__all__ = [
    "check_prefixes",
    "pack_partials",
    "partial_doc",
    "partials_wanted",
    "pass_of_group",
    "prefix_arrays",
    "prefix_mismatch",
]


def pack_partials(
    partials: Sequence[PartialJSON | PartialMsgpack], max_tokens: int
) -> list[PackedRollout]:
    """The stored form of a return's partials: checked as rollouts are (but for the reward,
    which they lack), each given once."""
    seen: set[str] = set()
    for p in partials:
        if p.rollout_id in seen:
            raise ValidationFailed(
                f"partial {p.rollout_id!r} is given twice in one return (duplicate_partial)"
            )
        seen.add(p.rollout_id)
    # Packed as a rollout of reward 0: the stored format has one; a work answer leaves it out.
    rewarded = [cast(RolloutFields, p.model_copy(update={"reward": 0.0})) for p in partials]
    return pack_each(rewarded, max_tokens)


def pass_of_group(group_id: str | None) -> str | None:
    """The prompt pass ('<prompt_id>#<pass>') a group id names when it has the form of a prompt
    attempt's ('<prompt_id>#<pass>.<attempt>'), else None; whether that pass exists is the
    store's to say."""
    if group_id is None:
        return None
    pk, dot, att = group_id.rpartition(".")
    head, hash_, number = pk.rpartition("#")
    if not (dot and hash_ and head and att.isdigit() and number.isdigit()):
        return None
    return pk


def partial_doc(p: StoredRollout, group_id: str) -> dict[str, Any]:
    """A kept partial as a work answer hands it out (:class:`PartialOut`), under the attempt's
    ``group_id``; its arrays stay numpy, which a msgpack answer carries as raw little-endian
    bytes and a JSON one as lists (app/api/_codec.py)."""
    n = p.response_ids.size
    return {
        "rollout_id": p.rollout_id,
        "group_id": group_id,
        "policy_version": p.policy_version,
        "prompt_ids": p.prompt_ids,
        "response_ids": p.response_ids,
        "logprobs": p.logprobs,
        "loss_mask": None if p.loss_mask is None else unpack_mask(p.loss_mask, n),
        "versions": p.versions,
        "generator_id": p.generator_id,
        "finish_reason": p.finish_reason,
        "metadata": p.metadata,
    }


def prefix_arrays(r: StoredRollout) -> Mapping[str, npt.NDArray[Any] | None]:
    """The per-token arrays a completed rollout must start with, by field, besides its
    ``response_ids``: its ``logprobs``, its loss mask and the version of each token (from
    ``versions``, or its one ``policy_version``). A per-token field of a rollout joins here."""
    n = r.response_ids.size
    segments = r.versions or [[0, r.policy_version]]
    starts = [o for o, _ in segments] + [n]
    return {
        "logprobs": r.logprobs,
        "loss_mask": (
            np.ones(n, dtype=np.uint8) if r.loss_mask is None else unpack_mask(r.loss_mask, n)
        ),
        "versions": np.repeat(np.array([v for _, v in segments], dtype=np.int64), np.diff(starts)),
    }


def prefix_mismatch(prefix: StoredRollout, posted: StoredRollout) -> str | None:
    """The first field in which ``posted`` does not start with the partial ``prefix`` (the
    same tokens, then the same per-token arrays of :func:`prefix_arrays`), or None."""
    n = prefix.response_ids.size
    if posted.response_ids.size < n or not np.array_equal(
        posted.response_ids[:n], prefix.response_ids
    ):
        return "response_ids"
    theirs = prefix_arrays(posted)
    for field, mine in prefix_arrays(prefix).items():
        other = theirs[field]
        if mine is None or other is None:
            if mine is not other:
                return field
        elif not np.array_equal(other[:n], mine):
            return field
    return None


def partials_wanted(packed: Sequence[PackedRollout]) -> dict[str, list[str]]:
    """The rollout ids of ``packed`` whose group names a prompt attempt, by prompt pass: the
    partials :func:`check_prefixes` needs (``attempt_reads`` of app/broker/pass_reads.py
    reads them)."""
    wanted: dict[str, list[str]] = {}
    for r in packed:
        pk = pass_of_group(r.group_id)
        if pk is not None:
            wanted.setdefault(pk, []).append(r.rollout_id)
    return wanted


def check_prefixes(packed: Sequence[PackedRollout], kept: Mapping[str, bytes]) -> None:
    """422 (``prefix_mismatch``) for the whole request when a rollout that completes a kept
    partial (same rollout_id, its prompt attempt's group) does not start with it: ``kept``,
    the partials of :func:`partials_wanted`, by rollout id. Partials change only when their
    attempt ends, so a check made before ingest holds for a rollout the ingest accepts: one
    of an attempt that ended since is ``stale_attempt``."""
    if not kept:
        return
    posted = {r.rollout_id: r for r in packed if pass_of_group(r.group_id) is not None}
    rids = list(kept)
    prefixes = unpack_rollouts([kept[rid] for rid in rids])
    completed = unpack_rollouts([posted[rid].blob for rid in rids])
    for rid, prefix, full in zip(rids, prefixes, completed, strict=True):
        field = prefix_mismatch(prefix, full)
        if field is not None:
            raise ValidationFailed(
                f"rollout {rid!r} does not start with its partial of {prefix.response_ids.size} "
                f"tokens given back before: its {field} differ (prefix_mismatch)"
            )
