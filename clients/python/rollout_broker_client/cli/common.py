"""What the operator commands share: the global options, the client of one command with its
errors as one line, the checks of a run id and of the broker's URL, and output as JSON or for a
person."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from rollout_broker_client import (
    DEFAULT_URL,
    BrokerClient,
    BrokerError,
    BrokerHTTPError,
    BrokerUnreachable,
    Forbidden,
    Retry,
    RunNotFound,
    Unauthorized,
)
from rollout_broker_client.protocol import base_url_of, is_run_id

if TYPE_CHECKING:
    from rich.console import Console

URL_HELP = "The broker's base URL, without the API's prefix /v1"
TOKEN_HELP = (
    "Bearer token for a broker with auth on; BROKER_TOKEN keeps it off the command line, "
    "where other users of the machine can read it"
)


@dataclasses.dataclass(frozen=True)
class GlobalOptions:
    """The options given before the command's name (``--url``, ``--token``), kept as the
    object of the command line's context for the commands to find, with where the URL came
    from (``url_from``: ``--url`` or ``BROKER_URL``)."""

    url: str = DEFAULT_URL
    token: str | None = None
    url_from: str = "--url"


def _global(ctx: typer.Context) -> GlobalOptions:
    found = ctx.find_object(GlobalOptions)
    return found if found is not None else GlobalOptions()


# The name of the command line running (rollout-broker or rollout-broker-ctl), for advice that
# names another of its commands; the global options, which run before every command, set it.
PROG: ContextVar[str] = ContextVar("PROG", default="rollout-broker-ctl")


def check_url(url: str, given_as: str) -> str:
    """``url``, or the reason the client refuses it as a base URL (a ``/v1`` suffix, a query),
    as the command's one-line error."""
    try:
        base_url_of(url)
    except ValueError as err:
        raise fail(f"{given_as} {err}", code=2) from None
    return url


def _url_or_global(ctx: typer.Context, value: str | None) -> str:
    if value:
        return check_url(value, "--url")
    options = _global(ctx)
    return check_url(options.url, options.url_from)


def _token_or_global(ctx: typer.Context, value: str | None) -> str | None:
    return value or _global(ctx).token


# A command's own --url and --token, which win over the global ones: what the command gets is
# whichever applies (a token of None: the client reads BROKER_TOKEN).
Url = Annotated[
    str | None,
    typer.Option(
        "--url",
        help=URL_HELP + " (default: the global --url, or BROKER_URL)",
        show_default=False,
        callback=_url_or_global,
    ),
]
Token = Annotated[
    str | None,
    typer.Option(
        "--token",
        help=TOKEN_HELP + " (default: the global --token)",
        show_default=False,
        callback=_token_or_global,
    ),
]
AsJson = Annotated[bool, typer.Option("--json", help="Print JSON for scripts")]


def fail(message: str, code: int = 1) -> typer.Exit:
    """End the command with ``message`` as its one line on stderr."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def check_run_id(value: str | None) -> str | None:
    """A run id as the broker accepts them, checked before any request: ``.`` and ``..`` would
    not even reach the run, a URL path resolves them away."""
    if value is not None and not is_run_id(value):
        raise typer.BadParameter(
            f"{value!r} is not a run id: 1 to 128 of A-Z a-z 0-9 . _ -, other than . and .."
        )
    return value


RunArg = Annotated[str, typer.Argument(help="Run id", callback=check_run_id)]


def console() -> Console:
    from rich.console import Console

    return Console(highlight=False)  # built per command: it binds the current sys.stdout


@contextlib.contextmanager
def connect(
    url: str | None,
    token: str | None = None,
    retry: Retry | None = None,
    *,
    reads_deleted: bool = False,
) -> Iterator[BrokerClient]:
    """A client for one command; broker errors become one line on stderr and exit status 1.
    A request is sent again a few times, for a second or so, before the broker counts as
    unreachable: an operator waits for an answer, not for a minute of retries.

    A run not found is told where to look for the runs there are; ``reads_deleted`` is for a
    command that reads deleted runs too (their accounting), so whose run not found was never
    one, rather than perhaps deleted."""
    try:
        client = BrokerClient(url, retry=retry or Retry(retries=3), token=token)
    except ValueError as err:  # a token that cannot be sent; the message does not quote it
        raise fail(str(err)) from None
    try:
        with client as opened:
            yield opened
    except Unauthorized as err:
        raise fail(
            f"{err.error}: {err.detail}; pass --token or set BROKER_TOKEN to a token of this broker"
        ) from None
    except Forbidden as err:
        raise fail(
            f"{err.error}: {err.detail}; pass --token or set BROKER_TOKEN to a token allowed to "
            "do this"
        ) from None
    except RunNotFound as err:
        runs = f"`{PROG.get()} runs list` shows the runs there are"
        advice = runs if reads_deleted else f"it may have been deleted: {runs}"
        raise fail(f"{err.error}: {err.detail}; {advice}") from None
    except BrokerHTTPError as err:
        raise fail(f"{err.error}: {err.detail}") from None
    except BrokerUnreachable as err:
        raise fail(f"cannot reach the broker at {url or client.base_url}: {err}") from None
    except BrokerError as err:
        raise fail(f"{type(err).__name__}: {err}") from None


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: _jsonable(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if f.name != "raw"
        }
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


T = TypeVar("T")


def print_json(value: Any) -> None:
    typer.echo(json.dumps(_jsonable(value), indent=2, sort_keys=True))


def show(value: T, as_json: bool, render: Callable[[T], Any]) -> None:
    """``value`` as JSON (``--json``), or as what ``render`` makes of it for a person."""
    if as_json:
        print_json(value)
    else:
        console().print(render(value))


def parse_config(items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs; a value is read as JSON when it parses (numbers, true/false), else
    taken as a string (``order=fifo``)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--config")
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw
    return out
