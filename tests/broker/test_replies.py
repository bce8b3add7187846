"""The scripts' reply protocol and the error table: replies of real scripts on a real Redis go
through the one decoder, and every refusal code becomes the error the table names."""

from __future__ import annotations

import logging
import re
from importlib import resources
from pathlib import Path

import msgpack
import pytest
from redis.asyncio import Redis

from app import keys
from app.broker.replies import (
    REFUSALS,
    AckAnswer,
    ErrorContext,
    ReplyError,
    StoreError,
    ack_answer,
    decode,
    error_for,
)
from app.broker.scripts import lua_source
from app.errors import (
    BatchNotFound,
    BatchSettled,
    BrokerError,
    ConsumerConflict,
    ConsumerNotFound,
    GeneratorQuarantined,
    InternalError,
    LeaseExpired,
    OverCapacity,
    RewardConflict,
    RewardLeaseNotFound,
    RewardLeaseOver,
    RunBusy,
    RunClosed,
    RunConflict,
    RunNotFound,
    RunOpen,
    ValidationFailed,
    VersionConflict,
    WorkLeaseNotFound,
    WorkLeaseOver,
)

LUA = Path(str(resources.files("app.broker") / "lua"))
SCRIPT_FILES = sorted(LUA.rglob("*.lua"))  # the scripts and their libraries (lua/lib)

# What each code must become, and how many args its scripts send, written out here rather
# than read back from the table.
EXPECTED: dict[str, tuple[type[BrokerError], int]] = {
    "run_missing": (RunNotFound, 0),
    "run_conflict": (RunConflict, 0),
    "version_backwards": (VersionConflict, 1),
    "version_future": (ValidationFailed, 1),
    "group_missing": (ValidationFailed, 1),
    "group_overflow": (ValidationFailed, 3),
    "group_done": (ValidationFailed, 1),
    "over_capacity": (OverCapacity, 2),
    "batch_size": (ValidationFailed, 1),
    "batch_missing": (BatchNotFound, 0),
    "batch_id_taken": (BatchSettled, 1),
    "batch_nacked": (BatchSettled, 0),
    "batch_acked": (BatchSettled, 0),
    "batch_settled": (BatchSettled, 1),
    "lease_expired": (LeaseExpired, 0),
    "lease_rewound": (LeaseExpired, 1),
    "lease_lost": (LeaseExpired, 0),
    "work_lost": (InternalError, 1),
    "run_closed": (RunClosed, 0),
    "run_deleted": (RunConflict, 0),
    "run_open": (RunOpen, 0),
    "run_parked": (RunBusy, 0),  # raised by the store, without the token, after its tries
    "run_busy": (RunBusy, 1),
    "work_missing": (WorkLeaseNotFound, 0),
    "work_lease_over": (WorkLeaseOver, 1),
    "work_not_in_lease": (ValidationFailed, 1),
    "partial_not_in_lease": (ValidationFailed, 2),
    "partial_not_returned": (ValidationFailed, 2),
    "partial_posted": (ValidationFailed, 1),
    "partial_future_version": (ValidationFailed, 2),
    "too_many_partials": (ValidationFailed, 3),
    "reward_lease_missing": (RewardLeaseNotFound, 0),
    "reward_lease_unknown": (ValidationFailed, 0),
    "reward_lease_over": (RewardLeaseOver, 1),
    "reward_unknown": (ValidationFailed, 1),
    "reward_not_in_lease": (ValidationFailed, 1),
    "reward_conflict": (RewardConflict, 2),
    "reward_lease_lost": (RewardLeaseOver, 0),
    "reward_raced": (RunBusy, 0),
    "generator_quarantined": (GeneratorQuarantined, 1),
    "consumer_missing": (ConsumerNotFound, 1),
    "consumer_exists": (ConsumerConflict, 1),
    "consumer_invalid": (ValidationFailed, 1),
}
STATUS = {
    RunNotFound: 404,
    RewardLeaseNotFound: 404,
    RewardConflict: 409,
    RewardLeaseOver: 409,
    BatchNotFound: 404,
    RunConflict: 409,
    VersionConflict: 409,
    BatchSettled: 409,
    LeaseExpired: 409,
    ValidationFailed: 422,
    OverCapacity: 429,
    RunClosed: 409,
    RunOpen: 409,
    RunBusy: 409,
    WorkLeaseNotFound: 404,
    WorkLeaseOver: 409,
    InternalError: 500,
    GeneratorQuarantined: 409,
    ConsumerNotFound: 404,
    ConsumerConflict: 409,
}
CTX = ErrorContext(
    "run-1", batch_id="batch-1", size=6, version=7, retry_after_s=3, lease_id="lease-1"
)


