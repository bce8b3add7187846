"""The ``rollout-broker`` operator commands, through typer's CliRunner, against a live broker."""

from __future__ import annotations

import fcntl
import io
import json
import os
import re
import uuid
from pathlib import Path
from typing import Any

import pytest
from rollout_broker_client import (
    Accounting,
    BrokerClient,
    Rollout,
    RunNotFound,
    ValidationFailed,
)
from rollout_broker_client._wire import parse_accounting
from rollout_broker_client.cli.app import build
from typer.testing import CliRunner

from app.cli import cli
from tests.cli_process import broker_env as cli_env
from tests.cli_process import rollout_broker
from tests.client.live import LiveServer
from tests.services import fresh_database, url_of_database

runner = CliRunner()


def invoke(server: LiveServer | None, *args: str, columns: int = 160) -> tuple[int, str, str]:
    env = {"COLUMNS": str(columns), "NO_COLOR": "1"}
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


@pytest.mark.slow
def test_runs_policy_sets_the_version_with_its_weights(live_server: LiveServer) -> None:
    run = rid()
    with BrokerClient(live_server.url) as broker:
        broker.create_run(run)
        code, out, _ = invoke(live_server, "runs", "policy", run, "2", "--weights", "s3://b/2")
        assert code == 0
        assert out.strip() == f"run {run} is at policy version 2; 0 rollouts retired as stale"
        got = broker.policy(run)
        assert got is not None and (got.policy_version, got.weights) == (2, "s3://b/2")
        code, out, _ = invoke(live_server, "runs", "policy", run, "3", "--json")
        assert code == 0 and json.loads(out) == {"evicted": 0, "policy_version": 3}
        got = broker.policy(run)
        assert got is not None and (got.policy_version, got.weights) == (3, None)
    code, _, err = invoke(live_server, "runs", "policy", run, "4", "--weights", "x" * 2049)
    assert code == 1 and err.startswith("error: ValidationFailed:")


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
def test_accounting_of_a_deleted_run(live_server: LiveServer, trained_run: str) -> None:
    """The API serves a deleted run's accounting; so does the command, without its live state."""
    with BrokerClient(live_server.url) as broker:
        broker.close_run(trained_run)
        broker.wait_for_accounting(trained_run, timeout_s=20)
        broker.delete_run(trained_run)
        with pytest.raises(RunNotFound):
            broker.get_run(trained_run)
    code, out, err = invoke(live_server, "accounting", trained_run)
    assert code == 0, err
    assert f"Accounting of {trained_run} (deleted)" in out
    assert "0 + 0 + 4 = 4 received" in out
    code, out, err = invoke(live_server, "accounting", trained_run, "--json")
    assert code == 0, err
    assert json.loads(out)["rollouts_received"] == 4


@pytest.mark.slow
def test_the_advice_for_a_deleted_run_can_be_followed(live_server: LiveServer) -> None:
    """A deleted run's id is refused to ``runs create`` (its accounting keeps it) and not found
    by the commands of live runs: the advice names ``runs list`` and the accounting, which
    answer, never ``runs config``, which would not find the run either."""
    run = rid()
    with BrokerClient(live_server.url) as broker:
        broker.create_run(run)
        broker.close_run(run)
        broker.wait_for_accounting(run, timeout_s=20)
        broker.delete_run(run)
    code, out, err = invoke(live_server, "runs", "create", run, "-c", "max_reuse=2")
    assert code == 1 and out == ""
    line = _one_line(err)
    assert line.startswith(f"error: RunConflict: run '{run}' was deleted"), line
    assert line.endswith(
        "; pick another run id: `rollout-broker runs list` shows the runs there are, "
        f"`rollout-broker accounting {run}` the deleted run's accounting"
    ), line
    for args in (["runs", "show", run], ["runs", "config", run, "-c", "max_reuse=2"]):
        code, out, err = invoke(live_server, *args)
        assert code == 1 and out == ""
        line = _one_line(err)
        assert line.startswith(f"error: RunNotFound: no run '{run}'"), line
        assert line.endswith(
            "; it may have been deleted: `rollout-broker runs list` shows the runs there are"
        ), line

    # The advice, followed.
    code, out, err = invoke(live_server, "runs", "list", "--json")
    assert code == 0, err
    assert run not in [r["run_id"] for r in json.loads(out)]
    code, out, err = invoke(live_server, "accounting", run)
    assert code == 0 and f"Accounting of {run} (deleted)" in out, err

    # The accounting is kept for deleted runs: a run it does not find never was one.
    never = rid()
    code, _, err = invoke(live_server, "accounting", never)
    line = _one_line(err)
    assert code == 1 and line.startswith(f"error: RunNotFound: run '{never}'"), line
    assert line.endswith("; `rollout-broker runs list` shows the runs there are"), line

    # The client's own command line names itself in its advice.
    env = {"BROKER_URL": live_server.url, "COLUMNS": "160", "NO_COLOR": "1"}
    result = runner.invoke(build(), ["runs", "create", run], env=env)
    assert result.exit_code == 1
    assert "`rollout-broker-ctl runs list`" in _one_line(result.stderr)


