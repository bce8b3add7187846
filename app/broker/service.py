"""The broker's operations as the API needs them: validate, call the store, shape results.

No HTTP here: the routers parse requests and render what these methods return; the rules
themselves live in the Lua scripts (atomic state changes) and in stats.py (numpy).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from rollout_broker_client.protocol import new_run_id

from app import keys
from app.broker.behaviour import BatchRow, BehaviourCache
from app.broker.config import RunConfig, RunConfigPatch
from app.broker.consumers import Consumers
from app.broker.generators import unnamed_attempts, with_lease_generators
from app.broker.notify import Try, Waker, long_poll
from app.broker.packing import (
    PackedRollout,
    StoredRollout,
    pack_rollouts,
    unpack_rollouts,
)
from app.broker.partials import check_prefixes, pack_partials, partials_wanted
from app.broker.prompt_limits import PromptLimits, with_prompts
from app.broker.replies import ErrorContext, StoreError, error_for
from app.broker.rewards import Rewards
from app.broker.run_index import ORPHAN_GRACE_MS, RunStatus, Visible
from app.broker.schemas import (
    IngestResult,
    PartialJSON,
    PartialMsgpack,
    PolicyOut,
    PolicyResult,
    PromptsResult,
    Rejection,
    ReturnResult,
    RolloutJSON,
    Run,
    RunList,
    WorkBody,
)
from app.broker.store import Lease, RedisStore, RunState
from app.broker.tokens import U8Array, hand_out
from app.broker.training import Training
from app.broker.views import WorkAnswer, iso_ms, run_view, work_answer
from app.caller import Caller, action_entry
from app.errors import ValidationFailed


@dataclass(frozen=True, slots=True)
class LeasedBatch:
    batch_id: str
    policy_version: int
    lease_expires_at: str
    kl_coef: float | None  # the adaptive KL penalty's β; None when off
    # (rollout, uses, lag, the loss mask handed out: None when every token is trained, the
    # prompt_id of a rollout posted under a work lease, which then carries the registered
    # prompt's prompt_ids when it was posted without any)
    rollouts: list[tuple[StoredRollout, int, int, U8Array | None, str | None]]


R = TypeVar("R")

LOST_LEASE_TRIES = 3
"""How often one lease or work request makes its batch or work lease again after a failover
lost it (each time the master it was made on was replaced before its rollouts or prompts were
read)."""


class Broker:
    def __init__(
        self,
        store: RedisStore,
        waker: Waker,
        *,
        max_tokens_per_rollout: int,
        max_rollouts_per_request: int,
        max_batch_size: int,
        max_wait_s: float,
        retry_after_s: int,
        behaviour_cache_bytes: int = 0,
        prompt_limits: PromptLimits | None = None,
    ) -> None:
        self.store = store
        self.prompt_limits = prompt_limits or PromptLimits()
        self.waker = waker
        self.max_tokens = max_tokens_per_rollout
        self.max_rollouts = max_rollouts_per_request
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self.retry_after_s = retry_after_s
        self.behaviour = BehaviourCache(behaviour_cache_bytes)
        self.rewards = Rewards(
            store, waker, check_wait=self.check_wait, check_count=self.check_count
        )
        self.training = Training(
            store, self.behaviour, self._refusals, max_batch_size=max_batch_size
        )
        self.consumers = Consumers(
            store, waker, check_wait=self.check_wait, check_size=self.check_size
        )

    @contextlib.contextmanager
    def _refusals(
        self,
        run_id: str,
        *,
        batch_id: str | None = None,
        size: int | None = None,
        version: int | None = None,
        lease_id: str | None = None,
    ) -> Iterator[None]:
        """Raise a script's refusal as the broker error the table in replies.py gives it."""
        try:
            yield
        except StoreError as err:
            ctx = ErrorContext(run_id, batch_id, size, version, self.retry_after_s, lease_id)
            raise error_for(err, ctx) from None

    # -- runs -----------------------------------------------------------------------------
    async def _run(self, run_id: str) -> RunState:
        state = await self.store.get_run(run_id)
        if state is None:  # a plain read, no script: the same refusal as a script's
            raise error_for(StoreError("run_missing"), ErrorContext(run_id))
        return state

    # An action on a run writes its entry to the run's outbox in the script that changes the run
    # (none when it changes nothing, or is refused); the caller moves the outbox on
    # (app.caller.ActionLog).
    async def create_run(
        self, run_id: str | None, config: RunConfig | None, by: Caller
    ) -> tuple[Run, bool]:
        """The run and whether it was created now (False: it existed with the same config)."""
        rid = run_id or new_run_id()
        cfg = config or RunConfig()
        entry = action_entry(by, "run.create", rid, {"config": cfg.model_dump(mode="json")})
        with self._refusals(rid):
            outcome = await self.store.create_run(rid, cfg, entry=entry)
        return run_view(await self._run(rid)), outcome == "created"

    async def get_run(self, run_id: str) -> Run:
        return run_view(await self._run(run_id))

    async def list_runs(
        self, status: RunStatus | None, limit: int, cursor: str | None, visible: Visible | None
    ) -> RunList:
        try:
            page = await self.store.list_runs(status, limit, cursor, visible)
        except ValueError as exc:
            raise ValidationFailed(str(exc)) from None
        return RunList(runs=[run_view(s) for s in page.runs], next_cursor=page.next_cursor)

    async def patch_config(self, run_id: str, patch: RunConfigPatch, by: Caller) -> Run:
        detail = {"patch": patch.model_dump(mode="json", exclude_unset=True)}
        entry = action_entry(by, "run.config", run_id, detail)
        while True:
            state = await self._run(run_id)
            try:
                new = state.config.merged(patch)
            except ValueError as exc:
                raise ValidationFailed(f"invalid config: {exc}") from None
            with self._refusals(run_id):
                outcome = await self.store.replace_config(
                    run_id, state.config_json, new, entry=entry
                )
            if outcome == "replaced":
                return run_view(await self._run(run_id))
            # 'changed': another patch landed between our read and write; merge again.

    async def close_run(self, run_id: str, by: Caller) -> Run:
        with self._refusals(run_id):
            await self.store.close_run(run_id, entry=action_entry(by, "run.close", run_id, {}))
        return run_view(await self._run(run_id))

    async def delete_run(self, run_id: str, by: Caller) -> None:
        """Delete the run; it stays in the run index until :meth:`unlist` (after its outbox
        has moved)."""
        with self._refusals(run_id):
            await self.store.delete_run(run_id, entry=action_entry(by, "run.delete", run_id, {}))

    async def unlist(self, run_id: str) -> None:
        """Take a deleted run whose outbox has moved out of the run index."""
        await self.store.unlist(run_id)

    async def set_policy(
        self,
        run_id: str,
        version: int,
        by: Caller,
        *,
        weights: str | None = None,
        rewind: bool = False,
    ) -> PolicyResult:
        """Move the run to ``version``, with where its ``weights`` are: forward, or with
        ``rewind`` back as well (a trainer resuming from a checkpoint); ``evicted`` counts what
        the change retired ('stale' going forward, 'rewound' going back)."""
        detail: dict[str, Any] = {"version": version}
        if weights is not None:
            detail["weights"] = weights
        with self._refusals(run_id, version=version):
            if rewind:
                entry = action_entry(by, "run.rewind", run_id, detail)
                back = await self.store.rewind(run_id, version, weights, entry=entry)
                if back is not None:
                    return PolicyResult(policy_version=back[0], evicted=back[1])
            entry = action_entry(by, "run.policy", run_id, detail)
            current, evicted = await self.store.set_policy(
                run_id, version, entry=entry, weights=weights
            )
        return PolicyResult(policy_version=current, evicted=evicted)

    async def get_policy(self, run_id: str, after: int | None, wait_s: float) -> PolicyOut | None:
        """The run's policy version, its weights and when it was set; with ``after``, once the
        version is another (above: a new one; below: the run was rewound past the caller), or
        None when ``wait_s`` passes first."""
        self.check_wait(wait_s)

        async def attempt(t: Try) -> tuple[PolicyOut | None, None]:
            with self._refusals(run_id):
                got = await self.store.policy(run_id, after, t.wait_ms)
            if got.policy_version == after:
                return None, None
            return PolicyOut(
                policy_version=got.policy_version,
                weights=got.weights,
                set_at=iso_ms(got.set_at_ms),
            ), None

        return await long_poll(self.waker, run_id, keys.POLICY_WAKE, 1, wait_s, attempt)

    # -- rollouts -------------------------------------------------------------------------
    def check_size(self, size: int) -> None:
        """The largest batch a trainer or a consumer may lease."""
        if size > self.max_batch_size:
            raise ValidationFailed(f"size {size} is above the largest batch, {self.max_batch_size}")

    def check_count(self, n: int) -> None:
        """The most rollouts one request may carry."""
        if n > self.max_rollouts:
            raise ValidationFailed(f"{n} rollouts in one request, at most {self.max_rollouts}")

    def pack(self, rollouts: Sequence[RolloutJSON]) -> list[PackedRollout]:
        self.check_count(len(rollouts))
        return pack_rollouts(rollouts, self.max_tokens)

    async def ingest_packed(self, run_id: str, packed: list[PackedRollout]) -> IngestResult:
        """Ingest rollouts :meth:`pack` has packed (the API packs big bodies off the event
        loop, one rollout at a time)."""
        # What both rules read, of rollouts of prompt attempts only: two round trips at most.
        attempts, wanted = unnamed_attempts(packed), partials_wanted(packed)
        got = await self.store.attempt_reads(run_id, attempts, wanted)
        packed = with_lease_generators(packed, got.generators)
        check_prefixes(packed, got.partials)
        with self._refusals(run_id):
            out = await self.store.ingest(run_id, packed)
        return IngestResult(
            accepted=out.accepted,
            duplicates=out.duplicates,
            rejected=[Rejection(rollout_id=r, reason=why) for r, why in out.rejected],
        )

    # -- batches --------------------------------------------------------------------------
    async def lease(
        self,
        run_id: str,
        *,
        size: int,
        policy_version: int | None,
        wait_s: float,
        partial: bool,
        trainer_id: str | None,
        batch_id: str | None = None,
    ) -> LeasedBatch | None:
        """A leased batch, or None when nothing qualified within ``wait_s``.

        A client-chosen ``batch_id`` makes the call safe to retry: while that batch's lease is
        live, the same call returns the same batch instead of leasing more.
        """
        self.check_wait(wait_s)
        self.check_size(size)
        bid = batch_id or uuid.uuid4().hex

        async def attempt(t: Try) -> tuple[LeasedBatch | None, int | None]:
            nonlocal bid
            lost = 0
            while True:
                try:
                    got = await self.store.lease(
                        run_id,
                        batch_id=bid,
                        size=size,
                        policy_version=policy_version,
                        # Take a part only once waiting for the whole is over.
                        partial=partial and t.last,
                        trainer_id=trainer_id,
                        wait_ms=t.wait_ms,
                        waited_ms=t.waited_ms,
                    )
                except StoreError as err:
                    if err.code == "lease_lost" and batch_id is None:
                        bid = uuid.uuid4().hex  # ran out before delivery: try afresh
                        continue
                    if (
                        err.code == "lease_lost"
                        and lost < LOST_LEASE_TRIES
                        and not await self._batch_known(run_id, bid)
                    ):
                        # Made on a master that a failover replaced before its rollouts were
                        # read: the promoted replica has neither the batch nor those rollouts,
                        # so the batch id is free there. Lease again under it.
                        lost += 1
                        continue
                    ctx = ErrorContext(run_id, bid, size, policy_version, self.retry_after_s)
                    raise error_for(err, ctx) from None
                if isinstance(got, Lease):
                    return self._delivered(run_id, got), None
                return None, got

        return await long_poll(self.waker, run_id, "", size, wait_s, attempt)

    async def _batch_known(self, run_id: str, batch_id: str) -> bool:
        """Whether Redis has the batch, in any state."""
        try:
            await self.store.batch_view(run_id, batch_id, rollouts="none")
        except StoreError as err:
            return err.code != "batch_missing"
        return True

    def check_wait(self, wait_s: float) -> None:
        """A long poll waits at most ``BROKER_MAX_WAIT_S``: a longer ``wait_s`` is refused (422),
        as the API description says, rather than cut short without a word."""
        if wait_s > self.max_wait_s:
            raise ValidationFailed(
                f"wait_s: {wait_s:g} s is above the longest wait, {self.max_wait_s:g} s"
            )

    def _delivered(self, run_id: str, got: Lease) -> LeasedBatch:
        """A lease as the API hands it out; its behaviour logprobs are kept for the ack."""
        leased = got.rollouts
        rollouts = unpack_rollouts([r.blob for r in leased])
        V, floor = got.policy_version, got.token_floor
        rows, out = [], []
        for (r, pid), lr in zip(with_prompts(rollouts, leased), leased, strict=True):
            n = r.response_ids.size
            given = hand_out(r.loss_mask, r.versions, r.policy_version, n, V, floor)
            # Counted under the version the lease script judged it by (its lag's), answered
            # with its lag by v_old (the SPEC's).
            rows.append(
                BatchRow(r.rollout_id, V - lr.lag, n, r.logprobs, given, r.generator_id, r.reward)
            )
            out.append((r, lr.uses, V - r.policy_version, given.mask, pid))
        self.behaviour.put(run_id, got.batch_id, rows)
        return LeasedBatch(
            batch_id=got.batch_id,
            policy_version=V,
            lease_expires_at=iso_ms(got.expires_at_ms),
            kl_coef=got.kl_coef,
            rollouts=out,
        )

    # -- prompts and work leases ----------------------------------------------------------
    async def register_prompts(
        self, run_id: str, packed: list[tuple[str, bytes]], epochs: int
    ) -> PromptsResult:
        """Register prompts ``prompt_limits.pack`` has packed, each for ``epochs`` passes."""
        with self._refusals(run_id):
            accepted, duplicates = await self.store.register_prompts(run_id, packed, epochs)
        return PromptsResult(accepted=accepted, duplicates=duplicates)

    async def work(self, run_id: str, body: WorkBody) -> WorkAnswer | None:
        """A work lease, or None when no prompt could be handed out within ``wait_s`` (none
        queued, or the staleness budget is spent)."""
        self.check_wait(body.wait_s)
        if body.max_prompts > self.prompt_limits.per_lease:
            raise ValidationFailed(
                f"max_prompts {body.max_prompts} is above the largest work lease, "
                f"{self.prompt_limits.per_lease}"
            )
        lid = body.lease_id or uuid.uuid4().hex

        async def attempt(t: Try) -> tuple[WorkAnswer | None, int | None]:
            lost = 0
            while True:
                try:
                    got = await self.store.work(
                        run_id,
                        lease_id=lid,
                        max_prompts=body.max_prompts,
                        generator_id=body.generator_id,
                        wait_ms=t.wait_ms,
                        waited_ms=t.waited_ms,
                    )
                except StoreError as err:
                    if err.code == "work_lost" and lost < LOST_LEASE_TRIES:
                        # Made on a master that a failover replaced before its prompts were
                        # read: the promoted replica lacks a prompt registered since it last
                        # replicated, and so the lease, written after it. Lease again there.
                        lost += 1
                        continue
                    ctx = ErrorContext(run_id, lease_id=lid)
                    raise error_for(err, ctx) from None
                return (None if got is None else work_answer(got)), None

        return await long_poll(
            self.waker, run_id, keys.WORK_WAKE, body.max_prompts, body.wait_s, attempt
        )

    async def return_work(
        self,
        run_id: str,
        lease_id: str,
        prompt_ids: Sequence[str] | None,
        partials: Sequence[PartialJSON | PartialMsgpack] = (),
    ) -> ReturnResult:
        """Give prompts back, with the partials sampled so far of their responses."""
        if prompt_ids is not None and not prompt_ids:
            if partials:
                raise ValidationFailed(
                    "partials given with no prompt to return (partial_not_returned)"
                )
            return ReturnResult(returned=0)  # an empty list returns nothing (None: all)
        self.check_count(len(partials))
        packed = pack_partials(partials, self.max_tokens)
        with self._refusals(run_id, lease_id=lease_id):
            n = await self.store.return_work(run_id, lease_id, prompt_ids, packed)
        return ReturnResult(returned=n)

    # -- maintenance ----------------------------------------------------------------------
    async def sweep_all(self) -> int:
        """One clean-up pass over the runs of the active index; returns rollouts retired. A
        closed run that has settled is parked and leaves the index, so closed and deleted runs
        cost the pass nothing."""
        total = 0
        for rid, token in await self.store.active_runs():
            while True:
                step = await self.store.maintain(rid, token)
                total += step.total
                if not step.more:
                    break
            if step.state in ("parked", "deleted") or (
                step.state == "missing" and step.now_ms - token > ORPHAN_GRACE_MS
            ):
                await self.store.deactivate(rid, token)
            await asyncio.sleep(0)
        return total
