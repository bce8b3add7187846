"""``--only scaling``: lease latency as the buffer grows, and as trainers are added."""

from __future__ import annotations

import math

from benchmarks.harness import Bench, Row
from benchmarks.load import percentile
from benchmarks.payloads import TOKENS


def scaling_rows(b: Bench) -> list[Row]:
    s = b.sizes
    size = s.batch
    rows: list[Row] = []
    later: list[Row] = []
    run = b.new_run("scaling", max_reuse=10_000)
    have = 0
    first: dict[int, float] = {}
    b.raw_clear()
    b.raw_write(64, 1, 600.0, math.ceil(max(s.trainers) * size * 2 / 64), "rs")
    for i, level in enumerate(s.levels):
        b.say(f"scaling: filling to {level:,} buffered")
        have += b.fill(run, level - have, f"s{i}")
        g = b.lease_ack(run, size, 1, s.level_s)
        for q in (50, 99):
            v = percentile(g.latencies, q) * 1e3
            first.setdefault(q, v)
            row = Row(
                f"scale.buffered.{level}.p{q}",
                "Cost vs buffered",
                f"lease of {size}, p{q}, {level:,} buffered",
                v,
                "ms",
                note=f"{v / first[q]:.2f}× the {s.levels[0]:,}-buffered figure",
            )
            if level == s.levels[-1]:  # flat: the most buffered against the least
                row.target(f"≤1.3× at {s.levels[0]:,}", v / first[q], 1.3, at_most=True)
            rows.append(row)
        if i == len(s.levels) // 2:
            later = trainer_rows(b, run, size, level)
    b.drop_run(run)
    b.raw_clear()
    return rows + later


def trainer_rows(b: Bench, run: str, size: int, level: int) -> list[Row]:
    s = b.sizes
    rows = []
    base: dict[str, float] = {}
    for n in s.trainers:
        b.say(f"scaling: {n} concurrent trainers")
        raw_g = b.raw_read(size, n, s.ceiling_s)
        g = b.lease_ack(run, size, n, s.trainer_s)
        lat = g.latencies
        figs = {
            "p50": (percentile(lat, 50) * 1e3, percentile(raw_g.latencies, 50) * 1e3, "ms"),
            "p99": (percentile(lat, 99) * 1e3, percentile(raw_g.latencies, 99) * 1e3, "ms"),
            "rate": (g.rate, raw_g.rate, "rollouts/s"),
        }
        for key, (v, raw, unit) in figs.items():
            base.setdefault(key, v)
            base.setdefault(f"raw {key}", raw)
            what = (
                "lease+ack rollouts/s, all trainers" if key == "rate" else f"lease of {size}, {key}"
            )
            row = Row(
                f"scale.trainers.{n}.{key}",
                "Cost vs trainers",
                f"{what}, {n} trainer{'s' if n > 1 else ''} ({level:,} buffered)",
                v,
                unit,
                raw=raw,
                tokens_per_s=v * TOKENS if key == "rate" else None,
                note=f"{v / base[key]:.2f}× the 1-trainer figure; raw Redis "
                f"{raw / base[f'raw {key}']:.2f}× its own",
            )
            if key == "p99" and n == max(s.trainers) and n > 1:
                # One Redis and one API process serve the trainers in turn: measured against
                # how raw Redis's own p99 grows from 1 to n clients in the same run.
                own = (v / base[key]) / (raw / base[f"raw {key}"])
                row.target("≤1.5× raw's n-to-1 ratio", own, 1.5, at_most=True)
            rows.append(row)
    return rows
