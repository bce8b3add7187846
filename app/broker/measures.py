"""The Python half of ``measure`` (SPEC "Correction before the update"): the rule that every
rollout of the batch is named, the answer (the ack's figures with the correction's weights),
and the measured logprobs as they are kept with the lease (the batch hash's ``ml``, written by
measure.lua, read back by an ack that carries none), plus the per-generator sums of the
``acked`` event.

The kept form is one blob: a dtype byte (``f`` float32, ``d`` float64) and then every rollout's
logprobs in the batch's row order, little-endian. Logprobs that all came as float32 bytes are
kept as float32, any that came as JSON floats make it float64: an ack that reads them back
computes from exactly the values it would have been given itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from app.broker.acks import check_ack_ids, figures
from app.broker.behaviour import BatchRow
from app.broker.config import RunConfig
from app.broker.correction import correct
from app.broker.stats import BatchFigures, Measured
from app.errors import ValidationFailed
from app.events import AckedGen

Logprobs = npt.NDArray[np.floating[Any]]
F32 = npt.NDArray[np.float32]

_DTYPES: dict[int, np.dtype[Any]] = {b"f"[0]: np.dtype("<f4"), b"d"[0]: np.dtype("<f8")}


@dataclass(frozen=True, slots=True)
class MeasureAnswer:
    """The answer of ``measure``, rollouts in the batch's order."""

    rollout_ids: list[str]
    weights: list[F32]  # per rollout, one per response token
    sequence_weights: list[float]
    stats: dict[str, float | None]  # the ack's figures, masked_fraction and chi2
    kl_coef: float | None = None


def check_all_named(batch_id: str, rows: Sequence[BatchRow], logprobs: Mapping[str, Any]) -> None:
    """A measure names every rollout of its batch, and no other (the ack's rule on the ids it
    names, and then every one)."""
    check_ack_ids(batch_id, rows, logprobs, {})
    missing = [row.rollout_id for row in rows if row.rollout_id not in logprobs]
    if missing:
        raise ValidationFailed(
            f"measure needs the logprobs of every rollout of batch {batch_id!r}: rollout "
            f"{missing[0]!r} has none ({len(missing)} missing)"
        )


def pack_measured(rows: Sequence[BatchRow], current: Mapping[str, Logprobs]) -> bytes:
    """The kept form of a measure's (checked) logprobs of every rollout."""
    arrays = [current[row.rollout_id] for row in rows]
    as_f32 = all(a.dtype == np.float32 for a in arrays)
    tag, dtype = (b"f", "<f4") if as_f32 else (b"d", "<f8")
    return b"".join([tag, *(np.asarray(a, dtype=dtype).tobytes() for a in arrays)])


def unpack_measured(rows: Sequence[BatchRow], ml: bytes) -> dict[str, Logprobs]:
    """The kept logprobs by rollout id: views of the blob, as :func:`pack_measured` wrote it."""
    values = np.frombuffer(ml, dtype=_DTYPES[ml[0]], offset=1)
    out: dict[str, Logprobs] = {}
    at = 0
    for row in rows:
        out[row.rollout_id] = values[at : at + row.tokens]
        at += row.tokens
    if at != values.size:  # written for this batch's rows: never seen
        raise ValueError(f"kept logprobs hold {values.size} values for {at} tokens")
    return out


def measured_items(rows: Sequence[BatchRow], current: Mapping[str, Logprobs]) -> list[int]:
    """The rows with logprobs on both sides: those a correction weighs."""
    return [
        i
        for i, row in enumerate(rows)
        if row.old is not None and current.get(row.rollout_id) is not None
    ]


def _item(row: BatchRow, new: Logprobs) -> Measured:
    return Measured(row.old, new, None, row.given.trained, row.given.mask)


def measure_answer(
    rows: Sequence[BatchRow],
    current: Mapping[str, Logprobs],
    config: RunConfig,
) -> MeasureAnswer:
    """The weights under the run's correction over the tokens as the lease handed them out,
    and the ack's figures with ``masked_fraction`` and ``chi2``. A rollout ingested without
    behaviour logprobs weighs 1 on its trained tokens (0 on the others), its sequence weight is
    1, and no statistic counts it, as the ack counts it nowhere (docs/design.md)."""
    _, stats = figures(rows, current, {}, config)
    idx = measured_items(rows, current)
    cor = correct([_item(rows[i], current[rows[i].rollout_id]) for i in idx], config.correction)
    weights: list[F32] = []
    seq: list[float] = [1.0] * len(rows)
    for i, s in zip(idx, cor.sequence_weights.tolist(), strict=True):
        seq[i] = s
    got = dict(zip(idx, cor.weights, strict=True))
    for i, row in enumerate(rows):
        w = got.get(i)
        if w is None:
            mask = row.given.mask
            w = np.ones(row.tokens, np.float32) if mask is None else mask.astype(np.float32)
        weights.append(w)
    answer = MeasureAnswer(
        rollout_ids=[row.rollout_id for row in rows],
        weights=weights,
        sequence_weights=seq,
        stats={
            **stats.model_dump(),
            "masked_fraction": cor.masked_fraction,
            "chi2": cor.chi2,
        },
        kl_coef=None,  # measure.lua's, once it kept the logprobs
    )
    return answer


def generator_sums(rows: Sequence[BatchRow], fig: BatchFigures) -> tuple[AckedGen, ...]:
    """The ``acked`` event's per-generator sums: for each generator with rollouts in the batch
    (in their order), its samples and trained tokens, and the sums of :class:`AckSums` over its
    measured rollouts, with its largest rollout KL and its trained tokens the run's correction
    weighs 0. ``fig`` has the per-rollout sums (acks.figures ``per_rollout``). Rollouts without a
    generator_id are in no entry."""
    names = list(dict.fromkeys(row.generator for row in rows if row.generator is not None))
    per = fig.per
    if not names or per is None:
        return ()
    index = {name: j for j, name in enumerate(names)}
    gi = np.array([-1 if r.generator is None else index[r.generator] for r in rows], np.int64)
    named = gi >= 0
    g = gi[named]
    n = len(names)

    def by(values: Any) -> list[float]:
        out: list[float] = np.bincount(g, weights=np.asarray(values)[named], minlength=n).tolist()
        return out

    kl_max: list[float | None] = [None] * n
    for j, k in zip(gi.tolist(), fig.kl, strict=True):
        top = kl_max[j] if j >= 0 else None
        if j >= 0 and k is not None and (top is None or k > top):
            kl_max[j] = k
    samples = np.bincount(g, minlength=n).tolist()
    columns = (
        by([r.given.trained for r in rows]),
        by(per.kl_tokens),
        by(per.kl_sum),
        by(per.ratio_tokens),
        by(per.ratio_sum),
        by(per.clipped),
        by(per.zero_weight),
    )
    return tuple(
        AckedGen(
            generator_id=name,
            samples=samples[j],
            tokens=int(columns[0][j]),
            kl_tokens=int(columns[1][j]),
            kl_sum=columns[2][j],
            ratio_tokens=int(columns[3][j]),
            ratio_sum=columns[4][j],
            clipped=int(columns[5][j]),
            zero_weight=int(columns[6][j]),
            kl_max=kl_max[j],
        )
        for j, name in enumerate(names)
    )
