"""The bias figures on GET /ui, in a real headless Chromium against a live broker: the two length
distributions drawn side by side on the same buckets, every bucket's count, the KS distance and
the four means exactly as the JSON has them (first the broker's own, then an answer doctored on
its way to the page so that every figure is one no other shows), and n/a from a broker that does
not report them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from playwright.async_api import Browser

from tests.services import RedisBackend
from tests.ui.conftest import live_broker
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

BIAS: dict[str, Any] = {
    "length": {
        "generated_mean": 123.4567,
        "trained_mean": 45.6789,
        "ks": 0.3125,  # above the alert's 0.2: marked
        "histogram": {
            "generated": {"0": 3, "40": 11, "194": 17, "1024": 29},
            "trained": {"40": 31, "194": 7},
        },
    },
    "reward": {"generated_mean": 0.5432, "trained_mean": -0.2109},
}


def shown_bias() -> dict[str, Any]:
    length, reward = BIAS["length"], BIAS["reward"]
    want: dict[str, Any] = {
        f"bias.length.{k}": length[k] for k in ("generated_mean", "trained_mean", "ks")
    }
    want |= {f"bias.reward.{k}": v for k, v in reward.items()}
    for side, counts in length["histogram"].items():
        want |= {f"bias.length.histogram.{side}.{first}": n for first, n in counts.items()}
    return want


async def test_page_shows_the_two_length_distributions_side_by_side(
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
        run = "bias-page"
        await create_run(http, run, group_size=2)
        # Short and long groups; only the short ones are trained: a length bias.
        await post(http, run, group("g1", 0, tokens=3) + group("g2", 0, tokens=5))
        await ack(http, run, await lease(http, run, 4), SHIFT)
        await post(http, run, group("g3", 0, tokens=300) + group("g4", 0, tokens=900))
        await settled(http, run)
        want = await expected_figures(http, run)
        bias = {k: v for k, v in want.items() if k.startswith("bias.")}
        assert 0 < bias["bias.length.ks"] < 1
        assert any(k.startswith("bias.length.histogram.trained.") for k in bias)

        page, wrong = await open_page(browser, broker.url, run)
        await until_shown(page, want)
        # Side by side: two charts in the card, level with each other, received on the left,
        # each with a bar per bucket either side has.
        # The page redraws every card on each refresh, so the two sides are measured in one
        # evaluation: locators taken one after another may meet a card already replaced.
        sides = await page.locator("#bias").evaluate(
            """card => [...card.querySelectorAll(".bias-side")].map(side => {
                const box = side.getBoundingClientRect();
                return { x: box.x, y: box.y, width: box.width, name: side.dataset.side,
                         bars: side.querySelectorAll("svg g title").length };
            })"""
        )
        assert len(sides) == 2
        left, right = sides
        assert left["y"] == right["y"] and left["x"] + left["width"] <= right["x"]
        assert (left["name"], right["name"]) == ("generated", "trained")
        buckets = {k.rsplit(".", 1)[1] for k in bias if ".histogram." in k}
        assert left["bars"] == right["bars"] == len(buckets)
        shot = tmp_path / "ui-bias.png"
        await page.screenshot(path=str(shot), full_page=True)
        print(f"\nscreenshot of the page: {shot}")

        # A doctored answer: every bias figure one no other shows.
        await page.route("**/v1/runs/*/accounting", doctor(lambda body: body.update(bias=BIAS)))
        without = {k: v for k, v in want.items() if not k.startswith("bias.")}
        await until_shown(page, without | shown_bias())
        ks = page.locator('[data-field="bias.length.ks"]')
        assert await ks.get_attribute("class") == "over"

        # A broker that does not report them: n/a there, the rest as before.
        await page.unroute_all(behavior="wait")
        await page.route("**/v1/runs/*/accounting", doctor(lambda body: body.pop("bias")))
        await until_shown(page, without | {"bias": "n/a"})
        await page.unroute_all(behavior="wait")
        await until_shown(page, want)
        assert wrong == [], wrong
