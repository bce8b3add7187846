"""The Lua scripts against the event schema of app/events/: a run is driven through
every change the broker makes (over HTTP, so the service's own part of the `acked` event is in
it too), and every entry of its stream must decode strictly, say what was done, and come back
unchanged from the schema's encoder. A script whose `emit` drifts from the schema fails here."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import httpx
import msgpack
from redis.asyncio import Redis

from app import keys
from app.broker.store import RedisStore
from app.events import (
    EVENT_TYPES,
    Accepted,
    Acked,
    ConsumersChanged,
    Duplicate,
    Event,
    GeneratorChanged,
    Leased,
    PartialsChanged,
    PassesChanged,
    PromptScored,
    Registered,
    Rejected,
    Retired,
    Returned,
    RewardExpired,
    RewardExpiredItem,
    RewardLeased,
    RewardReturned,
    Rewound,
    RunChanged,
    Scored,
    Waited,
    WorkLeased,
    decode_entry,
    encode_entry,
    encode_payload,
    lag_of,
)
from app.keys import events_key
from tests.api.test_rewards import _expire as expire_reward_lease
from tests.api.test_rewards import reward_lease, score
from tests.helpers import ack, lease, make_run, post, rollout

RETIRE_REASONS = {
    "stale",
    "max_reuse",
    "kl",
    "kl_flush",
    "incomplete_group",
    "zero_variance",
    "run_closed",
    "rewound",
    "reward_timeout",
    "quarantined",
}


def canonical(value: Any) -> Any:
    """A value up to what Lua's msgpack encoder does to it (a whole float becomes an integer),
    with each scalar tagged by its type, as ``True == 1`` would hide a flag written as a bool."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, list):
        return [canonical(v) for v in value]
    if isinstance(value, dict):
        return {k: canonical(v) for k, v in value.items()}
    return (type(value).__name__, value)


