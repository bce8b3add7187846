"""The README's Python tour runs as written and prints what the README says it prints."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.client.live import REPO, LiveServer

pytestmark = pytest.mark.slow  # the tour runs in a subprocess against a live broker


def blocks(kind: str) -> list[str]:
    """The README's fenced blocks of language ``kind`` ("" for none), in order."""
    out: list[str] = []
    lang: str | None = None
    lines: list[str] = []
    for line in (REPO / "README.md").read_text().splitlines(keepends=True):
        if lang is None and line.startswith("```"):
            lang, lines = line[3:].strip(), []
        elif lang is not None and line.rstrip() == "```":
            if lang == kind:
                out.append("".join(lines))
            lang = None
        elif lang is not None:
            lines.append(line)
    return out


def test_python_tour(live_server: LiveServer) -> None:
    (code,) = [b for b in blocks("python") if "BrokerClient" in b]
    printed = next(b for b in blocks("") if b.startswith("accepted "))
    code = code.replace("http://127.0.0.1:8000", live_server.url)
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == printed
