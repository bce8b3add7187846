"""The off-policy statistics against hand-computed values."""

import math

import numpy as np
import pytest

from app.broker.stats import Measured, batch_figures, ess_fraction, kl_per_token


def f32(xs):
    return np.asarray(xs, dtype=np.float32)


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [
        ("k1", lambda lr: -lr),
        ("k2", lambda lr: lr * lr / 2),
        ("k3", lambda lr: math.exp(lr) - 1 - lr),
    ],
)
def test_estimators_match_their_definitions(estimator, expected):
    log_r = np.array([-0.7, -0.1, 0.0, 0.3, 1.2])
    got = kl_per_token(log_r, estimator)
    assert got == pytest.approx([expected(x) for x in log_r], rel=1e-12, abs=1e-15)


def test_k3_is_non_negative_and_k1_can_be_negative():
    log_r = np.linspace(-3, 3, 61)
    assert (kl_per_token(log_r, "k3") >= 0).all()
    assert (kl_per_token(log_r, "k1") < 0).any()


def test_batch_figures_by_hand():
    old_a, new_a = f32([-1.0, -2.0]), f32([-0.5, -2.0])  # log_r = 0.5, 0
    old_b, new_b = f32([-1.0]), f32([-1.25])  # log_r = -0.25
    fig = batch_figures(
        [Measured(old_a, new_a, None, 2), Measured(old_b, new_b, None, 1)], "k3", 0.2
    )
    k3 = lambda x: math.exp(x) - 1 - x  # noqa: E731
    assert fig.kl[0] == pytest.approx((k3(0.5) + k3(0.0)) / 2)
    assert fig.kl[1] == pytest.approx(k3(-0.25))
    assert fig.kl_mean == pytest.approx((k3(0.5) + k3(0) + k3(-0.25)) / 3)
    assert fig.kl_max == pytest.approx(fig.kl[0])
    r = [math.exp(0.5), 1.0, math.exp(-0.25)]
    assert fig.is_ratio_mean == pytest.approx(sum(r) / 3)
    assert fig.clip_fraction == pytest.approx(2 / 3)  # 1.65 and 0.78 are outside [0.8, 1.2]
    w = [math.exp(0.5), math.exp(-0.25)]
    assert fig.ess_fraction == pytest.approx(sum(w) ** 2 / (2 * sum(x * x for x in w)))
    assert (fig.kl_tokens, fig.ratio_tokens, fig.clipped) == (3, 3, 2)


def test_ready_made_kl_is_weighted_by_tokens_and_unmeasured_rollouts_are_skipped():
    fig = batch_figures(
        [
            Measured(None, None, 0.3, 10),
            Measured(f32([-1.0]), f32([-1.0]), None, 1),
            Measured(None, None, None, 5),
            Measured(None, f32([-1.0]), None, 1),  # ingested without logprobs
        ],
        "k1",
        0.2,
    )
    assert fig.kl == [0.3, 0.0, None, None]
    assert fig.kl_mean == pytest.approx((0.3 * 10 + 0.0) / 11)
    assert fig.kl_max == pytest.approx(0.3)
    assert fig.is_ratio_mean == pytest.approx(1.0)
    assert fig.ess_fraction == pytest.approx(1.0)


def test_nothing_measured_gives_no_statistics():
    fig = batch_figures([Measured(None, None, None, 3)], "k3", 0.2)
    assert (fig.kl_mean, fig.kl_max, fig.is_ratio_mean, fig.clip_fraction, fig.ess_fraction) == (
        None,
        None,
        None,
        None,
        None,
    )


def test_ess_is_stable_for_huge_sequence_log_weights():
    # exp(800) overflows float64; in log space the answer is still exact.
    assert ess_fraction(np.array([800.0, 800.0])) == pytest.approx(1.0)
    assert ess_fraction(np.array([800.0, 0.0, 0.0, 0.0])) == pytest.approx(0.25)
    assert ess_fraction(np.array([-5.0, -5.0, -5.0])) == pytest.approx(1.0)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_batch_figures_agree_with_a_rollout_by_rollout_computation(estimator):
    """The batch is measured in one pass over its concatenated tokens; every figure must equal
    the SPEC's definition applied rollout by rollout, whatever the mix of kinds and lengths."""
    rng = np.random.default_rng(7)
    items, reference = [], []
    for n in range(40):
        tokens = int(rng.integers(1, 300))
        old = f32(-rng.exponential(1.0, tokens))
        new = f32(np.minimum(old + rng.normal(0, 0.3, tokens), 0.0))
        kind = n % 4
        if kind == 0:
            items.append(Measured(old, new, None, tokens))
        elif kind == 1:
            items.append(Measured(None, None, float(rng.random()), tokens))
        elif kind == 2:
            items.append(Measured(old, None, None, tokens))
        else:
            items.append(Measured(None, new, None, tokens))
        reference.append((kind, old.astype(np.float64), new.astype(np.float64), items[-1].kl))
    fig = batch_figures(items, estimator, 0.2)

    kl_sum = kl_tokens = ratio_sum = clipped = ratio_tokens = 0.0
    seq_log_w = []
    for (kind, old, new, ready), got in zip(reference, fig.kl, strict=True):
        if kind == 0:
            log_r = new - old
            k = kl_per_token(log_r, estimator)
            assert got == pytest.approx(k.mean(), rel=1e-9, abs=1e-12)
            kl_sum += k.sum()
            kl_tokens += k.size
            r = np.exp(log_r)
            ratio_sum += r.sum()
            clipped += np.count_nonzero(np.abs(r - 1) > 0.2)
            ratio_tokens += r.size
            seq_log_w.append(log_r.sum())
        elif kind == 1:
            assert got == ready
            kl_sum += ready * old.size
            kl_tokens += old.size
        else:
            assert got is None
    assert fig.kl_mean == pytest.approx(kl_sum / kl_tokens, rel=1e-9)
    assert fig.kl_max == max(x for x in fig.kl if x is not None)
    assert fig.is_ratio_mean == pytest.approx(ratio_sum / ratio_tokens, rel=1e-9)
    assert fig.clip_fraction == pytest.approx(clipped / ratio_tokens)
    assert (fig.kl_tokens, fig.ratio_tokens, fig.clipped) == (kl_tokens, ratio_tokens, clipped)
    w = np.exp(np.array(seq_log_w))
    assert fig.ess_fraction == pytest.approx(w.sum() ** 2 / (w.size * (w * w).sum()), rel=1e-9)
