"""``watch``: a live view of a run, refreshed until Ctrl-C, that waits through a broker it
cannot reach and a run that does not exist yet."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated

import typer

from rollout_broker_client import (
    Accounting,
    BrokerClient,
    BrokerUnreachable,
    NotFound,
    Retry,
    Run,
    RunNotFound,
    ServerError,
)
from rollout_broker_client.cli.common import RunArg, Token, Url, connect, console
from rollout_broker_client.cli.views import (
    fmt,
    histogram,
    ledger_check,
    masked_note,
    prompt_line,
    reasons,
    reward_line,
    reward_wait_note,
    seconds,
)

if TYPE_CHECKING:
    from rich.console import RenderableType


@dataclasses.dataclass
class _Frame:
    run: Run
    acc: Accounting | None
    at: float
    error: str | None = None


def watch_view(now: _Frame, before: _Frame | None) -> RenderableType:
    """One frame of ``watch``: the buffer, the flow since the last frame, prompt passes, waits,
    lag, reuse and KL."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table

    run, acc = now.run, now.acc
    cfg = run.config
    head = (
        f"[bold]{run.run_id}[/]  {run.status}  policy v{run.policy_version}  "
        f"max_staleness {cfg.get('max_staleness')}  max_reuse {cfg.get('max_reuse')}  "
        f"kl_max {cfg.get('kl_max')}"
    )
    if acc is None:
        return Panel(f"{head}\naccounting unavailable: {now.error}", title="rollout-broker watch")

    def change(read: Callable[[Accounting], float], unit: str) -> str:
        if before is None or before.acc is None or now.at <= before.at:
            return ""
        return f"{(read(acc) - read(before.acc)) / (now.at - before.at):,.1f}{unit}"

    def rate(field: str) -> str:
        return change(lambda a: float(getattr(a, field)), "/s")

    flow = Table(show_header=False, box=None, pad_edge=False)
    flow.add_column("what")
    flow.add_column("count", justify="right")
    flow.add_column("notes")
    cap = cfg.get("capacity_rollouts")
    flow.add_row("buffered", fmt(acc.buffered), f"of capacity {cap:,}" if cap else "")
    flow.add_row("leased", fmt(acc.leased), "")
    flow.add_row("rollouts received", fmt(acc.rollouts_received), rate("rollouts_received"))
    flow.add_row("samples consumed", fmt(acc.samples_consumed), rate("samples_consumed"))
    flow.add_row("samples rewound", fmt(acc.samples_rewound), "uses a rewind gave back")
    flow.add_row("reuse factor", fmt(acc.reuse_factor, 3), "")
    p = acc.prompts
    done = change(lambda a: a.prompts.done, " done/s")
    flow.add_row("prompt passes", fmt(p.registered), prompt_line(p) + (f", {done}" if done else ""))
    # Seconds waited per second: how many requests were waiting at a time, on average.
    busy = change(lambda a: a.wait.generator_s, " waiting on average")
    flow.add_row("generators waited", seconds(acc.wait.generator_s), busy)
    busy = change(lambda a: a.wait.trainer_s, " waiting on average")
    flow.add_row("trainers waited", seconds(acc.wait.trainer_s), busy)
    if acc.rewards is not None:  # a broker that reports rewards
        scored = change(lambda a: a.rewards.scored if a.rewards else 0, " scored/s")
        line = reward_line(acc.rewards) + (f", {scored}" if scored else "")
        flow.add_row("rewards scored", fmt(acc.rewards.scored), line)
    if acc.wait.reward_s is not None:
        flow.add_row("rewards waited", seconds(acc.wait.reward_s), reward_wait_note(acc))
    flow.add_row("retired", fmt(acc.retired_total), reasons(acc.retired))
    flow.add_row(
        "tokens masked",
        fmt(acc.tokens_masked),
        f"{masked_note(acc)}; masked stale at hand-out {acc.tokens_masked_stale:,}",
    )
    ok, why = ledger_check(acc)
    flow.add_row("ledger = live", "✓" if ok else "✗", why)
    flow.add_row("KL", f"mean {fmt(acc.kl.mean, 3)}", f"max {fmt(acc.kl.max, 3)}")
    flow.add_row(
        "IS ratio",
        f"mean {fmt(acc.is_ratio.mean, 4)}",
        f"clip {fmt(acc.is_ratio.clip_fraction, 3)}",
    )
    lag = (
        f"lag mean {fmt(acc.lag.mean, 3)}, max {fmt(acc.lag.max)}, "
        f"token lag mean {fmt(acc.lag.token_mean, 3)}\n" + histogram(acc.lag.histogram)
    )
    pending = f"  ({acc.pending_events} events pending)" if acc.pending_events else ""
    return Panel(
        Group(head + pending, flow, lag),
        title="rollout-broker watch",
        subtitle=time.strftime("%H:%M:%S"),
    )


def _frame(broker: BrokerClient, run_id: str) -> _Frame:
    run = broker.get_run(run_id)
    try:
        acc = broker.accounting(run_id)
    except NotFound as err:  # a server without the accounting API, or one not caught up yet
        return _Frame(run, None, time.monotonic(), err.detail)
    return _Frame(run, acc, time.monotonic())


def waiting_view(run_id: str, why: str) -> RenderableType:
    """A frame of ``watch`` while there is nothing to show yet, and why."""
    from rich.panel import Panel

    return Panel(
        f"[bold]{run_id}[/]  waiting: {why}",
        title="rollout-broker watch",
        subtitle=time.strftime("%H:%M:%S"),
    )


def watch(
    run_id: RunArg,
    url: Url = None,
    token: Token = None,
    interval: Annotated[float, typer.Option(help="Seconds between refreshes", min=0.05)] = 1.0,
    count: Annotated[
        int | None, typer.Option(help="Stop after this many refreshes (default: until Ctrl-C)")
    ] = None,
) -> None:
    """A live view of a run: buffered, leased, flow rates, prompt passes, waits, lag histogram,
    reuse factor, KL. A broker that cannot be reached or is unavailable, and a run that does
    not exist yet, are shown as such and tried again at the next refresh."""
    from rich.live import Live

    screen = console()
    # One attempt a refresh: the refreshes are the retries.
    with connect(url, token, retry=Retry(retries=0)) as broker:
        where = url or broker.base_url
        before: _Frame | None = None
        shown = 0
        live = Live(console=screen, auto_refresh=False) if screen.is_terminal else None
        with live if live is not None else contextlib.nullcontext():
            try:
                while count is None or shown < count:
                    if shown:
                        time.sleep(interval)
                    view: RenderableType
                    try:
                        now = _frame(broker, run_id)
                    except RunNotFound:
                        view = waiting_view(run_id, f"no run {run_id!r} (yet)")
                    except BrokerUnreachable as err:
                        view = waiting_view(run_id, f"cannot reach the broker at {where}: {err}")
                    except ServerError as err:  # 5xx: an outage of its Redis or Postgres
                        view = waiting_view(run_id, f"{err.error}: {err.detail}")
                    else:
                        view = watch_view(now, before)
                        before = now
                    if live is not None:
                        live.update(view, refresh=True)
                    else:  # not a terminal: one frame after the other
                        screen.print(view)
                    shown += 1
            except KeyboardInterrupt:
                pass
