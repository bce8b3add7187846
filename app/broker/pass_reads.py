"""The reads of a run's prompt passes that need no script: pipelined reads of their keys."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from app import keys
from app.broker.replies import text
from app.broker.run_index import RunIndex


class PassReads(RunIndex):
    """What the store reads of prompt passes without a script (each answer holds for what the
    caller does with it: see each method)."""

    async def attempt_generators(
        self, run_id: str, attempts: Sequence[tuple[str, int]]
    ) -> dict[tuple[str, int], str]:
        """The generator_id of the work lease each prompt attempt (pass, attempt) was handed out
        in, for the attempts still live whose lease named one: a pipelined read of the passes,
        then of their leases. An attempt's lease and its generator never change."""
        if not attempts:
            return {}
        async with self.redis.pipeline(transaction=False) as pipe:
            for pk, _ in attempts:
                key = keys.member_key(self.prefix, run_id, keys.PASS, pk)
                pipe.hmget(key, "st", "att", "lease")
            passes = await pipe.execute()
        leases = {
            a: text(lid)
            for a, (st, att, lid) in zip(attempts, passes, strict=True)
            if st is not None
            and text(st) in ("w", "b")
            and att is not None
            and int(att) == a[1]
            and lid
        }
        lids = sorted(set(leases.values()))
        if not lids:
            return {}
        async with self.redis.pipeline(transaction=False) as pipe:
            for lid in lids:
                pipe.hget(keys.member_key(self.prefix, run_id, keys.WORK, lid), "gen")
            gens = dict(zip(lids, await pipe.execute(), strict=True))
        return {a: text(gens[lid]) for a, lid in leases.items() if gens[lid]}

    async def kept_partials(
        self, run_id: str, wanted: Mapping[str, Sequence[str]]
    ) -> dict[str, bytes]:
        """The partials kept under these rollout ids, by prompt pass: {rollout_id: packed}."""
        if not wanted:
            return {}
        passes = list(wanted)
        async with self.redis.pipeline(transaction=False) as pipe:
            for pk in passes:
                pipe.hmget(keys.member_key(self.prefix, run_id, keys.PARTIALS, pk), wanted[pk])
            got = await pipe.execute()
        return {
            rid: blob
            for pk, blobs in zip(passes, got, strict=True)
            for rid, blob in zip(wanted[pk], blobs, strict=True)
            if blob is not None
        }
