"""The codec cases of ``benchmarks/libraries.py``: the broker's own parse of an ingest body and
its own msgpack of a lease answer, against msgspec and ormsgpack on the same bytes.

The broker's parse is ``parse_body`` with the ingest models, the collector off: what the ingest
endpoint runs (``pack_items``) for a body below 4 MiB, the counts of the body's lists
(app/api/_outline.py) and then pydantic (for msgpack, after ``msgpack.unpackb`` with the
broker's limits). msgspec takes pydantic's place in the same call (:class:`MsgspecModels`), and
is also timed alone, decoding the body in one pass.

The msgspec Structs below check what the broker's pydantic models check (app/broker/schemas.py):
strict types (no bool for an int, no string for a number), unknown fields refused, required
fields, the id pattern and the ledger's text rule, the version and reward bounds, the
``versions`` pairs, the finish reasons and the metadata rule. Each case first checks that the
candidate gives what the broker's code gives (the same packed rollouts, the same documents),
then times both.
"""

from __future__ import annotations

import gc
import re
from collections.abc import Callable
from typing import Annotated, Any, Literal

import msgpack
import msgspec
import ormsgpack
from fastapi.responses import Response
from rollout_broker_client.protocol import MSGPACK

from app.api import parse_body, render, widest_list
from app.broker.endpoints.batches import batch_body
from app.broker.packing import PackedRollout, pack_rollouts, unpack_rollouts
from app.broker.schemas import (
    MAX_REWARD,
    IngestJSON,
    IngestMsgpack,
    check_metadata,
)
from app.broker.service import LeasedBatch
from app.errors import ValidationFailed
from app.events.wire import text_fault
from app.ids import ITEM_ID_PATTERN, MAX_VERSION
from app.settings import Settings
from benchmarks.payloads import CONTENT_TYPE, ingest_body, make_payload, rollout_id

# Ids are checked in __post_init__, not as Meta(pattern=ITEM_ID_PATTERN): Python's re takes
# 4.5 µs to match a 32-character id against its class of a hundred ranges (pydantic's Rust regex
# a fraction of that). An ASCII id needs the ASCII part of the class alone; any other id is
# matched against the whole pattern (with `\Z`: Python's `$` also matches before a final
# newline, pydantic's only at the end).
ID_RE = re.compile(ITEM_ID_PATTERN.removesuffix("$") + r"\Z")
ASCII_EXCLUDED = re.compile(r"[\x00-\x20\x7f{}]")


def id_fault(text: str) -> str | None:
    """Why ``text`` is no item id (pattern and ledger rule), or None."""
    if text.isascii():
        if not 0 < len(text) <= 256 or ASCII_EXCLUDED.search(text):
            return "is not a valid id"
    elif ID_RE.search(text) is None:
        return "is not a valid id"
    return text_fault(text)


Version = Annotated[int, msgspec.Meta(ge=0, le=MAX_VERSION)]
Reward = Annotated[float, msgspec.Meta(ge=-MAX_REWARD, le=MAX_REWARD)]  # NaN fails both
Pair = Annotated[list[Version], msgspec.Meta(min_length=2, max_length=2)]


