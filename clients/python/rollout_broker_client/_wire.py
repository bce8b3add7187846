"""The requests of the API as data (method, path, body, how to read the answer), shared by the
sync and the async client, the codecs (msgpack with binary arrays, or JSON) and the bearer
token that the clients send without ever showing it."""

from __future__ import annotations

import json
import math
import os
import random
import re
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Generic, Literal, TypeVar, cast
from urllib.parse import quote

import httpx
import msgpack
import numpy as np
import numpy.typing as npt

from rollout_broker_client._errors import (
    BrokerError,
    BrokerHTTPError,
    BrokerUnreachable,
    error_from_response,
    parse_retry_after,
)
from rollout_broker_client._models import (
    AccessToken,
    Accounting,
    AckResult,
    AuditEntry,
    AuditPage,
    Batch,
    BatchCounts,
    BatchStats,
    ConsumerBatch,
    ConsumerInfo,
    ConsumerKind,
    ConsumerRollout,
    ConsumerSource,
    Float32Array,
    GeneratorAccounting,
    IngestResult,
    Int32Array,
    IsRatioStats,
    KlStats,
    LagStats,
    LeasedRollout,
    Measurement,
    MeasureStats,
    NewToken,
    Pair,
    PairRule,
    Partial,
    PolicyResult,
    PolicyVersion,
    Prompt,
    PromptCounts,
    PromptState,
    RegisterResult,
    Rejection,
    RewardLease,
    RewardRollout,
    Rollout,
    Run,
    RunConfig,
    Scope,
    ScoreResult,
    TrainingVersion,
    UInt8Array,
    VersionAccounting,
    WaitStats,
    WorkLease,
    WorkPrompt,
)
from rollout_broker_client.protocol import (
    JSON,
    MAX_TOKEN_ID,
    MSGPACK,
    MSGPACK_TYPES,
    new_run_id,
    token_id_of,
)

try:  # optional: faster JSON (the `fast` extra)
    import orjson
except ImportError:  # pragma: no cover - exercised where orjson is absent
    orjson = None  # type: ignore[assignment]

T = TypeVar("T")
Format = Literal["msgpack", "json"]


TOKEN_ENV = "BROKER_TOKEN"
_TOKEN_CHARS = re.compile(r"^[\x21-\x7e]+$")  # printable ASCII, no space: a header's value


class BearerToken:
    """A client's token, sent as ``Authorization: Bearer <token>``, that never shows itself:
    its repr and str are masked, and :meth:`scrub` masks it in any text the client raises."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        value = value.strip()
        if not _TOKEN_CHARS.match(value):
            # Not a word of the value itself: it is a secret.
            raise ValueError(
                "a broker token is printable ASCII without spaces (it is sent as "
                "'Authorization: Bearer <token>'); check the token= argument or BROKER_TOKEN"
            )
        self._value = value

    @classmethod
    def resolve(cls, token: str | None) -> BearerToken | None:
        """The token to send: ``token``, or with None the ``BROKER_TOKEN`` environment
        variable; an empty string (either way) is no token."""
        if token is None:
            token = os.environ.get(TOKEN_ENV)
        return cls(token) if token and token.strip() else None

    def header(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self._value}"}

    def scrub(self, text: str) -> str:
        return text.replace(self._value, "***")

    def scrub_error(self, err: BrokerError) -> None:
        """Mask the token in ``err``'s text (a proxy's error page may echo the request)."""
        err.args = tuple(self.scrub(a) if isinstance(a, str) else a for a in err.args)
        if isinstance(err, BrokerHTTPError):
            err.detail = self.scrub(err.detail)

    def __repr__(self) -> str:
        return "BearerToken('***')"

    __str__ = __repr__


RolloutLike = Rollout | Mapping[str, Any]
# A prompt to register: a Prompt, its wire form as a mapping, or a bare prompt_id.
PromptLike = Prompt | Mapping[str, Any] | str
# A partial rollout to give back: a Partial handed out before, or a rollout's fields, no reward.
PartialLike = Partial | Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Call(Generic[T]):
    """One request and how to read its answer.

    ``idempotent``: sending it again after it may have reached the broker changes nothing, so it
    may be retried after a lost answer or an outage. Every request this client builds is: it
    names what it creates (the run_id of a run, the batch_id of a lease, the lease_id of a work
    or reward lease), ingest is by rollout_id and a reward sent again is a duplicate.
    ``retry_statuses``: the statuses that mean "try again
    later" (an outage, a restarting broker behind a proxy). ``extra_timeout`` lengthens the
    read timeout (long polls).
    """

    method: str
    path: str
    read: Callable[[httpx.Response, Any], T]
    params: dict[str, str] | None = None
    content: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    idempotent: bool = True
    extra_timeout: float = 0.0
    retry_statuses: tuple[int, ...] = (502, 503, 504)


def decode(resp: httpx.Response) -> Any:
    """The body as Python data, msgpack or JSON by its content type; None when empty."""
    if not resp.content:
        return None
    kind = resp.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if kind in MSGPACK_TYPES:
        return msgpack.unpackb(resp.content, raw=False, strict_map_key=False)
    try:
        return orjson.loads(resp.content) if orjson is not None else json.loads(resp.content)
    except ValueError:  # orjson.JSONDecodeError and json.JSONDecodeError both are
        return resp.text


def check(resp: httpx.Response) -> Any:
    """The decoded body of a success, or the named exception of an error."""
    body = decode(resp)
    if resp.status_code >= 400:
        raise error_from_response(resp, body)
    return body


# -- encoding ------------------------------------------------------------------------------------


def _ids(value: npt.ArrayLike, what: str, rid: str) -> Int32Array:
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise ValueError(f"rollout {rid!r}: {what} must be one-dimensional, not {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype="<i4")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"rollout {rid!r}: {what} must be integers, not {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) > MAX_TOKEN_ID:
        raise ValueError(f"rollout {rid!r}: {what} must be between 0 and {MAX_TOKEN_ID}")
    return arr.astype("<i4", copy=False)


_F32_MIN = float(np.finfo(np.float32).min)
MAX_REWARD = 1e12  # the broker's bound on a reward's magnitude


def _logprobs(value: npt.ArrayLike, rid: str, tokens: int) -> Float32Array:
    """Behaviour logprobs as the broker takes them (SPEC "Rollouts"): one per response token,
    finite, at most 0 and within float32's range."""
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise ValueError(f"rollout {rid!r}: logprobs must be one-dimensional, not {arr.shape}")
    if arr.dtype.kind not in "fiu":
        try:
            arr = arr.astype(np.float64)
        except (TypeError, ValueError):
            raise TypeError(f"rollout {rid!r}: logprobs must be numbers, not {arr.dtype}") from None
    if arr.size != tokens:
        raise ValueError(f"rollout {rid!r}: {arr.size} logprobs for {tokens} response tokens")
    if arr.size:
        top, low = float(arr.max()), float(arr.min())
        if not (top <= 0.0 and low >= _F32_MIN):  # a NaN fails both
            if not np.isfinite(arr).all():
                raise ValueError(f"rollout {rid!r}: logprobs must be finite (no NaN or Infinity)")
            if top > 0.0:
                raise ValueError(
                    f"rollout {rid!r}: logprobs must be ≤ 0 (they are log-probabilities), not {top}"
                )
            raise ValueError(f"rollout {rid!r}: logprobs are out of float32 range ({low})")
    return arr.astype("<f4", copy=False)


