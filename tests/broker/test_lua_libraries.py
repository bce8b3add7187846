"""The Lua libraries (app/broker/lua/lib) hold together: each script's declared libraries define
every name it uses, before it uses it, and the admission count `adm` changes in one library only.

Redis compiles a script that calls an undefined function (SCRIPT LOAD succeeds) and fails only
when the call runs, so the names are checked here in the text as the store loads it."""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

import pytest

from app.broker.scripts import load_scripts as _load_scripts
from app.broker.scripts import lua_source

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


SCRIPTS = _load_scripts()


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_a_scripts_libraries_define_every_name_it_uses(name):
    assert undefined(SCRIPTS[name]) == set()


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
    loaded = "\n".join(SCRIPTS.values())
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
        if re.search(r"\bADM_DELTA\s*=(?!=)", line) and line.strip() != "local ADM_DELTA = 0":
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
