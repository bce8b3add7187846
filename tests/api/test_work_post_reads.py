"""The Redis round trips a post of rollouts makes before its ingest script (design.md, "Storage
format" and "Partial rollouts"): none for rollouts of groups of their own; for rollouts of prompt
attempts, the pass reads of the generator default and the partials reads of the prefix check in
one pipeline, then the reads of the leases' generators when a live attempt's lease is to be read."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx
import pytest

from app.broker.packing import PackedRollout
from app.broker.store import IngestOutcome
from tests.api.test_partials import completed, returned_with_partials
from tests.helpers import post, rollout


class RoundTrips:
    """Counts the round trips the app's store makes to Redis (a command sent on its own, a
    pipeline executed), and how many each post had made when its ingest script was called."""

    def __init__(self, api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
        store = api._transport.app.state.broker.store  # type: ignore[attr-defined]
        self.count = 0
        self.before_ingest: list[int] = []
        client = store.redis
        send, make, ingest = client.execute_command, client.pipeline, store.ingest

        async def execute_command(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return await send(*args, **kwargs)

        def pipeline(*args: Any, **kwargs: Any) -> Any:
            pipe = make(*args, **kwargs)
            execute = pipe.execute

            async def counted(*a: Any, **kw: Any) -> Any:
                self.count += 1
                return await execute(*a, **kw)

            pipe.execute = counted
            return pipe

        async def watched(run_id: str, rollouts: Sequence[PackedRollout]) -> IngestOutcome:
            self.before_ingest.append(self.count)
            return await ingest(run_id, rollouts)

        monkeypatch.setattr(client, "execute_command", execute_command)
        monkeypatch.setattr(client, "pipeline", pipeline)
        monkeypatch.setattr(store, "ingest", watched)

    async def post(self, api: httpx.AsyncClient, run: str, *rollouts: dict[str, Any]) -> int:
        """The round trips a post of ``rollouts`` made before its ingest script."""
        self.count, self.before_ingest = 0, []
        resp = await post(api, run, *rollouts)
        assert resp.status_code == 202 and resp.json()["accepted"] == len(rollouts), resp.text
        (n,) = self.before_ingest
        return n


async def test_a_work_post_reads_passes_and_partials_in_one_round_trip(api, monkeypatch):
    again = await returned_with_partials(api)  # generator B's lease, of prompt a's partials
    (p,) = again["prompts"]
    got = {q["rollout_id"]: q for q in p["partials"]}
    trips = RoundTrips(api, monkeypatch)
    # Partials to check and a lease's generator to fill in: passes and partials, then the lease.
    assert await trips.post(api, "r", completed(got["a-0"], [14])) == 2
    # Partials to check, the generator given: the partials alone.
    own = {**completed(got["a-1"], [22], 0.0), "generator_id": "gen-C"}
    assert await trips.post(api, "r", own) == 1
    # Rollouts of groups of their own read nothing before the script.
    plain = [rollout("own/0", group="own"), rollout("own/1", group="own", reward=0.0)]
    assert await trips.post(api, "r", *plain) == 0
    # A group with an attempt's form of no pass: its pass and partials, and no lease.
    assert await trips.post(api, "r", rollout("n/0", group="nope#1.1")) == 1
