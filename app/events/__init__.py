"""The accounting event schema (docs/events.md) and its codec: one declaration per event type,
from which the decoder, the encoder and the table of docs/events.md are all derived.

The payload classes below *are* the declaration. Each attribute's ``wire(...)`` gives its kind,
its key on the wire, whether it may be absent and its line in the docs; the attributes of an
item class, in order, are the positions of its fixed-position array. Adding a field is one edit
here (``python -m app.events --markdown`` then prints the docs' table; a test checks
that docs/events.md shows it, and another runs the Lua scripts and checks every entry they write
against this schema).

Decoding is strict about meaning and lenient about encoding: Redis's Lua msgpack encoder writes
whole floats as integers, drops trailing nils from arrays and may turn an array with a hole into
a map keyed 1..n, so all of those are accepted. Anything that cannot be applied safely (a wrong
type, a non-finite float, an integer outside int64) raises :class:`EventError`, which never
succeeds on a retry and so leads the entry to the dead-letter stream.

Encoding writes what the Lua scripts write: an absent value is left out (an optional map key,
a trailing optional item position, a map with nothing in it), flags are 0/1.
"""

from app.events.codec import (
    EVENT_TYPES,
    SCHEMA,
    EventType,
    decode_entry,
    decode_payload,
    encode_entry,
    encode_payload,
    markdown_table,
    pack_payload,
)
from app.events.payloads import (
    MAX_TEXT,
    Accepted,
    AcceptedItem,
    Acked,
    AckedItem,
    AckStats,
    AckSums,
    Duplicate,
    Event,
    EventError,
    Leased,
    LeasedItem,
    PartialItem,
    PartialsChanged,
    PassesChanged,
    PassItem,
    Payload,
    Registered,
    RegisteredItem,
    Rejected,
    RejectedItem,
    Retired,
    RetiredItem,
    Returned,
    ReturnedItem,
    Rewound,
    RewoundItem,
    RunChanged,
    StreamId,
    Waited,
    WorkItem,
    WorkLeased,
    lag_of,
    text_fault,
)

__all__ = [
    "EVENT_TYPES",
    "MAX_TEXT",
    "SCHEMA",
    "Accepted",
    "AcceptedItem",
    "AckStats",
    "AckSums",
    "Acked",
    "AckedItem",
    "Duplicate",
    "Event",
    "EventError",
    "EventType",
    "Leased",
    "LeasedItem",
    "PartialItem",
    "PartialsChanged",
    "PassItem",
    "PassesChanged",
    "Payload",
    "Registered",
    "RegisteredItem",
    "Rejected",
    "RejectedItem",
    "Retired",
    "RetiredItem",
    "Returned",
    "ReturnedItem",
    "Rewound",
    "RewoundItem",
    "RunChanged",
    "StreamId",
    "Waited",
    "WorkItem",
    "WorkLeased",
    "decode_entry",
    "decode_payload",
    "encode_entry",
    "encode_payload",
    "lag_of",
    "markdown_table",
    "pack_payload",
    "text_fault",
]
