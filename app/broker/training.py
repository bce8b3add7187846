"""What a trainer does with a leased batch (SPEC "Batches"): measure it before the update, ack it
after, or give it back. The rules are the scripts' (``measure.lua``, ``ack.lua``,
``nack.lua``); the figures are numpy's (app/broker/acks.py, measures.py, stats.py,
correction.py); this module reads the batch, checks the request and shapes the answers."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from app.broker.acks import ack_result, acked_event, batch_row, check_ack_ids, current_logprobs
from app.broker.acks import figures as ack_figures
from app.broker.behaviour import BatchRow, BehaviourCache
from app.broker.measures import (
    MeasureAnswer,
    check_all_named,
    generator_sums,
    measure_answer,
    pack_measured,
    unpack_measured,
)
from app.broker.replies import ErrorContext, StoreError, error_for
from app.broker.schemas import AckBody, AckResult, NackResult
from app.broker.store import BatchView, RedisStore
from app.errors import BrokerError, ValidationFailed

__all__ = ["Training"]

Refusals = Callable[..., AbstractContextManager[None]]


class Training:
    """The trainers' part of the broker, after the lease."""

    def __init__(
        self,
        store: RedisStore,
        behaviour: BehaviourCache,
        refusals: Refusals,
        *,
        max_batch_size: int,
    ) -> None:
        """``behaviour`` keeps what this process leased; ``refusals`` is the broker's
        (app/broker/service.py ``Broker._refusals``)."""
        self.store = store
        self.behaviour = behaviour
        self._refusals = refusals
        self.max_batch_size = max_batch_size

    def check_count(self, n: int, call: str = "ack") -> None:
        """The most rollouts one ack or measure may name (in its logprobs, or its kl): a
        batch's."""
        if n > self.max_batch_size:
            raise ValidationFailed(
                f"{n} rollouts named in one {call}, at most {self.max_batch_size} "
                "(the largest batch)"
            )

    async def ack(self, run_id: str, batch_id: str, body: AckBody) -> AckResult:
        """Acknowledge the batch; without ``logprobs`` in the body, with those the last
        measure kept for every rollout it gives no ``kl`` for."""
        ready_kl = body.kl or {}
        view, rows = await self.batch(run_id, batch_id, measured=body.logprobs is None)
        if view.answer is not None:  # acked before: the same answer again
            self.behaviour.pop(run_id, batch_id)
            return ack_result(view.answer, view.size)
        check_ack_ids(batch_id, rows, body.logprobs or {}, ready_kl)
        if body.logprobs is None:
            kept = {} if view.measured is None else unpack_measured(rows, view.measured)
            current = {rid: lp for rid, lp in kept.items() if rid not in ready_kl}
        else:
            current = current_logprobs(rows, body.logprobs)
        named = any(row.generator is not None for row in rows)
        fig, stats = ack_figures(rows, current, ready_kl, view.config, per_rollout=named)
        gens = generator_sums(rows, fig) if named else ()
        event = acked_event(batch_id, body.step, view.policy_version, rows, fig, stats, gens)
        try:
            with self._refusals(run_id, batch_id=batch_id):
                _, answer = await self.store.ack(
                    run_id,
                    batch_id,
                    kl_mean=fig.kl_mean,
                    event=event,
                    stats_text=stats.model_dump_json(),
                )
        finally:
            self.behaviour.pop(run_id, batch_id)
        return ack_result(answer, view.size)

    async def measure(self, run_id: str, batch_id: str, logprobs: dict[str, Any]) -> MeasureAnswer:
        """The batch's correction from the trainer's logprobs on every rollout, which are then
        kept with the lease for its ack."""
        view, rows = await self.batch(run_id, batch_id)
        if view.answer is not None:
            raise error_for(StoreError("batch_settled", "acked"), ErrorContext(run_id, batch_id))
        check_all_named(batch_id, rows, logprobs)
        current = current_logprobs(rows, logprobs, "measure")
        answer = measure_answer(rows, current, view.config)
        try:
            with self._refusals(run_id, batch_id=batch_id):
                beta = await self.store.measure(run_id, batch_id, pack_measured(rows, current))
        except BrokerError:
            self.behaviour.pop(run_id, batch_id)  # settled or expired: no ack will come
            raise
        return dataclasses.replace(answer, kl_coef=beta)

    async def batch(
        self, run_id: str, batch_id: str, *, measured: bool = False
    ) -> tuple[BatchView, list[BatchRow]]:
        """The batch's state and, while it is leased, its rollouts as the ack measures them:
        kept from this process's lease, else read back from Redis with the stored blobs; with
        ``measured``, the logprobs a measure kept."""
        kept = self.behaviour.get(run_id, batch_id)
        try:
            with self._refusals(run_id, batch_id=batch_id):
                view = await self.store.batch_view(
                    run_id,
                    batch_id,
                    # The blobs hold each rollout's mask and versions: what it trained.
                    rollouts="none" if kept is not None else "blobs",
                    measured=measured,
                )
        except BrokerError:
            self.behaviour.pop(run_id, batch_id)  # nacked, expired or gone: no ack will come
            raise
        if kept is not None:
            return view, kept
        return view, [batch_row(m, view.policy_version, view.token_floor) for m in view.members]

    async def nack(self, run_id: str, batch_id: str) -> NackResult:
        self.behaviour.pop(run_id, batch_id)
        with self._refusals(run_id, batch_id=batch_id):
            _, n = await self.store.nack(run_id, batch_id)
        return NackResult(returned=n)
