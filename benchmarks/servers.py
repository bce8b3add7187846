"""The processes a benchmark runs against: a private Redis and uvicorn servers, all on 127.0.0.1,
and a database of its own on a Postgres server for the brokers that need one.

Everything started here is stopped by the context managers, by process id; the database is
dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import redis

HOST = "127.0.0.1"
PG_URL = "postgresql://postgres@127.0.0.1:5432"  # a server whose user may create databases


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _version_of(binary: str) -> tuple[int, ...] | None:
    try:
        out = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"v=(\d+)\.(\d+)\.(\d+)", out)
    return tuple(int(x) for x in m.groups()) if m else None


def find_redis_server() -> str | None:
    """A redis-server binary of version 7 or later: $BENCH_REDIS_SERVER, /usr/bin, then PATH."""
    candidates = [os.environ.get("BENCH_REDIS_SERVER"), "/usr/bin/redis-server"]
    candidates.append(shutil.which("redis-server"))
    for c in candidates:
        if c and os.path.exists(c):
            v = _version_of(c)
            if v and v >= (7, 0, 0):
                return c
    return None


@dataclass
class RedisTarget:
    url: str
    private: bool  # a server of our own: INFO and MEMORY figures are ours alone
    version: str
    pid: int | None = None

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)


@contextlib.contextmanager
def redis_server(workdir: Path, url: str | None = None) -> Iterator[RedisTarget]:
    """A private redis-server on a free port, or (``url`` given / no binary) a shared one."""
    binary = None if url else find_redis_server()
    if binary is None:
        shared = url or os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
        r = redis.Redis.from_url(shared)
        version = str(r.info("server")["redis_version"])
        r.close()
        yield RedisTarget(shared, False, version)
        return
    port = free_port()
    log = open(workdir / "redis.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            HOST,
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
            "--protected-mode",
            "yes",
            # A replica attached to it (the replicas section) is synced at once, not after
            # Redis 7's default 5 s wait for more replicas to share the sync.
            "--repl-diskless-sync-delay",
            "0",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"redis://{HOST}:{port}/0"
    try:
        client = redis.Redis.from_url(url)
        wait_ping(client, proc, workdir / "redis.log")
        version = str(client.info("server")["redis_version"])
        client.close()
        yield RedisTarget(url, True, version, proc.pid)
    finally:
        _stop(proc)
        log.close()


def wait_ping(client: redis.Redis, proc: subprocess.Popen[bytes], log: Path) -> None:
    """Until the redis-server ``proc`` (writing to ``log``) answers PING on ``client``."""
    for _ in range(500):
        try:
            client.ping()
            return
        except redis.ConnectionError:
            if proc.poll() is not None:
                tail = log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"redis-server exited:\n{tail}") from None
            time.sleep(0.02)
    tail = log.read_text(errors="replace")[-2000:]
    raise RuntimeError(f"redis-server did not answer PING:\n{tail}")


async def _pg_execute(server_url: str, sql: str) -> None:
    import asyncpg  # type: ignore[import-untyped]

    conn = await asyncpg.connect(f"{server_url}/postgres")
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


@contextlib.contextmanager
def postgres_database(
    server_url: str, app_dir: Path, workdir: Path, name: str | None = None
) -> Iterator[str]:
    """A new database (``name``, or a new name) on the Postgres server at ``server_url`` (libpq
    form, without a database name; its user may create databases), migrated by the broker tree
    at ``app_dir``. Yields its SQLAlchemy async URL (:func:`database_url`); the database is
    dropped afterwards."""
    base = server_url.rstrip("/")
    name = name or f"rbbench_{uuid.uuid4().hex[:12]}"
    try:
        asyncio.run(_pg_execute(base, f'CREATE DATABASE "{name}"'))
    except Exception as exc:  # the driver's errors, or no server there
        raise RuntimeError(
            f"cannot create a database on {base} ({type(exc).__name__}: {exc}); the auth rows "
            "need a Postgres server whose user may create databases: --pg-url or $BENCH_PG_URL"
        ) from exc
    try:
        url = database_url(base, name)
        migrate = (
            "import sys; from app.db import upgrade_to_head_sync; upgrade_to_head_sync(sys.argv[1])"
        )
        env = tree_env(app_dir)
        done = subprocess.run(
            [sys.executable, "-c", migrate, url],
            cwd=app_dir,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        (workdir / "migrate.log").write_text(done.stdout + done.stderr)
        if done.returncode != 0:
            raise RuntimeError(f"migrating {name} failed:\n{done.stderr[-3000:]}")
        yield url
    finally:
        asyncio.run(_pg_execute(base, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def database_url(server_url: str, name: str) -> str:
    """The SQLAlchemy async URL of database ``name`` on the Postgres server at ``server_url``."""
    return f"postgresql+asyncpg://{server_url.rstrip('/').split('://', 1)[1]}/{name}"


@dataclass
class Server:
    name: str
    port: int
    pid: int

    @property
    def address(self) -> tuple[str, int]:
        return HOST, self.port


def tree_env(tree: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    """This environment with ``env`` over it and the broker tree ``tree`` first on
    ``PYTHONPATH``: what a subprocess running that tree's code gets."""
    full = {**os.environ, **(env or {})}
    full["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), full.get("PYTHONPATH", "")) if p)
    return full


@contextlib.contextmanager
def uvicorn_server(
    name: str,
    target: str,
    *,
    cwd: Path,
    workdir: Path,
    env: dict[str, str] | None = None,
    factory: bool = False,
) -> Iterator[Server]:
    """``python -m uvicorn target`` in a subprocess, ready when ``/healthz`` answers."""
    port = free_port()
    cmd = [sys.executable, "-m", "uvicorn", target, "--host", HOST, "--port", str(port)]
    cmd += ["--log-level", "warning", "--no-access-log"]
    if factory:
        cmd.append("--factory")
    with command_server(name, cmd, port, cwd=cwd, workdir=workdir, env=env) as server:
        yield server


@contextlib.contextmanager
def command_server(
    name: str,
    cmd: list[str],
    port: int,
    *,
    cwd: Path,
    workdir: Path,
    env: dict[str, str] | None = None,
) -> Iterator[Server]:
    """The server ``cmd`` (listening on ``port``) in a subprocess, ready when ``/healthz``
    answers; stopped with SIGINT (killed after 10 s)."""
    log_path = workdir / f"{name}.log"
    log = open(log_path, "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=tree_env(cwd, env), stdout=log, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited at start:\n{log_path.read_text()[-3000:]}")
            if _healthy(port):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{name} did not answer /healthz:\n{log_path.read_text()[-3000:]}"
                )
            time.sleep(0.05)
        yield Server(name, port, proc.pid)
    finally:
        _stop(proc)
        log.close()