class RolloutS(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """:class:`RolloutJSON` as a msgspec Struct."""

    rollout_id: str
    group_id: str | None = None
    policy_version: Version
    prompt_ids: list[int] | None = None
    response_ids: list[int]
    logprobs: list[float] | None = None
    loss_mask: list[int] | None = None
    versions: Annotated[list[Pair], msgspec.Meta(min_length=1)] | None = None
    reward: Reward | None = None
    generator_id: str | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    metadata: dict[str, Any] | None = None

    def __post_init__(self) -> None:  # the ledger's rule on ids, the metadata rule
        for text in (self.rollout_id, self.group_id, self.generator_id):
            fault = None if text is None else id_fault(text)
            if fault is not None:
                raise ValueError(fault)
        if self.metadata is not None:
            check_metadata(self.metadata)


class RolloutMsgpackS(RolloutS, kw_only=True, forbid_unknown_fields=True):
    """:class:`RolloutMsgpack`: the arrays also as raw little-endian bytes."""

    prompt_ids: bytes | list[int] | None = None  # type: ignore[assignment]
    response_ids: bytes | list[int]  # type: ignore[assignment]
    logprobs: bytes | list[float] | None = None  # type: ignore[assignment]
    loss_mask: bytes | list[int] | None = None  # type: ignore[assignment]


class IngestS(msgspec.Struct, forbid_unknown_fields=True):
    rollouts: list[RolloutS]


class IngestMsgpackS(msgspec.Struct, forbid_unknown_fields=True):
    rollouts: list[RolloutMsgpackS]


JSON_DECODER = msgspec.json.Decoder(IngestS)
MSGPACK_DECODER = msgspec.msgpack.Decoder(IngestMsgpackS)

SETTINGS = Settings()
WIDEST = widest_list(SETTINGS)


def check_count(n: int) -> None:
    """The broker's rule on the rollouts of one request (``Broker.check_count``)."""
    if n > SETTINGS.max_rollouts_per_request:
        raise ValidationFailed(f"{n} rollouts in one request, at most {n}")


class MsgspecModels:
    """What ``parse_body`` takes for a format's model, done by msgspec: a JSON body is decoded
    and validated in one pass; a msgpack body, which ``parse_body`` has already unpacked (with
    its limits), is validated by ``msgspec.convert``."""

    @classmethod
    def model_validate_json(cls, body: bytes) -> IngestS:
        return JSON_DECODER.decode(body)

    @classmethod
    def model_validate(cls, doc: Any) -> IngestMsgpackS:
        return msgspec.convert(doc, IngestMsgpackS)


class Unvalidated:
    """A model that validates nothing: ``parse_body`` with it is the counts and the decode
    (``msgpack.unpackb`` with the broker's limits) alone."""

    @classmethod
    def model_validate_json(cls, body: bytes) -> Any:
        return body

    @classmethod
    def model_validate(cls, doc: Any) -> Any:
        return doc


def _parse(body: bytes, fmt: str, models: tuple[Any, Any]) -> Any:
    """``parse_body`` of an ingest body with ``models``, with the collector off as the ingest
    endpoint parses (``pack_items``, which for a body below 4 MiB is exactly this call)."""
    was = gc.isenabled()
    gc.disable()
    try:
        return parse_body(body, CONTENT_TYPE[fmt], *models, {"rollouts": check_count}, WIDEST)
    finally:
        if was:
            gc.enable()


def broker_parse(body: bytes, fmt: str) -> list[Any]:
    """The ingest endpoint's parse: the counts, then the pydantic model of the format."""
    return _parse(body, fmt, (IngestJSON, IngestMsgpack)).rollouts  # type: ignore[no-any-return]


def msgspec_parse(body: bytes, fmt: str) -> list[Any]:
    """The same with msgspec in place of pydantic (:class:`MsgspecModels`)."""
    return _parse(body, fmt, (MsgspecModels, MsgspecModels)).rollouts  # type: ignore[no-any-return]


def broker_decode(body: bytes) -> Any:
    """The broker's decode of a msgpack body: the counts, ``msgpack.unpackb`` with its limits."""
    return _parse(body, "msgpack", (Unvalidated, Unvalidated))


def pydantic_alone(body: bytes, fmt: str) -> list[Any]:
    """pydantic without the counts and limits: ``model_validate_json``, or ``msgpack.unpackb``
    (plain) and ``model_validate``."""
    if fmt == "json":
        return IngestJSON.model_validate_json(body).rollouts
    doc = msgpack.unpackb(body, raw=False, strict_map_key=True)
    return IngestMsgpack.model_validate(doc).rollouts


def msgspec_alone(body: bytes, fmt: str) -> list[Any]:
    """msgspec's one-pass decode of the body into the Structs."""
    decoder = MSGPACK_DECODER if fmt == "msgpack" else JSON_DECODER
    return decoder.decode(body).rollouts


def ingest(fmt: str, rollouts: int, tokens: int) -> bytes:
    payload = make_payload(tokens=tokens)
    items = [payload.item(fmt, rollout_id("lib", 0, i)) for i in range(rollouts)]
    return ingest_body(fmt, items)


def _blobs(packed: list[PackedRollout]) -> list[bytes]:
    return [p.blob for p in packed]


def same_parse(body: bytes, fmt: str, tokens: int) -> None:
    """The broker's parse and msgspec's pack into the same stored rollouts."""
    ours = pack_rollouts(broker_parse(body, fmt), tokens)
    for parse in (pydantic_alone, msgspec_parse, msgspec_alone):
        if pack_rollouts(parse(body, fmt), tokens) != ours:
            raise RuntimeError(f"{parse.__name__}: {fmt} rollouts pack differently")


def lease_answer(rollouts: int, tokens: int) -> tuple[dict[str, Any], list[bytes]]:
    """``batch_body(..., as_msgpack=True)`` of a lease of ``rollouts`` stored rollouts, and
    their stored blobs (what the lease reads from Redis)."""
    blobs = _blobs(
        pack_rollouts(broker_parse(ingest("msgpack", rollouts, tokens), "msgpack"), tokens)
    )
    stored = unpack_rollouts(blobs)
    batch = LeasedBatch(
        batch_id="lib-batch-0000",
        policy_version=0,
        lease_expires_at="2026-01-01T00:00:00.000Z",
        kl_coef=None,
        rollouts=[(r, 1, 0, None, None) for r in stored],
    )
    return batch_body(batch, as_msgpack=True), blobs


def render_msgpack(content: dict[str, Any]) -> Response:
    """The broker's msgpack answer (``render``)."""
    return render(content, as_msgpack=True)


def ormsgpack_answer(content: dict[str, Any]) -> Response:
    """The same answer by ormsgpack: its memoryviews are packed as bin (no ``default``
    needed), into one new bytes object."""
    return Response(ormsgpack.packb(content), media_type=MSGPACK)


def same_answer(content: dict[str, Any]) -> None:
    ours = bytes(render_msgpack(content).body)
    theirs = bytes(ormsgpack_answer(content).body)
    if msgpack.unpackb(ours) != msgpack.unpackb(theirs):
        raise RuntimeError("ormsgpack's lease answer reads differently from the broker's")


def msgpack_docs(blobs: list[bytes]) -> list[Any]:
    """How ``unpack_rollouts`` reads stored rollouts before their arrays."""
    unpackb = msgpack.unpackb
    return [unpackb(blob, raw=False) for blob in blobs]


def ormsgpack_docs(blobs: list[bytes]) -> list[Any]:
    unpackb = ormsgpack.unpackb
    return [unpackb(blob) for blob in blobs]


def same_docs(decode: Callable[[Any], Any], ours: Callable[[Any], Any], arg: Any) -> None:
    if decode(arg) != ours(arg):
        raise RuntimeError(f"{decode.__name__} reads differently from {ours.__name__}")
