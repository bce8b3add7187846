"""Would msgspec, ormsgpack or granian make the broker's hot paths faster? One run measures each
against what the broker uses today, on the same bytes and the same machine:

- msgspec against the ingest endpoint's parse (the counts, then pydantic) of a JSON rollout,
  64 msgpack rollouts and 64 JSON rollouts, in its place in that parse; and each alone, without
  the counts and limits (benchmarks/lib_codecs.py);
- ormsgpack against msgpack: the lease answer of 256 rollouts (``batch_body`` rendered as
  ``render`` does), the stored rollouts a lease reads back, and a 64-rollout msgpack body;
- granian against uvicorn (as ``serve`` runs it) serving a trivial FastAPI app and the naive
  buffer (benchmarks/naive_app.py), from 1 and 4 generator processes (benchmarks/lib_http.py).

The codec pairs run interleaved, a few rounds, and keep each side's best time per call; the
servers run interleaved twice and keep each side's best rate and best CPU per request. Nothing
of the broker runs but its own functions, called directly (no Redis), in this process with
glibc's allocator set as the broker's API process sets it.

Run: ``python -m benchmarks.libraries`` (about 2 minutes), ``--quick`` for tiny sizes (about
20 s). Needs ``msgspec``, ``ormsgpack`` and ``granian`` installed (none is a dependency of the
broker).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ormsgpack

from app import allocator
from benchmarks import lib_codecs as codecs
from benchmarks.lib_http import SERVERS, Served, app_server, drive
from benchmarks.payloads import TOKENS
from benchmarks.servers import CpuMeter, Server


@dataclass(frozen=True)
class Sizes:
    tokens: int  # per rollout
    call_s: float  # how long one timing of a codec call repeats it, about
    rounds: int  # of each codec pair
    http_s: float  # one load on one server
    http_max_ops: int  # per generator and load
    apps: tuple[str, ...] = ("trivial", "naive")
    clients: tuple[int, ...] = (1, 4)
    http_rounds: int = 2


FULL = Sizes(tokens=TOKENS, call_s=0.2, rounds=5, http_s=4.0, http_max_ops=200_000)
QUICK = Sizes(tokens=32, call_s=0.005, rounds=2, http_s=0.3, http_max_ops=300)


@dataclass(frozen=True)
class Line:
    """A row of the table: one case, the current code's figure and the candidate's."""

    case: str
    current: float  # µs, lower is better
    candidate: float
    current_note: str = ""
    candidate_note: str = ""

    @property
    def ratio(self) -> float:
        return self.current / self.candidate

    def cells(self) -> list[str]:
        cur = f"{self.current:,.1f} µs{self.current_note}"
        cand = f"{self.candidate:,.1f} µs{self.candidate_note}"
        return [self.case, cur, cand, f"{self.ratio:.2f}"]


def best_pair(
    current: Callable[[], Any], candidate: Callable[[], Any], sizes: Sizes
) -> tuple[float, float]:
    """Each call's best time per call in µs, interleaved over ``sizes.rounds`` rounds (which of
    the two goes first alternates), each timing ``sizes.call_s`` of calls, about."""
    fns = (current, candidate)
    reps = []
    for fn in fns:
        fn()  # warm
        t0 = time.perf_counter()
        fn()
        reps.append(max(1, int(sizes.call_s / max(time.perf_counter() - t0, 1e-7))))
    best = [math.inf, math.inf]
    for r in range(sizes.rounds):
        for i in (0, 1) if r % 2 == 0 else (1, 0):
            fn, n = fns[i], reps[i]
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            best[i] = min(best[i], (time.perf_counter() - t0) / n * 1e6)
    return best[0], best[1]


PARSE_AS_SERVED = (codecs.broker_parse, codecs.msgspec_parse)
PARSE_ALONE = (codecs.pydantic_alone, codecs.msgspec_alone)


def parse_lines(sizes: Sizes) -> list[Line]:
    """msgspec against the ingest endpoint's parse, on the bodies the generators send."""
    lines = []
    for fmt, n in (("json", 1), ("msgpack", 64), ("json", 64)):
        body = codecs.ingest(fmt, n, sizes.tokens)
        codecs.same_parse(body, fmt, sizes.tokens)
        name = f"ingest {'JSON' if fmt == 'json' else 'msgpack'}, {n} rollout{'s' * (n > 1)}"
        pairs = (
            ("parse_body, counts + pydantic vs counts + msgspec", *PARSE_AS_SERVED),
            ("without counts or limits: pydantic vs msgspec decode", *PARSE_ALONE),
        )
        for what, ours, theirs in pairs:
            cur, cand = best_pair(
                functools.partial(ours, body, fmt), functools.partial(theirs, body, fmt), sizes
            )
            lines.append(Line(f"{name}: {what}", cur, cand))
    return lines


