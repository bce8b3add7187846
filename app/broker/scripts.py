"""The broker's Lua scripts as Redis runs them: each script of ``lua/`` after the key prologue
(:func:`app.keys.lua_prologue`), the libraries of ``lua/lib`` it names on its first line
(``-- requires: units, finish``) in dependency order, and the parked-run guard."""

from __future__ import annotations

import functools
import re
from importlib import resources

from app import keys

__all__ = ["SCRIPTS", "load_scripts", "lua_source"]

SCRIPTS = (
    "create_run",
    "maintain",
    "wake_run",
    "delete_run",
    "patch_config",
    "set_policy",
    "policy_view",
    "rewind",
    "close_run",
    "ingest",
    "lease",
    "batch_view",
    "ack",
    "nack",
    "measure",
    "sweep",
    "register_prompts",
    "work",
    "work_return",
    "reward_lease",
    "score",
    "reward_return",
    "release",
    "consumer_create",
    "consumer_delete",
    "consumer_view",
    "consumer_lease",
    "consumer_ack",
    "consumer_nack",
)


# A parked run (a closed one that has settled: see maintain.lua) has left the active index, so
# no worker visits it. Every script starts by refusing one, before it changes anything, except
# these, which handle a parked run themselves or only read. The store then takes the run back
# into the index and wakes it, index first (RedisStore._call), and calls again.
_PARK_AWARE = frozenset(
    {
        "create_run",
        "close_run",
        "batch_view",
        "policy_view",
        "maintain",
        "wake_run",
        "delete_run",
        "consumer_view",
    }
)
_PARKED_GUARD = """
if redis.call('HEXISTS', RUN, 'parked') == 1 then
  return err('run_parked', redis.call('HGET', RUN, 'tok') or '0')
end
"""

# A script's or library's first line names the libraries (lua/lib) it uses.
_REQUIRES = re.compile(r"-- requires: ([a-z_, ]*)\n")


def _requires(src: str) -> list[str]:
    m = _REQUIRES.match(src)
    return [name.strip() for name in m.group(1).split(",") if name.strip()] if m else []


@functools.cache
def _libraries() -> dict[str, str]:
    lib = resources.files("app.broker") / "lua" / "lib"
    return {
        f.name.removesuffix(".lua"): f.read_text() for f in lib.iterdir() if f.name.endswith(".lua")
    }


def _with_libraries(names: list[str], order: list[str]) -> list[str]:
    """``order`` extended by ``names`` and what they require, each library after its own."""
    for name in names:
        if name not in order:
            _with_libraries(_requires(_libraries()[name]), order)
            order.append(name)
    return order


def lua_source(src: str, guard: str = "") -> str:
    """A script as Redis runs it: the key prologue, the libraries the script requires in
    dependency order, ``guard``, the script."""
    libs = [_libraries()[name] for name in _with_libraries(_requires(src), [])]
    return "\n".join([keys.lua_prologue(), *libs, guard, src])


def load_scripts() -> dict[str, str]:
    pkg = resources.files("app.broker") / "lua"
    return {
        name: lua_source(
            (pkg / f"{name}.lua").read_text(), "" if name in _PARK_AWARE else _PARKED_GUARD
        )
        for name in SCRIPTS
    }
