"""The token figures of the accounting (masked tokens, tokens masked stale at hand-out, the
token-weighted lag) and the partial rollouts' figures: typed in the client, shown by
``rollout-broker accounting`` and ``watch``, each row found by its label and read for its value."""

from __future__ import annotations

import io
import re
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pytest
from rich.console import Console
from rollout_broker_client import Accounting, BrokerClient, PartialCounts, Rollout, Run
from rollout_broker_client._wire import parse_accounting, parse_versions
from rollout_broker_client.cli.views import accounting_table, versions_table
from rollout_broker_client.cli.watch import _Frame, watch_view

from tests.client.live import LiveServer
from tests.client.test_cli import invoke, rid

PARTIALS = {
    "returned": 7,
    "resumed": 5,
    "dropped": 2,
    "tokens_resumed": 1_310,
    "tokens_dropped": 96,
}


def body(**fields: Any) -> dict[str, Any]:
    """An accounting answer whose figures are all distinct, so a row cannot show another's."""
    out: dict[str, Any] = {
        "rollouts_received": 8,
        "buffered": 2,
        "leased": 0,
        "samples_consumed": 9,
        "samples_rewound": 4,
        "retired": {"max_reuse": 6},
        "tokens_generated": 4_936,
        "tokens_masked": 1_234,
        "tokens_masked_stale": 321,
        "tokens_consumed": 3_003,
        "lag": {"mean": 0.75, "max": 3, "histogram": {"0": 4, "1": 5}, "token_mean": 0.625},
        "pending_events": 0,
        "live": {"buffered": 2, "leased": 0},
        "dead_letters": 0,
        "partials": PARTIALS,
    }
    out.update(fields)
    return {k: v for k, v in out.items() if v is not None}


def rendered(view: Any) -> list[str]:
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(view)
    return console.export_text().splitlines()


def row(lines: list[str], label: str) -> str:
    """The one line of the table whose first cell is ``label``."""
    cell = re.compile(rf"[│┃] {re.escape(label)}(?: {{2,}}| *│)")
    [line] = [x for x in lines if cell.match(x)]
    return line


def test_the_client_types_the_token_and_partial_figures() -> None:
    acc = parse_accounting(body())
    assert (acc.tokens_masked, acc.tokens_masked_stale) == (1_234, 321)
    assert acc.lag.token_mean == 0.625
    assert acc.partials == PartialCounts(**PARTIALS)
    assert acc.samples_rewound == 4
    # A broker without these figures still reads: zeros, no token lag, and no partials.
    older = parse_accounting(
        body(
            tokens_masked=None,
            tokens_masked_stale=None,
            samples_rewound=None,
            partials=None,
            lag={"mean": 0.5},
        )
    )
    assert (older.tokens_masked, older.tokens_masked_stale, older.lag.token_mean) == (0, 0, None)
    assert older.samples_rewound == 0
    assert older.partials is None
    one = {**body(), "policy_version": 3, "tokens_masked": 12, "tokens_masked_stale": 5}
    [v] = parse_versions({"versions": [one]})
    assert (v.tokens_masked, v.tokens_masked_stale, v.lag.token_mean) == (12, 5, 0.625)
    assert v.samples_rewound == 4


def test_the_accounting_table_shows_masked_tokens_token_lag_and_partials() -> None:
    lines = rendered(accounting_table(parse_accounting(body())))
    masked = row(lines, "tokens masked")
    assert "1,234" in masked and "25.0% of generated" in masked  # 1234 / 4936
    assert "321" in row(lines, "tokens masked stale")
    assert " 4 " in row(lines, "samples rewound")
    assert "mean 0.75" in row(lines, "lag") and "max 3" in row(lines, "lag")
    assert "mean 0.625" in row(lines, "token lag")
    assert any("partial rollouts" in x for x in lines)
    assert "7" in row(lines, "returned")
    resumed, dropped = row(lines, "resumed"), row(lines, "dropped")
    assert " 5 " in resumed and "1,310 tokens" in resumed
    assert " 2 " in dropped and "96 tokens" in dropped


def test_the_partials_section_is_shown_only_when_the_broker_reports_it() -> None:
    lines = rendered(accounting_table(parse_accounting(body(partials=None))))
    assert not any("partial rollouts" in x for x in lines)
    zeros = dict.fromkeys(PARTIALS, 0)  # reported, all 0: shown
    lines = rendered(accounting_table(parse_accounting(body(partials=zeros))))
    assert any("partial rollouts" in x for x in lines) and " 0 " in row(lines, "returned")


