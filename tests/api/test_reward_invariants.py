"""The reward state's indexes agree with each other after any sequence of the calls that change
them: posts with and without rewards (single rollouts and groups), reward leases, scores (with
and without a lease), give-backs, expiries, version moves that retire stale units, rewinds and
trainer leases. Checked against Redis itself after every call, for several seeded sequences."""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from typing import Any

import pytest

from app.keys import (
    AWAITING,
    AWAITING_QUEUE,
    AWAITING_UNITS,
    AWAITING_VERSIONS,
    QUEUE,
    REWARD_LEASES,
    UNIT,
    UNITS,
    member_key,
    run_key,
)
from tests.helpers import lease, make_run, post, rollout

RUN = "inv"
OPS = ["post", "post", "lease", "lease", "score", "return", "wait", "policy", "policy"]


async def check(redis: Any, prefix: str) -> None:
    def k(suffix: str) -> str:
        return run_key(prefix, RUN, suffix)

    aw = {r.decode(): v.decode() for r, v in (await redis.hgetall(k(AWAITING))).items()}
    aun = {u.decode(): json.loads(v) for u, v in (await redis.hgetall(k(AWAITING_UNITS))).items()}
    aq = {u.decode() for u in await redis.zrange(k(AWAITING_QUEUE), 0, -1)}
    av = {u.decode() for u in await redis.zrange(k(AWAITING_VERSIONS), 0, -1)}
    ready = {u.decode() for u in await redis.zrange(k(QUEUE), 0, -1)}
    live = {lid.decode() for lid in await redis.zrange(k(REWARD_LEASES), 0, -1)}
    per_unit = Counter(v.split(" ", 2)[2] for v in aw.values())
    for u, n in per_unit.items():
        if u in aun:
            assert aun[u]["n"] == n, (u, aun[u], n)
        else:  # a group still filling
            assert await redis.hget(member_key(prefix, RUN, UNIT, u), "aw") == str(n).encode()
    assert set(aun) <= set(per_unit), "a unit awaits with no unscored rollout"
    assert av == set(aun), "AV is not every awaiting unit"
    leased = {u for u, s in aun.items() if "l" in s}
    assert aq == set(aun) - leased, "AQ is not every awaiting unit in no reward lease"
    assert not (set(aun) & ready), "an awaiting unit is ready"
    units = await redis.hmget(k(UNITS), *aun) if aun else []
    assert all(units), "an awaiting unit has no record"
    held = Counter()
    for u in leased:
        assert aun[u]["l"] in live, "a unit is held by a reward lease that is not live"
        held[aun[u]["l"]] += aun[u]["n"]
    rwl = int(await redis.hget(k("run"), "rwl") or 0)
    assert rwl == sum(held.values()), (rwl, held)
    for lid in live:
        left = int(await redis.hget(member_key(prefix, RUN, "rl:", lid), "left"))
        assert left == held[lid], (lid, left, held[lid])


@pytest.mark.parametrize("seed", range(4))
async def test_reward_indexes_agree_after_any_calls(api, redis, prefix, seed):
    rng = random.Random(seed)
    await make_run(
        api,
        RUN,
        group_size=2,
        max_staleness=1,
        reward_timeout_s=0.05,
        max_reward_attempts=2,
        drop_zero_variance_groups=True,
    )
    version, leases, scored = 0, [], set()
    n = 0
    for _ in range(80):
        op = rng.choice(OPS)
        if op == "post":
            g = f"g{n}"
            n += 1
            members = [
                rollout(
                    f"{g}-{i}",
                    max(0, version - rng.randrange(2)),
                    group=g,
                    reward=None if rng.random() < 0.7 else float(rng.randrange(2)),
                )
                for i in range(2)
            ]
            for m in members:
                m["policy_version"] = members[0]["policy_version"]
            await post(api, RUN, *members[: rng.choice([1, 2])])
            await post(api, RUN, *members)
        elif op == "lease":
            resp = await api.post(
                f"/v1/runs/{RUN}/rewards/lease", json={"max_rollouts": rng.randrange(1, 5)}
            )
            if resp.status_code == 200:
                leases.append(resp.json())
        elif op == "score" and leases:
            got = rng.choice(leases)
            picked = [r["rollout_id"] for r in got["rollouts"] if rng.random() < 0.6]
            body: dict[str, Any] = {"rewards": {rid: float(rng.randrange(2)) for rid in picked}}
            if rng.random() < 0.5:
                body["lease_id"] = got["lease_id"]
            resp = await api.post(f"/v1/runs/{RUN}/rewards", json=body)
            assert resp.status_code in (200, 409), resp.text  # 409: scored before, another value
            if resp.status_code == 200:
                scored.update(picked)
        elif op == "return" and leases:
            got = leases.pop(rng.randrange(len(leases)))
            resp = await api.post(f"/v1/runs/{RUN}/rewards/lease/{got['lease_id']}/return")
            assert resp.status_code == 200, resp.text
        elif op == "wait":
            await asyncio.sleep(0.06)  # reward leases run out; the next lease call sweeps them
        elif op == "policy":
            if version > 1 and rng.random() < 0.3:
                version -= 1
                body = {"version": version, "rewind": True}
            else:
                version += 1
                body = {"version": version}
            assert (await api.post(f"/v1/runs/{RUN}/policy", json=body)).status_code == 200
        if rng.random() < 0.2:
            got = await lease(api, RUN, 2)
            if got.status_code == 200:
                batch = got.json()
                assert all(r["reward"] is not None for r in batch["rollouts"])
                await api.post(f"/v1/runs/{RUN}/batches/{batch['batch_id']}/ack", json={})
        await check(redis, prefix)