def _reward(value: Any, rid: str) -> float:
    """A posted rollout's reward as a float: finite and within the broker's bound."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(
            f"rollout {rid!r}: reward must be a number (or None: unscored), not "
            f"{type(value).__name__}"
        ) from None
    if not math.isfinite(v):
        raise ValueError(f"rollout {rid!r}: reward must be finite (or None: unscored), not {v}")
    if abs(v) > MAX_REWARD:
        raise ValueError(f"rollout {rid!r}: reward must be within ±{MAX_REWARD:g}, not {v}")
    return v


def rollout_doc(r: RolloutLike, binary: bool) -> dict[str, Any]:
    """The wire form of one rollout; arrays as little-endian bytes when ``binary``. Token ids,
    logprobs and the reward are checked as the broker checks them (a ValueError or TypeError
    naming the rollout and the field), since one bad rollout makes it refuse a whole request."""
    src: Mapping[str, Any] = _as_mapping(r)
    rid = str(src["rollout_id"])
    doc: dict[str, Any] = {"rollout_id": rid, "policy_version": int(src["policy_version"])}
    if src.get("reward") is not None:  # absent: the rollout awaits its reward
        doc["reward"] = _reward(src["reward"], rid)
    resp = _ids(src["response_ids"], "response_ids", rid)
    doc["response_ids"] = resp.tobytes() if binary else resp.tolist()
    if src.get("prompt_ids") is not None:
        prompt = _ids(src["prompt_ids"], "prompt_ids", rid)
        doc["prompt_ids"] = prompt.tobytes() if binary else prompt.tolist()
    if src.get("logprobs") is not None:
        lp = _logprobs(src["logprobs"], rid, resp.size)
        doc["logprobs"] = lp.tobytes() if binary else lp.astype(np.float64).tolist()
    if src.get("loss_mask") is not None:
        mask = np.asarray(src["loss_mask"]).astype("u1")
        doc["loss_mask"] = mask.tobytes() if binary else mask.tolist()
    if src.get("versions") is not None:
        doc["versions"] = [[int(o), int(v)] for o, v in src["versions"]]
    for key in ("group_id", "finish_reason", "metadata", "generator_id"):
        if src.get(key) is not None:
            doc[key] = src[key]
    return doc


def partial_doc(p: PartialLike, binary: bool) -> dict[str, Any]:
    """The wire form of a partial rollout, a rollout without reward (a Partial handed out
    before, or a mapping of a rollout's fields), under its prompt's ``group_id``."""
    src: Mapping[str, Any] = (
        {
            "rollout_id": p.rollout_id,
            "group_id": p.group_id,
            "policy_version": p.policy_version,
            "response_ids": p.response_ids,
            "logprobs": p.logprobs,
            "prompt_ids": p.prompt_ids,
            "finish_reason": p.finish_reason,
            "metadata": p.metadata,
            "loss_mask": p.loss_mask,
            "versions": p.versions or None,
            "generator_id": p.generator_id,
        }
        if isinstance(p, Partial)
        else p
    )
    if src.get("group_id") is None:
        raise ValueError(f"partial {src.get('rollout_id')!r} has no group_id: name its prompt's")
    return rollout_doc({**src, "reward": None}, binary)


def _as_mapping(r: RolloutLike) -> Mapping[str, Any]:
    if isinstance(r, Rollout):
        return {
            "rollout_id": r.rollout_id,
            "policy_version": r.policy_version,
            "response_ids": r.response_ids,
            "reward": r.reward,
            "logprobs": r.logprobs,
            "group_id": r.group_id,
            "prompt_ids": r.prompt_ids,
            "finish_reason": r.finish_reason,
            "metadata": r.metadata,
            "loss_mask": r.loss_mask,
            "versions": r.versions,
            "generator_id": r.generator_id,
        }
    return r


def prompt_doc(p: PromptLike) -> dict[str, Any]:
    """The wire form of one prompt to register (token ids as a JSON list)."""
    if isinstance(p, str):
        return {"prompt_id": p}
    src: Mapping[str, Any] = (
        {"prompt_id": p.prompt_id, "prompt_ids": p.prompt_ids, "data": p.data}
        if isinstance(p, Prompt)
        else p
    )
    pid = str(src["prompt_id"])
    doc: dict[str, Any] = {"prompt_id": pid}
    if src.get("prompt_ids") is not None:
        doc["prompt_ids"] = _ids(src["prompt_ids"], "prompt_ids", pid).tolist()
    if src.get("data") is not None:
        doc["data"] = dict(src["data"])
    return doc


def encode(doc: Any, fmt: Format) -> tuple[bytes, dict[str, str]]:
    if fmt == "msgpack":
        return msgpack.packb(doc, use_bin_type=True), {"content-type": MSGPACK}
    if orjson is not None:
        return orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY), {"content-type": JSON}
    return json.dumps(doc, default=_json_default).encode(), {"content-type": JSON}


def _json_default(value: Any) -> Any:
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


# -- decoding ------------------------------------------------------------------------------------


def _time(value: Any) -> datetime:
    return datetime.fromisoformat(str(value))


def _opt_time(value: Any) -> datetime | None:
    return None if value is None else _time(value)


def _id_array(value: Any) -> Int32Array:
    if isinstance(value, bytes | bytearray | memoryview):
        return cast(Int32Array, np.frombuffer(value, dtype="<i4"))
    return np.asarray(value, dtype=np.int32)


def _lp_array(value: Any) -> Float32Array:
    if isinstance(value, bytes | bytearray | memoryview):
        return cast(Float32Array, np.frombuffer(value, dtype="<f4"))
    return np.asarray(value, dtype=np.float32)


def parse_policy(body: Any) -> PolicyVersion:
    weights = body.get("weights")
    return PolicyVersion(
        policy_version=int(body["policy_version"]),
        weights=None if weights is None else str(weights),
        set_at=_time(body["set_at"]),
    )


def parse_run(body: Any) -> Run:
    return Run(
        run_id=body["run_id"],
        config=cast(RunConfig, dict(body["config"])),
        policy_version=int(body["policy_version"]),
        status=body["status"],
        created_at=_time(body["created_at"]),
    )


def parse_ingest(body: Any) -> IngestResult:
    return IngestResult(
        accepted=int(body["accepted"]),
        duplicates=int(body["duplicates"]),
        rejected=[Rejection(x["rollout_id"], x["reason"]) for x in body.get("rejected", [])],
    )


def _scored_fields(doc: Any) -> dict[str, Any]:
    """The fields of a scored rollout handed out (to a trainer or a consumer), arrays as numpy
    from msgpack bytes or JSON lists."""
    prompt, lp = doc.get("prompt_ids"), doc.get("logprobs")
    return {
        "rollout_id": doc["rollout_id"],
        "group_id": doc.get("group_id"),
        "policy_version": int(doc["policy_version"]),
        "prompt_ids": None if prompt is None else _id_array(prompt),
        "response_ids": _id_array(doc["response_ids"]),
        "logprobs": None if lp is None else _lp_array(lp),
        "reward": float(doc["reward"]),
        "finish_reason": doc.get("finish_reason"),
        "metadata": doc.get("metadata"),
        "loss_mask": _mask_array(doc.get("loss_mask")),
        "versions": tuple((int(o), int(v)) for o, v in doc.get("versions") or ()),
        "generator_id": doc.get("generator_id"),
    }


def parse_leased(doc: Any) -> LeasedRollout:
    return LeasedRollout(
        **_scored_fields(doc),
        uses=int(doc["uses"]),
        lag=int(doc["lag"]),
        prompt_id=doc.get("prompt_id"),
    )


def parse_partial(doc: Any) -> Partial:
    prompt, lp = doc.get("prompt_ids"), doc.get("logprobs")
    return Partial(
        rollout_id=doc["rollout_id"],
        group_id=doc["group_id"],
        policy_version=int(doc["policy_version"]),
        response_ids=_id_array(doc["response_ids"]),
        logprobs=None if lp is None else _lp_array(lp),
        prompt_ids=None if prompt is None else _id_array(prompt),
        finish_reason=doc.get("finish_reason"),
        metadata=doc.get("metadata"),
        loss_mask=_mask_array(doc.get("loss_mask")),
        versions=tuple((int(o), int(v)) for o, v in doc.get("versions") or ()),
        generator_id=doc.get("generator_id"),
    )


def _mask_array(value: Any) -> UInt8Array | None:
    if value is None:
        return None
    if isinstance(value, bytes | bytearray | memoryview):
        return cast(UInt8Array, np.frombuffer(value, dtype=np.uint8))
    return np.asarray(value, dtype=np.uint8)


def parse_batch(body: Any) -> Batch:
    return Batch(
        batch_id=body["batch_id"],
        policy_version=int(body["policy_version"]),
        lease_expires_at=_time(body["lease_expires_at"]),
        rollouts=[parse_leased(r) for r in body["rollouts"]],
        kl_coef=body.get("kl_coef"),
    )


def parse_consumer(body: Any) -> ConsumerInfo:
    margin = body.get("min_margin")
    lag = body.get("max_lag")
    return ConsumerInfo(
        name=str(body["name"]),
        kind=body["kind"],
        source=body["source"],
        max_lag=None if lag is None else int(lag),
        min_margin=None if margin is None else float(margin),
        pairs=body.get("pairs"),
        retention_rollouts=int(body["retention_rollouts"]),
        created_at=_time(body["created_at"]),
        **{k: int(body[k]) for k in ("delivered", "acked", "dropped", "pending", "leased")},
    )


def parse_consumer_rollout(doc: Any) -> ConsumerRollout:
    return ConsumerRollout(**_scored_fields(doc))


def parse_pair(doc: Any) -> Pair:
    return Pair(
        pair_id=str(doc["pair_id"]),
        prompt_id=doc.get("prompt_id"),
        chosen=parse_consumer_rollout(doc["chosen"]),
        rejected=parse_consumer_rollout(doc["rejected"]),
        margin=float(doc["margin"]),
    )


def parse_consumer_batch(body: Any) -> ConsumerBatch:
    """A consumer's batch, JSON or msgpack (arrays as little-endian bytes)."""
    return ConsumerBatch(
        batch_id=body["batch_id"],
        lease_expires_at=_time(body["lease_expires_at"]),
        rollouts=[parse_consumer_rollout(r) for r in body.get("rollouts") or ()],
        pairs=[parse_pair(p) for p in body.get("pairs") or ()],
    )


def parse_ack(body: Any) -> AckResult:
    s = body["stats"]
    return AckResult(
        consumed=int(body["consumed"]),
        retired=int(body["retired"]),
        flushed=int(body["flushed"]),
        stats=BatchStats(
            kl_mean=s.get("kl_mean"),
            kl_max=s.get("kl_max"),
            is_ratio_mean=s.get("is_ratio_mean"),
            clip_fraction=s.get("clip_fraction"),
            ess_fraction=s.get("ess_fraction"),
        ),
        kl_coef=body.get("kl_coef"),
    )


def parse_measure(body: Any, order: Sequence[str] | None) -> Measurement:
    """A measure's answer; its weights as float32 arrays, in ``order`` (the batch's) if given.
    A msgpack answer carries them as float32 bytes, a JSON one as lists."""
    raw = body["weights"]
    ids = list(order) if order is not None else list(raw)
    s = body["stats"]
    return Measurement(
        weights={
            rid: np.frombuffer(raw[rid], dtype="<f4")
            if isinstance(raw[rid], bytes)
            else np.asarray(raw[rid], dtype=np.float32)
            for rid in ids
        },
        sequence_weights={rid: float(body["sequence_weights"][rid]) for rid in ids},
        stats=MeasureStats(
            **{k: s.get(k) for k in (*BATCH_FIGURES, "masked_fraction", "chi2")},
        ),
        kl_coef=body.get("kl_coef"),
    )


BATCH_FIGURES = ("kl_mean", "kl_max", "is_ratio_mean", "clip_fraction", "ess_fraction")


def parse_work(body: Any) -> WorkLease:
    return WorkLease(
        lease_id=body["lease_id"],
        policy_version=int(body["policy_version"]),
        expires_at=_time(body["expires_at"]),
        prompts=[
            WorkPrompt(
                prompt_id=p["prompt_id"],
                pass_=int(p.get("pass", 1)),
                attempt=int(p["attempt"]),
                group_id=p["group_id"],
                prompt_ids=None if p.get("prompt_ids") is None else _id_array(p["prompt_ids"]),
                data=p.get("data"),
                partials=[parse_partial(q) for q in p.get("partials") or []],
            )
            for p in body["prompts"]
        ],
    )


def parse_reward_lease(body: Any) -> RewardLease:
    return RewardLease(
        lease_id=body["lease_id"],
        expires_at=_time(body["expires_at"]),
        rollouts=[
            RewardRollout(
                rollout_id=r["rollout_id"],
                group_id=r.get("group_id"),
                prompt_id=r.get("prompt_id"),
                prompt_ids=None if r.get("prompt_ids") is None else _id_array(r["prompt_ids"]),
                response_ids=_id_array(r["response_ids"]),
                loss_mask=_mask_array(r.get("loss_mask")),
                data=r.get("data"),
                metadata=r.get("metadata"),
                finish_reason=r.get("finish_reason"),
            )
            for r in body["rollouts"]
        ],
    )


def parse_score(body: Any) -> ScoreResult:
    return ScoreResult(
        scored=int(body["scored"]),
        duplicates=int(body["duplicates"]),
        retired=[str(x) for x in body.get("retired") or []],
    )


def reward_values(rewards: Mapping[str, Any]) -> dict[str, float]:
    """Rewards by rollout_id as finite floats; anything else is refused before it is sent, so a
    bad score never costs a round trip or half a request."""
    out: dict[str, float] = {}
    for rid, value in rewards.items():
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"a reward's key must be a rollout_id, not {rid!r}")
        if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
            raise TypeError(f"reward of {rid!r} must be a number, not {type(value).__name__}")
        v = float(value)
        if not math.isfinite(v):
            raise ValueError(f"reward of {rid!r} must be finite, not {v}")
        if abs(v) > MAX_REWARD:
            raise ValueError(f"reward of {rid!r} must be within ±{MAX_REWARD:g}, not {v}")
        out[rid] = v
    return out


