"""Load generators, each run in its own process: generators, trainers and raw-Redis clients.

Every loop is bounded twice, by a number of operations and by a deadline, and stops by itself.
Processes are forked, meet at a barrier, and report (operations, rollouts, start, end,
latencies); start and end are ``time.perf_counter()`` (CLOCK_MONOTONIC, one clock for all
processes), so the rate of a group is its rollouts over the span from first start to last end.

The loads of the work leases are in ``load_prompts.py``; a load that one section alone uses lives
beside it (the big body in ``sections/bodies.py``, the on/off alternation in ``pairs.py``).
"""

from __future__ import annotations

import contextlib
import http.client
import multiprocessing as mp
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import orjson
import redis

from benchmarks.payloads import (
    CONTENT_TYPE,
    TOKENS,
    ack_body,
    ingest_body,
    make_payload,
    rollout_id,
)

Address = tuple[str, int]


@dataclass
class Result:
    ops: int = 0
    rollouts: int = 0  # items moved: rollouts, or prompts for the work-lease loads
    t0: float = 0.0
    t1: float = 0.0
    lat: list[float] = field(default_factory=list)  # seconds, one per measured operation
    empty: int = 0  # leases answered 204


@dataclass
class Group:
    results: list[Result]

    @property
    def rollouts(self) -> int:
        return sum(r.rollouts for r in self.results)

    @property
    def ops(self) -> int:
        return sum(r.ops for r in self.results)

    @property
    def span(self) -> float:
        return max(r.t1 for r in self.results) - min(r.t0 for r in self.results)

    @property
    def rate(self) -> float:
        return self.rollouts / self.span if self.span > 0 else 0.0

    @property
    def latencies(self) -> list[float]:
        return [x for r in self.results for x in r.lat]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]


class Http:
    """One keep-alive HTTP/1.1 connection with Nagle off, as lean as a client can be; with a
    ``token``, every request carries ``Authorization: Bearer <token>``."""

    def __init__(self, address: Address, token: str | None = None) -> None:
        self.conn = http.client.HTTPConnection(*address, timeout=120)
        self.conn.connect()
        assert self.conn.sock is not None
        self.conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.auth = {"authorization": f"Bearer {token}"} if token else {}

    def call(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        content_type: str | None = None,
        accept: str | None = None,
    ) -> tuple[int, bytes, str]:
        headers = dict(self.auth)
        if content_type:
            headers["content-type"] = content_type
        if accept:
            headers["accept"] = accept
        self.conn.request(method, path, body=body, headers=headers)
        resp = self.conn.getresponse()
        data = resp.read()
        return resp.status, data, resp.getheader("content-type") or ""

    def close(self) -> None:
        self.conn.close()


def expect(status: int, data: bytes, *ok: int) -> None:
    if status not in ok:
        raise RuntimeError(f"HTTP {status}: {data[:300]!r}")


# -- the workers ----------------------------------------------------------------------------
def timed_writes(
    write: Callable[[], int], *, duration: float, max_ops: int, barrier: Any
) -> Result:
    """Call ``write`` (which returns the rollouts it wrote) until ``duration`` or ``max_ops``,
    starting together with the other load processes."""
    res = Result()
    barrier.wait()
    res.t0 = time.perf_counter()
    deadline = res.t0 + duration
    while res.ops < max_ops and time.perf_counter() < deadline:
        res.rollouts += write()
        res.ops += 1
    res.t1 = time.perf_counter()
    return res


def http_ingest(
    *,
    address: Address,
    path: str,
    fmt: str,
    per_req: int,
    tag: str,
    worker: int,
    duration: float,
    max_ops: int,
    warmup: int = 2,
    token: str | None = None,
    tokens: int = TOKENS,
    barrier: Any,
) -> Result:
    """A generator posting ``per_req`` rollouts of ``tokens`` tokens per request (``fmt`` json
    or msgpack)."""
    http, post = ingest_poster(
        address=address,
        path=path,
        fmt=fmt,
        per_req=per_req,
        tag=tag,
        worker=worker,
        token=token,
        tokens=tokens,
    )
    for _ in range(warmup):
        post()
    res = timed_writes(post, duration=duration, max_ops=max_ops, barrier=barrier)
    http.close()
    return res


def ingest_poster(
    *,
    address: Address,
    path: str,
    fmt: str,
    per_req: int,
    tag: str,
    worker: int,
    token: str | None = None,
    tokens: int = TOKENS,
    segments: int = 0,
) -> tuple[Http, Callable[[], int]]:
    """A connection, and a call posting the next ``per_req`` rollouts on it (returns them);
    with ``segments``, multi-turn rollouts with a loss mask and per-token versions."""
    payload = make_payload(tokens=tokens, segments=segments)
    http = Http(address, token)
    ctype = CONTENT_TYPE[fmt]
    seq = 0

    def post() -> int:
        nonlocal seq
        items = [payload.item(fmt, rollout_id(tag, worker, seq + i)) for i in range(per_req)]
        seq += per_req
        status, data, _ = http.call("POST", path, ingest_body(fmt, items), ctype)
        expect(status, data, 202)
        return per_req

    return http, post


