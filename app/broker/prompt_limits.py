"""The bounds of registered prompts and work leases, and the stored form of a prompt."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgpack
import numpy as np
import orjson

from app.broker.packing import Int32Array, StoredRollout, token_ids
from app.broker.records import LeasedRollout
from app.broker.schemas import PromptJSON, PromptsBody
from app.errors import ValidationFailed


@dataclass(frozen=True, slots=True)
class PromptLimits:
    """Bounds of registered prompts and work leases (the BROKER_MAX_PROMPT* settings)."""

    per_request: int = 4096  # prompt passes (prompts × epochs) in one registration
    tokens: int = 262_144
    data_bytes: int = 65_536
    per_lease: int = 1024

    def check_count(self, n: int) -> None:
        """The most prompts one registration may carry (each makes one pass at least)."""
        if n > self.per_request:
            raise ValidationFailed(
                f"{n} prompts in one request, at most {self.per_request} prompt passes"
            )

    def pack(
        self, body: PromptsBody, prompts: Sequence[PromptJSON], count: int
    ) -> list[tuple[str, bytes]]:
        """The stored form of ``prompts`` by prompt id: some or all of the ``count`` of the
        registration ``body`` (the API packs a big body's prompts one at a time)."""
        # One script call writes every pass: bound the passes, not only the prompts.
        passes = count * body.epochs
        if passes > self.per_request:
            raise ValidationFailed(
                f"{count} prompts × {body.epochs} epochs = {passes} prompt passes "
                f"in one request, at most {self.per_request}"
            )
        return [(p.prompt_id, self.pack_one(p)) for p in prompts]

    def pack_one(self, prompt: PromptJSON) -> bytes:
        """The stored form of a prompt, within these bounds."""
        pid, ids = prompt.prompt_id, prompt.prompt_ids
        if ids is not None:
            if len(ids) > self.tokens:
                raise ValidationFailed(
                    f"prompt {pid!r}: {len(ids)} prompt_ids, at most {self.tokens}"
                )
            token_ids(ids, f"prompt {pid!r}: prompt_ids")
        if prompt.data is not None:
            size = len(orjson.dumps(prompt.data))
            if size > self.data_bytes:
                raise ValidationFailed(
                    f"prompt {pid!r}: data is {size} bytes as JSON, at most {self.data_bytes}"
                )
        packed: bytes = msgpack.packb({"i": ids, "d": prompt.data})
        return packed


def prompt_tokens(packed: bytes) -> Int32Array | None:
    """The registered token ids of a prompt in its stored form (None: it has none)."""
    ids = msgpack.unpackb(packed, raw=False)["i"]
    return None if ids is None else np.asarray(ids, dtype=np.int32)


def with_prompts(
    rollouts: Sequence[StoredRollout], leased: Sequence[LeasedRollout]
) -> list[tuple[StoredRollout, str | None]]:
    """A lease's rollouts as handed out, with the prompt_id of each posted under a work lease,
    which then carries the registered prompt's tokens when it was posted without any (each
    prompt's are unpacked once)."""
    tokens = {lr.prompt_id: prompt_tokens(lr.prompt) for lr in leased if lr.prompt is not None}
    return [
        (
            r
            if r.prompt_ids is not None or lr.prompt_id is None
            else r._replace(prompt_ids=tokens.get(lr.prompt_id)),
            lr.prompt_id,
        )
        for r, lr in zip(rollouts, leased, strict=True)
    ]
