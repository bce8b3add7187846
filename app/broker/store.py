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

from app import keys
from app.broker.batch_calls import SWEEP_LIMIT, BatchCalls, floor_of
from app.broker.config import RunConfig
from app.broker.consumer_calls import ConsumerCalls
from app.broker.packing import PackedRollout
from app.broker.pass_reads import PassReads
from app.broker.records import (
    BatchMember,
    BatchView,
    IngestOutcome,
    Lease,
    LeasedRollout,
    MaintainOutcome,
    PolicyState,
    RunPage,
    RunState,
    SweepOutcome,
    WorkItem,
    WorkLease,
    _counts,
    maintain_state,
)
from app.broker.replies import AckAnswer, StoreError, beta_of, decode, text
from app.broker.scripts import LIBRARY
from app.functions import call
from app.replicas import Replicas

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
    "PolicyState",
    "RedisStore",
    "RunPage",
    "RunState",
    "StoreError",
    "SweepOutcome",
    "WorkItem",
    "WorkLease",
    "scan_limit",
]

LEASE_SWEEP_LIMIT = 64  # the lazy clean-up a lease call does first

# A lease call looks at no more than SCAN_PER_ROLLOUT units per rollout asked for, plus
# SCAN_SLACK: enough to step over the units it cannot hand out (retired on the way, of a later
# version than the trainer's, groups too big for what is left of the batch) without letting
# one call walk a whole buffer of them while Redis waits.
SCAN_PER_ROLLOUT = 4
SCAN_SLACK = 256


def scan_limit(size: int) -> int:
    return SCAN_PER_ROLLOUT * size + SCAN_SLACK


_WAKE_TRIES = 5

# Scripts whose answer no client relies on for a write: a read, and the maintenance worker's
# calls (a wake-up is followed by the call that needed it, which waits). They never wait for
# replicas; every other script does when the store has Replicas.
_NO_WAIT = frozenset({"batch_view", "policy_view", "maintain", "wake_run", "consumer_view"})


