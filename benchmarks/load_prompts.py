"""Load processes of the work-lease rows: an operator registering prompts, a generator taking
work leases and giving them back unstarted, and the raw-Redis ceiling of the same."""

from __future__ import annotations

import time
from typing import Any

import msgpack
import numpy as np
import orjson
import redis

from benchmarks.load import Address, Http, Result, expect, timed_cycles, timed_writes
from benchmarks.payloads import make_prompt, rollout_id

MSGPACK = "application/msgpack"


def http_register(
    *,
    address: Address,
    run_id: str,
    per_req: int,
    tag: str,
    worker: int,
    duration: float,
    max_ops: int,
    barrier: Any,
) -> Result:
    """An operator registering prompts (one pass each), ``per_req`` per JSON request."""
    prompt = make_prompt()
    http = Http(address)
    path = f"/v1/runs/{run_id}/prompts"
    seq = 0

    def post() -> int:
        nonlocal seq
        ids = [rollout_id(tag, worker, seq + i) for i in range(per_req)]
        seq += per_req
        status, data, _ = http.call("POST", path, prompt.body(ids), "application/json")
        expect(status, data, 202)
        return per_req

    res = timed_writes(post, duration=duration, max_ops=max_ops, barrier=barrier)
    http.close()
    return res


def _work_call(http: Http, run_id: str, size: int, accept: str | None = None) -> Any:
    """One work request of ``size`` prompts (no wait): the answer's document, or None."""
    body = orjson.dumps({"max_prompts": size, "generator_id": "bench-gen", "wait_s": 0})
    status, data, _ = http.call("POST", f"/v1/runs/{run_id}/work", body, "application/json", accept)
    if status == 204:
        return None
    expect(status, data, 200)
    return msgpack.unpackb(data, raw=False) if accept == MSGPACK else orjson.loads(data)


def http_work_return(
    *,
    address: Address,
    run_id: str,
    size: int,
    duration: float,
    max_ops: int,
    warmup: int = 1,
    barrier: Any,
) -> Result:
    """A generator taking a work lease of ``size`` prompts and giving them all back unstarted,
    so the queue stays as deep as it was. Latency is the work call's."""
    http = Http(address)

    def take() -> tuple[str, list[Any]] | None:
        doc = _work_call(http, run_id, size)
        return None if doc is None else (doc["lease_id"], doc["prompts"])

    def give_back(lease_id: str, _prompts: list[Any]) -> None:
        path = f"/v1/runs/{run_id}/work/{lease_id}/return"
        status, data, _ = http.call("POST", path, b"{}", "application/json")
        expect(status, data, 200)

    res = timed_cycles(
        take,
        lambda got: give_back(*got),
        duration=duration,
        max_ops=max_ops,
        warmup=warmup,
        barrier=barrier,
        stop_on_empty=True,
    )
    http.close()
    return res


def http_work_return_partials(
    *,
    address: Address,
    run_id: str,
    size: int,
    partials: int,
    tokens: int,
    duration: float,
    max_ops: int,
    warmup: int = 1,
    barrier: Any,
) -> Result:
    """:func:`http_work_return` with partial rollouts: each lease's prompts go back with
    ``partials`` partials of ``tokens`` tokens each (msgpack, raw arrays), under the same
    rollout ids every time, so from the second lease on every prompt comes with its partials
    to continue (answers in msgpack)."""
    http = Http(address)
    ids = np.arange(tokens, dtype="<i4").tobytes()
    lps = np.full(tokens, -0.5, dtype="<f4").tobytes()

    def take() -> tuple[str, list[Any]] | None:
        doc = _work_call(http, run_id, size, MSGPACK)
        return None if doc is None else (doc["lease_id"], doc["prompts"])

    def give_back(lease_id: str, prompts: list[Any]) -> None:
        sampled = [
            {
                "rollout_id": f"{p['prompt_id']}-{k}",
                "group_id": p["group_id"],
                "policy_version": 0,
                "response_ids": ids,
                "logprobs": lps,
            }
            for p in prompts
            for k in range(partials)
        ]
        doc = msgpack.packb({"partials": sampled}, use_bin_type=True)
        path = f"/v1/runs/{run_id}/work/{lease_id}/return"
        status, data, _ = http.call("POST", path, doc, MSGPACK)
        expect(status, data, 200)

    res = timed_cycles(
        take,
        lambda got: give_back(*got),
        duration=duration,
        max_ops=max_ops,
        warmup=warmup,
        barrier=barrier,
        stop_on_empty=True,
    )
    http.close()
    return res


