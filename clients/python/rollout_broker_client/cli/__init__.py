"""The operator commands of Rollout Broker on the command line, built on the client's public
API: ``rollout-broker-ctl`` (the ``cli`` extra: typer and rich), the same commands that the
server's ``rollout-broker`` mounts beside ``serve``, ``worker`` and ``migrate``
(:func:`rollout_broker_client.cli.app.mount`).

Every error ends a command with one line on stderr (``error: ...``) and a non-zero status:
``1`` for what went wrong at run time, ``2`` for a bad command line. ``watch`` waits through a
broker that cannot be reached and a run that does not exist yet."""

from __future__ import annotations

import sys

__all__ = ["main"]

_EXTRA = {"typer", "click", "rich"}


def main() -> None:
    """``rollout-broker-ctl``: one line saying what to install when the ``cli`` extra is not."""
    try:
        from rollout_broker_client.cli.app import build
    except ModuleNotFoundError as exc:
        if exc.name not in _EXTRA:
            raise
        sys.stderr.write(
            f"error: the operator commands need {exc.name}: "
            "pip install 'rollout-broker-client[cli]'\n"
        )
        raise SystemExit(1) from None
    build()()
