"""The accounting event codec, derived from the payload declaration: the table of event types,
the strict decoder, the encoder, and the docs' table."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from app.events.payloads import (
    Accepted,
    Acked,
    ConsumersChanged,
    Duplicate,
    Event,
    EventError,
    GeneratorChanged,
    Leased,
    PartialsChanged,
    PassesChanged,
    Payload,
    PromptScored,
    Registered,
    Rejected,
    Retired,
    Returned,
    RewardExpired,
    RewardLeased,
    RewardReturned,
    Rewound,
    RunChanged,
    Scored,
    StreamId,
    Waited,
    Wire,
    WorkLeased,
)
from app.events.readers import (
    read_array,
    read_flag,
    read_float,
    read_int,
    read_json,
    read_map,
    read_opt_map,
    read_text,
)


def _duplicate_n(d: Mapping[str, Any]) -> Mapping[str, Any]:
    # `n` repeats len(ids); an entry that lacks it is still counted.
    if d.get("n") is None:
        return {**d, "n": len(read_array(d.get("ids"), "ids"))}
    return d


@dataclass(frozen=True, slots=True)
class EventType:
    """One value of the entry field ``e``: its payload class and what the change is."""

    name: str
    body: type[Payload]
    change: str  # for the docs' table
    prepare: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None


SCHEMA: dict[str, EventType] = {
    t.name: t
    for t in (
        EventType("run", RunChanged, "the run row changed; a snapshot of it after the change"),
        EventType(
            "accepted",
            Accepted,
            "rollouts stored. `tokens` = response length. `unit_id` is the group id for "
            "`group_size > 1`, else the rollout id. `new_unit` is 1 when this rollout opened a "
            "new group (counts `groups_received`); `masked` (absent: 0) counts its tokens posted "
            "with `loss_mask` 0. `policy_version` is the version the run judges it by: its "
            "`v_old`, or its `v_new` under `stale_tokens: mask`. `awaiting` is 1 for a "
            "rollout posted without a reward (then `masked` is written, 0 or not)",
        ),
        EventType(
            "duplicate",
            Duplicate,
            "repeats of known `rollout_id`s (stored nothing)",
            prepare=_duplicate_n,
        ),
        EventType(
            "rejected",
            Rejected,
            "per-rollout policy rejections (`stale`, `future_version`, `run_closed`, "
            "`stale_attempt`); "
            "nothing stored",
        ),
        EventType(
            "leased",
            Leased,
            "buffered → leased. `lag` = the batch's `policy_version` − the rollout's",
        ),
        EventType(
            "acked",
            Acked,
            "leased → buffered, each item gains one use (a *sample*); `tokens` are its trained "
            "tokens as handed out, `masked_stale` (absent: 0) the trained tokens handed out "
            "masked for their own lag, `lag_tokens` Σ each trained token's own lag (absent: "
            "`tokens` × the sample's lag). `sums` let totals be "
            "aggregated exactly: `kl_sum` is Σ per-token KL over `kl_tokens` measured tokens "
            "(a ready-made per-rollout `kl` counts as `kl × tokens`); `ratio_sum` is Σ r over "
            "`ratio_tokens` tokens, of which `clipped` were outside `[1-ε, 1+ε]`. The ack "
            "script gates on the same `kl` values (a unit above `kl_max` retires), so the gate "
            "and the accounting read one record",
        ),
        EventType("nacked", Returned, "leased → buffered, no use"),
        EventType(
            "expired",
            Returned,
            "leased → buffered, no use (lease ran out, or a rewind ended a lease taken at a "
            "version above the one it went back to)",
        ),
        EventType(
            "retired",
            Retired,
            "buffered → gone. Reasons: `stale`, `max_reuse`, `kl`, `kl_flush`, "
            "`incomplete_group`, `zero_variance`, `run_closed`, `rewound` (a token sampled "
            "above the version a rewind went back to), `reward_timeout`, `quarantined` (a "
            "rollout of a quarantined generator, or of its group). `uses == 0` means the "
            "tokens were wasted; `unscored` says where a rollout still awaiting its reward was",
        ),
        EventType(
            "rewound",
            Rewound,
            "the run's version went back from `from_version` to `to_version` (`W`): each "
            "item is a use of an acknowledged batch acked above `W` given back to its rollout "
            "(counts `samples_rewound`; `samples_consumed` keeps it), and each batch of "
            "`batches` is marked rewound. The rewind's other changes are in their own events: "
            "`expired` (trainer leases taken above `W`), `retired` `rewound`, `passes` "
            "`rewound`, `run` `policy`",
        ),
        EventType(
            "registered",
            Registered,
            "new prompts (repeats of a known `prompt_id` are not recorded): each pass "
            "1..`passes` queued at attempt 1",
        ),
        EventType(
            "work_leased",
            WorkLeased,
            "prompt passes handed to a generator: each item is `in_flight` at its attempt",
        ),
        EventType(
            "passes",
            PassesChanged,
            "prompt passes changed state. A pass's states are ordered by (attempt, state): "
            "`queued` < `in_flight` < `done`/`failed` within an attempt, and a later attempt "
            "comes after every state of an earlier one, so the newest state is the greatest "
            "whatever order entries are applied in",
        ),
        EventType(
            "partials",
            PartialsChanged,
            'partial rollouts of prompt passes (SPEC "Partial rollouts") came, went out with '
            "a work lease, or were dropped; a rollout posted complete in place of one is in "
            "`accepted`",
        ),
        EventType(
            "reward_leased",
            RewardLeased,
            "rollouts awaiting their reward handed to a reward worker: each item awaiting → "
            "reward-leased",
        ),
        EventType(
            "scored",
            Scored,
            "rollouts got their reward (`POST .../rewards`; not those posted with one): each "
            "item reward-leased (`leased` 1) or awaiting (0) → scored; `wait_ms` is summed in "
            "`wait.reward_s` and observed in the reward-latency histogram",
        ),
        EventType(
            "reward_expired",
            RewardExpired,
            "a reward lease ran out: each unscored item reward-leased → awaiting, one more "
            "`timed_out`; one at `max_reward_attempts` then retires `reward_timeout` (a "
            "`retired` event follows)",
        ),
        EventType(
            "reward_returned",
            RewardReturned,
            "a reward worker gave rollouts back unscored: each item reward-leased → awaiting",
        ),
        EventType(
            "generator",
            GeneratorChanged,
            "a generator was quarantined (`quarantined` 1; its buffered rollouts retire "
            "`quarantined`, a `retired` event follows) or released (0)",
        ),
        EventType(
            "consumers",
            ConsumersChanged,
            "a consumer was created (its row, all 0), or a call changed consumers' counts "
            "(deliveries, acks, drops, a deletion): per consumer, what it added; "
            "`pending = delivered − acked − dropped` sums to the items pending or in live leases",
        ),
        EventType(
            "prompt_scored",
            PromptScored,
            "the group of a prompt pass's attempt is complete with every reward in (at the "
            "post that completed it, or at its last score): the prompt's newest mean reward, "
            "which sorts it into a `difficulty` pool",
        ),
        EventType(
            "waited",
            Waited,
            "a long poll that waited and got nothing (time of one that got something is in "
            "its `leased` or `work_leased` event)",
        ),
    )
}

EVENT_TYPES = frozenset(SCHEMA)


# --- the codec, derived from the declaration -------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Field:
    attr: str
    key: str
    wire: Wire
    default: Any  # when absent on the wire
    read: Callable[[Any, str], Any]


def _reader(w: Wire) -> Callable[[Any, str], Any]:
    kind = w.kind
    if kind == "text":
        return read_text
    if kind == "int":
        minimum = w.minimum
        return lambda value, what: read_int(value, what, minimum=minimum)
    if kind == "float":
        return read_float
    if kind == "flag":
        return read_flag
    if kind == "map":
        return lambda value, what: read_json(read_opt_map(value, what), what)
    if kind == "texts":
        return lambda value, what: tuple(
            read_text(v, f"{what}[{i}]") for i, v in enumerate(read_array(value, what))
        )
    assert w.of is not None, "items and struct name their class"
    of = w.of
    if kind == "items":
        return lambda value, what: _read_items(of, value, what)
    return lambda value, what: of(**_read_map(of, read_opt_map(value, what), f"{what}."))


_FIELDS: dict[type, tuple[_Field, ...]] = {}


def _fields(cls: type) -> tuple[_Field, ...]:
    known = _FIELDS.get(cls)
    if known is not None:
        return known
    out = []
    for f in dataclasses.fields(cls):
        w = f.metadata["wire"]
        default = None if f.default is dataclasses.MISSING else f.default
        out.append(_Field(f.name, w.key or f.name, w, default, _reader(w)))
    _FIELDS[cls] = result = tuple(out)
    return result


def _arity(cls: type) -> tuple[int, int]:
    """Positions of an item array, and how many of them (the leading ones) are required."""
    fields = _fields(cls)
    required = next((i for i, f in enumerate(fields) if f.wire.optional), len(fields))
    if any(not f.wire.optional for f in fields[required:]):
        raise TypeError(f"{cls.__name__}: only trailing item positions may be optional")
    return len(fields), required


def _read_map(cls: type, d: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    values = {}
    for f in _fields(cls):
        raw = d.get(f.key)
        if raw is None and f.wire.optional:
            values[f.attr] = f.default
        else:
            values[f.attr] = f.read(raw, prefix + f.key)
    return values


def _read_items(cls: type, value: Any, what: str) -> tuple[Any, ...]:
    """Fixed-position item arrays, where trailing optional positions may have been dropped."""
    fields = _fields(cls)
    arity, required = _arity(cls)
    items = []
    for i, raw in enumerate(read_array(value, what)):
        row = read_array(raw, f"{what}[{i}]")
        if not required <= len(row) <= arity:
            raise EventError(f"{what}[{i}]: expected {arity} fields, got {len(row)}")
        items.append(
            cls(
                *(
                    f.read(row[p], f"{what}[{i}].{f.key}")
                    if p < len(row) and (row[p] is not None or not f.wire.optional)
                    else f.default
                    for p, f in enumerate(fields)
                )
            )
        )
    return tuple(items)


def decode_payload(event_type: str, d: Mapping[str, Any]) -> Payload:
    """The payload (the unpacked ``d`` of an entry) of an event of type ``event_type``."""
    spec = SCHEMA.get(event_type)
    if spec is None:
        raise EventError(f"unknown event type {event_type!r}")
    if spec.prepare is not None:
        d = spec.prepare(d)
    body: Payload = spec.body(**_read_map(spec.body, d, ""))
    return body


def decode_entry(run_id: str, entry_id: bytes | str, fields: Mapping[bytes, bytes]) -> Event:
    """Decode one stream entry (fields ``e`` and ``d``) of run ``run_id``."""
    stream_id = StreamId.parse(entry_id)
    raw_type = fields.get(b"e")
    raw_payload = fields.get(b"d")
    if raw_type is None or raw_payload is None:
        raise EventError("entry lacks field 'e' or 'd'")
    event_type = read_text(raw_type, "e")
    if event_type not in SCHEMA:
        raise EventError(f"unknown event type {event_type!r}")
    try:
        payload = msgpack.unpackb(raw_payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise EventError(f"payload is not msgpack: {exc}") from None
    payload = read_map(payload, "d")
    body = decode_payload(event_type, payload)
    if isinstance(body, RunChanged) and body.run_id != run_id:
        raise EventError("run event of another run")
    return Event(
        run_id=run_id,
        stream_id=stream_id,
        type=event_type,
        t_ms=read_int(payload.get("t"), "t", minimum=0),
        body=body,
    )


def _write(f: _Field, value: Any) -> Any:
    kind = f.wire.kind
    if kind == "int":
        return int(value)
    if kind == "float":
        return float(value)
    if kind == "flag":
        return 1 if value else 0
    if kind == "map":
        return dict(value)
    if kind == "texts":
        return list(value)
    if kind == "items":
        assert f.wire.of is not None
        return [_write_item(f.wire.of, item) for item in value]
    if kind == "struct":
        return _write_map(value)
    return value


def _write_item(cls: type, item: Any) -> list[Any]:
    fields = _fields(cls)
    row = [None if v is None else _write(f, v) for f in fields for v in [getattr(item, f.attr)]]
    # What Lua does with a trailing nil: drops it; a trailing optional position at its default
    # goes too (the scripts leave such positions out).
    while row and (
        row[-1] is None
        or (
            fields[len(row) - 1].wire.optional
            and _at_default(fields[len(row) - 1], getattr(item, fields[len(row) - 1].attr))
        )
    ):
        row.pop()
    return row


def _at_default(f: _Field, value: Any) -> bool:
    return f.default is not None and value == f.default


def _write_map(obj: Any) -> dict[str, Any]:
    out = {}
    for f in _fields(type(obj)):
        value = getattr(obj, f.attr)
        if value is None:
            continue  # a Lua table holds no nil
        if f.wire.optional and value == () and f.default == ():
            continue  # an optional list left empty: the scripts leave it out
        written = _write(f, value)
        if f.wire.kind == "struct" and not written:
            continue  # an empty Lua table is packed as an array: leave the map out
        if f.wire.kind == "items" and f.wire.optional and not written:
            continue  # an optional list with nothing in it is absent
        out[f.key] = written
    return out


def encode_payload(event_type: str, body: Payload, *, t_ms: int | None = None) -> dict[str, Any]:
    """The payload map of an event, as the Lua scripts write it; ``t`` only when given (the
    script that records an event built here adds its own)."""
    spec = SCHEMA.get(event_type)
    if spec is None or not isinstance(body, spec.body):
        raise TypeError(f"{type(body).__name__} is not the payload of {event_type!r} events")
    payload = _write_map(body)
    if t_ms is not None:
        payload["t"] = t_ms
    return payload


def pack_payload(event_type: str, body: Payload, *, t_ms: int | None = None) -> bytes:
    """:func:`encode_payload`, packed as the entry's ``d``."""
    packed: bytes = msgpack.packb(encode_payload(event_type, body, t_ms=t_ms), use_bin_type=True)
    return packed


