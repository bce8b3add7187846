"""The embedded Redis and Postgres: real servers, started in a temporary data directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from app.embedded import (
    DataDirInUseError,
    EmbeddedServices,
    _socket_dir,
    default_data_dir,
    start_embedded,
)
from tests.processes import RedisServer, redis_62_server

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    # A space in the path checks that both URLs are quoted correctly.
    yield tmp_path_factory.mktemp("embedded") / "data dir"


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live (not zombie) process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state != "Z"


def _group_members(pgid: int) -> list[int]:
    """Live processes in process group ``pgid`` (Postgres runs in the postmaster's group)."""
    if not Path("/proc/self/stat").exists():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        return [pgid]
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def _assert_gone(redis_pid: int, postgres_pid: int, within: float = 0.0) -> None:
    deadline = time.monotonic() + within
    while True:
        alive = [p for p in (redis_pid,) if _running(p)] + _group_members(postgres_pid)
        if not alive or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    assert alive == [], f"still running: {alive}"


async def _roundtrip(services: EmbeddedServices, *, first: bool) -> None:
    client = aioredis.from_url(services.redis_url)
    try:
        assert await client.ping()
        if first:
            await client.set("rb:test", b"kept")
        assert await client.get("rb:test") == b"kept"
    finally:
        await client.aclose()

    engine = create_async_engine(services.database_url)
    try:
        async with engine.begin() as conn:
            assert (await conn.execute(text("select 1"))).scalar_one() == 1
            if first:
                await conn.execute(text("create table if not exists kept (x int)"))
                await conn.execute(
                    text("insert into kept select 42 where not exists (select 1 from kept)")
                )
            assert (await conn.execute(text("select x from kept"))).scalar_one() == 42
    finally:
        await engine.dispose()


@pytest.mark.slow
async def test_start_talk_stop_and_restart_keeps_data(data_dir: Path) -> None:
    services = start_embedded(data_dir)
    try:
        assert services.redis_url.startswith("unix://")
        assert services.database_url.startswith("postgresql+asyncpg://")
        await _roundtrip(services, first=True)
    finally:
        services.stop()
    _assert_gone(services.redis_pid, services.postgres_pid)
    services.stop()  # idempotent

    # A restart on the same directory sees the Redis AOF and the Postgres cluster.
    with start_embedded(data_dir) as again:
        assert again.postgres_pid != services.postgres_pid
        await _roundtrip(again, first=False)
    _assert_gone(again.redis_pid, again.postgres_pid)


def _python(code: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
async def test_second_owner_is_refused(data_dir: Path) -> None:
    with start_embedded(data_dir) as services:
        await _roundtrip(services, first=True)
        with pytest.raises(DataDirInUseError, match=f"pid {os.getpid()}"):
            start_embedded(data_dir)

        other = _python(
            "from pathlib import Path\n"
            "from app.embedded import start_embedded\n"
            f"start_embedded(Path({str(data_dir)!r}))\n"
        )
        _, err = other.communicate(timeout=60)
        assert other.returncode != 0
        assert "DataDirInUseError" in err
        assert f"already in use by another rollout-broker (pid {os.getpid()})" in err

        await _roundtrip(services, first=False)  # the owner's servers are untouched
    _assert_gone(services.redis_pid, services.postgres_pid)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux")
async def test_servers_stop_when_the_owner_is_killed(data_dir: Path) -> None:
    with start_embedded(data_dir) as before:  # data for the restart after the kill to find
        await _roundtrip(before, first=True)
    owner = _python(
        "import json, sys\n"
        "from pathlib import Path\n"
        "from app.embedded import start_embedded\n"
        f"s = start_embedded(Path({str(data_dir)!r}))\n"
        "print(json.dumps([s.redis_pid, s.postgres_pid]), flush=True)\n"
        "sys.stdin.read()\n"
    )
    try:
        assert owner.stdout is not None
        line = owner.stdout.readline()
        assert line, owner.communicate(timeout=10)[1]
        redis_pid, postgres_pid = json.loads(line)
        assert _running(redis_pid)
        assert _running(postgres_pid)
    finally:
        owner.send_signal(signal.SIGKILL)  # no atexit, no stop(): only the kernel's signal
        owner.communicate(timeout=10)
    _assert_gone(redis_pid, postgres_pid, within=15.0)

    # The data directory is free again and the data survived the unclean owner exit.
    with start_embedded(data_dir) as again:
        await _roundtrip(again, first=False)


def test_long_paths_get_a_private_socket_dir(tmp_path: Path) -> None:
    assert _socket_dir(tmp_path, "redis.sock", os.geteuid()) == tmp_path

    deep = tmp_path / ("x" * 120)
    chosen = _socket_dir(deep, "redis.sock", os.geteuid())
    try:
        assert chosen.parent == Path(tempfile.gettempdir())
        st = chosen.stat()
        assert st.st_uid == os.geteuid()
        assert st.st_mode & 0o077 == 0
        assert _socket_dir(deep, "redis.sock", os.geteuid()) == chosen  # stable
    finally:
        chosen.rmdir()


def test_default_data_dir() -> None:
    path = default_data_dir()
    assert path.name == "rollout-broker"
    assert path.is_absolute()


@pytest.mark.slow
async def test_a_data_dir_of_the_redis_62_era_keeps_its_keys(tmp_path: Path) -> None:
    """An embedded Redis data directory written before Redis 7 holds one ``appendonly.aof``;
    the embedded Redis of today takes it over as the base of its multi-part AOF, every key
    kept, and keeps them across its next restart too."""
    data_dir = tmp_path / "data"
    (data_dir / "redis").mkdir(parents=True)
    old = RedisServer(data_dir / "redis", binary=redis_62_server())
    await old.start()
    client = aioredis.Redis(port=old.port)
    try:
        assert (await client.info("server"))["redis_version"].startswith("6.2.")
        await _write_kept_keys(client)
    finally:
        await client.aclose()
    await old.shutdown()
    assert (data_dir / "redis" / "appendonly.aof").is_file()

    for _ in range(2):  # the upgrade, then a start from the multi-part AOF it wrote
        with start_embedded(data_dir) as services:
            client = aioredis.from_url(services.redis_url)
            try:
                assert int((await client.info("server"))["redis_version"].split(".")[0]) >= 7
                await _check_kept_keys(client)
            finally:
                await client.aclose()
        assert (data_dir / "redis" / "appendonlydir").is_dir()


async def _write_kept_keys(client: aioredis.Redis) -> None:
    await client.set("rb:kept", b"\x00\xffbytes")
    await client.hset("rb:hash", mapping={"a": "1", "b": "2"})
    await client.xadd("rb:stream", {"d": "event"}, id="5-1")
    await client.xgroup_create("rb:stream", "drain", id="0")


async def _check_kept_keys(client: aioredis.Redis) -> None:
    assert await client.get("rb:kept") == b"\x00\xffbytes"
    assert await client.hgetall("rb:hash") == {b"a": b"1", b"b": b"2"}
    assert [entry_id for entry_id, _ in await client.xrange("rb:stream")] == [b"5-1"]
    groups = await client.xinfo_groups("rb:stream")
    assert [group["name"] for group in groups] == [b"drain"]
