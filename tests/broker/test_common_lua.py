"""Helpers of the Lua libraries (app/broker/lua/lib) run on their own in a real Redis: the
prologue and the libraries as a script that requires them gets them, followed by a few lines
that call one helper."""

from __future__ import annotations

import json
import math

import msgpack
import pytest
from redis.exceptions import ResponseError

from app import keys
from app.broker.scripts import lua_source

pytestmark = pytest.mark.one_node  # plain Lua helpers: the same on any Redis


async def run_lua(redis, prefix: str, body: str, *args):
    script = lua_source("-- requires: units\n" + body)
    return await redis.eval(script, 2, *keys.script_keys(prefix, "lua"), "wake", *args)


@pytest.mark.parametrize("pairs", [0, 1, 14, 15, 16, 300])
async def test_timed_adds_t_to_a_packed_map_of_any_size(redis, prefix, pairs):
    payload = {f"k{i}": [i, "x" * i] for i in range(pairs)}
    got = await run_lua(redis, prefix, "return timed(ARGV[2])", msgpack.packb(payload))
    decoded = msgpack.unpackb(got, raw=False)
    t = decoded.pop("t")
    assert decoded == payload
    now_ms = int((await redis.time())[0]) * 1000
    assert now_ms - 5_000 <= t <= now_ms + 5_000


async def test_timed_refuses_anything_but_a_map(redis, prefix):
    with pytest.raises(ResponseError, match="not a msgpack map"):
        await run_lua(redis, prefix, "return timed(ARGV[2])", msgpack.packb([1, 2]))


RECORDS = [
    dict(v=0, seq=1, uses=0, k=1, n=1024, kl=None, att=None, pk=None),
    dict(v=7, seq=2**40, uses=3, k=8, n=0, kl=-1.2345678901234567e-7, att=2, pk="p,1#3"),
    dict(v=12, seq=5, uses=1, k=1, n=7, kl=0.1 + 0.2, att=None, pk=None),
    dict(v=1, seq=9, uses=2, k=4, n=0, kl=1e300, att=1, pk="a b,c,,d#1"),
    dict(v=3, seq=4, uses=0, k=2, n=0, kl=0.0, att=1, pk="x#2"),
]


# What parse_unit read, field by field, as text (the numbers exactly: kl as %.17g).
_READ_BACK = """
local out = {}
for _, f in ipairs({ 'v', 'seq', 'uses', 'k', 'n' }) do table.insert(out, I(back[f])) end
table.insert(out, back.kl and string.format('%.17g', back.kl) or '')
table.insert(out, back.att and I(back.att) or '')
table.insert(out, back.pk or '')
return out
"""


def _assert_read_back(got: list[bytes], rec: dict) -> None:
    fields = [x.decode() for x in got]
    assert [int(x) for x in fields[:5]] == [rec[f] for f in ("v", "seq", "uses", "k", "n")]
    if rec["kl"] is None:
        assert fields[5] == ""
    else:
        assert float(fields[5]) == rec["kl"] and not math.isnan(float(fields[5]))
    assert fields[6] == ("" if rec["att"] is None else str(rec["att"]))
    assert fields[7] == (rec["pk"] or "")


@pytest.mark.parametrize("rec", RECORDS)
async def test_a_unit_record_reads_back_exactly(redis, prefix, rec):
    body = """
    local r = cjson.decode(ARGV[2])
    for _, f in ipairs({ 'kl', 'att', 'pk' }) do if r[f] == cjson.null then r[f] = nil end end
    local back = parse_unit(unit_record(r))
    """
    _assert_read_back(await run_lua(redis, prefix, body + _READ_BACK, json.dumps(rec)), rec)


@pytest.mark.parametrize("rec", RECORDS)
async def test_a_text_record_of_an_earlier_version_is_read_as_it_was_written(redis, prefix, rec):
    """Records written before the binary form ('v,seq,uses,k,n,kl,att,pk', '' for none) are
    still read, exactly."""
    kl = "" if rec["kl"] is None else f"{rec['kl']:.17g}"
    att = "" if rec["att"] is None else str(rec["att"])
    fields = [rec["v"], rec["seq"], rec["uses"], rec["k"], rec["n"], kl, att, rec["pk"] or ""]
    text = ",".join(str(x) for x in fields)
    body = "local back = parse_unit(ARGV[2])"
    _assert_read_back(await run_lua(redis, prefix, body + _READ_BACK, text), rec)
