"""The behaviour logprobs of the batches this process leased, kept until their ack.

An ack with current logprobs needs the behaviour logprobs stored at ingest. The process that
leased a batch has just read them, so it keeps them (bounded by bytes, oldest dropped first);
an ack that reaches another API replica, or comes after its batch was dropped, reads them from
Redis instead. Rollouts never change once stored, so both sources agree.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import numpy.typing as npt

__all__ = ["BehaviourCache"]

Logprobs = dict[str, npt.NDArray[np.float32] | None]  # rollout_id -> behaviour logprobs


class BehaviourCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._batches: OrderedDict[tuple[str, str], tuple[Logprobs, int]] = OrderedDict()
        self._bytes = 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def put(self, run_id: str, batch_id: str, logprobs: Logprobs) -> None:
        size = sum(a.nbytes for a in logprobs.values() if a is not None)
        self.pop(run_id, batch_id)
        if size > self.max_bytes:
            return
        self._batches[(run_id, batch_id)] = (logprobs, size)
        self._bytes += size
        while self._bytes > self.max_bytes:
            _, (_, dropped) = self._batches.popitem(last=False)
            self._bytes -= dropped

    def get(self, run_id: str, batch_id: str) -> Logprobs | None:
        got = self._batches.get((run_id, batch_id))
        return None if got is None else got[0]

    def pop(self, run_id: str, batch_id: str) -> None:
        got = self._batches.pop((run_id, batch_id), None)
        if got is not None:
            self._bytes -= got[1]
