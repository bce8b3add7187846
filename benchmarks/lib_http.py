"""uvicorn against granian for ``benchmarks/libraries.py``: the same FastAPI app served by
each, one server process, driven by the naive buffer's generators (``load.naive_ingest``: one
keep-alive connection each, one 1,024-token JSON rollout per POST).

uvicorn runs as ``rollout-broker serve`` runs it (``uvicorn.run`` with uvloop, httptools
under the broker's bounded protocol, ``app/serving.py``), but without the access log that
``serve`` leaves on; granian runs one worker (under its supervisor process, whose CPU is
counted too) with uvloop, HTTP/1.1 and no access log, its default.

One uvicorn server by hand:
``python -m benchmarks.lib_http uvicorn PORT benchmarks.lib_http:trivial_app``.
"""

from __future__ import annotations

import contextlib
import http.client
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request

from benchmarks.load import Group, naive_ingest, run_group
from benchmarks.servers import HOST, Server, command_server, free_port, tree_cpu_s

TRIVIAL = "benchmarks.lib_http:trivial_app"  # a factory
NAIVE = "benchmarks.naive_app:app"
APPS = {"trivial": (TRIVIAL, "/ingest"), "naive": (NAIVE, "/rollouts")}
SERVERS = ("uvicorn", "granian")


def trivial_app() -> FastAPI:
    """One POST route that reads its body and answers a small JSON (202, as the naive buffer's
    generators expect), and the ``/healthz`` the server start waits for."""
    app = FastAPI(title="trivial")

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/ingest", status_code=202)
    async def ingest(request: Request) -> dict[str, int]:
        return {"accepted": 1, "bytes": len(await request.body())}

    return app


def _command(server: str, target: str, port: int) -> list[str]:
    if server == "uvicorn":
        return [sys.executable, "-m", "benchmarks.lib_http", "uvicorn", str(port), target]
    cmd = [sys.executable, "-m", "granian", "--interface", "asgi", "--host", HOST]
    cmd += ["--port", str(port), "--workers", "1", "--loop", "uvloop", "--http", "1"]
    cmd += ["--no-ws", "--log-level", "warning", "--no-access-log"]
    return [*cmd, *(["--factory"] if target == TRIVIAL else []), target]


@contextlib.contextmanager
def app_server(server: str, app: str, cwd: Path, workdir: Path) -> Iterator[Server]:
    """The app ``app`` (a key of :data:`APPS`) served by ``server`` (uvicorn or granian)."""
    port = free_port()
    cmd = _command(server, APPS[app][0], port)
    with command_server(f"{server}-{app}", cmd, port, cwd=cwd, workdir=workdir) as s:
        yield s


@dataclass
class Served:
    """One load on one server: its rate and the server's CPU per request."""

    group: Group
    cpu_s: float

    @property
    def us_per_request(self) -> float:
        return 1e6 / self.group.rate

    @property
    def cpu_us_per_request(self) -> float:
        return self.cpu_s / max(self.group.ops, 1) * 1e6


def drive(
    server: Server, app: str, clients: int, duration: float, max_ops: int, tokens: int
) -> Served:
    """``clients`` generators posting rollouts of ``tokens`` tokens to ``app`` on ``server``
    for ``duration`` seconds (at most ``max_ops`` requests each), and the CPU the server's
    processes spent meanwhile."""
    kwargs = [
        {
            "address": server.address,
            "tag": f"lib{w}",
            "worker": w,
            "duration": duration,
            "max_ops": max_ops,
            "path": APPS[app][1],
            "tokens": tokens,
        }
        for w in range(clients)
    ]
    cpu0 = tree_cpu_s(server.pid)
    group = run_group(naive_ingest, kwargs, timeout=duration + 60)
    served = Served(group, tree_cpu_s(server.pid) - cpu0)
    if app == "naive":  # its dict holds every rollout posted: empty it for the next load
        conn = http.client.HTTPConnection(*server.address, timeout=30)
        conn.request("POST", "/_bench/clear")
        conn.getresponse().read()
        conn.close()
    return served


def _serve_uvicorn(port: int, target: str) -> None:
    """uvicorn as ``rollout-broker serve`` runs it (app/cli.py), less its access log."""
    import uvicorn

    from app.serving import uvicorn_options
    from app.settings import Settings

    options = uvicorn_options(Settings())
    uvicorn.run(
        target,
        host=HOST,
        port=port,
        log_level="warning",
        access_log=False,
        loop="uvloop",
        factory=target == TRIVIAL,
        **options,
    )


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "uvicorn":
        sys.exit("usage: python -m benchmarks.lib_http uvicorn PORT TARGET")
    _serve_uvicorn(int(sys.argv[2]), sys.argv[3])
