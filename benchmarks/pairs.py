"""A setting measured on against off: two brokers alike but for it, driven in alternation by one
client (the auth and metrics sections).
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness import Bench, Row, Sizes
from benchmarks.load import Http, Result, ingest_poster, lease_acker, run_group
from benchmarks.payloads import TOKENS
from benchmarks.servers import Server, postgres_database, proc_cpu_s, uvicorn_server

PAIR_SIDES = ("off", "on")


Cycle = tuple[tuple[int, float], tuple[int, float]]  # (rollouts, seconds) of side A, of side B


@dataclass
class Alternated(Result):
    """One client's alternation between two servers: ``sides`` holds each one's totals, with
    ``t0`` 0 and ``t1`` the time spent in its own blocks; ``cycles`` each whole A B B A cycle
    in which neither side ran out."""

    sides: list[Result] = field(default_factory=list)
    cycles: list[Cycle] = field(default_factory=list)


ABBA = (0, 1, 1, 0)  # one cycle of blocks: a drift that is linear over a cycle weighs alike


def http_alternate(
    *,
    kind: str,
    sides: list[dict[str, Any]],
    block_ops: int,
    duration: float,
    warmup: int,
    barrier: Any,
) -> Alternated:
    """One client process driving two servers in turn, ``block_ops`` operations at a time in
    the order A B B A, in whole cycles, until ``duration`` has passed or both have nothing left
    (``kind`` lease_ack: a lease answered 204). ``kind`` ingest posts rollouts, each side with
    the ``ingest_poster`` arguments of its dict; lease_ack leases and acks, with
    ``lease_acker``'s. Both sides run at the same moments, so that a change of the machine's
    speed, which on a shared VM is larger than the gap to be measured, falls on both."""
    if kind not in ("ingest", "lease_ack"):
        raise ValueError(f"no alternating load {kind!r}")
    clients: list[tuple[Http, Callable[[], int | None]]] = [
        ingest_poster(**spec) if kind == "ingest" else lease_acker(**spec) for spec in sides
    ]
    if len(clients) != 2:
        raise ValueError("the alternation is between two servers")
    for _, step in clients:
        for _ in range(warmup):
            step()
    res = Alternated(sides=[Result(), Result()])
    done = [False, False]
    barrier.wait()
    res.t0 = time.perf_counter()
    deadline = res.t0 + duration
    while not all(done) and time.perf_counter() < deadline:
        moved, spent = [0, 0], [0.0, 0.0]
        for i in ABBA:
            if done[i]:
                continue
            step, side = clients[i][1], res.sides[i]
            t = time.perf_counter()
            for _ in range(block_ops):
                got = step()
                if got is None:
                    side.empty += 1
                    done[i] = True
                    break
                side.ops += 1
                moved[i] += got
            spent[i] += time.perf_counter() - t
        for i, side in enumerate(res.sides):
            side.rollouts += moved[i]
            side.t1 += spent[i]
        if not any(done):
            res.cycles.append(((moved[0], spent[0]), (moved[1], spent[1])))
    res.t1 = time.perf_counter()
    for conn, _ in clients:
        conn.close()
    res.ops = sum(s.ops for s in res.sides)
    res.rollouts = sum(s.rollouts for s in res.sides)
    return res


@dataclass(frozen=True)
class Toggle:
    """A setting measured off against on by a pair of brokers alike but for it."""

    key: str  # the section and the row ids' first part
    title: str  # the rows' section title
    setting: str  # its env var, for the rows' text
    need: float  # on ÷ off at least
    env: dict[str, dict[str, str]]  # per side, the env that sets it
    on_text: str  # how the on side is described in its row


@contextlib.contextmanager
def broker_pair(b: Bench, db_url: str, toggle: Toggle) -> Iterator[dict[str, Server]]:
    """Two brokers on the run's Redis and key prefix and on one migrated database, alike but
    for ``toggle``'s setting."""
    workdir = b.workdir or Path(tempfile.gettempdir())
    env = {
        "BROKER_REDIS_URL": b.redis.url,
        "BROKER_REDIS_PREFIX": b.prefix,
        "BROKER_DATABASE_URL": db_url,
    }

    def broker(side: str) -> contextlib.AbstractContextManager[Server]:
        return uvicorn_server(
            f"broker-{toggle.key}-{side}",
            "app.main:create_app",
            cwd=b.app_dir,
            workdir=workdir,
            env={**env, **toggle.env[side]},
            factory=True,
        )

    with broker("off") as off, broker("on") as on:
        yield {"off": off, "on": on}