def parse_prompt_state(doc: Any) -> PromptState:
    return PromptState(
        prompt_id=doc["prompt_id"],
        pass_=int(doc.get("pass", 1)),
        attempt=int(doc["attempt"]),
        state=doc["state"],
        tries=int(doc.get("tries", 0)),
        mean=None if doc.get("mean") is None else float(doc["mean"]),
    )


def _page(body: Any) -> tuple[list[Any], str | None]:
    return list(body.get("prompts", [])), body.get("next_cursor") or None


def _counts(value: Any) -> dict[str, int]:
    return {str(k): int(v) for k, v in (value or {}).items()}


def _lag(value: Any) -> LagStats:
    v = value or {}
    hist = {int(k): int(n) for k, n in (v.get("histogram") or {}).items()}
    top = v.get("max")
    return LagStats(
        mean=v.get("mean"),
        max=None if top is None else int(top),
        histogram=hist,
        token_mean=v.get("token_mean"),
    )


def _kl(value: Any) -> KlStats:
    v = value or {}
    return KlStats(mean=v.get("mean"), max=v.get("max"))


def _prompt_counts(value: Any) -> PromptCounts:
    v = value or {}
    return PromptCounts(
        **{k: int(v.get(k, 0)) for k in ("registered", "queued", "in_flight", "done", "failed")},
        retried=int(v.get("retried", 0)),
        skipped=int(v.get("skipped", 0)),
        cancelled=int(v.get("cancelled", 0)),
        pools=None if v.get("pools") is None else _counts(v["pools"]),
    )


