"""The broker's figures, read at scrape time from Redis and Postgres, and the text of one scrape."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.accounting import queries
from app.accounting.deltas import REWARD_LATENCY_BOUNDS_MS
from app.accounting.schemas import BiasStats, ConsumerCounts, RunAccounting
from app.accounting.stream import EventStream
from app.broker.store import RedisStore, RunState
from app.caller import Caller
from app.errors import outage_of
from app.metrics.catalogue import (
    CATALOGUE,
    LAG_BUCKETS,
    NAMESPACE,
    SPECS,
    MetricSpec,
)
from app.metrics.consumers import STATES, label_consumers
from app.metrics.generators import GeneratorFigures, label_generators

# -- the broker's figures ------------------------------------------------------------------

# A scrape reads the open runs' accounting this many runs at a time, in one database snapshot
# each, and this many such reads at once (one database session each).
_RUNS_PER_READ: Final = 25
_CONCURRENT_READS: Final = 4


@dataclass(frozen=True, slots=True)
class LedgerFigures:
    """A run's figures read from the accounting: its answer to ``GET .../accounting``, the
    rollouts of each lease outcome, the drain's delay and the ledger check."""

    accounting: RunAccounting
    lease_rollouts: dict[str, int]
    drain_delay_s: float
    mismatch: bool
    reward_latency: dict[int, int]  # bucket bound (ms) -> scores in it (not cumulative)
    # (generator label, figures): the labelled generators, then "other" (app/metrics/generators)
    generators: tuple[tuple[str, GeneratorFigures], ...] = ()
    # (consumer label, counts): the labelled consumers, then "(other)" (app/metrics/consumers)
    consumers: tuple[tuple[str, ConsumerCounts], ...] = ()


@dataclass(frozen=True, slots=True)
class RunFigures:
    state: RunState
    ledger: LedgerFigures | None  # None: no accounting database


@dataclass(frozen=True, slots=True)
class BrokerFigures:
    """What one scrape read from the stores; ``up`` is False when they could not be read."""

    up: bool
    ledger: bool = False  # the broker keeps an accounting ledger (a database is configured)
    open_runs: int = 0
    omitted: int = 0
    runs: Sequence[RunFigures] = ()


async def collect_broker(
    store: RedisStore,
    stream: EventStream,
    sessionmaker: async_sessionmaker[AsyncSession] | None,
    caller: Caller,
    max_runs: int,
    max_generators: int = 16,
    max_consumers: int = 16,
) -> BrokerFigures:
    """The figures of the open runs ``caller`` may touch, the first ``max_runs`` of them with a
    ``run`` label, each with up to ``max_generators`` generator labels (and every quarantined
    generator's) and up to ``max_consumers`` consumer labels. An unreachable Redis or Postgres
    gives ``up=False`` instead of an error, so the process's own request metrics are still
    served."""
    try:
        page = await store.list_runs("open", limit=1 << 30)
        states = [s for s in page.runs if caller.may_touch(s.run_id)]
        shown = states[:max_runs]
        runs: list[RunFigures] = [RunFigures(s, None) for s in shown]
        if sessionmaker is not None:
            ledgers = await _ledgers(
                stream, sessionmaker, [s.run_id for s in shown], max_generators, max_consumers
            )
            # A run deleted since it was listed has no ledger read: left out.
            runs = [RunFigures(s, ledgers[s.run_id]) for s in shown if s.run_id in ledgers]
    except Exception as exc:
        if outage_of(exc) is None:
            raise
        return BrokerFigures(up=False)
    return BrokerFigures(
        up=True,
        ledger=sessionmaker is not None,
        open_runs=len(states),
        omitted=len(states) - len(shown),
        runs=runs,
    )