@contextlib.contextmanager
def cli_server(
    name: str,
    *args: str,
    cwd: Path,
    workdir: Path,
    env: dict[str, str],
    processes: int = 1,
) -> Iterator[Server]:
    """``rollout-broker serve <args>`` (as ``python -m app.cli``) on a free port in a
    subprocess, with ``env`` over this environment, ready once ``/healthz`` answers and its
    ``processes`` API processes (``--workers``) have started. ``Server.pid`` is the serve
    process's. It runs in a session of its own: whatever is left of it after the stop is
    killed by that session's process group."""
    port = free_port()
    cmd = [sys.executable, "-m", "app.cli", "serve", "--host", HOST, "--port", str(port), *args]
    log_path = workdir / f"{name}.log"
    log = open(log_path, "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=tree_env(cwd, env),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited at start:\n{log_path.read_text()[-3000:]}")
            started = log_path.read_text(errors="replace").count("Application startup complete")
            if started >= processes and _healthy(port):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.05)
        yield Server(name, port, proc.pid)
    finally:
        _stop(proc, signal.SIGTERM, grace_s=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # an API process the serve process left behind
        log.close()


def _healthy(port: int) -> bool:
    try:
        conn = http.client.HTTPConnection(HOST, port, timeout=2)
        conn.request("GET", "/healthz")
        ok = conn.getresponse().status == 200
        conn.close()
        return ok
    except OSError:
        return False


def _stop(
    proc: subprocess.Popen[bytes], sig: signal.Signals = signal.SIGINT, grace_s: float = 10
) -> None:
    """Stop ``proc`` with ``sig``, killed after ``grace_s`` seconds."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def reset_peak_rss(pid: int) -> None:
    """Start ``VmHWM`` of the process over from its current resident size (Linux 4.0+)."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def peak_rss_bytes(pid: int) -> int:
    """The process's peak resident size since it started or since :func:`reset_peak_rss`."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


def uvicorn_stack() -> str:
    """Which event loop and HTTP parser uvicorn's ``auto`` settings pick here."""
    import importlib.util

    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    http_impl = "httptools" if importlib.util.find_spec("httptools") else "h11"
    return f"uvicorn (loop={loop}, http={http_impl}), 1 worker process"


_TCK = os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TCK


def tree_cpu_s(pid: int) -> float:
    """:func:`proc_cpu_s` of a live process and of its live descendants: a server whose
    requests a child process serves (granian's worker under its supervisor)."""
    total = proc_cpu_s(pid)
    for task in os.listdir(f"/proc/{pid}/task"):
        with (
            contextlib.suppress(FileNotFoundError),
            open(f"/proc/{pid}/task/{task}/children") as f,
        ):
            total += sum(tree_cpu_s(int(child)) for child in f.read().split())
    return total


def machine_cpu_s() -> tuple[float, float]:
    """(busy, steal) CPU seconds of the whole machine since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = v[:8]
    return (user + nice + system + irq + softirq) / _TCK, steal / _TCK


@dataclass
class CpuMeter:
    """How much CPU other processes used while we ran: the noise the figures carry."""

    pids: list[int]
    t0: float = 0.0
    busy0: float = 0.0
    steal0: float = 0.0
    ours0: float = 0.0

    def _ours(self) -> float:
        t = os.times()
        own = t.user + t.system + t.children_user + t.children_system
        return own + sum(proc_cpu_s(p) for p in self.pids)

    def start(self) -> None:
        self.t0 = time.monotonic()
        self.busy0, self.steal0 = machine_cpu_s()
        self.ours0 = self._ours()

    def report(self) -> str:
        wall = time.monotonic() - self.t0
        busy, steal = machine_cpu_s()
        ours = self._ours() - self.ours0
        other = max(0.0, (busy - self.busy0) - ours)
        return (
            f"this run used {ours / wall:.2f} cores on average; other processes "
            f"{other / wall:.2f} cores, hypervisor steal {(steal - self.steal0) / wall:.2f}"
        )
