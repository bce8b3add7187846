"""Process ownership: the lock on the data directory, the servers this process started and their
shutdown, the parent-death signal, and servers a previous owner left running."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from app.embedded.common import DataDirInUseError, EmbeddedStartError, ShutdownPlan, log

if sys.platform != "win32":
    import fcntl

_PR_SET_PDEATHSIG = 1


class Runtime:
    """Mutable state behind the frozen :class:`EmbeddedServices`."""

    def __init__(self, lock_fd: int) -> None:
        self._lock_fd = lock_fd
        self._mutex = threading.Lock()
        self._stopped = False
        self.children: list[tuple[str, subprocess.Popen[bytes], ShutdownPlan]] = []

    def stop(self) -> None:
        with self._mutex:
            if self._stopped:
                return
            self._stopped = True
        try:
            # Signal every server first so they shut down in parallel, then wait for each.
            for _, proc, plan in self.children:
                _signal(proc, plan[0][0])
            for name, proc, plan in self.children:
                _wait_or_escalate(name, proc, plan)
        finally:
            os.close(self._lock_fd)  # releases the flock
            atexit.unregister(self.stop)


def _signal(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)


def _wait_or_escalate(name: str, proc: subprocess.Popen[bytes], plan: ShutdownPlan) -> None:
    for i, (sig, grace) in enumerate(plan):
        if i > 0:  # the first signal was already sent
            log.warning("embedded %s did not stop in time; sending %s", name, sig.name)
            _signal(proc, sig)
        try:
            proc.wait(grace)
            break
        except subprocess.TimeoutExpired:
            continue
    else:
        log.warning("embedded %s did not stop; killing it", name)
    # The server leads its own process group: SIGKILL whatever is still in it (nothing, after a
    # clean shutdown), then reap the leader.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def lock_data_dir(data_dir: Path) -> int:
    path = data_dir / ".lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise DataDirInUseError(
            f"data directory {data_dir} is already in use by another rollout-broker "
            f"(pid {owner}); stop that one, or give this one a different data directory"
        ) from None
    except OSError as exc:  # e.g. a network file system without locks
        os.close(fd)
        raise EmbeddedStartError(f"cannot lock {path}: {exc}") from exc
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def parent_death_hook(sig: signal.Signals) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child receive ``sig`` when this process dies (Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    if threading.current_thread() is not threading.main_thread():
        # PR_SET_PDEATHSIG fires when the *thread* that forked the child exits.
        log.info("start_embedded called off the main thread: no parent-death signal")
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before fork
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def hook() -> None:  # runs in the child after the uid switch, which would clear the setting
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)

    return hook


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def _cmdline(pid: int) -> str | None:
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except FileNotFoundError:
        if Path("/proc/self").exists():
            return None  # Linux: the process is gone
    except OSError:
        return None
    try:
        out = subprocess.run(
            ["ps", "-o", "command=", "-p", str(pid)], capture_output=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.decode(errors="replace").strip() or None


def stop_leftover(name: str, pid_file: Path, marker: str, plan: ShutdownPlan) -> None:
    """Stop a server left running on this data dir by a previous owner (we hold the lock)."""
    try:
        pid = int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return
    if pid <= 1 or pid == os.getpid() or not _alive(pid):
        return
    cmd = _cmdline(pid)
    if cmd is None or marker not in cmd:
        return  # the pid was reused by an unrelated process
    log.warning("stopping embedded %s (pid %d) left running by a previous owner", name, pid)
    for sig, grace in plan:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.05)
        if not _alive(pid):
            return
    with contextlib.suppress(OSError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.05)
