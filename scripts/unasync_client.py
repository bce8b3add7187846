"""Generate the blocking client, ``clients/python/rollout_broker_client/_sync.py``, from the
asyncio one, ``_async.py`` beside it.

``_async.py`` is the source: change it, then run ``python scripts/unasync_client.py`` (or
``--check`` to only report whether ``_sync.py`` is up to date; it exits 1 when it is not).

Code is converted by `unasync <https://github.com/python-trio/unasync>`_: ``async``/``await``
are dropped and the names in :data:`NAMES` renamed (besides unasync's own table:
``__aenter__`` → ``__enter__``, ``__aexit__`` → ``__exit__``, ...). Docstrings and comments are
then converted by :data:`PROSE` and the class names of :data:`NAMES`. Every rule must still
apply, so a change to ``_async.py`` that leaves one stale fails here instead of generating a
wrong ``_sync.py``.
"""

from __future__ import annotations

import io
import re
import sys
import tempfile
import tokenize
from pathlib import Path

import unasync  # type: ignore[import-untyped]

ROOT = Path(__file__).resolve().parents[1]
CLIENT = ROOT / "clients" / "python" / "rollout_broker_client"
ASYNC_PY = CLIENT / "_async.py"
SYNC_PY = CLIENT / "_sync.py"

HEADER = (
    "# Generated from _async.py by scripts/unasync_client.py. Do not edit by hand:\n"
    "# change _async.py and run `python scripts/unasync_client.py`.\n"
)

# Names renamed in code, on top of unasync's defaults.
NAMES = {
    "AsyncBrokerClient": "BrokerClient",
    "AsyncRolloutWriter": "RolloutWriter",
    "AsyncLeasedBatch": "LeasedBatch",
    "AsyncLease": "Lease",
    "AsyncWork": "Work",
    "AsyncWorkLoop": "WorkLoop",
    "_AsyncLeaseLoop": "_LeaseLoop",
    "_AsyncHeld": "_Held",
    "AsyncRewardWork": "RewardWork",
    "AsyncRewardLoop": "RewardLoop",
    "AsyncConsumer": "Consumer",
    "AsyncConsumerLease": "ConsumerLease",
    "AsyncConsumerLoop": "ConsumerLoop",
    "AsyncClient": "Client",  # httpx.AsyncClient
    "aclose": "close",
    "asyncio": "time",  # asyncio.sleep
}

# Lines of _async.py left out of _sync.py (``time`` is imported already).
ASYNC_ONLY_LINES = ("import asyncio\n",)

# Code of the generated file put back in ruff's import order after renaming, applied in order.
CODE = (
    (
        "from collections.abc import Iterator, Iterable,",  # from AsyncIterator
        "from collections.abc import Iterable, Iterator,",
    ),
)

# The names of NAMES also renamed in docstrings and comments (whole words).
PROSE_NAMES = (
    "AsyncBrokerClient",
    "AsyncRolloutWriter",
    "AsyncLeasedBatch",
    "AsyncLease",
    "AsyncWorkLoop",
    "AsyncWork",
    "AsyncRewardWork",
    "AsyncRewardLoop",
    "AsyncConsumer",
    "AsyncConsumerLease",
    "AsyncConsumerLoop",
    "AsyncClient",
)

# Docstring and comment text of _async.py and what it reads in _sync.py, applied in order.
PROSE = (
    (
        "The asyncio client: :class:`AsyncBrokerClient`; for generators its"
        " :class:`AsyncRolloutWriter`\nand the :class:`AsyncWorkLoop` of :class:`AsyncWork`"
        " leases, for trainers :class:`AsyncLease`.\nSame surface as the blocking client, every"
        " call awaited.",
        "The blocking client: :class:`BrokerClient`; for generators its :class:`RolloutWriter`"
        " and the\n:class:`WorkLoop` of :class:`Work` leases, for trainers :class:`Lease`.",
    ),
    ("An asyncio client of one broker.", "A blocking client of one broker."),
    (
        """\
so it
    can reach an app in this process through ``httpx.ASGITransport``, which runs no lifespan::

        app = create_app(settings)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as http:
                broker = AsyncBrokerClient(http=http)
""",
        """\
so it can
    reach an app in this process through :class:`SyncASGITransport`::

        with SyncASGITransport(create_app(settings)) as transport:    # runs the lifespan
            http = httpx.Client(transport=transport, base_url="http://localhost")
            broker = BrokerClient(http=http)
""",
    ),
    ("an async context manager", "a context manager"),
    ("``async with", "``with"),
    ("``async for", "``for"),
)


def _unasync_code(source: str) -> str:
    """``source`` through unasync with :data:`NAMES` (unasync reads and writes files)."""
    rule = unasync.Rule("/_async.py", "/_sync.py", additional_replacements=NAMES)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "_async.py")
        src.write_text(source, encoding="utf-8")
        unasync.unasync_files([str(src)], (rule,))
        return Path(tmp, "_sync.py").read_text(encoding="utf-8")


def _convert_prose(source: str) -> str:
    """Apply :data:`PROSE` and :data:`PROSE_NAMES` to the strings and comments of ``source``."""
    lines = source.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    spans = [
        (starts[tok.start[0] - 1] + tok.start[1], starts[tok.end[0] - 1] + tok.end[1])
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type in (tokenize.STRING, tokenize.COMMENT)
    ]
    names = re.compile(r"\b(" + "|".join(PROSE_NAMES) + r")\b")
    used = [False] * len(PROSE)
    out: list[str] = []
    done = 0
    for begin, end in spans:
        text = source[begin:end]
        for i, (old, new) in enumerate(PROSE):
            if old in text:
                used[i] = True
                text = text.replace(old, new)
        text = names.sub(lambda m: NAMES[m.group(1)], text)
        out += [source[done:begin], text]
        done = end
    out.append(source[done:])
    stale = [old for (old, _), hit in zip(PROSE, used, strict=True) if not hit]
    if stale:
        raise ValueError(f"text no longer in {ASYNC_PY.name}, update PROSE: {stale!r}")
    return "".join(out)


def generate(source: str) -> str:
    """The text of ``_sync.py`` for ``source``, the text of ``_async.py``."""
    for line in ASYNC_ONLY_LINES:
        if source.count(line) != 1:
            raise ValueError(f"{line!r} is not once in {ASYNC_PY.name}, update ASYNC_ONLY_LINES")
        source = source.replace(line, "")
    code = _unasync_code(source)
    for old, new in CODE:
        if code.count(old) != 1:
            raise ValueError(f"{old!r} is not once in the generated code, update CODE")
        code = code.replace(old, new)
    return HEADER + _convert_prose(code)


def main(argv: list[str]) -> int:
    check = argv == ["--check"]
    if argv and not check:
        print(f"usage: {Path(__file__).name} [--check]", file=sys.stderr)
        return 2
    text = generate(ASYNC_PY.read_text(encoding="utf-8"))
    current = SYNC_PY.read_text(encoding="utf-8") if SYNC_PY.exists() else None
    if text == current:
        return 0
    if check:
        print(f"{SYNC_PY.relative_to(ROOT)} is out of date; run {Path(__file__).name}")
        return 1
    SYNC_PY.write_text(text, encoding="utf-8")
    print(f"wrote {SYNC_PY.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
