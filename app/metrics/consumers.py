"""The per-consumer figures of ``GET /metrics`` with a bounded label set: the consumers of a run
that were delivered the most items get a ``consumer`` label of their own, the others are summed
under ``consumer="(other)"``, a label no consumer's name can take (``app.ids``'s
CONSUMER_NAME_PATTERN: letters, digits, ``_``, ``.`` and ``-``)."""

from __future__ import annotations

from collections.abc import Mapping

from app.accounting.schemas import ConsumerCounts

__all__ = ["OTHER_CONSUMERS", "STATES", "label_consumers"]

OTHER_CONSUMERS = "(other)"
STATES = ("delivered", "acked", "pending", "dropped")
"""The ``state`` label of ``rollout_broker_consumer_items``: the fields of ConsumerCounts."""


def label_consumers(
    consumers: Mapping[str, ConsumerCounts], bound: int
) -> tuple[tuple[str, ConsumerCounts], ...]:
    """(label, counts) of a run's consumers: the ``bound`` delivered the most items (ties by
    name) under their own names, the rest summed under ``(other)`` (absent when there is no
    rest). Delivered only grows, so a consumer's label does not come and go between scrapes
    unless another overtakes it."""
    ranked = sorted(consumers.items(), key=lambda kv: (-kv[1].delivered, kv[0]))
    labelled = list(ranked[:bound])
    rest = [counts for _, counts in ranked[bound:]]
    if rest:
        labelled.append(
            (
                OTHER_CONSUMERS,
                ConsumerCounts(**{state: sum(getattr(c, state) for c in rest) for state in STATES}),
            )
        )
    return tuple(labelled)