class Script:
    """Drives one run over HTTP and remembers what it did, to check the events against."""

    def __init__(self, client: httpx.AsyncClient, run_id: str) -> None:
        self.client = client
        self.run_id = run_id
        self.rollouts: dict[str, tuple[int, int]] = {}  # rollout_id -> (version, tokens)
        self.rejected: dict[str, str] = {}  # rollout_id -> reason
        self.leases: dict[str, dict[str, Any]] = {}  # batch_id -> the lease's reply
        self.trainers: dict[str, str | None] = {}  # batch_id -> trainer_id asked for
        self.acks: dict[str, dict[str, Any]] = {}  # batch_id -> the ack's body
        self.answers: dict[str, dict[str, Any]] = {}  # batch_id -> the ack's reply
        self.returned: dict[str, str] = {}  # batch_id -> nacked | expired
        self.work: dict[str, dict[str, Any]] = {}  # lease_id -> the work lease's reply
        self.generators: dict[str, str | None] = {}  # lease_id -> generator_id asked for
        self.registered: dict[str, int] = {}  # prompt_id -> epochs
        self.rewinds: list[tuple[int, int]] = []  # (from, to)
        self.unscored: set[str] = set()  # rollout_ids posted without a reward
        self.reward_leases: dict[str, dict[str, Any]] = {}  # lease_id -> the reward lease's reply
        self.reward_workers: dict[str, str | None] = {}  # lease_id -> worker_id asked for
        self.scores: dict[str, float] = {}  # rollout_id -> its reward, posted later
        self.scored_leased: set[str] = set()  # of them, those scored while in a reward lease
        self.rewards_back: dict[str, str] = {}  # lease_id -> reward_returned | reward_expired
        self.generator_of: dict[str, str] = {}  # rollout_id -> generator_id, when it named one
        self.quarantines: list[tuple[str, bool]] = []  # (generator_id, quarantined), in order
        self.posted_rewards: dict[str, float] = {}  # rollout_id -> the reward it was posted with
        self.prompt_means: list[list[Any]] = []  # the prompt_scored items expected, in order
        self.skipped: list[tuple[str, int]] = []  # (prompt_id, pass) expected skipped
        self.consumer_events: list[list[list[Any]]] = []  # each consumers event's items, in order

    async def send(self, *rollouts: dict[str, Any]) -> dict[str, Any]:
        resp = await post(self.client, self.run_id, *rollouts)
        assert resp.is_success, resp.text
        body: dict[str, Any] = resp.json()
        for r in rollouts:
            self.rollouts.setdefault(r["rollout_id"], (r["policy_version"], len(r["response_ids"])))
            if r.get("reward") is None:
                self.unscored.add(r["rollout_id"])
            else:
                self.posted_rewards.setdefault(r["rollout_id"], r["reward"])
            if r.get("generator_id") is not None:
                self.generator_of.setdefault(r["rollout_id"], r["generator_id"])
        for rej in body["rejected"]:
            self.rejected[rej["rollout_id"]] = rej["reason"]
        return body

    async def take(self, size: int, **params: Any) -> dict[str, Any]:
        resp = await lease(self.client, self.run_id, size, **params)
        assert resp.status_code == 200, resp.text
        batch: dict[str, Any] = resp.json()
        self.leases[batch["batch_id"]] = batch
        self.trainers[batch["batch_id"]] = params.get("trainer_id")
        return batch

    async def give(self, batch: dict[str, Any], **body: Any) -> httpx.Response:
        resp = await ack(self.client, self.run_id, batch["batch_id"], **body)
        if resp.status_code == 200:
            self.acks[batch["batch_id"]] = body
            self.answers[batch["batch_id"]] = resp.json()
        return resp

    async def nack(self, batch: dict[str, Any]) -> None:
        resp = await self.client.post(f"/v1/runs/{self.run_id}/batches/{batch['batch_id']}/nack")
        assert resp.status_code == 200, resp.text
        self.returned[batch["batch_id"]] = "nacked"

    async def patch(self, **fields: Any) -> None:
        resp = await self.client.patch(f"/v1/runs/{self.run_id}/config", json=fields)
        assert resp.status_code == 200, resp.text

    async def policy(self, version: int) -> None:
        resp = await self.client.post(f"/v1/runs/{self.run_id}/policy", json={"version": version})
        assert resp.status_code == 200, resp.text

    async def rewind(self, version: int) -> None:
        before = (await self.client.get(f"/v1/runs/{self.run_id}")).json()["policy_version"]
        body = {"version": version, "rewind": True}
        resp = await self.client.post(f"/v1/runs/{self.run_id}/policy", json=body)
        assert resp.status_code == 200, resp.text
        self.rewinds.append((before, version))

    async def reward_take(self, k: int, **body: Any) -> dict[str, Any]:
        resp = await reward_lease(self.client, self.run_id, k, **body)
        assert resp.status_code == 200, resp.text
        got: dict[str, Any] = resp.json()
        self.reward_leases[got["lease_id"]] = got
        self.reward_workers[got["lease_id"]] = body.get("worker_id")
        return got

    async def score(self, rewards: dict[str, float], lease_id: str | None = None) -> None:
        body = {} if lease_id is None else {"lease_id": lease_id}
        resp = await score(self.client, self.run_id, rewards, **body)
        assert resp.json()["scored"] == len(rewards), resp.text
        self.scores.update(rewards)
        if lease_id is not None:
            self.scored_leased.update(rewards)

    async def reward_give_back(self, lease_id: str) -> None:
        url = f"/v1/runs/{self.run_id}/rewards/lease/{lease_id}/return"
        assert (await self.client.post(url, json={})).status_code == 200
        self.rewards_back[lease_id] = "reward_returned"

    async def reward_expire(self, lease_id: str) -> None:
        await expire_reward_lease(self.client, self.run_id, lease_id)
        self.rewards_back[lease_id] = "reward_expired"

    async def release(self, generator_id: str) -> None:
        url = f"/v1/runs/{self.run_id}/generators/{generator_id}/release"
        resp = await self.client.post(url)
        assert resp.status_code == 200 and resp.json()["released"], resp.text
        self.quarantines.append((generator_id, False))

    def generator(self, rid: str) -> str | None:
        """The generator a rollout names, or by default its work lease's (SPEC "Rollouts")."""
        if rid in self.generator_of:
            return self.generator_of[rid]
        group = rid.rsplit("-", 1)[0]
        for lease_id, reply in self.work.items():
            if any(p["group_id"] == group for p in reply["prompts"]):
                return self.generators[lease_id]
        return None

    def per_generator(self, rids: list[str]) -> list[tuple[str, int]]:
        """(generator_id, rollouts) of ``rids`` that name one, sorted."""
        counts: dict[str, int] = {}
        for rid in rids:
            gen = self.generator(rid)
            if gen is not None:
                counts[gen] = counts.get(gen, 0) + 1
        return sorted(counts.items())

    async def close(self) -> None:
        resp = await self.client.post(f"/v1/runs/{self.run_id}/close")
        assert resp.status_code == 200, resp.text

    async def register(self, *pids: str, epochs: int = 1) -> None:
        body = {"prompts": [{"prompt_id": p} for p in pids], "epochs": epochs}
        resp = await self.client.post(f"/v1/runs/{self.run_id}/prompts", json=body)
        assert resp.status_code == 202, resp.text
        for p in pids:
            self.registered.setdefault(p, epochs)

    async def take_work(self, k: int, **body: Any) -> dict[str, Any] | None:
        resp = await self.client.post(
            f"/v1/runs/{self.run_id}/work", json={"max_prompts": k, **body}
        )
        if resp.status_code == 204:
            return None
        assert resp.status_code == 200, resp.text
        lease_body: dict[str, Any] = resp.json()
        self.work[lease_body["lease_id"]] = lease_body
        self.generators[lease_body["lease_id"]] = body.get("generator_id")
        return lease_body


