"""The reward events (docs/events.md) without a database: how each folds into the rewards
counts, per run and per rollout version, the reward-latency buckets, and the codec's round trip
and refusals."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from accounting_helpers import entry

from app.accounting.deltas import REWARD_LATENCY_BOUNDS_MS, Fold
from app.accounting.fold import fold_events
from app.events import (
    Accepted,
    AcceptedItem,
    Event,
    EventError,
    Payload,
    Retired,
    RetiredItem,
    RewardExpired,
    RewardExpiredItem,
    RewardItem,
    RewardLeased,
    RewardReturned,
    Scored,
    ScoredItem,
    StreamId,
    decode_entry,
    encode_entry,
    encode_payload,
)

V = 3  # the rollouts' policy version


def _events(*bodies: tuple[str, Payload]) -> list[Event]:
    return [
        Event("run-1", StreamId(100 + i, 0), kind, 1_000 + i, body)
        for i, (kind, body) in enumerate(bodies)
    ]


def _rewards(fold: Fold) -> dict[str, int]:
    """The run's rewards counts, after checking the rollout version's are the same."""
    run, version = fold.run, fold.versions[V]
    counts = {
        "awaiting": run.rewards_awaiting,
        "leased": run.rewards_leased,
        "scored": run.rewards_scored,
        "timed_out": run.rewards_timed_out,
    }
    assert counts == {
        "awaiting": version.rewards_awaiting,
        "leased": version.rewards_leased,
        "scored": version.rewards_scored,
        "timed_out": version.rewards_timed_out,
    }
    return counts


def _counts(awaiting: int = 0, leased: int = 0, scored: int = 0, timed_out: int = 0) -> Any:
    return {"awaiting": awaiting, "leased": leased, "scored": scored, "timed_out": timed_out}


def accepted(*rids: str, awaiting: bool = True) -> tuple[str, Payload]:
    return "accepted", Accepted(tuple(AcceptedItem(r, r, V, 5, True, 0, awaiting) for r in rids))


def reward_leased(lease: str, *rids: str) -> tuple[str, Payload]:
    items = tuple(RewardItem(r, V, 5) for r in rids)
    return "reward_leased", RewardLeased(lease, "judge", 9_999, items, 12)


def scored(*items: tuple[str, int, bool]) -> tuple[str, Payload]:
    """``items``: (rollout_id, wait_ms, leased)."""
    return "scored", Scored(tuple(ScoredItem(r, V, 0.5, ms, lsd) for r, ms, lsd in items))


def reward_expired(lease: str, *items: tuple[str, int]) -> tuple[str, Payload]:
    return "reward_expired", RewardExpired(
        lease, tuple(RewardExpiredItem(r, V, n) for r, n in items)
    )


def reward_returned(lease: str, *rids: str) -> tuple[str, Payload]:
    return "reward_returned", RewardReturned(lease, tuple(RewardItem(r, V, 5) for r in rids))


def retired(reason: str, *items: tuple[str, int]) -> tuple[str, Payload]:
    """``items``: (rollout_id, unscored)."""
    return "retired", Retired(reason, tuple(RetiredItem(r, V, 5, 0, u) for r, u in items))


# --- each event and element ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("steps", "expected"),
    [
        # accepted: awaiting counts; a rollout posted with its reward does not
        ([accepted("a", "b"), accepted("c", awaiting=False)], _counts(awaiting=2)),
        ([accepted("a"), reward_leased("l", "a")], _counts(leased=1)),
        ([accepted("a"), reward_leased("l", "a"), scored(("a", 7, True))], _counts(scored=1)),
        ([accepted("a"), scored(("a", 7, False))], _counts(scored=1)),
        (
            [accepted("a"), reward_leased("l", "a"), reward_expired("l", ("a", 1))],
            _counts(awaiting=1, timed_out=1),
        ),
        ([accepted("a"), reward_leased("l", "a"), reward_returned("l", "a")], _counts(awaiting=1)),
        ([accepted("a"), retired("stale", ("a", 1))], _counts()),
        ([accepted("a"), reward_leased("l", "a"), retired("run_closed", ("a", 2))], _counts()),
        # unscored absent/0: a rollout that had its reward moves no reward count
        ([accepted("a", awaiting=False), retired("stale", ("a", 0))], _counts()),
    ],
)
def test_each_reward_event_moves_the_counts(
    steps: list[tuple[str, Payload]], expected: dict[str, int]
) -> None:
    fold = fold_events(_events(*steps))
    assert _rewards(fold) == expected


def test_leased_expired_leased_again_then_scored() -> None:
    steps = [
        accepted("a"),
        reward_leased("l1", "a"),
        reward_expired("l1", ("a", 1)),
        reward_leased("l2", "a"),
        scored(("a", 1_500, True)),
    ]
    fold = fold_events(_events(*steps))
    assert _rewards(fold) == _counts(scored=1, timed_out=1)
    assert fold.run.reward_wait_ms == 1_500
    assert fold.reward_latency == {2_000: 1}
    # Whatever order batches of them are applied in: the counts are sums.
    for order in itertools.permutations(steps):
        assert _rewards(fold_events(_events(*order))) == _counts(scored=1, timed_out=1)


def test_three_expiries_then_reward_timeout() -> None:
    steps = [accepted("a")]
    for n in (1, 2, 3):
        steps += [reward_leased(f"l{n}", "a"), reward_expired(f"l{n}", ("a", n))]
    steps.append(retired("reward_timeout", ("a", 1)))
    fold = fold_events(_events(*steps))
    assert _rewards(fold) == _counts(timed_out=3)
    assert fold.run.rollouts_retired == 1
    assert fold.reasons[(V, "retired", "reward_timeout")].rollouts == 1


def test_retired_in_a_live_reward_lease() -> None:
    steps = [accepted("a", "b"), reward_leased("l", "a", "b"), retired("rewound", ("a", 2))]
    assert _rewards(fold_events(_events(*steps))) == _counts(leased=1)


def test_an_unknown_unscored_place_cannot_be_applied() -> None:
    with pytest.raises(EventError, match="unscored"):
        fold_events(_events(accepted("a"), retired("stale", ("a", 3))))


def test_scores_fall_in_the_smallest_bucket_that_holds_them() -> None:
    last = REWARD_LATENCY_BOUNDS_MS[-1]
    waits = [0, 100, 101, 500, 1_000, 59_999, last, last + 1]
    fold = fold_events(_events(scored(*((f"r{i}", ms, False) for i, ms in enumerate(waits)))))
    assert fold.reward_latency == {100: 2, 500: 2, 1_000: 1, 60_000: 1, last: 1}
    assert fold.run.rewards_scored == len(waits)  # the one beyond the last bound: +Inf only
    assert fold.run.reward_wait_ms == sum(waits)


# --- the codec ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "step",
    [
        accepted("a"),
        retired("reward_timeout", ("a", 1)),
        retired("run_closed", ("a", 2)),
        reward_leased("l", "a", "b"),
        ("reward_leased", RewardLeased("l", None, 5, (RewardItem("a", 0, 1),), None)),
        scored(("a", 0, False), ("b", 12, True)),
        reward_expired("l", ("a", 2)),
        reward_returned("l", "a"),
    ],
)
def test_round_trip(step: tuple[str, Payload]) -> None:
    kind, body = step
    event = decode_entry("run-1", b"7-0", encode_entry(kind, body, t_ms=7))
    assert (event.type, event.body, event.t_ms) == (kind, body, 7)


def test_what_the_encoder_writes() -> None:
    """An awaiting rollout's item writes `masked` 0 before its flag; older items lack both."""
    assert encode_payload(*accepted("a"))["items"] == [["a", "a", V, 5, 1, 0, 1]]
    assert encode_payload(*accepted("a", awaiting=False))["items"] == [["a", "a", V, 5, 1]]
    assert encode_payload(*retired("x", ("a", 0)))["items"] == [["a", V, 5, 0]]
    assert encode_payload(*retired("x", ("a", 2)))["items"] == [["a", V, 5, 0, 2]]
    leased = RewardLeased("l", None, 5, (RewardItem("a", 0, 1),), None)
    assert encode_payload("reward_leased", leased) == {
        "lease_id": "l",
        "expires_at": 5,
        "items": [["a", 0, 1]],
    }


