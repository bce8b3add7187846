"""The Lua libraries (app/broker/lua/lib) hold together: each script's declared libraries define
every name it uses, before it uses it; what a call changes of the libraries' state is reset at
the start of every call; and the admission count `adm` changes in one library only.

Redis compiles a function that calls an undefined function (FUNCTION LOAD succeeds) and fails
only when the call runs, so the names are checked here in the text."""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

import pytest

from app import keys
from app.broker.scripts import LIBRARY, SCRIPTS, lua_source

LUA = Path(str(resources.files("app.broker") / "lua"))
ADMISSION = LUA / "lib" / "admission.lua"

# Comments and string literals, in one pattern so that each is found where it starts: a '--'
# inside a string is not a comment, a quote inside a comment starts no string.
_COMMENT_OR_STRING = re.compile(r"""--[^\n]*|'(?:\\.|[^'\\\n])*'|"(?:\\.|[^"\\\n])*\"""")
# Lua's keywords, and what Redis's Lua provides.
_BUILTIN = re.compile(
    r"(and|break|do|else|elseif|end|false|for|function|if|in|local|nil|not|or|repeat|return"
    r"|then|true|until|while|redis|cjson|cmsgpack|bit|struct|string|table|math|tonumber"
    r"|tostring|ipairs|pairs|unpack|type|error|pcall|select|next|assert|KEYS|ARGV)"
)
_NAME = re.compile(r"(?<![\w.:])[A-Za-z_]\w*")


def without_comments(src: str, strings: bool = False) -> str:
    """``src`` with its comments blanked (and its string literals, when ``strings``)."""

    def blank(m: re.Match[str]) -> str:
        text = m.group()
        return " " if text.startswith("--") or strings else text

    return _COMMENT_OR_STRING.sub(blank, src)


def definitions(code: str) -> dict[str, int]:
    """Each name a local, a function parameter or a loop variable declares: where it first does."""
    found: dict[str, int] = {}
    patterns = (
        r"\blocal\s+function\s+(\w+)",
        r"\blocal\s+(\w+(?:\s*,\s*\w+)*)",
        r"\bfunction\s*[\w.]*\s*\(([^)]*)\)",
        r"\bfor\s+(\w+(?:\s*,\s*\w+)*)\s+in\b",
        r"\bfor\s+(\w+)\s*=",
    )
    for pattern in patterns:
        for m in re.finditer(pattern, code):
            for name in re.split(r"\s*,\s*", m.group(1).strip()):
                if name and name != "...":
                    found[name] = min(found.get(name, m.start()), m.start())
    return found


def undefined(src: str) -> set[str]:
    """Names ``src`` uses that nothing in it defines before the use: a function called or passed
    on, a constant or a piece of a call's state (an upper-case name). A lower-case name followed
    by '=' is a table key or an assignment, and is left out."""
    code = without_comments(src, strings=True)
    defined = definitions(code)
    missing = set()
    for m in _NAME.finditer(code):
        name = m.group()
        if _BUILTIN.fullmatch(name):
            continue
        if not name.isupper() and re.match(r"\s*=(?!=)", code[m.end() :]):
            continue
        if defined.get(name, len(code)) > m.start():
            missing.add(name)
    return missing


# Each script as it would run with only the libraries it names: they must be enough.
SOURCES = {name: lua_source((LUA / f"{name}.lua").read_text()) for name in SCRIPTS}


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_a_scripts_libraries_define_every_name_it_uses(name):
    assert undefined(SOURCES[name]) == set()


def test_the_library_defines_every_name_its_functions_use():
    assert undefined(LIBRARY.code.split("\n", 1)[1]) == set()  # after the '#!lua' line


# The libraries' state lives in locals of the library's main chunk, which Redis runs once, when
# it loads the library: a call that changes one must have it reset by per_call() at the start
# of every call, or the next call (of any run) starts from what this one left.
# A call's resets: the per_call() functions, and bind() of the key names (app/keys.py).
_PER_CALL = re.compile(
    r"^(?:per_call\(function\(\)|local function bind\(run\))(.*?)(?:\bend\)|^end$)", re.S | re.M
)
_TOP_LOCAL = re.compile(r"^local (?!function)([\w, ]+)", re.M)
_TARGETS = re.compile(
    r"(?:^[ \t]*|\b(?:then|do|else) )([\w.\[\]'\" ]+(?:,\s*[\w.\[\]'\" ]+)*)\s*=(?!=)", re.M
)
_INSERT = re.compile(r"table\.insert\((\w+(?:\.\w+)?)")


def _state_name(target: str, state: set[str]) -> str | None:
    """The piece of state an assignment's target changes (``X``, ``T.f``), if any."""
    path = re.split(r"\[", target.strip(), maxsplit=1)[0].split(".")
    if path[0] not in state:
        return None
    return ".".join(path[:2])


