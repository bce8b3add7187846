"""The asyncio client: :class:`AsyncBrokerClient`; for generators its :class:`AsyncRolloutWriter`
and the :class:`AsyncWorkLoop` of :class:`AsyncWork` leases, for trainers :class:`AsyncLease`.
Same surface as the blocking client, every call awaited."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Generic, Literal, Protocol, Self, TypeVar, Unpack

import httpx
import numpy.typing as npt

from rollout_broker_client._errors import (
    BrokerError,
    BrokerHTTPError,
    BrokerUnreachable,
    NotFound,
    OverCapacity,
    ServerError,
    Unavailable,
)
from rollout_broker_client._models import (
    AccessToken,
    Accounting,
    AckResult,
    AuditEntry,
    AuditPage,
    Batch,
    ConsumerBatch,
    ConsumerInfo,
    ConsumerKind,
    ConsumerSource,
    GeneratorAccounting,
    IngestResult,
    LogprobsArg,
    Measurement,
    MeasureStats,
    NewToken,
    PairRule,
    Partial,
    PolicyResult,
    PolicyVersion,
    PoolName,
    PromptState,
    PromptStateName,
    RegisterResult,
    Rejection,
    RewardLease,
    RewardRollout,
    Rollout,
    Run,
    RunConfig,
    Scope,
    ScoreResult,
    TrainingVersion,
    VersionAccounting,
    WorkLease,
    WorkPrompt,
)
from rollout_broker_client._wire import (
    Api,
    BearerToken,
    Call,
    Format,
    PartialLike,
    PromptLike,
    Retry,
    RolloutLike,
    answer_text,
    check,
    parse_audit_entry,
    parse_prompt_state,
    rejections_text,
    unreachable,
)
from rollout_broker_client.protocol import base_url_of

__all__ = [
    "DEFAULT_URL",
    "AsyncBrokerClient",
    "AsyncConsumer",
    "AsyncConsumerLease",
    "AsyncConsumerLoop",
    "AsyncLease",
    "AsyncRewardLoop",
    "AsyncRewardWork",
    "AsyncRolloutWriter",
    "AsyncWork",
    "AsyncWorkLoop",
]

log = logging.getLogger("rollout_broker.client")
T = TypeVar("T")
E = TypeVar("E", bound=BrokerError)

DEFAULT_URL = "http://127.0.0.1:8000"
_MEASURED_KEPT = 256  # batches a client remembers having measured, for the warning of its ack


class AsyncBrokerClient:
    """An asyncio client of one broker.

    ``AsyncBrokerClient("http://broker:8000")`` talks over the network. It also takes any
    ``httpx.AsyncClient`` as ``http`` (its base URL is used when ``base_url`` is not given), so it
    can reach an app in this process through ``httpx.ASGITransport``, which runs no lifespan::

        app = create_app(settings)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as http:
                broker = AsyncBrokerClient(http=http)

    ``format="msgpack"`` (the default) sends rollouts and acks as msgpack with token ids and
    logprobs as little-endian int32/float32 bytes, and asks for batches the same way;
    ``format="json"`` uses plain JSON lists throughout. ``trainer_id`` and ``generator_id`` are
    sent with every batch lease and work lease that does not name its own.

    ``token`` is sent as ``Authorization: Bearer <token>`` with every request; when it is not
    given, the ``BROKER_TOKEN`` environment variable is (``token=""`` sends none). It never
    shows in the client's repr, in its exceptions or in its log lines. A broker with auth on
    answers a missing, unknown or revoked token with :class:`Unauthorized` (401) and a token
    that lacks the scope or the run with :class:`Forbidden` (403); neither is sent again.
    """

    def __init__(
        self,
        base_url: str | None = None,
        *,
        http: httpx.AsyncClient | None = None,
        timeout: float = 10.0,
        retry: Retry | None = None,
        format: Format = "msgpack",
        trainer_id: str | None = None,
        generator_id: str | None = None,
        token: str | None = None,
    ) -> None:
        self._token = BearerToken.resolve(token)  # checked before anything is opened
        inherited = str(http.base_url) if http is not None else ""
        self.base_url = base_url_of(base_url or inherited or DEFAULT_URL)  # before opening too
        self._owns_http = http is None
        self._http = http if http is not None else httpx.AsyncClient()
        self.timeout = timeout
        self.retry = retry or Retry()
        self.api = Api(format, trainer_id, generator_id)
        # The work and reward leases of work() and reward_work() and the consumer batches of
        # batches() not yet settled, given back when the client closes, and those whose loop
        # was left without settling them, given back before the next request.
        self._works: set[_Open] = set()
        self._abandoned: list[_Open] = []
        # Whether the broker has ever answered: until it has, Retry.first_contact_s applies.
        self._contacted = False
        # Batches measured lately, whose ack may carry no logprobs; the warning of an ack
        # that carries nothing to measure with, given once.
        self._measured: dict[str, None] = {}
        self._warned_bare_ack = False

    async def __aenter__(self) -> AsyncBrokerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        token = "None" if self._token is None else "'***'"
        return f"{type(self).__name__}({self.base_url!r}, token={token})"

    async def close(self) -> None:
        """Give back the unposted prompts of the work leases still open and the unscored
        rollouts of the reward leases, then close the connection pool (not one passed in as
        ``http``)."""
        self._abandoned.clear()
        for work in list(self._works):
            await work.settle(failing=True)
        if self._owns_http:
            await self._http.aclose()

    async def send(self, call: Call[T]) -> T:
        """Send one request, retrying as :class:`Retry` allows; returns the parsed answer.
        Each resend is logged at WARNING, with the URL, the error and the pause. When the
        retries run out, raises the last error: :class:`BrokerUnreachable` without an answer,
        else the exception of the broker's answer (:class:`Unavailable`...)."""
        if self._abandoned:
            await self._give_back_abandoned()
        headers = call.headers if self._token is None else {**call.headers, **self._token.header()}
        url = self.base_url + call.path
        attempt = 0
        started = time.monotonic()
        while True:
            try:
                resp = await self._http.request(
                    call.method,
                    url,
                    params=call.params,
                    content=call.content,
                    headers=headers,
                    timeout=self.timeout + call.extra_timeout,
                )
            except httpx.TransportError as exc:
                elapsed = time.monotonic() - started
                pause = self.retry.pause(call, attempt, elapsed, error=exc)
                contacted = self._contacted
                # A wrong URL, or a broker not started: said soon, not after deadline_s.
                over = pause is not None and self.retry.first_contact_over(exc, elapsed, pause)
                if over and not contacted:
                    pause = None
                if pause is None:
                    err = unreachable(
                        call, self.base_url, exc, attempt + 1, elapsed, contacted=contacted
                    )
                    raise self._scrubbed(err) from exc
                why = f"{type(exc).__name__}: {exc or 'no answer'}"
            else:
                self._contacted = True
                pause = self.retry.pause(call, attempt, time.monotonic() - started, response=resp)
                if pause is None:
                    try:
                        return call.read(resp, check(resp))
                    except BrokerError as err:
                        raise self._scrubbed(err) from None
                why = answer_text(resp)
            if self._token is not None:
                why = self._token.scrub(why)
            log.warning(
                "%s %s: %s; resending in %.2f s (attempt %d)",
                call.method,
                url,
                why,
                pause,
                attempt + 2,
            )
            await asyncio.sleep(pause)
            attempt += 1

    def _scrubbed(self, err: E) -> E:
        """``err`` with the token masked in its text."""
        if self._token is not None:
            self._token.scrub_error(err)
        return err

    async def _give_back_abandoned(self) -> None:
        works, self._abandoned = self._abandoned, []
        for work in works:
            await work.settle(failing=True)

    # -- health ---------------------------------------------------------------------------
    async def healthz(self) -> bool:
        """True when the API process answers."""
        try:
            await self.send(self.api.healthz())
        except BrokerError:
            return False
        return True

    async def ready(self) -> bool:
        """True when the broker is ready (``GET /readyz``): its Redis and Postgres reachable and
        migrated, and a background worker draining the accounting."""
        try:
            await self.send(self.api.readyz())
        except (Unavailable, BrokerUnreachable):
            return False
        return True

    # -- runs -----------------------------------------------------------------------------
    async def create_run(
        self, run_id: str | None = None, config: RunConfig | Mapping[str, Any] | None = None
    ) -> Run:
        """Create a run (or get it back, if it exists with the same config)."""
        return await self.send(self.api.create_run(run_id, config))

    async def list_runs(self, status: Literal["open", "closed"] | None = None) -> list[Run]:
        """Every run (or every open or closed one), newest first, read a page at a time."""
        runs, cursor = await self.send(self.api.list_runs(status))
        while cursor is not None:
            page, cursor = await self.send(self.api.list_runs(status, cursor=cursor))
            runs += page
        return runs

    async def get_run(self, run_id: str) -> Run:
        return await self.send(self.api.get_run(run_id))

    async def patch_config(self, run_id: str, **changes: Unpack[RunConfig]) -> Run:
        """Change some of a run's rules; they apply at once."""
        return await self.send(self.api.patch_config(run_id, changes))

    async def close_run(self, run_id: str) -> Run:
        return await self.send(self.api.close_run(run_id))

    async def delete_run(self, run_id: str) -> None:
        """Delete a closed run's live state; its accounting stays. ``Conflict`` (409) while the
        run is open or has not settled (its leases still out, its events not yet applied)."""
        await self.send(self.api.delete_run(run_id))

    async def release_generator(self, run_id: str, generator_id: str) -> bool:
        """Lift a generator's quarantine (``generator_kl_max``): it may post and take work
        again. False when it was not quarantined (scope ``operate``)."""
        return await self.send(self.api.release_generator(run_id, generator_id))

    async def set_policy(
        self, run_id: str, version: int, *, weights: str | None = None, rewind: bool = False
    ) -> PolicyResult:
        """Announce policy ``version``, with where its ``weights`` are (a path or URI kept with
        the version for :meth:`follow_policy`); rollouts now too stale retire (``evicted``).
        ``rewind`` moves the run back to an earlier version (SPEC "Policy versions")."""
        return await self.send(self.api.set_policy(run_id, version, weights, rewind))

    async def policy(
        self, run_id: str, *, after: int | None = None, wait_s: float = 0.0
    ) -> PolicyVersion | None:
        """The run's policy version, its weights and when it was set. With ``after``, waits up
        to ``wait_s`` for a version other than ``after`` (a new one, or a lower one once the
        run was rewound past it); None if it is still ``after`` then."""
        return await self.send(self.api.policy(run_id, after, wait_s))

    async def follow_policy(
        self, run_id: str, *, after: int | None = None, wait_s: float = 30.0
    ) -> AsyncIterator[PolicyVersion]:
        """Every new policy version of the run as it is set, for generators that load each
        one's weights: ``async for v in client.follow_policy(run_id, after=loaded)``. Without
        ``after``, the current version comes first. Each wait is a long poll of ``wait_s``,
        asked again when it passes; the requests are retried through outages as any other
        (:class:`Retry`). A version below the last one means the run was rewound."""
        while True:
            got = await self.policy(run_id, after=after, wait_s=wait_s)
            if got is not None:
                after = got.policy_version
                yield got

    # -- generators -----------------------------------------------------------------------
    async def post_rollouts(self, run_id: str, rollouts: Sequence[RolloutLike]) -> IngestResult:
        """One ingest request. Raises :class:`OverCapacity` when the run is full; the
        :meth:`writer` waits instead. Every rollout is checked before anything is sent (token
        ids, logprobs finite and ≤ 0, one per response token, a finite reward or None): a
        ValueError or TypeError names the rollout and the field. Rollouts the broker rejects one
        by one (``stale``, ``future_version``...) are in the answer's ``rejected`` and logged at
        WARNING, one line for the request."""
        result = await self.send(self.api.post_rollouts(run_id, rollouts))
        _log_rejected(run_id, len(rollouts), result)
        return result

    def writer(
        self,
        run_id: str,
        *,
        batch_size: int = 256,
        linger_s: float | None = None,
        max_backpressure_s: float | None = 600.0,
    ) -> AsyncRolloutWriter:
        """A writer that batches rollouts into requests; see :class:`AsyncRolloutWriter`."""
        return AsyncRolloutWriter(
            self,
            run_id,
            batch_size=batch_size,
            linger_s=linger_s,
            max_backpressure_s=max_backpressure_s,
        )

    # -- prompts and work leases ----------------------------------------------------------
    async def register_prompts(
        self,
        run_id: str,
        prompts: Iterable[PromptLike],
        epochs: int = 1,
        *,
        batch_size: int = 1000,
    ) -> RegisterResult:
        """Queue prompts for the run's generators, each for ``epochs`` passes (one pass after
        another). A prompt is a :class:`Prompt`, a mapping of its fields, or a bare
        ``prompt_id``. ``prompt_id`` is the idempotency key: a prompt registered before counts
        as a duplicate and changes nothing, so registering a data set again is safe. Sent
        ``batch_size`` prompt passes (prompts × epochs) a request, and at least one prompt."""
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        accepted = duplicates = 0
        todo = iter(prompts)
        per_request = max(1, batch_size // max(epochs, 1))
        while chunk := list(itertools.islice(todo, per_request)):
            result = await self.send(self.api.register_prompts(run_id, chunk, epochs))
            accepted += result.accepted
            duplicates += result.duplicates
        return RegisterResult(accepted, duplicates)

    async def work_lease(
        self,
        run_id: str,
        max_prompts: int,
        *,
        generator_id: str | None = None,
        wait_s: float = 0.0,
        lease_id: str | None = None,
    ) -> WorkLease | None:
        """Lease up to ``max_prompts`` prompts to generate for, waiting up to ``wait_s`` for
        prompts or staleness budget; None if none came. The request names its lease
        (``lease_id``, or a new id), so a resend after a lost answer gets the same lease.
        Post each prompt's group with its ``group_id`` or give the prompt back with
        :meth:`return_work`; :meth:`work` does both for you."""
        return await self.send(
            self.api.work(
                run_id,
                max_prompts,
                generator_id=generator_id,
                wait_s=wait_s,
                lease_id=lease_id,
            )
        )

    async def return_work(
        self,
        run_id: str,
        lease_id: str,
        prompt_ids: Sequence[str] | None = None,
        partials: Sequence[PartialLike] = (),
    ) -> int:
        """Give prompts of a work lease back (all of them when ``prompt_ids`` is None); returns
        how many went back. A partial group of theirs retires. ``partials`` are what was sampled
        so far of their responses, each under its prompt's ``group_id``: the lease that next
        hands a prompt out carries its partials (:attr:`WorkPrompt.partials`) to continue."""
        if prompt_ids is not None and not prompt_ids:
            return 0  # an empty list on the wire would mean all of them
        return await self.send(self.api.return_work(run_id, lease_id, prompt_ids, partials))

    def work(
        self,
        run_id: str,
        *,
        max_prompts: int = 8,
        generator_id: str | None = None,
        wait_s: float = 30.0,
        stop_when_empty: bool = False,
        max_backpressure_s: float | None = 600.0,
    ) -> AsyncWorkLoop:
        """The generator loop: work leases one after another; see :class:`AsyncWorkLoop`."""
        return AsyncWorkLoop(
            self,
            run_id,
            max_prompts=max_prompts,
            generator_id=generator_id,
            wait_s=wait_s,
            stop_when_empty=stop_when_empty,
            max_backpressure_s=max_backpressure_s,
        )

    async def prompt_states(
        self,
        run_id: str,
        state: PromptStateName | None = None,
        *,
        page_size: int = 1000,
        pool: PoolName | None = None,
    ) -> AsyncIterator[PromptState]:
        """Every prompt pass of a run in its newest state (or those in ``state``, of prompts in
        difficulty ``pool``), in (prompt_id, pass) order, fetched a page at a time. Read from
        the accounting, which may trail the live state by a second or two."""
        cursor: str | None = None
        while True:
            call = self.api.prompts_page(run_id, state, cursor, page_size, pool)
            docs, cursor = await self.send(call)
            for doc in docs:
                yield parse_prompt_state(doc)
            if not cursor:
                return

    # -- reward workers -------------------------------------------------------------------
    async def reward_lease(
        self,
        run_id: str,
        max_rollouts: int,
        *,
        worker_id: str | None = None,
        wait_s: float = 0.0,
        lease_id: str | None = None,
    ) -> RewardLease | None:
        """Lease up to ``max_rollouts`` rollouts posted without a reward, waiting up to
        ``wait_s`` for some; None if none came. The request names its lease (``lease_id``, or
        a new id), so a resend after a lost answer gets the same lease. Score them with
        :meth:`score` or give them back with :meth:`return_rewards`; :meth:`reward_work` does
        both for you."""
        return await self.send(
            self.api.reward_lease(
                run_id, max_rollouts, worker_id=worker_id, wait_s=wait_s, lease_id=lease_id
            )
        )

    async def score(
        self, run_id: str, rewards: Mapping[str, float], *, lease_id: str | None = None
    ) -> ScoreResult:
        """Send rewards by rollout_id (finite numbers, checked before sending), under a reward
        lease or without one. The same reward again counts as a duplicate, so a resend is
        safe; another reward for a rollout already scored raises :class:`RewardConflict`."""
        if not rewards:
            return ScoreResult(0, 0, [])
        return await self.send(self.api.score(run_id, rewards, lease_id))

    async def return_rewards(
        self, run_id: str, lease_id: str, rollout_ids: Sequence[str] | None = None
    ) -> int:
        """Give unscored rollouts of a reward lease back (all it still holds when
        ``rollout_ids`` is None) for any reward worker to lease at once, without counting an
        attempt; returns how many went back."""
        if rollout_ids is not None and not rollout_ids:
            return 0  # an empty list on the wire would mean all of them
        return await self.send(self.api.return_rewards(run_id, lease_id, rollout_ids))

    def reward_work(
        self,
        run_id: str,
        *,
        max_rollouts: int = 8,
        worker_id: str | None = None,
        wait_s: float = 30.0,
        stop_when_empty: bool = False,
    ) -> AsyncRewardLoop:
        """The reward worker loop: reward leases one after another; see
        :class:`AsyncRewardLoop`."""
        return AsyncRewardLoop(
            self,
            run_id,
            max_rollouts=max_rollouts,
            worker_id=worker_id,
            wait_s=wait_s,
            stop_when_empty=stop_when_empty,
        )

    # -- trainers -------------------------------------------------------------------------
    async def lease_batch(
        self,
        run_id: str,
        size: int,
        *,
        policy_version: int | None = None,
        wait_s: float = 0.0,
        partial: bool = False,
        trainer_id: str | None = None,
    ) -> Batch | None:
        """Lease a batch of ``size`` rollouts, waiting up to ``wait_s``; None if none qualified.
        You must :meth:`ack` or :meth:`nack` it; :meth:`lease` does that for you."""
        return await self.send(
            self.api.lease(
                run_id,
                size,
                policy_version=policy_version,
                wait_s=wait_s,
                partial=partial,
                trainer_id=trainer_id,
            )
        )

    def lease(
        self,
        run_id: str,
        size: int,
        *,
        policy_version: int | None = None,
        wait_s: float = 0.0,
        partial: bool = False,
        trainer_id: str | None = None,
    ) -> AsyncLease:
        """A lease as an async context manager, whose batch is empty when none qualified
        within ``wait_s``; see :class:`AsyncLease`."""
        return AsyncLease(
            self,
            run_id,
            size,
            policy_version=policy_version,
            wait_s=wait_s,
            partial=partial,
            trainer_id=trainer_id,
        )

    async def ack(
        self,
        run_id: str,
        batch_id: str,
        *,
        logprobs: Mapping[str, npt.ArrayLike] | None = None,
        kl: Mapping[str, float] | None = None,
        step: int | None = None,
    ) -> AckResult:
        """Acknowledge a batch: every rollout gains a use. ``logprobs`` are the current
        policy's on the same tokens, by rollout_id; a repeated ack returns the same answer.

        An ack with neither ``logprobs`` nor ``kl``, of a batch this client has not measured,
        leaves the broker nothing to measure KL or importance ratios with: the answer's
        statistics are None and the KL rules (``kl_max``, ``kl_flush``) never act. The first
        such ack of a client logs a WARNING saying so."""
        if not (logprobs or kl or self._warned_bare_ack or batch_id in self._measured):
            self._warned_bare_ack = True
            log.warning(
                "the ack of batch %s of run %s carries no logprobs (nor KL values), so the "
                "broker can measure neither KL nor importance ratios: kl_mean and the other "
                "statistics stay empty and kl_max and kl_flush never act. Give the current "
                "policy's logprobs on the batch's tokens with batch.ack_with(logprobs) inside "
                "the lease's block or ack(..., logprobs=...), or measure the batch before the "
                "update. Logged once per client.",
                batch_id,
                run_id,
            )
        return await self.send(self.api.ack(run_id, batch_id, logprobs=logprobs, kl=kl, step=step))

    async def measure(
        self,
        run_id: str,
        batch_id: str,
        logprobs: Mapping[str, npt.ArrayLike],
        *,
        order: Sequence[str] | None = None,
    ) -> Measurement:
        """Measure a leased batch before the update: ``logprobs`` are the trainer's on every
        rollout's tokens, by rollout_id, from its forward pass before the update. The answer
        has the correction's weights (in ``order``, the batch's rollout ids, if given); the
        broker keeps the logprobs, so the batch's ack may then carry none."""
        result = await self.send(self.api.measure(run_id, batch_id, logprobs, order))
        self._measured[batch_id] = None
        if len(self._measured) > _MEASURED_KEPT:
            del self._measured[next(iter(self._measured))]
        return result

    async def nack(self, run_id: str, batch_id: str) -> int:
        """Give a batch back unused; returns how many rollouts went back."""
        return await self.send(self.api.nack(run_id, batch_id))

    # -- consumers ------------------------------------------------------------------------
    async def create_consumer(
        self,
        run_id: str,
        name: str,
        *,
        source: ConsumerSource,
        kind: ConsumerKind = "rollouts",
        max_lag: int | None = None,
        min_margin: float | None = None,
        pairs: PairRule | None = None,
        retention_rollouts: int | None = None,
    ) -> ConsumerInfo:
        """Create a consumer of the run's scored rollouts (scope ``operate``), from now on:
        ``source="received"`` sees every one (those more than ``max_lag`` versions behind when
        handed out are dropped), ``"trained"`` those that reached a gradient. Kind
        ``preferences`` gets pairs of a complete group whose rewards differ by ``min_margin``
        or more, one per group (``pairs="best_worst"``) or every such pair (``"all"``). The
        same name and config again answers the consumer as it is; another config is
        :class:`ConsumerConflict`."""
        return await self.send(
            self.api.create_consumer(
                run_id,
                name,
                source=source,
                kind=kind,
                max_lag=max_lag,
                min_margin=min_margin,
                pairs=pairs,
                retention_rollouts=retention_rollouts,
            )
        )

    async def get_consumer(self, run_id: str, name: str) -> ConsumerInfo:
        """A consumer's config and counts; :class:`ConsumerNotFound` if it has none such."""
        return await self.send(self.api.get_consumer(run_id, name))

    async def delete_consumer(self, run_id: str, name: str) -> None:
        """Delete a consumer: its pending and leased items are counted dropped."""
        await self.send(self.api.delete_consumer(run_id, name))

    def consumer(self, run_id: str, name: str) -> AsyncConsumer:
        """The consumer ``name`` of the run, to lease its batches; see :class:`AsyncConsumer`.
        Sends nothing: create it first with :meth:`create_consumer`."""
        return AsyncConsumer(self, run_id, name)

    # -- operators ------------------------------------------------------------------------
    async def accounting(self, run_id: str) -> Accounting:
        return await self.send(self.api.accounting(run_id))

    async def wait_for_accounting(
        self, run_id: str, *, timeout_s: float = 30.0, poll_s: float = 0.1
    ) -> Accounting:
        """The accounting once it has caught up with every change made so far
        (``pending_events == 0``). Raises TimeoutError if it has not within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            acc = await self.accounting(run_id)
            if not acc.pending_events:
                return acc
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"accounting of {run_id!r} still {acc.pending_events} events behind "
                    f"after {timeout_s} s"
                )
            await asyncio.sleep(poll_s)

    async def accounting_versions(self, run_id: str) -> list[VersionAccounting]:
        return await self.send(self.api.accounting_versions(run_id))

    async def accounting_training(self, run_id: str) -> list[TrainingVersion]:
        """Per policy version of the trainer: the acknowledged batches grouped by the version V
        of their lease, with their KL, importance ratio and clip fraction."""
        return await self.send(self.api.accounting_training(run_id))

    async def accounting_generators(self, run_id: str) -> list[GeneratorAccounting]:
        """Per generator of the run's rollouts: what it generated, the uses of its rollouts,
        the KL, importance ratio, clip and masked fractions measured on them, and whether it is
        quarantined."""
        return await self.send(self.api.accounting_generators(run_id))

    async def batches(self, run_id: str) -> list[dict[str, Any]]:
        """The batch ledger of a run, every page."""
        out: list[dict[str, Any]] = []
        cursor: str | None = None
        while True:
            page = await self.send(self.api.batches_page(run_id, cursor))
            out.extend(page.get("batches", []))
            cursor = page.get("next_cursor")
            if not cursor:
                return out

    async def audit(
        self, run_id: str | None = None, *, limit: int = 100, cursor: str | None = None
    ) -> AuditPage:
        """A page of the audit log (scope ``operate``), newest first: who did what to which
        run (or token), when. ``run_id`` keeps one run's entries; ``cursor`` is a previous
        page's ``next_cursor``; ``limit`` is 1 to 1000. A token limited to runs sees only
        their entries."""
        return await self.send(self.api.audit(run_id, limit, cursor))

    async def audit_entries(
        self, run_id: str | None = None, *, page_size: int = 1000
    ) -> AsyncIterator[AuditEntry]:
        """Every entry of the audit log (or of one run), newest first, fetched a page at a
        time."""
        cursor: str | None = None
        while True:
            docs, cursor = await self.send(self.api.audit_docs(run_id, page_size, cursor))
            for doc in docs:
                yield parse_audit_entry(doc)
            if not cursor:
                return

    # -- access tokens (scope admin) ------------------------------------------------------
    async def create_token(
        self,
        name: str,
        scopes: Scope | Sequence[Scope],
        runs: str | Sequence[str] | None = None,
    ) -> NewToken:
        """A new token for ``name`` (the audit log names its actions so) with ``scopes``
        (``generate``, ``train``, ``operate``, ``admin``), limited to ``runs`` (run ids or
        ``prefix*`` patterns; None: every run). Its secret, ``.token``, is in this answer
        only: the broker keeps just a digest. A request whose answer may have been lost is
        not sent again, since the resend would create a second token."""
        return await self.send(self.api.create_token(name, scopes, runs))

    async def list_tokens(self) -> list[AccessToken]:
        """Every token, newest first, revoked ones included (``revoked_at`` set); never a
        secret."""
        return await self.send(self.api.list_tokens())

    async def revoke_token(self, token_id: str) -> None:
        """Revoke a token: every API process of the broker refuses it within a second.
        Revoking it again changes nothing; an unknown id is :class:`TokenNotFound`. Takes the
        ``token_id`` or the whole token, of which only the id is sent."""
        await self.send(self.api.revoke_token(token_id))


class AsyncRolloutWriter:
    """Batches a generator's rollouts into ingest requests.

    ``add(*rollouts)`` buffers (the rollouts of one call always travel in one request, so pass a
    whole group at once); a request goes out when ``batch_size`` rollouts are buffered, when the
    oldest has waited ``linger_s`` (checked on ``add``), on :meth:`flush` and when its
    ``async with`` block ends normally. Resending is safe, since ``rollout_id`` makes ingest
    idempotent, so the client's :class:`Retry` resends through lost answers, broker restarts and
    outages (``503``), up to its deadline. A ``429`` is backpressure: the writer waits the
    ``Retry-After`` seconds and sends again, for up to ``max_backpressure_s`` in all (None:
    without limit), then raises :class:`OverCapacity`. Per-rollout rejections (``stale``, ...)
    are not errors: they are collected in :attr:`rejected` and logged at WARNING, one line for
    each request that had some.

    No rollout is dropped before the broker has accepted it. When a flush fails, the error
    raised carries in ``err.unsent`` every rollout not accepted, and they stay buffered for the
    next flush, which sends them first, ``batch_size`` at a time: when the broker cannot be
    reached, stays unavailable or full past the deadlines, or answers any other ``5xx``. Only a
    request the broker refused as a whole (``422``, ``404``, ``413``, ``401``, ``403``...:
    sending it again would fail the same way) leaves the buffer; its rollouts are in
    ``err.unsent`` all the same.
    """

    def __init__(
        self,
        client: AsyncBrokerClient,
        run_id: str,
        *,
        batch_size: int = 256,
        linger_s: float | None = None,
        max_backpressure_s: float | None = 600.0,
    ) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        self.client = client
        self.run_id = run_id
        self.batch_size = batch_size
        self.linger_s = linger_s
        self.max_backpressure_s = max_backpressure_s
        self._groups: list[list[RolloutLike]] = []  # one per add() call, oldest first
        self._docs: list[list[dict[str, Any]]] = []  # their wire forms, checked on add()
        self._pending = 0
        self._since = 0.0
        self.accepted = 0
        self.duplicates = 0
        self.rejected: list[Rejection] = []
        self.requests = 0
        self.backpressure_waits = 0
        self.backpressure_s = 0.0

    async def __aenter__(self) -> AsyncRolloutWriter:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            await self.flush()

    @property
    def pending(self) -> int:
        """Rollouts buffered, not yet accepted by the broker."""
        return self._pending

    @property
    def unsent(self) -> list[RolloutLike]:
        """The buffered rollouts, oldest first."""
        return [r for g in self._groups for r in g]

    async def add(self, *rollouts: RolloutLike) -> IngestResult | None:
        """Buffer rollouts; returns the ingest answer if this call sent a request (the last
        one, when the buffer held more than ``batch_size`` after a failed flush). The rollouts
        are checked first, as :meth:`AsyncBrokerClient.post_rollouts` checks them: a bad one
        raises a ValueError or TypeError naming it and the field, and none of this call's
        rollouts is buffered."""
        if not rollouts:
            return None
        docs = self.client.api.rollout_docs(rollouts)
        if not self._groups:
            self._since = time.monotonic()
        self._groups.append(list(rollouts))
        self._docs.append(docs)
        self._pending += len(rollouts)
        due = self.linger_s is not None and time.monotonic() - self._since >= self.linger_s
        if self._pending >= self.batch_size or due:
            return await self.flush()
        return None

    async def flush(self) -> IngestResult | None:
        """Send everything buffered, ``batch_size`` rollouts a request (a larger ``add`` call
        alone); returns the last answer, None if nothing was buffered."""
        result: IngestResult | None = None
        while self._groups:
            taken = 1
            size = len(self._groups[0])
            while taken < len(self._groups) and size + len(self._groups[taken]) <= self.batch_size:
                size += len(self._groups[taken])
                taken += 1
            chunk = [d for g in self._docs[:taken] for d in g]
            try:
                result = await self._send(chunk)
            except BrokerError as err:
                err.unsent = self.unsent
                if _refused_whole(err):
                    del self._groups[:taken], self._docs[:taken]
                    self._pending -= size
                raise
            del self._groups[:taken], self._docs[:taken]
            self._pending -= size
            self._since = time.monotonic()
        return result

    async def _send(self, chunk: Sequence[dict[str, Any]]) -> IngestResult:
        call = self.client.api.ingest(self.run_id, chunk)
        waited = 0.0
        while True:
            try:
                result = await self.client.send(call)
            except OverCapacity as exc:
                pause = exc.retry_after_s
                if self.max_backpressure_s is not None and waited + pause > self.max_backpressure_s:
                    raise
                self.backpressure_waits += 1
                self.backpressure_s += pause
                waited += pause
                await asyncio.sleep(pause)
                continue
            break
        self.requests += 1
        self.accepted += result.accepted
        self.duplicates += result.duplicates
        self.rejected.extend(result.rejected)
        _log_rejected(self.run_id, len(chunk), result)
        return result

    async def close(self) -> None:
        await self.flush()


def _refused_whole(err: BrokerError) -> bool:
    """The broker answered the request with a refusal that a resend would meet again."""
    return isinstance(err, BrokerHTTPError) and 400 <= err.status < 500 and err.status != 429


def _log_rejected(run_id: str, sent: int, result: IngestResult) -> None:
    """One WARNING line for the rollouts of an ingest request the broker rejected."""
    if result.rejected:
        log.warning(
            "run %s: the broker rejected %d of %d rollouts posted (%s)",
            run_id,
            len(result.rejected),
            sent,
            rejections_text(result.rejected),
        )


@dataclasses.dataclass(slots=True)
class AsyncLeasedBatch(Batch):
    """A batch leased through :class:`AsyncLease`, which can also be measured. It is empty when
    nothing qualified within the lease's ``wait_s``: no rollouts (``len`` 0, false), ``batch_id``
    ``""``, ``policy_version`` -1 and ``lease_expires_at`` the moment of the answer; its
    :meth:`ack_with` and :meth:`measure` send nothing, and leaving the lease acks nothing."""

    _client: AsyncBrokerClient | None = dataclasses.field(default=None, repr=False)
    _run_id: str = dataclasses.field(default="", repr=False)

    async def measure(self, logprobs: LogprobsArg) -> Measurement:
        """The correction of this batch from the trainer's logprobs before the update (a
        mapping by rollout_id, or a sequence in batch order, one array per rollout); the
        broker keeps them, so the ack on leaving may carry none (:meth:`ack_with` not called,
        or called without logprobs). Weights come back in batch order. An empty batch
        measures nothing: no weights, every figure None."""
        if not self.rollouts:
            self._by_id(logprobs)  # the same ValueError as any batch for values not its own
            return Measurement(
                {}, {}, MeasureStats(*(None for _ in dataclasses.fields(MeasureStats)))
            )
        if self._client is None:
            raise RuntimeError("this batch was not leased through a client")
        order = [r.rollout_id for r in self.rollouts]
        given = self._by_id(logprobs)
        return await self._client.measure(self._run_id, self.batch_id, given, order=order)


class AsyncLease:
    """``async with client.lease(run_id, size) as batch:`` leases a batch. When nothing
    qualified within ``wait_s``, ``batch`` is empty (no rollouts, so ``len(batch) == 0`` and
    ``not batch``; see :class:`AsyncLeasedBatch`) and leaving the block sends nothing.

    Leave the block normally and the batch is acked with what :meth:`Batch.ack_with` set (the
    current policy's logprobs, or KL values, and the step); the answer is in
    ``batch.ack_result``, and an ack that fails (say :class:`LeaseExpired`) raises. An ack that
    carries neither, of a batch not measured, is logged (once per client): the broker has
    nothing to measure KL with. Leave it with an exception and the batch is nacked, its
    rollouts going back unused, and the exception goes on (a failing nack is logged: the lease
    then simply expires).
    """

    def __init__(
        self,
        client: AsyncBrokerClient,
        run_id: str,
        size: int,
        *,
        policy_version: int | None = None,
        wait_s: float = 0.0,
        partial: bool = False,
        trainer_id: str | None = None,
    ) -> None:
        self.client = client
        self.run_id = run_id
        self._call = client.api.lease(
            run_id,
            size,
            policy_version=policy_version,
            wait_s=wait_s,
            partial=partial,
            trainer_id=trainer_id,
        )
        self.batch: AsyncLeasedBatch | None = None  # once the block is entered

    async def __aenter__(self) -> AsyncLeasedBatch:
        got = await self.client.send(self._call)
        if got is None:
            batch = AsyncLeasedBatch("", -1, datetime.now(UTC), [], _run_id=self.run_id)
        else:
            fields = {f.name: getattr(got, f.name) for f in dataclasses.fields(Batch)}
            batch = AsyncLeasedBatch(**fields, _client=self.client, _run_id=self.run_id)
        self.batch = batch
        return batch

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        batch = self.batch
        if batch is None or not batch.batch_id:  # nothing was leased
            return
        if exc_type is None:
            args = batch.pending_ack()
            batch.ack_result = await self.client.ack(self.run_id, batch.batch_id, **args)
            return
        try:
            await self.client.nack(self.run_id, batch.batch_id)
        except BrokerError as err:
            log.warning("nack of batch %s failed (%s); its lease will expire", batch.batch_id, err)


class _HeldLease(Protocol):
    @property
    def lease_id(self) -> str: ...
    @property
    def expires_at(self) -> datetime: ...


_L = TypeVar("_L", bound=_HeldLease)


class _AsyncHeld(Generic[_L]):
    """What a work lease and a reward lease share for the client that holds them: giving back
    what it did not use when it is settled (on leaving an ``async with`` block, or by the loop
    that handed it out), once. ``_HELD`` names what is held, ``_AGAIN`` what the broker does
    with it once the lease expires, for the log line of a give-back that failed."""

    _HELD = ""
    _AGAIN = ""
    client: AsyncBrokerClient
    lease: _L
    settled: bool
    _giving_back: bool

    @property
    def lease_id(self) -> str:
        return self.lease.lease_id

    def _unused(self) -> int:
        """How many of what the lease holds are neither used nor given back."""
        raise NotImplementedError

    async def _give_back_all(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.settle(failing=exc_type is not None)

    async def settle(self, *, failing: bool = False) -> None:
        """End the lease for this client: give back everything not used. A broker that cannot
        be reached is logged (it goes back when the lease expires), as is any error when
        ``failing`` (an exception is already on its way); other errors raise."""
        if self._giving_back:
            return
        self._giving_back = self.settled = True
        self.client._works.discard(self)
        try:
            await self._give_back_all()
        except BrokerError as err:
            if not (failing or isinstance(err, BrokerUnreachable | ServerError | NotFound)):
                raise
            log.warning(
                "could not give back %d %s %s (%s); the broker %s once the lease expires at %s",
                self._unused(),
                self._HELD,
                self.lease_id,
                err,
                self._AGAIN,
                self.lease.expires_at.isoformat(),
            )


class AsyncWork(_AsyncHeld[WorkLease]):
    """The prompts of one work lease, as :meth:`AsyncBrokerClient.work` hands them out.

    Generate for each of :attr:`prompts` and post its group with :meth:`post`. Every prompt not
    posted goes back to the broker when the lease is settled, which the loop does when it takes
    the next lease, when it ends and when its body leaves by ``break`` or an exception;
    :meth:`give_back` returns some sooner. Prompts given back are handed out again ahead of
    fresh ones; one whose return failed goes back when the lease expires. To drive a lease of
    :meth:`AsyncBrokerClient.work_lease` yourself, ``async with AsyncWork(client, run_id,
    lease) as work:`` settles it on leaving the block.
    """

    def __init__(
        self,
        client: AsyncBrokerClient,
        run_id: str,
        lease: WorkLease,
        *,
        max_backpressure_s: float | None = 600.0,
    ) -> None:
        self.client = client
        self.run_id = run_id
        self.lease = lease
        self.max_backpressure_s = max_backpressure_s
        self.posted: list[WorkPrompt] = []
        self.returned: list[WorkPrompt] = []
        self.rejected: list[Rejection] = []
        self.settled = False  # over for this client: no more posts, the rest goes back
        self._giving_back = False
        self._by_group = {p.group_id: p for p in lease.prompts}
        self._unposted = dict(self._by_group)
        self._sent: dict[str, int] = {}  # rollouts posted per group, numbering default ids
        client._works.add(self)

    _HELD = "prompts of work lease"
    _AGAIN = "hands them out again"

    def _unused(self) -> int:
        return len(self._unposted)

    async def _give_back_all(self) -> None:
        await self.give_back()

    @property
    def policy_version(self) -> int:
        return self.lease.policy_version

    @property
    def prompts(self) -> list[WorkPrompt]:
        return self.lease.prompts

    @property
    def unposted(self) -> list[WorkPrompt]:
        """The prompts of this lease no post has been accepted for, and not given back."""
        return list(self._unposted.values())

    def __len__(self) -> int:
        return len(self.lease.prompts)

    async def post(self, prompt: WorkPrompt | str, rollouts: Sequence[RolloutLike]) -> IngestResult:
        """Post rollouts of ``prompt`` (a prompt of this lease, or its ``group_id``), usually
        its whole group, in one request. Each rollout's ``group_id`` is filled in; a mapping's
        ``policy_version`` defaults to the lease's and its ``rollout_id`` to
        ``<group_id>-<k>``; one without ``generator_id`` gets the lease's from the broker. A
        ``group_id`` of another prompt is a ValueError. Backpressure
        (``429``) is waited out as the writer does. Rollouts refused one by one (say
        ``stale_attempt``, after the lease expired) are in the answer and in :attr:`rejected`;
        the prompt counts as posted once a request for it has been answered. A settled lease
        takes no more posts (RuntimeError)."""
        if self.settled:
            raise RuntimeError(
                f"work lease {self.lease_id!r} is settled: its unposted prompts go back"
            )
        p = self._prompt(prompt)
        first = self._sent.get(p.group_id, 0)
        docs = [self._in_group(p, first + k, r) for k, r in enumerate(rollouts)]
        if not docs:
            raise ValueError(f"no rollouts to post for prompt {p.prompt_id!r}")
        writer = self.client.writer(
            self.run_id, batch_size=len(docs), max_backpressure_s=self.max_backpressure_s
        )
        result = await writer.add(*docs)  # one request: batch_size is the group's size
        assert result is not None
        self._sent[p.group_id] = first + len(docs)
        self.rejected.extend(result.rejected)
        if self._unposted.pop(p.group_id, None) is not None:
            self.posted.append(p)
        return result

    async def give_back(
        self,
        prompts: Iterable[WorkPrompt | str] | None = None,
        *,
        partials: (
            Mapping[WorkPrompt, Sequence[PartialLike]] | Mapping[str, Sequence[PartialLike]] | None
        ) = None,
    ) -> int:
        """Return prompts of this lease not posted (all of them by default) to the broker now,
        for any generator to take; returns how many the broker took back. ``partials`` gives,
        by prompt (or its ``group_id``), what was sampled so far of its responses (rollouts
        without reward; their ``group_id`` is filled in): the lease that next hands the prompt
        out carries them to continue. A prompt given partials goes back with them."""
        given = {self._prompt(p).group_id: list(ps) for p, ps in (partials or {}).items()}
        chosen = (
            list(self._unposted.values())
            if prompts is None
            else [
                p
                for p in [*map(self._prompt, prompts), *map(self._prompt, given)]
                if p.group_id in self._unposted
            ]
        )
        if not chosen:
            return 0
        ids = list(dict.fromkeys(p.prompt_id for p in chosen))
        docs = [
            _in_prompt(gid, p) for gid, ps in given.items() if gid in self._unposted for p in ps
        ]
        n = await self.client.return_work(self.run_id, self.lease_id, ids, docs)
        for p in dict.fromkeys(chosen):
            del self._unposted[p.group_id]
        self.returned.extend(chosen)
        return n

    def _prompt(self, prompt: WorkPrompt | str) -> WorkPrompt:
        gid = prompt if isinstance(prompt, str) else prompt.group_id
        found = self._by_group.get(gid)
        if found is None:
            raise ValueError(
                f"{gid!r} is not the group_id of a prompt of work lease {self.lease_id!r}"
            )
        return found

    def _in_group(self, prompt: WorkPrompt, k: int, rollout: RolloutLike) -> RolloutLike:
        gid = prompt.group_id
        doc: dict[str, Any] = (
            {"rollout_id": rollout.rollout_id, "group_id": rollout.group_id}
            if isinstance(rollout, Rollout)
            else dict(rollout)
        )
        given = doc.get("group_id")
        if given is not None and given != gid:
            raise ValueError(
                f"rollout {doc.get('rollout_id')!r} names group {given!r}, not {gid!r} of "
                f"prompt {prompt.prompt_id!r}"
            )
        if isinstance(rollout, Rollout):
            return dataclasses.replace(rollout, group_id=gid)
        doc["group_id"] = gid
        if doc.get("rollout_id") is None:
            doc["rollout_id"] = f"{gid}-{k}"
        if doc.get("policy_version") is None:
            doc["policy_version"] = self.policy_version
        return doc


def _in_prompt(group_id: str, p: PartialLike) -> PartialLike:
    """A partial under its prompt's ``group_id`` (one of another prompt is a ValueError)."""
    given = p.group_id if isinstance(p, Partial) else p.get("group_id")
    if given is not None and given != group_id:
        rid = p.rollout_id if isinstance(p, Partial) else p.get("rollout_id")
        raise ValueError(f"partial {rid!r} names group {given!r}, not {group_id!r}")
    if isinstance(p, Partial):
        return p
    return {**p, "group_id": group_id}


class _Settling(Protocol):
    """A lease a loop hands out: settled (what it did not use given back) before the next."""

    settled: bool
    client: AsyncBrokerClient

    async def settle(self, *, failing: bool) -> None: ...


_Settled = TypeVar("_Settled", bound=_Settling)


class _AsyncLeaseLoop(Generic[_Settled]):
    """What the generator and reward worker loops share: leases one after another (each taken
    by :meth:`_take`, None when the broker had nothing within ``wait_s``), each settled before
    the next is taken and when the loop is left."""

    def __init__(
        self, client: AsyncBrokerClient, run_id: str, wait_s: float, stop_when_empty: bool
    ) -> None:
        self.client = client
        self.run_id = run_id
        self.wait_s = wait_s
        self.stop_when_empty = stop_when_empty
        self.current: _Settled | None = None
        self.leases = 0
        self._done = False

    async def _take(self) -> _Settled | None:
        raise NotImplementedError

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> _Settled:
        await self._settle_current(failing=False)
        while not self._done:
            lease = await self._take()
            if lease is not None:
                self.leases += 1
                self.current = lease
                return lease
            self._done = self.stop_when_empty
        raise StopAsyncIteration

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._done = True
        await self._settle_current(failing=exc_type is not None)

    async def aclose(self) -> None:
        """End the loop, giving back what its current lease holds and did not use."""
        self._done = True
        await self._settle_current(failing=False)

    async def _settle_current(self, *, failing: bool) -> None:
        work, self.current = self.current, None
        if work is not None:
            await work.settle(failing=failing)

    def __del__(self) -> None:
        work = getattr(self, "current", None)
        if work is not None and not work.settled:
            work.settled = True
            work.client._abandoned.append(work)


class AsyncWorkLoop(_AsyncLeaseLoop["AsyncWork"]):
    """The generator loop, ``async for lease in client.work(run_id, max_prompts=8)``: work
    leases one after another, each an :class:`AsyncWork` whose prompts the body generates for
    and posts. The loop settles each lease (gives back its prompts not posted) before it takes
    the next, and ends at a ``break``, an exception (:class:`RunClosed` once the run is closed)
    or, with ``stop_when_empty``, the first time the broker has nothing to hand out within
    ``wait_s`` (no prompt queued, or the staleness budget spent); otherwise it keeps asking.

    Leaving the loop settles its last lease: at once inside ``async with client.work(...) as
    leases``, or through :meth:`aclose`; without either, the client gives the prompts back
    before its next request, or when it closes (a ``break`` or an exception drops the loop,
    whose destructor hands the lease to the client: it sends nothing itself).
    """

    def __init__(
        self,
        client: AsyncBrokerClient,
        run_id: str,
        *,
        max_prompts: int = 8,
        generator_id: str | None = None,
        wait_s: float = 30.0,
        stop_when_empty: bool = False,
        max_backpressure_s: float | None = 600.0,
    ) -> None:
        super().__init__(client, run_id, wait_s, stop_when_empty)
        self.max_prompts = max_prompts
        self.generator_id = generator_id
        self.max_backpressure_s = max_backpressure_s

    async def _take(self) -> AsyncWork | None:
        lease = await self.client.work_lease(
            self.run_id, self.max_prompts, generator_id=self.generator_id, wait_s=self.wait_s
        )
        if lease is None:
            return None
        backpressure = self.max_backpressure_s
        return AsyncWork(self.client, self.run_id, lease, max_backpressure_s=backpressure)


class AsyncRewardWork(_AsyncHeld[RewardLease]):
    """The rollouts of one reward lease, as :meth:`AsyncBrokerClient.reward_work` hands them
    out.

    Score :attr:`rollouts` with :meth:`score`, all at once or a few at a time. Every rollout
    not scored goes back to the broker, for any reward worker to lease at once, when the lease
    is settled: the loop does so when it takes the next lease, when it ends and when its body
    leaves by ``break`` or an exception; :meth:`give_back` returns some sooner. One whose return
    failed goes back when the lease expires. To drive a lease of
    :meth:`AsyncBrokerClient.reward_lease` yourself, ``async with AsyncRewardWork(client,
    run_id, lease) as work:`` settles it on leaving the block.
    """

    def __init__(self, client: AsyncBrokerClient, run_id: str, lease: RewardLease) -> None:
        self.client = client
        self.run_id = run_id
        self.lease = lease
        self.scored: dict[str, float] = {}
        self.retired: list[str] = []  # retired (stale, say) before their score came
        self.returned: list[RewardRollout] = []
        self.settled = False  # over for this client: no more scores, the rest goes back
        self._giving_back = False
        self._by_id = {r.rollout_id: r for r in lease.rollouts}
        self._unscored = dict(self._by_id)
        client._works.add(self)

    _HELD = "rollouts of reward lease"
    _AGAIN = "leases them again"

    def _unused(self) -> int:
        return len(self._unscored)

    async def _give_back_all(self) -> None:
        await self.give_back()

    @property
    def rollouts(self) -> list[RewardRollout]:
        return self.lease.rollouts

    @property
    def unscored(self) -> list[RewardRollout]:
        """The rollouts of this lease not scored and not given back."""
        return list(self._unscored.values())

    def __len__(self) -> int:
        return len(self.lease.rollouts)

    async def score(self, rewards: Mapping[str, float]) -> ScoreResult:
        """Send rewards by rollout_id (finite numbers) for rollouts of this lease, in one
        request under the lease's id, resent as any idempotent request is. A rollout of
        another lease, or one given back, is a ValueError and a reward that is not a finite
        number a ValueError or TypeError, before anything is sent. Rollouts that retired before
        their score came are in the answer's ``retired`` and in :attr:`retired`. A settled
        lease takes no more scores (RuntimeError)."""
        if self.settled:
            raise RuntimeError(
                f"reward lease {self.lease_id!r} is settled: its unscored rollouts went back"
            )
        strange = [rid for rid in rewards if rid not in self._by_id]
        if strange:
            raise ValueError(f"{strange!r}: not rollouts of reward lease {self.lease_id!r}")
        back = {r.rollout_id for r in self.returned}
        gone = [rid for rid in rewards if rid in back]
        if gone:
            raise ValueError(f"{gone!r} of reward lease {self.lease_id!r} were given back")
        result = await self.client.score(self.run_id, rewards, lease_id=self.lease_id)
        for rid, value in rewards.items():
            self._unscored.pop(rid, None)
            self.scored[rid] = float(value)
        self.retired.extend(result.retired)
        return result

    async def give_back(self, rollouts: Iterable[RewardRollout | str] | None = None) -> int:
        """Return rollouts of this lease not scored (all of them by default) to the broker now,
        for any reward worker to lease at once; returns how many the broker took back. A
        group is leased and given back whole: a rollout goes back with the unscored members of
        its group."""
        if rollouts is None:
            chosen = list(self._unscored.values())
        else:
            named = {r if isinstance(r, str) else r.rollout_id for r in rollouts}
            groups = {self._by_id[rid].group_id for rid in named if rid in self._by_id} - {None}
            chosen = [
                r for r in self._unscored.values() if r.rollout_id in named or r.group_id in groups
            ]
        if not chosen:
            return 0
        ids = [r.rollout_id for r in chosen]
        n = await self.client.return_rewards(self.run_id, self.lease_id, ids)
        for r in chosen:
            del self._unscored[r.rollout_id]
        self.returned.extend(chosen)
        return n


class AsyncRewardLoop(_AsyncLeaseLoop["AsyncRewardWork"]):
    """The reward worker loop, ``async for lease in client.reward_work(run_id,
    max_rollouts=8)``: reward leases one after another, each an :class:`AsyncRewardWork` whose
    rollouts the body scores. The loop settles each lease (gives back its rollouts not scored)
    before it takes the next, and ends at a ``break``, an exception or, with
    ``stop_when_empty``, the first time the broker has nothing to score within ``wait_s``;
    otherwise it keeps asking.

    Leaving the loop settles its last lease: at once inside ``async with
    client.reward_work(...) as leases``, or through :meth:`aclose`; without either, the client
    gives the rollouts back before its next request, or when it closes (a ``break`` or an
    exception drops the loop, whose destructor hands the lease to the client: it sends nothing
    itself).
    """

    def __init__(
        self,
        client: AsyncBrokerClient,
        run_id: str,
        *,
        max_rollouts: int = 8,
        worker_id: str | None = None,
        wait_s: float = 30.0,
        stop_when_empty: bool = False,
    ) -> None:
        super().__init__(client, run_id, wait_s, stop_when_empty)
        self.max_rollouts = max_rollouts
        self.worker_id = worker_id

    async def _take(self) -> AsyncRewardWork | None:
        lease = await self.client.reward_lease(
            self.run_id, self.max_rollouts, worker_id=self.worker_id, wait_s=self.wait_s
        )
        return None if lease is None else AsyncRewardWork(self.client, self.run_id, lease)


class AsyncConsumer:
    """A consumer of a run, as :meth:`AsyncBrokerClient.consumer` names it: a reward-model or
    preference (DPO) trainer reading the run's scored rollouts beside the policy trainer.

    :meth:`batches` is the loop that acks each batch once its body moves on and nacks it when
    the body raises; :meth:`lease_batch`, :meth:`ack` and :meth:`nack` drive batches by hand.
    Every lease names its batch (``batch_id``, or a new id), so a resend after a lost answer
    gets the same batch."""

    def __init__(self, client: AsyncBrokerClient, run_id: str, name: str) -> None:
        self.client = client
        self.run_id = run_id
        self.name = name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.run_id!r}, {self.name!r})"

    async def info(self) -> ConsumerInfo:
        """The consumer's config and counts."""
        return await self.client.get_consumer(self.run_id, self.name)

    async def lease_batch(
        self, size: int, *, wait_s: float = 0.0, batch_id: str | None = None
    ) -> ConsumerBatch | None:
        """Lease up to ``size`` items (rollouts, or pairs for kind ``preferences``), waiting up
        to ``wait_s`` for some; None if none came. Ack or nack it; an expired lease returns its
        items."""
        call = self.client.api.consumer_lease(
            self.run_id, self.name, size, wait_s=wait_s, batch_id=batch_id
        )
        return await self.client.send(call)

    async def ack(self, batch: ConsumerBatch | str) -> int:
        """Acknowledge a batch (or its ``batch_id``); returns its items. A repeat is safe;
        :class:`BatchSettled` once nacked, :class:`LeaseExpired` once its lease ran out."""
        bid = batch if isinstance(batch, str) else batch.batch_id
        return await self.client.send(self.client.api.consumer_ack(self.run_id, self.name, bid))

    async def nack(self, batch: ConsumerBatch | str) -> int:
        """Give a batch (or its ``batch_id``) back: its items are pending again, to be handed
        out again; returns how many."""
        bid = batch if isinstance(batch, str) else batch.batch_id
        return await self.client.send(self.client.api.consumer_nack(self.run_id, self.name, bid))

    def batches(
        self, size: int, *, wait_s: float = 30.0, stop_when_empty: bool = False
    ) -> AsyncConsumerLoop:
        """The consumer's loop: batches one after another; see :class:`AsyncConsumerLoop`."""
        return AsyncConsumerLoop(self, size, wait_s=wait_s, stop_when_empty=stop_when_empty)


