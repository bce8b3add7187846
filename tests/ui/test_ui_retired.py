"""Used up is not waste, on GET /ui in a real headless Chromium against a live broker: a rollout
retired max_reuse (trained as many times as allowed) is counted as used up, apart from the
rollouts retired for every other reason (wasted), in the figure tiles, in the retired-by-reason
card and in where the received rollouts are. A run whose rollouts were all used up shows 0 %
wasted; one that lost rollouts to staleness shows them wasted."""

from __future__ import annotations

from typing import Any

from playwright.async_api import Browser, Page

from tests.ui.conftest import LiveBroker
from tests.ui.test_ui import (
    SHIFT,
    ack,
    create_run,
    expected_figures,
    group,
    lease,
    open_page,
    post,
    set_policy,
    settled,
    until_shown,
)

# The two tiles, and the retired-by-reason card's rows in order: a group ("used up", "wasted")
# or a reason under it.
SHOWN = """() => {
  const text = (e) => e.textContent.replace(/\\s+/g, ' ').trim();
  const tile = (key) => {
    const e = document.querySelector(`.kpi[data-kpi="${key}"]`);
    const parts = ['.k', '.v', '.s'].map((part) => text(e.querySelector(part)));
    return { title: e.title, text: parts.join(' | ') };
  };
  return {
    used_up: tile('used_up'),
    wasted: tile('wasted'),
    rows: [...document.querySelectorAll('#retired table.reasons tr')].map((tr) => tr.dataset.group
      ? ['group', tr.dataset.group, tr.querySelector('[data-field]').dataset.value]
      : ['reason', tr.dataset.reason, tr.querySelector('[data-field]').dataset.value]),
    where: [...document.querySelectorAll('.legend .lab')].map(text),
  };
}"""


async def shown(page: Page) -> dict[str, Any]:
    got: dict[str, Any] = await page.evaluate(SHOWN)
    return got


async def test_rollouts_used_up_are_not_wasted(browser: Browser, broker: LiveBroker) -> None:
    http = broker.http
    # Every rollout trained twice, as max_reuse allows: all used up, none wasted.
    run = "all-used-up"
    await create_run(http, run, group_size=2, max_reuse=2)
    await post(http, run, group("a", 0) + group("b", 0))
    for _ in range(2):
        await ack(http, run, await lease(http, run, 4), SHIFT)
    acc = await settled(http, run)
    assert acc["retired"] == {"max_reuse": 4} and acc["rollouts_received"] == 4
    want = await expected_figures(http, run)
    assert (want["retired_used_up"], want["retired_wasted"]) == (4, 0)

    page, wrong = await open_page(browser, broker.url, run)
    await until_shown(page, want)
    got = await shown(page)
    assert got["wasted"]["text"] == "Wasted | 0 | 0.0% of received"
    assert got["used_up"]["text"] == "Used up | 4 | 100.0% of received · max_reuse 2"
    assert "max_reuse" in got["used_up"]["title"] and "not waste" in got["used_up"]["title"]
    assert "stale" in got["wasted"]["title"] and "run_closed" in got["wasted"]["title"]
    assert got["rows"] == [
        ["group", "used up", "4"],
        ["reason", "max_reuse", "4"],
        ["group", "wasted", "0"],
    ]
    assert "used up: max_reuse" in got["where"]
    await page.close()

    # One group trained once (max_reuse 1), the other left behind by the policy: stale, wasted.
    run = "some-stale"
    await create_run(http, run, group_size=2, max_staleness=0)
    await post(http, run, group("a", 0) + group("b", 0))
    await ack(http, run, await lease(http, run, 2), SHIFT)
    await set_policy(http, run, 1)
    acc = await settled(http, run)
    assert acc["retired"] == {"max_reuse": 2, "stale": 2}
    want = await expected_figures(http, run)
    assert (want["retired_used_up"], want["retired_wasted"]) == (2, 2)

    page, more = await open_page(browser, broker.url, run)
    await until_shown(page, want)
    got = await shown(page)
    assert got["wasted"]["text"] == "Wasted | 2 | 50.0% of received · stale"
    assert got["used_up"]["text"] == "Used up | 2 | 50.0% of received · max_reuse 1"
    assert got["rows"] == [
        ["group", "used up", "2"],
        ["reason", "max_reuse", "2"],
        ["group", "wasted", "2"],
        ["reason", "stale", "2"],
    ]
    assert {"used up: max_reuse", "wasted: stale"} <= set(got["where"])
    assert wrong + more == [], wrong + more