def group(gid: str, version: int, rewards: tuple[float, ...] = (0.0, 1.0)) -> list[dict[str, Any]]:
    return [
        rollout(f"{gid}-{i}", version, group=gid, reward=r, tokens=3 + i)
        for i, r in enumerate(rewards)
    ]


def shifted(batch: dict[str, Any], by: float) -> dict[str, list[float]]:
    return {r["rollout_id"]: [x + by for x in r["logprobs"]] for r in batch["rollouts"]}


async def grouped_run(client: httpx.AsyncClient, run_id: str) -> Script:
    """Groups of two: every retirement reason, duplicates, every rejection, ack with logprobs
    and with ready-made KL, nack, expiry, config and policy changes, close."""
    s = Script(client, run_id)
    await make_run(
        client,
        run_id,
        group_size=2,
        max_reuse=2,
        max_staleness=1,
        kl_max=0.3,
        kl_flush=0.25,
        drop_zero_variance_groups=True,
    )
    for g in range(4):
        await s.send(*group(f"g{g}", 0))
    await s.send(*group("same", 0, rewards=(1.0, 1.0)))  # zero_variance
    assert (await s.send(*group("g0", 0)))["duplicates"] == 2
    await s.send(rollout("ahead", 5, group="x"))  # future_version

    for step in (1, 2):  # g0 and g1 twice: max_reuse
        batch = await s.take(4, trainer_id="t0")
        assert (await s.give(batch, logprobs=shifted(batch, -0.01), step=step)).status_code == 200
    third = await s.take(2)  # g2: one ready-made KL above kl_max, one not measured at all
    measured = third["rollouts"][0]["rollout_id"]
    assert (await s.give(third, kl={measured: 0.5})).status_code == 200
    await s.nack(await s.take(2))  # g3

    await s.patch(lease_timeout_s=0.05)
    expiring = await s.take(2)
    await asyncio.sleep(0.06)  # the lease's own 50 ms must pass
    assert (await s.give(expiring)).status_code == 409
    s.returned[expiring["batch_id"]] = "expired"
    await s.patch(lease_timeout_s=300)

    await s.send(rollout("lonely-0", 0, group="lonely"))  # never completed
    await s.patch(group_timeout_s=0.05)
    await asyncio.sleep(0.06)
    await s.nack(await s.take(2))  # the lease's sweep retires it: incomplete_group
    await s.patch(group_timeout_s=600)

    await s.policy(1)
    behind = await s.take(2, trainer_id="t1")  # g3 (v0) at V=1: lag 1
    assert [r["lag"] for r in behind["rollouts"]] == [1, 1]
    await s.nack(behind)
    for g in range(2):
        await s.send(*group(f"h{g}", 1))
    await s.policy(2)  # g3 (v0) is now stale
    await s.send(*group("old", 0))  # stale at ingest
    await s.send(*group("k0", 2))
    fresh = await s.take(2)
    # log_r = -1: k3 = e^-1 - 1 + 1 ≈ 0.37, above kl_max (k0 retires) and kl_flush (h0, h1 go)
    assert (await s.give(fresh, logprobs=shifted(fresh, -1.0), step=3)).status_code == 200

    await s.send(*group("k1", 2))
    held = await s.take(2)
    await s.send(*group("k2", 2))
    await s.close()  # k2 retires: run_closed
    await s.send(*group("late", 2))  # run_closed at ingest
    await s.nack(held)  # k1 comes back to a closed run: run_closed
    return s