@dataclass(frozen=True)
class PairCase:
    key: str  # the row ids' middle
    what: str  # the measure's text
    kind: str  # the http_alternate kind
    spec: dict[str, Any]  # its per-side arguments, but for address, token, path / run_id
    per_op: int  # rollouts per operation
    op: str  # what one operation is, for the notes
    block_ops: int  # operations per block of the alternation
    warmup: int  # operations per side before the measured ones
    config: dict[str, Any] = field(default_factory=dict)  # of the runs


def pair_cases(s: Sizes) -> list[PairCase]:
    return [
        PairCase(
            "ingest.json.1",
            "ingest, json, 1/request, 1 generator",
            "ingest",
            dict(fmt="json", per_req=1, tag="a1", worker=0),
            1,
            "request",
            16,
            2,
        ),
        PairCase(
            "ingest.msgpack.64",
            "ingest, msgpack, 64/request, 1 generator",
            "ingest",
            dict(fmt="msgpack", per_req=64, tag="a64", worker=0),
            64,
            "request",
            2,
            2,
        ),
        PairCase(
            f"lease_ack.msgpack.{s.batch}",
            f"lease + ack, msgpack, batches of {s.batch}, 1 trainer (max_reuse=1)",
            "lease_ack",
            dict(fmt="msgpack", size=s.batch),
            s.batch,
            "lease + ack",
            1,
            1,
            dict(max_reuse=1),
        ),
    ]


@dataclass
class PairSide:
    """One side's figures for one case, over every round."""

    rates: list[float] = field(default_factory=list)  # rollouts/s, one per A B B A cycle
    cpu_s: float = 0.0  # the server's CPU over the rounds' loads, warm-up included
    cpu_ops: int = 0  # the operations it served in that time

    @property
    def rate(self) -> float:
        return statistics.median(self.rates)

    def cpu_per_op_us(self) -> float:
        return self.cpu_s / self.cpu_ops * 1e6


def paired_rows(
    b: Bench,
    toggle: Toggle,
    prepare: Callable[[dict[str, Server]], dict[str, str | None]],  # -> each side's token
    during: Callable[[dict[str, Server]], contextlib.AbstractContextManager[None]],
) -> list[Row]:
    """Ingest (JSON 1 a request, msgpack 64 a request) and lease + ack (msgpack) with
    ``toggle`` off and on. One client drives both brokers in turn, a few operations at a time
    (A B B A), so that both run at the same moments of the machine's drifting speed; each side's
    figure is the median of its rates over all those cycles. Every round starts a new pair of
    brokers (a process can be a few per cent faster than its twin for as long as it lives) and
    the side that leads alternates."""
    s = b.sizes
    cases = pair_cases(s)
    got = {case.key: {side: PairSide() for side in PAIR_SIDES} for case in cases}
    with postgres_database(b.pg_url, b.app_dir, b.workdir or Path(tempfile.gettempdir())) as db:
        for rnd in range(s.auth_rounds):
            order = PAIR_SIDES if rnd % 2 == 0 else PAIR_SIDES[::-1]
            b.say(
                f"{toggle.key}: round {rnd + 1}/{s.auth_rounds}, a new pair of brokers, "
                f"{order[0]} leads"
            )
            with broker_pair(b, db, toggle) as servers:
                tokens = prepare(servers)
                for case in cases:
                    b.say(f"{toggle.key}: {case.what}, round {rnd + 1}/{s.auth_rounds}")
                    sides = [(side, servers[side], tokens[side]) for side in order]
                    with during(servers):
                        pair_round(b, toggle, case, sides, got[case.key])
    rows: list[Row] = []
    for case in cases:
        rows += pair_case_rows(toggle, case, got[case.key]["off"], got[case.key]["on"])
    return rows


