"""Schemathesis against a live broker: every operation of ``/openapi.json`` is called with what
its description allows (and with what it does not), operations are chained through the
description's links (the stateful phase), and every answer is checked against the description:
no server error, documented statuses, content types, bodies and headers, schema-valid requests
accepted and schema-invalid ones refused, 405 answers with the right ``Allow``, auth enforced.

The broker is a real process (uvicorn) with its worker, auth on and the bootstrap admin token
sent on every call; ``BROKER_MAX_WAIT_S`` is short, so the long polls the description allows
end quickly (the description says this app's bound)."""

from __future__ import annotations

import asyncio
import re
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pytest
import schemathesis
from redis.asyncio import Redis
from schemathesis.engine import Status, events, from_schema

from tests.processes import ApiProcess, broker_env, worker_process
from tests.services import REDIS_URL, delete_prefix, new_prefix

pytestmark = pytest.mark.slow

SEED = 20261203
MAX_EXAMPLES = 8  # per operation and phase: the whole test stays well under a minute
MAX_STEPS = 8  # per stateful scenario


# -- msgpack, as the API takes and gives it ------------------------------------------------------


@schemathesis.serializer("application/msgpack", "application/x-msgpack")
def _msgpack_body(ctx: schemathesis.SerializationContext, value: Any) -> bytes:
    packed: bytes = msgpack.packb(_msgpack_ints(value), use_bin_type=True)
    return packed


def _msgpack_ints(value: Any) -> Any:
    """msgpack integers are 64-bit: a bigger one (drawn to break a bound) goes as a float,
    which breaks the same bound, or an integer type."""
    if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**64:
        return float(value)
    if isinstance(value, dict):
        return {k: _msgpack_ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_msgpack_ints(v) for v in value]
    return value


@schemathesis.deserializer("application/msgpack")
def _msgpack_answer(ctx: schemathesis.DeserializationContext, response: Any) -> Any:
    # The raw arrays of a leased batch are msgpack bin, documented as binary strings: they
    # are validated as strings (hex), the rest as it is.
    return _bin_as_text(msgpack.unpackb(response.content, raw=False))