class RedisStore(PassReads, BatchCalls, ConsumerCalls):
    """Every change to a run's keys, one script call each (or a short loop of bounded calls),
    and the reads that need no script; the run indexes' part is :class:`RunIndex`'s, the prompt
    passes' reads :class:`PassReads`'. With ``replicas``, a script call that changes state is
    answered only once its master's replicas have it (app/replicas.py); without, each is one
    FCALL as Redis takes it (app/functions.py)."""

    def __init__(self, redis: Redis, prefix: str, replicas: Replicas | None = None) -> None:
        super().__init__(redis, prefix)
        self.replicas = replicas

    async def _script(self, name: str, run_id: str, *args: Any) -> Any:
        """The raw reply of script ``name`` on the run, after its replicas when asked."""
        script_keys = keys.script_keys(self.prefix, run_id)
        argv = [keys.wake_channel(self.prefix, run_id), *args]
        if self.replicas is None or name in _NO_WAIT:
            return await call(self.redis, LIBRARY.functions[name], LIBRARY.code, script_keys, argv)
        return await self.replicas.script(
            LIBRARY.functions[name],
            LIBRARY.code,
            keys.sync_key(self.prefix, run_id),
            script_keys,
            argv,
        )

    async def _call(self, name: str, run_id: str, *args: Any) -> list[Any]:
        """The body of the script's ok reply; StoreError when it refuses. A parked run is
        woken first (and the call made again)."""
        for _ in range(_WAKE_TRIES):
            reply = await self._script(name, run_id, *args)
            try:
                return decode(name, reply)
            except StoreError as err:
                if err.code != "run_parked":
                    raise
                await self.wake(run_id, int(err.args_[0]))
        raise StoreError("run_parked")  # parked again at every try: not seen in practice

    run_script = _call  # for the stores of the parts beside this one (app/broker/reward_store.py)

    async def wake(self, run_id: str, held: int) -> None:
        """Take a parked run (holding token ``held``) back into the active index, then into
        service. StoreError('run_missing') for a run being deleted."""
        token = await self.activate(run_id, held + 1)
        decode("wake_run", await self._script("wake_run", run_id, token))

    # -- runs -----------------------------------------------------------------------------
    async def create_run(
        self, run_id: str, config: RunConfig, *, entry: bytes = b""
    ) -> Literal["created", "exists"]:
        """'created', or 'exists' with the same config; StoreError('run_conflict'), or
        StoreError('run_deleted') for the id of a deleted run. ``entry``, the action's audit
        entry (:func:`app.caller.action_entry`; empty: none), goes to the run's outbox in the
        script that creates it; so does each run action's below, when it changes the run.

        The indexes come first, each write idempotent: a crash before the script leaves
        entries of a run that does not exist (skipped, and the client's retry creates it), never
        a run that the workers do not visit."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zadd(self.runs_key, {run_id: int(time.time() * 1000)}, nx=True)
            pipe.zscore(self.runs_key, run_id)
            _, created = await pipe.execute()
        await self.activate(run_id)
        (outcome,) = await self._call(
            "create_run", run_id, run_id, config.canonical_json(), int(created), entry
        )
        return "created" if text(outcome) == "created" else "exists"

    async def replace_config(
        self, run_id: str, expected_json: str, new: RunConfig, *, entry: bytes = b""
    ) -> Literal["replaced", "changed"]:
        """'replaced', or 'changed' (someone else patched first: merge again); the entry is
        written when the config changes."""
        (outcome,) = await self._call(
            "patch_config", run_id, expected_json, new.canonical_json(), entry
        )
        return "replaced" if text(outcome) == "replaced" else "changed"

    async def set_policy(
        self,
        run_id: str,
        version: int,
        limit: int = SWEEP_LIMIT,
        *,
        entry: bytes = b"",
        weights: str | None = None,
    ) -> tuple[int, int]:
        """(policy_version, evicted): the rollouts this change retired as stale, in bounded
        steps of ``limit`` until none is left. Other retirements of the same sweeps (expired
        leases, timed-out groups) are not evictions by the new version. The entry is written,
        and ``weights`` kept with the version, when the version moves (not for the current one
        again)."""
        _, current, more, retired = await self._call(
            "set_policy", run_id, str(version), limit, entry, weights or ""
        )
        evicted = _counts(retired).get("stale", 0)
        while int(more):
            step = await self.sweep(run_id, limit)
            more, evicted = step.more, evicted + step.retired.get("stale", 0)
        return int(current), evicted

    async def policy(self, run_id: str, after: int | None = None, wait_ms: int = 0) -> PolicyState:
        """The run's policy version, its weights and when it was set; a caller about to wait
        ``wait_ms`` for a version other than ``after`` is announced in the same call."""
        ver, wts, at = await self._call(
            "policy_view", run_id, "" if after is None else after, wait_ms
        )
        return PolicyState(int(ver), text(wts) or None, int(at))

    async def rewind(
        self, run_id: str, version: int, weights: str | None = None, *, entry: bytes = b""
    ) -> tuple[int, int] | None:
        """(policy_version, rollouts retired 'rewound') after moving the run back to
        ``version`` in one step (rewind.lua), or None when ``version`` is not below the run's
        (nothing changed: the caller moves forward). The entry is written when it rewinds."""
        got = await self._call("rewind", run_id, str(version), weights or "", entry)
        if text(got[0]) == "not_behind":
            return None
        _, current, retired = got
        return int(current), _counts(retired).get("rewound", 0)

    async def close_run(self, run_id: str, *, entry: bytes = b"") -> None:
        """Close the run (again: nothing changes); the entry is written when this call closes
        it."""
        (more,) = await self._call("close_run", run_id, SWEEP_LIMIT, entry)
        while int(more):
            more = (await self.sweep(run_id)).more

    async def delete_run(self, run_id: str, *, entry: bytes = b"") -> None:
        """Delete a closed, settled run in bounded steps, then its entry in the active index;
        deleting a deleted run again does only the latter. The entry is written by the step
        that leaves the tombstone. StoreError: 'run_missing', 'run_open', 'run_busy' (with what
        it waits for).

        The run stays in the run index (the listing skips a tombstone) until :meth:`unlist`:
        that is where the audit loop finds the run's outbox, whose entries must move first."""
        while True:
            (outcome,) = await self._call(
                "delete_run", run_id, SWEEP_LIMIT, keys.CONSUMER_GROUP, entry
            )
            if text(outcome) == "deleted":
                break
        # The run can no longer be woken (wake_run.lua refuses it): its entry may go at once.
        await self.redis.zrem(self.active_key, run_id)

    async def unlist(self, run_id: str) -> None:
        """Take a deleted run out of the run index, once its outbox has moved into the audit
        log: the outbox, empty, goes first (a tombstone writes no entry)."""
        await self.redis.delete(keys.outbox_key(self.prefix, run_id))
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
                str(r.v_new),
                r.tokens,
                r.masked,
                r.reward_text,
                # redis-py sends a memoryview as it is, beside the command's other bytes; a
                # bytes argument its hiredis packer (redis-py 8.2) copies into one buffer with
                # the rest, a second copy of a request's rollouts while the call lasts.
                memoryview(r.blob),
                r.generator_id or "",
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
        bid, version, expires_at, rows, floor, beta = body
        pids = [text(pid) for *_, pid in rows]
        got = await self.blobs(run_id, [text(rid) for _, _, rid, _ in rows])
        prompts = list(dict.fromkeys(pid for pid in pids if pid))
        prompt_of = dict(zip(prompts, await self.prompt_blobs(run_id, prompts), strict=True))
        rollouts = []
        for (uses, lag, _, _), pid, blob in zip(rows, pids, got, strict=True):
            if blob is None:
                # Only a lease that ran out already, and whose rollouts then retired, loses them.
                raise StoreError("lease_lost")
            prompt = prompt_of.get(pid) if pid else None
            rollouts.append(LeasedRollout(int(uses), int(lag), blob, pid or None, prompt))
        return Lease(
            text(bid), int(version), int(expires_at), rollouts, floor_of(floor), beta_of(beta)
        )

    async def blobs(self, run_id: str, rollout_ids: Sequence[str]) -> list[bytes | None]:
        """The packed rollouts, in one MGET (None for one that is gone)."""
        if not rollout_ids:
            return []
        got: list[Any] = await self.redis.mget(
            [keys.member_key(self.prefix, run_id, keys.BLOB, rid) for rid in rollout_ids]
        )
        return got

    async def release_generator(
        self, run_id: str, generator_id: str, *, entry: bytes = b""
    ) -> Literal["released", "not_quarantined"]:
        """Lift the generator's quarantine; 'not_quarantined' (and no audit entry) when it was
        not quarantined. StoreError for no such run."""
        (outcome,) = await self._call("release", run_id, generator_id, entry)
        return "released" if text(outcome) == "released" else "not_quarantined"

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
        seed: int | None = None,
    ) -> WorkLease | None:
        """A work lease, or None when nothing could be handed out; then, with ``wait_ms``,
        prompts or budget coming free in the run announce it for that long. ``seed`` seeds the
        draws from difficulty pools (random when None)."""
        outcome, *body = await self._call(
            "work",
            run_id,
            lease_id,
            max_prompts,
            generator_id or "",
            LEASE_SWEEP_LIMIT,
            wait_ms,
            waited_ms,
            secrets.randbits(31) if seed is None else seed,
        )
        if text(outcome) == "short":
            return None
        lid, version, expires_at, rows = body
        passes = [(text(pk).rpartition("#"), int(att), partials) for pk, att, partials in rows]
        blobs = await self.prompt_blobs(run_id, [pid for (pid, _, _), _, _ in passes])
        items = []
        for ((pid, _, pass_), att, partials), blob in zip(passes, blobs, strict=True):
            if blob is None:
                # Prompts are never deleted while their run lives: the read reached a master that
                # does not have this prompt yet (a failover's), or a hand deleted it.
                raise StoreError("work_lost", pid)
            items.append(WorkItem(pid, int(pass_), att, blob, list(partials)))
        return WorkLease(text(lid), int(version), int(expires_at), items)

    async def prompt_blobs(self, run_id: str, prompt_ids: Sequence[str]) -> list[bytes | None]:
        if not prompt_ids:
            return []
        got: list[Any] = await self.redis.mget(
            [keys.member_key(self.prefix, run_id, keys.PROMPT, pid) for pid in prompt_ids]
        )
        return got

    async def return_work(
        self,
        run_id: str,
        lease_id: str,
        prompt_ids: Sequence[str] | None,
        partials: Sequence[PackedRollout] = (),
    ) -> int:
        """Prompts given back (those still in flight under the lease); all when None. The
        partials stay with their prompts' passes (work_return.lua)."""
        ids = list(prompt_ids or [])
        args: list[Any] = [len(ids), *ids, len(partials)]
        for p in partials:
            args += [
                p.rollout_id,
                p.group_id or "",
                str(p.policy_version),
                p.tokens,
                memoryview(p.blob),
                str(p.v_new),
            ]
        (returned,) = await self._call("work_return", run_id, lease_id, *args)
        return int(returned)
