"""Who is calling: the identity the access guard gives every request it lets through, which each
domain's endpoints read (may this caller touch that run?) without knowing tokens or scopes, and
the log of operator actions they write to (``ActionLog``; the access domain keeps it)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from app.errors import Forbidden

__all__ = ["ActionLog", "Caller", "check_run", "run_matches"]


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


class ActionLog(Protocol):
    """Where an operator action on run state is recorded, as its caller (the audit log)."""

    async def record(
        self, caller: Caller, action: str, run_id: str | None, detail: Mapping[str, Any]
    ) -> None: ...
