"""The consumers of a run on GET /ui, in a real headless Chromium against a live broker: a note
while the run has none, then a row per consumer (driven through the store on the broker's Redis)
with its delivered, acked, pending and dropped items exactly as the accounting's JSON has them
(first the broker's own, then an answer doctored on its way to the page so that every figure is
one no other shows), and n/a from a broker that does not report them."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from playwright.async_api import Browser

from app.broker.store import RedisStore
from tests.ui.conftest import LiveBroker
from tests.ui.test_ui import (
    SHIFT,
    ack,
    create_run,
    doctor,
    expected_figures,
    group,
    lease,
    open_page,
    post,
    settled,
    until_shown,
)

CONSUMERS = {  # every figure distinct, and none another card shows
    "rm": {"delivered": 9_871, "acked": 6_543, "pending": 2_109, "dropped": 1_219},
    "dpo.v2": {"delivered": 777, "acked": 701, "pending": 76, "dropped": 0},
}


def shown_consumers(consumers: dict[str, dict[str, int]]) -> dict[str, Any]:
    return {f"consumers.{n}.{k}": v for n, counts in consumers.items() for k, v in counts.items()}


async def test_page_shows_each_consumer(
    browser: Browser,
    store: RedisStore,
    broker: LiveBroker,
    tmp_path: Path,
) -> None:
    http = broker.http
    run = "cons-page"
    await create_run(http, run, group_size=2)
    await post(http, run, group("g1", 0))
    await settled(http, run)
    want = await expected_figures(http, run)
    assert not any(k.startswith("consumers") for k in want)  # none: an empty map

    page, wrong = await open_page(browser, broker.url, run)
    await until_shown(page, want)
    card = page.locator("#consumers")
    assert "No consumers" in (await card.locator('[data-empty="consumers"]').inner_text())
    assert await card.locator("tbody tr").count() == 0

    # Two consumers: rm keeps 3 of the 4 rollouts received after its creation, acks one
    # and holds one leased; dpo.v2 sees the two that reach a gradient.
    await store.create_consumer(run, "rm", source="received", retention_rollouts=3)
    await store.create_consumer(run, "dpo.v2", source="trained")
    await post(http, run, group("g2", 0) + group("g3", 0))
    await ack(http, run, await lease(http, run, 2), SHIFT)
    for settle in (store.consumer_ack, None):
        bid = uuid.uuid4().hex
        got = await store.consumer_lease(run, "rm", batch_id=bid, size=1, lease_ms=60_000)
        assert got is not None and len(got.rollout_ids) == 1
        if settle is not None:
            await settle(run, "rm", bid)
    acc = await settled(http, run)
    assert acc["consumers"] == {
        "dpo.v2": {"delivered": 2, "acked": 0, "pending": 2, "dropped": 0},
        "rm": {"delivered": 4, "acked": 1, "pending": 2, "dropped": 1},
    }
    want = await expected_figures(http, run)
    await until_shown(page, want)
    rows = card.locator("tbody tr")
    assert [await rows.nth(i).get_attribute("data-consumer") for i in range(2)] == [
        "dpo.v2",
        "rm",
    ]
    assert await card.locator('[data-empty="consumers"]').count() == 0
    dropped = card.locator('[data-field="consumers.rm.dropped"]')
    assert await dropped.get_attribute("class") == "over"
    assert (
        await card.locator('[data-field="consumers.dpo.v2.dropped"]').get_attribute("class") is None
    )
    shot = tmp_path / "ui-consumers.png"
    await page.screenshot(path=str(shot), full_page=True)
    print(f"\nscreenshot of the page: {shot}")

    # A doctored answer: every consumer figure one no other shows.
    await page.route(
        "**/v1/runs/*/accounting", doctor(lambda body: body.update(consumers=CONSUMERS))
    )
    without = {k: v for k, v in want.items() if not k.startswith("consumers.")}
    await until_shown(page, without | shown_consumers(CONSUMERS))

    # A broker that does not report them: n/a there, the rest as before.
    await page.unroute_all(behavior="wait")
    await page.route("**/v1/runs/*/accounting", doctor(lambda body: body.pop("consumers")))
    await until_shown(page, without | {"consumers": "n/a"})
    await page.unroute_all(behavior="wait")
    await until_shown(page, want)
    assert wrong == [], wrong
