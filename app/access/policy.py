"""The access rules of the SPEC ("Access control"), written once: which scope each route needs,
and whether a caller's token lets it touch a run.

Scopes: ``generate`` posts rollouts and takes and returns work; ``reward`` leases rollouts to
score and posts their rewards; ``train`` leases, measures, acks, nacks and
sets the policy version; ``operate`` creates, patches, closes and deletes runs, registers prompts
and reads the accounting and the audit log; ``admin`` manages tokens. An ``admin`` token may do
everything (it could mint itself any other token anyway). Any scope may read the runs it may
touch. A token limited to runs (ids or ``prefix*`` patterns) touches only those.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final, NamedTuple

from app.caller import Caller


class Scope(StrEnum):
    GENERATE = "generate"
    REWARD = "reward"
    TRAIN = "train"
    OPERATE = "operate"
    ADMIN = "admin"


READ: Final = "read"
"""What a route needs when any scope will do (reading the runs a token may touch)."""

PUBLIC: Final = "public"
"""What a route needs when it needs no token at all (health, the API description, the docs)."""

Need = Scope | str  # a Scope, READ or PUBLIC


class Rule(NamedTuple):
    """A route's line of the access table."""

    need: Need
    changes_state: bool
    """Whether the route changes anything (a lease does, though it is a GET): with auth off, a
    web page of another origin may not call it (SPEC "Access control", the Origin rule)."""
    needs_auth: bool = False
    """Whether the route is refused outright with auth off: creating a token. A token made then
    would come from nobody and become valid the day auth is turned on."""


def reading(need: Need) -> Rule:
    return Rule(need, changes_state=False)


def changing(need: Need, *, needs_auth: bool = False) -> Rule:
    return Rule(need, changes_state=True, needs_auth=needs_auth)


ROUTES: Final[dict[tuple[str, str], Rule]] = {
    ("GET", "/healthz"): reading(PUBLIC),
    ("GET", "/readyz"): reading(PUBLIC),
    ("GET", "/openapi.json"): reading(PUBLIC),
    ("GET", "/docs"): reading(PUBLIC),
    ("GET", "/redoc"): reading(PUBLIC),
    ("GET", "/ui"): reading(PUBLIC),
    ("GET", "/metrics"): reading(Scope.OPERATE),
    ("POST", "/v1/runs"): changing(Scope.OPERATE),
    ("GET", "/v1/runs"): reading(READ),
    ("GET", "/v1/runs/{run_id}"): reading(READ),
    ("DELETE", "/v1/runs/{run_id}"): changing(Scope.OPERATE),
    ("PATCH", "/v1/runs/{run_id}/config"): changing(Scope.OPERATE),
    ("POST", "/v1/runs/{run_id}/close"): changing(Scope.OPERATE),
    ("POST", "/v1/runs/{run_id}/generators/{generator_id}/release"): changing(Scope.OPERATE),
    ("POST", "/v1/runs/{run_id}/policy"): changing(Scope.TRAIN),
    ("GET", "/v1/runs/{run_id}/policy"): reading(READ),
    ("POST", "/v1/runs/{run_id}/rollouts"): changing(Scope.GENERATE),
    ("GET", "/v1/runs/{run_id}/batch"): changing(Scope.TRAIN),  # it leases a batch
    ("POST", "/v1/runs/{run_id}/batches/{batch_id}/ack"): changing(Scope.TRAIN),
    ("POST", "/v1/runs/{run_id}/batches/{batch_id}/nack"): changing(Scope.TRAIN),
    ("POST", "/v1/runs/{run_id}/batches/{batch_id}/measure"): changing(Scope.TRAIN),
    ("POST", "/v1/runs/{run_id}/prompts"): changing(Scope.OPERATE),
    ("GET", "/v1/runs/{run_id}/prompts"): reading(Scope.OPERATE),
    ("POST", "/v1/runs/{run_id}/work"): changing(Scope.GENERATE),
    ("POST", "/v1/runs/{run_id}/work/{lease_id}/return"): changing(Scope.GENERATE),
    ("POST", "/v1/runs/{run_id}/rewards/lease"): changing(Scope.REWARD),
    ("POST", "/v1/runs/{run_id}/rewards"): changing(Scope.REWARD),
    ("POST", "/v1/runs/{run_id}/rewards/lease/{lease_id}/return"): changing(Scope.REWARD),
    ("POST", "/v1/runs/{run_id}/consumers"): changing(Scope.OPERATE),
    ("GET", "/v1/runs/{run_id}/consumers/{name}"): reading(READ),
    ("DELETE", "/v1/runs/{run_id}/consumers/{name}"): changing(Scope.OPERATE),
    ("GET", "/v1/runs/{run_id}/consumers/{name}/batch"): changing(Scope.TRAIN),  # it leases
    ("POST", "/v1/runs/{run_id}/consumers/{name}/batches/{batch_id}/ack"): changing(Scope.TRAIN),
    ("POST", "/v1/runs/{run_id}/consumers/{name}/batches/{batch_id}/nack"): changing(Scope.TRAIN),
    ("GET", "/v1/runs/{run_id}/accounting"): reading(Scope.OPERATE),
    ("GET", "/v1/runs/{run_id}/accounting/versions"): reading(Scope.OPERATE),
    ("GET", "/v1/runs/{run_id}/accounting/training"): reading(Scope.OPERATE),
    ("GET", "/v1/runs/{run_id}/accounting/generators"): reading(Scope.OPERATE),
    ("GET", "/v1/runs/{run_id}/batches"): reading(Scope.OPERATE),
    ("GET", "/v1/runs/{run_id}/accounting/dead-letters"): reading(Scope.OPERATE),
    ("POST", "/v1/tokens"): changing(Scope.ADMIN, needs_auth=True),
    ("GET", "/v1/tokens"): reading(Scope.ADMIN),
    ("DELETE", "/v1/tokens/{token_id}"): changing(Scope.ADMIN),
    ("GET", "/v1/audit"): reading(Scope.OPERATE),
}
"""Every route of the API, what it needs and whether it changes state; a route missing here is
refused (a test checks the table against the app's routes). ``HEAD`` is as ``GET``."""


def rule_of(method: str, path: str) -> Rule | None:
    """The access table's line for ``method path`` (the route's path template); None for an
    unknown route."""
    return ROUTES.get(("GET" if method == "HEAD" else method, path))


def need_of(method: str, path: str) -> Need | None:
    """What ``method path`` needs; None for an unknown route."""
    rule = rule_of(method, path)
    return None if rule is None else rule.need


def has(caller: Caller, need: Need) -> bool:
    """Whether ``caller``'s scopes meet ``need``."""
    if need in (PUBLIC, READ):
        return need == PUBLIC or bool(caller.scopes)
    return Scope.ADMIN in caller.scopes or need in caller.scopes


ANONYMOUS: Final = Caller(token_id="", name="anonymous", scopes=frozenset(Scope), runs=None)
"""The caller when auth is off: it may do everything (the Origin rule still applies)."""
