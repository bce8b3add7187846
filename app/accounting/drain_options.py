"""How the accounting drain reads, retries, trims and waits for replicas
(:class:`DrainOptions`, the ``BROKER_DRAIN_*`` and ``BROKER_REDIS_WAIT_*`` settings), and what
one pass did (:class:`DrainCounts`); the drain itself is app/accounting/drain.py."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from app.accounting.consumers import ALIVE_WITHIN_S
from app.settings import Settings

__all__ = ["DrainCounts", "DrainOptions"]


def _default(name: str) -> Any:
    """The default of setting ``drain_<name>``: Settings keeps the one copy of each."""
    return Settings.model_fields[f"drain_{name}"].default


@dataclass(frozen=True, slots=True)
class DrainOptions:
    """How the drain reads, retries and trims: the ``BROKER_DRAIN_*`` settings
    (:meth:`from_settings`), or chosen directly by tests."""

    batch_size: int = _default("batch_size")
    block_ms: int = _default("block_ms")
    claim_idle_ms: int = _default("claim_idle_ms")
    heartbeat_timeout_ms: int = _default("heartbeat_timeout_ms")
    max_deliveries: int = _default("max_deliveries")
    trim: bool = _default("trim")
    # Rounds of new reads in one pass, so one busy run cannot starve trimming and claiming.
    max_rounds: int = 20
    # Silent consumers taken over in one go.
    max_takeovers: int = 16
    # BROKER_REDIS_WAIT_*: events are committed only once this many replicas have them.
    wait_replicas: int = Settings.model_fields["redis_wait_replicas"].default
    wait_timeout_ms: int = Settings.model_fields["redis_wait_timeout_ms"].default

    @property
    def beat_s(self) -> float:
        """How often a consumer sends its heartbeat and looks for silent ones: every quarter of
        the heartbeat timeout, and at least four times within the readiness window, so that a
        running drain keeps /readyz ready whatever the timeout."""
        return min(self.heartbeat_timeout_ms / 4000, ALIVE_WITHIN_S / 4)

    @classmethod
    def from_settings(cls, settings: Settings) -> DrainOptions:
        return cls(
            batch_size=settings.drain_batch_size,
            block_ms=settings.drain_block_ms,
            claim_idle_ms=settings.drain_claim_idle_ms,
            heartbeat_timeout_ms=settings.drain_heartbeat_timeout_ms,
            max_deliveries=settings.drain_max_deliveries,
            trim=settings.drain_trim,
            wait_replicas=settings.redis_wait_replicas,
            wait_timeout_ms=settings.redis_wait_timeout_ms,
        )


@dataclass(slots=True)
class DrainCounts:
    """What one pass did."""

    streams: int = 0
    read: int = 0
    applied: int = 0
    already: int = 0
    acked: int = 0
    retrying: int = 0
    unreplicated: int = 0  # left pending: too few replicas had them (BROKER_REDIS_WAIT_REPLICAS)
    dead: int = 0
    missing: int = 0
    trimmed: int = 0
    taken_over: int = 0  # entries moved here from silent consumers
    consumers_deleted: int = 0
    checked: int = 0  # runs whose ledger was checked against the live counts
    mismatched: int = 0  # ... and disagreed

    def add(self, other: DrainCounts) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
