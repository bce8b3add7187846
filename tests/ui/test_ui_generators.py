"""The per-generator figures and the β of the adaptive KL penalty on GET /ui, in a real headless
Chromium against a live broker: the page shows ``/accounting/generators`` row by row, the run's
``kl_coef`` and each trainer version's exactly as the JSON has them (answers doctored on their
way to the page, so that every figure is one no other shows), and n/a from a broker that does
not serve the generators."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
from playwright.async_api import Browser, Route

from tests.services import RedisBackend
from tests.ui.conftest import live_broker
from tests.ui.test_ui import (
    INTERVAL_S,
    SHIFT,
    WAIT_MS,
    ack,
    create_run,
    expected_figures,
    group,
    lease,
    post,
    settled,
    until_shown,
    watch,
)

GENERATORS = {
    "generators": [
        {
            "generator_id": "vllm-0",
            "rollouts": 1_234,
            "tokens": 98_765,
            "samples_consumed": 2_345,
            "kl": {"mean": 0.0123, "max": 0.0456},
            "is_ratio": {"mean": 1.0021, "clip_fraction": 0.0345},
            "masked_fraction": 0.0067,
            "last_seen": "2026-12-06T03:30:12.345000Z",
            "quarantined": False,
        },
        {
            "generator_id": "vllm-1",
            "rollouts": 56,
            "tokens": 4_321,
            "samples_consumed": 0,
            "kl": {"mean": None, "max": None},
            "is_ratio": {"mean": None, "clip_fraction": None},
            "masked_fraction": None,
            "last_seen": None,
            "quarantined": True,
        },
    ],
    "as_of": None,
    "pending_events": 0,
}
BETA = 0.0789  # the run's β
BETA_AT = 0.0312  # each trainer version's


def shown_generators() -> dict[str, Any]:
    want: dict[str, Any] = {}
    for g in GENERATORS["generators"]:
        k = f"generators.{g['generator_id']}."
        want |= {
            k + "generator_id": g["generator_id"],
            k + "rollouts": g["rollouts"],
            k + "tokens": g["tokens"],
            k + "samples_consumed": g["samples_consumed"],
            k + "kl.mean": g["kl"]["mean"],
            k + "kl.max": g["kl"]["max"],
            k + "is_ratio.mean": g["is_ratio"]["mean"],
            k + "is_ratio.clip_fraction": g["is_ratio"]["clip_fraction"],
            k + "masked_fraction": g["masked_fraction"],
            k + "last_seen": g["last_seen"],
            k + "quarantined": "true" if g["quarantined"] else "false",
        }
    return want


async def test_page_shows_each_generator_and_the_beta(
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
        run = "gen-page"
        await create_run(http, run, group_size=2)
        await post(http, run, group("g1", 0) + group("g2", 0))
        await ack(http, run, await lease(http, run, 2), SHIFT)
        await settled(http, run)
        want = await expected_figures(http, run)
        # What the broker says now: no generator named, no β.
        assert not any(k.startswith("generators.") for k in want) and want["kl_coef"] is None
        trainer_versions = [k for k in want if k.startswith("training.") and k.endswith(".kl_coef")]
        assert trainer_versions

        page = await browser.new_page(viewport={"width": 1440, "height": 900})
        page.set_default_timeout(WAIT_MS)
        wrong = watch(page, broker.url)

        async def generators(route: Route) -> None:
            await route.fulfill(json=GENERATORS)

        async def beta(route: Route) -> None:
            real = await route.fetch()
            body = await real.json()
            body["kl_coef"] = BETA
            await route.fulfill(response=real, json=body)

        async def beta_at(route: Route) -> None:
            real = await route.fetch()
            body = await real.json()
            for row in body["versions"]:
                row["kl_coef"] = BETA_AT
            await route.fulfill(response=real, json=body)

        await page.route("**/v1/runs/*/accounting/generators", generators)
        await page.route("**/v1/runs/*/accounting", beta)
        await page.route("**/v1/runs/*/accounting/training", beta_at)
        await page.goto(f"{broker.url}/ui?interval={INTERVAL_S}#run={quote(run)}")
        doctored = want | shown_generators() | {"kl_coef": BETA}
        doctored |= {k: BETA_AT for k in trainer_versions}
        await until_shown(page, doctored)
        quarantined = page.locator('[data-field="generators.vllm-1.quarantined"]')
        assert await quarantined.text_content() == "quarantined"
        assert await quarantined.get_attribute("class") == "over"
        shot = tmp_path / "ui-generators.png"
        await page.screenshot(path=str(shot), full_page=True)
        print(f"\nscreenshot of the page: {shot}")

        # A broker that does not serve the generators: n/a there, the rest as before.
        await page.unroute("**/v1/runs/*/accounting/generators")
        await page.route(
            "**/v1/runs/*/accounting/generators",
            lambda route: route.fulfill(
                status=404, json={"error": "NotFound", "detail": "Not Found"}
            ),
        )
        without = {k: v for k, v in doctored.items() if not k.startswith("generators.")}
        await until_shown(page, without | {"generators": "n/a"})
        await page.unroute("**/v1/runs/*/accounting/generators")
        await page.unroute("**/v1/runs/*/accounting")
        await page.unroute("**/v1/runs/*/accounting/training")
        await until_shown(page, want)
        assert wrong == [], wrong


async def test_expected_figures_read_the_generators(monkeypatch: Any) -> None:
    """The figures the other page tests expect include the generators, row by row."""
    from tests.ui.test_ui import generator_figures

    ok = httpx.Response(200, json=GENERATORS)
    assert generator_figures(ok) == shown_generators()
    assert generator_figures(httpx.Response(404, json={})) == {"generators": "n/a"}
