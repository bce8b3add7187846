"""The access rules of the SPEC ("Access control"), written once: which scope each route needs,
and whether a caller's token lets it touch a run.

Scopes: ``generate`` posts rollouts and takes and returns work; ``train`` leases, acks, nacks and
sets the policy version; ``operate`` creates, patches, closes and deletes runs, registers prompts
and reads the accounting and the audit log; ``admin`` manages tokens. An ``admin`` token may do
everything (it could mint itself any other token anyway). Any scope may read the runs it may
touch. A token limited to runs (ids or ``prefix*`` patterns) touches only those.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final

from app.caller import Caller


class Scope(StrEnum):
    GENERATE = "generate"
    TRAIN = "train"
    OPERATE = "operate"
    ADMIN = "admin"


READ: Final = "read"
"""What a route needs when any scope will do (reading the runs a token may touch)."""

PUBLIC: Final = "public"
"""What a route needs when it needs no token at all (health, the API description, the docs)."""

Need = Scope | str  # a Scope, READ or PUBLIC

ROUTES: Final[dict[tuple[str, str], Need]] = {
    ("GET", "/healthz"): PUBLIC,
    ("GET", "/readyz"): PUBLIC,
    ("GET", "/openapi.json"): PUBLIC,
    ("GET", "/docs"): PUBLIC,
    ("GET", "/redoc"): PUBLIC,
    ("GET", "/ui"): PUBLIC,
    ("GET", "/metrics"): Scope.OPERATE,
    ("POST", "/v1/runs"): Scope.OPERATE,
    ("GET", "/v1/runs"): READ,
    ("GET", "/v1/runs/{run_id}"): READ,
    ("DELETE", "/v1/runs/{run_id}"): Scope.OPERATE,
    ("PATCH", "/v1/runs/{run_id}/config"): Scope.OPERATE,
    ("POST", "/v1/runs/{run_id}/close"): Scope.OPERATE,
    ("POST", "/v1/runs/{run_id}/policy"): Scope.TRAIN,
    ("POST", "/v1/runs/{run_id}/rollouts"): Scope.GENERATE,
    ("GET", "/v1/runs/{run_id}/batch"): Scope.TRAIN,
    ("POST", "/v1/runs/{run_id}/batches/{batch_id}/ack"): Scope.TRAIN,
    ("POST", "/v1/runs/{run_id}/batches/{batch_id}/nack"): Scope.TRAIN,
    ("POST", "/v1/runs/{run_id}/prompts"): Scope.OPERATE,
    ("GET", "/v1/runs/{run_id}/prompts"): Scope.OPERATE,
    ("POST", "/v1/runs/{run_id}/work"): Scope.GENERATE,
    ("POST", "/v1/runs/{run_id}/work/{lease_id}/return"): Scope.GENERATE,
    ("GET", "/v1/runs/{run_id}/accounting"): Scope.OPERATE,
    ("GET", "/v1/runs/{run_id}/accounting/versions"): Scope.OPERATE,
    ("GET", "/v1/runs/{run_id}/accounting/training"): Scope.OPERATE,
    ("GET", "/v1/runs/{run_id}/batches"): Scope.OPERATE,
    ("GET", "/v1/runs/{run_id}/accounting/dead-letters"): Scope.OPERATE,
    ("POST", "/v1/tokens"): Scope.ADMIN,
    ("GET", "/v1/tokens"): Scope.ADMIN,
    ("DELETE", "/v1/tokens/{token_id}"): Scope.ADMIN,
    ("GET", "/v1/audit"): Scope.OPERATE,
}
"""Every route of the API and what it needs; a route missing here is refused (a test checks the
table against the app's routes). ``HEAD`` needs what ``GET`` needs."""


def need_of(method: str, path: str) -> Need | None:
    """What ``method path`` (the route's path template) needs; None for an unknown route."""
    return ROUTES.get(("GET" if method == "HEAD" else method, path))


def has(caller: Caller, need: Need) -> bool:
    """Whether ``caller``'s scopes meet ``need``."""
    if need in (PUBLIC, READ):
        return need == PUBLIC or bool(caller.scopes)
    return Scope.ADMIN in caller.scopes or need in caller.scopes


ANONYMOUS: Final = Caller(token_id="", name="anonymous", scopes=frozenset(Scope), runs=None)
"""The caller when auth is off: it may do everything (the Origin rule still applies)."""
