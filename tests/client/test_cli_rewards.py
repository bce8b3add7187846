"""The reward figures of the accounting (``rewards: {awaiting, leased, scored, timed_out}`` and
``wait.reward_s``): typed in the client, shown by ``rollout-broker accounting`` and ``watch``
when the broker reports them and left out when it does not, each row found by its label and
read for its value."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from rollout_broker_client import BrokerClient, RewardCounts, Rollout, Run
from rollout_broker_client._wire import parse_accounting
from rollout_broker_client.cli.views import accounting_table
from rollout_broker_client.cli.watch import _Frame, watch_view

from tests.client.live import LiveServer
from tests.client.test_cli import invoke, rid
from tests.client.test_cli_figures import body, rendered, row

# All distinct, so a row cannot show another's figure.
REWARDS = {"awaiting": 13, "leased": 6, "scored": 40, "timed_out": 3}
REWARD_S = 18.0  # 40 scored: a mean of 0.45 s each


def reported(**fields: Any) -> dict[str, Any]:
    wait = {"generator_s": 2.5, "trainer_s": 1.25, "reward_s": REWARD_S}
    live = {"buffered": 2, "leased": 0, "rewards": {"awaiting": 13, "leased": 6}}
    return body(**({"rewards": REWARDS, "wait": wait, "live": live} | fields))


RUN = Run(
    run_id="w",
    config={"max_staleness": 2},
    policy_version=3,
    status="open",
    created_at=datetime(2026, 1, 1, tzinfo=UTC),
)


def test_the_client_types_the_reward_figures_and_reads_an_older_broker() -> None:
    acc = parse_accounting(reported())
    assert acc.rewards == RewardCounts(**REWARDS)
    assert acc.wait.reward_s == REWARD_S and acc.wait.trainer_s == 1.25
    assert acc.mean_reward_wait_s == pytest.approx(0.45)
    older = parse_accounting(body(wait={"generator_s": 2.5, "trainer_s": 1.25}))
    assert older.rewards is None and older.wait.reward_s is None
    assert older.mean_reward_wait_s is None
    none_scored = parse_accounting(reported(rewards=dict(REWARDS, scored=0)))
    assert none_scored.mean_reward_wait_s is None  # no division by zero


def test_the_ledger_check_holds_the_rewards_against_the_live_counts() -> None:
    acc = parse_accounting(reported())
    assert acc.matches_live and acc.rewards_match_live is True
    lines = rendered(accounting_table(acc))
    assert "✓" in row(lines, "buffered + leased + retired")
    off = {"buffered": 2, "leased": 0, "rewards": {"awaiting": 12, "leased": 7}}
    wrong = parse_accounting(reported(live=off))
    assert not wrong.matches_live and wrong.rewards_match_live is False
    check = row(rendered(accounting_table(wrong)), "ledger = live")
    assert "awaiting a reward 13, in reward leases 6 are not the live 12, 7" in check
    # A broker that reports no reward figures is checked on the rest, as before.
    older = parse_accounting(body())
    assert older.matches_live and older.rewards_match_live is None
    assert "✓" in row(rendered(accounting_table(older)), "buffered + leased + retired")


def test_the_accounting_table_shows_the_reward_figures() -> None:
    lines = rendered(accounting_table(parse_accounting(reported())))
    assert any("rewards" in x for x in lines)
    assert " 13 " in row(lines, "awaiting")
    assert " 6 " in row(lines, "in reward leases")
    assert " 40 " in row(lines, "scored")
    assert " 3 " in row(lines, "timed out")
    waited = row(lines, "rewards waited")
    assert "18.0 s" in waited and "mean 0.45 s per rollout scored" in waited
    assert "1.2 s" in row(lines, "trainers waited")  # its own figure still


def test_the_accounting_table_leaves_out_what_an_older_broker_does_not_report() -> None:
    lines = rendered(accounting_table(parse_accounting(body())))
    labels = ("awaiting", "in reward leases", "timed out", "rewards waited")
    assert not [x for x in lines for label in labels if f" {label} " in x]
    assert row(lines, "trainers waited")  # the waits section is there, without rewards
    zeros = dict.fromkeys(REWARDS, 0)  # reported, all 0: shown
    lines = rendered(accounting_table(parse_accounting(reported(rewards=zeros))))
    assert " 0 " in row(lines, "awaiting")
    assert "none scored yet" in row(lines, "rewards waited")


def test_watch_shows_the_reward_figures_and_the_scoring_rate() -> None:
    before = _Frame(RUN, parse_accounting(reported(rewards=dict(REWARDS, scored=30))), 10.0)
    now = _Frame(RUN, parse_accounting(reported()), 12.0)
    lines = rendered(watch_view(now, before))
    scored = row(lines, "rewards scored")
    assert " 40 " in scored and "awaiting 13, in reward leases 6, timed out 3" in scored
    assert "5.0 scored/s" in scored  # (40 - 30) / 2 s
    waited = row(lines, "rewards waited")
    assert "18.0 s" in waited and "mean 0.45 s" in waited
    older = rendered(watch_view(_Frame(RUN, parse_accounting(body()), 0.0), None))
    assert not [x for x in older if "rewards" in x]


@pytest.mark.slow
def test_a_live_brokers_reward_figures_reach_the_client_and_the_commands(
    live_server: LiveServer,
) -> None:
    """Five rollouts posted without a reward: three scored by a reward worker, one held in its
    live lease and one awaiting; the commands show the broker's own figures."""
    run = rid()
    with BrokerClient(live_server.url) as broker:
        broker.create_run(run)
        broker.post_rollouts(run, [Rollout(f"r{i}", 0, [1, 2, i]) for i in range(5)])
        lease = broker.reward_lease(run, 3)
        assert lease is not None
        broker.score(run, {r.rollout_id: 0.5 for r in lease.rollouts}, lease_id=lease.lease_id)
        held = broker.reward_lease(run, 1)  # held: leased
        assert held is not None
        acc = broker.wait_for_accounting(run, timeout_s=20)
    assert acc.rewards == RewardCounts(awaiting=1, leased=1, scored=3, timed_out=0)
    assert acc.rewards == RewardCounts(**acc.raw["rewards"])
    assert acc.wait.reward_s is not None and acc.wait.reward_s == acc.raw["wait"]["reward_s"] > 0

    code, out, err = invoke(live_server, "accounting", run)
    assert code == 0, err
    lines = out.splitlines()
    assert " 1 " in row(lines, "awaiting") and " 1 " in row(lines, "in reward leases")
    assert " 3 " in row(lines, "scored") and " 0 " in row(lines, "timed out")
    assert f"mean {acc.wait.reward_s / 3:.3g} s" in row(lines, "rewards waited")
    code, out, err = invoke(live_server, "watch", run, "--count", "1")
    assert code == 0, err
    assert "awaiting 1, in reward leases 1, timed out 0" in out


def test_tokens_create_takes_the_reward_scope() -> None:
    """``-s reward`` passes the command's own check and goes to the broker (unreachable
    here), where ``-s root`` is refused before any request."""
    code, _, err = invoke(
        None, "tokens", "create", "rm-0", "-s", "reward", "--url", "http://127.0.0.1:9"
    )
    assert code == 1 and "127.0.0.1:9" in err, err
