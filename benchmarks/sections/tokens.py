"""``--only tokens``: ingest of multi-turn rollouts (a loss mask and per-token versions, 16
segments) against plain rollouts of the same length, on one broker, in alternation (see
:mod:`benchmarks.pairs`)."""

from __future__ import annotations

import json

from benchmarks.harness import Bench, Row
from benchmarks.load import Http, expect
from benchmarks.pairs import PairCase, PairSide, Toggle, alternated, pair_case_rows
from benchmarks.servers import proc_cpu_s

SEGMENTS = 16
TOKENS_NEED = 0.9  # a 16-segment rollout's ingest within 10 % of a plain one's

TOGGLE = Toggle(
    "tokens",
    "Loss masks and per-token versions",
    "",
    TOKENS_NEED,
    {},
    f"{SEGMENTS} segments (loss_mask + versions)",
)

CASES = [
    PairCase(
        "ingest.msgpack.64",
        "ingest, msgpack (mask as bytes), 64/request, 1 generator",
        "ingest",
        dict(fmt="msgpack", per_req=64, worker=0),
        64,
        "request",
        2,
        2,
    ),
    PairCase(
        "ingest.json.1",
        "ingest, json, 1/request, 1 generator",
        "ingest",
        dict(fmt="json", per_req=1, worker=0),
        1,
        "request",
        16,
        2,
    ),
]


def _run(b: Bench, name: str) -> str:
    """A run whose version admits every segment's (0 to 15) and none stale."""
    run = b.new_run(name, max_staleness=1000)
    http = Http(b.broker.address)
    status, data, _ = http.call(
        "POST", f"/v1/runs/{run}/policy", json.dumps({"version": SEGMENTS - 1}).encode(),
        "application/json",
    )  # fmt: skip
    http.close()
    expect(status, data, 200)
    return run


def _round(b: Bench, case: PairCase, rnd: int, got: dict[str, PairSide]) -> None:
    order = ("off", "on") if rnd % 2 == 0 else ("on", "off")
    runs = {side: _run(b, f"tokens-{side}") for side in order}
    specs = [
        {
            **case.spec,
            "address": b.broker.address,
            "path": f"/v1/runs/{runs[side]}/rollouts",
            "tag": f"t{side[:2]}{rnd}",
            "segments": SEGMENTS if side == "on" else 0,
        }
        for side in order
    ]
    duration = 2 * b.sizes.auth_s
    cpu0 = proc_cpu_s(b.broker.pid)
    res = alternated(case, specs, duration)
    cpu = proc_cpu_s(b.broker.pid) - cpu0
    busy = sum(one.t1 for one in res.sides)
    for i, (side, one) in enumerate(zip(order, res.sides, strict=True)):
        acc = got[side]
        # One server serves both sides: its CPU is split by the time each side's blocks took
        # (an estimate; the rates are the measure).
        acc.cpu_s += cpu * one.t1 / max(busy, 1e-9)
        acc.cpu_ops += one.ops + one.empty + case.warmup
        acc.rates += [cycle[i][0] / cycle[i][1] for cycle in res.cycles]
    for run in runs.values():
        b.drop_run(run)


def tokens_rows(b: Bench) -> list[Row]:
    """Per case, rounds of plain ('off') against 16-segment ('on') rollouts of the same length,
    each round on two new runs, the leading side alternating; the figure is each side's median
    rate over the A B B A cycles."""
    rows: list[Row] = []
    for case in CASES:
        got = {side: PairSide() for side in ("off", "on")}
        for rnd in range(b.sizes.auth_rounds):
            b.say(f"tokens: {case.what}, round {rnd + 1}/{b.sizes.auth_rounds}")
            _round(b, case, rnd, got)
        rows += pair_case_rows(TOGGLE, case, got["off"], got["on"])
    return rows
