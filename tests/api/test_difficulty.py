"""Difficulty pools through HTTP (SPEC "Difficulty"): each prompt's pool follows the mean reward
of its newest complete group, work leases draw from pools by weight, a pool of weight 0 is
skipped, and a patch of the thresholds sorts the queue again."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from app import keys
from tests.api.support import assert_error, events, patch
from tests.api.test_prompts import group, pass_events, register, work
from tests.helpers import make_run, post, rollout

THRESHOLDS = {"easy_above": 0.8, "hard_below": 0.2}


def difficulty(easy: float = 1.0, normal: float = 1.0, hard: float = 1.0) -> dict[str, Any]:
    return {**THRESHOLDS, "weights": {"easy": easy, "normal": normal, "hard": hard}}


async def pools(redis: Redis, prefix: str, run: str) -> dict[str, set[str]]:
    """The queued passes in each pool's zset."""
    out = {}
    for name, suffix in (
        ("easy", keys.POOL_EASY),
        ("normal", keys.POOL_NORMAL),
        ("hard", keys.POOL_HARD),
    ):
        got = await redis.zrange(keys.run_key(prefix, run, suffix), 0, -1)
        out[name] = {m.decode() for m in got}
    return out


async def queued(redis: Redis, prefix: str, run: str) -> set[str]:
    got = await redis.zrange(keys.run_key(prefix, run, keys.PROMPT_QUEUE), 0, -1)
    return {m.decode() for m in got}


async def scored_events(redis: Redis, prefix: str, run: str) -> list[list[Any]]:
    return [
        i for e, d in await events(redis, prefix, run) if e == "prompt_scored" for i in d["items"]
    ]


async def answer(api: httpx.AsyncClient, run: str, rewards: dict[str, list[float]]) -> None:
    """One work lease of every prompt named, each answered with a group of those rewards."""
    got = await work(api, run, len(rewards))
    assert got is not None
    by_prompt = {p["prompt_id"]: p for p in got["prompts"]}
    assert set(by_prompt) == set(rewards)
    for pid, rw in rewards.items():
        resp = await post(api, run, *group(by_prompt[pid], len(rw), rewards=rw))
        assert resp.json()["accepted"] == len(rw), resp.text


async def test_a_prompt_joins_the_pool_of_its_newest_complete_groups_mean(api, redis, prefix):
    await make_run(api, "r1", group_size=2, difficulty=difficulty())
    await register(api, "r1", "p1", "p2", "p3", epochs=3)
    assert (await pools(redis, prefix, "r1"))["normal"] == await queued(redis, prefix, "r1")
    await answer(api, "r1", {"p1": [1.0, 1.0], "p2": [0.0, 0.0], "p3": [0.0, 1.0]})
    p = await pools(redis, prefix, "r1")
    assert p == {
        "easy": {"p1#2", "p1#3"},
        "hard": {"p2#2", "p2#3"},
        "normal": {"p3#2", "p3#3"},
    }
    assert sorted(await scored_events(redis, prefix, "r1")) == [
        ["p1", 1.0, 2],
        ["p2", 0.0, 2],
        ["p3", 0.5, 2],
    ]
    # p1's next group is hard: its last queued pass moves with it.
    got = await work(api, "r1", 1)
    assert got is not None
    first = got["prompts"][0]
    assert (await post(api, "r1", *group(first, 2, rewards=[0.0, 0.1]))).status_code == 202
    pid = first["prompt_id"]
    p = await pools(redis, prefix, "r1")
    assert [pid, 0.05, 2] in await scored_events(redis, prefix, "r1")
    assert f"{pid}#3" in p["hard"]
    assert sum(len(s) for s in p.values()) == len(await queued(redis, prefix, "r1")) == 5


async def test_a_group_scored_later_sorts_its_prompt_at_its_last_score(api, redis, prefix):
    await make_run(api, "r1", group_size=2, difficulty=difficulty())
    await register(api, "r1", "p1", epochs=2)
    got = await work(api, "r1", 1)
    assert got is not None
    p = got["prompts"][0]
    ids = [f"{p['group_id']}/{i}" for i in range(2)]
    posted = [rollout(rid, 0, group=p["group_id"], reward=None) for rid in ids]
    assert (await post(api, "r1", *posted)).json()["accepted"] == 2
    resp = await api.post("/v1/runs/r1/rewards", json={"rewards": {ids[0]: 0.9}})
    assert resp.status_code == 200, resp.text
    assert await scored_events(redis, prefix, "r1") == []  # one reward short of complete
    resp = await api.post("/v1/runs/r1/rewards", json={"rewards": {ids[1]: 1.0}})
    assert resp.status_code == 200, resp.text
    assert await scored_events(redis, prefix, "r1") == [["p1", 0.95, 2]]
    assert (await pools(redis, prefix, "r1"))["easy"] == {"p1#2"}


