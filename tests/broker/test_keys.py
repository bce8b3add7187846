"""The key layout: the strings stay what existing data was written under, the scripts take
every key name from the generated prologue, and docs/design.md lists every key."""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

from app import keys
from app.broker.config import RunConfig
from app.broker.store import RedisStore
from tests.broker.test_store import packed

LUA = Path(str(resources.files("app.broker") / "lua"))
DESIGN = Path(__file__).resolve().parents[2] / "docs" / "design.md"


def test_key_strings_are_the_ones_existing_data_lives_under():
    assert keys.run_key("rb", "r1") == "rb:{r1}:run"
    assert keys.events_key("rb", "r1") == "rb:{r1}:events"
    assert keys.dead_key("rb", "r1") == "rb:{r1}:dead"
    assert keys.member_key("rb", "r1", keys.BLOB, "x") == "rb:{r1}:d:x"
    assert keys.runs_key("rb") == "rb:runs"
    assert keys.active_key("rb") == "rb:active"
    assert keys.wake_channel("rb", "r1") == "rb:{r1}:wake"
    assert keys.run_of_wake_channel("rb", keys.wake_channel("rb", "run-1.b")) == "run-1.b"
    assert keys.run_tag("rb", "r1") == "rb:{r1}"
    assert keys.run_of_wake("rb", keys.run_tag("rb", "run-1.b")) == ("run-1.b", "")
    assert keys.run_of_wake("rb", keys.work_wake("rb", "run-1.b")) == ("run-1.b", keys.WORK_WAKE)


async def test_a_run_writes_only_keys_of_the_layout(store: RedisStore, redis, prefix):
    await store.create_run("r", RunConfig(group_size=2))
    await store.ingest(
        "r", [packed("a", group="g"), packed("b", group="g"), packed("c", group="h")]
    )
    got = await store.lease(
        "r", batch_id="b1", size=2, policy_version=None, partial=False, trainer_id=None
    )
    assert not isinstance(got, int)
    names = {k.decode() async for k in redis.scan_iter(match=keys.every_key(prefix))}
    base = keys.run_base(prefix, "r")
    fixed = {base + suffix for suffix in keys.LUA_KEYS.values()} | {
        keys.runs_key(prefix),
        keys.active_key(prefix),
    }
    families = tuple(base + family for family in keys.LUA_FAMILIES.values())
    assert {n for n in names if n not in fixed and not n.startswith(families)} == set()
    assert keys.member_key(prefix, "r", keys.BLOB, "a") in names
    assert keys.member_key(prefix, "r", keys.BATCH, "b1") in names


def test_the_scripts_spell_no_key_name_of_their_own():
    prologue = keys.lua_prologue()
    for name in [*keys.LUA_KEYS, *keys.LUA_FAMILIES]:
        bound = rf"\n  {re.escape(name)} = (B \.\. '|run\n)"  # set by bind() at every call
        family = rf"\n(local )?function {re.escape(name)}\(id\) return B \.\. '"
        assert re.search(bound, prologue) or re.search(family, prologue), name
    for path in LUA.rglob("*.lua"):  # the scripts and their libraries (lua/lib)
        src = path.read_text()
        assert not re.search(r"\bB \.\.", src), path.name  # only the prologue builds keys


def test_the_design_notes_list_every_key():
    section = DESIGN.read_text().split("## Redis keys", 1)[1].split("\n## ", 1)[0]
    for suffix in [*keys.LUA_KEYS.values(), *keys.LUA_FAMILIES.values(), keys.WAKE]:
        assert f"`P:{{R}}:{suffix}" in section, suffix
    for name in (*keys.GLOBAL_KEYS, keys.TOKENS):
        assert f"`P:{name}`" in section, name
