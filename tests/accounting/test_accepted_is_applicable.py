"""Whatever the API accepts, the accounting drain can apply: the ids it records pass the ledger's
own text rule, and an ack's figures are finite. Extreme but accepted values go through ingest,
lease, ack and the real drain, and the ledger must come out exact with no dead letter."""

from __future__ import annotations

import itertools
import math
from typing import Any, get_args

import httpx
import numpy as np
import pytest
from accounting_helpers import drain_all
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis

from app.broker.schemas import MAX_REWARD
from app.broker.stats import FIGURE_CAP, LOG_FIGURE_CAP
from app.broker.store import RedisStore
from app.events import (
    MAX_TEXT,
    Accepted,
    AcceptedItem,
    decode_entry,
    encode_entry,
    text_fault,
)
from app.ids import (
    ITEM_ID_PATTERN,
    LEASE_ID_PATTERN,
    MAX_VERSION,
    PROMPT_ID_PATTERN,
    RUN_ID_PATTERN,
    ItemId,
    LeaseId,
    LedgerText,
    PromptId,
    RunId,
)
from app.keys import dead_key
from tests.helpers import ack, lease, make_run, post, rollout

F32_MIN = float(np.finfo(np.float32).min)
F32_TINY = -float(np.finfo(np.float32).smallest_subnormal)


async def _settled(api: httpx.AsyncClient, redis: Redis, prefix: str, run: str, ctx: Any) -> dict:
    """The run's accounting once drained, after checking nothing was dead-lettered."""
    await drain_all(ctx)
    dead = (await api.get(f"/v1/runs/{run}/accounting/dead-letters")).json()
    assert dead["count"] == 0, [d["error"] for d in dead["dead_letters"]]
    assert await redis.xlen(dead_key(prefix, run)) == 0
    acc: dict = (await api.get(f"/v1/runs/{run}/accounting")).json()
    assert acc["pending_events"] == 0
    live = await RedisStore(redis, prefix).get_run(run)
    assert live is not None
    assert acc["leased"] == live.leased
    assert acc["buffered"] == live.live - live.leased
    assert acc["rollouts_received"] == acc["buffered"] + acc["leased"] + sum(
        acc["retired"].values()
    )
    return acc


async def _batches(api: httpx.AsyncClient, run: str) -> dict[str, dict]:
    return {b["batch_id"]: b for b in (await api.get(f"/v1/runs/{run}/batches")).json()["batches"]}


# -- one text rule for the API and the ledger -------------------------------------------------


def test_the_ledger_text_rule():
    assert text_fault("rollout-1") is None
    assert text_fault("x" * MAX_TEXT) is None
    assert text_fault("\U0001f600" * MAX_TEXT) is None  # 4 UTF-8 bytes each: still one char
    assert text_fault("x" * (MAX_TEXT + 1)) is not None
    assert text_fault("a\x00b") is not None
    assert text_fault("a\ud800b") is not None  # a lone surrogate has no UTF-8 form


@pytest.mark.parametrize("id_type", [RunId, ItemId, PromptId, LeaseId])
def test_every_id_type_applies_the_ledger_rule(id_type):
    assert LedgerText in get_args(id_type)


@pytest.mark.parametrize(
    "pattern", [RUN_ID_PATTERN, ITEM_ID_PATTERN, PROMPT_ID_PATTERN, LEASE_ID_PATTERN]
)
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_what_an_id_pattern_admits_the_ledger_can_store(pattern, data):
    """The patterns are narrower than the ledger's rule, so the rule never refuses an id the
    pattern admits: it only stops one a wider pattern would let through."""
    value = data.draw(st.from_regex(pattern, fullmatch=True))
    assert text_fault(value) is None


# Characters an id may not hold that the ledger held before: format characters (bidi controls,
# zero-width ones, the soft hyphen, a tag) and C1 controls (U+009B opens an escape sequence).
SPOOFING = ["\u202e", "\u200f", "\u2066", "\u200b", "\xad", "\u061c", "\U000e0041", "\x9b"]


@pytest.mark.parametrize("char", SPOOFING, ids=lambda c: f"U+{ord(c):04X}")
def test_the_ledger_still_applies_ids_the_api_no_longer_takes(char):
    """The id rule is narrower than the ledger's: events written before it refused these
    characters are applied as before, not dead-lettered."""
    rid = f"a{char}b"
    assert text_fault(rid) is None
    item = AcceptedItem(
        rollout_id=rid, unit_id=f"r:{rid}", policy_version=0, tokens=4, new_unit=True
    )
    event = decode_entry("r1", b"1-1", encode_entry("accepted", Accepted(items=(item,)), t_ms=1))
    assert event.body == Accepted(items=(item,))