async def test_a_group_filling_with_late_scores_sums_them_all(api, redis, prefix):
    """Members scored while their group is still filling count toward its mean."""
    await make_run(api, "r1", group_size=3, difficulty=difficulty())
    await register(api, "r1", "p1", epochs=2)
    got = await work(api, "r1", 1)
    assert got is not None
    gid = got["prompts"][0]["group_id"]
    assert (await post(api, "r1", rollout(f"{gid}/0", 0, group=gid, reward=None))).status_code
    resp = await api.post("/v1/runs/r1/rewards", json={"rewards": {f"{gid}/0": 0.3}})
    assert resp.status_code == 200, resp.text
    rest = [rollout(f"{gid}/{i}", 0, group=gid, reward=0.0) for i in (1, 2)]
    assert (await post(api, "r1", *rest)).json()["accepted"] == 2
    assert await scored_events(redis, prefix, "r1") == [["p1", pytest.approx(0.1), 3]]
    assert (await pools(redis, prefix, "r1"))["hard"] == {"p1#2"}


async def test_a_pool_of_weight_0_is_skipped_without_generation(api, redis, prefix):
    await make_run(api, "r1", group_size=2, difficulty=difficulty(easy=0))
    await register(api, "r1", "p1", "p2", epochs=2)
    await answer(api, "r1", {"p1": [1.0, 1.0], "p2": [0.5, 0.5]})
    got = await work(api, "r1", 5)
    assert got is not None
    assert [(p["prompt_id"], p["pass"]) for p in got["prompts"]] == [("p2", 2)]
    skipped = [item for cause, item in await pass_events(redis, prefix, "r1") if cause == "skipped"]
    assert skipped == [["p1", 2, 1, "skipped", 0]]
    pass_key = keys.member_key(prefix, "r1", keys.PASS, "p1#2")
    assert await redis.hget(pass_key, "st") == b"s"
    assert await queued(redis, prefix, "r1") == set()
    assert await work(api, "r1", 5) is None  # nothing left, nothing skipped twice
    assert len([1 for c, _ in await pass_events(redis, prefix, "r1") if c == "skipped"]) == 1


async def test_patching_the_thresholds_sorts_the_queue_again(api, redis, prefix):
    await make_run(api, "r1", group_size=2, difficulty=difficulty())
    await register(api, "r1", "p1", "p2", "p3", "fresh", epochs=2)
    await answer(api, "r1", {"p1": [1.0, 1.0], "p2": [0.0, 0.0], "p3": [0.5, 0.5]})
    await patch(api, "r1", difficulty={"easy_above": 0.4, "hard_below": 0.0})
    assert await pools(redis, prefix, "r1") == {
        "easy": {"p1#2", "p3#2"},
        "normal": {"p2#2", "fresh#1", "fresh#2"},
        "hard": set(),
    }
    # Weights alone leave the pools as they are; null takes them away: queue order again.
    await patch(api, "r1", difficulty={**THRESHOLDS, "weights": {"easy": 3, "hard": 0}})
    assert (await pools(redis, prefix, "r1"))["hard"] == {"p2#2"}
    await patch(api, "r1", difficulty=None)
    assert await pools(redis, prefix, "r1") == {"easy": set(), "normal": set(), "hard": set()}
    got = await work(api, "r1", 4)
    assert got is not None
    assert [(p["prompt_id"], p["pass"]) for p in got["prompts"]] == [
        ("fresh", 1),
        ("p1", 2),
        ("p2", 2),
        ("p3", 2),
    ]


async def test_prompt_history_is_kept_without_difficulty_and_used_when_it_comes(api, redis, prefix):
    await make_run(api, "r1", group_size=2)
    await register(api, "r1", "p1", "p2", epochs=2)
    await answer(api, "r1", {"p1": [1.0, 1.0], "p2": [0.0, 0.0]})
    assert await pools(redis, prefix, "r1") == {"easy": set(), "normal": set(), "hard": set()}
    await patch(api, "r1", difficulty=difficulty())
    assert await pools(redis, prefix, "r1") == {"easy": {"p1#2"}, "normal": set(), "hard": {"p2#2"}}


@pytest.mark.one_node  # refused in the parse, before any call to Redis: a cluster adds nothing
@pytest.mark.parametrize(
    ("value", "what"),
    [
        ({"easy_above": 0.1, "hard_below": 0.9}, "hard_below (0.9) is above easy_above (0.1)"),
        ({**THRESHOLDS, "weights": {"easy": 0, "normal": 0, "hard": 0}}, "all 0"),
        ({**THRESHOLDS, "weights": {"easy": -1}}, "easy"),
        ({**THRESHOLDS, "weights": {"easy": "1"}}, "easy"),
        ({"easy_above": 0.8}, "hard_below"),
        ({**THRESHOLDS, "extra": 1}, "extra"),
    ],
)
async def test_a_bad_difficulty_is_422_and_changes_nothing(api, value, what):
    resp = await api.post("/v1/runs", json={"run_id": "r1", "config": {"difficulty": value}})
    assert_error(resp, 422, "ValidationFailed")
    assert what in resp.json()["detail"]
    assert (await api.get("/v1/runs/r1")).status_code == 404
    await make_run(api, "r1", difficulty=difficulty())
    resp = await api.patch("/v1/runs/r1/config", json={"difficulty": value})
    assert_error(resp, 422, "ValidationFailed")
    assert (await api.get("/v1/runs/r1")).json()["config"]["difficulty"] == difficulty()
