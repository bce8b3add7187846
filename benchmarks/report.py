"""The printed report: the table of rows with their ratios and verdicts, the machine, the
summary line."""

from __future__ import annotations

import contextlib
import math
import os
import platform
import subprocess
from pathlib import Path

from benchmarks.harness import Row
from benchmarks.servers import RedisTarget, uvicorn_stack


def fmt_value(v: float | None, unit: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if unit == "rollouts/s":
        return f"{v:,.0f} r/s"
    if unit == "prompts/s":
        return f"{v:,.0f} prompts/s"
    if unit == "ms":
        return f"{v:.2f} ms" if v < 100 else f"{v:,.0f} ms"
    return f"{v:,.0f} B"


def fmt_ratio(r: float | None) -> str:
    return "–" if r is None else f"×{r:.2f}"


def fmt_targets(row: Row) -> str:
    parts = []
    for t in row.targets:
        verdict = "PASS" if t["ok"] else "MISS"
        ratio = "–" if t["ratio"] is None else f"{t['ratio']:.2f}"
        parts.append(f"{t['name']}: {ratio} {verdict}")
    return "; ".join(parts)


def table(rows: list[Row]) -> str:
    head = [
        "measure",
        "broker",
        "tokens/s",
        "raw Redis",
        "×raw",
        "naive dict",
        "×naive",
        "target",
        "note",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    section = None
    for r in rows:
        if r.section != section:
            section = r.section
            lines.append(f"| **{section}** |" + " |" * (len(head) - 1))
        toks = "–" if r.tokens_per_s is None else f"{r.tokens_per_s / 1e6:.2f} M"
        cells = [
            r.measure,
            fmt_value(r.value, r.unit),
            toks,
            fmt_value(r.raw, r.unit),
            fmt_ratio(r.vs_raw),
            fmt_value(r.naive, r.unit),
            fmt_ratio(r.vs_naive),
            fmt_targets(r),
            r.note,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def machine(rt: RedisTarget, app_dir: Path) -> dict[str, str]:
    cpu = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    rev = subprocess.run(
        ["git", "-C", str(app_dir), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(app_dir), "status", "--porcelain", "--untracked-files=no", "app"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return {
        "nproc": str(os.cpu_count()),
        "cpu": cpu,
        "python": platform.python_version(),
        "redis": f"{rt.version} ({'private server' if rt.private else 'shared server: ' + rt.url})",
        "server": uvicorn_stack(),
        "app": f"{app_dir} @ {rev or '?'}{' + local changes' if dirty else ''}",
    }


def summary(rows: list[Row]) -> str:
    checks = [(r, t) for r in rows for t in r.targets]
    missed = [f"{r.id} ({t['name']})" for r, t in checks if not t["ok"]]
    line = f"targets: {len(checks) - len(missed)} PASS, {len(missed)} MISS"
    return line + (": " + ", ".join(missed) if missed else "")