async def single_run(client: httpx.AsyncClient, run_id: str) -> Script:
    """Single rollouts: no trainer id, an ack that measures nothing and gives no step."""
    s = Script(client, run_id)
    await make_run(client, run_id)
    await s.send(*(rollout(f"s{i}", 0, tokens=2 + i, logprobs=False) for i in range(3)))
    assert (await s.give(await s.take(2))).status_code == 200
    await s.close()
    return s


async def rewind_run(client: httpx.AsyncClient, run_id: str) -> Script:
    """Batches acked at 0, 1 and 2, then a rewind to 0: the batches at 1 and 2 are undone (one
    use given back per rollout per batch, retired rollouts' too), what was sampled above 0
    retires `rewound`."""
    s = Script(client, run_id)
    await make_run(client, run_id, max_reuse=2, max_staleness=4)
    await s.send(rollout("r0", 0, tokens=2), rollout("r1", 0, tokens=3))
    assert (await s.give(await s.take(2))).status_code == 200
    await s.policy(1)
    await s.send(rollout("r2", 1, tokens=4))
    assert (await s.give(await s.take(3))).status_code == 200  # r0, r1 retire: max_reuse
    await s.policy(2)
    await s.send(rollout("r3", 2, tokens=5))
    assert (await s.give(await s.take(2))).status_code == 200
    await s.rewind(0)
    return s


PARTIAL = ("b-partial", 0, 3)  # the partial rollout prompt_run gives back: id, version, tokens


async def prompt_run(client: httpx.AsyncClient, redis: Redis, prefix: str, run_id: str) -> Script:
    """Prompts and work leases: registration over two epochs, hand-out, a group posted and
    trained (done), a return, an expiry, a rollout of an attempt that is over (stale_attempt),
    and a generator and a trainer that waited for nothing."""
    s = Script(client, run_id)
    await make_run(client, run_id, group_size=2, step_groups=2, max_staleness=0)
    await s.register("a", "b", epochs=2)
    await s.register("a")  # a repeat: not recorded
    first = await s.take_work(2, generator_id="gen-1")
    assert first is not None
    a, b = first["prompts"]
    await s.send(*group(a["group_id"], 0))
    s.prompt_means.append(["a", 0.5, 2])
    trained = await s.take(2)
    assert (await s.give(trained)).status_code == 200  # a#1 done
    # b#1 back, with a partial rollout: handed out with b#1 again, brought back by the expiry
    # below, then too stale to hand out once more (dropped).
    given = {"rollout_id": PARTIAL[0], "group_id": b["group_id"], "policy_version": PARTIAL[1]}
    given["response_ids"] = list(range(PARTIAL[2]))
    body = {"partials": [given]}
    resp = await client.post(f"/v1/runs/{run_id}/work/{first['lease_id']}/return", json=body)
    assert resp.json() == {"returned": 1}
    await s.send(rollout(f"{b['group_id']}-0", 0, group=b["group_id"]))  # stale_attempt
    second = await s.take_work(5)
    assert second is not None
    # Its time runs out: the next sweep sends its prompts back.
    await redis.zadd(keys.run_key(prefix, run_id, keys.WORK_LEASES), {second["lease_id"]: 1})
    await redis.hset(keys.member_key(prefix, run_id, keys.WORK, second["lease_id"]), "exp", 1)
    await s.policy(1)
    assert await s.take_work(5, wait_s=0.01) is not None
    await s.register(*[f"spare{i}" for i in range(5)])
    assert await s.take_work(5, wait_s=0.01) is None  # the budget is spent: waited
    resp = await lease(client, run_id, 2, wait_s=0.01)  # nothing ready: the trainer waited
    assert resp.status_code == 204
    return s


