"""Who is calling: the identity the access guard gives every request it lets through, which each
domain's endpoints read (may this caller touch that run?) without knowing tokens or scopes; the
entry of an operator action in the audit log (:func:`action_entry`), which the broker's scripts
write to the run's outbox with the change; and the log that moves those entries on
(``ActionLog``; the access domain keeps it)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from app.errors import Forbidden

__all__ = [
    "BROKER",
    "ActionLog",
    "Caller",
    "action_entry",
    "action_fields",
    "check_run",
    "run_matches",
]


@dataclass(frozen=True, slots=True)
class Caller:
    """A token's id, name, scopes and run patterns (None: every run)."""

    token_id: str
    name: str
    scopes: frozenset[str]
    runs: tuple[str, ...] | None = None

    def may_touch(self, run_id: str) -> bool:
        return self.runs is None or run_matches(self.runs, run_id)

    @property
    def every_run(self) -> bool:
        return self.runs is None


BROKER = Caller(token_id="broker", name="broker", scopes=frozenset())
"""Who the audit log names for what the broker does on its own (a generator's quarantine)."""


def run_matches(patterns: Iterable[str], run_id: str) -> bool:
    """True when ``run_id`` is one of ``patterns``: an exact id, or ``prefix*`` for every id
    that starts with ``prefix`` (``*`` alone matches every run)."""
    for p in patterns:
        if p.endswith("*"):
            if run_id.startswith(p[:-1]):
                return True
        elif p == run_id:
            return True
    return False


def check_run(caller: Caller, run_id: str) -> None:
    """Refuse (403) a caller whose token may not touch ``run_id``."""
    if not caller.may_touch(run_id):
        raise Forbidden(f"token {caller.name!r} may not touch run {run_id!r}")


def action_fields(
    caller: Caller, action: str, run_id: str | None, detail: Mapping[str, Any]
) -> dict[str, Any]:
    """An audit log entry but its time: who (the token's name and id) did what, to which run,
    with what."""
    return {
        "actor": caller.name,
        "token_id": caller.token_id,
        "action": action,
        "run_id": run_id,
        "detail": dict(detail),
    }


def action_entry(caller: Caller, action: str, run_id: str, detail: Mapping[str, Any]) -> bytes:
    """The entry of an action on a run as its script writes it to the run's outbox (field
    ``e``); the outbox's stream id tells when."""
    return orjson.dumps(action_fields(caller, action, run_id, detail))


class ActionLog(Protocol):
    """The audit log, as the endpoints of run actions see it: each action's script wrote its
    entry to the run's outbox; :meth:`moved` moves the run's outbox into the log now (raising
    when it cannot: the audit worker loop moves it later)."""

    async def moved(self, run_id: str) -> int: ...