@pytest.mark.slow
def test_a_url_with_the_api_prefix_is_refused_in_one_line(live_server: LiveServer) -> None:
    """The broker's API is under /v1, which the client adds itself: given in the URL too, every
    request met a bare 404 (``error: NotFound: Not Found``)."""
    for url in (f"{live_server.url}/v1", f"{live_server.url}/v1/"):
        code, out, err = invoke(None, "runs", "list", "--url", url)
        assert code == 2 and out == ""
        assert _one_line(err) == (
            f"error: --url {url} ends in /v1, the API's prefix: give the broker's base URL "
            f"without it, {live_server.url}"
        )
    code, _, err = invoke(None, "runs", "list", "--url", live_server.url)
    assert code == 0, err


@pytest.mark.slow
def test_accounting_training_table_and_json(live_server: LiveServer, trained_run: str) -> None:
    code, out, err = invoke(live_server, "accounting", trained_run, "--training", "--json")
    assert code == 0, err
    # Acked with the behaviour's own logprobs: no KL, every ratio 1, nothing clipped.
    assert json.loads(out) == [
        {
            "policy_version": 0,
            "batches": 1,
            "samples": 2,
            "tokens": 6,
            "kl_mean": 0.0,
            "kl_max": 0.0,
            "is_ratio_mean": 1.0,
            "clip_fraction": 0.0,
            "kl_coef": None,
        }
    ]

    code, out, err = invoke(live_server, "accounting", trained_run, "--training")
    assert code == 0, err
    assert "Training by policy version" in out
    assert "KL mean" in out and "IS mean" in out and "clip" in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("0 ")]
    assert rows == [["0", "1", "2", "6", "0", "0", "1", "0"]]

    code, out, err = invoke(live_server, "accounting", trained_run, "--versions", "--training")
    assert code == 2 and out == ""
    assert "--versions" in err and "--training" in err and "cannot be used together" in err
    code, out, err = invoke(live_server, "accounting", trained_run, "--training", "--generators")
    assert code == 2 and out == "" and "cannot be used together" in err


@pytest.mark.slow
def test_watch_refreshes(live_server: LiveServer, trained_run: str) -> None:
    code, out, err = invoke(live_server, "watch", trained_run, "--count", "2", "--interval", "0.05")
    assert code == 0, err
    assert out.count("rollout-broker watch") == 2  # two frames, one after the other
    assert "buffered" in out and "reuse factor" in out and "lag  0" in out and "KL" in out


@pytest.fixture
def work_run(live_server: LiveServer) -> str:
    """A run of 4 prompts whose generator leased 3, posted the groups of a and b and broke out
    (c went back, at attempt 2; d was never handed out), and whose trainer used a's group; a and
    b have a group mean (0.5), c and d none."""
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
        {"prompt_id": "a", "pass": 1, "attempt": 1, "state": "done", "tries": 0, "mean": 0.5},
        {"prompt_id": "b", "pass": 1, "attempt": 1, "state": "in_flight", "tries": 0, "mean": 0.5},
        {"prompt_id": "c", "pass": 1, "attempt": 2, "state": "queued", "tries": 0, "mean": None},
        {"prompt_id": "d", "pass": 1, "attempt": 1, "state": "queued", "tries": 0, "mean": None},
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
    assert rows == [["c", "1", "2", "queued", "0", "–"], ["d", "1", "1", "queued", "0", "–"]]

    # A pool is asked of the broker, which has none for a run without difficulty.
    code, _, err = invoke(live_server, "prompts", work_run, "--pool", "easy")
    assert code == 1 and "has no difficulty" in err, err

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


# -- errors: one line each, and the commands that were missing ------------------------------------


def _one_line(err: str) -> str:
    """The only line of ``err``, which starts with ``error: ``."""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.mark.parametrize("bad", [".", "..", "a b", "x" * 129, "run/1"])
