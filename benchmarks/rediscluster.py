"""Private Redis servers for the cluster rows: a single node, and a cluster of three masters
without replicas (each node ``--cluster-enabled yes`` on a port below 50000 whose bus port, the
port + 10000, is free too; joined with ``redis-cli --cluster create``; ready when every node
reports ``cluster_state:ok``), both from the same ``redis-server`` binary with the same settings.

All servers started here are stopped by process id, and the cluster's data directory removed.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from benchmarks.servers import HOST, _stop, _version_of, find_redis_server, wait_ping

MASTERS = 3
CLUSTER_OK_S = 30.0  # how long the cluster may take to report cluster_state:ok

# Node settings of both sides: no persistence, loopback only.
NODE_ARGS = ["--bind", HOST, "--save", "", "--appendonly", "no", "--protected-mode", "yes"]


# -- the redis-server binary ----------------------------------------------------------------
def cluster_binaries() -> tuple[str, str] | None:
    """``(redis-server, redis-cli)`` for both sides: ``$BENCH_REDIS_SERVER`` (any version from
    5.0, when ``redis-cli --cluster`` appeared), else the binary the rest of the benchmark uses
    (7 or later), else the one on ``PATH``; the ``redis-cli`` beside it, else ``PATH``'s."""
    for server in (
        os.environ.get("BENCH_REDIS_SERVER"),
        find_redis_server(),
        shutil.which("redis-server"),
    ):
        if not server or not os.path.exists(server):
            continue
        v = _version_of(server)
        if v is None or v < (5, 0, 0):
            continue
        beside = Path(server).with_name("redis-cli")
        cli = str(beside) if beside.exists() else shutil.which("redis-cli")
        if cli:
            return server, cli
    return None


def server_version(binary: str) -> str:
    v = _version_of(binary)
    return ".".join(map(str, v)) if v else "?"


# -- nodes ----------------------------------------------------------------------------------
@dataclass
class Node:
    port: int
    pid: int

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(HOST, self.port)

    def cpu_s(self) -> float:
        """``used_cpu_user + used_cpu_sys`` of ``INFO cpu``: the server's CPU seconds so far."""
        r = self.client()
        try:
            info = r.info("cpu")
        finally:
            r.close()
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def cluster_ports(n: int) -> list[int]:
    """``n`` ports P with P and its cluster bus port P + 10000 both free. P is drawn from 12000
    to 21999, so both sit below 32768, where Linux's ephemeral ports usually start."""
    picked: list[int] = []
    for p in random.sample(range(12_000, 22_000), 500):
        if port_free(p) and port_free(p + 10_000):
            picked.append(p)
            if len(picked) == n:
                return picked
    raise RuntimeError("no free ports for the cluster's nodes (P and P + 10000)")


@contextlib.contextmanager
def redis_nodes(
    binary: str, ports: list[int], workdir: Path, *, cluster: bool
) -> Iterator[list[Node]]:
    """One ``redis-server`` per port, each with a data directory of its own under ``workdir``
    (``--cluster-enabled yes`` and ``nodes.conf`` there for a cluster's nodes); stopped by
    process id afterwards."""
    procs: list[tuple[subprocess.Popen[bytes], Any]] = []
    try:
        nodes = []
        for port in ports:
            d = workdir / f"node-{port}"
            d.mkdir()
            extra = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
            args = [binary, "--port", str(port), "--dir", str(d), *NODE_ARGS]
            log_path = d / "redis.log"
            log = open(log_path, "wb")  # noqa: SIM115 - closed below
            proc = subprocess.Popen(
                args + (extra if cluster else []), stdout=log, stderr=subprocess.STDOUT
            )
            procs.append((proc, log))
            node = Node(port, proc.pid)
            client = node.client()
            try:
                wait_ping(client, proc, log_path)
            finally:
                client.close()
            nodes.append(node)
        yield nodes
    finally:
        for proc, log in procs:
            _stop(proc)
            log.close()


@dataclass
class Cluster:
    nodes: list[Node]
    slots: list[tuple[int, int, int]]  # (first slot, last slot, the index of its master)

    @property
    def url(self) -> str:
        return self.nodes[0].url  # the broker discovers the others from any node

    def master_of(self, slot: int) -> int:
        for lo, hi, i in self.slots:
            if lo <= slot <= hi:
                return i
        raise RuntimeError(f"slot {slot} has no master")

    def slot_text(self, i: int) -> str:
        return ", ".join(f"{lo}–{hi}" for lo, hi, j in self.slots if j == i)


@contextlib.contextmanager
def redis_cluster(binary: str, cli: str, workdir: Path) -> Iterator[Cluster]:
    """A private Redis Cluster of ``MASTERS`` masters and no replicas on 127.0.0.1, ready when
    every node reports ``cluster_state:ok``. Its nodes are stopped by process id and its data
    directory removed afterwards."""
    base = Path(tempfile.mkdtemp(prefix="rb-cluster-", dir=workdir))
    try:
        ports = cluster_ports(MASTERS)
        with redis_nodes(binary, ports, base, cluster=True) as nodes:
            create = [cli, "--cluster", "create", *(f"{HOST}:{p}" for p in ports)]
            create += ["--cluster-replicas", "0", "--cluster-yes"]
            done = subprocess.run(create, capture_output=True, text=True, timeout=60, check=False)
            (base / "create.log").write_text(done.stdout + done.stderr)
            if done.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed:\n{done.stdout[-3000:]}")
            wait_cluster_ok(nodes)
            yield Cluster(nodes, slot_map(nodes))
    finally:
        shutil.rmtree(base, ignore_errors=True)


def wait_cluster_ok(nodes: list[Node]) -> None:
    deadline = time.monotonic() + CLUSTER_OK_S
    waiting = list(nodes)
    while waiting:
        r = waiting[0].client()
        try:
            state: Any = r.cluster("INFO")
        finally:
            r.close()
        # redis-py parses the reply into a dict, or leaves it as text, depending on its version
        if isinstance(state, dict):
            text = "\n".join(f"{k}:{v}" for k, v in state.items())
        else:
            text = state.decode() if isinstance(state, bytes) else str(state)
        if "cluster_state:ok" in text.split():
            waiting.pop(0)
            continue
        if time.monotonic() > deadline:
            raise RuntimeError(f"node {waiting[0].port} is not cluster_state:ok:\n{text}")
        time.sleep(0.05)


def slot_map(nodes: list[Node]) -> list[tuple[int, int, int]]:
    """``CLUSTER SLOTS`` of the first node, as (first, last, index of the master's node)."""
    index = {n.port: i for i, n in enumerate(nodes)}
    r = nodes[0].client()
    try:
        rows: Any = r.cluster("SLOTS")
    finally:
        r.close()
    out = []
    # redis-py parses the reply into {(first, last): {"primary": (host, port), ...}}
    # or leaves it as the raw list, depending on its version.
    if isinstance(rows, dict):
        for (lo, hi), where in rows.items():
            out.append((int(lo), int(hi), index[int(where["primary"][1])]))
    else:
        for row in rows:
            out.append((int(row[0]), int(row[1]), index[int(row[2][1])]))
    return sorted(out)


def node_port() -> int:
    """A port for the single node, drawn as the cluster's are."""
    return cluster_ports(1)[0]
