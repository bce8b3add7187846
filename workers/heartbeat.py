"""A file whose modification time says that every worker loop is making progress, for the
health check of a container that runs ``rollout-broker worker`` (it serves no HTTP)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

__all__ = ["Heartbeat"]


class Heartbeat:
    """Touches ``path`` each time every loop has completed a pass since the last touch, so the
    file goes stale when any one loop stops or keeps failing, not only when all of them do."""

    def __init__(self, path: Path | None, loops: Iterable[str]) -> None:
        self.path = path
        self._loops = frozenset(loops)
        self._waiting = set(self._loops)

    def beat(self, loop: str) -> None:
        self._waiting.discard(loop)
        if self._waiting:
            return
        self._waiting = set(self._loops)
        if self.path is not None:
            self.path.touch()
