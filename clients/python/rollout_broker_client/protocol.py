"""Facts of the wire protocol that the broker and its clients must agree on.

The server imports them from here too, so there is one definition of each.
"""

from __future__ import annotations

import re
import uuid
from urllib.parse import urlsplit, urlunsplit

__all__ = [
    "JSON",
    "MAX_TOKEN_ID",
    "MSGPACK",
    "MSGPACK_TYPES",
    "RUN_ID_PATTERN",
    "base_url_of",
    "is_run_id",
    "new_run_id",
    "token_id_of",
]

JSON = "application/json"
MSGPACK = "application/msgpack"
# The content types accepted as msgpack: the registered one first, then two in common use.
MSGPACK_TYPES = (MSGPACK, "application/x-msgpack", "application/vnd.msgpack")

# Token ids travel as int32 in binary bodies and are stored as such.
MAX_TOKEN_ID = 2**31 - 1

# Run ids end up in Redis key names and in the ledger: printable, no spaces, bounded. A run id
# is a URL path segment: '.' and '..' would resolve away (a non-dot first, a non-dot second, or
# three characters or more).
RUN_ID_PATTERN = (
    r"^(?:[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}|\.[A-Za-z0-9_-][A-Za-z0-9._-]{0,126}"
    r"|\.\.[A-Za-z0-9._-]{1,126})$"
)
_RUN_ID = re.compile(RUN_ID_PATTERN)
# A whole token reads rb_<token_id>_<secret>; only its id may go into a URL.
_FULL_TOKEN = re.compile(r"^rb_([0-9a-f]{16})_.+$")


def new_run_id() -> str:
    """A fresh run id. Run ids never contain ':' (it delimits Redis keys around the hash tag)."""
    return f"run-{uuid.uuid4().hex[:12]}"


def is_run_id(value: str) -> bool:
    """Whether the broker accepts ``value`` as a run id (``RUN_ID_PATTERN``, the whole string)."""
    return _RUN_ID.fullmatch(value) is not None


def token_id_of(token_id: str) -> str:
    """``token_id`` itself, or the id part of a whole token ``rb_<token_id>_<secret>``, so
    that a secret passed by mistake never goes into a URL (and from there into logs)."""
    m = _FULL_TOKEN.match(token_id)
    return m.group(1) if m else token_id


def base_url_of(url: str) -> str:
    """``url`` as a client's base URL, without a trailing slash. ValueError for one whose path
    ends in ``/v1``, the API's prefix, which the client adds itself (its requests would go to
    ``/v1/v1/...`` and meet a bare 404), or that has a query or a fragment (the client appends
    each request's path to the base). A string that is no URL at all is left to httpx, which
    says so at the first request."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url.rstrip("/")
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        base = urlunsplit(parts._replace(path=path.removesuffix("/v1")))
        raise ValueError(
            f"{url} ends in /v1, the API's prefix: give the broker's base URL without it, {base}"
        )
    if parts.query or parts.fragment:
        base = urlunsplit(parts._replace(path=path, query="", fragment=""))
        raise ValueError(
            f"{url} has a query or a fragment, to which each request's path would be appended: "
            f"give the broker's base URL alone, {base}"
        )
    return url.rstrip("/")
