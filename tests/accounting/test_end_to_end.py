"""The real broker, through HTTP, then the real drain: the accounting in Postgres agrees with
what the API answered and with the live state in Redis, and the SPEC's invariants hold."""

from __future__ import annotations

import asyncio

import httpx
from accounting_helpers import drain_all

from app.broker.store import RedisStore
from tests.helpers import ack, lease, make_run, post, rollout


def group(gid: str, version: int, rewards=(0.0, 1.0)) -> list[dict]:
    return [
        rollout(f"{gid}-{i}", version, group=gid, reward=r, tokens=3 + i)
        for i, r in enumerate(rewards)
    ]


async def test_a_mixed_workload_adds_up(api: httpx.AsyncClient, make_ctx, prefix, redis):
    run = "e2e"
    await make_run(
        api,
        run,
        group_size=2,
        max_reuse=2,
        max_staleness=1,
        kl_max=0.3,
        kl_flush=0.25,
        drop_zero_variance_groups=True,
    )
    said = {"accepted": 0, "duplicates": 0, "consumed": 0, "acked_sizes": 0}

    async def send(*rollouts) -> dict:
        body = (await post(api, run, *rollouts)).json()
        said["accepted"] += body["accepted"]
        said["duplicates"] += body["duplicates"]
        return body

    async def take(size: int, **kw) -> dict:
        resp = await lease(api, run, size, **kw)
        assert resp.status_code == 200, resp.text
        return resp.json()

    async def give(batch: dict, lp_shift: dict[str, float] | None = None) -> dict:
        lp = {
            r["rollout_id"]: [x + (lp_shift or {}).get(r["rollout_id"], 0.0) for x in r["logprobs"]]
            for r in batch["rollouts"]
        }
        body = (await ack(api, run, batch["batch_id"], logprobs=lp)).json()
        said["consumed"] += body["consumed"]
        said["acked_sizes"] += len(batch["rollouts"])
        return body

    for g in range(2):
        await send(*group(f"g{g}", 0))
    # g0 and g1, twice: the only rollouts buffered
    assert (await give(await take(4)))["retired"] == 0
    assert (await give(await take(4)))["retired"] == 4  # g0, g1 at max_reuse
    for g in range(2, 6):
        await send(*group(f"g{g}", 0))
    await send(*group("same", 0, rewards=(1.0, 1.0)))  # zero variance: retires at once
    assert (await send(*group("g0", 0)))["duplicates"] == 2
    assert (await send(rollout("ahead", 5, group="x")))["rejected"][0]["reason"] == "future_version"

    # freshest order within v0: fewer uses first, then arrival
    third = await take(4)
    assert {r["group_id"] for r in third["rollouts"]} == {"g2", "g3"}
    assert (await give(third, lp_shift={"g2-0": -2.0}))["retired"] == 2  # g2 far off-policy: kl
    nacked = await take(2)
    assert (await api.post(f"/v1/runs/{run}/batches/{nacked['batch_id']}/nack")).status_code == 200
    await api.patch(f"/v1/runs/{run}/config", json={"lease_timeout_s": 0.05})
    expiring = await take(2)
    await asyncio.sleep(0.06)  # not a race: the lease's own 50 ms must pass for it to expire
    assert (await ack(api, run, expiring["batch_id"])).status_code == 409
    await api.patch(f"/v1/runs/{run}/config", json={"lease_timeout_s": 300})

    await api.post(f"/v1/runs/{run}/policy", json={"version": 1})
    for g in range(3):
        await send(*group(f"h{g}", 1))
    await api.post(f"/v1/runs/{run}/policy", json={"version": 2})  # v0 is now stale
    await send(*group("k0", 2))
    assert (await send(rollout("old", 0, group="y")))["rejected"][0]["reason"] == "stale"
    fresh = await take(2)
    assert {r["group_id"] for r in fresh["rollouts"]} == {"k0"}
    # log_r = -1 on every token: k3 = e^-1 ≈ 0.37, above kl_max (k0 retires) and kl_flush
    flushed = await give(fresh, lp_shift={"k0-0": -1.0, "k0-1": -1.0})
    assert (flushed["retired"], flushed["flushed"]) == (2, 6)  # k0; the three v1 groups
    await send(*group("k1", 2))
    held = await take(2)  # one lease left open at the end

    await drain_all(make_ctx())
    acc = (await api.get(f"/v1/runs/{run}/accounting")).json()
    live = await RedisStore(redis, prefix).get_run(run)

    assert acc["pending_events"] == 0
    assert acc["rollouts_received"] == said["accepted"] == 12 + 2 + 6 + 2 + 2
    assert acc["duplicates"] == said["duplicates"] == 2
    assert acc["rejected"] == {"future_version": 1, "stale": 1}
    assert acc["groups_received"] == 12
    assert acc["leased"] == live.leased == len(held["rollouts"]) == 2
    assert acc["buffered"] == live.live - live.leased == 0
    assert (
        acc["live"] == {"buffered": 0, "leased": 2, "rewards": {"awaiting": 0, "leased": 0}}
        and acc["dead_letters"] == 0
    )
    retired = acc["retired"]
    assert acc["rollouts_received"] == acc["buffered"] + acc["leased"] + sum(retired.values())
    assert retired == {"max_reuse": 4, "kl": 4, "zero_variance": 2, "stale": 6, "kl_flush": 6}
    assert acc["samples_consumed"] == said["consumed"] == said["acked_sizes"] == 14
    assert acc["reuse_factor"] == acc["samples_consumed"] / acc["rollouts_received"]
    assert acc["batches"] == {"leased": 7, "acked": 4, "nacked": 1, "expired": 1}
    # wasted: tokens of rollouts that retired unused, 3 + 4 per group: 'same', g4 and g5 (stale,
    # after a nack and an expiry; g3 was used once), h0..h2 (flushed)
    assert acc["wasted_tokens"] == (1 + 2 + 3) * 7

    rows = (await api.get(f"/v1/runs/{run}/accounting/versions")).json()
    per_version = rows["versions"] if isinstance(rows, dict) else rows
    for key in ("rollouts_received", "samples_consumed", "tokens_generated", "buffered", "leased"):
        assert sum(r[key] for r in per_version) == acc[key], key