def parse_accounting(body: Any) -> Accounting:
    b = body.get("batches") or {}
    ir = body.get("is_ratio") or {}
    w = body.get("wait") or {}
    pending = body.get("pending_events")
    return Accounting(
        rollouts_received=int(body["rollouts_received"]),
        groups_received=int(body.get("groups_received", 0)),
        duplicates=int(body.get("duplicates", 0)),
        rejected=_counts(body.get("rejected")),
        tokens_generated=int(body.get("tokens_generated", 0)),
        tokens_masked=int(body.get("tokens_masked") or 0),
        tokens_masked_stale=int(body.get("tokens_masked_stale") or 0),
        buffered=int(body["buffered"]),
        leased=int(body["leased"]),
        samples_consumed=int(body["samples_consumed"]),
        samples_rewound=int(body.get("samples_rewound") or 0),
        tokens_consumed=int(body.get("tokens_consumed", 0)),
        reuse_factor=float(body.get("reuse_factor", 0.0)),
        retired=_counts(body.get("retired")),
        wasted_tokens=int(body.get("wasted_tokens", 0)),
        batches=BatchCounts(
            leased=int(b.get("leased", 0)),
            acked=int(b.get("acked", 0)),
            nacked=int(b.get("nacked", 0)),
            expired=int(b.get("expired", 0)),
        ),
        lag=_lag(body.get("lag")),
        kl=_kl(body.get("kl")),
        is_ratio=IsRatioStats(mean=ir.get("mean"), clip_fraction=ir.get("clip_fraction")),
        prompts=_prompt_counts(body.get("prompts")),
        wait=WaitStats(
            generator_s=float(w.get("generator_s") or 0.0),
            trainer_s=float(w.get("trainer_s") or 0.0),
            reward_s=None if w.get("reward_s") is None else float(w["reward_s"]),
        ),
        pending_events=None if pending is None else int(pending),
        as_of=_opt_time(body.get("as_of")),
        kl_coef=body.get("kl_coef"),
        raw=dict(body),
    )


def parse_versions(body: Any) -> list[VersionAccounting]:
    rows = body.get("versions", []) if isinstance(body, Mapping) else body
    return [
        VersionAccounting(
            policy_version=int(v["policy_version"]),
            rollouts_received=int(v["rollouts_received"]),
            groups_received=int(v.get("groups_received", 0)),
            rejected=_counts(v.get("rejected")),
            tokens_generated=int(v.get("tokens_generated", 0)),
            tokens_masked=int(v.get("tokens_masked") or 0),
            tokens_masked_stale=int(v.get("tokens_masked_stale") or 0),
            buffered=int(v["buffered"]),
            leased=int(v["leased"]),
            samples_consumed=int(v["samples_consumed"]),
            samples_rewound=int(v.get("samples_rewound") or 0),
            tokens_consumed=int(v.get("tokens_consumed", 0)),
            reuse_factor=float(v.get("reuse_factor", 0.0)),
            retired=_counts(v.get("retired")),
            wasted_tokens=int(v.get("wasted_tokens", 0)),
            lag=_lag(v.get("lag")),
            kl=_kl(v.get("kl")),
            kl_coef=v.get("kl_coef"),
            raw=dict(v),
        )
        for v in rows
    ]