def test_the_versions_table_shows_masked_tokens_and_token_lag() -> None:
    one = body(
        policy_version=3,
        tokens_masked=4_321,
        samples_rewound=17,
        lag={"mean": 1.5, "max": 2, "token_mean": 1.25},
    )
    lines = rendered(versions_table(parse_versions({"versions": [one]})))
    header = next(x for x in lines if "version" in x and "received" in x).split()
    [cells] = [x.split() for x in lines if x.split()[:1] == ["3"]]
    named = dict(zip([*header[: header.index("token")], "token lag"], cells, strict=False))
    assert (named["masked"], named["lag"], named["token lag"]) == ("4,321", "1.5", "1.25")
    assert named["rewound"] == "17"


def test_watch_shows_token_lag_and_the_masked_share() -> None:
    acc = parse_accounting(body())
    run = Run(
        run_id="w",
        config={"max_staleness": 2},
        policy_version=3,
        status="open",
        created_at=datetime(2026, 1, 1, tzinfo=UTC),
    )
    lines = rendered(watch_view(_Frame(run, acc, 0.0), None))
    masked = row(lines, "tokens masked")
    assert "1,234" in masked and "25.0% of generated" in masked
    assert "masked stale at hand-out 321" in masked
    assert " 4 " in row(lines, "samples rewound")
    [lag] = [x for x in lines if "lag mean" in x]
    assert "lag mean 0.75" in lag and "token lag mean 0.625" in lag


@pytest.mark.slow
def test_a_live_brokers_token_figures_reach_the_client_and_the_commands(
    live_server: LiveServer,
) -> None:
    """A multi-turn rollout spanning versions 0 and 1 (a tool token masked), handed out at
    version 2 under ``stale_tokens: mask`` with its trained version-0 tokens masked, and a
    plain one."""
    run = rid()
    with BrokerClient(live_server.url) as broker:
        broker.create_run(run, {"max_staleness": 1, "stale_tokens": "mask"})
        broker.set_policy(run, 1)
        old = np.full(6, -0.5, np.float32)
        mask = np.array([1, 1, 1, 0, 1, 1], np.uint8)
        turns = Rollout("a", 0, np.arange(6), 1.0, old, loss_mask=mask, versions=[(0, 0), (4, 1)])
        broker.post_rollouts(run, [turns])
        broker.set_policy(run, 2)
        broker.post_rollouts(run, [Rollout("b", 2, np.arange(4), 0.0, np.full(4, -0.5))])
        with broker.lease(run, size=2) as batch:
            assert batch is not None
            batch.ack_with({"a": old, "b": np.full(4, -0.5, np.float32)})
        acc: Accounting = broker.wait_for_accounting(run, timeout_s=20)
        versions = broker.accounting_versions(run)
    raw = acc.raw
    assert (acc.tokens_generated, acc.tokens_masked, acc.tokens_masked_stale) == (10, 1, 3)
    assert (acc.tokens_masked, acc.tokens_masked_stale) == (
        raw["tokens_masked"],
        raw["tokens_masked_stale"],
    )
    # Samples at lag 1 (a, by v_new) and 0 (b); trained tokens: a's two at lag 1, b's four at 0.
    assert acc.lag.mean == 0.5 and acc.lag.token_mean == pytest.approx(2 / 6)
    assert acc.lag.token_mean == raw["lag"]["token_mean"]
    assert {v.policy_version: v.tokens_masked for v in versions} == {
        v.raw["policy_version"]: v.raw["tokens_masked"] for v in versions
    }
    assert acc.partials == PartialCounts(**raw["partials"]) == PartialCounts()

    code, out, err = invoke(live_server, "accounting", run)
    assert code == 0, err
    lines = out.splitlines()
    assert "10.0% of generated" in row(lines, "tokens masked")
    assert " 3 " in row(lines, "tokens masked stale")
    assert "mean 0.333 " in row(lines, "token lag")
    assert any("partial rollouts" in x for x in lines) and " 0 " in row(lines, "returned")
    code, out, err = invoke(live_server, "watch", run, "--count", "1")
    assert code == 0, err
    assert "token lag mean 0.333 " in out and "10.0% of generated" in out
