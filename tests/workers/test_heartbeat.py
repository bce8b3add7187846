"""The workers' heartbeat file: fresh only while every loop completes passes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from app.settings import Settings
from tests.conftest import REDIS_URL
from workers.heartbeat import Heartbeat
from workers.runner import run_workers


def test_the_file_is_touched_once_every_loop_has_passed(tmp_path: Path) -> None:
    path = tmp_path / "beat"
    beat = Heartbeat(path, ["maintenance", "drain"])
    beat.beat("maintenance")
    beat.beat("maintenance")
    assert not path.exists()  # the drain has not passed yet: one loop alone is not health
    beat.beat("drain")
    assert path.exists()
    path.unlink()
    beat.beat("drain")
    assert not path.exists()  # a new round: the maintenance loop has to pass again
    beat.beat("maintenance")
    assert path.exists()
    Heartbeat(None, ["maintenance"]).beat("maintenance")  # no file configured: nothing to do


async def test_the_running_workers_keep_the_file_fresh(
    tmp_path: Path, prefix: str, database_url: str
) -> None:
    path = tmp_path / "beat"
    settings = Settings(
        redis_url=REDIS_URL,
        database_url=database_url,
        redis_prefix=prefix,
        sweep_interval_s=0.05,
        worker_heartbeat_file=path,
    )
    stop = asyncio.Event()
    workers = asyncio.create_task(run_workers(settings, stop))

    def stamp() -> int | None:
        return path.stat().st_mtime_ns if path.exists() else None

    try:
        await _changes(stamp, None)  # both loops have completed a pass
        await _changes(stamp, stamp())  # and they keep doing so
    finally:
        stop.set()
        await workers


async def _changes(read: Callable[[], int | None], before: int | None) -> None:
    for _ in range(1500):  # 30 s
        if read() != before:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the heartbeat file did not change within 30 s")
