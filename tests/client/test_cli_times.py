"""Times in the operator commands' tables: whole at 80 columns (they were cut to
``2026-12-…``), to the second in UTC, with nothing else cut beside them: long ids and texts fold
onto more lines instead."""

from __future__ import annotations

import io
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from rich.console import Console
from rollout_broker_client import (
    AccessToken,
    AuditEntry,
    BrokerClient,
    ConsumerInfo,
    Run,
    RunConfig,
)
from rollout_broker_client._wire import parse_generators
from rollout_broker_client.cli.views import (
    audit_table,
    consumer_detail,
    generators_table,
    run_detail,
    run_table,
    tokens_table,
)

from tests.client.live import LiveServer
from tests.client.test_cli import invoke, rid
from tests.client.test_cli_generators import ANSWER

# 15:45:55 UTC, given an hour ahead of it: the tables show it in UTC.
AT = datetime(2026, 12, 6, 16, 45, 55, 123_000, tzinfo=timezone(timedelta(hours=1)))
SHOWN = "2026-12-06T15:45:55Z"
LATER = datetime(2026, 12, 7, 8, 0, 1, tzinfo=UTC)
LATER_SHOWN = "2026-12-07T08:00:01Z"
LONG_RUN = "grpo-qwen-7b-math-2026-12-06-ablation-b"
CONFIG: RunConfig = {"group_size": 8, "max_staleness": 2, "max_reuse": 1}


def _generators() -> Any:
    answer = {**ANSWER, "generators": [dict(g) for g in ANSWER["generators"]]}
    answer["generators"][0]["generator_id"] = "vllm-node-12.cluster-west.example.com:8000"
    return generators_table(parse_generators(answer))


CONSUMER = ConsumerInfo(
    name="reward-model-trainer",
    kind="rollouts",
    source="received",
    max_lag=None,
    min_margin=None,
    pairs=None,
    retention_rollouts=100_000,
    created_at=AT,
    delivered=1,
    acked=1,
    dropped=0,
    pending=0,
    leased=0,
)
ENTRIES = [
    AuditEntry(
        id=123_456,
        at=LATER,
        actor="trainer-node-17",
        token_id="a1b2c3d4e5f60718",
        action="run.policy",
        run_id=LONG_RUN,
        detail={"version": 12, "weights": "s3://bucket/ckpt/grpo/12"},
    ),
    AuditEntry(
        id=7,
        at=AT,
        actor="anonymous",
        token_id=None,
        action="token.create",
        run_id=None,
        detail={"token_id": "a1b2c3d4e5f60718"},
    ),
]
TOKENS = [
    AccessToken(
        token_id="a1b2c3d4e5f60718",
        name="trainer-node-17",
        scopes=["operate", "train"],
        runs=["grpo-*", "other"],
        created_at=AT,
        created_by="bootstrap",
        revoked_at=LATER,
    ),
    AccessToken("0011223344556677", "g", ["generate"], None, LATER, None, None),
]

# Each table, and the times it shows.
TABLES: dict[str, tuple[Any, list[str]]] = {
    "runs list": (
        run_table([Run(LONG_RUN, CONFIG, 12, "closed", AT), Run("r1", CONFIG, 0, "open", LATER)]),
        [SHOWN, LATER_SHOWN],
    ),
    "runs show": (run_detail(Run(LONG_RUN, CONFIG, 12, "open", AT)), [SHOWN]),
    "consumers show": (consumer_detail(CONSUMER), [SHOWN]),
    "audit": (audit_table(ENTRIES, more=True), [LATER_SHOWN, SHOWN]),
    "tokens list": (tokens_table(TOKENS), [SHOWN, LATER_SHOWN, LATER_SHOWN]),
    "accounting --generators": (_generators(), ["03:30:12"]),
}


@pytest.mark.parametrize("name", list(TABLES))
def test_every_table_with_times_keeps_them_whole_at_80_columns(name: str) -> None:
    table, times = TABLES[name]
    console = Console(width=80, record=True, file=io.StringIO())
    console.print(table)
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "…" not in text, text  # nothing cut
    assert {t: text.count(t) for t in times} == {t: times.count(t) for t in times}, text


def _shown(at: datetime) -> str:
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.mark.slow
def test_runs_list_and_audit_keep_times_whole_at_80_columns(live_server: LiveServer) -> None:
    run = rid()
    with BrokerClient(live_server.url) as broker:
        broker.create_run(run, {"max_reuse": 2})
        broker.close_run(run)
        runs = broker.list_runs()
        entries = list(broker.audit_entries(run))
    assert {e.action for e in entries} == {"run.create", "run.close"}

    code, out, err = invoke(live_server, "runs", "list", columns=80)
    assert code == 0, err
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 80 and "…" not in out, out
    for r in runs:
        [line] = [x for x in lines if x.startswith(f"{r.run_id} ")]
        assert line.split()[-1] == _shown(r.created_at), out

    code, out, err = invoke(live_server, "audit", "--run", run, columns=80)
    assert code == 0, err
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 80 and "…" not in out, out
    for e in entries:
        [line] = [x for x in lines if f" {e.action} " in x]
        assert line.split()[:2] == [str(e.id), _shown(e.at)], out
