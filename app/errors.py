"""The broker's one error hierarchy; a single handler renders every error as
``{"error": <class name>, "detail": <text>}`` with the class's HTTP status.

    BrokerError (500)
    ├── InternalError (500)        a broker bug, e.g. a store error code with no entry in
    │                              app/broker/replies.py's table (logged where it is raised)
    ├── BadRequest (400)
    ├── Unauthorized (401)
    ├── Forbidden (403)
    ├── NotFound (404)
    │   ├── RunNotFound
    │   ├── TokenNotFound
    │   ├── BatchNotFound
    │   └── WorkLeaseNotFound
    ├── MethodNotAllowed (405)
    ├── Conflict (409)
    │   ├── RunClosed
    │   ├── WorkLeaseOver
    │   ├── RunConflict            same run_id, different config (or a deleted run's id)
    │   ├── TokenNameTaken         a live token has the name already
    │   ├── RunOpen                deleting a run that is not closed
    │   ├── RunBusy                deleting a closed run not yet settled; carries Retry-After
    │   ├── VersionConflict        policy version moving backwards
    │   ├── LeaseExpired           ack after the lease ran out
    │   └── BatchSettled           nack of a batch that was acked, or the reverse
    ├── PayloadTooLarge (413)
    ├── UnsupportedMediaType (415)
    ├── ValidationFailed (422)
    ├── OverCapacity (429)         carries Retry-After
    └── Unavailable (503)          Redis or Postgres unreachable, or Redis refusing writes for
        │                          now (see :func:`outage_of`); carries Retry-After when the
        │                          outage is expected to pass
        └── NotReplicated          a write that too few Redis replicas acknowledged in time
                                   (BROKER_REDIS_WAIT_REPLICAS, app/replicas.py); answered as
                                   `Unavailable`, with Retry-After
"""

from __future__ import annotations

import re
from collections.abc import Callable
from types import TracebackType

import asyncpg  # type: ignore[import-untyped]
import redis.exceptions
import sqlalchemy.exc


