"""``--only long``: 32,768-token rollouts, ingest and lease + ack, against raw Redis and the
naive dict.
"""

from __future__ import annotations

from benchmarks import load
from benchmarks.harness import BIG, Bench, Row, best_rate
from benchmarks.load import Group, percentile, run_group
from benchmarks.payloads import LONG_TOKENS, make_payload, raw_bytes, rollout_id

LONG_NEED = 0.6  # issue 14: lease + ack of 32,768-token rollouts at least 0.6× the raw ceiling
LONG_SECTION = "Long rollouts (32,768 tokens)"


def long_rows(b: Bench) -> list[Row]:
    """32,768-token rollouts with logprobs, as reasoning runs make them: msgpack ingest a few a
    request with 1 and 4 generators, JSON ingest one a request, and lease + ack of whole batches
    (max_reuse=1), each beside its raw-Redis ceiling and the naive dict moving the same
    rollouts, interleaved and repeated, best of each kept. The rows are rollouts/s; every
    rollout has the same raw array bytes, so ×raw is also the ratio in bytes/s (in the note)."""
    s = b.sizes
    tokens, per, size = LONG_TOKENS, s.long_per_req, s.long_batch
    payload = make_payload(tokens=tokens)
    item = len(payload.msgpack_item(rollout_id("l", 0, 0)))
    json_item = len(payload.json_item(rollout_id("l", 0, 0)))
    got: dict[str, list[Group]] = {}

    def keep(key: str, g: Group) -> None:
        got.setdefault(key, []).append(g)

    for rep in range(s.repeats):
        for procs in (1, 4):
            b.say(f"long: raw Redis writes, {per}/pipeline, {procs} proc (#{rep + 1})")
            ceiling = b.raw_write(per, procs, s.long_ceiling_s, BIG, f"lw{per}", tokens=tokens)
            keep(f"raw{per}.p{procs}", ceiling)
            b.raw_clear()
            b.say(f"long: naive dict, json, 1/request, {procs} proc (#{rep + 1})")
            keep(f"naive.p{procs}", long_naive_ingest(b, procs, s.long_naive_s))
            b.say(f"long: broker, msgpack, {per}/request, {procs} proc (#{rep + 1})")
            run = b.new_run(f"long-msgpack-{procs}")
            keep(f"msgpack.p{procs}", long_ingest(b, run, "msgpack", per, procs, s.long_ingest_s))
            b.drop_run(run)
        b.say(f"long: raw Redis writes, 1/pipeline, 1 proc (#{rep + 1})")
        keep("raw1.p1", b.raw_write(1, 1, s.long_ceiling_s, BIG, "lw1", tokens=tokens))
        b.raw_clear()
        b.say(f"long: broker, json, 1/request, 1 proc (#{rep + 1})")
        run = b.new_run("long-json")
        keep("json.p1", long_ingest(b, run, "json", 1, 1, s.long_ingest_s))
        b.drop_run(run)

        b.say(f"long: raw Redis reads of {size} (#{rep + 1})")
        # A pool of 5 batches (one more to warm up).
        b.raw_write(size, 1, 600.0, 4, f"lw{size}", tokens=tokens)
        keep("raw_read", b.raw_read(size, 1, s.long_ceiling_s))
        b.raw_clear()
        b.say(f"long: naive dict, batches of {size} pops (#{rep + 1})")
        keep("naive_pop", long_naive_pop(b, size, s.long_naive_s))
        b.say(f"long: lease+ack floor, canned answers over HTTP, batches of {size} (#{rep + 1})")
        canned = f"canned-{tokens}"
        keep("floor", b.lease_ack(canned, size, 1, s.long_lease_s, server=b.naive, tokens=tokens))
        run = b.new_run("long-lease", max_reuse=1)
        b.say(f"long: filling {s.long_fill:,} rollouts (#{rep + 1})")
        b.fill(run, s.long_fill, "lf", size, tokens=LONG_TOKENS)
        b.say(f"long: broker, lease + ack, msgpack, batches of {size} (#{rep + 1})")
        lease = b.lease_ack(run, size, 1, s.long_lease_s, stop_on_empty=True, tokens=tokens)
        keep("lease", lease)
        b.drop_run(run)

    def mb_s(rate: float) -> str:
        return f"{rate * raw_bytes(tokens) / 1e6:,.0f} MB/s"

    rows: list[Row] = []
    for fmt, n, procs, raw_key in (
        ("msgpack", per, 1, f"raw{per}.p1"),
        ("msgpack", per, 4, f"raw{per}.p4"),
        ("json", 1, 1, "raw1.p1"),
    ):
        g, raw = best_rate(got[f"{fmt}.p{procs}"]), best_rate(got[raw_key]).rate
        body = n * (item if fmt == "msgpack" else json_item)
        row = Row(
            f"long.ingest.{fmt}.{n}.p{procs}",
            LONG_SECTION,
            f"ingest of 32,768-token rollouts, {fmt}, {n}/request, "
            f"{procs} generator{'s' if procs > 1 else ''}",
            g.rate,
            "rollouts/s",
            raw=raw,
            naive=best_rate(got[f"naive.p{procs}"]).rate,
            tokens_per_s=g.rate * tokens,
            note=f"{mb_s(g.rate)} of raw arrays, raw Redis {mb_s(raw)}; "
            f"{g.ops / g.span:,.1f} requests/s of {body / 1e6:.2f} MB",
        )
        row.target(">1× naive", row.vs_naive, 1.0)
        rows.append(row)
    g, raw = best_rate(got["lease"]), best_rate(got["raw_read"]).rate
    floor = best_rate(got["floor"]).rate
    floor_row = Row(
        f"http_floor.long.lease_ack.{size}",
        LONG_SECTION,
        "HTTP floor of 32,768-token rollouts: the same msgpack lease and ack, answered canned "
        "from memory (no broker)",
        floor,
        "rollouts/s",
        raw=raw,
        tokens_per_s=floor * tokens,
        note=f"{mb_s(floor)} of raw arrays: what one uvicorn process and the trainer's client "
        "cost to move the bytes alone",
    )
    row = Row(
        f"long.lease_ack.msgpack.{size}",
        LONG_SECTION,
        f"lease + ack of 32,768-token rollouts, msgpack, batches of {size}, 1 trainer "
        "(max_reuse=1)",
        g.rate,
        "rollouts/s",
        raw=raw,
        naive=best_rate(got["naive_pop"]).rate,
        tokens_per_s=g.rate * tokens,
        note=f"{mb_s(g.rate)} of raw arrays, raw Redis {mb_s(raw)}; {g.ops} batches; "
        f"lease p50 {percentile(g.latencies, 50) * 1e3:.1f} ms; {g.rate / floor:.2f}× the HTTP "
        "floor",
    )
    row.target(f"≥{LONG_NEED}× raw", row.vs_raw, LONG_NEED)
    row.target(">1× naive", row.vs_naive, 1.0)
    return [*rows, row, floor_row]


