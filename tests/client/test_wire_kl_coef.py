"""The client reads the adaptive KL penalty's β from lease and ack answers (None when off or from
a broker that does not send it)."""

from __future__ import annotations

from rollout_broker_client._wire import parse_ack, parse_batch

STATS = {"kl_mean": 0.1, "kl_max": 0.2, "is_ratio_mean": 1.0, "clip_fraction": 0.0}
LEASE = {"batch_id": "b", "policy_version": 3, "lease_expires_at": "2026-01-01T00:00:00Z"}
ACK = {"consumed": 2, "retired": 0, "flushed": 0, "stats": {**STATS, "ess_fraction": 1.0}}


def test_lease_and_ack_answers_give_beta():
    assert parse_batch({**LEASE, "rollouts": [], "kl_coef": 0.125}).kl_coef == 0.125
    assert parse_ack({**ACK, "kl_coef": 0.25}).kl_coef == 0.25


def test_beta_is_none_when_off_or_absent():
    assert parse_batch({**LEASE, "rollouts": [], "kl_coef": None}).kl_coef is None
    assert parse_batch({**LEASE, "rollouts": []}).kl_coef is None
    assert parse_ack(ACK).kl_coef is None