def encode_entry(event_type: str, body: Payload, *, t_ms: int) -> dict[bytes, bytes]:
    """The fields ``e`` and ``d`` of a stream entry."""
    return {b"e": event_type.encode("ascii"), b"d": pack_payload(event_type, body, t_ms=t_ms)}


# --- the docs' table -------------------------------------------------------------------------


def _describe(f: _Field) -> str:
    text = f"`{f.key}`"
    if f.wire.kind in ("items", "struct"):
        assert f.wire.of is not None
        names = [g.key + ("?" if g.wire.optional else "") for g in _fields(f.wire.of)]
        if f.wire.kind == "items":
            text += ": `[" + ", ".join(names) + "]`"
        else:
            text += ": `{" + ", ".join(g.key for g in _fields(f.wire.of)) + "}`"
    return text + (f" ({f.wire.note})" if f.wire.note else "")


def markdown_table() -> str:
    """The "Types" table of docs/events.md."""
    lines = ["| `e` | payload (`d`) | the change |", "|---|---|---|"]
    for spec in SCHEMA.values():
        payload = ", ".join(_describe(f) for f in _fields(spec.body))
        lines.append(f"| `{spec.name}` | {payload} | {spec.change} |")
    return "\n".join(lines) + "\n"


def _check(cls: type) -> None:
    """Every payload field is declared, and only trailing item positions are optional."""
    for f in _fields(cls):
        if f.wire.kind in ("items", "struct"):
            assert f.wire.of is not None
            _check(f.wire.of)
            if f.wire.kind == "items":
                _arity(f.wire.of)


for _spec in SCHEMA.values():
    _check(_spec.body)