async def pool_run(client: httpx.AsyncClient, run_id: str) -> Script:
    """Difficulty pools: a prompt whose group was all correct is easy, and the easy pool has
    weight 0: its next pass is skipped; another prompt's group is scored late, at its last
    score."""
    s = Script(client, run_id)
    weights = {"easy": 0, "normal": 1, "hard": 1}
    await make_run(
        client,
        run_id,
        group_size=2,
        difficulty={"easy_above": 0.9, "hard_below": 0.1, "weights": weights},
    )
    await s.register("e", "l", epochs=2)
    first = await s.take_work(2)
    assert first is not None
    e, late = first["prompts"]
    await s.send(*group(e["group_id"], 0, rewards=(1.0, 1.0)))
    s.prompt_means.append(["e", 1.0, 2])
    ids = [f"{late['group_id']}-{i}" for i in range(2)]
    await s.send(*(rollout(rid, 0, group=late["group_id"], reward=None) for rid in ids))
    await s.score({ids[0]: 0.25, ids[1]: 0.0})
    s.prompt_means.append(["l", 0.125, 2])
    s.skipped.append(("e", 2))
    second = await s.take_work(2)
    assert second is not None and [p["prompt_id"] for p in second["prompts"]] == ["l"]
    assert (await s.give(await s.take(4))).status_code == 200
    return s


async def reward_run(client: httpx.AsyncClient, run_id: str) -> Script:
    """Rollouts posted without a reward: a reward lease scored in part and given back, a score
    with no lease, a rollout whose reward lease expired until it retired `reward_timeout`, and
    a close with one rollout awaiting and one in a live reward lease."""
    s = Script(client, run_id)
    await make_run(client, run_id, max_reward_attempts=2)
    await s.send(*(rollout(f"w{i}", 0, tokens=2 + i, reward=None) for i in range(5)))
    await s.send(rollout("posted_with_one", 0))
    first = await s.reward_take(2, worker_id="judge-1")  # w0, w1
    await s.score({"w0": 0.5}, lease_id=first["lease_id"])
    await s.reward_give_back(first["lease_id"])  # w1 awaits again
    await s.score({"w2": 1.0})  # awaiting, no lease
    await s.patch(reward_timeout_s=0.05)  # only the leases taken now run out
    for attempt in range(2):  # w1 twice: reward_timeout
        timed = await s.reward_take(1, lease_id=f"reward-lease-{attempt}")
        assert [r["rollout_id"] for r in timed["rollouts"]] == ["w1"]
        await s.reward_expire(timed["lease_id"])
    await s.patch(reward_timeout_s=600)
    await s.reward_take(1, worker_id="judge-2")  # w3 stays leased; w4 awaits
    await s.close()
    await reward_lease(client, run_id, 1)  # sweeps what the close left
    return s


async def quarantine_run(client: httpx.AsyncClient, run_id: str) -> Script:
    """Two generators; one's logprobs are far from the trainer's: the ack that fills its window
    quarantines it (what it had buffered retires `quarantined`), a release lifts it, and a
    rewind undoes the batch's uses per generator."""
    s = Script(client, run_id)
    await make_run(client, run_id, generator_kl_max=0.01, generator_window_tokens=6, max_reuse=2)
    await s.policy(1)

    def named(rid: str, gen: str) -> dict[str, Any]:
        return {**rollout(rid, 0, tokens=3), "generator_id": gen}

    await s.send(named("bad0", "bad"), named("bad1", "bad"), named("ok0", "ok"))
    batch = await s.take(3)
    await s.send(named("bad2", "bad"))  # buffered when the quarantine comes
    # log_r = -0.5 on the bad generator's tokens: k3 ≈ 0.107, far above 0.01.
    logprobs = {
        r["rollout_id"]: [
            x - (0.5 if r["rollout_id"].startswith("bad") else 0.0) for x in r["logprobs"]
        ]
        for r in batch["rollouts"]
    }
    assert (await s.give(batch, logprobs=logprobs)).status_code == 200
    s.quarantines.append(("bad", True))
    await s.release("bad")
    await s.rewind(0)
    return s