def naive_ingest(
    *,
    address: Address,
    tag: str,
    worker: int,
    duration: float,
    max_ops: int,
    tokens: int = TOKENS,
    barrier: Any,
    path: str = "/rollouts",
) -> Result:
    """A generator of the naive buffer: one JSON rollout per request (to ``path``: the durable
    floor's is ``/_floor/rollouts``)."""
    payload = make_payload(tokens=tokens)
    http = Http(address)
    seq = 0

    def post() -> int:
        nonlocal seq
        b = payload.json_item(rollout_id(tag, worker, seq))
        seq += 1
        status, data, _ = http.call("POST", path, b, "application/json")
        expect(status, data, 202)
        return 1

    for _ in range(2):  # warm-up
        post()
    res = timed_writes(post, duration=duration, max_ops=max_ops, barrier=barrier)
    http.close()
    return res


def redis_write(
    *,
    url: str,
    key_prefix: str,
    per_pipe: int,
    tag: str,
    worker: int,
    duration: float,
    max_ops: int,
    tokens: int = TOKENS,
    barrier: Any,
) -> Result:
    """The write ceiling: per rollout ``SET <id> <msgpack rollout>`` and ``RPUSH <queue> <id>``,
    ``per_pipe`` rollouts per pipelined round trip. Same bytes as the msgpack request items."""
    payload = make_payload(tokens=tokens)
    r = redis.Redis.from_url(url)
    queue = f"{key_prefix}:q"
    seq = 0

    def one_pipe() -> int:
        nonlocal seq
        pipe = r.pipeline(transaction=False)
        for _ in range(per_pipe):
            rid = rollout_id(tag, worker, seq)
            seq += 1
            key = f"{key_prefix}:r:{rid}"
            pipe.set(key, payload.msgpack_item(rid))
            pipe.rpush(queue, key)
        pipe.execute()
        return per_pipe

    one_pipe()
    res = timed_writes(one_pipe, duration=duration, max_ops=max_ops, barrier=barrier)
    r.close()
    return res


def redis_read(
    *, url: str, queue: str, size: int, duration: float, max_ops: int, barrier: Any
) -> Result:
    """The read ceiling: ``LPOP <queue> size``, ``MGET`` the payloads, ``RPUSH`` the ids back
    (a batch handed out and returned, like a lease and its ack). Latency is per batch."""
    r = redis.Redis.from_url(url)

    def one() -> int:
        ids = r.lpop(queue, size)
        if not ids:
            return 0
        blobs = r.mget(ids)
        r.rpush(queue, *ids)
        return len([b for b in blobs if b is not None])

    one()
    res = Result()
    barrier.wait()
    res.t0 = time.perf_counter()
    deadline = res.t0 + duration
    while res.ops < max_ops and time.perf_counter() < deadline:
        t = time.perf_counter()
        n = one()
        res.lat.append(time.perf_counter() - t)
        res.ops += 1
        res.rollouts += n
        if n == 0:
            res.empty += 1
    res.t1 = time.perf_counter()
    r.close()
    return res


def http_lease_ack(
    *,
    address: Address,
    run_id: str,
    size: int,
    fmt: str,
    duration: float,
    max_ops: int,
    stop_on_empty: bool,
    warmup: int = 1,
    token: str | None = None,
    tokens: int = TOKENS,
    barrier: Any,
) -> Result:
    """A trainer: lease a batch (msgpack or JSON response), ack it with the current policy's
    logprobs for every rollout (so the broker computes KL and ratio statistics; ``tokens`` of
    them, as many as the rollouts have). Latency is the lease call's."""
    http, lease, ack = trainer(
        address=address, run_id=run_id, size=size, fmt=fmt, token=token, tokens=tokens
    )
    res = timed_cycles(
        lease,
        ack,
        duration=duration,
        max_ops=max_ops,
        warmup=warmup,
        barrier=barrier,
        stop_on_empty=stop_on_empty,
    )
    http.close()
    return res


