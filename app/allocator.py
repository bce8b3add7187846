"""glibc's allocator, for a process that moves megabytes per request.

A lease of large rollouts builds answers of megabytes and an ack parses as many; with glibc's
defaults each such buffer is a fresh ``mmap`` (allocations above its threshold), unmapped when
freed, so the next request touches new pages again: thousands of page faults per request, and
more kernel time than the request's own work (measured on lease + ack of 32,768-token
rollouts). :func:`keep_freed_pages` makes buffers below ``MMAP_THRESHOLD_BYTES`` come from the
heap and keeps up to ``keep_bytes`` of freed heap for the next requests; :func:`release` still
gives everything free back after a big body (``app.api.codec.sized_call``).

Both do nothing where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Final

__all__ = ["MMAP_THRESHOLD_BYTES", "keep_freed_pages", "release"]

# mallopt(3) parameters.
_M_TRIM_THRESHOLD: Final = -1
_M_TOP_PAD: Final = -2
_M_MMAP_THRESHOLD: Final = -3

MMAP_THRESHOLD_BYTES: Final = 32 * 1024 * 1024
"""glibc's largest mmap threshold on 64-bit systems: smaller buffers come from the heap."""


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt  # noqa: B018 - glibc's, absent from other C libraries
        libc.malloc_trim  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()


def keep_freed_pages(keep_bytes: int) -> bool:
    """Keep up to ``keep_bytes`` of freed memory for the next requests instead of returning
    it to the OS, and serve buffers up to :data:`MMAP_THRESHOLD_BYTES` from it; 0 leaves
    glibc's defaults. Process-wide; True when applied."""
    if _LIBC is None or keep_bytes <= 0:
        return False
    mallopt: Callable[[int, int], int] = _LIBC.mallopt
    return all(
        mallopt(param, value) == 1
        for param, value in (
            (_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
            (_M_TRIM_THRESHOLD, keep_bytes),
            (_M_TOP_PAD, min(keep_bytes, 16 * 1024 * 1024)),
        )
    )


def release() -> None:
    """Give every freed page back to the OS (glibc's ``malloc_trim(0)``)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