@pytest.mark.parametrize(
    "command",
    [
        ["runs", "show"],
        ["runs", "close"],
        ["runs", "config", "{}", "-c", "max_reuse=2"],
        ["runs", "create"],
        ["policy", "set", "{}", "1"],
        ["batches", "nack", "{}", "b1"],
        ["accounting"],
        ["prompts"],
        ["watch"],
    ],
    ids=" ".join,
)
def test_run_ids_the_broker_refuses_are_refused_before_any_request(
    command: list[str], bad: str
) -> None:
    """``.`` and ``..`` never reached their run: the URL path resolved them away (``runs show .``
    read the list of runs and crashed)."""
    args = [a.replace("{}", bad) for a in command] if "{}" in command else [*command, bad]
    code, out, err = invoke(None, *args, "--url", "http://127.0.0.1:9")
    assert code == 2, (code, out, err)
    assert "is not a run id" in err and out == ""


def test_a_valid_run_id_goes_through() -> None:
    for ok in ("...", ".a", "a.", "_-.", "x" * 128):
        code, _, err = invoke(None, "runs", "show", ok, "--url", "http://127.0.0.1:9")
        assert code == 1 and "cannot reach the broker" in _one_line(err), (ok, err)


def test_migrate_without_its_database_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    missing = f"rbt_missing_{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("BROKER_DATABASE_URL", url_of_database(missing))
    result = runner.invoke(cli, ["migrate"])
    assert result.exit_code == 1 and result.stdout == ""
    line = _one_line(result.stderr)
    assert "cannot migrate the database postgresql+asyncpg://" in line
    assert line.endswith(f'database "{missing}" does not exist'), line

    monkeypatch.setenv("BROKER_DATABASE_URL", "postgresql://u:secret@127.0.0.1:9/x")
    result = runner.invoke(cli, ["migrate"])
    assert result.exit_code == 1
    line = _one_line(result.stderr)
    assert "postgresql+asyncpg://u:***@127.0.0.1:9/x: " in line and "secret" not in line


@pytest.mark.slow
def test_migrate_as_a_process_prints_one_line_and_no_traceback() -> None:
    url = url_of_database(f"rbt_missing_{uuid.uuid4().hex[:8]}")
    with rollout_broker("migrate", env=cli_env(BROKER_DATABASE_URL=url)) as command:
        assert command.exit_code() == 1
    lines = command.output().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot migrate"), command.output()


