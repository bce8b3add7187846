"""The store's calls on a leased batch (SPEC "Batches"): its read before an ack or a measure
(``batch_view.lua``), the measured logprobs kept with it (``measure.lua``), its ack
(``ack.lua``) and its nack (``nack.lua``). A part of :class:`app.broker.store.RedisStore`,
which gives it its script calls and rollout reads."""

from __future__ import annotations

from typing import Any, Literal

from app.broker.config import RunConfig
from app.broker.records import BatchMember, BatchView
from app.broker.replies import AckAnswer, ack_answer, beta_of, text
from app.broker.store_parts import StorePart
from app.caller import BROKER, action_entry

__all__ = ["ACK_FLUSH_LIMIT", "SWEEP_LIMIT", "BatchCalls", "floor_of"]

SWEEP_LIMIT = 1000  # units retired / leases expired per bounded call
ACK_FLUSH_LIMIT = 10 * SWEEP_LIMIT  # units a kl_flush retires within the ack itself


def floor_of(raw: Any) -> int | None:
    """A token floor as the lease script replies it ('' : none)."""
    t = text(raw)
    return int(t) if t else None


class BatchCalls(StorePart):
    """The calls on a leased batch; :class:`app.broker.store.RedisStore` has the rest."""

    async def batch_view(
        self,
        run_id: str,
        batch_id: str,
        *,
        rollouts: Literal["none", "meta", "blobs"],
        measured: bool = False,
    ) -> BatchView:
        """The batch's state and, while it is leased and unless ``rollouts`` is 'none', its
        rollouts ('blobs': with their packed rollouts); with ``measured``, the logprobs kept by
        :meth:`measure`. StoreError for no such run or batch, and for a batch that was nacked
        or expired."""
        state, cfg, version, size, rest, *tail = await self._call(
            "batch_view",
            run_id,
            batch_id,
            "none" if rollouts == "none" else "meta",
            "1" if measured else "",
        )
        config = RunConfig.model_validate_json(cfg)
        if text(state) == "acked":
            return BatchView(config, "acked", int(version), int(size), ack_answer(rest), [])
        rids = [text(rid) for rid, _, _ in rest]
        blobs: list[bytes | None] = [None] * len(rids)
        if rollouts == "blobs":
            blobs = await self.blobs(run_id, rids)
        members = [
            BatchMember(rid, int(v), int(n), blob)
            for rid, (_, v, n), blob in zip(rids, rest, blobs, strict=True)
        ]
        floor, ml = tail
        return BatchView(
            config, "leased", int(version), int(size), None, members, floor_of(floor), ml or None
        )

    async def measure(self, run_id: str, batch_id: str, ml: bytes) -> float | None:
        """Keep the measured logprobs ``ml`` with the batch's live lease; the adaptive KL
        penalty's β to use now (None when off). StoreError for no such run or batch, for a
        batch that was settled, and for a lease that ran out."""
        _, beta = await self._call("measure", run_id, batch_id, ml)
        return beta_of(beta)

    async def ack(
        self,
        run_id: str,
        batch_id: str,
        *,
        kl_mean: float | None,
        event: bytes,
        stats_text: str,
    ) -> tuple[Literal["acked", "repeat"], AckAnswer]:
        """('acked', answer), or ('repeat', the answer stored by the first ack); StoreError
        for no such run or batch, and for a batch that was nacked or expired.

        ``event`` is the msgpack payload of the ``acked`` event; its items carry each rollout's
        measured KL, which the script also gates on."""
        outcome, answer = await self._call(
            "ack",
            run_id,
            batch_id,
            "" if kl_mean is None else repr(kl_mean),
            event,
            stats_text,
            ACK_FLUSH_LIMIT,
            # The audit entry of a quarantine this ack may make (lua/lib/quarantine.lua).
            action_entry(BROKER, "generator.quarantine", run_id, {}),
        )
        return ("acked" if text(outcome) == "acked" else "repeat"), ack_answer(answer)

    async def nack(self, run_id: str, batch_id: str) -> tuple[Literal["nacked", "repeat"], int]:
        """('nacked', rollouts returned), or ('repeat', the same count) for a batch nacked
        before; StoreError for no such run or batch, and for one acked or expired."""
        outcome, returned = await self._call("nack", run_id, batch_id)
        return ("nacked" if text(outcome) == "nacked" else "repeat"), int(returned)
