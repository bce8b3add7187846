"""Reward workers (SPEC "Rewards"): leases of rollouts to score, their scores, and what a worker
gives back. The rules are the scripts' (``reward_lease.lua``, ``score.lua``,
``reward_return.lua``); this module checks requests, waits, and shapes the answers."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import numpy as np

from app import keys
from app.broker import reward_store
from app.broker.notify import Try, Waker, long_poll
from app.broker.packing import unpack_rollouts
from app.broker.replies import ErrorContext, StoreError, error_for
from app.broker.schemas import RewardLeaseBody, ScoreBody, ScoreResult
from app.broker.store import RedisStore
from app.broker.tokens import unpack_mask
from app.broker.views import iso_ms

__all__ = ["Rewards"]

LOST_TRIES = 3  # leases made again when a rollout retired between the script and its read


class Rewards:
    """The reward workers' part of the broker."""

    def __init__(
        self,
        store: RedisStore,
        waker: Waker,
        *,
        check_wait: Callable[[float], None],
        check_count: Callable[[int], None],
    ) -> None:
        """``check_wait`` and ``check_count`` are the broker's bounds on a long poll's wait and
        on the rollouts one request may name (app/broker/service.py)."""
        self.store = store
        self.waker = waker
        self.check_wait = check_wait
        self.check_count = check_count

    def _error(self, err: StoreError, run_id: str, lease_id: str | None) -> Exception:
        return error_for(err, ErrorContext(run_id, lease_id=lease_id))

    async def lease(self, run_id: str, body: RewardLeaseBody) -> dict[str, Any] | None:
        """A reward lease's answer, or None when nothing awaited a reward within ``wait_s``."""
        self.check_wait(body.wait_s)
        self.check_count(body.max_rollouts)
        lid = body.lease_id or uuid.uuid4().hex

        async def attempt(t: Try) -> tuple[dict[str, Any] | None, int | None]:
            lost = 0
            while True:
                try:
                    got = await reward_store.lease(
                        self.store,
                        run_id,
                        lease_id=lid,
                        max_rollouts=body.max_rollouts,
                        worker_id=body.worker_id,
                        wait_ms=t.wait_ms,
                    )
                except StoreError as err:
                    if err.code == "reward_lease_lost" and lost < LOST_TRIES:
                        lost += 1  # the same lease again holds what is still there
                        continue
                    raise self._error(err, run_id, lid) from None
                return (None if got is None else lease_answer(got)), None

        return await long_poll(
            self.waker, run_id, keys.REWARD_WAKE, body.max_rollouts, body.wait_s, attempt
        )

    async def score(self, run_id: str, body: ScoreBody) -> ScoreResult:
        self.check_count(len(body.rewards))
        try:
            got = await reward_store.score(self.store, run_id, body.lease_id, body.rewards)
        except StoreError as err:
            raise self._error(err, run_id, body.lease_id) from None
        return ScoreResult(scored=got.scored, duplicates=got.duplicates, retired=got.retired)

    async def give_back(self, run_id: str, lease_id: str, rollout_ids: Sequence[str] | None) -> int:
        if rollout_ids is not None:
            self.check_count(len(rollout_ids))
        try:
            return await reward_store.give_back(self.store, run_id, lease_id, rollout_ids)
        except StoreError as err:
            raise self._error(err, run_id, lease_id) from None


def lease_answer(got: reward_store.RewardLease) -> dict[str, Any]:
    """The answer's body (arrays as numpy: raw bytes in msgpack, lists in JSON)."""
    rollouts = unpack_rollouts([r.blob for r in got.rollouts])
    out = []
    for r, lr in zip(rollouts, got.rollouts, strict=True):
        prompt = msgpack.unpackb(lr.prompt, raw=False) if lr.prompt is not None else None
        prompt_ids = r.prompt_ids
        if prompt_ids is None and prompt is not None and prompt["i"] is not None:
            # The registered prompt's tokens, as a trainer's lease gives them.
            prompt_ids = np.asarray(prompt["i"], dtype=np.int32)
        n = r.response_ids.size
        doc: dict[str, Any] = {
            "rollout_id": r.rollout_id,
            "group_id": r.group_id,
            "prompt_ids": prompt_ids,
            "response_ids": r.response_ids,
            "loss_mask": None if r.loss_mask is None else unpack_mask(r.loss_mask, n),
            "metadata": r.metadata,
            "finish_reason": r.finish_reason,
        }
        if lr.prompt_id is not None:
            doc["prompt_id"] = lr.prompt_id
        if prompt is not None:
            doc["data"] = prompt["d"]
        out.append(doc)
    return {
        "lease_id": got.lease_id,
        "expires_at": iso_ms(got.expires_at_ms),
        "rollouts": out,
    }
