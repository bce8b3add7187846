"""Wake only as many as can be served: one rollout posted to a run with many long-polling
trainers runs a lease script or two, not one per waiter; a burst reaches as many as it serves."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from tests.helpers import lease, make_run, post, rollout

WAITERS = 16


def broker_of(api: httpx.AsyncClient) -> Any:
    return api._transport.app.state.broker  # type: ignore[attr-defined]


@pytest.fixture
def lease_calls(api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The run of every lease script call the API makes (the real call, counted)."""
    store = broker_of(api).store
    calls: list[str] = []
    real = store.lease

    async def counted(run_id: str, **kw: Any) -> Any:
        calls.append(run_id)
        return await real(run_id, **kw)

    monkeypatch.setattr(store, "lease", counted)
    return calls


async def all_waiting(api: httpx.AsyncClient, run: str, n: int) -> None:
    waker = broker_of(api).waker
    while waker.waiting(run) < n:  # noqa: ASYNC110 - the requests join the line elsewhere
        await asyncio.sleep(0.01)


async def test_one_rollout_wakes_one_of_many_waiting_trainers(api, lease_calls):
    await make_run(api, "r")
    waiting = [asyncio.create_task(lease(api, "r", 1, wait_s=3)) for _ in range(WAITERS)]
    await all_waiting(api, "r", WAITERS)
    # Each tries once the run's wake-ups reach the process (its subscription is confirmed).
    while len(lease_calls) < WAITERS:  # noqa: ASYNC110 - the requests try elsewhere
        await asyncio.sleep(0.01)
    before = len(lease_calls)
    await post(api, "r", rollout("a"))
    done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    assert [t.result().status_code for t in done] == [200]
    # The served trainer passes the wake-up on once (more might be ready); that one finds
    # nothing and stops. Waking every waiter would run WAITERS scripts.
    await all_waiting(api, "r", WAITERS - 1)
    assert len(lease_calls) - before <= 2
    for t in waiting:
        t.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)


async def test_a_burst_reaches_as_many_waiters_as_it_can_serve(api):
    await make_run(api, "r")
    waiting = [asyncio.create_task(lease(api, "r", 1, wait_s=3)) for _ in range(WAITERS)]
    await all_waiting(api, "r", WAITERS)
    await post(api, "r", *[rollout(f"x{i}") for i in range(5)])
    served = []
    while len(served) < 5:
        done, _ = await asyncio.wait(
            [t for t in waiting if t not in served], return_when=asyncio.FIRST_COMPLETED
        )
        served += done
    assert all(t.result().status_code == 200 for t in served)
    ids = {r["rollout_id"] for t in served for r in t.result().json()["rollouts"]}
    assert ids == {f"x{i}" for i in range(5)}
    for t in waiting:
        t.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
