"""The broker's one error hierarchy; a single handler renders every error as
``{"error": <class name>, "detail": <text>}`` with the class's HTTP status.

    BrokerError (500)
    ├── InternalError (500)        a broker bug, e.g. a store error code with no entry in
    │                              app/broker/replies.py's table (logged where it is raised)
    ├── BadRequest (400)
    ├── NotFound (404)
    │   ├── RunNotFound
    │   └── BatchNotFound
    ├── Conflict (409)
    │   ├── RunConflict            same run_id, different config (or a deleted run's id)
    │   ├── RunOpen                deleting a run that is not closed
    │   ├── RunBusy                deleting a closed run not yet settled; carries Retry-After
    │   ├── VersionConflict        policy version moving backwards
    │   ├── LeaseExpired           ack after the lease ran out
    │   └── BatchSettled           nack of a batch that was acked, or the reverse
    ├── PayloadTooLarge (413)
    ├── UnsupportedMediaType (415)
    ├── ValidationFailed (422)
    ├── OverCapacity (429)         carries Retry-After
    └── Unavailable (503)
"""

from __future__ import annotations


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


class NotFound(BrokerError):
    status = 404


class RunNotFound(NotFound):
    pass


class BatchNotFound(NotFound):
    pass


class Conflict(BrokerError):
    status = 409


class WorkLeaseNotFound(NotFound):
    pass


class RunClosed(Conflict):
    pass


class WorkLeaseOver(Conflict):
    pass


class RunConflict(Conflict):
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
