"""The operator commands but ``watch``: runs, policy versions, batches, consumers, the
accounting, prompt passes, access tokens and the audit log, each one or a few requests through
the client."""

from __future__ import annotations

import contextlib
import itertools
import json
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Literal, cast

import typer

from rollout_broker_client import BrokerClient, RunConflict, RunNotFound
from rollout_broker_client.cli.common import (
    PROG,
    AsJson,
    RunArg,
    Token,
    Url,
    check_run_id,
    connect,
    console,
    fail,
    parse_config,
    print_json,
    show,
)
from rollout_broker_client.cli.views import (
    accounting_table,
    audit_table,
    consumer_detail,
    generators_table,
    prompts_table,
    run_detail,
    run_table,
    tokens_table,
    training_table,
    versions_table,
)
from rollout_broker_client.protocol import token_id_of

if TYPE_CHECKING:
    from rollout_broker_client import Scope

runs_cli = typer.Typer(help="List, create, show, configure and close runs.", no_args_is_help=True)
policy_cli = typer.Typer(help="Policy versions of a run.", no_args_is_help=True)
generators_cli = typer.Typer(help="Generators of a run: lift a quarantine.", no_args_is_help=True)
batches_cli = typer.Typer(help="Leased batches of a run.", no_args_is_help=True)
consumers_cli = typer.Typer(
    help="Consumers of a run (reward-model and preference trainers): create, show, delete.",
    no_args_is_help=True,
)
tokens_cli = typer.Typer(
    help="Create, list and revoke the access tokens of a broker with auth on (scope admin).",
    no_args_is_help=True,
)


