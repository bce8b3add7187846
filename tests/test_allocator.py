"""``app.allocator``: with freed pages kept, requests of megabytes stop faulting in fresh pages
each time. Counted in page faults (getrusage), not timed; each case in a process of its own,
since the setting is process-wide."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from app import allocator

ROOT = Path(__file__).resolve().parent.parent

# Buffers of the sizes a lease of long rollouts makes: arrays, their bytes, a body.
WORKLOAD = """
import resource, sys
import numpy as np
from app import allocator
applied = allocator.keep_freed_pages(int(sys.argv[1]))
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
start = faults()
for _ in range(40):
    a = np.ones(3 << 20, dtype=np.float32)
    b = a.tobytes()
    c = bytearray(5 << 20)
    c[::4096] = b"x" * len(c[::4096])
    del a, b, c
print(applied, faults() - start)
"""


def faults_with(keep_bytes: int) -> tuple[bool, int]:
    done = subprocess.run(
        [sys.executable, "-c", WORKLOAD, str(keep_bytes)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    applied, faults = done.stdout.split()
    return applied == "True", int(faults)


@pytest.mark.skipif(allocator._LIBC is None, reason="the C library is not glibc")
def test_kept_pages_spare_the_page_faults_of_megabyte_buffers():
    applied, kept = faults_with(64 << 20)
    untouched, default = faults_with(0)
    assert applied and not untouched
    # 40 rounds of 29 MiB: glibc's defaults map and unmap most of them every round.
    assert default > 40 * 1024
    assert kept * 10 < default, (kept, default)
