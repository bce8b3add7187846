"""Every ack statistic counts trained tokens only: multi-turn rollouts whose tool tokens carry
loss_mask 0, measured as the ack measures them (their stored blobs read back, their hand-out
mask applied), against a float64 numpy recompute of the SPEC's definitions over the trained
tokens alone."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.broker import tokens
from app.broker.acks import measure
from app.broker.behaviour import BatchRow
from app.broker.config import RunConfig
from app.broker.packing import pack_rollout, unpack_rollouts
from app.broker.stats import kl_per_token
from app.broker.tokens import hand_out

EPS = 0.2


def rows_of(parts: list[tuple[np.ndarray, np.ndarray]], V: int = 0) -> list[BatchRow]:
    """Rollouts of (old logprobs, mask) packed as ingest packs them and read back as a lease
    reads them."""
    blobs = [
        pack_rollout(
            rollout_id=f"r{i}",
            group_id=None,
            policy_version=0,
            prompt_ids=None,
            response_ids=list(range(old.size)),
            logprobs=old.tolist(),
            reward=0.0,
            finish_reason=None,
            metadata=None,
            max_tokens=1024,
            loss_mask=mask.tolist(),
        ).blob
        for i, (old, mask) in enumerate(parts)
    ]
    out = []
    for r in unpack_rollouts(blobs):
        n = r.response_ids.size
        given = hand_out(r.loss_mask, r.versions, r.policy_version, n, V, None)
        out.append(BatchRow(r.rollout_id, r.policy_version, n, r.logprobs, given))
    return out


def recompute(
    olds: list[np.ndarray], news: list[np.ndarray], masks: list[np.ndarray], estimator: str
) -> dict[str, Any]:
    """The SPEC's ack statistics in float64 over the tokens each mask keeps."""
    per, k_all, r_all, seq = [], [], [], []
    for old, new, mask in zip(olds, news, masks, strict=True):
        keep = mask.astype(bool)
        log_r = new.astype(np.float64)[keep] - old.astype(np.float64)[keep]
        k = kl_per_token(log_r, estimator)
        per.append(float(k.mean()))
        k_all.append(k)
        r_all.append(np.exp(log_r))
        seq.append(log_r.sum())
    k, r, w = np.concatenate(k_all), np.concatenate(r_all), np.exp(np.array(seq) - max(seq))
    return {
        "kl": per,
        "kl_mean": float(k.mean()),
        "kl_max": max(per),
        "is_ratio_mean": float(r.mean()),
        "clip_fraction": float(np.count_nonzero(np.abs(r - 1) > EPS) / r.size),
        "ess_fraction": float(w.sum() ** 2 / (w.size * (w * w).sum())),
        "tokens": int(sum(m.sum() for m in masks)),
    }


def assert_figures(fig: Any, stats: Any, want: dict[str, Any]) -> None:
    assert fig.kl == pytest.approx(want["kl"], rel=1e-9, abs=1e-12)
    for name in ("kl_mean", "kl_max", "is_ratio_mean", "clip_fraction", "ess_fraction"):
        assert getattr(stats, name) == pytest.approx(want[name], rel=1e-9, abs=1e-12), name
    assert fig.kl_tokens == fig.ratio_tokens == want["tokens"]


logprobs = st.floats(-8.0, 0.0, allow_nan=False, width=32)