def unreset_state(code: str) -> set[str]:
    """Pieces of the libraries' state (top-level locals, and fields of top-level tables) that
    some code changes and no per_call() reset assigns."""
    code = without_comments(code, strings=True)
    state = {n.strip() for m in _TOP_LOCAL.finditer(code) for n in m.group(1).split(",")}
    reset: set[str] = set()
    for block in _PER_CALL.findall(code):
        for m in _TARGETS.finditer(block):
            reset |= {t.strip() for t in m.group(1).split(",")}
    rest = _PER_CALL.sub("", code)
    changed = set()
    for m in _TARGETS.finditer(rest):
        at_top = (m.start() == 0 or rest[m.start() - 1] == "\n") and not m.group(0)[0].isspace()
        if m.group(0).startswith("local ") or at_top:
            continue  # a declaration, or a statement of the main chunk: made once, at load
        for target in m.group(1).split(","):
            changed.add(_state_name(target, state))
    changed |= {_state_name(m.group(1), state) for m in _INSERT.finditer(rest)}
    return {c for c in changed if c and c not in reset and c.split(".")[0] not in reset}


def test_every_piece_of_a_calls_state_is_reset_at_each_call():
    libs = keys.lua_prologue() + "\n".join(
        p.read_text() for p in sorted((LUA / "lib").glob("*.lua"))
    )
    assert unreset_state(libs) == set()
    # The check finds what it looks for.
    leaky = "local N\nlocal T = {}\nlocal function f()\n  N = 1\n  T.x[2] = 3\nend\n"
    assert unreset_state(leaky) == {"N", "T.x"}
    assert unreset_state(leaky + "per_call(function() N, T.x = 0, {} end)\n") == set()
    assert unreset_state("local L = {}\nlocal function g() table.insert(L, 1) end\n") == {"L"}
    assert unreset_state(libs.replace("GEN.del, GEN.on =", "GEN.dex, GEN.on =")) == {"GEN.del"}


def test_a_missing_library_is_found():
    assert undefined(lua_source("-- requires: run\nreturn finish()")) == {"finish"}
    ack = (
        (LUA / "ack.lua")
        .read_text()
        .replace("-- requires: cleanup, finish", "-- requires: batches")
    )
    assert {"finish", "retire_below"} <= undefined(lua_source(ack))
    # Used before its library comes: the library's functions see it as an undefined global.
    assert undefined("local function f() return g() end\nlocal function g() end") == {"g"}
    assert undefined("each_unit(units, rows, settle)") >= {"each_unit", "settle"}
    assert undefined("WOKE = true") == {"WOKE"}


def test_every_library_is_used_by_some_script():
    loaded = "\n".join(SOURCES.values())
    for path in (LUA / "lib").glob("*.lua"):
        assert path.read_text() in loaded, path.name


# In the admission library: the read of admission_left() and the write of finish().
_ADM_ALLOWED = ("redis.call('HGET', RUN, 'adm')", "redis.call('HINCRBY', RUN, 'adm', ADM_DELTA)")
_ADM = re.compile(r"['\"]adm['\"]|\bADM_DELTA\b")


def admission_changes(path_name: str, src: str) -> list[str]:
    """Lines of ``src`` that touch the admission count outside its library: the run's 'adm'
    field or the call's ADM_DELTA. In the admission library, ADM_DELTA may change only in its
    declaration, admit() and release(), and 'adm' only be read and have ADM_DELTA added."""
    code = without_comments(src)
    if path_name != ADMISSION.name:
        return [line for line in code.splitlines() if _ADM.search(line)]
    rest = re.sub(r"local function (admit|release)\(\w*\) ADM_DELTA = [^\n]* end\n", "", code)
    bad = []
    for line in rest.splitlines():
        declared = ("local ADM_DELTA", "per_call(function() ADM_DELTA = 0 end)")
        if re.search(r"\bADM_DELTA\s*=(?!=)", line) and line.strip() not in declared:
            bad.append(line)
        for allowed in _ADM_ALLOWED:
            line = line.replace(allowed, "")
        if re.search(r"['\"]adm['\"]", line):
            bad.append(line)
    return bad


def test_the_admission_count_changes_only_through_admit_and_release():
    for path in LUA.rglob("*.lua"):
        if path != ADMISSION:
            assert admission_changes(path.name, path.read_text()) == [], path.name
    assert admission_changes(ADMISSION.name, ADMISSION.read_text()) == []
    # The check finds what it looks for.
    assert admission_changes("ingest.lua", "ADM_DELTA = ADM_DELTA + 1\n") != []
    assert admission_changes("work.lua", "redis.call('HINCRBY', RUN, 'adm', 1)\n") != []
    src = ADMISSION.read_text()
    assert admission_changes(ADMISSION.name, src + "\nADM_DELTA = 0\n") != []
    extra = "\nredis.call('HSET', RUN, 'adm', 0)\n"
    assert admission_changes(ADMISSION.name, src + extra) != []
