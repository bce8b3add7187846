"""The ``rollout-broker`` operator commands, through typer's CliRunner, against a live broker."""

from __future__ import annotations

import json
import uuid

import pytest
from rollout_broker_client import BrokerClient, Rollout
from typer.testing import CliRunner

from app.cli import cli
from tests.client.live import LiveServer
from tests.services import fresh_database

runner = CliRunner()


def invoke(server: LiveServer | None, *args: str) -> tuple[int, str, str]:
    env = {"COLUMNS": "160", "NO_COLOR": "1"}
    if server is not None:
        env["BROKER_URL"] = server.url
    result = runner.invoke(cli, list(args), env=env)
    return result.exit_code, result.stdout, result.stderr


def rid() -> str:
    return f"cli-{uuid.uuid4().hex[:8]}"


@pytest.mark.slow
def test_runs_create_show_list_close(live_server: LiveServer) -> None:
    run = rid()
    code, out, err = invoke(
        live_server, "runs", "create", run, "-c", "group_size=2", "-c", "order=fifo", "--json"
    )
    assert code == 0, err
    created = json.loads(out)
    assert created["run_id"] == run and created["config"]["group_size"] == 2
    assert created["config"]["order"] == "fifo" and created["status"] == "open"

    code, out, _ = invoke(live_server, "runs", "show", run)
    assert code == 0
    assert f"Run {run}" in out and '"fifo"' in out and "group_size" in out

    code, out, _ = invoke(live_server, "runs", "list", "--json")
    assert code == 0 and run in [r["run_id"] for r in json.loads(out)]
    code, out, _ = invoke(live_server, "runs", "list")
    assert code == 0 and run in out

    code, out, _ = invoke(live_server, "runs", "close", run, "--json")
    assert code == 0 and json.loads(out)["status"] == "closed"


@pytest.mark.slow
def test_url_option_and_errors(live_server: LiveServer) -> None:
    code, out, err = invoke(None, "runs", "show", "missing-run", "--url", live_server.url)
    assert code == 1 and out == ""
    assert err.startswith("error: RunNotFound: no run 'missing-run'")

    code, _, err = invoke(None, "runs", "list", "--url", "http://127.0.0.1:9")
    assert code == 1 and "cannot reach the broker at http://127.0.0.1:9" in err

    code, _, err = invoke(live_server, "runs", "create", rid(), "-c", "group_size")
    assert code == 2 and "is not KEY=VALUE" in err
    code, _, err = invoke(live_server, "runs", "create", rid(), "-c", "max_reuse=0")
    assert code == 1 and err.startswith("error: ValidationFailed:")


@pytest.mark.slow
def test_policy_set(live_server: LiveServer) -> None:
    run = rid()
    with BrokerClient(live_server.url) as broker:
        broker.create_run(run, {"max_staleness": 1})
        broker.post_rollouts(run, [Rollout("a", 0, [1], 0.0)])
        broker.set_policy(run, 1)
        broker.post_rollouts(run, [Rollout("b", 1, [1], 0.0)])
    code, out, _ = invoke(live_server, "policy", "set", run, "1")  # the same: a no-op
    assert code == 0
    assert out.strip() == f"run {run} is at policy version 1; 0 rollouts retired as stale"
    code, out, _ = invoke(live_server, "policy", "set", run, "3", "--json")
    assert code == 0 and json.loads(out) == {"evicted": 2, "policy_version": 3}
    code, _, err = invoke(live_server, "policy", "set", run, "2")
    assert code == 1 and err.startswith("error: VersionConflict:")


@pytest.fixture
def trained_run(live_server: LiveServer) -> str:
    """A run with 4 rollouts in, 2 of them used once (max_reuse 1) and retired."""
    run = rid()
    with BrokerClient(live_server.url) as broker:
        broker.create_run(run, {"max_reuse": 1})
        broker.post_rollouts(
            run, [Rollout(f"r{i}", 0, [1, 2, 3], float(i), [-1.0] * 3) for i in range(4)]
        )
        with broker.lease(run, size=2) as batch:
            assert batch is not None
            batch.ack_with([[-1.0] * 3] * 2)
        broker.wait_for_accounting(run, timeout_s=20)
    return run


@pytest.mark.slow
def test_accounting_table_and_json(live_server: LiveServer, trained_run: str) -> None:
    code, out, _ = invoke(live_server, "accounting", trained_run, "--json")
    assert code == 0
    acc = json.loads(out)
    assert (acc["rollouts_received"], acc["buffered"], acc["samples_consumed"]) == (4, 2, 2)
    assert acc["retired"] == {"max_reuse": 2}

    code, out, _ = invoke(live_server, "accounting", trained_run)
    assert code == 0
    assert f"Accounting of {trained_run}" in out
    assert "buffered + leased + retired" in out and "2 + 0 + 2 = 4 received" in out
    assert "max_reuse 2" in out  # retired by reason

    code, out, _ = invoke(live_server, "accounting", trained_run, "--versions", "--json")
    assert code == 0
    rows = json.loads(out)
    assert [(r["policy_version"], r["rollouts_received"]) for r in rows] == [(0, 4)]