# The work-lease ceiling's hand-out, one script: the first `size` passes of the queue leave it
# and are marked leased. What the broker's work.lua must do at the least, without its lease
# record, staleness budget, sweep or accounting event.
RAW_HANDOUT = """
local got = redis.call('ZRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1, 'WITHSCORES')
if #got == 0 then return got end
local passes = {}
for i = 1, #got, 2 do
  passes[#passes + 1] = got[i]
  redis.call('HSET', ARGV[2] .. got[i], 'st', 'w', 'lease', ARGV[3])
end
redis.call('ZREM', KEYS[1], unpack(passes))
return got
"""


def raw_prompt_keys(key_prefix: str) -> tuple[str, str, str]:
    """The raw ceiling's prompt queue, pass-hash prefix and stored-prompt prefix."""
    return f"{key_prefix}:pq", f"{key_prefix}:pp:", f"{key_prefix}:pb:"


def redis_fill_prompts(url: str, key_prefix: str, start: int, n: int) -> None:
    """Queue ``n`` more prompts for the raw ceiling, laid out as the broker lays them out: the
    stored prompt, a hash per pass, the pass in a zset by registration order."""
    prompt = make_prompt()
    queue, pass_prefix, blob_prefix = raw_prompt_keys(key_prefix)
    r = redis.Redis.from_url(url)
    for lo in range(start, start + n, 1000):
        pipe = r.pipeline(transaction=False)
        for seq in range(lo, min(lo + 1000, start + n)):
            pid = rollout_id("rp", 0, seq)
            pipe.set(blob_prefix + pid, prompt.stored)
            pipe.hset(pass_prefix + pid + "#1", mapping={"st": "q", "att": 1, "seq": seq})
            pipe.zadd(queue, {pid + "#1": seq})
        pipe.execute()
    r.close()


def redis_work_return(
    *, url: str, key_prefix: str, size: int, duration: float, max_ops: int, barrier: Any
) -> Result:
    """The work-lease ceiling: the hand-out script, ``MGET`` of the stored prompts, then the
    passes given back (``ZADD`` at their old score, ``HSET`` queued) in one pipeline. Latency
    is the hand-out's (script and ``MGET``), as the broker's is its work call's."""
    r = redis.Redis.from_url(url)
    queue, pass_prefix, blob_prefix = raw_prompt_keys(key_prefix)
    handout = r.register_script(RAW_HANDOUT)
    lease = 0

    def take() -> list[tuple[bytes, float]]:
        nonlocal lease
        lease += 1
        got = handout(keys=[queue], args=[size, pass_prefix, f"lease-{lease}"])
        passes = [(got[i], float(got[i + 1])) for i in range(0, len(got), 2)]
        if passes:
            blobs = r.mget([blob_prefix.encode() + pk.rpartition(b"#")[0] for pk, _ in passes])
            assert all(b is not None for b in blobs)
        return passes

    def give_back(passes: list[tuple[bytes, float]]) -> None:
        pipe = r.pipeline(transaction=False)
        pipe.zadd(queue, dict(passes))
        for pk, _ in passes:
            pipe.hset(pass_prefix.encode() + pk, "st", "q")
        pipe.execute()

    give_back(take())
    res = Result()
    barrier.wait()
    res.t0 = time.perf_counter()
    deadline = res.t0 + duration
    while res.ops < max_ops and time.perf_counter() < deadline:
        t = time.perf_counter()
        passes = take()
        dt = time.perf_counter() - t
        if not passes:
            res.empty += 1
            break
        res.lat.append(dt)
        give_back(passes)
        res.ops += 1
        res.rollouts += len(passes)
    res.t1 = time.perf_counter()
    r.close()
    return res