async def consumer_run(client: httpx.AsyncClient, redis: Redis, prefix: str, run_id: str) -> Script:
    """A consumer (no HTTP yet: through the store, on the app's keys): deliveries at a post, one
    beyond its retention dropped, a lease acked, a lease nacked (no count changes), and its
    deletion with one item pending and one leased."""
    s = Script(client, run_id)
    store = RedisStore(redis, prefix)
    await make_run(client, run_id)
    await store.create_consumer(run_id, "c", source="received", retention_rollouts=3)
    s.consumer_events.append([["c", 0, 0, 0]])  # its creation
    await s.send(*[rollout(f"c{i}", 0) for i in range(4)])
    s.consumer_events.append([["c", 4, 0, 1]])
    got = await store.consumer_lease(run_id, "c", batch_id="b1", size=1, lease_ms=60_000)
    assert got is not None
    await store.consumer_ack(run_id, "c", "b1")
    s.consumer_events.append([["c", 0, 1, 0]])
    assert await store.consumer_lease(run_id, "c", batch_id="b2", size=1, lease_ms=60_000)
    await store.consumer_nack(run_id, "c", "b2")
    assert await store.consumer_lease(run_id, "c", batch_id="b3", size=1, lease_ms=60_000)
    assert await store.delete_consumer(run_id, "c")
    s.consumer_events.append([["c", 0, 0, 2]])
    return s


async def stream_entries(redis: Redis, prefix: str, run_id: str) -> list[tuple[bytes, Any]]:
    return list(await redis.xrange(events_key(prefix, run_id)))


def check_round_trip(run_id: str, entry_id: bytes, fields: dict[bytes, bytes]) -> Event:
    event = decode_entry(run_id, entry_id, fields)  # strict: raises on anything off-schema
    written = msgpack.unpackb(fields[b"d"], raw=False, strict_map_key=False)
    encoded = encode_payload(event.type, event.body, t_ms=event.t_ms)
    # Same keys, same positions, same values: nothing the script writes is unknown to the
    # schema, and nothing the schema writes is missing from the script's event.
    assert canonical(encoded) == canonical(written), (event.type, written, encoded)
    again = decode_entry(run_id, entry_id, encode_entry(event.type, event.body, t_ms=event.t_ms))
    assert again == event
    return event


