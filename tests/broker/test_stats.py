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
