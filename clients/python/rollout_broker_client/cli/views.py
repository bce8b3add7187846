"""The rich tables of the operator commands: runs, the accounting (with the ledger's check),
prompt passes, tokens and the audit log. A time is never wrapped nor cut, at 80 columns and
wider: the ids and texts beside it fold onto more lines instead."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import RenderableType
    from rich.table import Table

    from rollout_broker_client import (
        AccessToken,
        Accounting,
        AuditEntry,
        BiasStats,
        ConsumerCounts,
        ConsumerInfo,
        GeneratorAccounting,
        PartialCounts,
        PromptCounts,
        PromptState,
        RewardCounts,
        Run,
        TrainingVersion,
        VersionAccounting,
    )


def fmt(value: float | int | None, digits: int = 4) -> str:
    if value is None:
        return "–"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.{digits}g}"


def reasons(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v:,}" for k, v in sorted(counts.items())) or "–"


def histogram(hist: dict[int, int], width: int = 16) -> str:
    if not hist:
        return "–"
    top = max(hist.values()) or 1
    lines = []
    for lag in sorted(hist):
        n = hist[lag]
        bar = "█" * max(1 if n else 0, round(width * n / top))
        lines.append(f"lag {lag:>2} {bar} {n:,}")
    return "\n".join(lines)


def length_histograms(generated: dict[int, int], trained: dict[int, int], width: int = 12) -> str:
    """The two length distributions side by side, one line per bucket either has (named by its
    first length), each side's share of its own total as a bar and a percentage."""
    if not generated and not trained:
        return "–"
    g_total, t_total = sum(generated.values()) or 1, sum(trained.values()) or 1

    def side(n: int, total: int) -> str:
        bar = "█" * max(1 if n else 0, round(width * n / total))
        return f"{bar:<{width}} {100 * n / total:5.1f}%"

    lines = [f"{'from':>8}  {'received':<{width + 7}}  trained"]
    for first in sorted(set(generated) | set(trained)):
        g, t = generated.get(first, 0), trained.get(first, 0)
        lines.append(f"{first:>8}  {side(g, g_total)}  {side(t, t_total)}")
    return "\n".join(lines)


def seconds(value: float) -> str:
    return f"{value:,.1f} s"


def reward_line(r: RewardCounts) -> str:
    return f"awaiting {r.awaiting:,}, in reward leases {r.leased:,}, timed out {r.timed_out:,}"


def reward_wait_note(acc: Accounting) -> str:
    """What the summed reward wait means, with its mean per rollout scored."""
    mean = acc.mean_reward_wait_s
    each = "none scored yet" if mean is None else f"mean {fmt(mean, 3)} s per rollout scored"
    return f"from ingest to score; {each}"


def prompt_line(p: PromptCounts) -> str:
    skipped = f", of them skipped {p.skipped:,}" if p.skipped else ""
    skipped += f", of them cancelled {p.cancelled:,}" if p.cancelled else ""
    pools = f"; queued by pool: {pool_line(p.pools)}" if p.pools is not None else ""
    return (
        f"queued {p.queued:,}, in flight {p.in_flight:,}, done {p.done:,}{skipped}, "
        f"failed {p.failed:,} (retried {p.retried:,}){pools}"
    )


def pool_line(pools: dict[str, int]) -> str:
    """Queued passes per difficulty pool, easy to hard."""
    return ", ".join(f"{name} {pools.get(name, 0):,}" for name in ("easy", "normal", "hard"))


def share(part: int, whole: int) -> str:
    return f"{part / whole:.1%}" if whole else "–"


def masked_note(acc: Accounting | VersionAccounting) -> str:
    """What ``tokens_masked`` is, with its share of the tokens generated."""
    of = share(acc.tokens_masked, acc.tokens_generated)
    return f"{of} of generated: posted with loss_mask 0, never trained"


# The width of a time as _when writes it: 2026-12-06T15:45:55Z.
WHEN_WIDTH = 20


