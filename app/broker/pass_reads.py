"""The reads of a run's prompt passes that need no script: pipelined reads of their keys."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from app import keys
from app.broker.replies import text
from app.broker.run_index import RunIndex


@dataclass(frozen=True)
class AttemptReads:
    """What a post of rollouts of prompt attempts reads before its ingest script."""

    generators: dict[tuple[str, int], str]
    """The generator_id of the work lease each attempt asked for was handed out in, for the
    attempts still live whose lease named one."""
    partials: dict[str, bytes]
    """The partials kept under the rollout ids asked for: {rollout_id: packed}."""


class PassReads(RunIndex):
    """What the store reads of prompt passes without a script (each answer holds for what the
    caller does with it: see app/broker/generators.py and app/broker/partials.py)."""

    async def attempt_reads(
        self,
        run_id: str,
        attempts: Sequence[tuple[str, int]],
        partials: Mapping[str, Sequence[str]],
    ) -> AttemptReads:
        """The generators of these prompt attempts (pass, attempt) and the partials kept under
        these rollout ids, by prompt pass: one pipeline reads the passes and the partials, a
        second the leases of the attempts still live. An attempt's lease and its generator
        never change."""
        if not attempts and not partials:
            return AttemptReads({}, {})
        passes = list(partials)
        async with self.redis.pipeline(transaction=False) as pipe:
            for pk, _ in attempts:
                key = keys.member_key(self.prefix, run_id, keys.PASS, pk)
                pipe.hmget(key, "st", "att", "lease")
            for pk in passes:
                pipe.hmget(keys.member_key(self.prefix, run_id, keys.PARTIALS, pk), partials[pk])
            got = await pipe.execute()
        kept = {
            rid: blob
            for pk, blobs in zip(passes, got[len(attempts) :], strict=True)
            for rid, blob in zip(partials[pk], blobs, strict=True)
            if blob is not None
        }
        gens = await self._lease_generators(run_id, attempts, got[: len(attempts)])
        return AttemptReads(gens, kept)

    async def _lease_generators(
        self, run_id: str, attempts: Sequence[tuple[str, int]], passes: Sequence[Any]
    ) -> dict[tuple[str, int], str]:
        """The generator of each attempt's lease, given its pass's ``st``, ``att`` and
        ``lease``, for the attempts still live whose lease named one."""
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
