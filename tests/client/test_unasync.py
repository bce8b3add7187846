"""``clients/python/rollout_broker_client/_sync.py`` is exactly what
``scripts/unasync_client.py`` generates from
``_async.py``, so the blocking and asyncio clients cannot drift apart."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "unasync_client", REPO / "scripts" / "unasync_client.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


script = load_script()


def test_sync_client_is_generated_from_async() -> None:
    expected = script.generate(script.ASYNC_PY.read_text(encoding="utf-8"))
    actual = script.SYNC_PY.read_text(encoding="utf-8")
    assert actual == expected, "the blocking client is stale: run python scripts/unasync_client.py"


def test_generated_file_says_so() -> None:
    assert script.SYNC_PY.read_text(encoding="utf-8").startswith(script.HEADER)


def test_stale_docstring_rule_fails() -> None:
    source = script.ASYNC_PY.read_text(encoding="utf-8")
    changed = source.replace("An asyncio client of one broker.", "An asyncio broker client.")
    assert changed != source
    with pytest.raises(ValueError, match="update PROSE"):
        script.generate(changed)
