"""The broker's Lua scripts as Redis runs them: one function library (Redis 7 ``FUNCTION
LOAD``), loaded once per server and called with ``FCALL``.

The library's main chunk, run once when Redis loads it, declares the key names
(:func:`app.keys.lua_prologue`) and defines every library of ``lua/lib`` in dependency order (a
file's first line names the libraries it uses: ``-- requires: units, finish``). Each script of
``lua/`` becomes one function whose body is the script as written: it starts with ``begin``,
which binds the key names to the run of KEYS[1] and resets the call's state (each library hands
the reset of its own to ``per_call``), then the parked-run guard, then the script.

The library's name and its functions' names carry a digest of its text, so processes of two
versions of the broker on one Redis each call their own code.
"""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass
from importlib import resources

from app import keys

__all__ = ["LIBRARY", "SCRIPTS", "Library", "guarded", "library", "lua_source"]

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

# The state of one call lives in locals of the main chunk (upvalues of the functions), which
# outlive the call: each library that keeps some hands per_call() the function that resets it.
_CALL_STATE = """
local PER_CALL = {}
local function per_call(reset) PER_CALL[#PER_CALL + 1] = reset end
"""
_BEGIN = """
local function begin(keys, args)
  KEYS, ARGV = keys, args
  bind(keys[1])
  for i = 1, #PER_CALL do PER_CALL[i]() end
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


@functools.cache
def _scripts() -> dict[str, str]:
    pkg = resources.files("app.broker") / "lua"
    return {name: (pkg / f"{name}.lua").read_text() for name in SCRIPTS}


def _with_libraries(names: list[str], order: list[str]) -> list[str]:
    """``order`` extended by ``names`` and what they require, each library after its own."""
    for name in names:
        if name not in order:
            _with_libraries(_requires(_libraries()[name]), order)
            order.append(name)
    return order


def _main_chunk(libs: list[str], keys_args: str) -> list[str]:
    """The declarations, the libraries named (and theirs) in dependency order, and ``begin``."""
    code = [_libraries()[name] for name in _with_libraries(libs, [])]
    return [keys_args, _CALL_STATE, keys.lua_prologue(), *code, _BEGIN]


def lua_source(src: str) -> str:
    """A piece of Lua run with EVAL as the library's functions run: the key names, the
    libraries ``src`` requires, ``begin`` and ``src`` (the tests of the libraries use it)."""
    chunk = _main_chunk(_requires(src), "local KEYS, ARGV = KEYS, ARGV")
    return "\n".join([*chunk, "begin(KEYS, ARGV)", src])


@dataclass(frozen=True)
class Library:
    """The library's name, its code as ``FUNCTION LOAD`` takes it, and each script's function."""

    name: str
    code: str
    functions: dict[str, str]


def guarded(name: str) -> str:
    """Script ``name`` as its function runs it after ``begin``: the parked-run guard (unless
    the script handles a parked run itself), then the script."""
    guard = "" if name in _PARK_AWARE else _PARKED_GUARD
    return f"{guard}\n{_scripts()[name]}"


def _function(name: str, fname: str) -> str:
    head = f"redis.register_function('{fname}', function(keys, args)\nbegin(keys, args)"
    return f"{head}\n{guarded(name)}\nend)\n"


@functools.cache
def library() -> Library:
    every = sorted(_libraries())
    chunk = "\n".join(_main_chunk(every, "local KEYS, ARGV"))
    bodies = "\n".join(_function(name, f"{{}}{name}") for name in SCRIPTS)
    digest = hashlib.sha1((chunk + bodies).encode()).hexdigest()[:16]
    prefix = f"rollout_broker_{digest}_"
    functions = {name: prefix + name for name in SCRIPTS}
    code = "\n".join(
        [
            f"#!lua name=rollout_broker_{digest}",
            chunk,
            *(_function(name, fname) for name, fname in functions.items()),
        ]
    )
    return Library(f"rollout_broker_{digest}", code, functions)


LIBRARY = library()