def test_a_second_serve_on_the_same_data_dir_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("BROKER_REDIS_URL", "BROKER_DATABASE_URL", "BROKER_DATA_DIR"):
        monkeypatch.delenv(name, raising=False)
    lock = os.open(tmp_path / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running broker holds it
        os.pwrite(lock, b"4242\n", 0)
        result = runner.invoke(cli, ["serve", "--data-dir", str(tmp_path), "--port", "0"])
    finally:
        os.close(lock)
    assert result.exit_code == 1, result.output
    line = _one_line(result.stderr)
    assert f"data directory {tmp_path} is already in use by another rollout-broker (pid 4242)" in (
        line
    )

    blocked = tmp_path / "file"
    blocked.write_text("")
    result = runner.invoke(cli, ["serve", "--data-dir", str(blocked / "data"), "--port", "0"])
    assert result.exit_code == 1
    assert f"cannot create the data directory {blocked / 'data'}" in _one_line(result.stderr)


def test_watch_waits_for_a_broker_it_cannot_reach() -> None:
    code, out, err = invoke(
        None, "watch", "r1", "--url", "http://127.0.0.1:9", "--count", "2", "--interval", "0.05"
    )
    assert code == 0, err
    assert out.count("rollout-broker watch") == 2
    assert out.count("waiting: cannot reach the broker at http://127.0.0.1:9") == 2


@pytest.mark.slow
def test_watch_waits_for_a_run_that_does_not_exist_yet(live_server: LiveServer) -> None:
    run = rid()
    env = cli_env(BROKER_URL=live_server.url, COLUMNS="160")
    with rollout_broker("watch", run, "--interval", "0.05", env=env) as command:
        command.wait_for(re.compile(rf"waiting: no run '{run}' \(yet\)"))
        with BrokerClient(live_server.url) as broker:
            broker.create_run(run, {"max_reuse": 3})
        command.wait_for(re.compile(r"max_reuse 3"))
        assert command.stop() == 0
    assert "Traceback" not in command.output()


@pytest.mark.slow
def test_runs_config_changes_what_runs_create_refuses_to(live_server: LiveServer) -> None:
    run = rid()
    code, _, err = invoke(live_server, "runs", "create", run, "-c", "max_reuse=2")
    assert code == 0, err
    code, out, err = invoke(live_server, "runs", "create", run, "-c", "max_reuse=3")
    assert code == 1 and out == ""
    line = _one_line(err)
    assert line.startswith(f"error: RunConflict: run '{run}' exists with a different config")
    assert line.endswith(f"change its config with `rollout-broker runs config {run} -c KEY=VALUE`")

    code, out, err = invoke(
        live_server, "runs", "config", run, "-c", "max_reuse=3", "-c", "order=fifo", "--json"
    )
    assert code == 0, err
    config = json.loads(out)["config"]
    assert (config["max_reuse"], config["order"], config["group_size"]) == (3, "fifo", 1)
    code, out, _ = invoke(live_server, "runs", "config", run, "-c", "step_groups=4")
    assert code == 0 and "step_groups" in out and "4" in out

    code, _, err = invoke(live_server, "runs", "config", run, "-c", "max_reuse=0")
    assert code == 1 and _one_line(err).startswith("error: ValidationFailed:")
    code, _, err = invoke(live_server, "runs", "config", run)
    assert code == 2 and "--config" in err
    code, _, err = invoke(live_server, "runs", "config", rid(), "-c", "max_reuse=2")
    assert code == 1 and _one_line(err).startswith("error: RunNotFound:")

    # The broker itself refuses the ids the command line does.
    with BrokerClient(live_server.url) as broker:
        for bad in (".", ".."):
            with pytest.raises(ValidationFailed):
                broker.create_run(bad)


@pytest.mark.slow
def test_batches_nack_returns_a_leased_batch(live_server: LiveServer) -> None:
    run = rid()
    with BrokerClient(live_server.url) as broker:
        broker.create_run(run)
        broker.post_rollouts(run, [Rollout(f"r{i}", 0, [1, 2], 0.0) for i in range(3)])
        batch = broker.lease_batch(run, size=2)
        assert batch is not None
    code, out, err = invoke(live_server, "batches", "nack", run, batch.batch_id)
    assert code == 0, err
    assert out.strip() == f"batch {batch.batch_id} of run {run}: 2 rollouts back in the buffer"
    code, out, err = invoke(live_server, "batches", "nack", run, "no-such-batch", "--json")
    assert code == 1 and _one_line(err).startswith("error: BatchNotFound:")
    with BrokerClient(live_server.url) as broker:
        again = broker.lease_batch(run, size=3)
        assert again is not None and len(again.rollouts) == 3  # the two came back


# -- the invariant line: ✓ only when the ledger is checked against the live counts -------------


def _accounting(**fields: Any) -> Accounting:
    body: dict[str, Any] = {
        "rollouts_received": 4,
        "buffered": 2,
        "leased": 1,
        "samples_consumed": 3,
        "retired": {"max_reuse": 1},
        "pending_events": 0,
        "live": {"buffered": 2, "leased": 1},
        "dead_letters": 0,
    }
    body.update(fields)
    return parse_accounting({k: v for k, v in body.items() if v is not None})


def _rendered(acc: Accounting) -> list[str]:
    from rich.console import Console
    from rollout_broker_client.cli.views import accounting_table

    console = Console(width=160, record=True, file=io.StringIO())
    console.print(accounting_table(acc))
    return console.export_text().splitlines()


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({}, None),
        ({"live": None}, "the broker does not report its live counts"),
        ({"dead_letters": None}, "the broker does not report dead letters"),
        ({"pending_events": None}, "the broker does not report pending events"),
        ({"pending_events": 5}, "5 events not yet applied"),
        ({"dead_letters": 2}, "2 dead letters"),
        (
            {"live": {"buffered": 1, "leased": 1}},
            "the ledger's buffered 2, leased 1 are not the live 1, 1",
        ),
        ({"buffered": -2, "live": {"buffered": -2, "leased": 1}}, "off by 4"),
    ],
)
def test_the_invariant_line_is_a_check_only_against_the_live_counts(
    fields: dict[str, Any], why: str | None
) -> None:
    lines = _rendered(_accounting(**fields))
    [line] = [x for x in lines if "buffered + leased + retired" in x]
    [check] = [x for x in lines if "ledger = live" in x]
    if why is None:
        assert "✓" in line and "✗" not in line + check
        assert "all events applied, none dead-lettered" in check
    else:
        assert "✓" not in line and "✗" in line
        assert f"✗ {why}" in check