def msgpack_lines(sizes: Sizes) -> list[Line]:
    """ormsgpack against msgpack where the broker packs or unpacks msgpack in bulk."""
    content, blobs = codecs.lease_answer(256, sizes.tokens)
    codecs.same_answer(content)
    codecs.same_docs(codecs.ormsgpack_docs, codecs.msgpack_docs, blobs)
    body = codecs.ingest("msgpack", 64, sizes.tokens)
    codecs.same_docs(ormsgpack.unpackb, codecs.broker_decode, body)
    cases: list[tuple[str, Callable[[], Any], Callable[[], Any]]] = [
        (
            "lease answer, 256 rollouts: render (msgpack.Packer) vs ormsgpack.packb",
            lambda: codecs.render_msgpack(content),
            lambda: codecs.ormsgpack_answer(content),
        ),
        (
            "lease, 256 stored rollouts read back: msgpack.unpackb vs ormsgpack.unpackb",
            lambda: codecs.msgpack_docs(blobs),
            lambda: codecs.ormsgpack_docs(blobs),
        ),
        (
            "ingest msgpack, 64 rollouts, decode: counts + unpackb with limits vs ormsgpack",
            lambda: codecs.broker_decode(body),
            lambda: ormsgpack.unpackb(body),
        ),
    ]
    return [Line(case, *best_pair(ours, theirs, sizes)) for case, ours, theirs in cases]


def http_lines(sizes: Sizes, workdir: Path) -> list[Line]:
    """uvicorn against granian, each load on each server in turn, twice."""
    tree = Path(__file__).resolve().parents[1]
    best: dict[tuple[str, str, int], list[Served]] = {}
    with contextlib.ExitStack() as stack:
        servers: dict[tuple[str, str], Server] = {
            (srv, app): stack.enter_context(app_server(srv, app, tree, workdir))
            for app in sizes.apps
            for srv in SERVERS
        }
        for _ in range(sizes.http_rounds):
            for app in sizes.apps:
                for clients in sizes.clients:
                    for srv in SERVERS:
                        served = drive(
                            servers[srv, app],
                            app,
                            clients,
                            sizes.http_s,
                            sizes.http_max_ops,
                            sizes.tokens,
                        )
                        best.setdefault((srv, app, clients), []).append(served)
    lines = []
    for app in sizes.apps:
        for clients in sizes.clients:
            runs = [best[srv, app, clients] for srv in SERVERS]
            name = f"HTTP {app} app, {clients} client{'s' * (clients > 1)}"
            per = [min(r, key=lambda s: s.us_per_request) for r in runs]
            lines.append(
                Line(
                    f"{name}: wall time per request",
                    per[0].us_per_request,
                    per[1].us_per_request,
                    f" ({per[0].group.rate:,.0f} r/s)",
                    f" ({per[1].group.rate:,.0f} r/s)",
                )
            )
            cpu = [min(s.cpu_us_per_request for s in r) for r in runs]
            lines.append(Line(f"{name}: server CPU per request", cpu[0], cpu[1]))
    return lines


HEADER = ["case", "current", "candidate", "current/candidate (time)"]


def table(lines: list[Line]) -> str:
    rows = [HEADER, ["---"] * len(HEADER), *(line.cells() for line in lines)]
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


@contextlib.contextmanager
def _workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="rb-libs-") as d:
        yield Path(d)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.libraries", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a few seconds each")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    # glibc as the broker's API process sets it (app/main.py): a buffer of megabytes comes from
    # the heap, not from a fresh mmap touched page by page on every call.
    allocator.keep_freed_pages(codecs.SETTINGS.keep_freed_bytes)
    meter = CpuMeter([])  # the servers are this process's children: counted once stopped
    meter.start()
    t0 = time.monotonic()
    with _workdir() as workdir:
        lines = parse_lines(sizes) + msgpack_lines(sizes) + http_lines(sizes, workdir)
    print(
        f"{sizes.tokens}-token rollouts; msgspec, ormsgpack, granian against the broker's code "
        f"and uvicorn; {time.monotonic() - t0:.0f} s"
    )
    print(f"cpu load: {meter.report()}")
    print()
    print(table(lines))


if __name__ == "__main__":
    main()
