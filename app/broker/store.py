"""The Redis store: the Lua scripts that change a run's keys atomically, and the reads that
need no script.

Every key of a run shares the hash tag ``{run_id}``; app/keys.py defines the layout.
Each method is one script call (or a short loop of bounded calls); replies are decoded by
app/broker/replies.py, which raises StoreError when a script refuses.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from typing import Any, Literal

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from app import keys
from app.broker.config import RunConfig
from app.broker.packing import PackedRollout
from app.broker.records import (
    RUN_FIELDS,
    BatchMember,
    BatchView,
    IngestOutcome,
    Lease,
    LeasedRollout,
    MaintainOutcome,
    RunPage,
    RunState,
    SweepOutcome,
    WorkItem,
    WorkLease,
    _counts,
    _cursor,
    _parse_cursor,
    _run_state,
    _score_text,
    maintain_state,
)
from app.broker.replies import AckAnswer, StoreError, ack_answer, decode, text
from app.broker.scripts import load_scripts

__all__ = [
    "LEASE_SWEEP_LIMIT",
    "SWEEP_LIMIT",
    "AckAnswer",
    "BatchMember",
    "BatchView",
    "IngestOutcome",
    "Lease",
    "LeasedRollout",
    "MaintainOutcome",
    "RedisStore",
    "RunPage",
    "RunState",
    "StoreError",
    "SweepOutcome",
    "WorkItem",
    "WorkLease",
    "scan_limit",
]

SWEEP_LIMIT = 1000  # units retired / leases expired per bounded call
LEASE_SWEEP_LIMIT = 64  # the lazy clean-up a lease call does first
ACK_FLUSH_LIMIT = 10 * SWEEP_LIMIT  # units a kl_flush retires within the ack itself

# A lease call looks at no more than SCAN_PER_ROLLOUT units per rollout asked for, plus
# SCAN_SLACK: enough to step over the units it cannot hand out (retired on the way, of a later
# version than the trainer's, groups too big for what is left of the batch) without letting
# one call walk a whole buffer of them while Redis waits.
SCAN_PER_ROLLOUT = 4
SCAN_SLACK = 256


def scan_limit(size: int) -> int:
    return SCAN_PER_ROLLOUT * size + SCAN_SLACK


_WAKE_TRIES = 5

# The active index lives in one slot of its own, so these touch only it. A token is the time
# (ms) of the call, and always above the run's previous token and above `floor`: it only ever
# grows, so a worker that read an older one cannot take the run out after a wake-up.
_ACTIVATE_LUA = """
redis.replicate_commands()
local t = redis.call('TIME')
local s = math.max(tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), tonumber(ARGV[2]))
local prev = redis.call('ZSCORE', KEYS[1], ARGV[1])
if prev then s = math.max(s, tonumber(prev) + 1) end
s = string.format('%d', s)
redis.call('ZADD', KEYS[1], s, ARGV[1])
return s
"""
_DEACTIVATE_LUA = """
local s = redis.call('ZSCORE', KEYS[1], ARGV[1])
if s and tonumber(s) == tonumber(ARGV[2]) then return redis.call('ZREM', KEYS[1], ARGV[1]) end
return 0
"""

# An active-index entry whose run does not exist is a creation under way (the index is written
# first) or one that never finished; after this long, it is the latter.
ORPHAN_GRACE_MS = 10 * 60 * 1000
# A page of GET /v1/runs reads at most this many index entries beyond the runs it returns
# (entries of runs of the other status, of runs being created or deleted); it is then short.
PAGE_SCAN_SLACK = 10_000


class RedisStore:
    def __init__(self, redis: Redis, prefix: str) -> None:
        self.redis = redis
        self.prefix = prefix
        self.wake_channel = keys.wake_channel(prefix)
        self._scripts: dict[str, AsyncScript] = {
            name: redis.register_script(src) for name, src in load_scripts().items()
        }
        self._activate = redis.register_script(_ACTIVATE_LUA)
        self._deactivate = redis.register_script(_DEACTIVATE_LUA)

    # -- keys -----------------------------------------------------------------------------
    def run_key(self, run_id: str) -> str:
        return keys.run_key(self.prefix, run_id)

    def events_key(self, run_id: str) -> str:
        return keys.events_key(self.prefix, run_id)

    @property
    def runs_key(self) -> str:
        return keys.runs_key(self.prefix)

    @property
    def active_key(self) -> str:
        return keys.active_key(self.prefix)

    async def _call(self, name: str, run_id: str, *args: Any) -> list[Any]:
        """The body of the script's ok reply; StoreError when it refuses. A parked run is
        woken first (and the call made again)."""
        for _ in range(_WAKE_TRIES):
            reply = await self._scripts[name](
                keys=keys.script_keys(self.prefix, run_id), args=[self.wake_channel, *args]
            )
            try:
                return decode(name, reply)
            except StoreError as err:
                if err.code != "run_parked":
                    raise
                await self.wake(run_id, int(err.args_[0]))
        raise StoreError("run_parked")  # parked again at every try: not seen in practice

    # -- the run indexes --------------------------------------------------------------------
    # RUNS holds every run by creation time, for listing. ACTIVE holds the runs the workers
    # visit: open runs, and closed ones until they have settled (nothing live, every event
    # drained). Both are written before the run's own keys (create_run, wake), so a run is never
    # without its entries, on one Redis or on a cluster, where they live in other slots. The
    # order of the two writes matters only in that both come first; an entry whose run does
    # not exist is skipped by the readers and cleared after ORPHAN_GRACE_MS.
    async def activate(self, run_id: str, floor: int = 0) -> int:
        """Put the run in the active index; returns its new token (above ``floor``)."""
        return int(await self._activate(keys=[self.active_key], args=[run_id, floor]))

    async def deactivate(self, run_id: str, token: int) -> bool:
        """Take the run out of the active index if its token is still ``token``."""
        return bool(await self._deactivate(keys=[self.active_key], args=[run_id, token]))

    async def wake(self, run_id: str, held: int) -> None:
        """Take a parked run (holding token ``held``) back into the active index, then into
        service. StoreError('run_missing') for a run being deleted."""
        token = await self.activate(run_id, held + 1)
        decode(
            "wake_run",
            await self._scripts["wake_run"](
                keys=keys.script_keys(self.prefix, run_id), args=[self.wake_channel, token]
            ),
        )

    async def active_runs(self) -> list[tuple[str, int]]:
        """(run id, token) of every run the workers visit."""
        rows: list[Any] = await self.redis.zrange(self.active_key, 0, -1, withscores=True)
        return [(text(rid), int(score)) for rid, score in rows]

    # -- runs -----------------------------------------------------------------------------
    async def create_run(self, run_id: str, config: RunConfig) -> Literal["created", "exists"]:
        """'created', or 'exists' with the same config; StoreError('run_conflict'), or
        StoreError('run_deleted') for the id of a deleted run.

        The indexes come first, each write idempotent: a crash before the script leaves
        entries of a run that does not exist (skipped, and the client's retry creates it), never
        a run that the workers do not visit."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zadd(self.runs_key, {run_id: int(time.time() * 1000)}, nx=True)
            pipe.zscore(self.runs_key, run_id)
            _, created = await pipe.execute()
        await self.activate(run_id)
        (outcome,) = await self._call(
            "create_run", run_id, run_id, config.canonical_json(), int(created)
        )
        return "created" if text(outcome) == "created" else "exists"

    async def get_run(self, run_id: str) -> RunState | None:
        f: list[Any] = await self.redis.hmget(self.run_key(run_id), *RUN_FIELDS)
        return _run_state(run_id, f)

    async def run_ids(self) -> list[str]:
        """The runs the workers visit (the active index), oldest token first."""
        return [rid for rid, _ in await self.active_runs()]

    async def list_runs(
        self,
        status: Literal["open", "closed"] | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> RunPage:
        """Runs newest first (by creation, then id), ``limit`` at most, after ``cursor`` (a
        previous page's ``next_cursor``); ValueError for a malformed cursor.

        Open runs come from the active index, which holds them all and few others, ordered
        here; the others from the run index, newest first. A page reads at most
        PAGE_SCAN_SLACK entries beyond its runs, and is then short, with a cursor."""
        after = _parse_cursor(cursor)
        if status == "open":
            return await self._list_open(limit, after)
        runs: list[RunState] = []
        scanned, last = 0, after
        while len(runs) < limit and scanned < limit + PAGE_SCAN_SLACK:
            chunk = await self._index_after(last, limit - len(runs))
            if not chunk:
                return RunPage(runs, None)
            scanned += len(chunk)
            states = await self._states([rid for rid, _ in chunk])
            for (rid, created), state in zip(chunk, states, strict=True):
                last = (created, rid)
                if state is not None and status in (None, state.status):
                    runs.append(state)
        return RunPage(runs, _cursor(*last) if last else None)

    async def _index_after(
        self, after: tuple[float, str] | None, count: int
    ) -> list[tuple[str, float]]:
        """Up to ``count`` entries of the run index after ``after``, newest first; entries of
        one score in reverse id order, as ZREVRANGEBYSCORE gives them."""
        if after is None:
            rows: list[Any] = await self.redis.zrevrangebyscore(
                self.runs_key, "+inf", "-inf", start=0, num=count, withscores=True
            )
            return [(text(r), float(sc)) for r, sc in rows]
        score, rid = after
        exact = _score_text(score)
        # Runs created in the same millisecond: as many as Redis can create in one.
        ties: list[Any] = await self.redis.zrevrangebyscore(self.runs_key, exact, exact)
        got = [(text(r), score) for r in ties if text(r).encode() < rid.encode()][:count]
        if len(got) < count:
            older: list[Any] = await self.redis.zrevrangebyscore(
                self.runs_key, f"({exact}", "-inf", start=0, num=count - len(got), withscores=True
            )
            got += [(text(r), float(sc)) for r, sc in older]
        return got

    async def _list_open(self, limit: int, after: tuple[float, str] | None) -> RunPage:
        ids = [rid for rid, _ in await self.active_runs()]
        states = [s for s in await self._states(ids) if s is not None and s.status == "open"]
        order = sorted(states, key=lambda s: (s.created_at_ms, s.run_id.encode()), reverse=True)
        if after is not None:
            order = [
                s
                for s in order
                if (s.created_at_ms, s.run_id.encode()) < (after[0], after[1].encode())
            ]
        page = order[:limit]
        more = len(order) > limit
        return RunPage(page, _cursor(page[-1].created_at_ms, page[-1].run_id) if more else None)

    async def _states(self, run_ids: Sequence[str]) -> list[RunState | None]:
        """Each run as get_run reads it (None: no such run, or a deleted one's tombstone)."""
        out: list[RunState | None] = []
        for start in range(0, len(run_ids), 1000):
            async with self.redis.pipeline(transaction=False) as pipe:
                for rid in run_ids[start : start + 1000]:
                    pipe.hmget(self.run_key(rid), *RUN_FIELDS)
                rows = await pipe.execute()
            out += [
                _run_state(rid, f)
                for rid, f in zip(run_ids[start : start + 1000], rows, strict=True)
            ]
        return out

    async def replace_config(
        self, run_id: str, expected_json: str, new: RunConfig
    ) -> Literal["replaced", "changed"]:
        """'replaced', or 'changed' (someone else patched first: merge again)."""
        (outcome,) = await self._call("patch_config", run_id, expected_json, new.canonical_json())
        return "replaced" if text(outcome) == "replaced" else "changed"

    async def set_policy(
        self, run_id: str, version: int, limit: int = SWEEP_LIMIT
    ) -> tuple[int, int]:
        """(policy_version, evicted): the rollouts this change retired as stale, in bounded
        steps of ``limit`` until none is left. Other retirements of the same sweeps (expired
        leases, timed-out groups) are not evictions by the new version."""
        _, current, more, retired = await self._call("set_policy", run_id, str(version), limit)
        evicted = _counts(retired).get("stale", 0)
        while int(more):
            step = await self.sweep(run_id, limit)
            more, evicted = step.more, evicted + step.retired.get("stale", 0)
        return int(current), evicted

    async def close_run(self, run_id: str) -> None:
        (more,) = await self._call("close_run", run_id, SWEEP_LIMIT)
        while int(more):
            more = (await self.sweep(run_id)).more

    async def delete_run(self, run_id: str) -> None:
        """Delete a closed, settled run in bounded steps, then its index entries; deleting a
        deleted run again does only the latter. StoreError: 'run_missing', 'run_open',
        'run_busy' (with what it waits for)."""
        while True:
            (outcome,) = await self._call("delete_run", run_id, SWEEP_LIMIT, keys.CONSUMER_GROUP)
            if text(outcome) == "deleted":
                break
        # The run can no longer be woken (wake_run.lua refuses it): its entries may go at once.
        await self.redis.zrem(self.active_key, run_id)
        await self.redis.zrem(self.runs_key, run_id)

    async def maintain(self, run_id: str, token: int, limit: int = SWEEP_LIMIT) -> MaintainOutcome:
        """The maintenance worker's bounded call on one run of the active index (maintain.lua)."""
        state, more, retired, now = await self._call(
            "maintain", run_id, limit, token, keys.CONSUMER_GROUP
        )
        return MaintainOutcome(
            maintain_state(text(state)), bool(int(more)), _counts(retired), int(now)
        )

    async def sweep(self, run_id: str, limit: int = SWEEP_LIMIT) -> SweepOutcome:
        """One bounded clean-up call."""
        try:
            more, retired = await self._call("sweep", run_id, limit)
        except StoreError as err:
            if err.code != "run_missing":
                raise
            return SweepOutcome(False, {})  # deleted by hand: nothing left to clean
        return SweepOutcome(bool(int(more)), _counts(retired))

    # -- rollouts -------------------------------------------------------------------------
    async def ingest(self, run_id: str, rollouts: Sequence[PackedRollout]) -> IngestOutcome:
        args: list[Any] = [len(rollouts)]
        for r in rollouts:
            args += [
                r.rollout_id,
                r.group_id or "",
                str(r.policy_version),
                r.tokens,
                r.reward_text,
                # redis-py sends a memoryview as it is, beside the command's other bytes; a
                # bytes argument its hiredis packer (redis-py 8.2) copies into one buffer with
                # the rest, a second copy of a request's rollouts while the call lasts.
                memoryview(r.blob),
            ]
        accepted, duplicates, rejected = await self._call("ingest", run_id, *args)
        return IngestOutcome(
            accepted=int(accepted),
            duplicates=int(duplicates),
            rejected=[(text(rid), text(reason)) for rid, reason in rejected],
        )

    # -- batches --------------------------------------------------------------------------
    async def lease(
        self,
        run_id: str,
        *,
        batch_id: str,
        size: int,
        policy_version: int | None,
        partial: bool,
        trainer_id: str | None,
        wait_ms: int = 0,
        waited_ms: int = 0,
    ) -> Lease | int:
        """A Lease, or the number of eligible rollouts found when that was not enough; then, with
        ``wait_ms``, units that become ready in the run announce it for that long. ``waited_ms``
        is how long the request has waited so far, recorded as the trainer's wait."""
        outcome, *body = await self._call(
            "lease",
            run_id,
            batch_id,
            size,
            "" if policy_version is None else str(policy_version),
            1 if partial else 0,
            trainer_id or "",
            LEASE_SWEEP_LIMIT,
            scan_limit(size),
            secrets.randbits(31),
            wait_ms,
            waited_ms,
        )
        if text(outcome) == "short":
            (found,) = body
            return int(found)
        bid, version, expires_at, rows = body
        blobs = await self.blobs(run_id, [text(rid) for _, _, rid in rows])
        rollouts = []
        for (uses, lag, _), blob in zip(rows, blobs, strict=True):
            if blob is None:
                # Only a lease that ran out already, and whose rollouts then retired, loses them.
                raise StoreError("lease_lost")
            rollouts.append(LeasedRollout(int(uses), int(lag), blob))
        return Lease(text(bid), int(version), int(expires_at), rollouts)

    async def blobs(self, run_id: str, rollout_ids: Sequence[str]) -> list[bytes | None]:
        """The packed rollouts, in one MGET (None for one that is gone)."""
        if not rollout_ids:
            return []
        got: list[Any] = await self.redis.mget(
            [keys.member_key(self.prefix, run_id, keys.BLOB, rid) for rid in rollout_ids]
        )
        return got

    async def batch_view(
        self, run_id: str, batch_id: str, *, rollouts: Literal["none", "meta", "blobs"]
    ) -> BatchView:
        """The batch's state and, while it is leased and unless ``rollouts`` is 'none', its
        rollouts ('blobs': with their packed rollouts). StoreError for no such run or batch,
        and for a batch that was nacked or expired."""
        state, cfg, version, size, rest = await self._call(
            "batch_view", run_id, batch_id, "none" if rollouts == "none" else "meta"
        )
        config = RunConfig.model_validate_json(cfg)
        if text(state) == "acked":
            return BatchView(config, "acked", int(version), int(size), ack_answer(rest), [])
        rids = [text(rid) for rid, _, _ in rest]
        blobs: list[bytes | None] = [None] * len(rids)
        if rollouts == "blobs":
            blobs = await self.blobs(run_id, rids)
        members = [
            BatchMember(rid, int(v), int(n), blob)
            for rid, (_, v, n), blob in zip(rids, rest, blobs, strict=True)
        ]
        return BatchView(config, "leased", int(version), int(size), None, members)

    async def ack(
        self,
        run_id: str,
        batch_id: str,
        *,
        kl_mean: float | None,
        event: bytes,
        stats_text: str,
    ) -> tuple[Literal["acked", "repeat"], AckAnswer]:
        """('acked', answer), or ('repeat', the answer stored by the first ack); StoreError
        for no such run or batch, and for a batch that was nacked or expired.

        ``event`` is the msgpack payload of the ``acked`` event; its items carry each rollout's
        measured KL, which the script also gates on."""
        outcome, answer = await self._call(
            "ack",
            run_id,
            batch_id,
            "" if kl_mean is None else repr(kl_mean),
            event,
            stats_text,
            ACK_FLUSH_LIMIT,
        )
        return ("acked" if text(outcome) == "acked" else "repeat"), ack_answer(answer)

    async def nack(self, run_id: str, batch_id: str) -> tuple[Literal["nacked", "repeat"], int]:
        """('nacked', rollouts returned), or ('repeat', the same count) for a batch nacked
        before; StoreError for no such run or batch, and for one acked or expired."""
        outcome, returned = await self._call("nack", run_id, batch_id)
        return ("nacked" if text(outcome) == "nacked" else "repeat"), int(returned)

    # -- prompts --------------------------------------------------------------------------
    async def register_prompts(
        self, run_id: str, prompts: Sequence[tuple[str, bytes]], epochs: int
    ) -> tuple[int, int]:
        """(accepted, duplicates) for (prompt_id, packed prompt) pairs."""
        args: list[Any] = [epochs, len(prompts)]
        for pid, blob in prompts:
            args += [pid, blob]
        accepted, duplicates = await self._call("register_prompts", run_id, *args)
        return int(accepted), int(duplicates)

    async def work(
        self,
        run_id: str,
        *,
        lease_id: str,
        max_prompts: int,
        generator_id: str | None,
        wait_ms: int = 0,
        waited_ms: int = 0,
    ) -> WorkLease | None:
        """A work lease, or None when nothing could be handed out; then, with ``wait_ms``,
        prompts or budget coming free in the run announce it for that long."""
        outcome, *body = await self._call(
            "work",
            run_id,
            lease_id,
            max_prompts,
            generator_id or "",
            LEASE_SWEEP_LIMIT,
            wait_ms,
            waited_ms,
        )
        if text(outcome) == "short":
            return None
        lid, version, expires_at, rows = body
        passes = [(text(pk).rpartition("#"), int(att)) for pk, att in rows]
        blobs = await self.prompt_blobs(run_id, [pid for (pid, _, _), _ in passes])
        items = []
        for ((pid, _, pass_), att), blob in zip(passes, blobs, strict=True):
            if blob is None:
                # Prompts are never deleted while their run lives: the read reached a master that
                # does not have this prompt yet (a failover's), or a hand deleted it.
                raise StoreError("work_lost", pid)
            items.append(WorkItem(pid, int(pass_), att, blob))
        return WorkLease(text(lid), int(version), int(expires_at), items)

    async def prompt_blobs(self, run_id: str, prompt_ids: Sequence[str]) -> list[bytes | None]:
        if not prompt_ids:
            return []
        got: list[Any] = await self.redis.mget(
            [keys.member_key(self.prefix, run_id, keys.PROMPT, pid) for pid in prompt_ids]
        )
        return got

    async def return_work(
        self, run_id: str, lease_id: str, prompt_ids: Sequence[str] | None
    ) -> int:
        """Prompts given back (those still in flight under the lease); all when None."""
        ids = list(prompt_ids or [])
        (returned,) = await self._call("work_return", run_id, lease_id, len(ids), *ids)
        return int(returned)
