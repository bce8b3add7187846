"""GET /ui in a real headless Chromium against a live broker process and its accounting worker.

Every figure the page marks with ``data-field`` (its exact value in ``data-value``) must equal
the broker's JSON read at the same moment, once the traffic has stopped and the accounting has
caught up; and every figure of ``/accounting`` must be on the page. The page follows new traffic
without a reload, keeps its figures through a failed poll, loads nothing from elsewhere, and with
auth on asks for a token that it keeps in ``sessionStorage`` only.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
from playwright.async_api import Browser, Page, Route
from playwright.async_api import TimeoutError as PlaywrightTimeout

from tests.helpers import live_of_ledger, rollout
from tests.services import RedisBackend
from tests.ui.conftest import live_broker

INTERVAL_S = 0.25  # the page's poll interval in these tests (?interval=)
WAIT_MS = 10_000  # longest wait for the page to show a change (it polls every INTERVAL_S)
TOKEN_KEY = "rollout-broker.token"  # the page's sessionStorage key
SHIFT = 0.05  # the trainer's logprobs = the behaviour's - SHIFT: a small KL
FAR = 0.4  # a shift whose k3 KL (e^-0.4 - 1 + 0.4 = 0.070) is above kl_max 0.05

# -- traffic ---------------------------------------------------------------------------------


def group(gid: str, version: int, tokens: int = 4) -> list[dict[str, Any]]:
    """Two rollouts of one prompt, rewards 0 and 1."""
    return [
        rollout(f"{gid}-{k}", version, tokens=tokens + k, group=gid, reward=float(k))
        for k in range(2)
    ]


def turns(gid: str) -> list[dict[str, Any]]:
    """Two multi-turn rollouts of one prompt sampled across versions 0 (three tokens) and 1
    (three), each with a tool token masked (loss_mask 0)."""
    out = group(gid, 0, tokens=6)
    for r in out:
        n = len(r["response_ids"])
        r["loss_mask"] = [0 if i == 3 else 1 for i in range(n)]
        r["versions"] = [[0, 0], [3, 1]]
    return out


async def post(http: httpx.AsyncClient, run_id: str, rollouts: list[dict[str, Any]]) -> None:
    resp = await http.post(f"/v1/runs/{run_id}/rollouts", json={"rollouts": rollouts})
    assert resp.status_code == 202, resp.text


async def lease(http: httpx.AsyncClient, run_id: str, size: int) -> dict[str, Any]:
    resp = await http.get(
        f"/v1/runs/{run_id}/batch", params={"size": size, "partial": "true", "trainer_id": "t0"}
    )
    assert resp.status_code == 200, resp.text
    batch: dict[str, Any] = resp.json()
    return batch


async def ack(http: httpx.AsyncClient, run_id: str, batch: dict[str, Any], shift: float) -> None:
    """Acknowledge with the current policy's logprobs: the behaviour's shifted by ``shift``."""
    logprobs = {r["rollout_id"]: [x - shift for x in r["logprobs"]] for r in batch["rollouts"]}
    resp = await http.post(
        f"/v1/runs/{run_id}/batches/{batch['batch_id']}/ack", json={"logprobs": logprobs}
    )
    assert resp.status_code == 200, resp.text


async def set_policy(http: httpx.AsyncClient, run_id: str, version: int) -> None:
    resp = await http.post(f"/v1/runs/{run_id}/policy", json={"version": version})
    assert resp.status_code == 200, resp.text


async def create_run(http: httpx.AsyncClient, run_id: str, **config: Any) -> None:
    resp = await http.post("/v1/runs", json={"run_id": run_id, "config": config})
    assert resp.status_code == 201, resp.text


async def settled(http: httpx.AsyncClient, run_id: str, within: float = 20.0) -> dict[str, Any]:
    """The run's accounting once every event is applied and the ledger equals the live counts."""
    deadline = time.monotonic() + within
    while True:
        resp = await http.get(f"/v1/runs/{run_id}/accounting")
        assert resp.status_code == 200, resp.text
        acc: dict[str, Any] = resp.json()
        if acc["pending_events"] == 0 and acc["live"] in (None, live_of_ledger(acc)):
            return acc
        assert time.monotonic() < deadline, f"the accounting of {run_id} did not settle: {acc}"
        await asyncio.sleep(0.05)


# -- what the page must show -----------------------------------------------------------------