def parse_training(body: Any) -> list[TrainingVersion]:
    rows = body.get("versions", []) if isinstance(body, Mapping) else body
    return [
        TrainingVersion(
            policy_version=int(v["policy_version"]),
            batches=int(v["batches"]),
            samples=int(v["samples"]),
            tokens=int(v.get("tokens", 0)),
            kl_mean=v.get("kl_mean"),
            kl_max=v.get("kl_max"),
            is_ratio_mean=v.get("is_ratio_mean"),
            clip_fraction=v.get("clip_fraction"),
            kl_coef=v.get("kl_coef"),
            raw=dict(v),
        )
        for v in rows
    ]


def parse_generators(body: Any) -> list[GeneratorAccounting]:
    rows = body.get("generators", []) if isinstance(body, Mapping) else body
    out = []
    for g in rows:
        ir = g.get("is_ratio") or {}
        out.append(
            GeneratorAccounting(
                generator_id=str(g["generator_id"]),
                rollouts=int(g["rollouts"]),
                tokens=int(g.get("tokens", 0)),
                samples_consumed=int(g["samples_consumed"]),
                kl=_kl(g.get("kl")),
                is_ratio=IsRatioStats(mean=ir.get("mean"), clip_fraction=ir.get("clip_fraction")),
                masked_fraction=g.get("masked_fraction"),
                last_seen=_opt_time(g.get("last_seen")),
                quarantined=bool(g.get("quarantined", False)),
                raw=dict(g),
            )
        )
    return out


def _scopes(value: Any) -> list[Scope]:
    return [cast(Scope, str(x)) for x in value]


def _runs(value: Any) -> list[str] | None:
    return None if value is None else [str(x) for x in value]


def parse_access_token(doc: Any) -> AccessToken:
    return AccessToken(
        token_id=str(doc["token_id"]),
        name=str(doc["name"]),
        scopes=_scopes(doc["scopes"]),
        runs=_runs(doc.get("runs")),
        created_at=_time(doc["created_at"]),
        created_by=doc.get("created_by"),
        revoked_at=_opt_time(doc.get("revoked_at")),
    )


def parse_new_token(doc: Any) -> NewToken:
    return NewToken(
        token_id=str(doc["token_id"]),
        token=str(doc["token"]),
        name=str(doc["name"]),
        scopes=_scopes(doc["scopes"]),
        runs=_runs(doc.get("runs")),
        created_at=_time(doc["created_at"]),
    )


def parse_audit_entry(doc: Any) -> AuditEntry:
    return AuditEntry(
        id=int(doc["id"]),
        at=_time(doc["at"]),
        actor=str(doc["actor"]),
        token_id=doc.get("token_id"),
        action=str(doc["action"]),
        run_id=doc.get("run_id"),
        detail=dict(doc.get("detail") or {}),
    )


def parse_audit_page(body: Any) -> AuditPage:
    return AuditPage(
        entries=[parse_audit_entry(e) for e in body["entries"]],
        next_cursor=body.get("next_cursor") or None,
    )


def _audit(run_id: str | None, limit: int, cursor: str | None) -> dict[str, str]:
    params = {"limit": str(int(limit))}
    if run_id is not None:
        params["run_id"] = run_id
    if cursor:
        params["cursor"] = cursor
    return params


def _ignore(resp: httpx.Response, body: Any) -> Any:
    return body


# -- the requests --------------------------------------------------------------------------------


def _p(run_id: str) -> str:
    return "/v1/runs/" + quote(run_id, safe="")


def _consumer(run_id: str, name: str) -> str:
    return f"{_p(run_id)}/consumers/{quote(name, safe='')}"


