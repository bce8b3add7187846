"""``--only work``: work leases of prompts at each queue depth, against raw Redis."""

from __future__ import annotations

from benchmarks import load_prompts
from benchmarks.harness import Bench, Row, best_latency, best_rate
from benchmarks.load import Group, percentile


def work_rows(b: Bench) -> list[Row]:
    """Work leases with the prompt queue at each depth: a generator takes a lease and gives it
    back unstarted, so the depth holds; the raw ceiling does the same at the same depth."""
    s = b.sizes
    size = s.work_size
    rows: list[Row] = []
    run = b.new_run("work", step_groups=1_000_000)  # the budget is checked, never binds
    b.raw_clear()
    have = 0
    first: dict[str, float] = {}
    for level in s.work_levels:
        b.say(f"work: registering prompts up to {level:,} queued")
        reg = b.register_prompts(run, level - have, f"p{level}")
        load_prompts.redis_fill_prompts(b.redis.url, b.raw_prefix, have, level - have)
        have = level
        got: dict[str, list[Group]] = {}
        for rep in range(s.repeats):
            b.say(f"work ceiling: raw Redis, leases of {size}, {level:,} queued (#{rep + 1})")
            got.setdefault("raw", []).append(b.raw_work(size, s.ceiling_s))
            b.say(f"work: broker, leases of {size}, {level:,} queued (#{rep + 1})")
            got.setdefault("broker", []).append(b.work_return(run, size, s.work_s))
        g, raw_g = best_rate(got["broker"]), best_rate(got["raw"])
        lat, raw_lat = best_latency(got["broker"]), best_latency(got["raw"])
        figs = {
            "rate": (g.rate, raw_g.rate, "prompts/s", f"{g.ops} leases"),
            "p50": (
                percentile(lat.latencies, 50) * 1e3,
                percentile(raw_lat.latencies, 50) * 1e3,
                "ms",
                f"{len(lat.latencies)} leases",
            ),
            "p99": (
                percentile(lat.latencies, 99) * 1e3,
                percentile(raw_lat.latencies, 99) * 1e3,
                "ms",
                f"{len(lat.latencies)} leases",
            ),
        }
        for key, (v, raw, unit, count) in figs.items():
            first.setdefault(key, v)
            what = (
                f"work lease of {size} + return, prompts/s"
                if key == "rate"
                else f"work lease of {size}, {key}"
            )
            note = f"{count}; {v / first[key]:.2f}× the {s.work_levels[0]:,}-queued figure"
            if key == "rate":
                note += f"; the prompts were registered at {reg.rate:,.0f}/s"
            rows.append(
                Row(
                    f"work.queued.{level}.{key}",
                    "Work leases (prompts)",
                    f"{what}, {level:,} queued (1 generator)",
                    v,
                    unit,
                    raw=raw,
                    note=note,
                )
            )
    b.drop_run(run)
    b.raw_clear()
    return rows + partial_rows(b)


PARTIALS = 2  # partial rollouts per prompt given back
PARTIAL_TOKENS = 512  # tokens of each


def partial_rows(b: Bench) -> list[Row]:
    """A work lease given back with partials, whose next lease hands them out again: against
    the same lease given back without, at the smallest queue depth of the rows above."""
    s = b.sizes
    size, level = s.work_size, s.work_levels[0]
    run = b.new_run("work-partials", step_groups=1_000_000, group_size=PARTIALS)
    b.register_prompts(run, level, "pp")
    got: dict[str, list[Group]] = {}
    for rep in range(s.repeats):
        b.say(f"work: leases of {size} + return, no partials, {level:,} queued (#{rep + 1})")
        got.setdefault("plain", []).append(b.work_return(run, size, s.work_s))
        b.say(f"work: leases of {size} + return with partials, {level:,} queued (#{rep + 1})")
        got.setdefault("partials", []).append(
            b.work_return_partials(run, size, PARTIALS, PARTIAL_TOKENS, s.work_s)
        )
    b.drop_run(run)
    g, plain = best_rate(got["partials"]), best_rate(got["plain"])
    lat, plain_lat = best_latency(got["partials"]), best_latency(got["plain"])
    what = f"work lease of {size} + return with {PARTIALS} partials of {PARTIAL_TOKENS} tokens"
    p50, plain_p50 = (percentile(x.latencies, 50) * 1e3 for x in (lat, plain_lat))
    return [
        Row(
            "work.partials.rate",
            "Work leases (prompts)",
            f"{what} a prompt, handed out again, {level:,} queued",
            g.rate,
            "prompts/s",
            note=f"{g.ops} leases; {g.rate / plain.rate:.2f}× the same leases given back "
            f"without partials ({plain.rate:,.0f} prompts/s)",
        ),
        Row(
            "work.partials.p50",
            "Work leases (prompts)",
            f"{what} a prompt: the work call's p50, {level:,} queued",
            p50,
            "ms",
            note=f"{len(lat.latencies)} leases; {p50 / plain_p50:.2f}× the work call's p50 "
            f"without partials ({plain_p50:.2f} ms)",
        ),
    ]