@st.composite
def multi_turn(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One rollout: old and new logprobs and a mask with at least one trained token."""
    n = draw(st.integers(1, 40))
    old = np.array(draw(st.lists(logprobs, min_size=n, max_size=n)), dtype=np.float32)
    new = np.array(draw(st.lists(logprobs, min_size=n, max_size=n)), dtype=np.float32)
    mask = np.array(draw(st.lists(st.sampled_from([0, 1]), min_size=n, max_size=n)), np.uint8)
    mask[draw(st.integers(0, n - 1))] = 1
    return old, new, mask


@settings(max_examples=150, deadline=None)
@given(st.lists(multi_turn(), min_size=1, max_size=6), st.sampled_from(["k1", "k2", "k3"]))
def test_ack_statistics_count_only_trained_tokens(batch, estimator):
    olds, news, masks = ([b[i] for b in batch] for i in range(3))
    rows = rows_of(list(zip(olds, masks, strict=True)))
    given_lp = {row.rollout_id: new.tolist() for row, new in zip(rows, news, strict=True)}
    config = RunConfig(kl_estimator=estimator, clip_epsilon=EPS)
    fig, stats = measure(rows, given_lp, {}, config)
    assert_figures(fig, stats, recompute(olds, news, masks, estimator))
    assert [row.given.trained for row in rows] == [int(m.sum()) for m in masks]


def test_tool_tokens_change_no_figure_though_they_would_change_every_one():
    """Tool output the policy never sampled can be wildly off-policy: counted, it would move
    every figure; masked, the figures are those of the turns alone."""
    mask = np.array([1, 1, 1, 0, 0, 0, 1, 1], np.uint8)
    old = np.array([-0.5, -1.0, -0.25, -9.0, -7.0, -8.0, -0.75, -1.5], np.float32)
    new = np.array([-0.4, -1.2, -0.25, -0.01, -0.02, -0.03, -0.8, -1.25], np.float32)
    olds, news = [old, old[:4]], [new, new[:4]]
    masks = [mask, np.array([1, 1, 1, 0], np.uint8)]
    rows = rows_of(list(zip(olds, masks, strict=True)))
    given_lp = {row.rollout_id: n.tolist() for row, n in zip(rows, news, strict=True)}
    for estimator in ("k1", "k2", "k3"):
        config = RunConfig(kl_estimator=estimator, clip_epsilon=EPS)
        fig, stats = measure(rows, given_lp, {}, config)
        want = recompute(olds, news, masks, estimator)
        assert_figures(fig, stats, want)
        every = recompute(olds, news, [np.ones_like(m) for m in masks], estimator)
        for name in ("kl_mean", "kl_max", "is_ratio_mean", "clip_fraction", "ess_fraction"):
            assert getattr(stats, name) != pytest.approx(every[name], rel=1e-3), name


def test_a_ready_made_kl_weighs_the_trained_tokens():
    mask = np.array([1, 0, 0, 1], np.uint8)
    rows = rows_of([(np.full(4, -0.5, np.float32), mask), (np.full(2, -0.5, np.float32), mask[:2])])
    fig, stats = measure(rows, {}, {"r0": 0.3, "r1": 0.1}, RunConfig())
    assert fig.kl_tokens == 3
    assert stats.kl_mean == pytest.approx((0.3 * 2 + 0.1 * 1) / 3, rel=1e-12)


def test_hand_out_masks_exactly_the_tokens_below_the_floor():
    mask = np.packbits(np.array([1, 0, 1, 1, 0, 1, 1, 1], np.uint8)).tobytes()
    versions = [[0, 2], [2, 3], [5, 5]]
    got = hand_out(mask, versions, 2, 8, V=6, floor=4)
    assert got.mask is not None
    assert got.mask.tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    assert (got.trained, got.stale, got.lag_sum) == (3, 3, 3 * (6 - 5))
    kept = hand_out(mask, versions, 2, 8, V=6, floor=None)
    assert kept.mask is not None and kept.mask.tolist() == [1, 0, 1, 1, 0, 1, 1, 1]
    assert (kept.trained, kept.stale, kept.lag_sum) == (6, 0, 1 * 4 + 2 * 3 + 3 * 1)
    plain = hand_out(None, None, 2, 8, V=3, floor=2)
    assert (plain.mask, plain.trained, plain.stale, plain.lag_sum) == (None, 8, 0, 8)


@st.composite
def stored_tokens(draw: Any) -> tuple[Any, ...]:
    """A stored rollout's mask (packed as ingest packs it) and versions, its policy_version (the
    oldest version of a trained token), and a lease's V and token floor."""
    n = draw(st.integers(1, 70))
    bits = draw(st.none() | st.lists(st.integers(0, 1), min_size=n, max_size=n))
    if bits is not None and not any(bits):
        bits[draw(st.integers(0, n - 1))] = 1
    cuts = sorted(set(draw(st.lists(st.integers(1, n - 1), max_size=4)) if n > 1 else []))
    vers = sorted(draw(st.lists(st.integers(0, 9), min_size=len(cuts) + 1, max_size=len(cuts) + 1)))
    versions = [[o, v] for o, v in zip([0, *cuts], vers, strict=True)]
    trained = [i for i in range(n) if bits is None or bits[i]]
    of = [next(v for o, v in reversed(versions) if o <= i) for i in range(n)]
    policy_version = min(of[i] for i in trained)
    mask = None if bits is None else np.packbits(np.array(bits, np.uint8)).tobytes()
    V = draw(st.integers(max(vers), 12))
    floor = draw(st.none() | st.integers(0, 12))
    return mask, versions if len(versions) > 1 else None, policy_version, n, V, floor


@settings(max_examples=300, deadline=None)
@given(case=stored_tokens())
def test_the_hand_out_without_arrays_is_the_one_with_them(case):
    """The shortcuts of a mask alone or versions alone (no array built but the mask handed out)
    give what the array computation gives."""
    got = hand_out(*case)
    want = tokens._hand_out_arrays(*case)
    assert (got.trained, got.stale, got.lag_sum) == (want.trained, want.stale, want.lag_sum)
    assert (got.mask is None) == (want.mask is None)
    if got.mask is not None:
        assert got.mask.tolist() == want.mask.tolist()