@dataclass(frozen=True, slots=True)
class Api:
    """Builds the :class:`Call` of each endpoint. ``fmt`` is the body format of ingest and ack
    and the format asked of batches."""

    fmt: Format = "msgpack"
    trainer_id: str | None = None
    generator_id: str | None = None

    def _body(self, doc: Any, fmt: Format | None = None) -> tuple[bytes, dict[str, str]]:
        return encode(doc, fmt or "json")

    # runs
    def create_run(self, run_id: str | None, config: Mapping[str, Any] | None) -> Call[Run]:
        # Naming the run here makes a retried creation land on the same run (idempotent).
        rid = run_id or new_run_id()
        content, headers = self._body({"run_id": rid, "config": dict(config or {})})
        return Call("POST", "/v1/runs", lambda r, b: parse_run(b), None, content, headers)

    def list_runs(
        self, status: str | None = None, limit: int = 1000, cursor: str | None = None
    ) -> Call[tuple[list[Run], str | None]]:
        """A page of runs, newest first, and the cursor of the next (None: no more)."""
        params = {"limit": str(limit)}
        if status is not None:
            params["status"] = status
        if cursor is not None:
            params["cursor"] = cursor
        return Call(
            "GET",
            "/v1/runs",
            lambda r, b: ([parse_run(x) for x in b["runs"]], b["next_cursor"]),
            params,
        )

    def get_run(self, run_id: str) -> Call[Run]:
        return Call("GET", _p(run_id), lambda r, b: parse_run(b))

    def patch_config(self, run_id: str, changes: Mapping[str, Any]) -> Call[Run]:
        content, headers = self._body(dict(changes))
        return Call(
            "PATCH", _p(run_id) + "/config", lambda r, b: parse_run(b), None, content, headers
        )

    def close_run(self, run_id: str) -> Call[Run]:
        return Call("POST", _p(run_id) + "/close", lambda r, b: parse_run(b))

    def delete_run(self, run_id: str) -> Call[None]:
        return Call("DELETE", _p(run_id), lambda r, b: None)

    def release_generator(self, run_id: str, generator_id: str) -> Call[bool]:
        path = _p(run_id) + "/generators/" + quote(generator_id, safe="") + "/release"
        return Call("POST", path, lambda r, b: bool(b["released"]))

    def set_policy(
        self, run_id: str, version: int, weights: str | None = None, rewind: bool = False
    ) -> Call[PolicyResult]:
        doc: dict[str, Any] = {"version": int(version)}
        if weights is not None:
            doc["weights"] = str(weights)
        if rewind:
            doc["rewind"] = True
        content, headers = self._body(doc)
        return Call(
            "POST",
            _p(run_id) + "/policy",
            lambda r, b: PolicyResult(int(b["policy_version"]), int(b["evicted"])),
            None,
            content,
            headers,
        )

    def policy(
        self, run_id: str, after: int | None = None, wait_s: float = 0.0
    ) -> Call[PolicyVersion | None]:
        params = {"wait_s": repr(float(wait_s))}
        if after is not None:
            params["after"] = str(int(after))
        return Call(
            "GET",
            _p(run_id) + "/policy",
            lambda r, b: None if r.status_code == 204 else parse_policy(b),
            params,
            extra_timeout=max(0.0, float(wait_s)),
        )

    # generators
    def post_rollouts(self, run_id: str, rollouts: Sequence[RolloutLike]) -> Call[IngestResult]:
        return self.ingest(run_id, self.rollout_docs(rollouts))

    def rollout_docs(self, rollouts: Iterable[RolloutLike]) -> list[dict[str, Any]]:
        """The wire form of rollouts in the body format of ingest, checked before anything is
        sent (see :func:`rollout_doc`)."""
        binary = self.fmt == "msgpack"
        return [rollout_doc(r, binary) for r in rollouts]

    def ingest(self, run_id: str, docs: Sequence[dict[str, Any]]) -> Call[IngestResult]:
        """An ingest request of rollouts already in their wire form (:meth:`rollout_docs`)."""
        content, headers = self._body({"rollouts": list(docs)}, self.fmt)
        return Call(
            "POST",
            _p(run_id) + "/rollouts",
            lambda r, b: parse_ingest(b),
            None,
            content,
            headers,
        )

    # work leases (generators; prompts are registered by operators)
    def register_prompts(
        self, run_id: str, prompts: Sequence[PromptLike], epochs: int
    ) -> Call[RegisterResult]:
        content, headers = self._body(
            {"prompts": [prompt_doc(p) for p in prompts], "epochs": int(epochs)}
        )
        return Call(
            "POST",
            _p(run_id) + "/prompts",
            lambda r, b: RegisterResult(int(b["accepted"]), int(b["duplicates"])),
            None,
            content,
            headers,
        )

    def work(
        self,
        run_id: str,
        max_prompts: int,
        *,
        generator_id: str | None,
        wait_s: float,
        lease_id: str | None,
    ) -> Call[WorkLease | None]:
        # Our own lease id makes a resend safe: the broker answers it with the same lease.
        doc: dict[str, Any] = {
            "max_prompts": int(max_prompts),
            "wait_s": float(wait_s),
            "lease_id": lease_id or uuid.uuid4().hex,
        }
        gid = generator_id or self.generator_id
        if gid is not None:
            doc["generator_id"] = gid
        content, headers = self._body(doc)
        if self.fmt == "msgpack":
            headers["accept"] = f"{MSGPACK}, {JSON};q=0.5"
        return Call(
            "POST",
            _p(run_id) + "/work",
            lambda r, b: None if r.status_code == 204 else parse_work(b),
            None,
            content,
            headers,
            extra_timeout=max(0.0, float(wait_s)),
        )

    def return_work(
        self,
        run_id: str,
        lease_id: str,
        prompt_ids: Sequence[str] | None,
        partials: Sequence[PartialLike] = (),
    ) -> Call[int]:
        doc: dict[str, Any] = {} if prompt_ids is None else {"prompt_ids": list(prompt_ids)}
        fmt: Format = "json"
        if partials:  # as big as a post of rollouts may be: in the body format of ingest
            fmt = self.fmt
            doc["partials"] = [partial_doc(p, fmt == "msgpack") for p in partials]
        content, headers = self._body(doc, fmt)
        path = f"{_p(run_id)}/work/{quote(lease_id, safe='')}/return"
        return Call("POST", path, lambda r, b: int(b["returned"]), None, content, headers)

    def prompts_page(
        self,
        run_id: str,
        state: str | None,
        cursor: str | None,
        limit: int,
        pool: str | None = None,
    ) -> Call[tuple[list[Any], str | None]]:
        """One page of prompt states, as documents: the caller parses them one by one."""
        params = {"limit": str(int(limit))}
        if state is not None:
            params["state"] = state
        if pool is not None:
            params["pool"] = pool
        if cursor:
            params["cursor"] = cursor
        return Call("GET", _p(run_id) + "/prompts", lambda r, b: _page(b), params)

    # reward workers
    def reward_lease(
        self,
        run_id: str,
        max_rollouts: int,
        *,
        worker_id: str | None,
        wait_s: float,
        lease_id: str | None,
    ) -> Call[RewardLease | None]:
        # Our own lease id makes a resend safe: the broker answers it with the same lease.
        doc: dict[str, Any] = {
            "max_rollouts": int(max_rollouts),
            "wait_s": float(wait_s),
            "lease_id": lease_id or uuid.uuid4().hex,
        }
        if worker_id is not None:
            doc["worker_id"] = worker_id
        content, headers = self._body(doc)
        if self.fmt == "msgpack":
            headers["accept"] = f"{MSGPACK}, {JSON};q=0.5"
        return Call(
            "POST",
            _p(run_id) + "/rewards/lease",
            lambda r, b: None if r.status_code == 204 else parse_reward_lease(b),
            None,
            content,
            headers,
            extra_timeout=max(0.0, float(wait_s)),
        )

    def score(
        self, run_id: str, rewards: Mapping[str, Any], lease_id: str | None
    ) -> Call[ScoreResult]:
        # Idempotent: the same reward again is a duplicate, so a resend changes nothing.
        doc: dict[str, Any] = {"rewards": reward_values(rewards)}
        if lease_id is not None:
            doc["lease_id"] = lease_id
        content, headers = self._body(doc)
        return Call(
            "POST", _p(run_id) + "/rewards", lambda r, b: parse_score(b), None, content, headers
        )

    def return_rewards(
        self, run_id: str, lease_id: str, rollout_ids: Sequence[str] | None
    ) -> Call[int]:
        doc: dict[str, Any] = {} if rollout_ids is None else {"rollout_ids": list(rollout_ids)}
        content, headers = self._body(doc)
        path = f"{_p(run_id)}/rewards/lease/{quote(lease_id, safe='')}/return"
        return Call("POST", path, lambda r, b: int(b["returned"]), None, content, headers)

    # trainers
    def lease(
        self,
        run_id: str,
        size: int,
        *,
        policy_version: int | None,
        wait_s: float,
        partial: bool,
        trainer_id: str | None,
    ) -> Call[Batch | None]:
        params = {"size": str(int(size)), "wait_s": repr(float(wait_s))}
        if partial:
            params["partial"] = "true"
        if policy_version is not None:
            params["policy_version"] = str(int(policy_version))
        tid = trainer_id or self.trainer_id
        if tid is not None:
            params["trainer_id"] = tid
        # Our own batch id makes a resend safe: while the lease lives, it returns the same batch.
        params["batch_id"] = uuid.uuid4().hex
        headers = {"accept": f"{MSGPACK}, {JSON};q=0.5"} if self.fmt == "msgpack" else {}
        return Call(
            "GET",
            _p(run_id) + "/batch",
            lambda r, b: None if r.status_code == 204 else parse_batch(b),
            params,
            None,
            headers,
            extra_timeout=max(0.0, float(wait_s)),
        )

    def ack(
        self,
        run_id: str,
        batch_id: str,
        *,
        logprobs: Mapping[str, npt.ArrayLike] | None,
        kl: Mapping[str, float] | None,
        step: int | None,
    ) -> Call[AckResult]:
        doc: dict[str, Any] = {}
        binary = self.fmt == "msgpack"
        if logprobs:
            doc["logprobs"] = {
                rid: (
                    np.asarray(v, dtype="<f4").tobytes()
                    if binary
                    else np.asarray(v, dtype=np.float64).tolist()
                )
                for rid, v in logprobs.items()
            }
        if kl:
            doc["kl"] = {rid: float(v) for rid, v in kl.items()}
        if step is not None:
            doc["step"] = int(step)
        content, headers = self._body(doc, self.fmt)
        path = f"{_p(run_id)}/batches/{quote(batch_id, safe='')}/ack"
        return Call("POST", path, lambda r, b: parse_ack(b), None, content, headers)

    def measure(
        self,
        run_id: str,
        batch_id: str,
        logprobs: Mapping[str, npt.ArrayLike],
        order: Sequence[str] | None,
    ) -> Call[Measurement]:
        binary = self.fmt == "msgpack"
        doc = {
            "logprobs": {
                rid: (
                    np.asarray(v, dtype="<f4").tobytes()
                    if binary
                    else np.asarray(v, dtype=np.float64).tolist()
                )
                for rid, v in logprobs.items()
            }
        }
        content, headers = self._body(doc, self.fmt)
        if binary:
            headers = {**headers, "accept": f"{MSGPACK}, {JSON};q=0.5"}
        path = f"{_p(run_id)}/batches/{quote(batch_id, safe='')}/measure"
        return Call("POST", path, lambda r, b: parse_measure(b, order), None, content, headers)

    def nack(self, run_id: str, batch_id: str) -> Call[int]:
        path = f"{_p(run_id)}/batches/{quote(batch_id, safe='')}/nack"
        return Call("POST", path, lambda r, b: int(b["returned"]))

    # consumers: reward-model and preference trainers beside the policy trainer
    def create_consumer(
        self,
        run_id: str,
        name: str,
        *,
        source: ConsumerSource,
        kind: ConsumerKind,
        max_lag: int | None,
        min_margin: float | None,
        pairs: PairRule | None,
        retention_rollouts: int | None,
    ) -> Call[ConsumerInfo]:
        # Idempotent: the same name and config again answers the consumer as it is.
        doc: dict[str, Any] = {"name": name, "kind": kind, "source": source}
        if max_lag is not None:
            doc["max_lag"] = int(max_lag)
        if min_margin is not None:
            doc["min_margin"] = float(min_margin)
        if pairs is not None:
            doc["pairs"] = pairs
        if retention_rollouts is not None:
            doc["retention_rollouts"] = int(retention_rollouts)
        content, headers = self._body(doc)
        path = _p(run_id) + "/consumers"
        return Call("POST", path, lambda r, b: parse_consumer(b), None, content, headers)

    def get_consumer(self, run_id: str, name: str) -> Call[ConsumerInfo]:
        return Call("GET", _consumer(run_id, name), lambda r, b: parse_consumer(b))

    def delete_consumer(self, run_id: str, name: str) -> Call[None]:
        return Call("DELETE", _consumer(run_id, name), lambda r, b: None)

    def consumer_lease(
        self, run_id: str, name: str, size: int, *, wait_s: float, batch_id: str | None
    ) -> Call[ConsumerBatch | None]:
        # Our own batch id makes a resend safe: while the lease lives, it returns the same batch.
        params = {
            "size": str(int(size)),
            "wait_s": repr(float(wait_s)),
            "batch_id": batch_id or uuid.uuid4().hex,
        }
        headers = {"accept": f"{MSGPACK}, {JSON};q=0.5"} if self.fmt == "msgpack" else {}
        return Call(
            "GET",
            _consumer(run_id, name) + "/batch",
            lambda r, b: None if r.status_code == 204 else parse_consumer_batch(b),
            params,
            None,
            headers,
            extra_timeout=max(0.0, float(wait_s)),
        )

    def consumer_ack(self, run_id: str, name: str, batch_id: str) -> Call[int]:
        path = f"{_consumer(run_id, name)}/batches/{quote(batch_id, safe='')}/ack"
        return Call("POST", path, lambda r, b: int(b["acked"]))

    def consumer_nack(self, run_id: str, name: str, batch_id: str) -> Call[int]:
        path = f"{_consumer(run_id, name)}/batches/{quote(batch_id, safe='')}/nack"
        return Call("POST", path, lambda r, b: int(b["returned"]))

    # operators
    def accounting(self, run_id: str) -> Call[Accounting]:
        return Call("GET", _p(run_id) + "/accounting", lambda r, b: parse_accounting(b))

    def accounting_versions(self, run_id: str) -> Call[list[VersionAccounting]]:
        return Call("GET", _p(run_id) + "/accounting/versions", lambda r, b: parse_versions(b))

    def accounting_training(self, run_id: str) -> Call[list[TrainingVersion]]:
        return Call("GET", _p(run_id) + "/accounting/training", lambda r, b: parse_training(b))

    def accounting_generators(self, run_id: str) -> Call[list[GeneratorAccounting]]:
        return Call("GET", _p(run_id) + "/accounting/generators", lambda r, b: parse_generators(b))

    def batches_page(self, run_id: str, cursor: str | None) -> Call[dict[str, Any]]:
        params = {"cursor": cursor} if cursor else None
        return Call(
            "GET",
            _p(run_id) + "/batches",
            lambda r, b: b if isinstance(b, dict) else {"batches": b, "next_cursor": None},
            params,
        )

    # access control: tokens (admin) and the audit log (operate)
    def create_token(
        self, name: str, scopes: Scope | Iterable[Scope], runs: str | Iterable[str] | None
    ) -> Call[NewToken]:
        doc: dict[str, Any] = {
            "name": name,
            "scopes": [scopes] if isinstance(scopes, str) else list(scopes),
        }
        if runs is not None:
            doc["runs"] = [runs] if isinstance(runs, str) else list(runs)
        content, headers = self._body(doc)
        # Not idempotent: a resend after a lost answer would create a second token, alive and
        # with a secret nobody has seen. Only a request that never left is sent again.
        return Call(
            "POST",
            "/v1/tokens",
            lambda r, b: parse_new_token(b),
            None,
            content,
            headers,
            idempotent=False,
        )

    def list_tokens(self) -> Call[list[AccessToken]]:
        return Call("GET", "/v1/tokens", lambda r, b: [parse_access_token(t) for t in b["tokens"]])

    def revoke_token(self, token_id: str) -> Call[None]:
        path = "/v1/tokens/" + quote(token_id_of(token_id), safe="")
        return Call("DELETE", path, lambda r, b: None)

    def audit(self, run_id: str | None, limit: int, cursor: str | None) -> Call[AuditPage]:
        return Call(
            "GET", "/v1/audit", lambda r, b: parse_audit_page(b), _audit(run_id, limit, cursor)
        )

    def audit_docs(
        self, run_id: str | None, limit: int, cursor: str | None
    ) -> Call[tuple[list[Any], str | None]]:
        """One page of the audit log, as documents: the caller parses them one by one."""
        return Call(
            "GET",
            "/v1/audit",
            lambda r, b: (list(b["entries"]), b.get("next_cursor") or None),
            _audit(run_id, limit, cursor),
        )

    def healthz(self) -> Call[Any]:
        return Call("GET", "/healthz", _ignore, retry_statuses=())

    def readyz(self) -> Call[Any]:
        return Call("GET", "/readyz", _ignore, retry_statuses=())


