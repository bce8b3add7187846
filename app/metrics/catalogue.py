"""The catalogue of every metric ``GET /metrics`` exposes: names, kinds, labels, help texts and
where each figure comes from (the one owner of every metric name), and the buckets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from prometheus_client import disable_created_metrics

# No ``_created`` series: in the text format they are families of their own, which the
# catalogue does not declare and dashboards do not use.
disable_created_metrics()  # type: ignore[no-untyped-call]

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"

MULTIPROC_DIR: Final = "PROMETHEUS_MULTIPROC_DIR"
"""prometheus-client's variable: set (before the process starts), every process writes its
request histogram to files in that folder and reads all of them for ``GET /metrics``."""

NAMESPACE: Final = "rollout_broker"

MetricKind = Literal["counter", "gauge", "histogram"]
Source = Literal["process", "state", "ledger"]


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One exposed metric family: its name as scraped (a counter's ends in ``_total``, a
    histogram's has no suffix), kind, labels, help text, and where its figures come from:
    this API process, the broker's live state in Redis, or the accounting ledger (absent when
    the broker runs without a database)."""

    name: str
    kind: MetricKind
    labels: tuple[str, ...]
    help: str
    source: Source


def _m(
    name: str, kind: MetricKind, labels: tuple[str, ...], help: str, source: Source = "ledger"
) -> MetricSpec:
    return MetricSpec(f"{NAMESPACE}_{name}", kind, labels, help, source)


_RUN = ("run",)
_GENERATOR = ("run", "generator")
_LEDGER = "from the accounting ledger"