class BrokerError(Exception):
    status: int = 500

    def __init__(self, detail: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.headers = headers or {}

    @property
    def name(self) -> str:
        return type(self).__name__


class InternalError(BrokerError):
    pass


class BadRequest(BrokerError):
    status = 400


class Unauthorized(BrokerError):
    """No token, or one the broker does not know (or has revoked)."""

    status = 401

    def __init__(self, detail: str) -> None:
        super().__init__(detail, headers={"WWW-Authenticate": "Bearer"})


class Forbidden(BrokerError):
    """The token lacks the scope or the run; or, with auth off, a foreign web page asked."""

    status = 403


class NotFound(BrokerError):
    status = 404


class RunNotFound(NotFound):
    pass


class TokenNotFound(NotFound):
    pass


class BatchNotFound(NotFound):
    pass


class MethodNotAllowed(BrokerError):
    """The path exists, not with this method (the router's own 405)."""

    status = 405


class Conflict(BrokerError):
    status = 409


class WorkLeaseNotFound(NotFound):
    pass


class RewardLeaseNotFound(NotFound):
    pass


class ConsumerNotFound(NotFound):
    pass


class RewardConflict(Conflict):
    pass


class RewardLeaseOver(Conflict):
    pass


class RunClosed(Conflict):
    pass


class GeneratorQuarantined(Conflict):
    pass


class WorkLeaseOver(Conflict):
    pass


class RunConflict(Conflict):
    pass


class ConsumerConflict(Conflict):
    pass


class TokenNameTaken(Conflict):
    pass


class RunOpen(Conflict):
    pass


class RunBusy(Conflict):
    def __init__(self, detail: str, *, retry_after_s: int) -> None:
        super().__init__(detail, headers={"Retry-After": str(retry_after_s)})
        self.retry_after_s = retry_after_s


class VersionConflict(Conflict):
    pass


class LeaseExpired(Conflict):
    pass


class BatchSettled(Conflict):
    pass


class PayloadTooLarge(BrokerError):
    status = 413


class UnsupportedMediaType(BrokerError):
    status = 415


class ValidationFailed(BrokerError):
    status = 422


class OverCapacity(BrokerError):
    status = 429

    def __init__(self, detail: str, *, retry_after_s: int) -> None:
        super().__init__(detail, headers={"Retry-After": str(retry_after_s)})
        self.retry_after_s = retry_after_s


class Unavailable(BrokerError):
    status = 503

    def __init__(self, detail: str, *, retry_after_s: int | None = None) -> None:
        headers = None if retry_after_s is None else {"Retry-After": str(retry_after_s)}
        super().__init__(detail, headers=headers)
        self.retry_after_s = retry_after_s


class NotReplicated(Unavailable):
    """Fewer Redis replicas than asked for acknowledged a write within the timeout. The write
    was made on the master: the client sends the request again (every write is idempotent by
    its ids), and the retry is answered once the earlier write is replicated too. Clients see
    it as any ``Unavailable``."""

    def __init__(
        self, wanted: int, acknowledged: int, timeout_ms: int, *, retry_after_s: int
    ) -> None:
        super().__init__(
            f"Redis: {acknowledged} of the {wanted} replicas asked for "
            f"(BROKER_REDIS_WAIT_REPLICAS) acknowledged the write within {timeout_ms} ms; it is "
            f"kept, send the request again in {retry_after_s} s",
            retry_after_s=retry_after_s,
        )
        self.wanted = wanted
        self.acknowledged = acknowledged

    @property
    def name(self) -> str:
        return "Unavailable"


def status_name(status: int) -> str:
    """The ``error`` of an answer with ``status`` that no broker error raised (the router's
    404 and 405, Starlette's 400): the name of the broker's error class of that status."""
    for cls in BrokerError.__subclasses__():
        if cls.status == status:
            return cls.__name__
    return "HTTPError"


# -- outages: which exceptions mean that Redis or Postgres cannot be reached ---------------------

# Redis that cannot be reached or cannot serve yet: refused, reset, timed out, loading its data
# set (BusyLoadingError is a ConnectionError), a cluster without a master for a slot.
_REDIS_OUTAGES: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    # Redirections that did not settle within the cluster client's tries (TTL exhausted),
    # as while a slot is being moved.
    redis.exceptions.ClusterError,
)

# Redis that answers but refuses writes for now. Each is the error code a reply starts with:
# NOREPLICAS, a master with fewer good replicas than its min-replicas-to-write (after a failover,
# until a replica attaches to the promoted master); READONLY, a replica (a client still talking
# to a demoted master); MASTERDOWN, a replica cut from its master with replica-serve-stale-data
# no; MISCONF, a master that cannot persist to disk. Redis refuses the command whole (in a
# script, its first write, which ends the script), so a refused write changed nothing.
WRITE_REFUSALS = ("NOREPLICAS", "READONLY", "MASTERDOWN", "MISCONF")
# Where the code stands in redis-py's text of the error: at its start, after a pipeline's
# "Command # n (...) of pipeline caused error: ", or after "-" where Redis 6.2 wraps the error of
# a script's redis.call ("Error running script (...): @user_script:1: ... -NOREPLICAS ...").
_REFUSAL = re.compile(rf"(?:^|caused error: |: -)({'|'.join(WRITE_REFUSALS)}) ")

# Postgres that cannot be reached or cannot serve: connection failures and lost connections
# (SQLSTATE class 08), shutting down or starting up (57P01-57P03), out of connection slots.
_POSTGRES_OUTAGES: tuple[type[BaseException], ...] = (
    asyncpg.exceptions.PostgresConnectionError,
    asyncpg.exceptions.AdminShutdownError,
    asyncpg.exceptions.CrashShutdownError,
    asyncpg.exceptions.CannotConnectNowError,
    asyncpg.exceptions.TooManyConnectionsError,
    sqlalchemy.exc.TimeoutError,  # no pooled connection came free in time
)