@dataclass(frozen=True, slots=True)
class Retry:
    """When and how long to wait before sending a request again, through broker restarts and
    outages of its Redis or Postgres.

    Retried: a request that never reached the broker (connection refused, connect timeout);
    one whose answer was lost (the connection dropped, a read timeout) or that met ``502``,
    ``503`` or ``504``, when it is idempotent, as every request of this client is (ingest by
    ``rollout_id``, a lease by the ``batch_id`` and a work or reward lease by the ``lease_id``
    the client chose, a score by its value, ...) but the creation of a token. Not retried: any
    other status, ``500`` included (a bug, not an outage), ``401`` and ``403`` (the token will
    not do better a second time), ``429``, which the writer waits out on its own terms, and a
    URL the client cannot send to (no ``http://`` or ``https://``).

    The waits grow exponentially from ``backoff_s`` to ``max_backoff_s``, jittered (each is 50
    to 100 % of its step), and are at least the ``Retry-After`` the broker or a proxy sent. A
    request gives up (and its error is raised) when its next attempt would start more than
    ``deadline_s`` after its first, plus the long poll's own wait (``wait_s``), or after
    ``retries`` resends; None lifts either limit.

    ``first_contact_s`` is the deadline instead while the broker has never answered the client
    (a wrong URL, a broker not started: connection refused, a failed DNS lookup, a connect
    timeout): such a request gives up with :class:`BrokerUnreachable` when its next attempt would
    start more than ``first_contact_s`` after its first. Once the broker has answered the client
    (any status), ``deadline_s`` rides out its outages. None: ``deadline_s`` from the start.
    """

    deadline_s: float | None = 60.0
    retries: int | None = None
    backoff_s: float = 0.1
    max_backoff_s: float = 5.0
    first_contact_s: float | None = 10.0

    def delay(self, attempt: int) -> float:
        """The backoff before resend number ``attempt + 1``."""
        step = min(self.max_backoff_s, self.backoff_s * 2.0 ** min(attempt, 64))
        return random.uniform(0.5, 1.0) * step

    def pause(
        self,
        call: Call[Any],
        attempt: int,
        elapsed_s: float,
        *,
        error: httpx.TransportError | None = None,
        response: httpx.Response | None = None,
    ) -> float | None:
        """Seconds to wait before resending ``call`` after its attempt number ``attempt``
        (from 0) failed with ``error`` or answered ``response``, ``elapsed_s`` after the first
        attempt began; None to give up. A client whose broker has never answered also asks
        :meth:`first_contact_over`."""
        retry_after: float | None = None
        if error is not None:
            if isinstance(error, httpx.UnsupportedProtocol | httpx.LocalProtocolError):
                return None  # the request itself is wrong: sending it again cannot help
            never_sent = isinstance(
                error, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout
            )
            if not (never_sent or call.idempotent):
                return None
        elif response is not None:
            if not call.idempotent or response.status_code not in call.retry_statuses:
                return None
            header = response.headers.get("retry-after")
            if header is not None:
                retry_after = parse_retry_after(header)
        else:
            return None
        if self.retries is not None and attempt >= self.retries:
            return None
        wait = self.delay(attempt)
        if retry_after is not None:
            wait = max(wait, retry_after)
        if self.deadline_s is not None and elapsed_s + wait > self.deadline_s + call.extra_timeout:
            return None
        return wait

    def first_contact_over(
        self, error: httpx.TransportError, elapsed_s: float, wait: float
    ) -> bool:
        """Whether a request of a client whose broker has never answered it gives up, rather
        than wait ``wait`` seconds: its connection could not be made (``error``) and its next
        attempt would start more than ``first_contact_s`` after its first, ``elapsed_s`` ago."""
        no_contact = isinstance(error, httpx.ConnectError | httpx.ConnectTimeout)
        limit = self.first_contact_s
        return no_contact and limit is not None and elapsed_s + wait > limit