@dataclasses.dataclass(slots=True, eq=False)
class AsyncConsumerLease(ConsumerBatch):
    """A consumer's batch as its loop hands it out, settled once: acked (``acked``, the items
    acked) or nacked (``returned``, the items back to pending)."""

    consumer: AsyncConsumer = dataclasses.field(kw_only=True, repr=False)
    client: AsyncBrokerClient = dataclasses.field(kw_only=True, repr=False)
    settled: bool = dataclasses.field(default=False, kw_only=True)
    acked: int | None = dataclasses.field(default=None, kw_only=True)
    returned: int | None = dataclasses.field(default=None, kw_only=True)
    _settling: bool = dataclasses.field(default=False, kw_only=True, repr=False)

    async def settle(self, *, failing: bool) -> None:
        """Ack the batch, or nack it when ``failing``. A failing ack raises; a failing nack is
        logged (the items come back when the lease expires)."""
        if self._settling:
            return
        self._settling = self.settled = True
        self.client._works.discard(self)
        if not failing:
            self.acked = await self.consumer.ack(self)
            return
        try:
            self.returned = await self.consumer.nack(self)
        except BrokerError as err:
            log.warning(
                "nack of batch %s of consumer %s failed (%s); its items come back when its "
                "lease expires at %s",
                self.batch_id,
                self.consumer.name,
                err,
                self.lease_expires_at.isoformat(),
            )