@runs_cli.command("list")
def runs_list(
    status: Annotated[
        Literal["open", "closed"] | None, typer.Option(help="Only open or only closed runs")
    ] = None,
    url: Url = None,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Every run (not deleted), newest first."""
    with connect(url, token) as broker:
        runs = broker.list_runs(status)
    show(runs, as_json, run_table)


@runs_cli.command("create")
def runs_create(
    run_id: Annotated[
        str | None, typer.Argument(help="Run id (default: a new one)", callback=check_run_id)
    ] = None,
    config: Annotated[
        list[str] | None,
        typer.Option(
            "--config",
            "-c",
            help="RunConfig field of the new run as KEY=VALUE; repeat for more (`runs config` "
            "changes an existing run's)",
        ),
    ] = None,
    url: Url = None,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Create a run (the same id and config again is a no-op; another config for an existing
    run is refused: change it with `runs config`)."""
    cfg = parse_config(config or [])
    with connect(url, token) as broker:
        try:
            run = broker.create_run(run_id, cfg)
        except RunConflict as err:
            if run_id is None:  # an id of the broker's choosing
                raise
            raise fail(f"{err.error}: {err.detail}; {_conflict_advice(broker, run_id)}") from None
    show(run, as_json, run_detail)


def _conflict_advice(broker: BrokerClient, run_id: str) -> str:
    """What to do about a run id that ``runs create`` was refused: change the config of the
    run that has it, or, when that run was deleted (its accounting keeps the id), pick another
    id."""
    name = PROG.get()
    try:
        broker.get_run(run_id)
    except RunNotFound:
        return (
            f"pick another run id: `{name} runs list` shows the runs there are, "
            f"`{name} accounting {run_id}` the deleted run's accounting"
        )
    return f"change its config with `{name} runs config {run_id} -c KEY=VALUE`"


@runs_cli.command("config")
def runs_config(
    run_id: RunArg,
    config: Annotated[
        list[str],
        typer.Option("--config", "-c", help="RunConfig field as KEY=VALUE; repeat for more"),
    ],
    url: Url = None,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Change fields of a run's config (the others keep their values); the rules apply from the
    broker's next decision on."""
    cfg = parse_config(config)
    with connect(url, token) as broker:
        run = broker.patch_config(run_id, **cfg)
    show(run, as_json, run_detail)


@runs_cli.command("show")
def runs_show(
    run_id: RunArg,
    url: Url = None,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """A run's status, policy version and config."""
    with connect(url, token) as broker:
        run = broker.get_run(run_id)
    show(run, as_json, run_detail)


@runs_cli.command("close")
def runs_close(
    run_id: RunArg,
    url: Url = None,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Close a run: its buffered rollouts retire (run_closed); the accounting stays."""
    with connect(url, token) as broker:
        run = broker.close_run(run_id)
    show(run, as_json, run_detail)


@runs_cli.command("delete")
def runs_delete(
    run_id: Annotated[str, typer.Argument(help="Run id")],
    url: Url = None,
    token: Token = None,
) -> None:
    """Delete a closed run's live state once its accounting has caught up; the accounting
    stays. Refused (409) while the run is open, or until its leases are back and its events
    applied."""
    with connect(url, token) as broker:
        broker.delete_run(run_id)
    console().print(f"run {run_id} deleted")


@generators_cli.command("release")
def generators_release(
    run_id: RunArg,
    generator_id: Annotated[str, typer.Argument(help="Generator id")],
    url: Url = None,
    token: Token = None,
) -> None:
    """Lift a generator's quarantine (its mean KL passed the run's generator_kl_max): it may post
    rollouts and take work again."""
    with connect(url, token) as broker:
        released = broker.release_generator(run_id, generator_id)
    what = "released" if released else "was not quarantined"
    console().print(f"generator {generator_id} of run {run_id} {what}")


# -- consumers -------------------------------------------------------------------------------------


class Source(StrEnum):
    received = "received"
    trained = "trained"


class Kind(StrEnum):
    rollouts = "rollouts"
    preferences = "preferences"


class Pairs(StrEnum):
    best_worst = "best_worst"
    all = "all"


NameArg = Annotated[str, typer.Argument(help="Consumer name")]


@consumers_cli.command("create")
def consumers_create(
    run_id: RunArg,
    name: NameArg,
    source: Annotated[
        Source,
        typer.Option(help="received: every scored rollout; trained: those that reached a gradient"),
    ],
    kind: Annotated[
        Kind, typer.Option(help="rollouts, or preference pairs of complete groups")
    ] = Kind.rollouts,
    max_lag: Annotated[
        int | None,
        typer.Option(min=0, help="Drop items more than this many versions behind (default: none)"),
    ] = None,
    min_margin: Annotated[
        float | None,
        typer.Option(min=0, help="Kind preferences: the least reward difference of a pair"),
    ] = None,
    pairs: Annotated[
        Pairs | None,
        typer.Option(
            help="Kind preferences: one pair per group, or every pair (default best_worst)"
        ),
    ] = None,
    retention: Annotated[
        int | None,
        typer.Option(min=1, help="Most rollouts the consumer may hold pending (default 100000)"),
    ] = None,
    url: Url = None,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Create a consumer of a run's scored rollouts, from now on (the same name and config again
    is a no-op; another config under the name is refused)."""
    with connect(url, token) as broker:
        info = broker.create_consumer(
            run_id,
            name,
            source=source.value,
            kind=kind.value,
            max_lag=max_lag,
            min_margin=min_margin,
            pairs=None if pairs is None else pairs.value,
            retention_rollouts=retention,
        )
    show(info, as_json, consumer_detail)


@consumers_cli.command("show")
def consumers_show(
    run_id: RunArg, name: NameArg, url: Url = None, token: Token = None, as_json: AsJson = False
) -> None:
    """A consumer's config and counts: delivered, acked, dropped, pending (leased among them)."""
    with connect(url, token) as broker:
        info = broker.get_consumer(run_id, name)
    show(info, as_json, consumer_detail)


@consumers_cli.command("delete")
def consumers_delete(run_id: RunArg, name: NameArg, url: Url = None, token: Token = None) -> None:
    """Delete a consumer: its pending and leased items are counted dropped."""
    with connect(url, token) as broker:
        broker.delete_consumer(run_id, name)
    console().print(f"consumer {name} of run {run_id} deleted")


# -- policy ----------------------------------------------------------------------------------------


Weights = Annotated[
    str | None,
    typer.Option(
        "--weights",
        metavar="URI",
        help="Where the version's weights are (a path or URI), kept with the version for the "
        "generators that follow it",
    ),
]
Rewind = Annotated[
    bool, typer.Option("--rewind", help="Move the run back to an earlier version (a checkpoint's)")
]


@runs_cli.command("policy")
def runs_policy(
    run_id: RunArg,
    version: Annotated[int, typer.Argument(help="The new policy version", min=0)],
    weights: Weights = None,
    rewind: Rewind = False,
    url: Url = None,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Announce a new policy version (and where its weights are); rollouts now too stale
    retire."""
    with connect(url, token) as broker:
        result = broker.set_policy(run_id, version, weights=weights, rewind=rewind)
    if as_json:
        print_json(result)
    else:
        typer.echo(
            f"run {run_id} is at policy version {result.policy_version}; "
            f"{result.evicted} rollouts retired as {'rewound' if rewind else 'stale'}"
        )


@policy_cli.command("set")
def policy_set(
    run_id: RunArg,
    version: Annotated[int, typer.Argument(help="The new policy version", min=0)],
    weights: Weights = None,
    rewind: Rewind = False,
    url: Url = None,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Announce a new policy version; rollouts now too stale retire (as `runs policy`)."""
    runs_policy(run_id, version, weights, rewind, url, token, as_json)


# -- batches ---------------------------------------------------------------------------------------


@batches_cli.command("nack")
def batches_nack(
    run_id: RunArg,
    batch_id: Annotated[str, typer.Argument(help="Batch id (from the lease)")],
    url: Url = None,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Give a leased batch back unused: its rollouts return to the buffer as they were, as when
    its trainer fails (and it does not wait for the lease to expire)."""
    with connect(url, token) as broker:
        returned = broker.nack(run_id, batch_id)
    if as_json:
        print_json({"returned": returned})
    else:
        typer.echo(f"batch {batch_id} of run {run_id}: {returned} rollouts back in the buffer")


# -- accounting ------------------------------------------------------------------------------------


def accounting(
    run_id: RunArg,
    url: Url = None,
    token: Token = None,
    as_json: AsJson = False,
    versions: Annotated[
        bool, typer.Option("--versions", help="Per policy version of the rollouts")
    ] = False,
    training: Annotated[
        bool,
        typer.Option(
            "--training",
            help="Per policy version of the trainer: batches, samples, tokens, KL, IS ratio, clip",
        ),
    ] = False,
    generators: Annotated[
        bool,
        typer.Option(
            "--generators",
            help="Per generator: rollouts, samples, KL, IS ratio, clip and masked fractions, "
            "last seen, quarantined",
        ),
    ] = False,
) -> None:
    """A run's sample/rollout accounting (from Postgres; may trail by a second or two)."""
    if versions + training + generators > 1:
        raise typer.BadParameter(
            "they cannot be used together: give one",
            param_hint="'--versions' / '--training' / '--generators'",
        )
    with connect(url, token, reads_deleted=True) as broker:
        if generators:
            show(broker.accounting_generators(run_id), as_json, generators_table)
            return
        if versions:
            rows = broker.accounting_versions(run_id)
            show(rows, as_json, versions_table)
            return
        if training:
            trained = broker.accounting_training(run_id)
            show(trained, as_json, training_table)
            return
        acc = broker.accounting(run_id)
        run = None
        if not as_json:
            with contextlib.suppress(RunNotFound):  # deleted: its accounting stays
                run = broker.get_run(run_id)
    if as_json:
        typer.echo(json.dumps(acc.raw, indent=2, sort_keys=True, default=str))
    else:
        console().print(accounting_table(acc, run, deleted=None if run else run_id))


# -- prompts ---------------------------------------------------------------------------------------


# The states of a prompt pass (the client's PromptStateName), spelled here for typer to read.
PassState = Literal["queued", "in_flight", "done", "failed", "skipped", "cancelled"]
Pool = Literal["easy", "normal", "hard"]


def prompts(
    run_id: RunArg,
    state: Annotated[
        PassState | None, typer.Option("--state", "-s", help="Only passes in this state")
    ] = None,
    pool: Annotated[
        Pool | None,
        typer.Option("--pool", help="Only passes of prompts in this difficulty pool"),
    ] = None,
    limit: Annotated[
        int, typer.Option(help="Show at most this many passes (0: all of them)", min=0)
    ] = 50,
    url: Url = None,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """A run's prompt passes (runs whose generators take work from the broker): each one's
    state, attempt and tries, in prompt order (from the accounting; may trail by a second)."""
    with connect(url, token, reads_deleted=True) as broker:
        counts = None if as_json else broker.accounting(run_id).prompts
        page_size = min(limit + 1, 1000) if limit else 1000
        found = broker.prompt_states(run_id, state, page_size=page_size, pool=pool)
        rows = list(itertools.islice(found, limit + 1 if limit else None))
    more = bool(limit) and len(rows) > limit
    rows = rows[:limit] if limit else rows
    if as_json:
        docs = [
            {"prompt_id": r.prompt_id, "pass": r.pass_, "attempt": r.attempt, "state": r.state,
             "tries": r.tries, "mean": r.mean}
            for r in rows
        ]  # fmt: skip
        typer.echo(json.dumps(docs, indent=2))
    else:
        console().print(prompts_table(run_id, rows, counts, more))


# -- access: tokens and the audit log --------------------------------------------------------------


class ScopeName(StrEnum):
    """The scopes of a token (the client's ``Scope``), spelled here for typer to read."""

    GENERATE = "generate"
    REWARD = "reward"
    TRAIN = "train"
    OPERATE = "operate"
    ADMIN = "admin"


SECRET_WARNING = (
    "warning: the token is shown only this once (the broker keeps only a digest of it): "
    "store it now"
)


@tokens_cli.command("create")
def tokens_create(
    name: Annotated[str, typer.Argument(help="Who holds the token: the audit log names it")],
    scope: Annotated[
        list[ScopeName],
        typer.Option(
            "--scope",
            "-s",
            help="What the token may do: generate, reward, train, operate or admin; repeat for"
            " more",
        ),
    ],
    run: Annotated[
        list[str] | None,
        typer.Option(
            "--run",
            "-r",
            help="A run id or prefix* pattern the token may touch; repeat for more "
            "(default: every run)",
        ),
    ] = None,
    url: Url = None,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Create a token (needs an admin token) and print its id and its secret, once."""
    with connect(url, token) as broker:
        scopes = cast("list[Scope]", [s.value for s in scope])
        new = broker.create_token(name, scopes, run or None)
    if as_json:
        print_json(new)
    else:
        typer.echo(f"token_id: {new.token_id}")
        typer.echo(f"token:    {new.token}")
    typer.echo(SECRET_WARNING, err=True)


@tokens_cli.command("list")
def tokens_list(
    url: Url = None,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Every token, newest first, revoked ones included; no secret is ever shown."""
    with connect(url, token) as broker:
        rows = broker.list_tokens()
    show(rows, as_json, tokens_table)


@tokens_cli.command("revoke")
def tokens_revoke(
    token_id: Annotated[str, typer.Argument(help="The token's id (from `tokens list`)")],
    url: Url = None,
    token: Token = None,
) -> None:
    """Revoke a token: every API process of the broker refuses it within a second (revoking
    it again changes nothing)."""
    with connect(url, token) as broker:
        broker.revoke_token(token_id)
    typer.echo(f"token {token_id_of(token_id)} revoked")


def audit(
    run: Annotated[
        str | None, typer.Option("--run", help="Only this run's entries", callback=check_run_id)
    ] = None,
    limit: Annotated[
        int, typer.Option(help="Show at most this many entries (0: all of them)", min=0)
    ] = 50,
    url: Url = None,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Operator actions, newest first: who (the token's name and id) created, changed, closed or
    deleted which run, set its policy version, or created or revoked a token (scope operate)."""
    with connect(url, token) as broker:
        page_size = min(limit + 1, 1000) if limit else 1000
        found = broker.audit_entries(run, page_size=page_size)
        rows = list(itertools.islice(found, limit + 1 if limit else None))
    more = bool(limit) and len(rows) > limit
    rows = rows[:limit] if limit else rows
    if as_json:
        print_json(rows)
    else:
        console().print(audit_table(rows, more))