CATALOGUE: Final[tuple[MetricSpec, ...]] = (
    _m(
        "http_request_duration_seconds",
        "histogram",
        ("route", "method", "status_class"),
        "Time from the arrival of an HTTP request to the end of its answer, in this API "
        "process, by route template, method and status class",
        "process",
    ),
    _m(
        "state_up",
        "gauge",
        (),
        "1 when this scrape read the broker's state from Redis and Postgres, 0 when one of "
        "them was unreachable (the broker figures are then absent)",
        "state",
    ),
    _m("open_runs", "gauge", (), "Open runs (the token's, when it is limited to some)", "state"),
    _m(
        "metrics_runs_omitted",
        "gauge",
        (),
        "Open runs left out of the per-run figures by BROKER_METRICS_MAX_RUNS",
        "state",
    ),
    _m("run_policy_version", "gauge", _RUN, "The run's current policy version", "state"),
    _m(
        "capacity_rollouts",
        "gauge",
        _RUN,
        "The run's capacity_rollouts: buffered + leased rollouts above which ingest answers 429",
        "state",
    ),
    _m(
        "max_staleness",
        "gauge",
        _RUN,
        "The run's max_staleness: the largest lag, in policy versions, a sample may be handed "
        "out with (served so that a rule can compare the run's lag with its own setting)",
        "state",
    ),
    _m(
        "rollouts_buffered",
        "gauge",
        _RUN,
        "Rollouts stored and not leased, from the live state",
        "state",
    ),
    _m("rollouts_leased", "gauge", _RUN, "Rollouts in live leases, from the live state", "state"),
    _m("rollouts_received_total", "counter", _RUN, f"Rollouts accepted at ingest, {_LEDGER}"),
    _m(
        "rollouts_duplicate_total",
        "counter",
        _RUN,
        f"Rollouts posted again under an id already accepted (not stored twice), {_LEDGER}",
    ),
    _m(
        "rollouts_rejected_total",
        "counter",
        ("run", "reason"),
        f"Rollouts refused at ingest by a policy rule, by reason, {_LEDGER}",
    ),
    _m(
        "lease_rollouts_total",
        "counter",
        ("run", "outcome"),
        "Rollouts handed out in leases (outcome=leased) and how their leases ended (acked, "
        f"nacked, expired), {_LEDGER}",
    ),
    _m(
        "batches_total",
        "counter",
        ("run", "outcome"),
        f"Batches leased, and acked, nacked or expired, {_LEDGER}",
    ),
    _m(
        "samples_consumed_total",
        "counter",
        _RUN,
        f"Samples that reached a gradient (rollouts in acknowledged batches), {_LEDGER}",
    ),
    _m(
        "samples_rewound_total",
        "counter",
        _RUN,
        "Of the samples consumed, the uses a rewind of the policy version gave back to their "
        f"rollouts (the acknowledged batches it undid), {_LEDGER}",
    ),
    _m(
        "rollouts_retired_total",
        "counter",
        ("run", "reason"),
        f"Rollouts retired, by reason, {_LEDGER}",
    ),
    _m("tokens_generated_total", "counter", _RUN, f"Tokens of the received rollouts, {_LEDGER}"),
    _m(
        "tokens_consumed_total",
        "counter",
        _RUN,
        f"Tokens of the samples that reached a gradient, {_LEDGER}",
    ),
    _m(
        "tokens_wasted_total",
        "counter",
        _RUN,
        f"Tokens of rollouts that retired with no use, {_LEDGER}",
    ),
    _m(
        "tokens_masked_total",
        "counter",
        _RUN,
        f"Tokens of the received rollouts posted with loss_mask 0 (never trained), {_LEDGER}",
    ),
    _m(
        "tokens_masked_stale_total",
        "counter",
        _RUN,
        "Trained tokens of the consumed samples handed out with loss_mask 0 because their own "
        f"lag exceeded max_staleness (stale_tokens mask), {_LEDGER}",
    ),
    _m(
        "sample_lag_versions",
        "histogram",
        _RUN,
        "Lag of the consumed samples in policy versions (the trainer's version at lease minus "
        f"the version that generated the rollout), {_LEDGER}",
    ),
    _m(
        "reward_latency_seconds",
        "histogram",
        _RUN,
        "Time from a rollout's ingest to its reward, over the rollouts posted without one and "
        f"scored through POST .../rewards, {_LEDGER}",
    ),
    _m(
        "token_lag_versions_mean",
        "gauge",
        _RUN,
        "Mean over the trained tokens consumed of each token's own lag in policy versions (the "
        f"trainer's version at lease minus the version that sampled the token), {_LEDGER}",
    ),
    _m("kl_mean", "gauge", _RUN, "Token-weighted mean KL of the acknowledged samples measured"),
    _m("kl_max", "gauge", _RUN, "Largest per-rollout KL measured in an acknowledgement"),
    _m(
        "importance_ratio_mean",
        "gauge",
        _RUN,
        "Mean importance ratio pi_theta/pi_old over the tokens acknowledged with logprobs",
    ),
    _m(
        "importance_ratio_clip_fraction",
        "gauge",
        _RUN,
        "Share of those tokens whose importance ratio was outside [1-eps, 1+eps]",
    ),
    _m(
        "generator_rollouts",
        "gauge",
        _GENERATOR,
        "Rollouts accepted from the generator; the generators beyond BROKER_METRICS_GENERATORS "
        'summed under generator="other" (a gauge: a generator may move in or out of it)',
    ),
    _m(
        "generator_samples_consumed",
        "gauge",
        _GENERATOR,
        "Uses of the generator's rollouts in acknowledged batches, less those a rewind undid",
    ),
    _m(
        "generator_kl_mean",
        "gauge",
        _GENERATOR,
        "Token-weighted mean KL measured on the generator's acknowledged samples",
    ),
    _m(
        "generator_importance_ratio_clip_fraction",
        "gauge",
        _GENERATOR,
        "Share of the generator's measured tokens whose importance ratio was outside "
        "[1-eps, 1+eps]",
    ),
    _m(
        "generator_masked_fraction",
        "gauge",
        _GENERATOR,
        "Share of the generator's measured tokens the run's correction weighed 0",
    ),
    _m(
        "generator_quarantined",
        "gauge",
        _GENERATOR,
        "1 while the generator is quarantined (its mean KL over its window passed "
        "generator_kl_max), else 0; a quarantined generator always has a label of its own",
    ),
    _m(
        "consumer_items",
        "gauge",
        ("run", "consumer", "state"),
        "A consumer's items by state: delivered to it, acked, pending (delivered - acked - "
        "dropped: queued or in its live leases), dropped (beyond retention_rollouts, beyond "
        "max_lag, or held when it was deleted); the consumers beyond BROKER_METRICS_CONSUMERS "
        f'summed under consumer="(other)", {_LEDGER}',
    ),
    _m(
        "bias_length_ks",
        "gauge",
        _RUN,
        "Kolmogorov-Smirnov distance between the trained-token lengths of the rollouts received "
        "and those of the samples consumed (0 the same distribution, 1 disjoint), read from "
        f"log-spaced histograms, {_LEDGER}",
    ),
    _m(
        "bias_length_mean",
        "gauge",
        ("run", "side"),
        "Mean trained-token length of the rollouts received (side=generated) and of the "
        f"samples consumed (side=trained), {_LEDGER}",
    ),
    _m(
        "bias_reward_mean",
        "gauge",
        ("run", "side"),
        "Mean reward of the rollouts received, posted with it or scored later (side=generated), "
        f"and of the samples consumed (side=trained), {_LEDGER}",
    ),
    _m(
        "prompt_passes",
        "gauge",
        ("run", "state"),
        "Prompt passes by state: queued, in_flight (in a generator's work lease), done (not "
        "counting the skipped ones), failed, skipped (in a difficulty pool of weight 0), "
        f"{_LEDGER}",
    ),
    _m(
        "prompt_pool_passes",
        "gauge",
        ("run", "pool"),
        "Queued prompt passes by difficulty pool: easy, normal, hard (judged from each prompt's "
        f"newest group mean and the run's thresholds; runs with difficulty only), {_LEDGER}",
    ),
    _m(
        "prompt_passes_registered_total",
        "counter",
        _RUN,
        f"Prompt passes registered (a prompt counts once per epoch), {_LEDGER}",
    ),
    _m(
        "prompt_retries_total",
        "counter",
        _RUN,
        f"Attempts of prompt passes after their first, {_LEDGER}",
    ),
    _m(
        "partials_total",
        "counter",
        ("run", "outcome"),
        "Partial rollouts that came back with their prompts (outcome=returned), were handed out "
        f"again to be continued (resumed) or were dropped (dropped), {_LEDGER}",
    ),
    _m(
        "partial_tokens_total",
        "counter",
        ("run", "outcome"),
        f"Response tokens of the partial rollouts resumed and dropped, by outcome, {_LEDGER}",
    ),
    _m(
        "generator_wait_seconds_total",
        "counter",
        _RUN,
        f"Time generators' requests waited for prompts or staleness budget, {_LEDGER}",
    ),
    _m(
        "trainer_wait_seconds_total",
        "counter",
        _RUN,
        f"Time trainers' lease requests waited for rollouts, {_LEDGER}",
    ),
    _m(
        "accounting_pending_events",
        "gauge",
        _RUN,
        "Accounting events not yet drained into Postgres (the drain backlog)",
    ),
    _m(
        "accounting_drain_delay_seconds",
        "gauge",
        _RUN,
        "Age of the oldest accounting event not yet drained into Postgres; 0 when none is",
    ),
    _m(
        "accounting_dead_letters",
        "gauge",
        _RUN,
        "Accounting events the ledger could not apply (see /accounting/dead-letters)",
    ),
    _m(
        "ledger_mismatch",
        "gauge",
        _RUN,
        "1 when nothing is pending and the ledger's buffered or leased rollouts differ from "
        "the live state's, else 0",
    ),
)
"""Every metric ``GET /metrics`` exposes: the one list of names, kinds, labels and help."""

SPECS: Final[dict[str, MetricSpec]] = {spec.name: spec for spec in CATALOGUE}
REQUEST_SECONDS: Final = f"{NAMESPACE}_http_request_duration_seconds"

LAG_BUCKETS: Final = (0, 1, 2, 4, 8, 16, 32, 64)
"""Upper bounds of ``sample_lag_versions``'s buckets, in policy versions."""

LATENCY_BUCKETS_S: Final = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
"""Request latency buckets; up to 60 s, the default longest long poll (BROKER_MAX_WAIT_S)."""
