"""A quarantined generator as the client meets it: its posts raise GeneratorQuarantined with the
rollouts unsent, and the operator's release lifts it (once); the CLI's ``generators release``."""

from __future__ import annotations

import pytest
from rollout_broker_client import AsyncBrokerClient, GeneratorQuarantined, Rollout

from tests.broker.test_quarantine import ack_gens, gen_entry, packed
from tests.broker.test_store import lease
from tests.client.live import LiveServer
from tests.client.test_cli import invoke, rid


async def test_a_quarantined_generator_is_refused_until_released(
    broker: AsyncBrokerClient, store
) -> None:
    await broker.create_run("r", {"generator_kl_max": 0.1, "generator_window_tokens": 4})
    await store.ingest("r", [packed("a", "gen-x")])
    got = await lease(store, 1)
    await ack_gens(store, got.batch_id, [gen_entry("gen-x", 4, 4.0)])  # a mean KL of 1

    mine = [Rollout(f"x{i}", 0, [1, 2], generator_id="gen-x") for i in range(2)]
    with pytest.raises(GeneratorQuarantined) as refused:
        await broker.post_rollouts("r", mine)
    assert refused.value.status == 409 and "gen-x" in refused.value.detail
    # Another generator's rollouts go on.
    ok = await broker.post_rollouts("r", [Rollout("y", 0, [1], generator_id="gen-y")])
    assert ok.accepted == 1

    assert await broker.release_generator("r", "gen-x") is True
    assert await broker.release_generator("r", "gen-x") is False
    assert (await broker.post_rollouts("r", mine)).accepted == 2


@pytest.mark.slow
def test_the_cli_releases_a_generator(live_server: LiveServer) -> None:
    run = rid()
    assert invoke(live_server, "runs", "create", run)[0] == 0
    code, out, err = invoke(live_server, "generators", "release", run, "gen/with-slash")
    assert code == 0, err
    assert "generator gen/with-slash of run" in out and "was not quarantined" in out
    code, _, err = invoke(live_server, "generators", "release", "no-such-run", "g")
    assert code != 0 and "RunNotFound" in err
