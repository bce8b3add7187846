"""The page's layout in a real headless Chromium against a live broker: at window widths of 1,024,
1,280 and 1,400 px the document is no wider than the window, no card reaches past its edge and
no card's content runs past the card or is cut off, for a run with figures in every card, five
retirement reasons and long ids (run, generator, consumer), and then on an answer doctored on
its way to the page with every retirement reason and every count in the millions."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import httpx
from playwright.async_api import Browser, Page
from playwright.async_api import TimeoutError as PlaywrightTimeout

from app.broker.store import RedisStore
from tests.helpers import rollout
from tests.ui.conftest import LiveBroker
from tests.ui.test_ui import (
    create_run,
    doctor,
    drive,
    expected_figures,
    group,
    open_page,
    post,
    settled,
    until_shown,
)

# The longest ids the broker takes are 128 characters for a run, 64 for a consumer; this run id
# has no hyphen, where a browser would break a line by itself.
LONG_RUN = (
    "grpo_qwen2.5_math_7b_instruct.lr_1e_6.kl_0.02.group_16.reuse_2.staleness_1."
    "ctx_8192.seed_1234.ablation_longer_warmup.2026_12_06"
)
GENERATOR = "vllm-engine-a100-80gb-rack17-node042-gpu3-replica-0f3c9a27e5b14d6f8a0b2c4d6e8f0a1b"
CONSUMER = "reward_model_trainer.preference_pairs.helpful_and_harmless.v2"
REASONS = (  # every reason a rollout retires for (SPEC, app/events/codec.py)
    "max_reuse",
    "stale",
    "kl",
    "kl_flush",
    "run_closed",
    "incomplete_group",
    "zero_variance",
    "rewound",
    "reward_timeout",
    "quarantined",
)
WIDTHS = (1024, 1280, 1400)
GROUP_TIMEOUT_S = 0.5  # a group still incomplete after this retires incomplete_group

# What does not fit at the window's width: the document's and the window's widths; the boxes
# (cards, figure tiles, the run's header, the run list) reaching past the window; the elements
# reaching past their box (those inside an element that clips are its business: a scrolling
# table, a text cut with an ellipsis); and the figures cut off by an element that clips without
# scrolling.
LAYOUT = """() => {
  const width = window.innerWidth;
  const clips = (e) => getComputedStyle(e).overflowX !== 'visible';
  const name = (e) => e.tagName.toLowerCase() + (e.id ? '#' + e.id : '')
    + (e.getAttribute('class') ? '.' + e.getAttribute('class').split(' ').join('.') : '')
    + ' "' + (e.textContent || '').trim().slice(0, 40) + '"';
  const scrollWidth = document.documentElement.scrollWidth;
  const out = { width, scrollWidth, outside: [], spill: [], cut: [] };
  const boxes = 'section.card, .kpi, section.runhead, aside.runs, .big > div';
  for (const box of document.querySelectorAll(boxes)) {
    const b = box.getBoundingClientRect();
    if (b.left < 0 || b.right > width) out.outside.push(name(box) + ' right ' + b.right);
    const walk = (e) => {
      for (const kid of e.children) {
        const r = kid.getBoundingClientRect();
        if (r.width && (r.right > b.right + 0.5 || r.left < b.left - 0.5)) {
          const by = Math.round(r.right - b.right);
          out.spill.push(name(kid) + ' past ' + name(box) + ' by ' + by + ' px');
        } else if (!clips(kid)) walk(kid);
      }
    };
    walk(box);
  }
  for (const f of document.querySelectorAll('[data-field]')) {
    const r = f.getBoundingClientRect();
    if (!r.width) continue;
    for (let a = f.parentElement; a; a = a.parentElement) {
      if (!['hidden', 'clip'].includes(getComputedStyle(a).overflowX)) continue;
      const c = a.getBoundingClientRect();
      if (r.right > c.right + 0.5 || r.left < c.left - 0.5) {
        out.cut.push(f.getAttribute('data-field') + ' in ' + name(a));
      }
    }
  }
  out.retired = document.querySelector('#retired').getBoundingClientRect().right;
  return out;
}"""

FITS = f"""() => {{
  const got = ({LAYOUT})();
  return got.scrollWidth <= got.width
    && !got.outside.length && !got.spill.length && !got.cut.length;
}}"""


async def fits(page: Page, width: int) -> None:
    """At ``width``: the page fits the window once it has laid itself out again (its charts are
    redrawn at their new width a moment after a resize); else what does not fit is the failure's
    message."""
    await page.set_viewport_size({"width": width, "height": 900})
    with contextlib.suppress(PlaywrightTimeout):
        await page.wait_for_function(FITS, timeout=5_000, polling=100)
    got = await page.evaluate(LAYOUT)
    assert got["width"] == width
    wrong = [f"the document is {got['scrollWidth']} px wide"] if got["scrollWidth"] > width else []
    wrong += [f"outside the window: {x}" for x in got["outside"]]
    wrong += [f"spills: {x}" for x in got["spill"]]
    wrong += [f"cut off: {x}" for x in got["cut"]]
    assert not wrong, f"at {width} px:\n" + "\n".join(wrong)
    assert got["retired"] <= width  # the "Retired by reason" card, as it was seen cut off


async def busy_run(http: httpx.AsyncClient, store: RedisStore, run_id: str) -> dict[str, Any]:
    """A run with something in every card: the traffic of the main page test (samples at lag 0
    and 1, retired max_reuse, kl and stale, duplicates, a rejection, masked tokens, rollouts
    buffered and leased), a group of a long-named generator, one whose rewards are equal
    (zero_variance), one left incomplete (incomplete_group), two rollouts awaiting a reward,
    prompts registered and a consumer; its accounting once settled."""
    await create_run(
        http,
        run_id,
        group_size=2,
        max_reuse=2,
        max_staleness=1,
        stale_tokens="mask",
        drop_zero_variance_groups=True,
        group_timeout_s=GROUP_TIMEOUT_S,
    )
    await store.create_consumer(run_id, CONSUMER, source="received")
    await drive(http, run_id)
    await post(http, run_id, [r | {"generator_id": GENERATOR} for r in group("gen", 2)])
    await post(http, run_id, [rollout(f"same-{k}", 2, group="same", reward=0.5) for k in range(2)])
    unscored = [rollout(f"unscored-{k}", 2, group="unscored") for k in range(2)]
    await post(http, run_id, [{k: v for k, v in r.items() if k != "reward"} for r in unscored])
    await post(http, run_id, group("half", 2)[:1])
    resp = await http.post(
        f"/v1/runs/{run_id}/prompts",
        json={"prompts": [{"prompt_id": f"prompt-{k}", "prompt_ids": [1, 2, 3]} for k in range(3)]},
    )
    assert resp.status_code == 202, resp.text
    deadline = time.monotonic() + 20
    while "incomplete_group" not in (acc := await settled(http, run_id))["retired"]:
        assert time.monotonic() < deadline, f"the half group did not retire: {acc['retired']}"
        await asyncio.sleep(GROUP_TIMEOUT_S / 5)
    return acc


def in_the_millions(body: Any) -> Any:
    """Every count of an answer made a number in the millions (zeros too), floats kept."""
    if isinstance(body, dict):
        return {k: in_the_millions(v) for k, v in body.items()}
    if isinstance(body, list):
        return [in_the_millions(v) for v in body]
    if isinstance(body, int) and not isinstance(body, bool):
        return 1_234_567 + 1_000_003 * body
    return body


def every_reason_in_the_millions(body: dict[str, Any]) -> None:
    body.update(in_the_millions(body))
    body["retired"] = {reason: 9_876_543 + 1_000_003 * i for i, reason in enumerate(REASONS)}


async def test_page_fits_the_window(
    browser: Browser, store: RedisStore, broker: LiveBroker, tmp_path: Path
) -> None:
    http = broker.http
    acc = await busy_run(http, store, LONG_RUN)
    assert {"max_reuse", "stale", "kl", "zero_variance", "incomplete_group"} <= set(acc["retired"])
    assert acc["buffered"] and acc["leased"] and acc["rejected"] and acc["prompts"]["registered"]
    assert acc["rewards"]["awaiting"] and CONSUMER in acc["consumers"]
    want = await expected_figures(http, LONG_RUN)
    assert want[f"generators.{GENERATOR}.rollouts"] == 2

    page, wrong = await open_page(browser, broker.url, LONG_RUN)
    await until_shown(page, want)
    for width in WIDTHS:
        await fits(page, width)
    shot = tmp_path / "ui-1280.png"
    await page.set_viewport_size({"width": 1280, "height": 900})
    await page.screenshot(path=str(shot), full_page=True)
    print(f"\nscreenshot of the page: {shot}")

    # Every reason, and counts in the millions: the widest the figures get.
    await page.route("**/v1/runs/*/accounting", doctor(every_reason_in_the_millions))
    try:
        await page.locator('#retired [data-field="retired.reward_timeout"]').wait_for()
        for width in WIDTHS:
            await fits(page, width)
    finally:  # a poll being doctored is let finish before the broker stops
        await page.unroute_all(behavior="wait")
    assert wrong == [], wrong