@pytest.mark.one_node  # refused in the parse, before any call to Redis: a cluster adds nothing
@pytest.mark.parametrize("char", SPOOFING, ids=lambda c: f"U+{ord(c):04X}")
async def test_an_id_that_could_pass_for_another_is_422_and_changes_nothing(
    api, redis, prefix, make_ctx, char
):
    """A bidi control or a zero-width character makes an id look like another (or reorders what
    follows it) where the command line or a log shows it; they were accepted in every id."""
    bad = f"a{char}b"
    await make_run(api, "r1")
    await make_run(api, "g1", group_size=2)
    for resp in (
        await post(api, "r1", rollout(bad)),
        await post(api, "g1", rollout("x", group=bad), rollout("y", group=bad)),
        await api.post("/v1/runs/r1/prompts", json={"prompts": [{"prompt_id": bad}]}),
        await api.post("/v1/runs/r1/work", json={"max_prompts": 1, "generator_id": bad}),
        await lease(api, "r1", 1, trainer_id=bad),
    ):
        assert resp.status_code == 422, resp.text
        assert resp.json()["error"] == "ValidationFailed"
    for run in ("r1", "g1"):
        acc = await _settled(api, redis, prefix, run, make_ctx())
        assert (acc["rollouts_received"], acc["batches"]["leased"]) == (0, 0)
    assert (await api.get("/v1/runs/r1/prompts")).json()["prompts"] == []


# -- the reported cases, end to end -----------------------------------------------------------


@pytest.mark.one_node  # refused in the parse, before any call to Redis: a cluster adds nothing
@pytest.mark.parametrize("trainer_id", ["\x00", "t\x00", "a b", "x" * 257, "{t}"], ids=repr)
async def test_a_trainer_id_the_ledger_cannot_hold_is_422_and_leases_nothing(
    api, redis, prefix, make_ctx, trainer_id
):
    """It answered 200 while its leased event was dead-lettered: the batch ledger got a row with
    no size and the run's leased count went wrong for good."""
    await make_run(api, "r1")
    await post(api, "r1", rollout("a"))
    resp = await lease(api, "r1", 1, trainer_id=trainer_id)
    assert resp.status_code == 422, resp.text
    assert resp.json()["error"] == "ValidationFailed"
    acc = await _settled(api, redis, prefix, "r1", make_ctx())
    assert (acc["buffered"], acc["leased"], acc["batches"]["leased"]) == (1, 0, 0)


@pytest.mark.parametrize(
    "trainer_id",
    ["\U0001f600" * 256, "\uffff" * 256, "é:#.\\\"'/%" + "z" * 247, "t"],
    ids=["emoji", "nonchar", "punctuation", "short"],
)
async def test_the_widest_trainer_ids_reach_the_ledger(api, redis, prefix, make_ctx, trainer_id):
    await make_run(api, "r1")
    await post(api, "r1", rollout("a", tokens=3), rollout("b", tokens=5))
    batch = (await lease(api, "r1", 2, trainer_id=trainer_id)).json()
    assert (await ack(api, "r1", batch["batch_id"])).status_code == 200
    acc = await _settled(api, redis, prefix, "r1", make_ctx())
    assert (acc["samples_consumed"], acc["tokens_consumed"]) == (2, 8)
    row = (await _batches(api, "r1"))[batch["batch_id"]]
    assert (row["trainer_id"], row["size"], row["outcome"]) == (trainer_id, 2, "acked")


async def test_an_overflowing_ack_is_counted_exactly(api, redis, prefix, make_ctx):
    """Behaviour logprob -1000 acked with 0, and a ready-made kl at the cap: the acks answered
    null statistics and their events were dead-lettered (buffered -1, samples_consumed short).
    Now the figures are finite and the ledger adds up."""
    await make_run(api, "r1", max_reuse=2, kl_max=1e12, kl_flush=1e12)
    await post(
        api,
        "r1",
        rollout("far", tokens=1, logprobs=[-1000.0]),
        rollout("near", tokens=1, logprobs=[-0.5]),
        rollout("ready", tokens=4),
    )
    first = (await lease(api, "r1", 2)).json()
    assert {r["rollout_id"] for r in first["rollouts"]} == {"far", "near"}
    one = await ack(api, "r1", first["batch_id"], logprobs={"far": [0.0], "near": [-0.5]})
    assert one.status_code == 200, one.text
    second = (await lease(api, "r1", 2)).json()
    assert {r["rollout_id"] for r in second["rollouts"]} == {"near", "ready"}
    two = await ack(api, "r1", second["batch_id"], kl={"ready": FIGURE_CAP})
    assert two.status_code == 200, two.text
    for answer in (one.json(), two.json()):
        assert all(v is not None for k, v in answer["stats"].items() if k.startswith("kl_"))
        assert all(math.isfinite(v) for v in answer["stats"].values() if v is not None)

    acc = await _settled(api, redis, prefix, "r1", make_ctx())
    assert acc["samples_consumed"] == 4
    assert acc["retired"] == {"kl": 2, "max_reuse": 1}  # far and ready: far off-policy
    assert (acc["buffered"], acc["leased"]) == (0, 0)
    assert acc["kl"]["max"] == FIGURE_CAP
    rows = await _batches(api, "r1")
    assert rows[first["batch_id"]]["kl_mean"] == one.json()["stats"]["kl_mean"]
    assert rows[second["batch_id"]]["kl_max"] == FIGURE_CAP