def unreachable(
    call: Call[Any],
    base_url: str,
    exc: httpx.TransportError,
    attempts: int,
    elapsed_s: float,
    *,
    contacted: bool = True,
) -> BrokerUnreachable:
    tries = "" if attempts == 1 else f" ({attempts} attempts in {elapsed_s:.1f} s)"
    hint = "" if contacted else "; the broker never answered this client: check its URL"
    return BrokerUnreachable(
        f"{call.method} {base_url}{call.path}: {type(exc).__name__}: {exc or 'no answer'}"
        f"{tries}{hint}"
    )


def answer_text(resp: httpx.Response) -> str:
    """An answer that will be retried, for a log line: its status and, when the broker sent
    it, the error's name and detail."""
    try:
        body = decode(resp)
    except ValueError:  # msgpack's errors are ValueErrors
        body = None
    if isinstance(body, Mapping) and isinstance(body.get("error"), str):
        return f"{resp.status_code} {body['error']}: {str(body.get('detail', ''))[:200]}"
    return f"{resp.status_code} {resp.reason_phrase}"


def rejections_text(rejected: Sequence[Rejection], shown: int = 5) -> str:
    """Rollouts the broker rejected one by one, for a log line: how many for each reason and
    the first ``shown`` ids."""
    reasons: dict[str, int] = {}
    for r in rejected:
        reasons[r.reason] = reasons.get(r.reason, 0) + 1
    by_reason = ", ".join(f"{reason}: {n}" for reason, n in sorted(reasons.items()))
    ids = ", ".join(repr(r.rollout_id) for r in rejected[:shown])
    more = f" and {len(rejected) - shown} more" if len(rejected) > shown else ""
    return f"{by_reason}; ids {ids}{more}"
