"""The accounting per generator and the β of the adaptive KL penalty: typed in the client, and
shown by ``rollout-broker accounting RUN --generators`` in 80 columns."""

from __future__ import annotations

import io
import json
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from rich.console import Console
from rollout_broker_client import BrokerClient, GeneratorAccounting, IsRatioStats, KlStats
from rollout_broker_client._wire import parse_accounting, parse_generators, parse_training
from rollout_broker_client.cli.views import generators_table

from tests.client.live import LiveServer
from tests.client.test_cli import invoke, rid

ANSWER: dict[str, Any] = {
    "generators": [
        {
            "generator_id": "vllm-node-12",
            "rollouts": 123_456,
            "tokens": 9_876_543,
            "samples_consumed": 234_567,
            "kl": {"mean": 0.0123456, "max": 0.54321},
            "is_ratio": {"mean": 1.0023456, "clip_fraction": 0.123456},
            "masked_fraction": 0.0456,
            "last_seen": "2026-12-06T03:30:12.345000Z",
            "quarantined": True,
        },
        {
            "generator_id": "g2",
            "rollouts": 7,
            "tokens": 70,
            "samples_consumed": 0,
            "kl": {"mean": None, "max": None},
            "is_ratio": {"mean": None, "clip_fraction": None},
            "masked_fraction": None,
            "last_seen": None,
            "quarantined": False,
        },
    ],
    "as_of": "2026-12-06T03:30:13Z",
    "pending_events": 0,
}


def test_the_client_types_the_generators_and_beta() -> None:
    first, second = parse_generators(ANSWER)
    assert first == GeneratorAccounting(
        generator_id="vllm-node-12",
        rollouts=123_456,
        tokens=9_876_543,
        samples_consumed=234_567,
        kl=KlStats(mean=0.0123456, max=0.54321),
        is_ratio=IsRatioStats(mean=1.0023456, clip_fraction=0.123456),
        masked_fraction=0.0456,
        last_seen=datetime(2026, 12, 6, 3, 30, 12, 345000, tzinfo=UTC),
        quarantined=True,
    )
    assert (second.kl.mean, second.masked_fraction, second.last_seen) == (None, None, None)
    assert not second.quarantined
    assert parse_accounting({**_zeros(), "kl_coef": 0.05}).kl_coef == 0.05
    assert parse_accounting(_zeros()).kl_coef is None
    trained = parse_training({"versions": [{"policy_version": 2, "batches": 1, "samples": 3,
                                            "kl_coef": 0.2}]})  # fmt: skip
    assert trained[0].kl_coef == 0.2


def _zeros() -> dict[str, Any]:
    return {"rollouts_received": 0, "buffered": 0, "leased": 0, "samples_consumed": 0}


def test_the_generators_table_fits_80_columns_and_shows_each_figure() -> None:
    console = Console(width=80, record=True, file=io.StringIO())
    console.print(generators_table(parse_generators(ANSWER)))
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= 80
    assert not any("…" in line for line in lines), "a cell was cut"
    header = next(line for line in lines if line.startswith("generator"))
    assert header.split() == [
        *("generator", "rollouts", "samples", "KL", "mean", "KL", "max", "IS", "mean"),
        *("clip", "masked", "seen", "Q"),
    ]
    [node] = [line.split() for line in lines if line.startswith("vllm-node-12")]
    assert node == [
        *("vllm-node-12", "123,456", "234,567", "0.0123", "0.543", "1.002", "0.123", "0.0456"),
        *("03:30:12", "Q"),
    ]
    [other] = [line.split() for line in lines if line.startswith("g2 ")]
    assert other == ["g2", "7", "0", *["–"] * 6]  # nothing measured, never seen, not quarantined


@pytest.mark.slow
def test_the_command_reads_the_generators_of_a_live_broker(live_server: LiveServer) -> None:
    run = rid()
    with BrokerClient(live_server.url) as broker:
        broker.create_run(run)
        broker.wait_for_accounting(run, timeout_s=20)
        assert broker.accounting_generators(run) == []
        body = {
            "rollouts": [
                {
                    "rollout_id": f"r{i}",
                    "policy_version": 0,
                    "prompt_ids": [1],
                    "response_ids": [2, 3, 4],
                    "logprobs": [-1.0] * 3,
                    "reward": 1.0,
                    "generator_id": "node-7",
                }
                for i in range(3)
            ]
        }
        resp = httpx.post(f"{live_server.url}/v1/runs/{run}/rollouts", json=body)
        assert resp.status_code in (200, 202), resp.text
        broker.wait_for_accounting(run, timeout_s=20)
        [node] = broker.accounting_generators(run)
    assert (node.generator_id, node.rollouts, node.tokens, node.quarantined) == (
        "node-7",
        3,
        9,
        False,
    )
    code, out, err = invoke(live_server, "accounting", run, "--generators", "--json")
    assert code == 0, err
    [row] = json.loads(out)
    assert (row["generator_id"], row["rollouts"], row["samples_consumed"]) == ("node-7", 3, 0)
    code, out, err = invoke(live_server, "accounting", run, "--generators")
    assert code == 0, err
    assert "Accounting by generator" in out
    [line] = [x.split() for x in out.splitlines() if x.startswith("node-7")]
    assert line[:3] == ["node-7", "3", "0"]
    code, out, err = invoke(live_server, "accounting", "no-such-run", "--generators")
    assert code == 1 and "RunNotFound" in err
