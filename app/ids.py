"""The identifiers and numbers every domain shares, and the bounds each obeys: run, item, prompt
and lease ids (printable, no spaces, bounded, and texts the ledger can hold) and versions."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, StringConstraints
from rollout_broker_client.protocol import RUN_ID_PATTERN

from app.events import text_fault

__all__ = [
    "CONSUMER_NAME_PATTERN",
    "ID_EXCLUDED",
    "ITEM_ID_PATTERN",
    "LEASE_ID_PATTERN",
    "MAX_VERSION",
    "PROMPT_ID_PATTERN",
    "RUN_ID_PATTERN",
    "ConsumerName",
    "ItemId",
    "LeaseId",
    "LedgerText",
    "PromptId",
    "RunId",
]

# Versions and lags are exact doubles inside Redis's Lua: stay within 2**53.
MAX_VERSION = 2**53 - 1


def _ledger_text(value: str) -> str:
    """An id the scripts record must be one the accounting drain can apply: the ledger's own
    text rule (app/events/), checked here on top of each id's pattern, so a
    pattern widened later cannot let through an id that would be dead-lettered."""
    fault = text_fault(value)
    if fault is not None:
        raise ValueError(fault)
    return value


LedgerText = AfterValidator(_ledger_text)

# Ids end up in Redis key names and in the ledger: printable, no spaces, bounded. The run id's
# pattern (RUN_ID_PATTERN) is the client's protocol: its command line checks ids before any
# request.
# Not in an id: control characters (Unicode Cc), format characters (Cf: the bidi controls,
# zero-width characters, the soft hyphen, invisible tags, which make an id look like another
# where it is shown), braces (Redis hash tags) and whitespace. Whitespace is spelled out rather
# than written \s, whose meaning differs between the regex engines that read these patterns:
# ECMA-262's (OpenAPI clients, JSON Schema) counts U+FEFF and not U+0085, Python's and Rust's
# (pydantic) the other way round; this is the union, so every reader admits the same ids. The
# format characters are those of Unicode 14 (tests/api/test_openapi.py compares them with the
# running Python's tables).
# Those beyond U+FFFF are written as themselves (an escape of them has no spelling Python's,
# Rust's and ECMA-262's engines all read), each alone: ECMA-262 without Unicode mode reads each as
# two UTF-16 units, and a range of them would not compile there.
# Texts the ledger already holds are not bound by this: the drain applies text_fault() alone.
_FORMAT_BEYOND_BMP = (0x110BD, 0x110CD, *range(0x13430, 0x13439), *range(0x1BCA0, 0x1BCA4))
_FORMAT_BEYOND_BMP += (*range(0x1D173, 0x1D17B), 0xE0001, *range(0xE0020, 0xE0080))
ID_EXCLUDED = (
    r"\x00-\x20\x7f-\xa0\xad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u1680\u180e"
    r"\u2000-\u200f\u2028-\u202f\u205f-\u2064\u2066-\u206f\u3000\ufeff\ufff9-\ufffb{}"
) + "".join(map(chr, _FORMAT_BEYOND_BMP))
ITEM_ID_PATTERN = rf"^[^{ID_EXCLUDED}]{{1,256}}$"
PROMPT_ID_PATTERN = rf"^[^{ID_EXCLUDED}]{{1,200}}$"
LEASE_ID_PATTERN = r"^[A-Za-z0-9_-]{8,64}$"
# Consumers' names end up in Redis key names and in metric labels: short and plain.
CONSUMER_NAME_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
RunId = Annotated[str, StringConstraints(pattern=RUN_ID_PATTERN), LedgerText]
# Rollout, group, trainer and generator ids.
ItemId = Annotated[str, StringConstraints(pattern=ITEM_ID_PATTERN), LedgerText]
# A prompt's group ids are '<prompt_id>#<pass>.<attempt>': an ItemId whatever the numbers.
PromptId = Annotated[str, StringConstraints(pattern=PROMPT_ID_PATTERN), LedgerText]
# Client-chosen ids of batches and work leases, which make their calls safe to retry.
LeaseId = Annotated[str, StringConstraints(pattern=LEASE_ID_PATTERN), LedgerText]
ConsumerName = Annotated[str, StringConstraints(pattern=CONSUMER_NAME_PATTERN)]
