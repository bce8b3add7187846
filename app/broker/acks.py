"""The Python half of an ack: the rules on the rollout ids it names, the trainer's logprobs
checked and set against the generator's (:mod:`app.broker.stats` computes the figures), and the
``acked`` event the ack script records."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt

from app.broker.behaviour import BatchRow
from app.broker.config import RunConfig
from app.broker.correction import zero_weights
from app.broker.packing import as_logprobs, check_logprobs
from app.broker.records import BatchMember
from app.broker.replies import AckAnswer
from app.broker.schemas import AckResult, BatchStats
from app.broker.stats import BatchFigures, Measured, batch_figures
from app.broker.tokens import hand_out
from app.errors import ValidationFailed
from app.events import Acked, AckedGen, AckedItem, AckStats, AckSums, pack_payload


def check_ack_ids(
    batch_id: str,
    rows: Sequence[BatchRow],
    logprobs: Mapping[str, Any],
    kl: Mapping[str, Any],
) -> None:
    """An ack names only rollouts of its batch, each with logprobs or a kl, not both."""
    unknown = (logprobs.keys() | kl.keys()) - {row.rollout_id for row in rows}
    if unknown:
        raise ValidationFailed(
            f"batch {batch_id!r} has no rollout {sorted(unknown)[0]!r} "
            f"({len(unknown)} unknown rollout ids)"
        )
    both = logprobs.keys() & kl.keys()
    if both:
        raise ValidationFailed(
            f"rollout {sorted(both)[0]!r} has both logprobs and kl; give one of them"
        )


def measure(
    rows: Sequence[BatchRow],
    logprobs: dict[str, Any],
    kl: Mapping[str, float],
    config: RunConfig,
) -> tuple[BatchFigures, BatchStats]:
    """The batch's off-policy figures from the trainer's logprobs (or ready-made kl values)."""
    return figures(rows, current_logprobs(rows, logprobs), kl, config)


def figures(
    rows: Sequence[BatchRow],
    current: Mapping[str, npt.NDArray[np.floating[Any]]],
    kl: Mapping[str, float],
    config: RunConfig,
    *,
    per_rollout: bool = False,
) -> tuple[BatchFigures, BatchStats]:
    """The batch's off-policy figures from logprobs :func:`current_logprobs` checked (or
    ready-made kl values); with ``per_rollout``, its sums rollout by rollout as well. Ready-made
    kl values were bounded by AckBody, and stats.py caps what it computes: every figure is
    finite, so the acked event can always be applied."""
    items = [
        Measured(
            row.old,
            current.get(row.rollout_id),
            kl.get(row.rollout_id),
            row.given.trained,
            row.given.mask,
        )
        for row in rows
    ]
    zero = partial(zero_weights, correction=config.correction) if per_rollout else None
    fig = batch_figures(items, config.kl_estimator, config.clip_epsilon, per_rollout=zero)
    stats = BatchStats(
        kl_mean=fig.kl_mean,
        kl_max=fig.kl_max,
        is_ratio_mean=fig.is_ratio_mean,
        clip_fraction=fig.clip_fraction,
        ess_fraction=fig.ess_fraction,
    )
    return fig, stats


def ack_result(answer: AckAnswer, size: int) -> AckResult:
    return AckResult(
        consumed=size,
        retired=answer.retired,
        flushed=answer.flushed,
        kl_coef=answer.kl_coef,
        stats=BatchStats.model_validate_json(answer.stats_json),
    )


def batch_row(m: BatchMember, V: int, floor: int | None) -> BatchRow:
    """A rollout of a batch read back from Redis, handed out at ``V`` with token ``floor``."""
    doc = msgpack.unpackb(m.blob, raw=False) if m.blob is not None else {}
    lp = doc.get("l")
    old = np.frombuffer(lp, dtype="<f4") if lp is not None else None
    given = hand_out(
        doc.get("k"), doc.get("vs"), doc.get("v", m.policy_version), m.tokens, V, floor
    )
    return BatchRow(
        m.rollout_id, m.policy_version, m.tokens, old, given, doc.get("gi"), doc.get("w")
    )


def current_logprobs(
    rows: Sequence[BatchRow], given: dict[str, Any], call: str = "ack"
) -> dict[str, npt.NDArray[np.floating[Any]]]:
    """The logprobs of an ack (or of the ``call`` named) by rollout id. They are validated in
    one pass over all the batch's tokens; only when that fails is each rollout checked, to
    name the one at fault."""
    arrays: dict[str, npt.NDArray[np.floating[Any]]] = {}
    for row in rows:
        value = given.get(row.rollout_id)
        if value is None:
            continue
        if isinstance(value, bytes) and len(value) == 4 * row.tokens:
            arr = np.frombuffer(value, dtype="<f4")  # raw float32, one per token
        else:
            what = f"{call} logprobs of rollout {row.rollout_id!r}"
            arr = as_logprobs(value, what)
            if arr.size != row.tokens:
                raise ValidationFailed(f"{what}: {arr.size} values for {row.tokens} tokens")
        arrays[row.rollout_id] = arr
    if arrays:
        try:
            check_logprobs(np.concatenate(list(arrays.values())), f"{call} logprobs")
        except ValidationFailed:
            for rid, arr in arrays.items():
                check_logprobs(arr, f"{call} logprobs of rollout {rid!r}")
            raise
    return arrays


def _acked_item(row: BatchRow, V: int, kl: float | None) -> AckedItem:
    """A sample of the ``acked`` event: its trained tokens, and the masked stale ones and their
    token lag when its tokens are not all at its own version's lag (else left out), and its
    reward."""
    g = row.given
    plain = g.lag_sum == g.trained * (V - row.policy_version)
    return AckedItem(
        row.rollout_id,
        row.policy_version,
        g.trained,
        kl,
        g.stale,
        None if plain else g.lag_sum,
        row.reward,
    )


def acked_event(
    batch_id: str,
    step: int | None,
    policy_version: int,
    rows: Sequence[BatchRow],
    fig: BatchFigures,
    stats: BatchStats,
    gens: tuple[AckedGen, ...] = (),
) -> bytes:
    """The ``acked`` event's payload, without ``t``: the ack script adds it when it records it."""
    return pack_payload(
        "acked",
        Acked(
            batch_id=batch_id,
            step=step,
            policy_version=policy_version,
            items=tuple(
                _acked_item(row, policy_version, k) for row, k in zip(rows, fig.kl, strict=True)
            ),
            stats=AckStats(
                kl_mean=stats.kl_mean,
                kl_max=stats.kl_max,
                is_ratio_mean=stats.is_ratio_mean,
                clip_fraction=stats.clip_fraction,
                ess_fraction=stats.ess_fraction,
            ),
            sums=AckSums(
                kl_tokens=fig.kl_tokens,
                kl_sum=fig.kl_sum,
                ratio_tokens=fig.ratio_tokens,
                ratio_sum=fig.ratio_sum,
                clipped=fig.clipped,
            ),
            gens=gens,
        ),
    )
