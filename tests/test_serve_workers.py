"""`serve --workers N`: N API processes on one port, the background workers once (in the serve
process itself), the request metrics summed over the processes whichever one is scraped, and
SIGTERM leaving no process and no metrics folder behind. Real processes on real services."""

from __future__ import annotations

import asyncio
import re
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from app import keys
from app.cli import NO_WORKERS
from app.metrics import SPECS
from tests.cli_process import LISTENING, Command, broker_env, rollout_broker, until_ready
from tests.helpers import rollout
from tests.services import REDIS_URL

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/stat").exists(), reason="reads the process tree from /proc"
)

SUMMED_IN = re.compile(r"(\d+) API processes; their request metrics are summed in (\S+)")
STARTED = "Application startup complete."
REQUESTS = "rollout_broker_http_request_duration_seconds"


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command's name (state, ppid, ...)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _alive(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def _descendants(pid: int) -> dict[int, str]:
    """Every live process below ``pid`` and its command line."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))) and fields[0] != "Z":
            parents[int(entry.name)] = int(fields[1])
    found: dict[int, str] = {}
    below = {pid}
    while below:
        below = {child for child, parent in parents.items() if parent in below}
        for child in below:
            try:
                cmd = (Path("/proc") / str(child) / "cmdline").read_bytes()
            except OSError:
                continue
            found[child] = cmd.replace(b"\0", b" ").decode(errors="replace")
    return found


def _api_processes(serve: Command) -> set[int]:
    """The serve process's children that run an API (uvicorn's spawned workers)."""
    children = _descendants(serve.proc.pid)
    return {pid for pid, cmd in children.items() if "spawn_main" in cmd}


def _started(serve: Command, processes: int, within: float = 60.0) -> str:
    """The API's URL once ``processes`` API processes have finished their start-up; returns
    the metrics folder ``serve`` announced."""
    summed = serve.wait_for(SUMMED_IN, within)
    assert int(summed.group(1)) == processes
    deadline = time.monotonic() + within
    while serve.output().count(STARTED) < processes:
        assert serve.proc.poll() is None, serve.output()
        assert time.monotonic() < deadline, serve.output()
        time.sleep(0.05)
    return summed.group(2)


def _count(families: Iterable[Metric], route: str) -> float:
    """The request count of ``route`` among prometheus-client metric families."""
    for family in families:
        for s in family.samples:
            if s.name == f"{REQUESTS}_count" and s.labels.get("route") == route:
                return float(s.value)
    return 0.0


def _count_of_process(folder: Path, pid: int, route: str) -> float:
    """What process ``pid`` alone counted for ``route``: its own file in the metrics folder."""
    own = folder / f"histogram_{pid}.db"
    if not own.exists():
        return 0.0
    return _count(MultiProcessCollector.merge([str(own)]), route)  # type: ignore[no-untyped-call]


def _get_fresh(url: str, path: str) -> httpx.Response:
    """One request on a connection of its own, so that any API process may accept it."""
    with httpx.Client(timeout=10) as client:
        return client.get(url + path)


def _until_each_answered(url: str, folder: Path, pids: set[int], path: str) -> int:
    """GET ``path`` on new connections, 16 at a time, until every process of ``pids`` has
    answered at least one; returns how many were sent."""
    sent = 0
    deadline = time.monotonic() + 30
    with ThreadPoolExecutor(8) as pool:
        while not all(_count_of_process(folder, pid, path) for pid in pids):
            assert time.monotonic() < deadline, "one API process never answered"
            for resp in pool.map(lambda _: _get_fresh(url, path), range(16)):
                assert resp.status_code == 200, resp.text
            sent += 16
    return sent


def _assert_all_gone(pids: set[int], within: float = 15.0) -> None:
    deadline = time.monotonic() + within
    while (alive := {p for p in pids if _alive(p)}) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive, f"still running: {alive}"


def test_the_settings_reach_the_api_processes_through_the_environment(tmp_path: Path) -> None:
    """Every setting, none at its default (a secret, a path, floats, booleans, URLs), is read
    back from the variables `serve --workers` puts in the API processes' environment."""
    from pydantic import SecretStr

    from app.cli import _environment, _settings_env
    from app.settings import Settings

    chosen = Settings(
        redis_url="unix:///run/a%20b/redis.sock",
        database_url="postgresql+asyncpg://u@/db?host=/run/pg",
        redis_prefix="p.1",
        data_dir=tmp_path / "data dir",
        auth=True,
        admin_token=SecretStr("s" * 40),
        token_cache_s=0.1,
        redis_timeout_s=7.5,
        metrics=False,
        workers_in_process=False,
        drain_trim=False,
        drain_consumer="c-1",
        worker_heartbeat_file=tmp_path / "beat",
        allowed_hosts=("rb.lan", "broker_1"),
        header_timeout_s=2.5,
        keep_alive_timeout_s=9,
        max_header_bytes=4096,
        max_connections=77,
    )
    unset = {name for name, f in Settings.model_fields.items() if f.default is None}
    assert not unset - chosen.model_fields_set, "give every optional setting a value above"
    with _environment(_settings_env(chosen)):
        assert Settings() == chosen
    with _environment(_settings_env(Settings.model_construct(redis_url=None))):
        assert Settings().redis_url is None  # unset, not the text "None"


