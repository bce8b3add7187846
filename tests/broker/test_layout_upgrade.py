"""A run written by the earlier layout (a hash per unit and per rollout, bare ids in a group's
member list, a live batch's units as a JSON list) is converted by the first script that loads
it, and nothing buffered, leased or half-received is lost or changed by the conversion."""

from __future__ import annotations

import json

import msgpack

from app import keys
from app.broker.config import RunConfig
from app.broker.store import RedisStore
from tests.broker.test_store import ack, events, ids, lease, packed


def _key(store: RedisStore, run_id: str, suffix: str) -> str:
    return keys.run_key(store.prefix, run_id, suffix)


def _member(store: RedisStore, run_id: str, family: str, member: str) -> str:
    return keys.member_key(store.prefix, run_id, family, member)


async def _rollouts(store: RedisStore, run_id: str, u: str, rec: list[str]) -> list[list[str]]:
    """(rollout id, version, tokens) of a unit, as this layout keeps them."""
    if u.startswith("r:"):
        return [[u[2:], rec[0], rec[4]]]
    entries = await store.redis.lrange(_member(store, run_id, keys.MEMBERS, u), 0, -1)
    rows = []
    for e in entries:
        v, n, rid = e.decode().split(" ", 2)
        rows.append([rid, v, n])
    return rows


async def write_earlier_layout(store: RedisStore, run_id: str) -> None:
    """Rewrite a run's units as the earlier layout kept them."""
    r = store.redis
    units_key = _key(store, run_id, keys.UNITS)
    ready = {m.decode() for m in await r.zrange(_key(store, run_id, keys.QUEUE), 0, -1)}
    batch_of: dict[str, str] = {}
    for bid in await r.zrange(_key(store, run_id, keys.LEASES), 0, -1):
        bk = _member(store, run_id, keys.BATCH, bid.decode())
        flat = msgpack.unpackb(await r.hget(bk, "units"), raw=False)
        unit_ids = flat[0::3]
        for u in unit_ids:
            batch_of[u] = bid.decode()
        await r.hset(bk, "units", json.dumps(unit_ids))
        await r.hdel(bk, "rows")

    async def old_members(u: str, rows: list[list[str]]) -> None:
        for rid, v, n in rows:
            await r.hset(_member(store, run_id, keys.ROLLOUT, rid), mapping={"v": v, "n": n})
        if u.startswith("g:"):
            mk = _member(store, run_id, keys.MEMBERS, u)
            await r.delete(mk)
            await r.rpush(mk, *[rid for rid, _, _ in rows])

    for field, value in (await r.hgetall(units_key)).items():
        u = field.decode()
        rec = value.decode().split(",", 7)  # v, seq, uses, k, n, kl, att, pk
        rows = await _rollouts(store, run_id, u, rec)
        await old_members(u, rows)
        h = {"need": rec[3], "have": rec[3], "v": rec[0], "seq": rec[1], "uses": rec[2]}
        h["st"] = "r" if u in ready else "l"
        if u in batch_of:
            h["b"] = batch_of[u]
        if rec[5]:
            h["kl"] = rec[5]
        if rec[6]:
            h["att"], h["pk"] = rec[6], rec[7]
        await r.hset(_member(store, run_id, keys.UNIT, u), mapping=h)
    await r.delete(units_key)
    for m in await r.zrange(_key(store, run_id, keys.OPEN), 0, -1):
        u = m.decode()
        await r.hset(_member(store, run_id, keys.UNIT, u), mapping={"st": "o", "uses": 0})
        await old_members(u, await _rollouts(store, run_id, u, []))
    await r.hdel(_key(store, run_id, keys.RUN), "lay")


async def _leftovers(store: RedisStore, run_id: str) -> list[bytes]:
    base = keys.run_base(store.prefix, run_id)
    return [k async for k in store.redis.scan_iter(match=f"{base}{keys.ROLLOUT}*")]


async def test_ready_and_leased_units_keep_their_uses_kl_and_batch(store):
    await store.create_run("r", RunConfig(max_reuse=3, kl_max=1.0))
    await store.ingest("r", [packed(x, tokens=5) for x in "abcd"])
    first = await lease(store, 2)
    held = await lease(store, 2)
    assert (ids(first), ids(held)) == (["a", "b"], ["c", "d"])
    await ack(store, first, kl=[("a", 0.5)])
    await write_earlier_layout(store, "r")
    assert len(await _leftovers(store, "r")) == 4  # the earlier layout, as written

    # The batch leased before the upgrade is acknowledged after it.
    await ack(store, held)
    again = await lease(store, 4)
    assert sorted(ids(again)) == ["a", "b", "c", "d"]
    assert [x.uses for x in again.rollouts] == [1, 1, 1, 1]
    leased = [d for e, d in await events(store) if e == "leased"][-1]
    assert sorted(i[:3] for i in leased["items"]) == [[x, 0, 5] for x in "abcd"]
    assert await _leftovers(store, "r") == []
    assert await store.redis.hget(_key(store, "r", keys.RUN), "lay") == b"3"

    # a's measured KL came through: below it, a retires and the others do not.
    await store.nack("r", again.batch_id)
    before = RunConfig(max_reuse=3, kl_max=1.0).canonical_json()
    lowered = RunConfig(max_reuse=3, kl_max=0.25)
    assert await store.replace_config("r", before, lowered) == "replaced"
    rest = await lease(store, 3)
    assert sorted(ids(rest)) == ["b", "c", "d"]
    retired = [d for e, d in await events(store) if e == "retired"]
    assert [(d["reason"], [i[0] for i in d["items"]]) for d in retired] == [("kl", ["a"])]


async def test_groups_complete_and_filling_come_through(store):
    await store.create_run("r", RunConfig(group_size=2))
    await store.ingest("r", [packed("a1", group="a", tokens=2), packed("a2", group="a", tokens=3)])
    await store.ingest("r", [packed("b1", group="b", tokens=4)])
    await write_earlier_layout(store, "r")

    await store.ingest("r", [packed("b2", group="b", tokens=6)])
    got = await lease(store, 4)
    assert ids(got) == ["a1", "a2", "b1", "b2"]
    leased = [d for e, d in await events(store) if e == "leased"][-1]
    assert [i[:3] for i in leased["items"]] == [
        ["a1", 0, 2],
        ["a2", 0, 3],
        ["b1", 0, 4],
        ["b2", 0, 6],
    ]
    view = await store.batch_view("r", got.batch_id, rollouts="meta")
    assert [(m.rollout_id, m.tokens) for m in view.members] == [
        ("a1", 2),
        ("a2", 3),
        ("b1", 4),
        ("b2", 6),
    ]
    assert await _leftovers(store, "r") == []