def _decode(kind: str, payload: dict[str, Any]) -> Any:
    return decode_entry("run-1", b"5-1", entry(kind, {"t": 7, **payload})).body


def test_older_entries_decode_with_the_defaults() -> None:
    old = _decode("accepted", {"items": [["a", "a", 0, 5, 1], ["b", "b", 0, 5, 0, 2]]})
    assert [(i.masked, i.awaiting) for i in old.items] == [(0, False), (2, False)]
    gone = _decode("retired", {"reason": "stale", "items": [["a", 0, 5, 1]]})
    assert gone.items[0].unscored == 0
    fold = fold_events([Event("run-1", StreamId(1, 0), "accepted", 1, old)])
    assert fold.run.rewards_awaiting == 0


@pytest.mark.parametrize(
    ("kind", "payload"),
    [
        ("scored", {"items": [["a", 0, 0.5, -1, 0]]}),  # negative wait_ms
        ("scored", {"items": [["a", 0, 0.5, 3]]}),  # leased missing
        ("scored", {"items": [["a", 0, 0.5, 3, 2]]}),  # leased is a flag
        ("scored", {"items": [["a", 0, float("nan"), 3, 0]]}),
        ("scored", {}),  # items missing
        ("reward_leased", {"lease_id": "l", "expires_at": 5}),  # items missing
        ("reward_leased", {"lease_id": "l", "expires_at": 5, "items": [], "wait_ms": -2}),
        ("reward_leased", {"expires_at": 5, "items": []}),  # lease_id missing
        ("reward_expired", {"lease_id": "l", "items": [["a", 0, 0]]}),  # attempts from 1
        ("reward_expired", {"lease_id": "l", "items": [["a", 0]]}),
        ("reward_returned", {"lease_id": 5, "items": []}),
        ("accepted", {"items": [["a", "a", 0, 5, 1, 0, 2]]}),  # awaiting is a flag
        ("retired", {"reason": "x", "items": [["a", 0, 5, 0, -1]]}),  # unscored >= 0
    ],
)
def test_rejects_malformed_reward_payloads(kind: str, payload: dict[str, Any]) -> None:
    with pytest.raises(EventError):
        _decode(kind, payload)
