"""The prompt ledger's pass states: their order within and across attempts, how two events'
states of one pass merge (:class:`PassState`), and how the run's counters of passes per state
move with a ledger row (:class:`PassCounts`)."""

from __future__ import annotations

from dataclasses import dataclass

from app.events import EventError

__all__ = ["MAX_PASSES", "PASS_RANK", "PassCounts", "PassState", "pass_state"]

# A pass's states within one attempt: queued < in_flight < done = failed = skipped = cancelled
# (all final; skipped: queued in a difficulty pool of weight 0, its pass over without generation;
# cancelled: its run closed before it was over).
PASS_RANK = {"queued": 0, "in_flight": 1, "done": 2, "failed": 2, "skipped": 2, "cancelled": 2}

# More passes than this in one `registered` item is not a real run's epochs but a broken event;
# folding it would build that many rows in memory.
MAX_PASSES = 100_000


@dataclass(frozen=True, slots=True)
class PassState:
    """What one event says about one prompt pass.

    States are ordered by :attr:`order`: the attempt, then the state's rank, then the state's
    name, which only separates ``done`` from ``failed`` at one attempt (never both for a real
    pass, but the order must be total for the result not to depend on which came first).
    :meth:`merge` keeps the greatest state, the largest ``tries`` (it only ever grows, and a
    ``work_leased`` item does not carry it) and, of the events that said the winning state,
    the earliest time. Each of the three is commutative and associative, so folding a pass's
    events in any order, in any grouping, gives one row.
    """

    attempt: int
    state: str
    tries: int
    t_ms: int

    @property
    def order(self) -> tuple[int, int, str]:
        return (self.attempt, PASS_RANK[self.state], self.state)

    def merge(self, other: PassState) -> PassState:
        mine, theirs = self.order, other.order
        winner = self if mine >= theirs else other
        t_ms = min(self.t_ms, other.t_ms) if mine == theirs else winner.t_ms
        return PassState(winner.attempt, winner.state, max(self.tries, other.tries), t_ms)


@dataclass
class PassCounts:
    """Change of the run's prompt-pass counters: rows per state, and Σ (attempt - 1)."""

    prompts_queued: int = 0
    prompts_in_flight: int = 0
    prompts_done: int = 0
    prompts_failed: int = 0
    prompts_skipped: int = 0
    prompts_cancelled: int = 0
    prompts_retried: int = 0

    def move(self, old: PassState | None, new: PassState) -> None:
        """A ledger row went from ``old`` (``None``: it did not exist) to ``new``."""
        retried = new.attempt - 1
        if old is not None:
            self._add(old.state, -1)
            retried -= old.attempt - 1
        self._add(new.state, 1)
        self.prompts_retried += retried

    def _add(self, state: str, n: int) -> None:
        name = f"prompts_{state}"
        setattr(self, name, getattr(self, name) + n)


def pass_state(state: str, attempt: int, tries: int, t_ms: int) -> PassState:
    if state not in PASS_RANK:
        raise EventError(f"unknown prompt pass state {state!r}")
    return PassState(attempt, state, tries, t_ms)