def flatten(value: Any, key: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from flatten(v, f"{key}.{k}" if key else str(k))
    else:
        yield key, value


async def expected_figures(http: httpx.AsyncClient, selected: str) -> dict[str, Any]:
    """``data-field`` -> value of every figure the page shows, from the broker's JSON: the
    selected run's accounting (all of it), its versions, its training figures (or n/a), its
    config, and the listed runs with their headline figures."""
    runs = (await http.get("/v1/runs", params={"limit": 1000})).json()["runs"]
    base = f"/v1/runs/{quote(selected, safe='')}"
    run = (await http.get(base)).json()
    acc = (await http.get(base + "/accounting")).json()
    versions = (await http.get(base + "/accounting/versions")).json()
    training = await http.get(base + "/accounting/training")
    want: dict[str, Any] = dict(flatten(acc))
    used_up = acc["retired"].get("max_reuse", 0)  # trained max_reuse times; the rest: wasted
    want["retired_used_up"] = used_up
    want["retired_wasted"] = sum(acc["retired"].values()) - used_up
    want["rejected_total"] = sum(acc["rejected"].values())
    want["ledger_live"] = "ok"
    if "rewards" in acc:  # the mean wait for a reward, per rollout scored
        scored, waited = acc["rewards"]["scored"], acc["wait"].get("reward_s")
        want["rewards.mean_wait_s"] = waited / scored if scored and waited is not None else None
    else:
        want["rewards"] = "n/a"
    if "bias" not in acc:  # a broker that does not report the bias figures
        want["bias"] = "n/a"
    if "consumers" not in acc:  # a broker that does not report consumers
        want["consumers"] = "n/a"
    want |= {
        "run.run_id": run["run_id"],
        "run.status": run["status"],
        "run.policy_version": run["policy_version"],
    }
    for name in ("group_size", "max_reuse", "max_staleness", "kl_max", "capacity_rollouts"):
        want[f"run.config.{name}"] = run["config"][name]
    for v in versions["versions"]:
        k = f"versions.{v['policy_version']}."
        want[k + "policy_version"] = v["policy_version"]
        for name in (
            "rollouts_received",
            "samples_consumed",
            "samples_rewound",
            "reuse_factor",
            "buffered",
            "leased",
        ):
            want[k + name] = v[name]
        want[k + "retired_total"] = sum(v["retired"].values())
        want[k + "rejected_total"] = sum(v["rejected"].values())
        want[k + "tokens_masked"] = v["tokens_masked"]
        for name in ("lag.mean", "lag.token_mean", "lag.max", "kl.mean", "kl.max"):
            outer, inner = name.split(".")
            want[k + name] = v[outer][inner]
    if training.status_code == 404:
        want["training"] = "n/a"
    else:
        assert training.status_code == 200, training.text
        body = training.json()
        want["training.pending_events"] = body["pending_events"]
        for v in body["versions"]:
            for name, value in v.items():
                want[f"training.{v['policy_version']}.{name}"] = value
    want |= generator_figures(await http.get(base + "/accounting/generators"))
    for r in runs:
        k = f"runs.{r['run_id']}."
        want[k + "status"] = r["status"]
        want[k + "policy_version"] = r["policy_version"]
        head = (await http.get(f"/v1/runs/{quote(r['run_id'], safe='')}/accounting")).json()
        for name in ("rollouts_received", "samples_consumed", "reuse_factor"):
            want[k + name] = head[name]
    return want


def generator_figures(resp: httpx.Response) -> dict[str, Any]:
    """The figures of ``/accounting/generators`` as the page marks them (a flag as its JSON
    text), or n/a from a broker that does not serve it."""
    if resp.status_code == 404:
        return {"generators": "n/a"}
    assert resp.status_code == 200, resp.text
    want: dict[str, Any] = {}
    for g in resp.json()["generators"]:
        for name, value in flatten(g):
            shown = ("true" if value else "false") if isinstance(value, bool) else value
            want[f"generators.{g['generator_id']}.{name}"] = shown
    return want


# The figures on the page: data-field -> [(data-value, text)] (a figure may be shown twice).
READ_FIGURES = """() => {
  const out = {};
  for (const e of document.querySelectorAll('[data-field]')) {
    const field = e.getAttribute('data-field');
    (out[field] ||= []).push([e.getAttribute('data-value'), e.textContent.trim()]);
  }
  return out;
}"""

# True once the page shows exactly the figures of ``want``.
SHOWS = """(want) => {
  const got = {};
  for (const e of document.querySelectorAll('[data-field]')) {
    (got[e.getAttribute('data-field')] ||= []).push(e.getAttribute('data-value'));
  }
  const same = (x, v) => v === null ? x === 'null'
    : typeof v === 'number' ? x !== null && x !== '' && Number(x) === v
    : x === String(v);
  return Object.entries(want).every(([k, v]) => k in got && got[k].every((x) => same(x, v)))
    && Object.keys(got).every((k) => k in want);
}"""


def same(shown: str | None, want: Any) -> bool:
    if want is None:
        return shown == "null"
    if isinstance(want, int | float) and not isinstance(want, bool):
        try:
            return shown is not None and float(shown) == float(want)
        except ValueError:
            return False
    return shown == str(want)


def differences(shown: dict[str, list[list[str]]], want: dict[str, Any]) -> list[str]:
    """What the page shows that is not what it should, one line each: figures missing, wrong
    (exact value), written without thousands separators, or not from the JSON at all."""
    out = [f"missing {k} (want {v!r})" for k, v in want.items() if k not in shown]
    out += [f"unexpected figure {k}: {shown[k]}" for k in shown if k not in want]
    for k, v in want.items():
        for value, text in shown.get(k, []):
            if not same(value, v):
                out.append(f"{k}: page {value!r}, JSON {v!r}")
            elif isinstance(v, int) and not isinstance(v, bool) and f"{v:,}" not in text:
                out.append(f"{k}: the text {text!r} does not read {v:,}")
            elif not text or re.search(r"NaN|undefined|Infinity", text):
                out.append(f"{k}: the text {text!r} is not a figure")
    return out


async def until_shown(page: Page, want: dict[str, Any], within: float = 15.0) -> None:
    """Until the page shows exactly ``want`` (it polls every INTERVAL_S); then compared once
    more in Python, text included. On a timeout the differences are the failure's message."""
    with contextlib.suppress(PlaywrightTimeout):
        await page.wait_for_function(SHOWS, arg=want, timeout=within * 1000, polling=50)
    diff = differences(await page.evaluate(READ_FIGURES), want)
    assert not diff, "the page does not show the accounting:\n" + "\n".join(diff)


def watch(page: Page, origin: str) -> list[str]:
    """What must not happen on the page (the list stays empty): a request for anything that is
    not the broker's own, an uncaught script error, an error logged to the console (other than
    a failed request's, which the page shows itself)."""
    wrong: list[str] = []
    page.on(
        "request",
        lambda req: (
            None
            if req.url.startswith((origin + "/", "data:"))
            else wrong.append(f"outside request {req.url}")
        ),
    )
    page.on("pageerror", lambda err: wrong.append(f"script error {err}"))
    page.on(
        "console",
        lambda msg: (
            wrong.append(f"console {msg.text}")
            if msg.type == "error" and "Failed to load resource" not in msg.text
            else None
        ),
    )
    return wrong


async def open_page(browser: Browser, origin: str, run_id: str) -> tuple[Page, list[str]]:
    """A page of the broker at ``origin`` on run ``run_id``, polling every INTERVAL_S, and the
    list of what must not happen on it (:func:`watch`)."""
    page = await browser.new_page(viewport={"width": 1440, "height": 900})
    page.set_default_timeout(WAIT_MS)
    wrong = watch(page, origin)
    await page.goto(f"{origin}/ui?interval={INTERVAL_S}#run={quote(run_id)}")
    return page, wrong


def doctor(change: Callable[[dict[str, Any]], None]) -> Callable[[Route], Awaitable[None]]:
    """A route handler that hands the page the broker's JSON answer with ``change`` made to it
    (a figure valid traffic never shows, or one an older broker does not report)."""

    async def handle(route: Route) -> None:
        real = await route.fetch()
        body = await real.json()
        change(body)
        await route.fulfill(response=real, json=body)

    return handle


# A page may not load anything from elsewhere nor run a script it did not ship: an image from
# another address is refused by the Content-Security-Policy, and an injected script does not run.
TRY_OUTSIDE_ASSETS = """() => new Promise((done) => {
  const blocked = [];
  document.addEventListener('securitypolicyviolation', (e) => {
    blocked.push(e.effectiveDirective + ' ' + e.blockedURI);
    if (blocked.length === 2) done({ blocked, ran: Boolean(window.__injected) });
  });
  const img = document.createElement('img');
  img.src = 'http://192.0.2.1/pixel.png';
  document.body.append(img);
  const script = document.createElement('script');
  script.textContent = 'window.__injected = true';
  document.body.append(script);
})"""


# -- the tests -------------------------------------------------------------------------------


async def test_page_shows_the_accounting_of_a_live_broker_and_follows_it(
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
        main, done = "grpo-math-7b", "sft-warmup"
        await create_run(http, done, group_size=2)
        await post(http, done, group("w0", 0) + group("w1", 0))
        await ack(http, done, await lease(http, done, 2), SHIFT)
        assert (await http.post(f"/v1/runs/{done}/close")).status_code == 200  # run_closed
        # With difficulty pools: the page shows the queued passes per pool.
        pools = {"easy_above": 0.8, "hard_below": 0.2}
        await create_run(
            http,
            main,
            group_size=2,
            max_reuse=2,
            max_staleness=1,
            stale_tokens="mask",
            difficulty=pools,
        )
        await drive(http, main)
        await settled(http, done)
        acc = await settled(http, main)
        # The traffic left something in every place the page shows.
        assert acc["buffered"] and acc["leased"] and acc["duplicates"] and acc["rejected"]
        assert acc["tokens_masked"] and acc["tokens_masked_stale"]
        assert acc["lag"]["token_mean"] != acc["lag"]["mean"]
        assert {"kl", "max_reuse", "stale"} <= set(acc["retired"])
        assert len(acc["lag"]["histogram"]) >= 2
        assert acc["kl"]["mean"] is not None and acc["is_ratio"]["clip_fraction"]
        want = await expected_figures(http, main)

        page = await browser.new_page(viewport={"width": 1440, "height": 900})
        page.set_default_timeout(WAIT_MS)
        wrong = watch(page, broker.url)
        resp = await page.goto(f"{broker.url}/ui?interval={INTERVAL_S}#run={quote(main)}")
        assert resp is not None and resp.status == 200
        policy = resp.headers["content-security-policy"]
        csp = dict(d.strip().split(" ", 1) for d in policy.split(";"))
        assert csp["default-src"] == "'self'" and csp["connect-src"] == "'self'"
        assert csp["script-src"].startswith("'sha256-")  # its own inline script, by hash
        await until_shown(page, want)
        # The selection is in the address: a reload keeps it.
        await page.evaluate("window.__kept = true")
        await page.reload()
        await until_shown(page, want)
        assert await page.evaluate("window.__kept") is None  # it was reloaded

        # New traffic: the page follows it without a reload.
        await page.evaluate("window.__kept = true")
        updated = await page.text_content("#updated")
        await post(http, main, group("late0", 2) + group("late1", 2))
        await ack(http, main, await lease(http, main, 4), SHIFT)
        after = await settled(http, main)
        assert after["samples_consumed"] > acc["samples_consumed"]
        await until_shown(page, await expected_figures(http, main))
        assert await page.evaluate("window.__kept") is True
        await page.wait_for_function(  # the clock of the newest poll moves on
            "(before) => document.querySelector('#updated').textContent !== before", arg=updated
        )
        assert re.fullmatch(r"updated \d\d:\d\d:\d\d", (await page.text_content("#updated")) or "")
        # The charts keep the history of the page's own polls.
        assert await page.locator(".chart svg path").count() >= 4

        shot = tmp_path / "ui.png"
        await page.screenshot(path=str(shot), full_page=True)
        print(f"\nscreenshot of the page: {shot}")

        # A failed poll (an outage: 503) shows a banner and keeps the figures shown.
        want = await expected_figures(http, main)
        outage = "postgres is unreachable (OSError); try again in 1 s"

        async def unavailable(route: Route) -> None:
            await route.fulfill(
                status=503,
                json={"error": "Unavailable", "detail": outage},
                headers={"Retry-After": "1"},
            )

        await page.route("**/v1/runs/*/accounting", unavailable)
        banner = page.locator("#banner")
        await banner.wait_for(state="visible")
        assert "503 Unavailable" in (await banner.text_content() or "")
        assert outage in (await banner.text_content() or "")
        await until_shown(page, want)
        await page.unroute("**/v1/runs/*/accounting")
        await banner.wait_for(state="hidden")

        # Dead letters are highlighted, and a ledger that disagrees with the live counts is
        # flagged (valid traffic causes neither: the answers are doctored on the way).
        async def doctored(route: Route) -> None:
            real = await route.fetch()
            body = await real.json()
            body["dead_letters"] = 3
            body["live"]["buffered"] += 1
            await route.fulfill(response=real, json=body)

        await page.route("**/v1/runs/*/accounting", doctored)
        await page.locator('.check.bad [data-field="dead_letters"][data-value="3"]').wait_for()
        await page.locator('[data-field="ledger_live"][data-value="mismatch"]').wait_for()
        await page.unroute_all(behavior="wait")  # a poll being doctored is let finish

        # So is one whose rollouts awaiting a reward disagree with the live state's.
        await page.locator('[data-field="ledger_live"][data-value="ok"]').wait_for()

        async def doctored_rewards(route: Route) -> None:
            real = await route.fetch()
            body = await real.json()
            body["live"]["rewards"]["awaiting"] += 1
            await route.fulfill(response=real, json=body)

        await page.route("**/v1/runs/*/accounting", doctored_rewards)
        await page.locator('[data-field="ledger_live"][data-value="mismatch"]').wait_for()
        # A poll still being doctored is let finish: unrouted under it, its answer would fail.
        await page.unroute_all(behavior="wait")
        await page.locator('[data-field="ledger_live"][data-value="ok"]').wait_for()

        # Partial rollouts' figures, all different, each on the page; and n/a from a broker that
        # does not count them (the answers are doctored on the way).
        partials = {
            "returned": 11,
            "resumed": 7,
            "dropped": 3,
            "tokens_resumed": 1234,
            "tokens_dropped": 56,
        }

        async def with_partials(route: Route) -> None:
            real = await route.fetch()
            await route.fulfill(response=real, json=await real.json() | {"partials": partials})

        async def without_partials(route: Route) -> None:
            real = await route.fetch()
            body = await real.json()
            del body["partials"]
            await route.fulfill(response=real, json=body)

        others = {k: v for k, v in want.items() if not k.startswith("partials.")}
        assert len(others) == len(want) - len(partials)
        for doctor, shown in (
            (with_partials, others | {f"partials.{k}": n for k, n in partials.items()}),
            (without_partials, others | {"partials": "n/a"}),
        ):
            await page.route("**/v1/runs/*/accounting", doctor)
            try:
                await until_shown(page, shown)
            finally:  # before the broker stops, should the page not show them; a poll being
                await page.unroute_all(behavior="wait")  # doctored is let finish
        await until_shown(page, want)

        # A broker without the training figures (404) shows n/a there and the rest as before.
        await page.route(
            "**/v1/runs/*/accounting/training",
            lambda route: route.fulfill(
                status=404, json={"error": "NotFound", "detail": "Not Found"}
            ),
        )
        without = {k: v for k, v in want.items() if not k.startswith("training.")}
        await until_shown(page, without | {"training": "n/a"})
        await page.unroute("**/v1/runs/*/accounting/training")

        # Another run, chosen in the list: its figures, and its id in the address.
        await page.click(f'button[data-run="{done}"]')
        await until_shown(page, await expected_figures(http, done))
        assert page.url.endswith(f"#run={done}")

        assert wrong == [], wrong
        found = await page.evaluate(TRY_OUTSIDE_ASSETS)
        assert found["ran"] is False, "an injected script ran"
        assert any("192.0.2.1" in b for b in found["blocked"]), found


async def drive(http: httpx.AsyncClient, run_id: str) -> None:
    """Traffic that leaves a figure in each place: samples at lag 0 and 1, KL and clipped
    ratios, rollouts retired for max_reuse, kl and stale, a duplicate, a rejection, masked
    tokens, tokens masked stale at hand-out (a multi-turn group across versions 0 and 1 used
    at version 2 under ``stale_tokens: mask``), some rollouts buffered and a lease not yet
    acknowledged."""
    v0 = [r for g in range(8) for r in group(f"a{g}", 0)]
    await post(http, run_id, v0)
    await post(http, run_id, v0[:2] + group("future", 5))  # 2 duplicates, 2 future_version
    await ack(http, run_id, await lease(http, run_id, 4), FAR)  # above kl_max: retire kl
    await ack(http, run_id, await lease(http, run_id, 8), SHIFT)
    await set_policy(http, run_id, 1)
    await post(http, run_id, [r for g in range(4) for r in group(f"b{g}", 1)] + turns("m"))
    await ack(http, run_id, await lease(http, run_id, 16), SHIFT)  # lag 0 and 1; max_reuse
    await set_policy(http, run_id, 2)  # what is left of version 0 retires stale
    # All that is left (the multi-turn group: its version-0 tokens now masked stale).
    await ack(http, run_id, await lease(http, run_id, 64), SHIFT)
    await post(http, run_id, [r for g in range(3) for r in group(f"c{g}", 2)])
    await lease(http, run_id, 2)  # held: leased


async def test_page_asks_for_a_token_and_keeps_it_in_session_storage_only(
    browser: Browser,
    redis_backend: RedisBackend,
    database_url: str,
    prefix: str,
    tmp_path: Path,
) -> None:
    admin = secrets.token_urlsafe(32)
    async with live_broker(
        redis_backend,
        database_url,
        prefix,
        tmp_path,
        token=admin,
        BROKER_AUTH="on",
        BROKER_ADMIN_TOKEN=admin,
    ) as broker:
        http = broker.http
        run_id = "ppo-guarded"
        await create_run(http, run_id, group_size=2, max_reuse=1)
        await post(http, run_id, group("p0", 0) + group("p1", 0))
        await ack(http, run_id, await lease(http, run_id, 2), SHIFT)
        await settled(http, run_id)
        want = await expected_figures(http, run_id)
        made = await http.post("/v1/tokens", json={"name": "gen-only", "scopes": ["generate"]})
        assert made.status_code == 201, made.text
        generate_only = made.json()["token"]

        page = await browser.new_page(viewport={"width": 1440, "height": 900}, color_scheme="dark")
        page.set_default_timeout(WAIT_MS)
        wrong = watch(page, broker.url)
        resp = await page.goto(f"{broker.url}/ui?interval={INTERVAL_S}")
        assert resp is not None and resp.status == 200  # the page itself needs no token
        form = page.locator("#auth")
        await form.wait_for(state="visible")

        # A wrong token is refused, and not kept.
        await page.fill("#token", "rbt_" + secrets.token_hex(20))
        await page.press("#token", "Enter")
        error = page.locator("#auth-error")
        await page.wait_for_function(
            "() => document.querySelector('#auth-error').textContent.startsWith('Token refused')"
        )
        assert "unknown or revoked token" in (await error.text_content() or "")
        assert await form.is_visible()
        assert await page.evaluate(f"sessionStorage.getItem('{TOKEN_KEY}')") is None

        # The right one: the figures appear; it is in sessionStorage, nowhere else.
        await page.fill("#token", admin)
        await page.click("#auth button[type=submit]")
        await form.wait_for(state="hidden")
        await until_shown(page, want)
        assert await page.evaluate(f"sessionStorage.getItem('{TOKEN_KEY}')") == admin
        assert await page.evaluate("localStorage.length") == 0
        assert await page.evaluate("document.cookie") == ""
        assert admin not in page.url
        shot = tmp_path / "ui-auth.png"
        await page.screenshot(path=str(shot), full_page=True)
        print(f"\nscreenshot of the page: {shot}")

        # Forgetting it asks again.
        await page.click("#forget")
        await form.wait_for(state="visible")
        assert await page.evaluate(f"sessionStorage.getItem('{TOKEN_KEY}')") is None

        # A token without the operate scope lists the runs but is told which scope it lacks.
        await page.fill("#token", generate_only)
        await page.press("#token", "Enter")
        await form.wait_for(state="hidden")
        forbidden = page.locator("#forbidden")
        await forbidden.wait_for(state="visible")
        assert await forbidden.locator("[data-scope]").get_attribute("data-scope") == "operate"
        await page.locator(f'button[data-run="{run_id}"]').wait_for()
        assert wrong == [], wrong


def test_figures_are_compared_exactly() -> None:
    """The comparison itself: a figure off by one, one too many or one missing is found."""
    want = {"rollouts_received": 1234, "reuse_factor": 1.5, "kl.mean": None, "as_of": "t"}
    shown = {
        "rollouts_received": [["1234", "1,234"]],
        "reuse_factor": [["1.5", "×1.500"]],
        "kl.mean": [["null", "n/a"]],
        "as_of": [["t", "12:00:00"]],
    }
    assert differences(shown, want) == []
    assert differences({**shown, "rollouts_received": [["1235", "1,235"]]}, want)
    assert differences({**shown, "rollouts_received": [["1234", "1234"]]}, want)
    assert differences({**shown, "extra": [["1", "1"]]}, want)
    assert differences({k: v for k, v in shown.items() if k != "as_of"}, want)
    assert differences({**shown, "reuse_factor": [["1.5", "NaN"]]}, want)