async def test_lags_whose_sum_passes_int64_are_counted_exactly(api, redis, prefix, make_ctx):
    """1100 samples of lag 2^53 - 1 (max_staleness at its largest) sum past 2^63: the ledger's
    BIGINT lag sum refused the acked event, which was dead-lettered with its samples."""
    await make_run(api, "r1", max_staleness=MAX_VERSION)
    n = 1100
    await post(api, "r1", *(rollout(f"x{i}", tokens=1) for i in range(n)))
    resp = await api.post("/v1/runs/r1/policy", json={"version": MAX_VERSION})
    assert resp.status_code == 200
    batch = (await lease(api, "r1", n)).json()
    assert {r["lag"] for r in batch["rollouts"]} == {MAX_VERSION}
    assert (await ack(api, "r1", batch["batch_id"])).status_code == 200
    acc = await _settled(api, redis, prefix, "r1", make_ctx())
    assert acc["samples_consumed"] == n
    assert n * MAX_VERSION > 2**63
    assert acc["lag"]["mean"] == MAX_VERSION and acc["lag"]["max"] == MAX_VERSION


# -- the property: extreme but accepted values, through the real drain ------------------------

_run_numbers = itertools.count()

# Logprobs at and around their bounds: 0 and -0, float32's smallest subnormal and its largest
# magnitude, and the log-ratios where exp() would pass the cap or overflow.
LOGPROBS = st.sampled_from(
    [0.0, -0.0, F32_TINY, -0.5, -LOG_FIGURE_CAP, -710.0, -1000.0, -3e38, F32_MIN]
)
READY_KL = st.sampled_from([0.0, -0.0, 5e-324, 0.05, 1e12, 1e39, FIGURE_CAP])
# The extremes the API accepts (app/broker/schemas.py MAX_REWARD): their sums stay finite.
REWARDS = st.sampled_from([0.0, -0.0, 5e-324, 1.0, -MAX_REWARD, MAX_REWARD])
ITEM_IDS = st.from_regex(ITEM_ID_PATTERN, fullmatch=True)


