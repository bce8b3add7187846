"""Consumers (SPEC "Consumers"): reward-model and preference trainers reading a run beside the
policy trainer. The rules are the scripts' (app/broker/lua/lib/consumers.lua and the
``consumer_*.lua`` scripts, through app/broker/consumer_calls.py); this module checks requests,
waits, and shapes the answers."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from app import keys
from app.broker.consumer_calls import ConsumerLease, ConsumerView
from app.broker.consumer_schemas import (
    ConsumerAckResult,
    ConsumerBody,
    ConsumerNackResult,
    ConsumerOut,
)
from app.broker.notify import Try, Waker, long_poll
from app.broker.packing import StoredRollout, unpack_rollouts
from app.broker.replies import ErrorContext, StoreError, error_for
from app.broker.store import RedisStore
from app.broker.tokens import unpack_mask
from app.broker.views import iso_ms
from app.caller import Caller, action_entry

__all__ = ["Consumers", "consumer_out"]

LOST_TRIES = 3  # leases made again when a held rollout's blob was read after its lease ran out


class Consumers:
    """The consumers' part of the broker."""

    def __init__(
        self,
        store: RedisStore,
        waker: Waker,
        *,
        check_wait: Callable[[float], None],
        check_size: Callable[[int], None],
    ) -> None:
        """``check_wait`` and ``check_size`` are the broker's bounds on a long poll's wait and
        on a batch's size (app/broker/service.py)."""
        self.store = store
        self.waker = waker
        self.check_wait = check_wait
        self.check_size = check_size

    def _error(self, err: StoreError, run_id: str, batch_id: str | None = None) -> Exception:
        return error_for(err, ErrorContext(run_id, batch_id=batch_id))

    async def create(self, run_id: str, body: ConsumerBody, by: Caller) -> tuple[ConsumerOut, bool]:
        """The consumer and whether it was created now (False: it existed with this config)."""
        detail = body.model_dump(mode="json")
        entry = action_entry(by, "consumer.create", run_id, detail)
        try:
            outcome = await self.store.create_consumer(
                run_id,
                body.name,
                kind=body.kind,
                source=body.source,
                max_lag=body.max_lag,
                retention_rollouts=body.retention_rollouts,
                min_margin=body.min_margin,
                pairs=body.pairs,
                entry=entry,
            )
        except StoreError as err:
            raise self._error(err, run_id) from None
        return await self.get(run_id, body.name), outcome == "created"

    async def get(self, run_id: str, name: str) -> ConsumerOut:
        try:
            view = await self.store.get_consumer(run_id, name)
        except StoreError as err:
            raise self._error(err, run_id) from None
        if view is None:
            raise self._error(StoreError("consumer_missing", name), run_id)
        return consumer_out(view)

    async def delete(self, run_id: str, name: str, by: Caller) -> None:
        """Delete the consumer; its pending and leased items are counted dropped."""
        entry = action_entry(by, "consumer.delete", run_id, {"name": name})
        try:
            deleted = await self.store.delete_consumer(run_id, name, entry=entry)
        except StoreError as err:
            raise self._error(err, run_id) from None
        if not deleted:
            raise self._error(StoreError("consumer_missing", name), run_id)

    async def lease(
        self, run_id: str, name: str, *, size: int, wait_s: float, batch_id: str | None
    ) -> dict[str, Any] | None:
        """A batch's answer (arrays as numpy: raw bytes in msgpack, lists in JSON), or None
        when nothing was pending within ``wait_s``."""
        self.check_wait(wait_s)
        self.check_size(size)
        bid = batch_id or uuid.uuid4().hex

        async def attempt(t: Try) -> tuple[dict[str, Any] | None, int | None]:
            lost = 0
            while True:
                try:
                    got = await self.store.consumer_lease(
                        run_id, name, batch_id=bid, size=size, wait_ms=t.wait_ms
                    )
                except StoreError as err:
                    if err.code == "lease_lost" and lost < LOST_TRIES and batch_id is None:
                        lost += 1  # a new batch holds what is still pending
                        continue
                    raise self._error(err, run_id, bid) from None
                return (None if got is None else batch_answer(got)), None

        return await long_poll(self.waker, run_id, keys.CONSUMER_WAKE, size, wait_s, attempt)

    async def ack(self, run_id: str, name: str, batch_id: str) -> ConsumerAckResult:
        try:
            _, n = await self.store.consumer_ack(run_id, name, batch_id)
        except StoreError as err:
            raise self._error(err, run_id, batch_id) from None
        return ConsumerAckResult(acked=n)

    async def nack(self, run_id: str, name: str, batch_id: str) -> ConsumerNackResult:
        try:
            _, n = await self.store.consumer_nack(run_id, name, batch_id)
        except StoreError as err:
            raise self._error(err, run_id, batch_id) from None
        return ConsumerNackResult(returned=n)


def consumer_out(view: ConsumerView) -> ConsumerOut:
    cfg = view.config
    return ConsumerOut(
        name=view.name,
        kind=cfg["kind"],
        source=cfg["source"],
        max_lag=cfg["max_lag"],
        min_margin=cfg.get("min_margin"),
        pairs=cfg.get("pairs"),
        retention_rollouts=cfg["retention_rollouts"],
        created_at=iso_ms(view.created_ms),
        delivered=view.delivered,
        acked=view.acked,
        dropped=view.dropped,
        pending=view.pending + view.leased,  # as the accounting counts it
        leased=view.leased,
    )


def rollout_doc(r: StoredRollout) -> dict[str, Any]:
    """A rollout as a consumer receives it."""
    n = r.response_ids.size
    return {
        "rollout_id": r.rollout_id,
        "group_id": r.group_id,
        "policy_version": r.policy_version,
        "prompt_ids": r.prompt_ids,
        "response_ids": r.response_ids,
        "logprobs": r.logprobs,
        "loss_mask": None if r.loss_mask is None else unpack_mask(r.loss_mask, n),
        "versions": r.versions or [[0, r.policy_version]],
        "reward": r.reward,
        "generator_id": r.generator_id,
        "finish_reason": r.finish_reason,
        "metadata": r.metadata,
    }


def batch_answer(got: ConsumerLease) -> dict[str, Any]:
    docs = {
        rid: rollout_doc(r)
        for rid, r in zip(got.rollout_ids, unpack_rollouts(got.blobs), strict=True)
    }
    answer: dict[str, Any] = {
        "batch_id": got.batch_id,
        "lease_expires_at": iso_ms(got.expires_at_ms),
    }
    if got.pairs is None:
        answer["rollouts"] = list(docs.values())
        return answer
    answer["pairs"] = [
        {
            "pair_id": p.pair_id,
            **({} if p.prompt_id is None else {"prompt_id": p.prompt_id}),
            "chosen": docs[p.chosen],
            "rejected": docs[p.rejected],
            "margin": p.margin,
        }
        for p in got.pairs
    ]
    return answer
