"""The consumers of the accounting (``consumers: {name: {delivered, acked, pending, dropped}}``):
typed in the client, shown by ``rollout-broker accounting`` when the broker reports them (a
note for a run with none) and left out when it does not, each row found by its label and read
for its value; and a live broker's consumers, driven through its store, reaching the command."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from rollout_broker_client import BrokerClient, ConsumerCounts, Rollout
from rollout_broker_client._wire import parse_accounting
from rollout_broker_client.cli.views import accounting_table

from app.broker.store import RedisStore
from tests.client.live import LiveServer, broker_env, serve
from tests.client.test_cli import invoke, rid
from tests.client.test_cli_figures import body, rendered, row
from tests.services import REDIS_URL, fresh_database, redis_prefix

# All distinct, and none another row shows, so a row cannot show another's figure.
CONSUMERS = {
    "rm": {"delivered": 9_871, "acked": 6_543, "pending": 2_109, "dropped": 1_219},
    "dpo.v2": {"delivered": 777, "acked": 701, "pending": 76, "dropped": 0},
}


def reported(**fields: Any) -> dict[str, Any]:
    return body(**({"consumers": CONSUMERS} | fields))


def test_the_client_types_the_consumers_and_reads_an_older_broker() -> None:
    acc = parse_accounting(reported())
    assert acc.consumers == {
        "rm": ConsumerCounts(delivered=9_871, acked=6_543, pending=2_109, dropped=1_219),
        "dpo.v2": ConsumerCounts(delivered=777, acked=701, pending=76, dropped=0),
    }
    assert parse_accounting(body()).consumers is None
    assert parse_accounting(reported(consumers={})).consumers == {}


def test_the_accounting_table_shows_each_consumer() -> None:
    lines = rendered(accounting_table(parse_accounting(reported())))
    rm = row(lines, "rm")
    assert " pending 2,109 " in rm
    assert "delivered 9,871, acked 6,543, dropped 1,219" in rm
    dpo = row(lines, "dpo.v2")
    assert " pending 76 " in dpo and "delivered 777, acked 701, dropped 0" in dpo
    # Under their own heading, in name order.
    at = lines.index(row(lines, "consumers"))
    assert lines.index(dpo) == at + 1 and lines.index(rm) == at + 2


def test_the_accounting_table_notes_none_and_leaves_out_an_older_broker() -> None:
    lines = rendered(accounting_table(parse_accounting(reported(consumers={}))))
    assert "counted from then on" in row(lines, "none")
    lines = rendered(accounting_table(parse_accounting(body())))
    assert not [x for x in lines for label in ("consumers", "none") if x.startswith(f"│ {label} ")]


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[LiveServer, str]]:
    """A live broker, with its key prefix (the consumers are created through its store)."""
    with redis_prefix() as prefix, fresh_database() as db, serve(broker_env(prefix, db)) as s:
        yield s, prefix


async def _drive_consumers(prefix: str, run: str) -> None:
    """rm keeps 2 of the 3 rollouts posted next (retention) and acks one of them."""
    from redis.asyncio import Redis

    redis = Redis.from_url(REDIS_URL)
    try:
        store = RedisStore(redis, prefix)
        await store.create_consumer(run, "rm", source="received", retention_rollouts=2)
    finally:
        await redis.aclose()


async def _ack_one(prefix: str, run: str) -> None:
    from redis.asyncio import Redis

    redis = Redis.from_url(REDIS_URL)
    try:
        store = RedisStore(redis, prefix)
        bid = uuid.uuid4().hex
        got = await store.consumer_lease(run, "rm", batch_id=bid, size=1, lease_ms=60_000)
        assert got is not None
        await store.consumer_ack(run, "rm", bid)
    finally:
        await redis.aclose()


@pytest.mark.slow
def test_a_live_brokers_consumers_reach_the_client_and_the_command(
    served: tuple[LiveServer, str],
) -> None:
    server, prefix = served
    run = rid()
    with BrokerClient(server.url) as broker:
        broker.create_run(run)
        assert broker.wait_for_accounting(run, timeout_s=20).consumers == {}
        code, out, err = invoke(server, "accounting", run)
        assert code == 0, err
        assert "counted from then on" in row(out.splitlines(), "none")

        asyncio.run(_drive_consumers(prefix, run))
        broker.post_rollouts(run, [Rollout(f"r{i}", 0, [1, 2, 3], reward=1.0) for i in range(3)])
        asyncio.run(_ack_one(prefix, run))
        acc = broker.wait_for_accounting(run, timeout_s=20)
    assert acc.consumers == {"rm": ConsumerCounts(delivered=3, acked=1, pending=1, dropped=1)}
    code, out, err = invoke(server, "accounting", run)
    assert code == 0, err
    lines = out.splitlines()
    assert " pending 1 " in row(lines, "rm")
    assert "delivered 3, acked 1, dropped 1" in row(lines, "rm")
