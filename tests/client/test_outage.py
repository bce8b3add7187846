"""A Redis outage under a generator and a trainer: the test's own redis-server (AOF, fsync always)
under a uvicorn process is SIGKILLed while rollouts stream in and a batch is being acked, the API
answers 503 with Retry-After, Redis starts again on the same port from its append-only file, and
the client's writers and acks complete: every rollout reaches the broker and a gradient exactly
once. A writer whose deadline ends within the outage raises with its unsent rollouts, keeps
them, and sends them once Redis is back."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from rollout_broker_client import AsyncBrokerClient, Batch, Retry, Rollout, Unavailable

from tests.processes import ApiProcess, RedisServer, broker_env

RUN = "outage"
N = 160  # rollouts from the streaming generator
LATE = 6  # rollouts of the impatient writer


def rollout(rid: str) -> Rollout:
    return Rollout(rid, 0, [1, 2, 3], 1.0, [-0.5, -0.6, -0.7])


async def until(condition: Callable[[], object], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


@pytest.mark.slow
async def test_a_redis_outage_loses_and_doubles_nothing(tmp_path: Path) -> None:
    redis_server = RedisServer(tmp_path)
    await redis_server.start()
    api = ApiProcess(
        broker_env(BROKER_REDIS_URL=redis_server.url, BROKER_REDIS_PREFIX="rb"),
        tmp_path / "api.log",
    )
    statuses: Counter[tuple[str, int]] = Counter()
    retry_afters: set[str | None] = set()

    async def seen(resp: httpx.Response) -> None:
        kind = resp.request.url.path.rsplit("/", 1)[-1]
        statuses[(kind, resp.status_code)] += 1
        if resp.status_code == 503:
            retry_afters.add(resp.headers.get("retry-after"))

    hooks = {"response": [seen]}
    patient = Retry(deadline_s=15.0, backoff_s=0.05, max_backoff_s=0.5)
    try:
        await api.start()
        async with (
            httpx.AsyncClient(base_url=api.url, event_hooks=hooks) as http,
            AsyncBrokerClient(http=http, retry=patient) as client,
        ):
            await client.create_run(RUN, {"max_reuse": 1, "order": "fifo"})
            writer = client.writer(RUN, batch_size=8)
            trained: list[str] = []

            async def generate() -> None:
                async with writer:
                    for i in range(N // 2):
                        await writer.add(rollout(f"g{i}-0"), rollout(f"g{i}-1"))
                        await asyncio.sleep(0.01)

            async def train(batch: Batch) -> None:
                result = await client.ack(
                    RUN, batch.batch_id, kl={r.rollout_id: 0.0 for r in batch}
                )
                assert result.consumed == len(batch)
                trained.extend(r.rollout_id for r in batch)

            generator = asyncio.create_task(generate())
            await until(lambda: writer.accepted >= 40, 10, "the first rollouts")
            held = await client.lease_batch(RUN, 8)
            assert held is not None

            await redis_server.kill()
            outage = time.monotonic()
            acking = asyncio.create_task(train(held))  # an ack in flight through the outage
            impatient = AsyncBrokerClient(
                http=http, retry=Retry(deadline_s=1.0, backoff_s=0.05, max_backoff_s=0.2)
            )
            late = impatient.writer(RUN, batch_size=LATE)
            with pytest.raises(Unavailable) as gave_up:
                await late.add(*[rollout(f"late-{k}") for k in range(LATE)])
            unsent = gave_up.value.unsent
            assert [r.rollout_id for r in unsent if isinstance(r, Rollout)] == [
                f"late-{k}" for k in range(LATE)
            ]
            assert late.pending == LATE  # kept, to send once the broker is back
            await until(
                lambda: statuses[("rollouts", 503)] and statuses[("ack", 503)],
                10,
                "the writer's and the ack's requests to meet the outage",
            )
            await asyncio.sleep(max(0.0, 1.5 - (time.monotonic() - outage)))

            await redis_server.start()  # the same port, from its append-only file
            await asyncio.wait_for(asyncio.gather(generator, acking), 15)
            await late.flush()
            assert late.pending == 0
            await impatient.close()
            while len(trained) < N + LATE:
                batch = await client.lease_batch(RUN, 8, wait_s=1.0, partial=True)
                assert batch is not None, f"{N + LATE - len(trained)} rollouts never came"
                await train(batch)
            assert await client.lease_batch(RUN, 1, partial=True) is None

        sent = {f"g{i}-{k}" for i in range(N // 2) for k in range(2)}
        sent |= {f"late-{k}" for k in range(LATE)}
        assert Counter(trained) == Counter(sent)  # every rollout trained on, each exactly once
        assert writer.accepted + writer.duplicates == N and writer.pending == 0
        assert late.accepted + late.duplicates == LATE
        assert statuses[("rollouts", 503)] and statuses[("ack", 503)]
        assert retry_afters == {"1"}  # every 503 said when to come back
        assert not [s for s in statuses if s[1] >= 500 and s[1] != 503]
    finally:
        await api.stop()
        await redis_server.kill()
