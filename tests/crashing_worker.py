"""``rollout-broker worker`` that exits right after its Nth Postgres commit, before the XACK of
that commit's entries: the drain's crash window, hit on purpose.

    python -m tests.crashing_worker N [worker options]

The drain's commit is wrapped to call ``os._exit(CRASH_EXIT_CODE)`` once it has committed ``N``
times; everything else is the real command (``app.cli`` run as ``__main__``)."""

from __future__ import annotations

import logging
import os
import runpy
import sys
from collections.abc import Sequence
from typing import Final

from app.accounting import repository
from app.accounting.drain import Drainer
from app.events import Event

CRASH_EXIT_CODE: Final = 75

log = logging.getLogger(__name__)


def crash_after(commits: int) -> None:
    """Make every :class:`Drainer` of this process exit after ``commits`` commits in all."""
    commit = Drainer._commit
    done = 0

    async def commit_then_exit(
        self: Drainer, run_id: str, events: Sequence[Event]
    ) -> repository.ApplyResult:
        nonlocal done
        result = await commit(self, run_id, events)
        done += 1
        if done >= commits:
            log.warning("%d commits made: exiting before their XACK", done)
            os._exit(CRASH_EXIT_CODE)
        return result

    Drainer._commit = commit_then_exit  # type: ignore[method-assign]


def main(argv: list[str]) -> None:
    crash_after(int(argv[0]))
    sys.argv = ["rollout-broker", "worker", *argv[1:]]
    runpy.run_module("app.cli", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
