"""Folding of one run's newly drained events into additive deltas for the accounting tables
(app/accounting/deltas.py).

Every delta is commutative (sums, maxima, minima, "newest snapshot wins", "greatest pass state
wins"), so the order in which workers apply batches of events does not change the result: a
batch claimed from a dead consumer may land after a later one.

An event that decodes but cannot be applied (a prompt pass state or a waiting role this module
does not know) raises :class:`~app.events.EventError`: the drain treats it like a
payload it cannot decode, and dead-letters the entry.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import assert_never

from app.accounting.deltas import BatchPatch, Fold, RunSnapshot, TotalsDelta, tell
from app.accounting.passes import MAX_PASSES, PassState, pass_state
from app.events import (
    Accepted,
    Acked,
    ConsumersChanged,
    Duplicate,
    Event,
    EventError,
    GeneratorChanged,
    Leased,
    PartialsChanged,
    PassesChanged,
    PromptScored,
    Registered,
    Rejected,
    Retired,
    Returned,
    RewardExpired,
    RewardLeased,
    RewardReturned,
    Rewound,
    RunChanged,
    Scored,
    Waited,
    WorkLeased,
    lag_of,
)

__all__ = ["fold_events"]

REJECTED = "rejected"
GENERATED, TRAINED = "generated", "trained"  # the sides of the length histograms
RETIRED = "retired"
# A retired item's `unscored`: it awaited a reward lease, or was in a live one.
UNSCORED_AWAITING = 1
UNSCORED_LEASED = 2

_WAIT_COLUMNS = {"trainer": "trainer_wait_ms", "generator": "generator_wait_ms"}


def _max(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    if b is None:
        return a
    return max(a, b)


def fold_events(events: Iterable[Event]) -> Fold:
    """Aggregate events (all of one run, none already applied) into table deltas."""
    fold = Fold()
    run = fold.run
    for event in events:
        run.events_applied += 1
        run.first_event_ms = (
            event.t_ms if run.first_event_ms is None else min(run.first_event_ms, event.t_ms)
        )
        run.last_event_ms = (
            event.t_ms if run.last_event_ms is None else max(run.last_event_ms, event.t_ms)
        )
        body = event.body
        if isinstance(body, RunChanged):
            _fold_run(fold, event, body)
        elif isinstance(body, Accepted):
            _fold_accepted(fold, event, body)
        elif isinstance(body, Duplicate):
            run.duplicates += body.n
        elif isinstance(body, Rejected):
            _fold_rejected(fold, body)
        elif isinstance(body, Leased):
            _fold_leased(fold, event, body)
        elif isinstance(body, Acked):
            _fold_acked(fold, event, body)
        elif isinstance(body, Returned):
            _fold_returned(fold, event, body)
        elif isinstance(body, Retired):
            _fold_retired(fold, body)
        elif isinstance(body, Rewound):
            _fold_rewound(fold, event, body)
        elif isinstance(body, Registered):
            _fold_registered(fold, event, body)
        elif isinstance(body, WorkLeased):
            _fold_work_leased(fold, event, body)
        elif isinstance(body, PassesChanged):
            _fold_passes(fold, event, body)
        elif isinstance(body, PartialsChanged):
            _fold_partials(fold, body)
        elif isinstance(body, RewardLeased | RewardReturned):
            _fold_reward_moved(fold, body)
        elif isinstance(body, Scored):
            _fold_scored(fold, body)
        elif isinstance(body, RewardExpired):
            _fold_reward_expired(fold, body)
        elif isinstance(body, Waited):
            _fold_waited(fold, body)
        elif isinstance(body, ConsumersChanged):
            _fold_consumers(fold, body)
        elif isinstance(body, PromptScored):
            _fold_prompt_scored(fold, event, body)
        elif isinstance(body, GeneratorChanged):
            # Quarantined or released: the newest event wins, whatever the order applied.
            tell(
                fold.generator(body.generator_id), "quarantined", event.stream_id, body.quarantined
            )
        else:
            assert_never(body)
    return fold


def _fold_run(fold: Fold, event: Event, body: RunChanged) -> None:
    if fold.snapshot is not None and fold.snapshot.stream_id > event.stream_id:
        return
    fold.snapshot = RunSnapshot(
        stream_id=event.stream_id,
        t_ms=event.t_ms,
        change=body.change,
        config=dict(body.config),
        policy_version=body.policy_version,
        status=body.status,
        created_at_ms=body.created_at_ms,
    )


def _fold_accepted(fold: Fold, event: Event, body: Accepted) -> None:
    if body.rewarded is not None:
        fold.run.reward_generated_n += body.rewarded
        fold.run.reward_generated_sum += body.reward_sum or 0.0
    for item in body.items:
        # Its trained length: the tokens not posted with loss_mask 0 (0 when all were).
        fold.observe_length(GENERATED, item.tokens - item.masked)
        for totals in (fold.run, fold.version(item.policy_version)):
            totals.rollouts_received += 1
            totals.groups_received += int(item.new_unit)
            totals.tokens_generated += item.tokens
            totals.tokens_masked += item.masked
            totals.rewards_awaiting += int(item.awaiting)
        if item.generator is not None:
            generator = fold.generator(item.generator)
            generator.rollouts += 1
            generator.tokens += item.tokens
            generator.last_seen_ms = _max_ms(generator.last_seen_ms, event.t_ms)


def _max_ms(a: int | None, b: int) -> int:
    return b if a is None else max(a, b)


def _fold_rejected(fold: Fold, body: Rejected) -> None:
    for item in body.items:
        fold.run.rollouts_rejected += 1
        fold.version(item.policy_version).rollouts_rejected += 1
        reason = fold.reason(item.policy_version, REJECTED, item.reason)
        reason.rollouts += 1
        reason.tokens += item.tokens


def _fold_leased(fold: Fold, event: Event, body: Leased) -> None:
    fold.run.batches_leased += 1
    fold.run.trainer_wait_ms += body.wait_ms
    for item in body.items:
        fold.run.rollouts_leased += 1
        fold.version(item.policy_version).rollouts_leased += 1
    lags = [item.lag for item in body.items]
    fold.batch(
        BatchPatch(
            first_event=event.stream_id,
            trainer_id=body.trainer_id,
            policy_version=body.policy_version,
            leased_at_ms=event.t_ms,
            expires_at_ms=body.expires_at_ms,
            size=len(body.items),
            tokens=sum(item.tokens for item in body.items),
            lag_mean=sum(lags) / len(lags) if lags else None,
            lag_max=max(lags) if lags else None,
        ),
        body.batch_id,
    )


def _fold_acked(fold: Fold, event: Event, body: Acked) -> None:
    run = fold.run
    run.batches_acked += 1
    for item in body.items:
        # Acked items carry no lag, and the batch's leased event (which does) may be folded in
        # another transaction: derive it by the rule lease.lua applies to that event's items.
        lag = lag_of(body.policy_version, item.policy_version)
        # Events written before tokens had versions of their own: every token at the sample's.
        lag_tokens = item.tokens * lag if item.lag_tokens is None else item.lag_tokens
        for totals in (run, fold.version(item.policy_version)):
            totals.rollouts_acked += 1
            totals.tokens_consumed += item.tokens
            totals.tokens_masked_stale += item.masked_stale
            totals.lag_token_sum += lag_tokens
            totals.lag_samples += 1
            totals.lag_sum += lag
            totals.lag_max = lag if totals.lag_max is None else max(totals.lag_max, lag)
        key = (item.policy_version, lag)
        fold.lags[key] = fold.lags.get(key, 0) + 1
        fold.observe_length(TRAINED, item.tokens)
        if item.reward is not None:
            run.reward_trained_n += 1
            run.reward_trained_sum += item.reward
        if item.kl is not None:
            # Per version the KL is token-weighted from the per-rollout values; per run the
            # exact per-token sums of the event are used instead (below).
            version = fold.version(item.policy_version)
            version.kl_tokens += item.tokens
            version.kl_sum += item.kl * item.tokens
            version.kl_max = _max(version.kl_max, item.kl)
            run.kl_max = _max(run.kl_max, item.kl)
    run.kl_tokens += body.sums.kl_tokens
    run.kl_sum += body.sums.kl_sum
    run.kl_max = _max(run.kl_max, body.stats.kl_max)
    run.ratio_tokens += body.sums.ratio_tokens
    run.ratio_sum += body.sums.ratio_sum
    run.ratio_clipped += body.sums.clipped
    # The same exact sums per trainer version (the V of the lease), which the per-version
    # totals above cannot give: those are keyed by the version that generated the rollouts.
    training = fold.training(body.policy_version)
    training.batches += 1
    training.samples += len(body.items)
    training.tokens += sum(item.tokens for item in body.items)
    training.kl_tokens += body.sums.kl_tokens
    training.kl_sum += body.sums.kl_sum
    training.kl_max = _max(training.kl_max, body.stats.kl_max)
    training.ratio_tokens += body.sums.ratio_tokens
    training.ratio_sum += body.sums.ratio_sum
    training.ratio_clipped += body.sums.clipped
    # β after this ack (None: the penalty is off), per run and per V: the newest ack's wins.
    tell(run, "kl_coef", event.stream_id, body.kl_coef)
    tell(training, "kl_coef", event.stream_id, body.kl_coef)
    _fold_acked_gens(fold, body)
    fold.batch(
        BatchPatch(
            first_event=event.stream_id,
            outcome="acked",
            acked_at_ms=event.t_ms,
            samples=len(body.items),
            kl_mean=body.stats.kl_mean,
            kl_max=body.stats.kl_max,
            is_ratio_mean=body.stats.is_ratio_mean,
            clip_fraction=body.stats.clip_fraction,
            ess_fraction=body.stats.ess_fraction,
            step=body.step,
        ),
        body.batch_id,
    )


def _fold_acked_gens(fold: Fold, body: Acked) -> None:
    for gen in body.gens:
        generator = fold.generator(gen.generator_id)
        generator.samples_consumed += gen.samples
        generator.kl_tokens += gen.kl_tokens
        generator.kl_sum += gen.kl_sum
        generator.kl_max = _max(generator.kl_max, gen.kl_max)
        generator.ratio_tokens += gen.ratio_tokens
        generator.ratio_sum += gen.ratio_sum
        generator.clipped += gen.clipped
        generator.zero_weight += gen.zero_weight


def _fold_returned(fold: Fold, event: Event, body: Returned) -> None:
    nacked = event.type == "nacked"
    if nacked:
        fold.run.batches_nacked += 1
    else:
        fold.run.batches_expired += 1
    for item in body.items:
        for totals in (fold.run, fold.version(item.policy_version)):
            if nacked:
                totals.rollouts_nacked += 1
            else:
                totals.rollouts_expired += 1
    patch = BatchPatch(first_event=event.stream_id, outcome=event.type)
    if nacked:
        patch.nacked_at_ms = event.t_ms
    else:
        patch.expired_at_ms = event.t_ms
    fold.batch(patch, body.batch_id)


def _fold_retired(fold: Fold, body: Retired) -> None:
    for item in body.items:
        wasted = item.uses == 0
        for totals in (fold.run, fold.version(item.policy_version)):
            totals.rollouts_retired += 1
            if wasted:
                totals.wasted_tokens += item.tokens
            _leave_rewards(totals, item.unscored)
        reason = fold.reason(item.policy_version, RETIRED, body.reason)
        reason.rollouts += 1
        reason.tokens += item.tokens
        if wasted:
            reason.unused += 1
            reason.wasted_tokens += item.tokens


def _leave_rewards(totals: TotalsDelta, unscored: int) -> None:
    """A retired rollout that still awaited its reward leaves where it was."""
    if unscored == UNSCORED_AWAITING:
        totals.rewards_awaiting -= 1
    elif unscored == UNSCORED_LEASED:
        totals.rewards_leased -= 1
    elif unscored != 0:
        raise EventError(f"retired: unknown unscored place {unscored}")


def _fold_reward_moved(fold: Fold, body: RewardLeased | RewardReturned) -> None:
    """Awaiting → reward-leased (``reward_leased``), or back (``reward_returned``)."""
    step = 1 if isinstance(body, RewardLeased) else -1
    for item in body.items:
        for totals in (fold.run, fold.version(item.policy_version)):
            totals.rewards_awaiting -= step
            totals.rewards_leased += step


def _fold_scored(fold: Fold, body: Scored) -> None:
    for item in body.items:
        for totals in (fold.run, fold.version(item.policy_version)):
            totals.rewards_scored += 1
            if item.leased:
                totals.rewards_leased -= 1
            else:
                totals.rewards_awaiting -= 1
        fold.run.reward_wait_ms += item.wait_ms
        fold.observe_reward_latency(item.wait_ms)
        # A reward that came after the rollout: received all the same.
        fold.run.reward_generated_n += 1
        fold.run.reward_generated_sum += item.reward


def _fold_reward_expired(fold: Fold, body: RewardExpired) -> None:
    for item in body.items:
        for totals in (fold.run, fold.version(item.policy_version)):
            totals.rewards_leased -= 1
            totals.rewards_awaiting += 1
            totals.rewards_timed_out += 1


def _fold_rewound(fold: Fold, event: Event, body: Rewound) -> None:
    # A use given back is not taken out of rollouts_acked (samples_consumed): the gradient
    # happened, and the undone batch stays acknowledged in the ledger.
    for item in body.items:
        fold.run.samples_rewound += 1
        fold.version(item.policy_version).samples_rewound += 1
    # Per generator the uses undone come off its samples_consumed (unlike the run's).
    for gen in body.gens:
        fold.generator(gen.generator_id).samples_consumed -= gen.samples
    for batch_id in body.batches:
        # Only its time: the outcome stays what the batch's own events say ("leased" never
        # replaces a terminal one), whichever is folded first.
        fold.batch(BatchPatch(first_event=event.stream_id, rewound_at_ms=event.t_ms), batch_id)


def _fold_registered(fold: Fold, event: Event, body: Registered) -> None:
    for item in body.items:
        if item.passes > MAX_PASSES:
            raise EventError(f"registered: {item.passes} passes, more than {MAX_PASSES}")
        fold.run.prompts_registered += item.passes
        for pass_ in range(1, item.passes + 1):
            fold.prompt_pass(item.prompt_id, pass_, PassState(1, "queued", 0, event.t_ms))


def _fold_work_leased(fold: Fold, event: Event, body: WorkLeased) -> None:
    fold.run.generator_wait_ms += body.wait_ms
    for item in body.items:
        # The item does not say `tries`; 0 never wins over a known count (PassState.merge).
        fold.prompt_pass(
            item.prompt_id, item.pass_, PassState(item.attempt, "in_flight", 0, event.t_ms)
        )


def _fold_passes(fold: Fold, event: Event, body: PassesChanged) -> None:
    for item in body.items:
        state = pass_state(item.state, item.attempt, item.tries, event.t_ms)
        fold.prompt_pass(item.prompt_id, item.pass_, state)


def _fold_prompt_scored(fold: Fold, event: Event, body: PromptScored) -> None:
    # Each item is one group of the prompt: the newest event's mean wins, the groups add up.
    for item in body.items:
        mean = fold.prompt_mean(item.prompt_id)
        tell(mean, "mean", event.stream_id, item.mean)
        mean.groups += 1


def _fold_consumers(fold: Fold, body: ConsumersChanged) -> None:
    for item in body.items:
        consumer = fold.consumer(item.name)
        consumer.delivered += item.delivered
        consumer.acked += item.acked
        consumer.dropped += item.dropped


def _fold_partials(fold: Fold, body: PartialsChanged) -> None:
    run, n = fold.run, len(body.items)
    tokens = sum(item.tokens for item in body.items)
    if body.change == "returned":
        run.partials_returned += n
    elif body.change == "resumed":
        run.partials_resumed += n
        run.partial_tokens_resumed += tokens
    elif body.change == "dropped":
        run.partials_dropped += n
        run.partial_tokens_dropped += tokens
    else:
        raise EventError(f"partials: unknown change {body.change!r}")


def _fold_waited(fold: Fold, body: Waited) -> None:
    column = _WAIT_COLUMNS.get(body.role)
    if column is None:
        raise EventError(f"waited: unknown role {body.role!r}")
    setattr(fold.run, column, getattr(fold.run, column) + body.wait_ms)