@pytest.mark.slow
def test_watch_refreshes(live_server: LiveServer, trained_run: str) -> None:
    code, out, err = invoke(live_server, "watch", trained_run, "--count", "2", "--interval", "0.05")
    assert code == 0, err
    assert out.count("rollout-broker watch") == 2  # two frames, one after the other
    assert "buffered" in out and "reuse factor" in out and "lag  0" in out and "KL" in out


@pytest.fixture
def work_run(live_server: LiveServer) -> str:
    """A run of 4 prompts whose generator leased 3, posted the groups of a and b and broke out
    (c went back, at attempt 2; d was never handed out), and whose trainer used a's group."""
    run = rid()
    with BrokerClient(live_server.url) as broker:
        broker.create_run(run, {"group_size": 2, "max_reuse": 1})
        broker.register_prompts(run, ["a", "b", "c", "d"])
        with broker.work(run, max_prompts=3, wait_s=0) as leases:
            for lease in leases:
                for p in lease.prompts[:2]:
                    lease.post(p, [{"response_ids": [1, 2], "reward": float(k)} for k in (0, 1)])
                break
        with broker.lease(run, size=2) as batch:
            assert batch is not None and {r.group_id for r in batch} == {"a#1.1"}
        acc = broker.wait_for_accounting(run, timeout_s=20)
        assert (acc.prompts.queued, acc.prompts.done) == (2, 1)
    return run


@pytest.mark.slow
def test_prompts_lists_passes_and_their_states(live_server: LiveServer, work_run: str) -> None:
    code, out, err = invoke(live_server, "prompts", work_run, "--json")
    assert code == 0, err
    assert json.loads(out) == [
        {"prompt_id": "a", "pass": 1, "attempt": 1, "state": "done", "tries": 0},
        {"prompt_id": "b", "pass": 1, "attempt": 1, "state": "in_flight", "tries": 0},
        {"prompt_id": "c", "pass": 1, "attempt": 2, "state": "queued", "tries": 0},
        {"prompt_id": "d", "pass": 1, "attempt": 1, "state": "queued", "tries": 0},
    ]

    code, out, _ = invoke(live_server, "prompts", work_run, "--state", "queued")
    assert code == 0
    assert "4 passes registered: queued 2, in flight 1, done 1, failed 0 (retried 1)" in out
    assert f"Prompt passes of {work_run}" in out
    rows = [
        line.split()
        for line in out.splitlines()
        if line.strip().startswith(("a ", "b ", "c ", "d "))
    ]
    assert rows == [["c", "1", "2", "queued", "0"], ["d", "1", "1", "queued", "0"]]

    code, out, _ = invoke(live_server, "prompts", work_run, "--limit", "1")
    assert code == 0 and "1 shown; more with --limit" in out
    code, out, _ = invoke(live_server, "prompts", work_run, "--limit", "0")
    assert code == 0 and "more with --limit" not in out

    code, _, err = invoke(live_server, "prompts", work_run, "--state", "lost")
    assert code == 2 and "lost" in err


@pytest.mark.slow
def test_accounting_and_watch_show_prompts_and_waits(
    live_server: LiveServer, work_run: str, trained_run: str
) -> None:
    code, out, _ = invoke(live_server, "accounting", work_run)
    assert code == 0
    assert "prompts (passes)" in out and "2 + 1 + 1 + 0 = 4 registered" in out
    assert "generators waited" in out and "trainers waited" in out
    code, out, _ = invoke(live_server, "accounting", trained_run)
    assert code == 0
    assert "prompts (passes)" not in out  # a run without work leases
    assert "trainers waited" in out

    code, out, err = invoke(live_server, "watch", work_run, "--count", "1")
    assert code == 0, err
    assert "prompt passes" in out and "queued 2, in flight 1, done 1, failed 0" in out
    assert "generators waited" in out and "trainers waited" in out


def test_service_commands_are_kept() -> None:
    code, out, _ = invoke(None, "--help")
    assert code == 0
    for name in ("serve", "worker", "migrate", "runs", "policy", "accounting", "prompts", "watch"):
        assert name in out
    code, _, err = invoke(None, "worker")
    assert code == 2 and "BROKER_REDIS_URL" in err


def test_migrate_against_postgres(monkeypatch: pytest.MonkeyPatch) -> None:
    with fresh_database() as url:
        monkeypatch.setenv("BROKER_DATABASE_URL", url)
        result = runner.invoke(cli, ["migrate"])
        assert result.exit_code == 0, result.output
        assert "database is at the latest schema" in result.stdout


@pytest.mark.parametrize(
    ("present", "missing"),
    [("BROKER_REDIS_URL", "BROKER_DATABASE_URL"), ("BROKER_DATABASE_URL", "BROKER_REDIS_URL")],
)
def test_serve_refuses_half_a_configuration(
    present: str, missing: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both services configured, or neither (embedded): one alone would leave the API without
    Redis, or without accounting while its event streams grow."""
    monkeypatch.delenv(missing, raising=False)
    monkeypatch.setenv(
        present, "redis://127.0.0.1:1/0" if "REDIS" in present else "postgresql://x@127.0.0.1:1/x"
    )
    code, _, err = invoke(None, "serve", "--port", "0")
    assert code == 2
    assert f"{missing} is not set" in err
