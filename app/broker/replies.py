"""The reply protocol of the Lua scripts, and the one table that turns their refusals into
the broker's errors.

Every script answers ``{'ok', ...}`` or ``{'err', code, arg...}`` (``ok()`` and ``err()`` in
lua/lib/replies.lua). :func:`decode` is the only reader of that envelope: it returns the body of an
``ok`` and raises :class:`StoreError` for an ``err``. :data:`REFUSALS` maps every code to its
error class and message; :func:`error_for` applies it, and turns a code missing from the table
into a logged :class:`~app.errors.InternalError` (500) naming the code, never a 4xx.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

import msgpack

from app.errors import (
    BatchNotFound,
    BatchSettled,
    BrokerError,
    ConsumerConflict,
    ConsumerNotFound,
    GeneratorQuarantined,
    InternalError,
    LeaseExpired,
    OverCapacity,
    RewardConflict,
    RewardLeaseNotFound,
    RewardLeaseOver,
    RunBusy,
    RunClosed,
    RunConflict,
    RunNotFound,
    RunOpen,
    ValidationFailed,
    VersionConflict,
    WorkLeaseNotFound,
    WorkLeaseOver,
)

__all__ = [
    "REFUSALS",
    "AckAnswer",
    "ErrorContext",
    "Refusal",
    "ReplyError",
    "StoreError",
    "ack_answer",
    "decode",
    "error_for",
    "text",
]

log = logging.getLogger(__name__)

OK = b"ok"
ERR = b"err"


class StoreError(Exception):
    """A script refused the call: ``code`` says why, ``args_`` are the script's details."""

    def __init__(self, code: str, *args: str) -> None:
        super().__init__(code, *args)
        self.code = code
        self.args_ = args


class ReplyError(RuntimeError):
    """A script answered outside the protocol: a bug, rendered as a 500."""


