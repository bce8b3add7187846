"""The reward figures on GET /ui, in a real headless Chromium against a live broker: rollouts
posted without a reward, some scored by a reward worker, some in its live lease and some still
awaiting one; the page shows the accounting's ``rewards`` counts, ``wait.reward_s`` and the mean
wait per rollout scored, exactly as the JSON has them, and n/a from a broker that does not
report them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from playwright.async_api import Browser, Route

from tests.helpers import rollout
from tests.services import RedisBackend
from tests.ui.conftest import live_broker
from tests.ui.test_ui import (
    create_run,
    expected_figures,
    open_page,
    post,
    settled,
    until_shown,
)


def unscored(rid: str) -> dict[str, Any]:
    doc = rollout(rid, 0, tokens=3)
    del doc["reward"]
    return doc


async def reward_lease(http: httpx.AsyncClient, run_id: str, k: int, lid: str) -> list[str]:
    resp = await http.post(
        f"/v1/runs/{run_id}/rewards/lease", json={"max_rollouts": k, "lease_id": lid}
    )
    assert resp.status_code == 200, resp.text
    return [r["rollout_id"] for r in resp.json()["rollouts"]]


async def test_page_shows_the_reward_figures(
    browser: Browser,
    redis_backend: RedisBackend,
    database_url: str,
    prefix: str,
    tmp_path: Path,
) -> None:
    async with live_broker(
        redis_backend, database_url, prefix, tmp_path, BROKER_AUTH="off"
    ) as broker:
        http = broker.http
        run = "rm-scored"
        await create_run(http, run)
        await post(http, run, [unscored(f"u{i}") for i in range(7)])
        scored = await reward_lease(http, run, 3, "worker-a-1")
        resp = await http.post(
            f"/v1/runs/{run}/rewards",
            json={"rewards": {rid: 0.5 for rid in scored}, "lease_id": "worker-a-1"},
        )
        assert resp.status_code == 200, resp.text
        held = await reward_lease(http, run, 2, "worker-a-2")  # held: leased
        assert len(scored) == 3 and len(held) == 2
        acc = await settled(http, run)
        # Every count differs, so a figure cannot show another's.
        assert acc["rewards"] == {"awaiting": 2, "leased": 2, "scored": 3, "timed_out": 0}
        assert acc["wait"]["reward_s"] > 0
        want = await expected_figures(http, run)
        assert want["rewards.mean_wait_s"] == acc["wait"]["reward_s"] / 3

        page, wrong = await open_page(browser, broker.url, run)
        await until_shown(page, want)
        shot = tmp_path / "ui-rewards.png"
        await page.screenshot(path=str(shot), full_page=True)
        print(f"\nscreenshot of the page: {shot}")

        # A broker that does not report them: n/a, and no reward wait among the waits.
        async def older(route: Route) -> None:
            real = await route.fetch()
            body = await real.json()
            del body["rewards"]
            del body["wait"]["reward_s"]
            body["live"].pop("rewards", None)
            await route.fulfill(response=real, json=body)

        without = {
            k: v
            for k, v in want.items()
            if not k.startswith(("rewards.", "live.rewards.")) and k != "wait.reward_s"
        }
        await page.route("**/v1/runs/*/accounting", older)
        try:
            await until_shown(page, without | {"rewards": "n/a"})
        finally:
            await page.unroute("**/v1/runs/*/accounting")
        await until_shown(page, want)
        assert wrong == [], wrong