async def _ledgers(
    stream: EventStream,
    sessionmaker: async_sessionmaker[AsyncSession],
    run_ids: list[str],
    max_generators: int,
    max_consumers: int,
) -> dict[str, LedgerFigures]:
    """The ledger figures of ``run_ids``, read ``_RUNS_PER_READ`` runs at a time
    (:func:`app.accounting.queries.checked_accounting_of`), ``_CONCURRENT_READS`` reads at once."""
    seconds, micros = await stream.redis.time()  # the clock the stream ids were cut by
    now_ms = seconds * 1000 + micros // 1000
    gate = asyncio.Semaphore(_CONCURRENT_READS)

    async def read(chunk: list[str]) -> dict[str, queries.CheckedAccounting]:
        async with gate, sessionmaker() as session:
            return await queries.checked_accounting_of(session, stream, chunk)

    chunks = [run_ids[i : i + _RUNS_PER_READ] for i in range(0, len(run_ids), _RUNS_PER_READ)]
    out: dict[str, LedgerFigures] = {}
    for got in await asyncio.gather(*(read(chunk) for chunk in chunks)):
        for run_id, checked in got.items():
            acc, totals = checked.accounting, checked.totals
            oldest = await stream.oldest_undrained(run_id) if acc.pending_events else None
            out[run_id] = LedgerFigures(
                accounting=acc,
                lease_rollouts={
                    "leased": totals.rollouts_leased,
                    "acked": totals.rollouts_acked,
                    "nacked": totals.rollouts_nacked,
                    "expired": totals.rollouts_expired,
                },
                drain_delay_s=max(0, now_ms - oldest.ms) / 1000 if oldest is not None else 0.0,
                mismatch=checked.check.mismatch,
                reward_latency=checked.reward_latency,
                generators=label_generators(checked.generators, max_generators),
                consumers=label_consumers(acc.consumers, max_consumers),
            )
    return out


def _family(spec: MetricSpec) -> Any:  # a MetricFamily; their add_metric()s differ
    if spec.kind == "counter":
        return CounterMetricFamily(spec.name, spec.help, labels=spec.labels)
    if spec.kind == "gauge":
        return GaugeMetricFamily(spec.name, spec.help, labels=spec.labels)
    return HistogramMetricFamily(spec.name, spec.help, labels=spec.labels)


def _lag_buckets(histogram: dict[int, int]) -> tuple[list[tuple[str, float]], float]:
    """Cumulative ``le`` buckets of a lag -> samples histogram, and Σ lag."""
    buckets = [
        (str(float(bound)), float(sum(n for lag, n in histogram.items() if lag <= bound)))
        for bound in LAG_BUCKETS
    ]
    buckets.append(("+Inf", float(sum(histogram.values()))))
    return buckets, float(sum(lag * n for lag, n in histogram.items()))


def _reward_latency_buckets(
    latency: dict[int, int], scored: int, reward_s: float
) -> tuple[list[tuple[str, float]], float]:
    """Cumulative ``le`` buckets (seconds) of the ledger's reward-latency counts; the ``+Inf``
    bucket is every score, those beyond the last bound too, and the sum is ``wait.reward_s``."""
    buckets, below = [], 0
    for bound in REWARD_LATENCY_BOUNDS_MS:
        below += latency.get(bound, 0)
        buckets.append((str(bound / 1000), float(below)))
    buckets.append(("+Inf", float(scored)))
    return buckets, reward_s


