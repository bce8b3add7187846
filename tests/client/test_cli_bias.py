"""The bias figures of the accounting (``bias: {length: {generated_mean, trained_mean, ks,
histogram}, reward: {generated_mean, trained_mean}}``): typed in the client, shown by
``rollout-broker accounting`` when the broker reports them and left out when it does not, each
row found by its label and read for its value."""

from __future__ import annotations

from typing import Any

import pytest
from rollout_broker_client import BiasStats, BrokerClient, LengthBias, RewardBias, Rollout
from rollout_broker_client._wire import parse_accounting
from rollout_broker_client.cli.views import accounting_table

from tests.client.live import LiveServer
from tests.client.test_cli import invoke, rid
from tests.client.test_cli_figures import body, rendered, row

# All distinct, so a row cannot show another's figure.
BIAS = {
    "length": {
        "generated_mean": 12.5,
        "trained_mean": 7.25,
        "ks": 0.375,
        "histogram": {"generated": {"0": 1, "8": 3, "64": 4}, "trained": {"8": 5, "64": 3}},
    },
    "reward": {"generated_mean": 0.625, "trained_mean": -0.125},
}


def reported(**fields: Any) -> dict[str, Any]:
    return body(**({"bias": BIAS} | fields))


def test_the_client_types_the_bias_figures_and_reads_an_older_broker() -> None:
    acc = parse_accounting(reported())
    assert acc.bias == BiasStats(
        length=LengthBias(12.5, 7.25, 0.375, {0: 1, 8: 3, 64: 4}, {8: 5, 64: 3}),
        reward=RewardBias(0.625, -0.125),
    )
    assert parse_accounting(body()).bias is None
    empty = {
        "length": {"generated_mean": None, "trained_mean": None, "ks": None, "histogram": {}},
        "reward": {"generated_mean": None, "trained_mean": None},
    }
    assert parse_accounting(reported(bias=empty)).bias == BiasStats()


def test_the_accounting_table_shows_the_bias_figures() -> None:
    lines = rendered(accounting_table(parse_accounting(reported())))
    assert " 0.375 " in row(lines, "length KS")
    assert " mean 12.5 " in row(lines, "length received")
    assert " mean 7.25 " in row(lines, "length trained")
    reward = row(lines, "reward")
    assert " mean 0.625 " in reward and "trained mean -0.125" in reward
    # The two distributions side by side: each bucket's share of its own side.
    at = lines.index(row(lines, "length histograms"))
    shares = [x.split("│")[3].split() for x in lines[at + 1 : at + 4]]
    assert [s[0] for s in shares] == ["0", "8", "64"]
    assert [[p for p in s if p.endswith("%")] for s in shares] == [
        ["12.5%", "0.0%"],
        ["37.5%", "62.5%"],
        ["50.0%", "37.5%"],
    ]


def test_the_accounting_table_leaves_out_what_an_older_broker_does_not_report() -> None:
    lines = rendered(accounting_table(parse_accounting(body())))
    labels = ("length KS", "length received", "length trained", "length histograms")
    assert not [x for x in lines for label in labels if f" {label} " in x]
    none = {"length": {"histogram": {}}, "reward": {}}  # reported, nothing to average: dashes
    lines = rendered(accounting_table(parse_accounting(reported(bias=none))))
    assert " – " in row(lines, "length KS")
    assert " – " in row(lines, "length histograms")


@pytest.mark.slow
def test_a_live_brokers_bias_figures_reach_the_client_and_the_command(
    live_server: LiveServer,
) -> None:
    """Three rollouts received, two of them trained: the command shows the broker's figures."""
    run = rid()
    with BrokerClient(live_server.url) as broker:
        broker.create_run(run)
        sizes = [(4, 1.0), (40, 0.0), (400, 0.5)]
        rollouts = [
            Rollout(f"r{i}", 0, list(range(1, n + 1)), reward=w) for i, (n, w) in enumerate(sizes)
        ]
        broker.post_rollouts(run, rollouts)
        batch = broker.lease_batch(run, 2)
        assert batch is not None and len(batch.rollouts) == 2
        broker.ack(run, batch.batch_id)
        acc = broker.wait_for_accounting(run, timeout_s=20)
    assert acc.bias is not None and acc.bias.length.generated_mean == pytest.approx(444 / 3)
    assert acc.bias.length.ks is not None and acc.bias.reward.generated_mean == 0.5
    code, out, err = invoke(live_server, "accounting", run)
    assert code == 0, err
    lines = out.splitlines()
    assert f" {acc.bias.length.ks:.3g} " in row(lines, "length KS")
    assert f" mean {acc.bias.length.trained_mean:.4g} " in row(lines, "length trained")
