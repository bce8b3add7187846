"""``rollout-broker consumers create|show|delete`` against a live broker: the config sent as
given, the counts shown, and the broker's refusals as one line on stderr."""

from __future__ import annotations

import io
import json
from datetime import UTC, datetime

import pytest
from rich.console import Console
from rollout_broker_client import BrokerClient, ConsumerInfo, ConsumerNotFound, Rollout
from rollout_broker_client.cli.views import consumer_detail

from tests.client.live import LiveServer
from tests.client.test_cli import invoke, rid


def test_consumers_create_show_and_delete(live_server: LiveServer) -> None:
    run = rid()
    with BrokerClient(live_server.url) as broker:
        broker.create_run(run)
        code, out, err = invoke(
            live_server, "consumers", "create", run, "rm", "--source", "trained", "--max-lag",
            "2", "--retention", "50", "--json",
        )  # fmt: skip
        assert code == 0, err
        made = json.loads(out)
        assert (made["name"], made["kind"], made["source"]) == ("rm", "rollouts", "trained")
        assert (made["max_lag"], made["retention_rollouts"], made["pending"]) == (2, 50, 0)
        assert broker.get_consumer(run, "rm").max_lag == 2  # as the broker keeps it

        code, out, _ = invoke(
            live_server, "consumers", "create", run, "all", "--source", "received"
        )
        assert code == 0 and "Consumer all" in out and "received" in out
        broker.post_rollouts(run, [Rollout("a", 0, [1, 2], 1.0)])
        code, out, _ = invoke(live_server, "consumers", "show", run, "all", "--json")
        shown = json.loads(out)
        assert code == 0 and (shown["delivered"], shown["pending"], shown["max_lag"]) == (
            1,
            1,
            None,
        )

        code, out, _ = invoke(live_server, "consumers", "delete", run, "all")
        assert code == 0 and out.strip() == f"consumer all of run {run} deleted"
        with pytest.raises(ConsumerNotFound):
            broker.get_consumer(run, "all")
        assert broker.get_consumer(run, "rm").name == "rm"  # the other one stays


def test_consumers_create_of_kind_preferences(live_server: LiveServer) -> None:
    run = rid()
    with BrokerClient(live_server.url) as broker:
        broker.create_run(run, {"group_size": 4})
        code, out, err = invoke(
            live_server, "consumers", "create", run, "dpo", "--source", "received", "--kind",
            "preferences", "--min-margin", "0.5", "--pairs", "all",
        )  # fmt: skip
        assert code == 0, err
        assert "min_margin" in out and "0.5" in out and "all" in out
        made = broker.get_consumer(run, "dpo")
        assert (made.kind, made.min_margin, made.pairs) == ("preferences", 0.5, "all")
        code, out, _ = invoke(live_server, "consumers", "show", run, "dpo", "--json")
        assert code == 0 and json.loads(out)["pairs"] == "all"


def test_consumers_refusals_are_one_line_each(live_server: LiveServer) -> None:
    run = rid()
    with BrokerClient(live_server.url) as broker:
        broker.create_run(run)
        broker.create_consumer(run, "rm", source="received")
    code, _, err = invoke(live_server, "consumers", "create", run, "rm", "--source", "trained")
    assert code == 1 and err.startswith("error: ConsumerConflict: ") and len(err.splitlines()) == 1
    code, _, err = invoke(live_server, "consumers", "show", run, "nobody")
    assert code == 1 and err.startswith("error: ConsumerNotFound: ")
    code, _, err = invoke(live_server, "consumers", "delete", run, "nobody")
    assert code == 1 and err.startswith("error: ConsumerNotFound: ")
    code, _, err = invoke(
        live_server, "consumers", "create", run, "x", "--source", "received", "--min-margin", "1"
    )
    assert code == 1 and err.startswith("error: ValidationFailed: ")  # kind rollouts has no margin
    code, _, err = invoke(live_server, "consumers", "create", run, "x", "--source", "sampled")
    assert code == 2 and "sampled" in err  # refused before anything is sent


def test_the_consumer_view_shows_pair_settings_for_preferences_only() -> None:
    base = {
        "name": "dpo",
        "source": "received",
        "max_lag": None,
        "retention_rollouts": 100_000,
        "created_at": datetime(2026, 12, 6, 9, 0, tzinfo=UTC),
        "delivered": 12,
        "acked": 7,
        "dropped": 1,
        "pending": 4,
        "leased": 2,
    }
    prefs = ConsumerInfo(kind="preferences", min_margin=0.5, pairs="all", **base)  # type: ignore[arg-type]
    plain = ConsumerInfo(kind="rollouts", min_margin=None, pairs=None, **base)  # type: ignore[arg-type]
    for info, extra in ((prefs, True), (plain, False)):
        console = Console(width=80, record=True, file=io.StringIO())
        console.print(consumer_detail(info))
        text = console.export_text()
        rows = {
            line.split("│")[1].strip(): line.split("│")[2].strip()
            for line in text.splitlines()
            if line.count("│") == 3
        }
        assert (rows["delivered"], rows["acked"], rows["dropped"]) == ("12", "7", "1")
        assert (rows["pending"], rows["leased"], rows["max_lag"]) == ("4", "2", "–")
        assert ("pairs" in rows, "min_margin" in rows) == (extra, extra)
        if extra:
            assert (rows["pairs"], rows["min_margin"]) == ("all", "0.5")