async def call_common(redis: Redis, prefix: str, body: str) -> object:
    """Run ``body`` after the real prologue every broker script starts with."""
    src = lua_source("-- requires: replies\n" + body)
    return await redis.register_script(src)(
        keys=[keys.run_key(prefix, "r")], args=[keys.wake_channel(prefix, "r")]
    )


async def test_ok_and_err_of_a_real_script_decode_to_a_body_and_a_store_error(redis, prefix):
    reply = await call_common(redis, prefix, "return ok('short', 3, { { 'a', 'stale' } })")
    assert decode("t", reply) == [b"short", 3, [[b"a", b"stale"]]]
    reply = await call_common(redis, prefix, "return err('group_overflow', 'g', '3', '2')")
    with pytest.raises(StoreError) as err:
        decode("t", reply)
    assert (err.value.code, err.value.args_) == ("group_overflow", ("g", "3", "2"))


@pytest.mark.parametrize("reply", [[], [b"created"], [b"err"], b"ok", None, {"ok": 1}])
def test_a_reply_outside_the_protocol_is_a_reply_error(reply):
    with pytest.raises(ReplyError):
        decode("t", reply)


async def test_an_unknown_code_from_a_real_script_is_a_logged_500_naming_it(redis, prefix, caplog):
    reply = await call_common(redis, prefix, "return err('no_such_code', 'x')")
    with pytest.raises(StoreError) as err:
        decode("t", reply)
    with caplog.at_level(logging.ERROR, logger="app.broker.replies"):
        error = error_for(err.value, CTX)
    assert type(error) is InternalError and error.status == 500
    assert "no_such_code" in error.detail
    assert any("no_such_code" in r.getMessage() for r in caplog.records)


def test_the_table_covers_exactly_the_expected_codes():
    assert set(REFUSALS) == set(EXPECTED)


@pytest.mark.parametrize("code", sorted(EXPECTED))
def test_each_code_becomes_its_error_with_a_message_from_its_args_and_context(code):
    cls, arity = EXPECTED[code]
    args = [f"arg{i}" for i in range(arity)]
    error = error_for(StoreError(code, *args), CTX)
    assert type(error) is cls
    assert error.status == STATUS[cls]
    # The message names every arg the script sent, and with none the run or batch it is about.
    assert all(arg in error.detail for arg in args), error.detail
    assert args or "run-1" in error.detail or "batch-1" in error.detail, error.detail
    assert "{" not in error.detail and "None" not in error.detail, error.detail


def test_run_busy_carries_retry_after():
    error = error_for(StoreError("run_busy", "rollouts are still buffered or leased"), CTX)
    assert isinstance(error, RunBusy) and error.headers == {"Retry-After": "3"}


def test_over_capacity_carries_retry_after():
    error = error_for(StoreError("over_capacity", "10", "10"), CTX)
    assert isinstance(error, OverCapacity)
    assert error.headers == {"Retry-After": "3"}
    assert error.detail == "run 'run-1' holds 10 rollouts, its capacity is 10; retry later"


def script_error_codes() -> set[str]:
    codes: set[str] = set()
    for path in SCRIPT_FILES:
        codes |= set(re.findall(r"\berr\('([a-z_]+)'", path.read_text()))
    return codes


def test_every_code_a_script_can_return_is_in_the_table():
    codes = script_error_codes()
    assert "run_missing" in codes and "version_backwards" in codes  # the scan finds them
    assert codes <= set(REFUSALS), codes - set(REFUSALS)


def test_no_script_builds_a_reply_by_hand():
    """Every reply goes through ok() and err(): no table literal starting with a reply word."""
    for path in SCRIPT_FILES:
        if path.name != "replies.lua":
            src = path.read_text()
            assert not re.search(r"return\s*\{\s*'", src), path.name


def test_the_stored_ack_answer_reads_back_exactly():
    stats = '{"kl_mean":0.1234567890123456789}'
    raw = msgpack.packb({"retired": 2, "flushed": 5, "stats": stats})
    assert ack_answer(raw) == AckAnswer(2, 5, stats)
    # Written before answers were msgpack, and kept for a day with the batch.
    assert ack_answer(b"12,0," + stats.encode()) == AckAnswer(12, 0, stats)
