"""The per-generator figures of ``GET /metrics`` with a bounded label set: the generators of a
run with the most rollouts (and every quarantined one) get a ``generator`` label of their own,
the others are summed under ``generator="other"``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from app.accounting.models import GeneratorTotals

__all__ = ["OTHER", "GeneratorFigures", "label_generators"]

OTHER = "other"


@dataclass(frozen=True, slots=True)
class GeneratorFigures:
    """A generator's ledger sums (or the sums of several), from which its means follow."""

    rollouts: int = 0
    samples_consumed: int = 0
    kl_tokens: int = 0
    kl_sum: float = 0.0
    ratio_tokens: int = 0
    clipped: int = 0
    zero_weight: int = 0
    quarantined: bool = False

    @classmethod
    def of(cls, row: GeneratorTotals) -> GeneratorFigures:
        return cls(
            row.rollouts,
            row.samples_consumed,
            row.kl_tokens,
            row.kl_sum,
            row.ratio_tokens,
            row.clipped,
            row.zero_weight,
            row.quarantined,
        )

    def __add__(self, other: GeneratorFigures) -> GeneratorFigures:
        return GeneratorFigures(
            self.rollouts + other.rollouts,
            self.samples_consumed + other.samples_consumed,
            self.kl_tokens + other.kl_tokens,
            self.kl_sum + other.kl_sum,
            self.ratio_tokens + other.ratio_tokens,
            self.clipped + other.clipped,
            self.zero_weight + other.zero_weight,
            self.quarantined or other.quarantined,
        )

    @property
    def kl_mean(self) -> float | None:
        return self.kl_sum / self.kl_tokens if self.kl_tokens else None

    @property
    def clip_fraction(self) -> float | None:
        return self.clipped / self.ratio_tokens if self.ratio_tokens else None

    @property
    def masked_fraction(self) -> float | None:
        return self.zero_weight / self.ratio_tokens if self.ratio_tokens else None


def label_generators(
    rows: Sequence[GeneratorTotals], bound: int
) -> tuple[tuple[str, GeneratorFigures], ...]:
    """(label, figures) of a run's generators: the ``bound`` with the most rollouts (ties by
    generator_id) and every quarantined one under their own ids, the rest summed under
    ``other`` (absent when there is no rest)."""
    ranked = sorted(rows, key=lambda row: (-row.rollouts, row.generator_id))
    own = {row.generator_id for row in ranked[:bound]}
    own |= {row.generator_id for row in rows if row.quarantined}
    labelled = [
        (row.generator_id, GeneratorFigures.of(row)) for row in ranked if row.generator_id in own
    ]
    rest = [GeneratorFigures.of(row) for row in ranked if row.generator_id not in own]
    if rest:
        total = GeneratorFigures()
        for figures in rest:
            total += figures
        labelled.append((OTHER, total))
    return tuple(labelled)