def text(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def decode(script: str, reply: Any) -> list[Any]:
    """The body of a script's ``{'ok', ...}`` reply (everything after 'ok'); raises
    StoreError for ``{'err', code, ...}``."""
    if isinstance(reply, list) and reply:
        if reply[0] == OK:
            return reply[1:]
        if reply[0] == ERR and len(reply) >= 2:
            raise StoreError(text(reply[1]), *[text(a) for a in reply[2:]])
    raise ReplyError(f"script {script} answered outside the protocol: {reply!r:.200}")


@dataclass(frozen=True, slots=True)
class AckAnswer:
    """What an ack answered, stored with the batch so that a repeated ack gets it again."""

    retired: int
    flushed: int
    stats_json: str  # the BatchStats as the first ack rendered them
    kl_coef: float | None = None  # the adaptive KL penalty's β after the ack; None when off


def ack_answer(raw: bytes) -> AckAnswer:
    """Read a stored answer: a msgpack map {retired, flushed, stats, kl_coef} written by
    ack.lua (kl_coef: absent in answers stored before it)."""
    try:
        stored = msgpack.unpackb(raw, raw=False)
    except ValueError:
        # Written before answers were msgpack: "retired,flushed,stats_json" (kept 24 h).
        retired, flushed, stats = raw.decode().split(",", 2)
        return AckAnswer(int(retired), int(flushed), stats)
    beta = beta_of(stored.get("kl_coef", ""))
    return AckAnswer(int(stored["retired"]), int(stored["flushed"]), str(stored["stats"]), beta)


def beta_of(raw: Any) -> float | None:
    """The adaptive KL penalty's β as the scripts reply it (lib/run.lua beta_text): '' when
    off, else a float's 17 digits, which parse back to the same double."""
    t = text(raw)
    return float(t) if t else None


# -- the error table -------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ErrorContext:
    """What a refusal's message may name besides the script's own args."""

    run_id: str
    batch_id: str | None = None
    size: int | None = None  # the batch size asked for
    version: int | None = None  # the policy version asked for
    retry_after_s: int = 1  # the Retry-After of OverCapacity
    lease_id: str | None = None  # the work lease


@dataclass(frozen=True, slots=True)
class Refusal:
    error: type[BrokerError]
    # str.format template: {0}, {1}... are the script's args, {run_id} etc. the context's.
    detail: str


REFUSALS: dict[str, Refusal] = {
    # arg: the consumer's name
    "consumer_missing": Refusal(ConsumerNotFound, "no consumer {0!r} in run {run_id!r}"),
    "consumer_exists": Refusal(
        ConsumerConflict, "consumer {0!r} exists in run {run_id!r} with a different config"
    ),
    # arg: what is wrong with the config
    "consumer_invalid": Refusal(ValidationFailed, "consumer config refused: {0}"),
    "run_missing": Refusal(RunNotFound, "no run {run_id!r}"),
    "run_conflict": Refusal(RunConflict, "run {run_id!r} exists with a different config"),
    "run_deleted": Refusal(
        RunConflict, "run {run_id!r} was deleted; its id stays with its accounting"
    ),
    "run_open": Refusal(RunOpen, "run {run_id!r} is open; close it before deleting it"),
    # The store wakes a parked run and calls again (RedisStore._call); this is only raised
    # when the run was parked again at every try. arg: the run's park token
    "run_parked": Refusal(RunBusy, "run {run_id!r} kept going out of service; retry later"),
    # arg: what the run waits for, in words
    "run_busy": Refusal(RunBusy, "run {run_id!r} cannot be deleted yet: {0}; retry later"),
    # arg: the run's current version
    "version_backwards": Refusal(
        VersionConflict,
        "policy version {version} is below the run's current version {0}; a trainer resuming "
        "from a checkpoint of it moves the run back with rewind: true",
    ),
    "version_future": Refusal(
        ValidationFailed, "policy_version {version} is above the run's current version {0}"
    ),
    # arg: the rollout id
    "group_missing": Refusal(
        ValidationFailed, "rollout {0!r} has no group_id, and this run's group_size is above 1"
    ),
    # args: group id, rollouts it would have, group_size
    "group_overflow": Refusal(
        ValidationFailed, "group {0!r} would have {1} rollouts, more than its group_size {2}"
    ),
    # arg: the group id
    "group_done": Refusal(
        ValidationFailed,
        "group {0!r} was already complete and handed out or retired; it takes no more rollouts",
    ),
    # args: live rollouts, capacity_rollouts
    "over_capacity": Refusal(
        OverCapacity, "run {run_id!r} holds {0} rollouts, its capacity is {1}; retry later"
    ),
    # arg: the run's group_size
    "batch_size": Refusal(
        ValidationFailed, "size {size} is not a multiple of this run's group_size {0}"
    ),
    "batch_missing": Refusal(BatchNotFound, "no batch {batch_id!r} in run {run_id!r}"),
    # arg: the batch's state, 'leased' (its lease ran out), 'acked', 'nacked' or 'expired'
    "batch_id_taken": Refusal(
        BatchSettled, "batch {batch_id!r} was already {0}; choose a new batch_id"
    ),
    "batch_nacked": Refusal(BatchSettled, "batch {batch_id!r} was nacked; it cannot be acked"),
    "batch_acked": Refusal(BatchSettled, "batch {batch_id!r} was acked; it cannot be nacked"),
    # arg: the batch's state, 'acked' or 'nacked'
    "batch_settled": Refusal(
        BatchSettled, "batch {batch_id!r} was already {0}; it can no longer be measured"
    ),
    "lease_expired": Refusal(
        LeaseExpired, "the lease of batch {batch_id!r} expired; its rollouts went back"
    ),
    "run_closed": Refusal(RunClosed, "run {run_id!r} is closed"),
    "generator_quarantined": Refusal(
        GeneratorQuarantined,
        "generator {0!r} is quarantined in run {run_id!r}: its mean KL passed generator_kl_max; "
        "an operator lifts it with POST /v1/runs/{run_id}/generators/{0}/release",
    ),
    # arg: the batch's version
    "lease_rewound": Refusal(
        LeaseExpired,
        "the lease of batch {batch_id!r} ended when the run was rewound below its version {0}; "
        "its rollouts went back",
    ),
    "work_missing": Refusal(WorkLeaseNotFound, "no work lease {lease_id!r} in run {run_id!r}"),
    # arg: the lease's state, 'returned' or 'expired'
    "work_lease_over": Refusal(
        WorkLeaseOver,
        "work lease {lease_id!r} was {0}: its prompts went back; choose a new lease_id",
    ),
    # arg: the prompt id
    "work_not_in_lease": Refusal(
        ValidationFailed, "prompt {0!r} is not in work lease {lease_id!r}; nothing was returned"
    ),
    # args: the partial's rollout id, then its group id / its prompt id / its version
    "partial_not_in_lease": Refusal(
        ValidationFailed,
        "partial {0!r} names group {1!r}, not a prompt attempt of work lease {lease_id!r} "
        "(partial_not_in_lease); nothing was returned",
    ),
    "partial_not_returned": Refusal(
        ValidationFailed,
        "partial {0!r} is of prompt {1!r}, which this call does not return "
        "(partial_not_returned); nothing was returned",
    ),
    "partial_posted": Refusal(
        ValidationFailed,
        "partial {0!r} names a rollout received already (partial_posted); nothing was returned",
    ),
    "partial_future_version": Refusal(
        ValidationFailed,
        "partial {0!r} has policy_version {1}, above the run's (partial_future_version); "
        "nothing was returned",
    ),
    # args: prompt id, partials it would keep, group_size
    "too_many_partials": Refusal(
        ValidationFailed,
        "prompt {0!r} would keep {1} partials, more than its group_size {2} "
        "(too_many_partials); nothing was returned",
    ),
    "reward_lease_missing": Refusal(
        RewardLeaseNotFound, "no reward lease {lease_id!r} in run {run_id!r}"
    ),
    # The lease named in a body (the path names a run that exists): the body is wrong.
    "reward_lease_unknown": Refusal(
        ValidationFailed, "no reward lease {lease_id!r} in run {run_id!r}; nothing was scored"
    ),
    # arg: the lease's state, 'scored', 'returned' or 'expired'
    "reward_lease_over": Refusal(
        RewardLeaseOver, "reward lease {lease_id!r} was {0}; choose a new lease_id"
    ),
    # arg: the rollout id
    "reward_unknown": Refusal(
        ValidationFailed, "rollout {0!r} was never received in run {run_id!r}; nothing was scored"
    ),
    "reward_not_in_lease": Refusal(
        ValidationFailed,
        "rollout {0!r} is not in reward lease {lease_id!r}; nothing was scored",
    ),
    # args: the rollout id, its reward
    # Raised by the store, not a script. args: the rollout id, its reward
    "reward_conflict": Refusal(
        RewardConflict,
        "rollout {0!r} has the reward {1} already; a reward is not changed; nothing was scored",
    ),
    # Raised by the store, not a script: a reward lease's rollout retired before it was read.
    "reward_lease_lost": Refusal(
        RewardLeaseOver,
        "reward lease {lease_id!r} of run {run_id!r} lost rollouts before they could be "
        "delivered; lease again with a new lease_id",
    ),
    # Raised by the store, not a script: the rollouts kept changing while they were scored.
    "reward_raced": Refusal(
        RunBusy,
        "rollouts of run {run_id!r} kept changing while they were scored; nothing was scored; "
        "retry",
    ),
    # Raised by the store, not a script: a handed-out prompt has no stored data. arg: its id
    "work_lost": Refusal(InternalError, "prompt {0!r} of run {run_id!r} has no stored data"),
    # Raised by the store, not a script: the leased rollouts retired before they were read.
    "lease_lost": Refusal(
        LeaseExpired,
        "the lease of batch {batch_id!r} ran out before it could be delivered; "
        "lease again with a new batch_id",
    ),
}


def error_for(err: StoreError, ctx: ErrorContext) -> BrokerError:
    """The broker error of a refusal, by :data:`REFUSALS`."""
    refusal = REFUSALS.get(err.code)
    if refusal is None:
        log.error("unknown store error code %r, args %r, run %r", err.code, err.args_, ctx.run_id)
        return InternalError(f"internal error: unknown store error code {err.code!r}")
    detail = refusal.detail.format(*err.args_, **asdict(ctx))
    if issubclass(refusal.error, OverCapacity | RunBusy):
        return refusal.error(detail, retry_after_s=ctx.retry_after_s)
    return refusal.error(detail)
