"""A real broker in a subprocess for tests: ``rollout-broker serve`` on a free port, against the
test Redis (a key prefix of its own) and a Postgres database of its own, both made by
``tests/services.py``."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tests.services import REDIS_URL

REPO = Path(__file__).resolve().parents[2]
_LISTENING = re.compile(r"Uvicorn running on (http://\S+)")


@dataclass
class LiveServer:
    url: str
    proc: subprocess.Popen[str]
    log: list[str] = field(default_factory=list)

    def output(self) -> str:
        return "".join(self.log)


def broker_env(prefix: str, database_url: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BROKER_")}
    env.update(
        BROKER_REDIS_URL=REDIS_URL,
        BROKER_REDIS_PREFIX=prefix,
        BROKER_DATABASE_URL=database_url,
        PYTHONPATH=str(REPO),
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


@contextlib.contextmanager
def serve(env: Mapping[str, str], *, timeout_s: float = 60.0) -> Iterator[LiveServer]:
    """``rollout-broker serve --port 0 --with-workers --migrate``; yields once it listens
    (uvicorn logs the bound address only after the app's start-up has completed)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve", "--port", "0", "--with-workers", "--migrate"],
        cwd=REPO,
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    server = LiveServer("", proc)
    listening = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            server.log.append(line)
            m = _LISTENING.search(line)
            if m and not listening.is_set():
                server.url = m.group(1)
                listening.set()
        listening.set()  # the process ended: stop waiting

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        listening.wait(timeout_s)
        if not server.url:
            raise RuntimeError(f"the broker did not start:\n{server.output()}")
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        reader.join(5)
