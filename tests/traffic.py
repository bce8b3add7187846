"""What the traffic tests (chaos, failover, resharding) share: the rollouts their generators
send, and the replay of a run's whole event stream that checks what happened to them."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable
from pathlib import Path

import numpy as np
from rollout_broker_client import Accounting, AsyncBrokerClient, Rollout

from app.events import Accepted, Acked, Event, Leased, Retired, Returned
from tests.processes import ApiProcess, Process, broker_env, worker_process

GROUP = 2  # rollouts per group


def brokers(
    redis_env: dict[str, str], database_url: str, prefix: str, logs: Path
) -> tuple[list[ApiProcess], Process]:
    """Two API processes and a worker on the given Redis (``BROKER_REDIS_*``), not started,
    with brisk sweeps, drain reads and long-poll re-checks, so a disturbance is over soon."""
    env = broker_env(
        **redis_env,
        BROKER_DATABASE_URL=database_url,
        BROKER_REDIS_PREFIX=prefix,
        BROKER_SWEEP_INTERVAL_S="0.2",
        BROKER_DRAIN_BLOCK_MS="50",
        BROKER_WAKE_FALLBACK_S="0.5",
    )
    apis = [ApiProcess(env, logs / f"api{i}.log") for i in range(2)]
    return apis, worker_process(env, logs / "worker.log")


def group_of(generator: int, g: int, rng: np.random.Generator) -> list[Rollout]:
    """Group ``g`` of generator ``generator``: GROUP short rollouts with ids of their own."""
    gid = f"g{generator}-{g}"
    out = []
    for k in range(GROUP):
        n = int(rng.integers(2, 12))
        out.append(
            Rollout(
                rollout_id=f"{gid}-{k}",
                group_id=gid,
                policy_version=0,
                response_ids=rng.integers(0, 32_000, size=n),
                logprobs=-rng.random(n).astype(np.float32),
                reward=float(k),
            )
        )
    return out


class Replay:
    """The counts of a sequence of events, folded the way the ledger folds them (additive:
    a rollout leased is out of the buffer until acked, returned or retired)."""

    def __init__(self, events: list[Event]) -> None:
        self.accepted: Counter[str] = Counter()
        self.uses: Counter[str] = Counter()
        self.tokens = 0
        self.acked: set[str] = set()
        self.leased = self.retired = 0
        self.double_leases = 0
        live_lease: dict[str, str] = {}  # rollout_id -> batch holding it
        for e in events:
            body = e.body
            if isinstance(body, Accepted):
                self.accepted.update(i.rollout_id for i in body.items)
                self.tokens += sum(i.tokens for i in body.items)
            elif isinstance(body, Leased):
                self.leased += len(body.items)
                for item in body.items:
                    if item.rollout_id in live_lease:
                        self.double_leases += 1
                    live_lease[item.rollout_id] = body.batch_id
            elif isinstance(body, Acked):
                self.leased -= len(body.items)
                self.acked.add(body.batch_id)
                for a in body.items:
                    self.uses[a.rollout_id] += 1
                    live_lease.pop(a.rollout_id, None)
            elif isinstance(body, Returned):
                self.leased -= len(body.items)
                for r in body.items:
                    live_lease.pop(r.rollout_id, None)
            elif isinstance(body, Retired):
                self.retired += len(body.items)
                for t in body.items:
                    live_lease.pop(t.rollout_id, None)

    @property
    def buffered(self) -> int:
        return sum(self.accepted.values()) - self.leased - self.retired


class Traffic:
    """Two generators (through each client's writer) and two trainers (lease, then ack) on one
    run with ``max_reuse`` 1, while something disturbs the broker: what each side was told is
    kept, and :meth:`check` holds it against the replayed event stream and the accounting.
    The generators go on until ``calm`` is set and each has sent ``min_per_generator``."""

    def __init__(
        self, clients: list[AsyncBrokerClient], run: str, min_per_generator: int, pause_s: float
    ) -> None:
        self.clients, self.run_id = clients, run
        self.min_per_generator, self.pause_s = min_per_generator, pause_s
        self.sent: dict[str, int] = {}  # rollout_id -> tokens, of every rollout sent
        self.acked: list[int] = []  # sizes of the batches the trainers were told are acked
        self.calm = asyncio.Event()  # the last disturbance is behind us
        self.generating = 2

    async def run(self, disturb: Awaitable[None], within: float) -> None:
        """Generators, trainers and ``disturb`` (which sets ``calm``), all to their end."""
        await asyncio.wait_for(
            asyncio.gather(
                self._generate(0), self._generate(1), self._train(0), self._train(1), disturb
            ),
            within,
        )

    async def progressed(self, rollouts: int) -> None:
        """Until the trainers were told ``rollouts`` rollouts were acknowledged."""
        while sum(self.acked) < rollouts:  # noqa: ASYNC110 - the trainers make progress
            await asyncio.sleep(0.02)

    async def _generate(self, i: int) -> None:
        rng = np.random.default_rng(i)
        g = 0
        async with self.clients[i].writer(self.run_id, batch_size=2 * GROUP) as writer:
            while not self.calm.is_set() or g * GROUP < self.min_per_generator:
                for r in group_of(i, g, rng):
                    self.sent[r.rollout_id] = len(r.response_ids)  # type: ignore[arg-type]
                    await writer.add(r)
                g += 1
                await asyncio.sleep(self.pause_s)  # traffic goes on through the disturbance
        self.generating -= 1

    async def _train(self, i: int) -> None:
        client = self.clients[i]
        while self.generating or sum(self.acked) < len(self.sent):
            batch = await client.lease_batch(self.run_id, 4 * GROUP, wait_s=0.5, partial=True)
            if batch is None:
                continue
            result = await client.ack(self.run_id, batch.batch_id)
            self.acked.append(result.consumed)

    def check(self, replay: Replay, acc: Accounting) -> None:
        """No rollout the clients were told was accepted is missing from the stream, none was
        in two live leases at once, each was used exactly once, and the ledger, the live state
        and what the clients were told agree."""
        total = len(self.sent)
        assert total >= 2 * self.min_per_generator
        assert not set(self.sent) - set(replay.accepted)  # lost
        assert set(replay.accepted.values()) == {1}  # accepted once, whatever was retried
        assert replay.double_leases == 0
        assert replay.uses == Counter(dict.fromkeys(self.sent, 1))
        assert acc.rollouts_received == total
        assert acc.samples_consumed == sum(self.acked) == total
        assert acc.tokens_generated == sum(self.sent.values())
        assert acc.buffered == acc.leased == 0
        assert acc.live is not None and (acc.live.buffered, acc.live.leased) == (0, 0)
        assert acc.dead_letters == 0
        assert acc.batches.acked == len(self.acked)

    def summary(self, replay: Replay) -> str:
        lost = set(self.sent) - set(replay.accepted)
        return (
            f"{len(self.sent)} rollouts sent, {sum(replay.accepted.values())} accepted, "
            f"{len(lost)} lost, {replay.double_leases} double leases, "
            f"{len(self.acked)} batches acked"
        )
