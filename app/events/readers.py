"""The readers of the decoder: strict about meaning (a wrong type, a non-finite float, an integer
outside int64, a text the ledger cannot hold raise :class:`EventError`), lenient about encoding
(msgpack bin for strings, whole floats as integers, an array with holes as a map keyed 1..n)."""

from __future__ import annotations

import math
from typing import Any

from app.events.wire import _INT64_MAX, _INT64_MIN, EventError, text_fault


def read_text(value: Any, what: str) -> str:
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            raise EventError(f"{what}: not UTF-8") from None
    if not isinstance(value, str):
        raise EventError(f"{what}: expected a string, got {type(value).__name__}")
    fault = text_fault(value)
    if fault is not None:
        raise EventError(f"{what}: {fault}")
    return value


def read_int(value: Any, what: str, *, minimum: int = _INT64_MIN) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise EventError(f"{what}: expected an integer, got {type(value).__name__}")
    if not minimum <= value <= _INT64_MAX:
        raise EventError(f"{what}: {value} out of range")
    return value


def read_float(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise EventError(f"{what}: expected a number, got {type(value).__name__}")
    result = float(value)
    if not math.isfinite(result):
        raise EventError(f"{what}: not finite")
    return result


def read_flag(value: Any, what: str) -> bool:
    if isinstance(value, bool):
        return value
    if value in (0, 1):
        return bool(value)
    raise EventError(f"{what}: expected 0 or 1")


def read_map(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise EventError(f"{what}: expected a map with string keys")
    return value


def read_opt_map(value: Any, what: str) -> dict[str, Any]:
    return {} if value is None else read_map(value, what)


def read_json(value: Any, what: str, depth: int = 0) -> Any:
    """A value that JSONB can store as it is (the run config is kept verbatim)."""
    if depth > 32:
        raise EventError(f"{what}: nested too deeply")
    if value is None or isinstance(value, bool | int | str):
        if isinstance(value, int) and not isinstance(value, bool):
            return read_int(value, what)
        return read_text(value, what) if isinstance(value, str) else value
    if isinstance(value, float):
        return read_float(value, what)
    if isinstance(value, bytes):
        return read_text(value, what)
    if isinstance(value, list):
        return [read_json(v, what, depth + 1) for v in value]
    if isinstance(value, dict):
        return {read_text(k, what): read_json(v, what, depth + 1) for k, v in value.items()}
    raise EventError(f"{what}: {type(value).__name__} is not JSON")


def read_array(value: Any, what: str) -> list[Any]:
    """A list, or the map a Lua encoder writes for an array with holes (keys 1..n)."""
    if isinstance(value, list):
        return value
    if isinstance(value, dict) and all(
        isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= 4096 for k in value
    ):
        size = max(value, default=0)
        return [value.get(i) for i in range(1, size + 1)]
    if isinstance(value, dict) and not value:
        return []
    raise EventError(f"{what}: expected an array")