def pair_round(
    b: Bench,
    toggle: Toggle,
    case: PairCase,
    sides: list[tuple[str, Server, str | None]],
    got: dict[str, PairSide],
) -> None:
    """One round of ``case``: a run on each server (filled first for lease + ack), then one
    client alternating between them; adds each side's figures to ``got``."""
    s = b.sizes
    specs, runs = [], []
    for side, server, token in sides:
        run = b.new_run(f"{toggle.key}-{side}", server=server, token=token, **case.config)
        runs.append(run)
        where = dict(path=f"/v1/runs/{run}/rollouts") if case.kind == "ingest" else dict(run_id=run)
        specs.append({**case.spec, **where, "address": server.address, "token": token})
        if case.kind == "lease_ack":
            b.fill(run, s.auth_lease_fill, "al", server=server, token=token)
    duration = 2 * s.auth_s if case.kind == "ingest" else 600.0  # lease + ack: until empty
    cpu0 = [proc_cpu_s(server.pid) for _, server, _ in sides]
    res = alternated(case, specs, duration)
    for i, ((side, server, _), c0, one) in enumerate(zip(sides, cpu0, res.sides, strict=True)):
        acc = got[side]
        acc.cpu_s += proc_cpu_s(server.pid) - c0
        acc.cpu_ops += one.ops + one.empty + case.warmup
        acc.rates += [cycle[i][0] / cycle[i][1] for cycle in res.cycles]
    for run in runs:
        b.drop_run(run)


def alternated(case: PairCase, specs: list[dict[str, Any]], duration: float) -> Alternated:
    """One client process alternating between the two sides ``specs`` of ``case``."""
    g = run_group(
        http_alternate,
        [
            dict(
                kind=case.kind,
                sides=specs,
                block_ops=case.block_ops,
                duration=duration,
                warmup=case.warmup,
            )
        ],
        timeout=duration + 300,
    )
    res = g.results[0]
    assert isinstance(res, Alternated)
    return res


def pair_case_rows(toggle: Toggle, case: PairCase, off: PairSide, on: PairSide) -> list[Row]:
    paired = sorted(a / b for a, b in zip(on.rates, off.rates, strict=True))
    n = len(paired)
    ratio = on.rate / off.rate
    name = toggle.key

    def us_per_op(rate: float) -> float:
        return case.per_op / rate * 1e6

    off_row = Row(
        f"{name}.{case.key}.off",
        toggle.title,
        f"{case.what}, {name} off",
        off.rate,
        "rollouts/s",
        tokens_per_s=off.rate * TOKENS,
        note=f"median of {n} cycles; {us_per_op(off.rate):,.0f} µs per {case.op}, "
        f"server CPU {off.cpu_per_op_us():,.0f} µs",
    )
    on_row = Row(
        f"{name}.{case.key}.on",
        toggle.title,
        f"{case.what}, {toggle.on_text}",
        on.rate,
        "rollouts/s",
        tokens_per_s=on.rate * TOKENS,
        note=f"on/off ×{ratio:.3f}; the cycles' own on/off: median ×{statistics.median(paired):.3f}"
        f", middle half ×{paired[n // 4]:.3f} to ×{paired[(3 * n) // 4]:.3f}; "
        f"{us_per_op(on.rate) - us_per_op(off.rate):+,.0f} µs per {case.op}, "
        f"server CPU {on.cpu_per_op_us() - off.cpu_per_op_us():+,.0f} µs",
    )
    on_row.target(f"≥{toggle.need}× {name} off", ratio, toggle.need)
    return [off_row, on_row]
