"""What the parts of :class:`app.broker.store.RedisStore` written as mixins (batch calls,
consumer calls) use of the store itself, declared once for the type checker."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["StorePart"]


class StorePart:
    """The store's script call and blob read, which RedisStore defines."""

    async def _call(self, name: str, run_id: str, *args: Any) -> list[Any]:
        raise NotImplementedError  # RedisStore's

    async def blobs(self, run_id: str, rollout_ids: Sequence[str]) -> list[bytes | None]:
        raise NotImplementedError  # RedisStore's