def _bin_as_text(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dict):
        return {k: _bin_as_text(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_bin_as_text(v) for v in value]
    return value


# -- what a JSON Schema cannot state -------------------------------------------------------------


def _whole_numbers_as_integers(value: Any) -> Any:
    """Under OpenAPI 3.1 Schemathesis spells some integers as whole floats (``2.0``): the same
    JSON number, but the broker's models are strict and refuse ``2.0`` where an integer
    belongs (pydantic's strict mode; see the report of the OpenAPI work). Every whole float
    is sent as the integer it is, which a number field takes just as well."""
    if isinstance(value, float) and value.is_integer() and abs(value) <= 2**53:
        return int(value)
    if isinstance(value, dict):
        return {k: _whole_numbers_as_integers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_whole_numbers_as_integers(v) for v in value]
    return value


@dataclass(frozen=True)
class Limit:
    """A failure that is not one: a schema-valid request the broker refuses for a rule the
    description states in words because JSON Schema cannot (it depends on the run's state, ties
    two fields together, or names what only an earlier answer can give), or a behaviour the
    SPEC asks for that a check does not expect."""

    code: str  # Schemathesis's failure code
    operation: str  # regex on "METHOD /path" of the request that found it
    status: int  # of that request's answer; -1: any
    detail: str  # regex on the error's detail ("" for any answer)
    why: str


REFUSED = "ST202"  # a schema-valid request refused
LIMITS = (
    Limit(
        REFUSED,
        r"POST /v1/runs/\{run_id\}/rollouts",
        422,
        r"logprobs for \d+ response tokens",
        "logprobs are one per response token: two arrays of one length",
    ),
    Limit(
        REFUSED,
        r"POST /v1/runs/\{run_id\}/(rollouts|work/\{lease_id\}/return)",  # and partials
        422,
        r"loss_mask has \d+ values|loss_mask values must be 0 or 1|loss_mask masks every token|"
        r"versions must start at offset 0|versions offsets must be strictly increasing|"
        r"versions must not decrease|versions offset \d+ is beyond|not the oldest version of",
        "a loss mask is one 0/1 per response token, at least one 1 (raw msgpack bytes hold any "
        "byte); versions are ordered run-lengths inside the response, their oldest trained "
        "version the policy_version",
    ),
    Limit(
        REFUSED,
        r"POST /v1/runs/\{run_id\}/rollouts",
        422,
        r"has no group_id, and this run's group_size|more than its group_size|was already "
        r"complete",
        "the group rules follow the run's group_size and its groups so far",
    ),
    Limit(
        REFUSED,
        r"GET /v1/runs/\{run_id\}/batch",
        422,
        r"is above the run's current version|is not a multiple of this run's group_size",
        "policy_version and size are bound by the run's version and group_size",
    ),
    Limit(
        REFUSED,
        r"POST /v1/runs/\{run_id\}/batches/\{batch_id\}/ack",
        422,
        r"has no rollout|has both logprobs and kl|values for \d+ tokens",
        "an ack covers the batch's own rollouts, each with logprobs or kl, one per token",
    ),
    Limit(
        REFUSED,
        r"(POST /v1/runs|PATCH /v1/runs/\{run_id\}/config)$",
        422,
        r"correction low \(.*\) is above high",
        "a correction's low may not be above its high (a rule between two fields)",
    ),
    Limit(
        REFUSED,
        r"(POST /v1/runs|PATCH /v1/runs/\{run_id\}/config)$",
        422,
        r"difficulty hard_below \(.*\) is above easy_above|difficulty weights are all 0",
        "difficulty's thresholds are ordered and its weights not all 0 (rules between fields)",
    ),
    Limit(
        REFUSED,
        r"GET /v1/runs/\{run_id\}/prompts$",
        422,
        r"pool needs a run with difficulty pools",
        "a prompt listing by pool needs a run with difficulty (the run's state)",
    ),
    Limit(
        REFUSED,
        r"POST /v1/runs/\{run_id\}/prompts",
        422,
        r"prompt passes in one request|data is \d+ bytes as JSON",
        "prompts × epochs is bounded (a product), and so is each prompt's data as JSON",
    ),
    Limit(
        REFUSED,
        r"POST /v1/runs/\{run_id\}/work/\{lease_id\}/return",
        422,
        r"is not in work lease|\((partial_not_in_lease|partial_not_returned|partial_posted|"
        r"partial_future_version|too_many_partials|duplicate_partial)\)|"
        r"logprobs for \d+ response tokens",
        "only prompts the work lease held can be returned, with partials of their own attempts "
        "(new rollout ids, of no later version, at most group_size a prompt, one logprob a "
        "token)",
    ),
    Limit(
        REFUSED,
        r"POST /v1/runs/\{run_id\}/consumers$",
        422,
        r"kind preferences needs groups|apply to kind preferences only",
        "a consumer of pairs needs a run with groups (the run's group_size); min_margin and "
        "pairs go with kind preferences (a rule between fields)",
    ),
    Limit(
        REFUSED,
        r"POST /v1/runs/\{run_id\}/rewards",
        422,
        r"was never received|is not in reward lease|^no reward lease",
        "rewards are for rollouts the run received, of the lease named (if one is)",
    ),
    Limit(
        REFUSED,
        r"GET /v1/runs/\{run_id\}/(batches|prompts|accounting/dead-letters)",
        -1,  # 400 or 422
        r"^invalid cursor$",
        "a cursor is one a previous page handed out (the links pass real ones)",
    ),
    Limit(
        REFUSED,
        r".*",
        422,
        r"metadata|data\.",
        "free-form JSON must fit 64-bit integers and 16 levels of nesting",
    ),
    Limit(
        "ST301",  # a deleted resource still answers
        r"GET /v1/runs/\{run_id\}/(accounting.*|batches|prompts)",
        200,
        "",
        "the SPEC keeps a deleted run's accounting readable; its live state is what goes",
    ),
)


def _is_limit(failure: Any, case: Any, response: Any) -> bool:
    try:
        detail = str(response.json().get("detail", "")) if response.status_code >= 400 else ""
    except (ValueError, AttributeError):
        detail = ""
    label = case.operation.label
    return any(
        getattr(failure, "code", "") == limit.code
        and re.fullmatch(limit.operation, label)
        and limit.status in (response.status_code, -1)
        and re.search(limit.detail, detail)
        for limit in LIMITS
    )


# -- the run -------------------------------------------------------------------------------------


@dataclass
class Found:
    operation: str
    title: str
    message: str
    code_sample: str

    def __str__(self) -> str:
        return f"{self.operation}: {self.title}\n{self.message}\n{self.code_sample}\n"


@dataclass
class Outcome:
    operations: int
    cases: int
    failures: list[Found]
    errors: list[str]


def _config(token: str) -> schemathesis.Config:
    every_check = {
        name: {"enabled": True}
        for name in (
            "not_a_server_error",
            "status_code_conformance",
            "content_type_conformance",
            "response_schema_conformance",
            "response_headers_conformance",
            "positive_data_acceptance",
            "negative_data_rejection",
            "use_after_free",
            "ensure_resource_availability",
            "missing_required_header",
            "ignored_auth",
            "unsupported_method",
            "allow_header_conformance",
        )
    }
    # Not enabled: max_response_time (a latency budget is the benchmarks' business), and
    # object_level_authorization (it needs a second identity; tests/api/test_access.py checks
    # who may touch which run).
    return schemathesis.Config.from_dict(
        {
            "seed": SEED,
            "headers": {"Authorization": f"Bearer {token}"},
            "request-timeout": 10,
            "generation": {"max-examples": MAX_EXAMPLES, "database": "none"},
            "phases": {"stateful": {"enabled": True, "max-steps": MAX_STEPS}},
            "checks": every_check,
        }
    )


def run_schemathesis(url: str, token: str) -> Outcome:
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", config=_config(token))

    @schema.hook("map_body")
    def _(ctx: schemathesis.HookContext, body: Any) -> Any:
        return _whole_numbers_as_integers(body)

    @schema.hook("filter_failure")
    def _(ctx: schemathesis.HookContext, failure: Any, case: Any, response: Any) -> bool:
        return not _is_limit(failure, case, response)

    failures: dict[tuple[str, str, str], Found] = {}
    errors: list[str] = []
    cases = 0
    for event in from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished):
            cases += len(event.recorder.cases)
            for found in _failures(event.recorder.checks.values()):
                failures.setdefault((found.operation, found.title, found.message), found)
        elif isinstance(event, events.NonFatalError):
            errors.append(f"{event.label}: {event.info.format()}")
        elif isinstance(event, events.FatalError):
            errors.append(f"fatal: {event.exception!r}")
    return Outcome(len(schema), cases, list(failures.values()), errors)