_Open = AsyncWork | AsyncRewardWork | AsyncConsumerLease


class AsyncConsumerLoop(_AsyncLeaseLoop["AsyncConsumerLease"]):
    """A consumer's loop, ``async for batch in client.consumer(run_id, "rm").batches(32)``:
    batches one after another, each an :class:`AsyncConsumerLease` (a :class:`ConsumerBatch`).
    A batch is acked when the body moves on to the next one (or the loop ends normally) and
    nacked when the body raises inside ``async with``: its items are handed out again. The loop
    ends at a ``break``, an exception or, with ``stop_when_empty``, the first time nothing is
    pending within ``wait_s``; otherwise it keeps asking.

    Leaving it inside ``async with consumer.batches(...) as batches`` settles its last batch at
    once: acked after a ``break``, nacked on an exception. Without the block the loop cannot
    tell one from the other, so its last batch is nacked, before the client's next request or
    when it closes (or by :meth:`aclose`, which acks it).
    """

    def __init__(
        self,
        consumer: AsyncConsumer,
        size: int,
        *,
        wait_s: float = 30.0,
        stop_when_empty: bool = False,
    ) -> None:
        super().__init__(consumer.client, consumer.run_id, wait_s, stop_when_empty)
        self.consumer = consumer
        self.size = size

    async def _take(self) -> AsyncConsumerLease | None:
        batch = await self.consumer.lease_batch(self.size, wait_s=self.wait_s)
        if batch is None:
            return None
        fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(ConsumerBatch)}
        lease = AsyncConsumerLease(**fields, consumer=self.consumer, client=self.client)
        self.client._works.add(lease)
        return lease
