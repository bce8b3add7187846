"""The operator commands as one typer application: ``mount`` adds them, with the global
options ``--url``, ``--token`` and ``--version``, to a typer app (the server's
``rollout-broker``); ``build`` makes the client's own ``rollout-broker-ctl``."""

# No `from __future__ import annotations` here: typer reads the signature of the callback that
# mount() defines, whose option types are local to it.

from collections.abc import Callable
from typing import Annotated

import typer

from rollout_broker_client import DEFAULT_URL, __version__
from rollout_broker_client.cli import commands, watch
from rollout_broker_client.cli.common import PROG, TOKEN_HELP, URL_HELP, GlobalOptions

HELP = (
    "Rollout Broker's operator commands: runs, policy versions, batches, consumers, the "
    "accounting, prompt passes, a live view, access tokens and the audit log."
)


def mount(app: typer.Typer, *, name: str, version: str) -> None:
    """Add the operator commands to ``app``, and the global options as its callback (which
    ``app`` must not have yet); ``--version`` prints ``name`` and ``version``."""
    if app.registered_callback is not None:
        raise ValueError("the app has a callback already: the global options would replace it")
    app.callback()(_global_options(name, version))
    app.add_typer(commands.runs_cli, name="runs")
    app.add_typer(commands.policy_cli, name="policy")
    app.add_typer(commands.batches_cli, name="batches")
    app.add_typer(commands.generators_cli, name="generators")
    app.add_typer(commands.consumers_cli, name="consumers")
    app.add_typer(commands.tokens_cli, name="tokens")
    for command in (commands.accounting, commands.prompts, commands.audit, watch.watch):
        app.command()(command)


def build(name: str = "rollout-broker-ctl", version: str = __version__) -> typer.Typer:
    """The operator commands alone, as the client installs them."""
    app = typer.Typer(help=HELP, no_args_is_help=True, add_completion=False)
    mount(app, name=name, version=version)
    return app


def _global_options(name: str, version: str) -> Callable[..., None]:
    def print_version(value: bool) -> None:
        if value:
            typer.echo(f"{name} {version}")
            raise typer.Exit()

    def options(
        ctx: typer.Context,
        url: Annotated[
            str, typer.Option("--url", envvar="BROKER_URL", show_envvar=True, help=URL_HELP)
        ] = DEFAULT_URL,
        token: Annotated[
            str | None,
            typer.Option(
                "--token",
                envvar="BROKER_TOKEN",
                show_envvar=True,
                show_default=False,
                help=TOKEN_HELP,
            ),
        ] = None,
        show_version: Annotated[
            bool,
            typer.Option(
                "--version", callback=print_version, is_eager=True, help="Print the version"
            ),
        ] = False,
    ) -> None:
        # Runs before every command: the operator commands take the broker's URL and the token
        # from here unless given their own (serve, worker and migrate ignore them), and check
        # the URL only then.
        source = ctx.get_parameter_source("url")
        from_env = source is not None and source.name == "ENVIRONMENT"
        ctx.obj = GlobalOptions(
            url=url, token=token, url_from="BROKER_URL" if from_env else "--url"
        )
        PROG.set(name)

    return options