def _when(at: datetime | None) -> str:
    """A time to the second in UTC, ``2026-12-06T15:45:55Z``: one word, so that wrapping a
    cell never splits it."""
    if at is None:
        return "–"
    if at.tzinfo is None:  # of no zone: shown as it is
        return at.isoformat(timespec="seconds")
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _when_column(table: Table, header: str) -> None:
    """A column of times that the table never narrows: the others give way."""
    table.add_column(header, no_wrap=True, min_width=WHEN_WIDTH)


def _narrow(title: str, caption: str | None = None) -> Table:
    """A table of many columns, narrow enough for 80: the box's own blank separates them."""
    from rich import box
    from rich.table import Table

    return Table(
        title=title,
        caption=caption,
        box=box.SIMPLE_HEAD,
        title_justify="left",
        padding=0,
        show_edge=False,
    )


def _detail(title: str) -> Table:
    """A table of one field a line: a value too long for the line folds onto more."""
    from rich.table import Table

    table = Table(title=title, show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    return table


# -- runs ------------------------------------------------------------------------------------------


def run_table(runs: list[Run]) -> RenderableType:
    table = _narrow("Runs")
    table.add_column("run_id", overflow="fold")
    table.add_column("status", no_wrap=True)
    # The config's fields, their names on two lines: 80 columns hold the table then.
    for header in ("version", "group\nsize", "max\nstaleness", "max\nreuse"):
        table.add_column(header, justify="right", no_wrap=True)
    _when_column(table, "created_at")
    for r in runs:
        c = r.config
        table.add_row(
            r.run_id,
            r.status,
            str(r.policy_version),
            str(c.get("group_size", "")),
            str(c.get("max_staleness", "")),
            str(c.get("max_reuse", "")),
            _when(r.created_at),
        )
    return table


def run_detail(run: Run) -> RenderableType:
    table = _detail(f"Run {run.run_id}")
    table.add_row("status", run.status)
    table.add_row("policy_version", str(run.policy_version))
    table.add_row("created_at", _when(run.created_at))
    for key, value in sorted(run.config.items()):
        table.add_row(key, json.dumps(value))
    return table


def consumer_detail(c: ConsumerInfo) -> RenderableType:
    table = _detail(f"Consumer {c.name}")
    rows: list[tuple[str, object]] = [
        ("kind", c.kind),
        ("source", c.source),
        ("max_lag", "–" if c.max_lag is None else c.max_lag),
    ]
    if c.kind == "preferences":
        rows += [("min_margin", fmt(c.min_margin)), ("pairs", c.pairs)]
    rows += [
        ("retention_rollouts", c.retention_rollouts),
        ("created_at", _when(c.created_at)),
        ("delivered", c.delivered),
        ("acked", c.acked),
        ("dropped", c.dropped),
        ("pending", c.pending),
        ("leased", c.leased),
    ]
    for field, value in rows:
        table.add_row(field, str(value))
    return table


# -- accounting ------------------------------------------------------------------------------------


def ledger_check(acc: Accounting) -> tuple[bool, str]:
    """Whether the accounting can be trusted, and why not: the ledger's buffered and leased
    (and the rollouts awaiting a reward, from a broker that reports them) equal the broker's
    live counts (``live``), every event is applied (``pending_events`` 0),
    none was dead-lettered, and received = buffered + leased + retired. A broker that does not
    report ``live`` or ``dead_letters`` cannot be checked: no ✓ then."""
    raw = acc.raw
    why = []
    if acc.unaccounted:
        why.append(f"off by {acc.unaccounted:,}")
    live = raw.get("live")
    if not isinstance(live, dict):
        why.append("the broker does not report its live counts")
    elif (acc.buffered, acc.leased) != (live.get("buffered"), live.get("leased")):
        why.append(
            f"the ledger's buffered {acc.buffered:,}, leased {acc.leased:,} are not the live "
            f"{live.get('buffered')}, {live.get('leased')}"
        )
    if acc.rewards_match_live is False and acc.rewards and acc.live:
        why.append(
            f"the ledger's awaiting a reward {acc.rewards.awaiting:,}, in reward leases "
            f"{acc.rewards.leased:,} are not the live {acc.live.rewards_awaiting:,}, "
            f"{acc.live.rewards_leased:,}"
        )
    if acc.pending_events is None:
        why.append("the broker does not report pending events")
    elif acc.pending_events:
        why.append(f"{acc.pending_events:,} events not yet applied")
    dead = raw.get("dead_letters")
    if dead is None:
        why.append("the broker does not report dead letters")
    elif dead:
        why.append(f"{dead:,} dead letters")
    return not why, "; ".join(why)


def _section(table: Table, title: str) -> None:
    table.add_row(f"[cyan]{title}[/]", "", "", end_section=False)


def _prompt_rows(table: Table, p: PromptCounts) -> None:
    """The accounting's prompt passes, and their check."""
    _section(table, "prompts (passes)")
    table.add_row("registered", fmt(p.registered), "")
    table.add_row("queued", fmt(p.queued), "waiting for a generator")
    table.add_row("in flight", fmt(p.in_flight), "in work leases, or groups not yet used")
    table.add_row(
        "done", fmt(p.done), "reached a gradient (or retired zero_variance), skipped or cancelled"
    )
    if p.skipped:
        table.add_row("  of them skipped", fmt(p.skipped), "in a difficulty pool of weight 0")
    if p.cancelled:
        table.add_row("  of them cancelled", fmt(p.cancelled), "their run closed first")
    table.add_row("failed", fmt(p.failed), "ran out of attempts")
    table.add_row("retried", fmt(p.retried), "attempts after the first")
    if p.pools is not None:
        table.add_row("queued by pool", pool_line(p.pools), "by each prompt's newest mean reward")
    check = "✓" if p.unaccounted == 0 else f"✗ off by {p.unaccounted:,}"
    table.add_row(
        "queued + in flight + done + failed",
        check,
        f"{p.queued:,} + {p.in_flight:,} + {p.done:,} + {p.failed:,} = {p.registered:,} registered",
        end_section=True,
    )


def _partial_rows(table: Table, p: PartialCounts) -> None:
    """Partial rollouts given back with their prompts, continued or dropped."""
    _section(table, "partial rollouts")
    table.add_row("returned", fmt(p.returned), "came back with their prompts")
    table.add_row("resumed", fmt(p.resumed), f"handed out again; {p.tokens_resumed:,} tokens")
    table.add_row(
        "dropped",
        fmt(p.dropped),
        f"too stale, left out of their group or of a failed pass; {p.tokens_dropped:,} tokens",
        end_section=True,
    )


def _reward_rows(table: Table, r: RewardCounts) -> None:
    """Rollouts posted without a reward, by where they are on the way to their score."""
    _section(table, "rewards")
    table.add_row("awaiting", fmt(r.awaiting), "unscored, in no reward lease")
    table.add_row("in reward leases", fmt(r.leased), "unscored, leased to a reward worker")
    table.add_row("scored", fmt(r.scored), "got their reward from a reward worker")
    table.add_row(
        "timed out",
        fmt(r.timed_out),
        "reward leases expired, once per unscored rollout in them",
        end_section=True,
    )


def _bias_rows(table: Table, b: BiasStats) -> None:
    """What is trained against what is generated: lengths (trained tokens) and rewards."""
    _section(table, "bias")
    length, reward = b.length, b.reward
    table.add_row(
        "length KS",
        fmt(length.ks, 3),
        "distance between the length distributions received and trained (0 same, 1 disjoint)",
    )
    table.add_row(
        "length received",
        f"mean {fmt(length.generated_mean, 4)}",
        "trained tokens of the rollouts received",
    )
    table.add_row(
        "length trained",
        f"mean {fmt(length.trained_mean, 4)}",
        "trained tokens of the samples consumed (each use counts)",
    )
    table.add_row("length histograms", "", length_histograms(length.generated, length.trained))
    table.add_row(
        "reward",
        f"mean {fmt(reward.generated_mean, 4)}",
        f"received (posted or scored later); trained mean {fmt(reward.trained_mean, 4)}",
        end_section=True,
    )


def _consumer_rows(table: Table, consumers: dict[str, ConsumerCounts]) -> None:
    """The run's consumers by name: what each holds, and what it was delivered, acked and
    dropped."""
    _section(table, "consumers")
    if not consumers:
        table.add_row("none", "", "a consumer created on the run is counted from then on")
    for i, name in enumerate(sorted(consumers), 1):
        c = consumers[name]
        table.add_row(
            name,
            f"pending {c.pending:,}",
            f"delivered {c.delivered:,}, acked {c.acked:,}, dropped {c.dropped:,}",
            end_section=i == len(consumers),
        )


def accounting_table(
    acc: Accounting, run: Run | None = None, *, deleted: str | None = None
) -> RenderableType:
    """The accounting as a readable table: prompts handed out (for runs that use work leases),
    where rollouts went and what became samples. ``deleted`` names a run whose live state is
    gone (its accounting stays)."""
    from rich.table import Table

    name = run.run_id if run is not None else f"{deleted} (deleted)" if deleted else "run"
    table = Table(title=f"Accounting of {name}", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("count", justify="right")
    table.add_column("notes")

    if acc.prompts.registered:  # a run whose generators take their work from the broker
        _prompt_rows(table, acc.prompts)
    _section(table, "rollouts in")
    table.add_row("rollouts received", fmt(acc.rollouts_received), "accepted into the buffer")
    gs = run.config.get("group_size") if run is not None else None
    table.add_row(
        "groups received",
        fmt(acc.groups_received),
        f"group_size {gs}" if gs is not None else "",
    )
    table.add_row("duplicates", fmt(acc.duplicates), "repeated rollout_ids, not counted")
    table.add_row("rejected", fmt(sum(acc.rejected.values())), reasons(acc.rejected))
    table.add_row("tokens generated", fmt(acc.tokens_generated), "")
    table.add_row("tokens masked", fmt(acc.tokens_masked), masked_note(acc))
    _section(table, "where they are")
    table.add_row("buffered", fmt(acc.buffered), "")
    table.add_row("leased", fmt(acc.leased), "in live leases")
    table.add_row("retired", fmt(acc.retired_total), reasons(acc.retired))
    table.add_row("wasted tokens", fmt(acc.wasted_tokens), "of rollouts retired unused")
    ok, why = ledger_check(acc)
    table.add_row(
        "buffered + leased + retired",
        "✓" if ok else "✗",
        f"{acc.buffered:,} + {acc.leased:,} + {acc.retired_total:,} = {acc.rollouts_received:,}"
        " received",
    )
    table.add_row(
        "ledger = live",
        "",
        "buffered and leased as the broker counts them, all events applied, none dead-lettered"
        if ok
        else f"✗ {why}",
        end_section=True,
    )
    if acc.partials is not None:  # shown whenever the broker reports them, zeros too
        _partial_rows(table, acc.partials)
    if acc.rewards is not None:  # shown whenever the broker reports them, zeros too
        _reward_rows(table, acc.rewards)
    _section(table, "waits")
    table.add_row("generators waited", seconds(acc.wait.generator_s), "for prompts or budget")
    rewards = acc.wait.reward_s is not None
    table.add_row(
        "trainers waited", seconds(acc.wait.trainer_s), "for rollouts", end_section=not rewards
    )
    if acc.wait.reward_s is not None:
        table.add_row(
            "rewards waited", seconds(acc.wait.reward_s), reward_wait_note(acc), end_section=True
        )
    _section(table, "samples out")
    max_reuse = run.config.get("max_reuse") if run is not None else None
    table.add_row("samples consumed", fmt(acc.samples_consumed), "Σ uses = Σ acked batch sizes")
    table.add_row(
        "samples rewound",
        fmt(acc.samples_rewound),
        "of them, given back by a rewind",
    )
    table.add_row("tokens consumed", fmt(acc.tokens_consumed), "trained tokens of the samples")
    table.add_row(
        "tokens masked stale",
        fmt(acc.tokens_masked_stale),
        "handed out with loss_mask 0 for their own lag (stale_tokens mask)",
    )
    table.add_row(
        "reuse factor",
        fmt(acc.reuse_factor, 3),
        "samples / rollouts" + (f" (max_reuse {max_reuse})" if max_reuse is not None else ""),
    )
    b = acc.batches
    table.add_row(
        "batches",
        fmt(b.leased),
        f"acked {b.acked:,}, nacked {b.nacked:,}, expired {b.expired:,}",
        end_section=True,
    )
    _section(table, "off-policy")
    table.add_row("lag", f"mean {fmt(acc.lag.mean, 3)}", f"max {fmt(acc.lag.max)}; over samples")
    table.add_row(
        "token lag",
        f"mean {fmt(acc.lag.token_mean, 3)}",
        "over trained tokens, each by the version that sampled it",
    )
    table.add_row("lag histogram", "", histogram(acc.lag.histogram))
    table.add_row("KL", f"mean {fmt(acc.kl.mean, 3)}", f"max {fmt(acc.kl.max, 3)}")
    table.add_row(
        "IS ratio",
        f"mean {fmt(acc.is_ratio.mean, 4)}",
        f"clip fraction {fmt(acc.is_ratio.clip_fraction, 3)}",
        end_section=acc.bias is not None or acc.consumers is not None,
    )
    if acc.bias is not None:  # shown whenever the broker reports it
        _bias_rows(table, acc.bias)
    if acc.consumers is not None:  # shown whenever the broker reports them, none too
        _consumer_rows(table, acc.consumers)
    if acc.pending_events:
        table.caption = f"{acc.pending_events} events not yet in the accounting"
    return table


def versions_table(rows: list[VersionAccounting]) -> RenderableType:
    from rich import box
    from rich.table import Table

    reasons = sorted({k for v in rows for k in v.retired})
    table = Table(
        title="Accounting by policy version",
        caption="masked: tokens posted with loss_mask 0; rewound: of the samples, uses a rewind "
        "gave back; token lag: over trained tokens; retired, by reason, on the right",
        box=box.SIMPLE_HEAD,
    )
    cols = (
        *("version", "received", "masked", "buffered", "leased"),
        *("samples", "rewound", "reuse", "lag"),
    )
    for col in (*cols, "token lag", *reasons):
        table.add_column(col, justify="right")
    for v in rows:
        table.add_row(
            str(v.policy_version),
            fmt(v.rollouts_received),
            fmt(v.tokens_masked),
            fmt(v.buffered),
            fmt(v.leased),
            fmt(v.samples_consumed),
            fmt(v.samples_rewound),
            fmt(v.reuse_factor, 3),
            fmt(v.lag.mean, 3),
            fmt(v.lag.token_mean, 3),
            *(fmt(v.retired.get(k, 0)) for k in reasons),
        )
    return table


def training_table(rows: list[TrainingVersion]) -> RenderableType:
    from rich import box
    from rich.table import Table

    table = Table(
        title="Training by policy version",
        caption="acknowledged batches by the trainer's version V of their lease",
        box=box.SIMPLE_HEAD,
    )
    for col in ("version", "batches", "samples", "tokens", "KL mean", "KL max", "IS mean", "clip"):
        table.add_column(col, justify="right")
    for v in rows:
        table.add_row(
            str(v.policy_version),
            fmt(v.batches),
            fmt(v.samples),
            fmt(v.tokens),
            fmt(v.kl_mean, 3),
            fmt(v.kl_max, 3),
            fmt(v.is_ratio_mean, 4),
            fmt(v.clip_fraction, 3),
        )
    return table


def generators_table(rows: list[GeneratorAccounting]) -> RenderableType:
    """One line per generator, narrow enough for 80 columns."""
    from rich import box
    from rich.table import Table

    table = Table(
        title="Accounting by generator",
        caption="samples: uses of its rollouts, less those a rewind undid; clip, masked: "
        "shares of its measured tokens; seen: its newest rollout (UTC); Q: quarantined",
        box=box.SIMPLE_HEAD,
        # The box's own blank separates the columns: no padding, so that 80 columns hold it.
        padding=0,
        show_edge=False,
    )
    table.add_column("generator", overflow="fold")
    for col in ("rollouts", "samples", "KL mean", "KL max", "IS mean", "clip", "masked"):
        table.add_column(col, justify="right")
    table.add_column("seen", justify="right", no_wrap=True)
    table.add_column("Q", justify="center")
    for g in rows:
        table.add_row(
            g.generator_id,
            fmt(g.rollouts),
            fmt(g.samples_consumed),
            fmt(g.kl.mean, 3),
            fmt(g.kl.max, 3),
            fmt(g.is_ratio.mean, 4),
            fmt(g.is_ratio.clip_fraction, 3),
            fmt(g.masked_fraction, 3),
            g.last_seen.strftime("%H:%M:%S") if g.last_seen else "–",
            "Q" if g.quarantined else "",
        )
    return table


# -- prompts ---------------------------------------------------------------------------------------


def prompts_table(
    run_id: str, rows: list[PromptState], counts: PromptCounts | None, more: bool
) -> RenderableType:
    """The run's passes counted by state, then the passes listed one per line."""
    from rich import box
    from rich.console import Group
    from rich.table import Table

    table = Table(
        title=f"Prompt passes of {run_id}",
        caption=f"{len(rows):,} shown; more with --limit (0: all)" if more else None,
        box=box.SIMPLE_HEAD,
        title_justify="left",
    )
    for col in ("prompt_id", "pass", "attempt", "state", "tries", "mean"):
        table.add_column(col, justify="left" if col in ("prompt_id", "state") else "right")
    for r in rows:
        mean = "–" if r.mean is None else f"{r.mean:.4g}"
        table.add_row(r.prompt_id, str(r.pass_), str(r.attempt), r.state, str(r.tries), mean)
    if counts is None:
        return table
    return Group(f"{counts.registered:,} passes registered: {prompt_line(counts)}", table)


# -- access: tokens and the audit log --------------------------------------------------------------


def tokens_table(rows: list[AccessToken]) -> RenderableType:
    """The tokens, newest first, revoked ones marked with the time, under it; never a secret
    (the broker has none)."""
    table = _narrow("Tokens")
    for col in ("token_id", "name", "scopes", "runs"):
        table.add_column(col, overflow="fold")
    _when_column(table, "created_at")
    table.add_column("created_by", overflow="fold")
    # "revoked" with its time under it: a column of times only when a token is revoked.
    revoked = any(t.revoked for t in rows)
    table.add_column("status", no_wrap=True, min_width=WHEN_WIDTH if revoked else None)
    for t in rows:
        table.add_row(
            t.token_id,
            t.name,
            ",".join(t.scopes),
            "all" if t.runs is None else ",".join(t.runs),
            _when(t.created_at),
            t.created_by or "–",
            f"revoked\n{_when(t.revoked_at)}" if t.revoked else "active",
        )
    return table


def audit_table(rows: list[AuditEntry], more: bool) -> RenderableType:
    table = _narrow(
        "Audit log, newest first",
        caption=f"{len(rows):,} shown; more with --limit (0: all)" if more else None,
    )
    table.add_column("id", justify="right", no_wrap=True)
    _when_column(table, "at")
    for col in ("actor", "token_id"):
        table.add_column(col, overflow="fold")
    table.add_column("action", no_wrap=True)
    for col in ("run_id", "detail"):
        table.add_column(col, overflow="fold")
    for e in rows:
        table.add_row(
            str(e.id),
            _when(e.at),
            e.actor,
            e.token_id or "–",
            e.action,
            e.run_id or "–",
            json.dumps(e.detail, sort_keys=True, separators=(",", ":")),
        )
    return table
