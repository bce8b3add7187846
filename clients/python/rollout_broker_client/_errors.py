"""The client's exceptions. Every error status the broker answers becomes the exception named
by the body's ``error`` field, carrying the body's ``detail``:

    BrokerError                      anything the client raises on purpose
    ├── BrokerUnreachable            no answer (connection refused, timed out), after retries
    └── BrokerHTTPError              an error status; .status, .error, .detail, .headers
        ├── BadRequest (400)
        ├── Unauthorized (401)       no token, or one the broker does not know or has revoked
        ├── Forbidden (403)          the token lacks the scope or the run (or, with auth off,
        │                            a request from another web origin)
        ├── NotFound (404)
        │   ├── RunNotFound
        │   ├── BatchNotFound
        │   ├── TokenNotFound        no such token id (to revoke)
        │   ├── WorkLeaseNotFound    no such work lease (or long forgotten)
        │   ├── ConsumerNotFound     no such consumer in the run
        │   └── RewardLeaseNotFound  no such reward lease (or long forgotten)
        ├── Conflict (409)
        │   ├── RunConflict          same run_id, different config
        │   ├── ConsumerConflict     a consumer's name taken by another config
        │   ├── RunClosed            work asked of a closed run
        │   ├── GeneratorQuarantined posts or work of a quarantined generator (its KL drifted)
        │   ├── VersionConflict      policy version moving backwards
        │   ├── LeaseExpired         ack after the lease ran out
        │   ├── BatchSettled         nack of an acked batch, or the reverse
        │   ├── WorkLeaseOver        a work lease_id reused after its lease was returned or expired
        │   ├── RewardLeaseOver      a reward lease_id reused after its lease was over
        │   └── RewardConflict       a different reward for a rollout already scored
        ├── PayloadTooLarge (413)
        ├── UnsupportedMediaType (415)
        ├── ValidationFailed (422)
        ├── OverCapacity (429)       .retry_after_s from the Retry-After header
        └── ServerError (5xx)
            ├── InternalError (500)
            └── Unavailable (503)

An ``error`` name the client does not know falls back to the class of its status. No error
is ever sent again by the client but those of an outage (``502``, ``503``, ``504``): a ``401``
or ``403`` is raised at once. An exception's text never holds the client's token.

An error raised by a rollout writer (or a work lease's ``post``) carries in ``unsent`` the
rollouts of that writer the broker has not accepted, in the order they were added.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx

from rollout_broker_client._models import Rollout

__all__ = [
    "BadRequest",
    "BatchNotFound",
    "BatchSettled",
    "BrokerError",
    "BrokerHTTPError",
    "BrokerUnreachable",
    "Conflict",
    "ConsumerConflict",
    "ConsumerNotFound",
    "Forbidden",
    "GeneratorQuarantined",
    "InternalError",
    "LeaseExpired",
    "NotFound",
    "OverCapacity",
    "PayloadTooLarge",
    "RewardConflict",
    "RewardLeaseNotFound",
    "RewardLeaseOver",
    "RunClosed",
    "RunConflict",
    "RunNotFound",
    "ServerError",
    "TokenNotFound",
    "Unauthorized",
    "Unavailable",
    "UnsupportedMediaType",
    "ValidationFailed",
    "VersionConflict",
    "WorkLeaseNotFound",
    "WorkLeaseOver",
    "error_from_response",
]


class BrokerError(Exception):
    """Base of every exception the client raises on purpose.

    ``unsent``: when a rollout writer raises, the rollouts it was given that the broker has not
    accepted (empty otherwise). The writer keeps them buffered, to send at its next flush,
    unless the broker refused their request as a whole (a ``4xx`` other than ``429``: sending
    it again would fail the same way); then they are only here."""

    unsent: list[Rollout | Mapping[str, Any]]

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        self.unsent = []


class BrokerUnreachable(BrokerError):
    """The broker gave no answer: the connection failed or timed out, and retries ran out."""


class BrokerHTTPError(BrokerError):
    """The broker answered with an error status and ``{"error": ..., "detail": ...}``."""

    def __init__(
        self,
        error: str,
        detail: str,
        *,
        status: int,
        headers: Mapping[str, str] | None = None,
        method: str = "",
        url: str = "",
    ) -> None:
        super().__init__(f"{error}: {detail}")
        self.error = error
        self.detail = detail
        self.status = status
        self.headers: dict[str, str] = dict(headers or {})
        self.method = method
        self.url = url


class BadRequest(BrokerHTTPError):
    pass


class Unauthorized(BrokerHTTPError):
    """The broker wants a token (``Authorization: Bearer``) and got none, or one it does not
    know or has revoked: give the client ``token=`` (or set ``BROKER_TOKEN``)."""


class Forbidden(BrokerHTTPError):
    """The token is valid but lacks the scope the request needs, or may not touch its run."""


class NotFound(BrokerHTTPError):
    pass


class RunNotFound(NotFound):
    pass


class BatchNotFound(NotFound):
    pass


class WorkLeaseNotFound(NotFound):
    pass


class RewardLeaseNotFound(NotFound):
    pass


class TokenNotFound(NotFound):
    pass


class ConsumerNotFound(NotFound):
    pass


class Conflict(BrokerHTTPError):
    pass


class RunConflict(Conflict):
    pass


class ConsumerConflict(Conflict):
    """A consumer of that name exists with another config: delete it first, or pick a name."""


class RunClosed(Conflict):
    pass


class GeneratorQuarantined(Conflict):
    """The generator's measured KL drifted past the run's ``generator_kl_max``: its rollouts and
    work requests are refused until an operator releases it; not retried."""


class WorkLeaseOver(Conflict):
    """The work lease was returned or expired: its prompts went back; lease with a new id."""


class RewardLeaseOver(Conflict):
    """The reward lease was returned or expired: its rollouts went back; lease with a new id."""


class RewardConflict(Conflict):
    """A rollout already scored was sent another reward: the first one stands."""


class VersionConflict(Conflict):
    pass


class LeaseExpired(Conflict):
    pass


class BatchSettled(Conflict):
    pass


class PayloadTooLarge(BrokerHTTPError):
    pass


class UnsupportedMediaType(BrokerHTTPError):
    pass


class ValidationFailed(BrokerHTTPError):
    pass


class OverCapacity(BrokerHTTPError):
    """The run is full; wait ``retry_after_s`` seconds before sending again (backpressure)."""

    @property
    def retry_after_s(self) -> float:
        return parse_retry_after(self.headers.get("retry-after"))


class ServerError(BrokerHTTPError):
    pass


class InternalError(ServerError):
    pass


class Unavailable(ServerError):
    pass


_BY_NAME: dict[str, type[BrokerHTTPError]] = {
    cls.__name__: cls
    for cls in (
        BadRequest,
        Unauthorized,
        Forbidden,
        NotFound,
        RunNotFound,
        BatchNotFound,
        WorkLeaseNotFound,
        RewardLeaseNotFound,
        TokenNotFound,
        ConsumerNotFound,
        Conflict,
        RunConflict,
        ConsumerConflict,
        RunClosed,
        GeneratorQuarantined,
        WorkLeaseOver,
        RewardLeaseOver,
        RewardConflict,
        VersionConflict,
        LeaseExpired,
        BatchSettled,
        PayloadTooLarge,
        UnsupportedMediaType,
        ValidationFailed,
        OverCapacity,
        InternalError,
        Unavailable,
    )
}

_BY_STATUS: dict[int, type[BrokerHTTPError]] = {
    400: BadRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    413: PayloadTooLarge,
    415: UnsupportedMediaType,
    422: ValidationFailed,
    429: OverCapacity,
    500: InternalError,
    503: Unavailable,
}

DEFAULT_RETRY_AFTER_S = 1.0


def parse_retry_after(value: str | None) -> float:
    """Seconds from a Retry-After header (delta-seconds form); 1 s when absent or unreadable."""
    try:
        seconds = float(value) if value is not None else DEFAULT_RETRY_AFTER_S
    except ValueError:
        return DEFAULT_RETRY_AFTER_S
    return max(0.0, seconds)


def _class_for(name: str, status: int) -> type[BrokerHTTPError]:
    cls = _BY_NAME.get(name)
    if cls is not None:
        return cls
    if status in _BY_STATUS:
        return _BY_STATUS[status]
    if status >= 500:
        return ServerError
    return BrokerHTTPError


def error_from_response(resp: httpx.Response, body: Any) -> BrokerHTTPError:
    """The named exception for an error response whose decoded body is ``body``."""
    if isinstance(body, Mapping) and isinstance(body.get("error"), str):
        name = str(body["error"])
        detail = str(body.get("detail", ""))
    else:  # not the broker's error shape: a proxy's page, say
        name = f"HTTP{resp.status_code}"
        detail = (resp.text or resp.reason_phrase)[:500]
    cls = _class_for(name, resp.status_code)
    return cls(
        name,
        detail,
        status=resp.status_code,
        headers=resp.headers,
        method=resp.request.method,
        url=str(resp.request.url),
    )