@st.composite
def scenarios(draw: st.DrawFn) -> dict[str, Any]:
    group_size = draw(st.sampled_from([1, 2]))
    units = draw(st.integers(1, 3))
    n = units * group_size
    ids = draw(st.lists(ITEM_IDS, min_size=n, max_size=n, unique=True))
    groups = draw(st.lists(ITEM_IDS, min_size=units, max_size=units, unique=True))
    version = draw(st.sampled_from([0, 1, 2**32, MAX_VERSION]))
    staleness = draw(st.sampled_from([0, 1, MAX_VERSION]))
    rollouts = []
    for i, rid in enumerate(ids):
        tokens = draw(st.integers(1, 3))
        behaviour = draw(st.none() | st.lists(LOGPROBS, min_size=tokens, max_size=tokens))
        age = draw(st.sampled_from([0, 1, staleness]))
        rollouts.append(
            {
                **rollout(
                    rid,
                    max(version - min(age, staleness), 0),
                    tokens=tokens,
                    group=groups[i // group_size] if group_size > 1 else None,
                    reward=draw(REWARDS),
                    logprobs=behaviour,
                ),
                "response_ids": draw(
                    st.lists(st.sampled_from([0, 2**31 - 1]), min_size=tokens, max_size=tokens)
                ),
            }
        )
    acks: dict[str, dict[str, Any]] = {"logprobs": {}, "kl": {}}
    for r in rollouts:
        how = draw(st.sampled_from(["logprobs", "kl", "none"]))
        if how == "logprobs":
            size = len(r["response_ids"])
            acks["logprobs"][r["rollout_id"]] = draw(
                st.lists(LOGPROBS, min_size=size, max_size=size)
            )
        elif how == "kl":
            acks["kl"][r["rollout_id"]] = draw(READY_KL)
    return {
        "config": {
            "group_size": group_size,
            "max_staleness": staleness,
            "max_reuse": draw(st.integers(1, 3)),
            "kl_estimator": draw(st.sampled_from(["k1", "k2", "k3"])),
            "kl_max": draw(st.sampled_from([0.0, 0.05, 1e12])),
            "kl_flush": draw(st.sampled_from([0.0, 0.1, 1e12])),
            "clip_epsilon": draw(st.sampled_from([1e-9, 0.2, 0.999999])),
            "drop_zero_variance_groups": draw(st.booleans()),
        },
        "run_tail": draw(st.from_regex(r"^[A-Za-z0-9._-]{0,100}$", fullmatch=True)),
        "version": version,
        "rollouts": rollouts,
        "trainer_id": draw(st.none() | ITEM_IDS),
        "batch_id": draw(st.none() | st.from_regex(LEASE_ID_PATTERN, fullmatch=True)),
        "step": draw(st.sampled_from([None, 0, MAX_VERSION])),
        "ack": acks,
        "then": draw(st.sampled_from(["nothing", "lease", "nack"])),
    }


@settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(s=scenarios())
async def test_extreme_accepted_values_reach_the_ledger_exactly(
    api: httpx.AsyncClient, redis: Redis, prefix: str, make_ctx: Any, s: dict[str, Any]
):
    # Each example is a run of its own; the fixtures (a Redis prefix, a database) are shared.
    run = f"p{next(_run_numbers)}-{s['run_tail']}"
    await make_run(api, run, **s["config"])
    if s["version"]:
        resp = await api.post(f"/v1/runs/{run}/policy", json={"version": s["version"]})
        assert resp.status_code == 200, resp.text
    posted = await post(api, run, *s["rollouts"])
    assert posted.status_code == 202, posted.text
    said = posted.json()
    assert said == {"accepted": len(s["rollouts"]), "duplicates": 0, "rejected": []}
    tokens = {r["rollout_id"]: len(r["response_ids"]) for r in s["rollouts"]}

    params: dict[str, Any] = {"partial": True}
    if s["trainer_id"] is not None:
        params["trainer_id"] = s["trainer_id"]
    if s["batch_id"] is not None:
        params["batch_id"] = s["batch_id"]
    got = await lease(api, run, len(s["rollouts"]), **params)
    if got.status_code == 204:  # all retired at ingest (zero variance): nothing to lease
        acc = await _settled(api, redis, prefix, run, make_ctx())
        assert acc["rollouts_received"] == len(s["rollouts"])
        return
    assert got.status_code == 200, got.text
    batch = got.json()
    leased = [r["rollout_id"] for r in batch["rollouts"]]
    body: dict[str, Any] = {
        key: {rid: v for rid, v in values.items() if rid in leased}
        for key, values in s["ack"].items()
    }
    if s["step"] is not None:
        body["step"] = s["step"]
    acked = await ack(api, run, batch["batch_id"], **body)
    assert acked.status_code == 200, acked.text
    answer = acked.json()
    stats = answer["stats"]
    assert all(v is None or math.isfinite(v) for v in stats.values()), stats
    behaviour = {r["rollout_id"]: r["logprobs"] for r in batch["rollouts"]}
    if body["kl"] or any(behaviour[rid] is not None for rid in body["logprobs"]):
        assert stats["kl_mean"] is not None and stats["kl_max"] is not None

    later: dict[str, Any] | None = None
    if s["then"] != "nothing":
        again = await lease(api, run, len(s["rollouts"]), partial=True)
        if again.status_code == 200:
            later = again.json()
            if s["then"] == "nack":
                nacked = await api.post(f"/v1/runs/{run}/batches/{later['batch_id']}/nack")
                assert nacked.status_code == 200, nacked.text

    acc = await _settled(api, redis, prefix, run, make_ctx())
    assert acc["rollouts_received"] == len(s["rollouts"])
    assert acc["tokens_generated"] == sum(tokens.values())
    assert acc["samples_consumed"] == answer["consumed"] == len(leased)
    assert acc["tokens_consumed"] == sum(tokens[rid] for rid in leased)
    held = later["rollouts"] if later is not None and s["then"] == "lease" else []
    assert acc["leased"] == len(held)
    assert acc["batches"] == {
        "leased": 1 + (later is not None),
        "acked": 1,
        "nacked": int(later is not None and s["then"] == "nack"),
        "expired": 0,
    }
    lags = [r["lag"] for r in batch["rollouts"]]
    assert acc["lag"]["max"] == max(lags)
    assert acc["lag"]["histogram"] == {str(lag): lags.count(lag) for lag in sorted(set(lags))}
    if stats["kl_max"] is not None:
        assert acc["kl"]["max"] == stats["kl_max"]

    row = (await _batches(api, run))[batch["batch_id"]]
    assert row["outcome"] == "acked"
    assert row["trainer_id"] == s["trainer_id"]
    assert (row["size"], row["tokens"], row["step"]) == (
        len(leased),
        sum(tokens[rid] for rid in leased),
        s["step"],
    )
    for figure, value in stats.items():
        assert row[figure] == value, figure
