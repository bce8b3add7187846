"""Accounts and permissions, as root only: the unprivileged system account that runs Postgres,
created if missing, and the search and read permissions it needs to reach the cluster and the
bundled binaries."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from app.embedded.common import EmbeddedStartError, log

if sys.platform != "win32":
    import pwd


@dataclass(frozen=True)
class Account:
    name: str
    uid: int
    gid: int
    groups: frozenset[int]


def system_account(name: str) -> Account:
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        _create_account(name)
        entry = pwd.getpwnam(name)
    if entry.pw_uid == 0:
        raise EmbeddedStartError(f"account {name!r} has uid 0; Postgres cannot run as root")
    groups = frozenset(os.getgrouplist(name, entry.pw_gid))
    return Account(name, entry.pw_uid, entry.pw_gid, groups)


def _find_tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for d in ("/usr/sbin", "/sbin", "/usr/bin", "/bin"):
        if os.access(f"{d}/{name}", os.X_OK):
            return f"{d}/{name}"
    return None


def _create_account(name: str) -> None:
    shell = next(
        (s for s in ("/usr/sbin/nologin", "/sbin/nologin") if os.path.exists(s)), "/bin/false"
    )
    useradd, adduser = _find_tool("useradd"), _find_tool("adduser")
    if useradd:
        cmd = [
            useradd,
            "--system",
            "--user-group",
            "--no-create-home",
            "--home-dir",
            "/nonexistent",
            "--shell",
            shell,
            "--comment",
            "rollout-broker embedded Postgres",
            name,
        ]
    elif adduser:  # BusyBox (Alpine)
        cmd = [adduser, "-S", "-D", "-H", "-h", "/nonexistent", "-s", shell, name]
    else:
        cmd = []
    log.warning("running as root: creating system account %r to run the embedded Postgres", name)
    error = "neither useradd nor adduser was found"
    if cmd:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
            error = (done.stderr or done.stdout).strip() or f"exit status {done.returncode}"
        except (OSError, subprocess.SubprocessError) as exc:
            error = str(exc)
    try:
        pwd.getpwnam(name)  # also covers a concurrent creation by another process
    except KeyError:
        raise EmbeddedStartError(
            f"Postgres cannot run as root and creating the system account {name!r} failed "
            f"({error}); create an unprivileged account and pass it as service_account, or run "
            "the broker as a normal user"
        ) from None


def _can(account: Account, st: os.stat_result, bits: int) -> bool:
    """Whether ``account`` has all of ``bits`` (r=4, w=2, x=1) on a file with status ``st``."""
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid == account.uid:
        return (mode >> 6) & bits == bits
    if st.st_gid in account.groups:
        return (mode >> 3) & bits == bits
    return mode & bits == bits


def grant_search(path: Path, account: Account) -> None:
    """Let ``account`` traverse ``path`` and every directory above it (adding o+x if needed)."""
    for d in (path, *path.parents):
        st = d.stat()
        if not _can(account, st, 1):
            d.chmod(stat.S_IMODE(st.st_mode) | stat.S_IXOTH)
            log.warning(
                "granted search permission (o+x) on %s so %r can reach %s", d, account.name, path
            )


def grant_read_tree(root: Path, account: Account) -> None:
    """Let ``account`` read (and run) the bundled Postgres installation."""
    probes = [
        (root / "bin" / "postgres", 5),
        (root / "bin" / "initdb", 5),
        (root / "share" / "postgres.bki", 4),
        (root / "lib", 5),
        (root / "share", 5),
    ]
    if all(not p.exists() or _can(account, p.stat(), bits) for p, bits in probes):
        return
    log.warning("making %s readable by other users so %r can run it", root, account.name)
    for dirpath, _, filenames in os.walk(root):
        d = Path(dirpath)
        d.chmod(stat.S_IMODE(d.stat().st_mode) | 0o005)
        for fn in filenames:
            f = d / fn
            if f.is_symlink():
                continue
            mode = stat.S_IMODE(f.stat().st_mode)
            f.chmod(mode | 0o004 | (0o001 if mode & stat.S_IXUSR else 0))