def long_ingest(b: Bench, run: str, fmt: str, per_req: int, procs: int, duration: float) -> Group:
    """Generators posting 32,768-token rollouts, ``per_req`` a request, to ``run``."""
    return run_group(
        load.http_ingest,
        [
            dict(
                address=b.broker.address,
                path=f"/v1/runs/{run}/rollouts",
                fmt=fmt,
                per_req=per_req,
                tag=f"l{fmt[0]}{per_req}",
                worker=w,
                duration=duration,
                max_ops=BIG,
                tokens=LONG_TOKENS,
            )
            for w in range(procs)
        ],
        timeout=duration + 300,
    )


def long_naive_ingest(b: Bench, procs: int, duration: float) -> Group:
    """The naive dict's generators: one JSON 32,768-token rollout a request; emptied after."""
    g = run_group(
        load.naive_ingest,
        [
            dict(
                address=b.naive.address,
                tag=f"ln{procs}",
                worker=w,
                duration=duration,
                max_ops=BIG,
                tokens=LONG_TOKENS,
            )
            for w in range(procs)
        ],
        timeout=duration + 120,
    )
    b.naive_call("POST", "/_bench/clear")
    return g


def long_naive_pop(b: Bench, size: int, duration: float) -> Group:
    """The naive dict's trainer popping batches of ``size`` 32,768-token rollouts; emptied
    after."""
    b.naive_call("POST", "/_bench/clear")
    item = make_payload(tokens=LONG_TOKENS).json_item(rollout_id("lp", 0, 0))
    b.naive_call("POST", "/rollouts", item)
    b.naive_call("POST", f"/_bench/replicate?n={max(20 * size, 400)}&prefix=lp-")
    g = run_group(
        load.naive_pop,
        [dict(address=b.naive.address, size=size, duration=duration, max_ops=BIG)],
        timeout=duration + 120,
    )
    b.naive_call("POST", "/_bench/clear")
    return g