def check_meaning(s: Script, events: list[Event]) -> None:
    """The decoded fields say what was done (catches positions swapped in a script)."""
    seen_units: set[str] = set()
    registered = [
        (i.prompt_id, i.passes)
        for e in events
        if isinstance(e.body, Registered)
        for i in e.body.items
    ]
    assert registered == list(s.registered.items())  # each new prompt once, repeats not at all
    for event in events:
        body = event.body
        if isinstance(body, RunChanged):
            assert body.run_id == s.run_id
            assert body.config["max_reuse"] in (1, 2)
        elif isinstance(body, Accepted):
            posted = [s.posted_rewards[a.rollout_id] for a in body.items if not a.awaiting]
            assert (body.rewarded, body.reward_sum) == (
                (len(posted), sum(posted)) if posted else (None, None)
            )
            for a in body.items:
                assert (a.policy_version, a.tokens) == s.rollouts[a.rollout_id]
                unit = a.rollout_id.rsplit("-", 1)[0] if "-" in a.rollout_id else a.rollout_id
                assert a.unit_id == unit
                assert a.new_unit == (unit not in seen_units)
                assert a.awaiting == (a.rollout_id in s.unscored)
                assert a.generator == s.generator(a.rollout_id)
                seen_units.add(unit)
        elif isinstance(body, Duplicate):
            assert body.n == len(body.ids) > 0
            assert all(rid in s.rollouts for rid in body.ids)
        elif isinstance(body, Rejected):
            for j in body.items:
                assert j.reason == s.rejected[j.rollout_id]
                assert (j.policy_version, j.tokens) == s.rollouts[j.rollout_id]
        elif isinstance(body, Leased):
            reply = s.leases[body.batch_id]
            assert body.policy_version == reply["policy_version"]
            assert body.trainer_id == s.trainers[body.batch_id]
            by_id = {r["rollout_id"]: r for r in reply["rollouts"]}
            assert [i.rollout_id for i in body.items] == list(by_id)
            for i in body.items:
                assert (i.policy_version, i.tokens) == s.rollouts[i.rollout_id]
                assert i.lag == lag_of(body.policy_version, i.policy_version)
                assert i.lag == by_id[i.rollout_id]["lag"]
                assert i.uses_before == by_id[i.rollout_id]["uses"]
        elif isinstance(body, Acked):
            reply = s.leases[body.batch_id]
            given = s.acks[body.batch_id]
            assert body.policy_version == reply["policy_version"]
            assert body.step == given.get("step")
            assert [i.rollout_id for i in body.items] == [
                r["rollout_id"] for r in reply["rollouts"]
            ]
            for i in body.items:
                assert (i.policy_version, i.tokens) == s.rollouts[i.rollout_id]
                assert i.reward == s.posted_rewards.get(i.rollout_id, s.scores.get(i.rollout_id))
                ready = given.get("kl") or {}
                if i.rollout_id in ready:
                    assert i.kl == ready[i.rollout_id]
                elif given.get("logprobs"):
                    assert i.kl is not None and i.kl >= 0
                else:
                    assert i.kl is None
            assert body.sums.kl_tokens == sum(i.tokens for i in body.items if i.kl is not None)
            rids = [i.rollout_id for i in body.items]
            assert sorted((g.generator_id, g.samples) for g in body.gens) == s.per_generator(rids)
            # The reply's stats are stored apart from the event (and reach JSON exactly).
            assert dataclasses.asdict(body.stats) == s.answers[body.batch_id]["stats"]
        elif isinstance(body, Returned):
            assert s.returned[body.batch_id] == event.type
            reply = s.leases[body.batch_id]
            assert [i.rollout_id for i in body.items] == [
                r["rollout_id"] for r in reply["rollouts"]
            ]
            for i in body.items:
                assert (i.policy_version, i.tokens) == s.rollouts[i.rollout_id]
        elif isinstance(body, Registered):
            assert body.items
        elif isinstance(body, WorkLeased):
            reply = s.work[body.lease_id]
            assert body.generator_id == s.generators[body.lease_id]
            assert body.policy_version == reply["policy_version"]
            assert [(i.prompt_id, i.pass_, i.attempt) for i in body.items] == [
                (p["prompt_id"], p["pass"], p["attempt"]) for p in reply["prompts"]
            ]
        elif isinstance(body, PassesChanged):
            causes = {"returned", "expired", "rejected", "retired", "acked", "skipped"}
            assert body.cause in causes
            assert (body.lease_id is None) == (body.cause in {"retired", "acked", "skipped"})
            for item in body.items:
                assert 1 <= item.pass_ <= s.registered[item.prompt_id]
                if body.cause == "skipped":
                    assert (item.prompt_id, item.pass_) in s.skipped
                    assert item.state == "skipped"
                else:
                    assert item.state in {"queued", "done", "failed"}
        elif isinstance(body, PromptScored):
            assert [[i.prompt_id, i.mean, i.rollouts] for i in body.items] == [
                s.prompt_means.pop(0) for _ in body.items
            ]
        elif isinstance(body, PartialsChanged):
            assert body.change in {"returned", "resumed", "dropped"}
            assert (body.reason is not None) == (body.change == "dropped")
            assert body.lease_id is not None or body.change != "resumed"
            for p in body.items:
                assert (p.rollout_id, p.policy_version, p.tokens) == PARTIAL
                assert (p.prompt_id, p.pass_) == ("b", 1)
        elif isinstance(body, Waited):
            assert body.role in {"trainer", "generator"}
        elif isinstance(body, RewardLeased):
            reply = s.reward_leases[body.lease_id]
            assert body.worker_id == s.reward_workers[body.lease_id]
            assert [i.rollout_id for i in body.items] == [
                r["rollout_id"] for r in reply["rollouts"]
            ]
            for i in body.items:
                assert (i.policy_version, i.tokens) == s.rollouts[i.rollout_id]
        elif isinstance(body, Scored):
            for sc in body.items:
                assert sc.reward == s.scores[sc.rollout_id]
                assert sc.policy_version == s.rollouts[sc.rollout_id][0]
                assert sc.leased == (sc.rollout_id in s.scored_leased)
                assert 0 <= sc.wait_ms < 60_000
        elif isinstance(body, RewardExpired | RewardReturned):
            assert s.rewards_back[body.lease_id] == event.type
            for i in body.items:
                assert i.policy_version == s.rollouts[i.rollout_id][0]
                if isinstance(i, RewardExpiredItem):
                    assert i.attempts == int(body.lease_id.removeprefix("reward-lease-")) + 1
                else:
                    assert i.tokens == s.rollouts[i.rollout_id][1]
        elif isinstance(body, Rewound):
            assert (body.from_version, body.to_version) in s.rewinds
            undone = {
                b: s.leases[b] for b in s.answers if s.leases[b]["policy_version"] > body.to_version
            }
            assert sorted(body.batches) == sorted(undone)
            uses = sorted(
                (r["rollout_id"], reply["policy_version"])
                for reply in undone.values()
                for r in reply["rollouts"]
            )
            assert sorted((i.rollout_id, i.batch_version) for i in body.items) == uses
            for i in body.items:
                assert (i.policy_version, i.tokens) == s.rollouts[i.rollout_id]
            undone_rids = [i.rollout_id for i in body.items]
            got = sorted((g.generator_id, g.samples) for g in body.gens)
            assert got == s.per_generator(undone_rids)
        elif isinstance(body, ConsumersChanged):
            items = [[i.name, i.delivered, i.acked, i.dropped] for i in body.items]
            assert items == s.consumer_events.pop(0)
        elif isinstance(body, GeneratorChanged):
            assert (body.generator_id, body.quarantined) in s.quarantines
            assert (body.kl_mean is not None) == body.quarantined
        else:
            assert isinstance(body, Retired)
            for r in body.items:
                assert (r.policy_version, r.tokens) == s.rollouts[r.rollout_id]
                awaiting = r.rollout_id in s.unscored and r.rollout_id not in s.scores
                assert (r.unscored > 0) == awaiting
                if body.reason == "reward_timeout":
                    assert r.unscored == 1