class _BrokerCollector(Collector):
    """Exposes one scrape's :class:`BrokerFigures` (read beforehand, in the async handler)."""

    def __init__(self, figures: BrokerFigures) -> None:
        self.figures = figures

    def collect(self) -> Iterable[Metric]:
        f = self.figures
        families: dict[str, Any] = {s.name: _family(s) for s in CATALOGUE if s.source != "process"}

        def put(name: str, value: float, *labels: str) -> None:
            families[f"{NAMESPACE}_{name}"].add_metric(list(labels), value)

        put("state_up", 1 if f.up else 0)
        if not f.up:
            return [families[f"{NAMESPACE}_state_up"]]
        put("open_runs", f.open_runs)
        put("metrics_runs_omitted", f.omitted)
        for r in f.runs:
            run, state = r.state.run_id, r.state
            put("run_policy_version", state.policy_version, run)
            put("capacity_rollouts", state.config.capacity_rollouts, run)
            put("max_staleness", state.config.max_staleness, run)
            put("rollouts_buffered", state.live - state.leased, run)
            put("rollouts_leased", state.leased, run)
            if r.ledger is not None:
                self._ledger(put, families, run, r.ledger)
        return [
            family
            for name, family in families.items()
            if f.ledger or SPECS[name].source != "ledger"
        ]

    @staticmethod
    def _ledger(put: Any, families: dict[str, Any], run: str, ledger: LedgerFigures) -> None:
        acc = ledger.accounting
        put("rollouts_received_total", acc.rollouts_received, run)
        put("rollouts_duplicate_total", acc.duplicates, run)
        for reason, n in acc.rejected.items():
            put("rollouts_rejected_total", n, run, reason)
        for outcome, n in ledger.lease_rollouts.items():
            put("lease_rollouts_total", n, run, outcome)
        for outcome, n in acc.batches.model_dump().items():
            put("batches_total", n, run, outcome)
        put("samples_consumed_total", acc.samples_consumed, run)
        put("samples_rewound_total", acc.samples_rewound, run)
        for reason, n in acc.retired.items():
            put("rollouts_retired_total", n, run, reason)
        put("tokens_generated_total", acc.tokens_generated, run)
        put("tokens_consumed_total", acc.tokens_consumed, run)
        put("tokens_wasted_total", acc.wasted_tokens, run)
        put("tokens_masked_total", acc.tokens_masked, run)
        put("tokens_masked_stale_total", acc.tokens_masked_stale, run)
        buckets, lag_sum = _lag_buckets(acc.lag.histogram)
        families[f"{NAMESPACE}_sample_lag_versions"].add_metric([run], buckets, lag_sum)
        latency, reward_s = _reward_latency_buckets(
            ledger.reward_latency, acc.rewards.scored, acc.wait.reward_s
        )
        families[f"{NAMESPACE}_reward_latency_seconds"].add_metric([run], latency, reward_s)
        for name, figure in (
            ("token_lag_versions_mean", acc.lag.token_mean),
            ("kl_mean", acc.kl.mean),
            ("kl_max", acc.kl.max),
            ("importance_ratio_mean", acc.is_ratio.mean),
            ("importance_ratio_clip_fraction", acc.is_ratio.clip_fraction),
        ):
            if figure is not None:  # not measured yet: no sample rather than a made-up 0
                put(name, figure, run)
        _put_bias(put, run, acc.bias)
        # By state, each pass once: the answer's done counts the skipped passes too.
        prompts = acc.prompts
        for state, n in (
            ("queued", prompts.queued),
            ("in_flight", prompts.in_flight),
            ("done", prompts.done - prompts.skipped),
            ("failed", prompts.failed),
            ("skipped", prompts.skipped),
        ):
            put("prompt_passes", n, run, state)
        if prompts.pools is not None:
            for pool, n in prompts.pools.model_dump().items():
                put("prompt_pool_passes", n, run, pool)
        put("prompt_passes_registered_total", acc.prompts.registered, run)
        put("prompt_retries_total", acc.prompts.retried, run)
        p = acc.partials
        for outcome, n in (
            ("returned", p.returned),
            ("resumed", p.resumed),
            ("dropped", p.dropped),
        ):
            put("partials_total", n, run, outcome)
        put("partial_tokens_total", p.tokens_resumed, run, "resumed")
        put("partial_tokens_total", p.tokens_dropped, run, "dropped")
        put("generator_wait_seconds_total", acc.wait.generator_s, run)
        put("trainer_wait_seconds_total", acc.wait.trainer_s, run)
        put("accounting_pending_events", acc.pending_events, run)
        put("accounting_drain_delay_seconds", ledger.drain_delay_s, run)
        put("accounting_dead_letters", acc.dead_letters, run)
        put("ledger_mismatch", 1 if ledger.mismatch else 0, run)
        for generator, g in ledger.generators:
            put("generator_rollouts", g.rollouts, run, generator)
            put("generator_samples_consumed", g.samples_consumed, run, generator)
            for name, figure in (
                ("generator_kl_mean", g.kl_mean),
                ("generator_importance_ratio_clip_fraction", g.clip_fraction),
                ("generator_masked_fraction", g.masked_fraction),
            ):
                if figure is not None:
                    put(name, figure, run, generator)
            put("generator_quarantined", 1 if g.quarantined else 0, run, generator)
        for consumer, counts in ledger.consumers:
            for state in STATES:
                put("consumer_items", getattr(counts, state), run, consumer, state)


def _put_bias(put: Any, run: str, bias: BiasStats) -> None:
    """The bias figures: none with nothing to average, rather than a made-up 0."""
    if bias.length.ks is not None:  # either side empty
        put("bias_length_ks", bias.length.ks, run)
    for side in ("generated", "trained"):
        for name, figure in (
            ("bias_length_mean", getattr(bias.length, f"{side}_mean")),
            ("bias_reward_mean", getattr(bias.reward, f"{side}_mean")),
        ):
            if figure is not None:
                put(name, figure, run, side)


def render_metrics(request_registry: CollectorRegistry, figures: BrokerFigures) -> bytes:
    """The text of one scrape: this process's request metrics, then the broker's figures."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_BrokerCollector(figures))
    return generate_latest(request_registry) + generate_latest(registry)