# The exception types worth a look: every outage above is one of these, or caused by one.
OUTAGE_CANDIDATES: tuple[type[Exception], ...] = (
    redis.exceptions.RedisError,
    sqlalchemy.exc.SQLAlchemyError,
    asyncpg.exceptions.PostgresError,
    asyncpg.exceptions.InterfaceError,
    OSError,  # builtin TimeoutError and ConnectionError included
    ExceptionGroup,
    # A write on a connection redis-py's cluster client closed under the command (outage_of
    # counts only these, by where they were raised).
    RuntimeError,
    AttributeError,
)

# The packages whose frames make an OSError a store's connection failure.
_DRIVERS = {"redis": "Redis", "asyncpg": "Postgres", "sqlalchemy": "Postgres"}


def outage_of(exc: BaseException) -> str | None:
    """``"Redis"`` or ``"Postgres"`` when ``exc`` means that store cannot be reached (or cannot
    serve for now, as Redis refusing writes: :func:`write_refusal_of`), else None. Explicit
    causes (``raise ... from``) are followed, so a SQLAlchemy error wrapping a lost asyncpg
    connection counts; an OSError counts when it was raised inside a driver's code (a refused
    or reset connection, a failed name lookup, a connect timeout), never one of the
    application's own. A group counts when every exception in it does. Anything else is a bug
    or a bad request, not an outage."""
    return _along_causes(exc, _direct_outage)


def write_refusal_of(exc: BaseException) -> str | None:
    """The code (one of :data:`WRITE_REFUSALS`) when ``exc``, or an explicit cause of it, is
    Redis refusing a write for now, else None."""
    return _along_causes(exc, _direct_refusal)


def _along_causes(exc: BaseException, direct: Callable[[BaseException], str | None]) -> str | None:
    """The first answer of ``direct`` along ``exc`` and its explicit causes."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        found = direct(current)
        if found is not None:
            return found
        current = current.__cause__
    return None


def _direct_refusal(exc: BaseException) -> str | None:
    # redis-py strips the code of the errors it has a class for
    if isinstance(exc, redis.exceptions.ReadOnlyError):
        return "READONLY"
    if isinstance(exc, redis.exceptions.MasterDownError):
        return "MASTERDOWN"
    if isinstance(exc, redis.exceptions.ResponseError):
        found = _REFUSAL.search(str(exc))
        return None if found is None else found.group(1)
    return None


def _direct_outage(exc: BaseException) -> str | None:
    if isinstance(exc, BaseExceptionGroup):
        stores = [outage_of(e) for e in exc.exceptions]
        return stores[0] if stores and all(stores) else None
    if isinstance(exc, _REDIS_OUTAGES) or _direct_refusal(exc) is not None:
        return "Redis"
    if isinstance(exc, _POSTGRES_OUTAGES):
        return "Postgres"
    if isinstance(exc, sqlalchemy.exc.DBAPIError) and exc.connection_invalidated:
        return "Postgres"
    if isinstance(exc, OSError):
        return _driver_in(exc.__traceback__)
    if isinstance(exc, RuntimeError | AttributeError) and _redis_write_in(exc.__traceback__):
        # redis-py's cluster client may hand out a connection it is closing after an error on
        # its node (a failover): the write then fails with these, not with ConnectionError.
        return "Redis"
    return None


def _redis_write_in(tb: TracebackType | None) -> bool:
    """Whether the innermost redis-py frame of the traceback writes a command to a socket."""
    where = None
    while tb is not None:
        code = tb.tb_frame.f_code
        if str(tb.tb_frame.f_globals.get("__name__", "")).startswith("redis."):
            where = code.co_name
        tb = tb.tb_next
    return where in ("send_packed_command", "_send_packed_command")


def _driver_in(tb: TracebackType | None) -> str | None:
    """The store of the innermost driver frame the traceback passes through."""
    store = None
    while tb is not None:
        module = str(tb.tb_frame.f_globals.get("__name__", ""))
        store = _DRIVERS.get(module.split(".", 1)[0], store)
        tb = tb.tb_next
    return store
