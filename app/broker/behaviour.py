"""What an ack needs of the batches this process leased, kept from the lease until the ack.

An ack is measured against the behaviour logprobs stored at ingest, rollout by rollout. The
process that leased a batch has just read them, with each rollout's version and length, so it
keeps them (bounded by bytes, oldest batch dropped first) and its ack reads only the batch's
state from Redis. An ack that reaches another API replica, or comes after its batch was
dropped, reads the rollouts back from Redis instead. A stored rollout never changes and a
batch's rollouts are fixed when it is leased, so both give the same answer.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from app.broker.tokens import HandOut

__all__ = ["BatchRow", "BehaviourCache"]

_ROW_BYTES = 128  # what a row costs besides its logprobs, roughly: ids, ints, the object


class BatchRow(NamedTuple):
    """One rollout of a leased batch, as the ack measures it (a named tuple: one is built per
    rollout of every lease)."""

    rollout_id: str
    policy_version: int  # the version it is counted under (lib/run.lua governing_version)
    tokens: int  # response tokens
    old: npt.NDArray[np.float32] | None  # behaviour logprobs, None if ingested without
    given: HandOut  # its mask, trained tokens and token lag as the lease handed it out
    generator: str | None = None  # its generator_id, None if it has none
    reward: float | None = None  # its reward (a leased rollout always has one)


class BehaviourCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._batches: OrderedDict[tuple[str, str], tuple[list[BatchRow], int]] = OrderedDict()
        self._bytes = 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def put(self, run_id: str, batch_id: str, rows: list[BatchRow]) -> None:
        size = sum(
            _ROW_BYTES
            + (r.old.nbytes if r.old is not None else 0)
            + (r.given.mask.nbytes if r.given.mask is not None else 0)
            for r in rows
        )
        self.pop(run_id, batch_id)
        if size > self.max_bytes:
            return
        self._batches[(run_id, batch_id)] = (rows, size)
        self._bytes += size
        while self._bytes > self.max_bytes:
            _, (_, dropped) = self._batches.popitem(last=False)
            self._bytes -= dropped

    def get(self, run_id: str, batch_id: str) -> list[BatchRow] | None:
        got = self._batches.get((run_id, batch_id))
        return None if got is None else got[0]

    def pop(self, run_id: str, batch_id: str) -> None:
        got = self._batches.pop((run_id, batch_id), None)
        if got is not None:
            self._bytes -= got[1]
