"""Facts of the wire protocol that the broker and its clients must agree on.

The server imports them from here too, so there is one definition of each.
"""

from __future__ import annotations

import uuid

__all__ = ["JSON", "MAX_TOKEN_ID", "MSGPACK", "MSGPACK_TYPES", "new_run_id"]

JSON = "application/json"
MSGPACK = "application/msgpack"
# The content types accepted as msgpack: the registered one first, then two in common use.
MSGPACK_TYPES = (MSGPACK, "application/x-msgpack", "application/vnd.msgpack")

# Token ids travel as int32 in binary bodies and are stored as such.
MAX_TOKEN_ID = 2**31 - 1


def new_run_id() -> str:
    """A fresh run id. Run ids never contain ':' (it delimits Redis keys around the hash tag)."""
    return f"run-{uuid.uuid4().hex[:12]}"
