"""The KL chart of GET /ui (KL mean and max by trainer version) in a real headless Chromium
against a live broker: its y axis is scaled to the values drawn, its top at or above the largest
and at most a round step above it, below 0 when a value is (the k1 estimator's KL can be
negative); every bar and whisker is inside the plot; the run's kl_max is drawn as a line when it
is near the values and marked at the top edge when it is far above them; and a run with more
versions than the chart draws says so, and where its largest KL was when that is older."""

from __future__ import annotations

from typing import Any

import httpx
from playwright.async_api import Browser, Page

from tests.helpers import rollout
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

SPIKE = 0.5  # a shift whose k3 KL (e^-0.5 - 1 + 0.5 = 0.107) is above kl_max 0.05
ROUND_STEP = 1.25  # the largest step of the axis' round tops (8 -> 10)
EPS = 1e-9  # relative: a label reads 0.3 where the value is 0.30000000000000004
DRAWN = 40  # the versions the chart draws, the newest

# The KL chart as drawn: the plot's top and bottom (its grid lines), the y-axis labels (value
# read from the text), the bars' and whiskers' extents, the kl_max lines and the marks of lines
# above the axis, and the notes beside it.
CHART = """() => {
  const card = document.querySelector('#off-policy');
  const svg = card.querySelector('.chart svg');
  const at = (e, name) => Number(e.getAttribute(name));
  const rules = [...svg.querySelectorAll('line.grid, line.axis')].map((l) => at(l, 'y1'));
  return {
    top: Math.min(...rules),
    bottom: Math.max(...rules),
    ticks: [...svg.querySelectorAll('text[text-anchor="end"]')].filter((t) => at(t, 'x') < 46)
      .map((t) => [Number(t.textContent), at(t, 'y') - 3.5]),
    bars: [...svg.querySelectorAll('g rect')]
      .filter((r) => r.getAttribute('fill') !== 'transparent')
      .map((r) => [at(r, 'y'), at(r, 'y') + at(r, 'height')]),
    whiskers: [...svg.querySelectorAll('g line')].map((l) => [at(l, 'y1'), at(l, 'y2')]),
    thresholds: [...svg.querySelectorAll('line.threshold')].map((l) => at(l, 'y1')),
    marks: [...svg.querySelectorAll('text')].map((t) => t.textContent)
      .filter((t) => t.includes('above the axis')),
    legend: card.querySelector('.chart-legend').textContent,
    notes: [...card.querySelectorAll('.note')].map((n) => n.textContent),
  };
}"""


async def chart(page: Page) -> dict[str, Any]:
    drawn: dict[str, Any] = await page.evaluate(CHART)
    return drawn


def inside(drawn: dict[str, Any]) -> None:
    """Every bar and whisker of the chart is within its plot (half a pixel of rounding)."""
    top, bottom = drawn["top"], drawn["bottom"]
    for y0, y1 in drawn["bars"] + drawn["whiskers"]:
        assert top - 0.5 <= min(y0, y1) and max(y0, y1) <= bottom + 0.5, (drawn, y0, y1)


async def trained(http: httpx.AsyncClient, run_id: str) -> list[dict[str, Any]]:
    resp = await http.get(f"/v1/runs/{run_id}/accounting/training")
    assert resp.status_code == 200, resp.text
    versions: list[dict[str, Any]] = resp.json()["versions"]
    return versions


async def shown(browser: Browser, broker: LiveBroker, run_id: str) -> tuple[Page, list[str]]:
    page, wrong = await open_page(browser, broker.url, run_id)
    await until_shown(page, await expected_figures(broker.http, run_id))
    return page, wrong


async def two_versions(http: httpx.AsyncClient, run_id: str, first: float, then: float) -> None:
    """A group trained at version 0 with the current policy's logprobs shifted by ``first``,
    another at version 1 shifted by ``then``."""
    for version, shift in enumerate((first, then)):
        await post(http, run_id, group(f"g{version}", version))
        await ack(http, run_id, await lease(http, run_id, 2), shift)
        await set_policy(http, run_id, version + 1)
    await settled(http, run_id)


async def test_kl_chart_is_scaled_to_the_values_drawn(browser: Browser, broker: LiveBroker) -> None:
    http = broker.http
    problems: list[str] = []

    # A KL above kl_max (0.05): the axis reaches it, kl_max is a line within the plot.
    await create_run(http, "kl-above", group_size=2)
    await two_versions(http, "kl-above", SPIKE, SHIFT)
    acc = await settled(http, "kl-above")
    assert acc["kl"]["max"] > 0.1
    page, wrong = await shown(browser, broker, "kl-above")
    drawn = await chart(page)
    problems += wrong
    top = max(v for v, _ in drawn["ticks"])
    assert acc["kl"]["max"] * (1 - EPS) <= top <= ROUND_STEP * acc["kl"]["max"], drawn
    inside(drawn)
    assert len(drawn["thresholds"]) == 1 and drawn["marks"] == []
    assert drawn["top"] <= drawn["thresholds"][0] <= drawn["bottom"]
    await page.close()

    # KL far below kl_max (1.0): the bars are not flattened under it; kl_max is marked at the
    # top edge, above the axis.
    await create_run(http, "kl-low", group_size=2, kl_max=1.0)
    await two_versions(http, "kl-low", SHIFT, 2 * SHIFT)
    largest = max(v["kl_max"] for v in await trained(http, "kl-low"))
    assert largest < 0.01
    page, wrong = await shown(browser, broker, "kl-low")
    drawn = await chart(page)
    problems += wrong
    top = max(v for v, _ in drawn["ticks"])
    assert largest * (1 - EPS) <= top <= ROUND_STEP * largest, drawn
    inside(drawn)
    assert drawn["thresholds"] == [] and drawn["marks"] == ["▲ kl_max 1.00, above the axis"]
    await page.close()

    # The k1 estimator: a version whose KL is negative is drawn below 0, inside the plot.
    await create_run(http, "kl-k1", group_size=2, kl_estimator="k1")
    await two_versions(http, "kl-k1", -0.3, SHIFT)
    means = [v["kl_mean"] for v in await trained(http, "kl-k1")]
    assert min(means) < -0.2 and max(means) > 0
    page, wrong = await shown(browser, broker, "kl-k1")
    drawn = await chart(page)
    problems += wrong
    assert min(v for v, _ in drawn["ticks"]) <= min(means) * (1 - EPS), drawn
    inside(drawn)
    await page.close()
    assert problems == [], problems


async def test_kl_chart_says_when_the_largest_kl_is_older_than_the_versions_drawn(
    browser: Browser, broker: LiveBroker
) -> None:
    http = broker.http
    run, versions = "kl-long", DRAWN + 5
    await create_run(http, run)
    for version in range(versions):  # one rollout trained at each version; a spike at 1
        await post(http, run, [rollout(f"r{version}", version)])
        await ack(http, run, await lease(http, run, 1), SPIKE if version == 1 else SHIFT)
        await set_policy(http, run, version + 1)
    acc = await settled(http, run)
    rows = await trained(http, run)
    assert len(rows) == versions and rows[1]["kl_max"] == acc["kl"]["max"] > 0.1

    page, wrong = await shown(browser, broker, run)
    drawn = await chart(page)
    assert len(drawn["bars"]) == DRAWN
    assert f"(the last {DRAWN} of {versions})" in drawn["legend"]
    older = "The largest KL max, 0.107 at trainer v1, is older than the versions drawn."
    assert older in drawn["notes"]
    inside(drawn)
    assert wrong == [], wrong
