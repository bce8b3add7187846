"""The prompt and work-lease scripts called directly through the store: the staleness budget's
count against an independent recount of the state, under random sequences of every operation."""

from __future__ import annotations

import random
import uuid
from typing import Any

import msgpack
import pytest

from app import keys
from app.broker.config import RunConfig
from app.broker.packing import pack_rollout, unpack_rollouts
from app.broker.store import Lease, RedisStore, StoreError, WorkItem
from app.events import Acked, AckedItem, AckStats, AckSums, pack_payload

B = 3
GROUP = 2


def group_rollouts(item: WorkItem, version: int, rewards: tuple[float, float] = (0.0, 1.0)):
    return [
        pack_rollout(
            rollout_id=f"{item.group_id}/{i}/{uuid.uuid4().hex[:6]}",
            group_id=item.group_id,
            policy_version=version,
            prompt_ids=None,
            response_ids=[1, 2, 3],
            logprobs=None,
            reward=rewards[i],
            finish_reason=None,
            metadata=None,
            max_tokens=4096,
        )
        for i in range(GROUP)
    ]


async def recount(store: RedisStore, run: str, passes: list[str]) -> dict[str, Any]:
    """The run's prompt passes (``passes``: their ids) by state, read key by key (not from the
    scripts' counters), in one pipeline: a SCAN would walk every key of the shared Redis."""
    r = store.redis
    async with r.pipeline(transaction=False) as pipe:
        for pk in passes:
            pipe.hget(keys.member_key(store.prefix, run, keys.PASS, pk), "st")
        pipe.hget(store.run_key(run), "adm")
        pipe.zcard(keys.run_key(store.prefix, run, keys.PROMPT_QUEUE))
        *sts, adm, queued = await pipe.execute()
    states: dict[str, int] = {}
    for st in sts:
        states[st.decode()] = states.get(st.decode(), 0) + 1
    return {"states": states, "adm": int(adm or 0), "queued": queued}


@pytest.mark.parametrize("seed", range(4))
async def test_the_budget_count_matches_the_state_under_random_operations(store, seed):
    rng = random.Random(seed)
    run = f"r{seed}"
    await store.create_run(
        run,
        RunConfig(
            group_size=GROUP,
            step_groups=B,
            max_staleness=1,
            max_attempts=3,
            order="fifo",
            drop_zero_variance_groups=True,
        ),
    )
    await store.register_prompts(run, [(f"p{i}", b"\x80") for i in range(40)], epochs=2)
    passes = [f"p{i}#{n}" for i in range(40) for n in (1, 2)]
    done_by_use = DoneByUse(store, run)
    version = 0
    held: dict[str, tuple[str, list[WorkItem], int]] = {}  # lease id -> (lease, items, version)
    for _ in range(120):
        op = rng.choice(["work", "work", "post", "post", "train", "return", "expire", "policy"])
        if op == "work":
            lid = uuid.uuid4().hex
            got = await store.work(
                run, lease_id=lid, max_prompts=rng.randint(1, 4), generator_id=None
            )
            if got is not None:
                held[lid] = (lid, list(got.items), got.policy_version)
        elif op == "post" and held:
            lid = rng.choice(sorted(held))
            _, items, v = held[lid]
            if items:
                item = items.pop(rng.randrange(len(items)))
                rewards = (1.0, 1.0) if rng.random() < 0.2 else (0.0, 1.0)
                await store.ingest(run, group_rollouts(item, v, rewards))
        elif op == "train":
            got_lease = await store.lease(
                run,
                batch_id=uuid.uuid4().hex,
                size=GROUP,
                policy_version=None,
                partial=False,
                trainer_id=None,
            )
            if isinstance(got_lease, Lease):
                await store.ack(
                    run, got_lease.batch_id, kl_mean=None, event=_acked(got_lease), stats_text="{}"
                )
        elif op == "return" and held:
            lid = rng.choice(sorted(held))
            await store.return_work(run, lid, None)
            del held[lid]
        elif op == "expire" and held:
            lid = rng.choice(sorted(held))
            await store.redis.zadd(keys.run_key(store.prefix, run, keys.WORK_LEASES), {lid: 1})
            await store.sweep(run)
            del held[lid]
        elif op == "policy":
            version += 1
            await store.set_policy(run, version)

        seen = await recount(store, run, passes)
        st = seen["states"]
        # Every pass is somewhere, and the queue holds exactly the queued ones.
        assert sum(st.values()) == 80
        assert seen["queued"] == st.get("q", 0)
        # Admitted = in flight + complete groups waiting for a trainer + groups that reached a
        # gradient: the passes done by an ack (zero_variance ones are done unused).
        used = await done_by_use.count()
        assert seen["adm"] == st.get("w", 0) + st.get("b", 0) + used, (op, seen)
        # And never more than the budget allows at this version.
        assert seen["adm"] <= (version + 1 + 1) * B


class DoneByUse:
    """Passes done by an ack so far: the items of the run's `passes` events of cause `acked`,
    read from where the last count stopped."""

    def __init__(self, store: RedisStore, run: str) -> None:
        self.store, self.run, self.after, self.n = store, run, "-", 0

    async def count(self) -> int:
        for sid, f in await self.store.redis.xrange(self.store.events_key(self.run), self.after):
            self.after = "(" + sid.decode()
            if f[b"e"] == b"passes":
                d = msgpack.unpackb(f[b"d"], raw=False)
                if d["cause"] == "acked":
                    self.n += len(d["items"])
        return self.n


def _acked(lease: Lease) -> bytes:
    rollouts = unpack_rollouts([r.blob for r in lease.rollouts])
    return pack_payload(
        "acked",
        Acked(
            batch_id=lease.batch_id,
            step=None,
            policy_version=lease.policy_version,
            items=tuple(
                AckedItem(r.rollout_id, r.policy_version, r.response_ids.size, None)
                for r in rollouts
            ),
            stats=AckStats(),
            sums=AckSums(),
        ),
    )


async def test_work_refuses_unknown_runs_and_reports_the_budget_left(store):
    with pytest.raises(StoreError) as err:
        await store.work("nope", lease_id="l" * 8, max_prompts=1, generator_id=None)
    assert err.value.code == "run_missing"
    await store.create_run("r", RunConfig(step_groups=2, max_staleness=0))
    await store.register_prompts("r", [("a", b"\x80"), ("b", b"\x80"), ("c", b"\x80")], 1)
    got = await store.work("r", lease_id="lease-1", max_prompts=5, generator_id="g")
    assert got is not None and [i.group_id for i in got.items] == ["a#1.1", "b#1.1"]
    assert await store.work("r", lease_id="lease-2", max_prompts=5, generator_id="g") is None