async def test_workers_serve_one_port_with_summed_metrics_and_background_once(
    database_factory: Callable[[], Awaitable[str]], prefix: str
) -> None:
    url = await database_factory()
    env = broker_env(
        BROKER_REDIS_URL=REDIS_URL, BROKER_DATABASE_URL=url, BROKER_REDIS_PREFIX=prefix
    )
    await asyncio.to_thread(_two_workers, env, prefix)


def _two_workers(env: dict[str, str], prefix: str) -> None:
    args = ("serve", "--port", "0", "--workers", "2", "--with-workers", "--migrate")
    with rollout_broker(*args, env=env) as serve:
        api = serve.wait_for(LISTENING).group(1)
        folder = Path(_started(serve, 2))
        assert folder.is_dir()
        pids = _api_processes(serve)
        assert len(pids) == 2, _descendants(serve.proc.pid)
        assert until_ready(api).status_code == 200
        assert NO_WORKERS not in serve.output()

        # Both processes answer on the one port: each counted requests of its own.
        sent = _until_each_answered(api, folder, pids, "/healthz")
        assert sum(_count_of_process(folder, pid, "/healthz") for pid in pids) == sent

        # Whichever process answers /metrics, it counts the requests of both.
        scrapes = 0
        while not all(_count_of_process(folder, pid, "/metrics") for pid in pids):
            assert scrapes < 200, "one API process never answered /metrics"
            resp = _get_fresh(api, "/metrics")
            scrapes += 1
            assert resp.status_code == 200, resp.text
            families = list(text_string_to_metric_families(resp.text))
            assert _count(families, "/healthz") == sent
            (histogram,) = [f for f in families if f.name == REQUESTS]
            assert histogram.type == "histogram"
            assert histogram.documentation == SPECS[REQUESTS].help

        # The background workers run once, in the serve process, not in the API processes:
        # one drain consumer (named host-pid-random), and its pid is serve's.
        with redis.Redis.from_url(REDIS_URL) as r:
            drains_key = keys.drain_consumers_key(prefix)
            deadline = time.monotonic() + 15
            while not r.zcard(drains_key):
                assert time.monotonic() < deadline, serve.output()
                time.sleep(0.05)
            time.sleep(1.0)  # time for any other drain to have sent its first heartbeat
            (consumer,) = r.zrange(drains_key, 0, -1)
            assert consumer.decode().split("-")[-2] == str(serve.proc.pid)

            # ... and they do their work: what was posted reaches the ledger.
            _post_and_wait_drained(api)

            everything = set(_descendants(serve.proc.pid)) | {serve.proc.pid}
            assert serve.stop(signal.SIGTERM) == 0, serve.output()
            _assert_all_gone(everything)
            assert not folder.exists()
            assert r.zcard(drains_key) == 0  # the drain left on the way out


def _post_and_wait_drained(api: str) -> None:
    with httpx.Client(base_url=api, timeout=10) as client:
        resp = client.post("/v1/runs", json={"run_id": "w1", "config": {}})
        assert resp.status_code == 201, resp.text
        resp = client.post("/v1/runs/w1/rollouts", json={"rollouts": [rollout("a"), rollout("b")]})
        assert resp.status_code == 202, resp.text
        deadline = time.monotonic() + 15
        while True:
            acc = client.get("/v1/runs/w1/accounting").json()
            if acc["pending_events"] == 0 and acc["rollouts_received"] == 2:
                return
            assert time.monotonic() < deadline, acc
            time.sleep(0.05)


@pytest.mark.skipif(sys.platform == "win32", reason="no embedded services on Windows")
async def test_workers_on_the_embedded_services(tmp_path: Path) -> None:
    env = broker_env()  # nothing configured: embedded Redis and Postgres, workers in serve
    await asyncio.to_thread(_embedded_two_workers, env, tmp_path / "data")


def _embedded_two_workers(env: dict[str, str], data_dir: Path) -> None:
    args = ("serve", "--port", "0", "--workers", "2", "--data-dir", str(data_dir))
    with rollout_broker(*args, env=env) as serve:
        api = serve.wait_for(LISTENING, within=180).group(1)
        folder = Path(_started(serve, 2))
        assert len(_api_processes(serve)) == 2, _descendants(serve.proc.pid)
        resp = until_ready(api)
        assert resp.status_code == 200, resp.text
        assert resp.json()["checks"]["migrations"] == "ok"
        _post_and_wait_drained(api)  # both processes reach the embedded services' sockets

        everything = set(_descendants(serve.proc.pid)) | {serve.proc.pid}
        assert serve.stop(signal.SIGTERM) == 0, serve.output()
        _assert_all_gone(everything)
        assert not folder.exists()