def _failures(checks: Any) -> Iterator[Found]:
    for nodes in checks:
        for node in nodes:
            if node.status == Status.FAILURE and node.failure_info is not None:
                failure = node.failure_info.failure
                yield Found(
                    str(failure.operation),
                    failure.title,
                    failure.message,
                    node.failure_info.code_sample,
                )


async def test_the_api_does_what_its_description_says(database_url: str, tmp_path: Path) -> None:
    # A key prefix of its own (not the `prefix` fixture: one Redis node is enough here, the
    # contract is the same on a cluster).
    prefix = new_prefix()
    token = secrets.token_urlsafe(32)[:43]
    env = broker_env(
        BROKER_REDIS_URL=REDIS_URL,
        BROKER_DATABASE_URL=database_url,
        BROKER_REDIS_PREFIX=prefix,
        BROKER_AUTH="on",
        BROKER_ADMIN_TOKEN=token,
        BROKER_MAX_WAIT_S="0.2",
        BROKER_SWEEP_INTERVAL_S="0.2",
        BROKER_DRAIN_BLOCK_MS="50",
    )
    api = ApiProcess(env, tmp_path / "api.log")
    worker = worker_process(env, tmp_path / "worker.log")
    try:
        await asyncio.gather(api.start(), worker.start())
        started = time.monotonic()
        outcome = await asyncio.to_thread(run_schemathesis, api.url, token)
        took = time.monotonic() - started
    finally:
        await asyncio.gather(api.stop(), worker.stop())
        redis = Redis.from_url(REDIS_URL)
        await delete_prefix(redis, prefix)
        await redis.aclose()
    report = "\n".join([*map(str, outcome.failures), *outcome.errors])
    print(
        f"schemathesis: {outcome.operations} operations, {outcome.cases} cases, "
        f"{len(outcome.failures)} failures, {len(outcome.errors)} errors in {took:.1f} s"
    )
    assert not outcome.failures and not outcome.errors, report
    assert outcome.cases >= 10 * outcome.operations  # every operation was called, many times
    # No unhandled error; no event the drain dead-lettered, no ledger at odds with the live
    # state (the worker logs both as errors; a blocked read of a deleted run's stream is a
    # warning it retries).
    assert "Traceback" not in (tmp_path / "api.log").read_text()
    assert " ERROR " not in (tmp_path / "worker.log").read_text()
