"""``rollout-broker`` commands as real processes for tests: each with an environment of its own
(no ``BROKER_*`` variable of the calling shell leaks in), its output kept, always stopped."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import httpx

REPO = Path(__file__).resolve().parents[1]
LISTENING = re.compile(r"Uvicorn running on (http://\S+)")


@dataclass
class Command:
    proc: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)

    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: re.Pattern[str], within: float = 60.0) -> re.Match[str]:
        """The first output line matching ``pattern``; fails after ``within`` seconds or when
        the process ended without printing one."""
        deadline = time.monotonic() + within
        while True:
            ended = self.proc.poll() is not None
            for line in list(self.lines):
                if m := pattern.search(line):
                    return m
            if ended or time.monotonic() > deadline:
                raise AssertionError(f"no line matching {pattern.pattern!r}:\n{self.output()}")
            time.sleep(0.02)

    def exit_code(self, within: float = 60.0) -> int:
        try:
            return self.proc.wait(within)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {within} s:\n{self.output()}") from None

    def stop(self, sig: signal.Signals = signal.SIGINT, within: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.exit_code(within)


def broker_env(**settings: str) -> dict[str, str]:
    """The caller's environment without its ``BROKER_*`` variables, plus ``settings``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BROKER_")}
    env.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", **settings)
    return env


@contextlib.contextmanager
def rollout_broker(*args: str, env: dict[str, str]) -> Iterator[Command]:
    """``rollout-broker <args>`` (as ``python -m app.cli``, the same entry point) in this
    checkout; killed on the way out if it is still running."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", *args],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    command = Command(proc)

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            command.lines.append(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        yield command
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        reader.join(5)


def readyz(url: str) -> httpx.Response:
    return httpx.get(f"{url}/readyz", timeout=10)


def until_ready(url: str, within: float = 30.0) -> httpx.Response:
    """/readyz once it answers 200, or its last answer after ``within`` seconds: a worker that
    starts beside the API sends its first heartbeat a moment after the API listens."""
    deadline = time.monotonic() + within
    while True:
        resp = readyz(url)
        if resp.status_code == 200 or time.monotonic() > deadline:
            return resp
        time.sleep(0.05)


def alembic_version_exists(database_url: str) -> bool:
    """Whether Alembic has ever run on the database (its ``alembic_version`` table)."""

    async def query() -> bool:
        conn = await asyncpg.connect(database_url.replace("postgresql+asyncpg://", "postgresql://"))
        try:
            return await conn.fetchval("SELECT to_regclass('alembic_version') IS NOT NULL")  # type: ignore[no-any-return]
        finally:
            await conn.close()

    return asyncio.run(query())