def timed_cycles(
    take: Callable[[], tuple[Any, Any] | None],
    settle: Callable[[Any], object],
    *,
    duration: float,
    max_ops: int,
    warmup: int,
    barrier: Any,
    stop_on_empty: bool,
) -> Result:
    """``take`` something (None: nothing to take) and ``settle`` it, over and over for
    ``duration``, after ``warmup`` untimed cycles; latency is ``take``'s, ``rollouts`` counts
    the items of what was taken (its second element)."""
    for _ in range(warmup):
        got = take()
        if got is not None:
            settle(got)
    res = Result()
    barrier.wait()
    res.t0 = time.perf_counter()
    deadline = res.t0 + duration
    while res.ops < max_ops and time.perf_counter() < deadline:
        t = time.perf_counter()
        got = take()
        dt = time.perf_counter() - t
        if got is None:
            res.empty += 1
            if stop_on_empty:
                break
            continue
        res.lat.append(dt)
        settle(got)
        res.ops += 1
        res.rollouts += len(got[1])
    res.t1 = time.perf_counter()
    return res


Batch = tuple[str, list[str]]  # a leased batch's id and its rollout ids


def trainer(
    *,
    address: Address,
    run_id: str,
    size: int,
    fmt: str,
    token: str | None = None,
    tokens: int = TOKENS,
) -> tuple[Http, Callable[[], Batch | None], Callable[[Batch], None]]:
    """A connection, a lease of ``size`` (None when the run has nothing: 204) and the ack of a
    batch with the current policy's logprobs for every rollout (``tokens`` of them)."""
    payload = make_payload(tokens=tokens)
    http = Http(address, token)
    ctype = CONTENT_TYPE[fmt]
    lease_path = f"/v1/runs/{run_id}/batch?size={size}"

    def lease() -> Batch | None:
        status, data, _ = http.call("GET", lease_path, accept=ctype)
        if status == 204:
            return None
        expect(status, data, 200)
        doc = msgpack.unpackb(data, raw=False) if fmt == "msgpack" else orjson.loads(data)
        return doc["batch_id"], [r["rollout_id"] for r in doc["rollouts"]]

    def ack(batch: Batch) -> None:
        bid, rids = batch
        status, data, _ = http.call(
            "POST", f"/v1/runs/{run_id}/batches/{bid}/ack", ack_body(fmt, rids, payload), ctype
        )
        expect(status, data, 200)

    return http, lease, ack


def lease_acker(
    *, address: Address, run_id: str, size: int, fmt: str, token: str | None = None
) -> tuple[Http, Callable[[], int | None]]:
    """A connection, and a call leasing one batch and acking it (returns its rollouts; None
    when the run has nothing left)."""
    http, lease, ack = trainer(address=address, run_id=run_id, size=size, fmt=fmt, token=token)

    def lease_ack() -> int | None:
        got = lease()
        if got is None:
            return None
        ack(got)
        return len(got[1])

    return http, lease_ack


def naive_pop(
    *, address: Address, size: int, duration: float, max_ops: int, barrier: Any
) -> Result:
    """A trainer of the naive buffer: a 'batch' of ``size`` is ``size`` pops, one per request.
    Latency is per batch."""
    http = Http(address)
    status, data, _ = http.call("GET", "/rollouts/next")
    expect(status, data, 200, 204)
    res = Result()
    barrier.wait()
    res.t0 = time.perf_counter()
    deadline = res.t0 + duration
    while res.ops < max_ops and time.perf_counter() < deadline:
        t = time.perf_counter()
        got = 0
        for _ in range(size):
            status, data, _ = http.call("GET", "/rollouts/next")
            expect(status, data, 200, 204)
            if status == 204:
                break
            orjson.loads(data)
            got += 1
        if got < size:
            res.empty += 1
            break
        res.lat.append(time.perf_counter() - t)
        res.ops += 1
        res.rollouts += got
    res.t1 = time.perf_counter()
    http.close()
    return res


# -- running a group of workers -------------------------------------------------------------
def _child(fn: Callable[..., Result], kwargs: dict[str, Any], barrier: Any, out: Any) -> None:
    try:
        out.put(("ok", fn(barrier=barrier, **kwargs)))
    except BaseException:  # the parent re-raises it
        barrier.abort()
        out.put(("error", traceback.format_exc()))


def run_group(
    fn: Callable[..., Result], kwargs_list: list[dict[str, Any]], timeout: float
) -> Group:
    """Run one worker per kwargs in parallel processes that start together."""
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(len(kwargs_list) + 1)
    out = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(fn, kw, barrier, out)) for kw in kwargs_list]
    for p in procs:
        p.start()
    results: list[Result] = []
    errors: list[str] = []
    try:
        # A worker that failed before the start broke the barrier; its error is on the queue.
        with contextlib.suppress(Exception):
            barrier.wait(timeout=timeout)
        deadline = time.monotonic() + timeout
        for _ in procs:
            remaining = max(0.1, deadline - time.monotonic())
            kind, value = out.get(timeout=remaining)
            (results if kind == "ok" else errors).append(value)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    if errors:
        raise RuntimeError("a load process failed:\n" + errors[0])
    return Group(results)