async def test_every_event_the_scripts_write_follows_the_schema(
    api: httpx.AsyncClient, redis: Redis, prefix: str
) -> None:
    scripts = [
        await grouped_run(api, "schema-groups"),
        await single_run(api, "schema-one"),
        await prompt_run(api, redis, prefix, "schema-prompts"),
        await rewind_run(api, "schema-rewind"),
        await reward_run(api, "schema-rewards"),
        await pool_run(api, "schema-pools"),
        await quarantine_run(api, "schema-quarantine"),
        await consumer_run(api, redis, prefix, "schema-consumers"),
    ]
    types: set[str] = set()
    reasons: set[str] = set()
    places: set[int] = set()  # the `unscored` of retired items
    causes: set[str] = set()  # of passes events
    for s in scripts:
        entries = await stream_entries(redis, prefix, s.run_id)
        assert entries
        events = [check_round_trip(s.run_id, eid, fields) for eid, fields in entries]
        check_meaning(s, events)
        assert s.prompt_means == []  # every group mean expected was told, in order
        assert s.consumer_events == []  # and every consumers event
        types |= {e.type for e in events}
        causes |= {e.body.cause for e in events if isinstance(e.body, PassesChanged)}
        reasons |= {e.body.reason for e in events if isinstance(e.body, Retired)}
        places |= {i.unscored for e in events if isinstance(e.body, Retired) for i in e.body.items}
        reasons |= {i.reason for e in events if isinstance(e.body, Rejected) for i in e.body.items}
    assert types == EVENT_TYPES
    assert "skipped" in causes
    assert places == {0, 1, 2}
    assert "stale_attempt" in reasons
    assert reasons >= RETIRE_REASONS | {"future_version"}
