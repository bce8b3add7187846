"""``GET /metrics`` (SPEC "Observability"): Prometheus text that parses, broker figures that
follow the traffic and agree with the run's accounting, the request histogram by route
template, the bounded run labels, and who may read it."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr
from redis.exceptions import ConnectionError as RedisConnectionError

from app.accounting.stream import EventStream
from app.broker.service import Broker
from app.broker.store import RedisStore
from app.keys import run_key
from app.main import create_app
from app.metrics import CATALOGUE
from app.settings import Settings
from tests.api.support import assert_error
from tests.api.test_partials import give_back, partial
from tests.api.test_prompts import register, work
from tests.helpers import KNOWN_SECRETS, ack, lease, make_run, post, rollout
from workers.drain import DrainContext, drain_once

ADMIN = secrets.token_urlsafe(32)
KNOWN_SECRETS.add(ADMIN)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(client: httpx.AsyncClient, **headers: str) -> Samples:
    resp = await client.get("/metrics", headers=headers)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/plain; version=0.0.4")
    out: Samples = {}
    for family in text_string_to_metric_families(resp.text):
        assert family.name.startswith("rollout_broker_"), family.name
        assert family.documentation, family.name
        for s in family.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in out, key
            out[key] = s.value
    return out


@contextlib.asynccontextmanager
async def app_client(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    """The app in-process on ``settings``, with its lifespan, and a client of it."""
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://broker") as c:
            yield c


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def runs_of(samples: Samples) -> set[str]:
    """Every value of a ``run`` label in the scrape."""
    return {v for (_, labels) in samples for k, v in labels if k == "run"}


@pytest.fixture
def drain(redis, prefix, sessionmaker):
    return DrainContext.create(redis, sessionmaker, prefix, consumer="test-drain")


def per_run(samples: Samples, run: str) -> dict[str, Any]:
    return {
        "buffered": value(samples, "rollout_broker_rollouts_buffered", run=run),
        "leased": value(samples, "rollout_broker_rollouts_leased", run=run),
        "received": value(samples, "rollout_broker_rollouts_received_total", run=run),
        "consumed": value(samples, "rollout_broker_samples_consumed_total", run=run),
        "pending": value(samples, "rollout_broker_accounting_pending_events", run=run),
        "dead": value(samples, "rollout_broker_accounting_dead_letters", run=run),
        "retired": {
            dict(labels)["reason"]: v
            for (name, labels), v in samples.items()
            if name == "rollout_broker_rollouts_retired_total" and ("run", run) in labels
        },
    }


def from_accounting(acc: dict[str, Any]) -> dict[str, Any]:
    return {
        "buffered": acc["live"]["buffered"],
        "leased": acc["live"]["leased"],
        "received": acc["rollouts_received"],
        "consumed": acc["samples_consumed"],
        "pending": acc["pending_events"],
        "dead": acc["dead_letters"],
        "retired": acc["retired"],
    }


async def test_broker_figures_follow_the_traffic_and_agree_with_the_accounting(api, drain):
    async def both(run: str) -> tuple[dict[str, Any], dict[str, Any]]:
        acc = (await api.get(f"/v1/runs/{run}/accounting")).json()
        return per_run(await scrape(api), run), from_accounting(acc)

    await make_run(api, "m1", max_reuse=1, max_staleness=0)
    empty, acc = await both("m1")
    assert empty == acc
    assert empty["buffered"] == 0 and empty["received"] == 0 and empty["retired"] == {}

    assert (await post(api, "m1", *(rollout(f"r{i}") for i in range(5)))).status_code == 202
    posted, acc = await both("m1")
    assert posted == acc
    assert posted["buffered"] == 5 and posted["leased"] == 0
    assert posted["pending"] > 0 and posted["received"] == 0  # not drained yet

    await drain_once(drain)
    drained, acc = await both("m1")
    assert drained == acc
    assert (drained["received"], drained["pending"]) == (5, 0)

    batch = (await lease(api, "m1", 3)).json()
    leased, acc = await both("m1")
    assert leased == acc
    assert (leased["buffered"], leased["leased"]) == (2, 3)

    resp = await ack(api, "m1", batch["batch_id"], step=1)
    assert resp.status_code == 200, resp.text
    # The version moves on: with max_staleness 0 the two left go stale.
    assert (await api.post("/v1/runs/m1/policy", json={"version": 1})).status_code == 200
    await drain_once(drain)
    acked, acc = await both("m1")
    assert acked == acc
    assert (acked["buffered"], acked["leased"], acked["consumed"]) == (0, 0, 3)
    assert acked["retired"] == acc["retired"] and sum(acked["retired"].values()) == 5
    samples = await scrape(api)
    assert value(samples, "rollout_broker_open_runs") == 1
    assert value(samples, "rollout_broker_metrics_runs_omitted") == 0
    assert value(samples, "rollout_broker_state_up") == 1


async def test_the_request_histogram_counts_requests_by_route_template(api):
    name = "rollout_broker_http_request_duration_seconds_count"
    template = {"route": "/v1/runs/{run_id}", "method": "GET", "status_class": "2xx"}
    before = await scrape(api)
    assert value(before, name, **template) is None
    for run in ("h1", "h2", "h3"):
        await make_run(api, run)
        assert (await api.get(f"/v1/runs/{run}")).status_code == 200
    assert (await api.get("/v1/runs/h1")).status_code == 200
    assert (await api.get("/v1/runs/nope")).status_code == 404
    assert (await api.get("/no/such/path")).status_code == 404
    after = await scrape(api)
    assert value(after, name, **template) == 4
    assert value(after, name, **{**template, "status_class": "4xx"}) == 1
    assert value(after, name, route="/v1/runs", method="POST", status_class="2xx") == 3
    assert value(after, name, route="unmatched", method="GET", status_class="4xx") == 1
    assert value(after, name, route="/metrics", method="GET", status_class="2xx") == 1
    # Templates only, never a raw path.
    routes = {dict(labels)["route"] for (n, labels) in after if n == name}
    assert not any(r.startswith(("/v1/runs/h", "/v1/runs/nope", "/no/")) for r in routes), routes
    buckets = {
        dict(labels)["le"]: v
        for (n, labels), v in after.items()
        if n == "rollout_broker_http_request_duration_seconds_bucket"
        and {("route", "/v1/runs/{run_id}"), ("status_class", "2xx")} <= labels
    }
    assert buckets["+Inf"] == 4 and buckets["60.0"] <= 4


async def test_run_labels_stay_bounded_with_more_runs_than_the_cap(settings: Settings):
    async with app_client(settings.model_copy(update={"metrics_max_runs": 3})) as c:
        for i in range(7):
            await make_run(c, f"cap{i}")
        samples = await scrape(c)
    assert len(runs_of(samples)) == 3
    assert runs_of(samples) == {"cap6", "cap5", "cap4"}  # the newest, as GET /v1/runs lists
    assert value(samples, "rollout_broker_open_runs") == 7
    assert value(samples, "rollout_broker_metrics_runs_omitted") == 4
    buffered = [k for k in samples if k[0] == "rollout_broker_rollouts_buffered"]
    assert len(buffered) == 3


async def test_closed_runs_have_no_run_label(api):
    await make_run(api, "open1")
    await make_run(api, "shut1")
    assert (await post(api, "shut1", rollout("s1"))).status_code == 202
    assert runs_of(await scrape(api)) == {"open1", "shut1"}
    assert (await api.post("/v1/runs/shut1/close")).status_code == 200
    samples = await scrape(api)
    assert runs_of(samples) == {"open1"}
    assert value(samples, "rollout_broker_open_runs") == 1


@pytest.mark.one_node
async def test_an_operate_token_reads_it_and_sees_only_the_runs_it_may_touch(settings: Settings):
    app = create_app(settings.model_copy(update={"auth": True, "admin_token": SecretStr(ADMIN)}))
    admin = {"Authorization": f"Bearer {ADMIN}"}
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://broker") as c:
            for run in ("math-1", "math-2", "code-1"):
                resp = await c.post("/v1/runs", json={"run_id": run}, headers=admin)
                assert resp.status_code == 201, resp.text
            made = {}
            for name, scopes in (("ops", ["operate"]), ("gen", ["generate", "train"])):
                resp = await c.post(
                    "/v1/tokens",
                    json={"name": name, "scopes": scopes, "runs": ["math-*"]},
                    headers=admin,
                )
                assert resp.status_code == 201, resp.text
                made[name] = resp.json()["token"]
                KNOWN_SECRETS.add(made[name])
            limited = made["ops"]
            assert_error(await c.get("/metrics"), 401, "Unauthorized")
            gen = await c.get("/metrics", headers={"Authorization": f"Bearer {made['gen']}"})
            assert_error(gen, 403, "Forbidden")  # the ledger's figures are operate's to read
            assert runs_of(await scrape(c, **admin)) == {"math-1", "math-2", "code-1"}
            mine = await scrape(c, Authorization=f"Bearer {limited}")
    assert runs_of(mine) == {"math-1", "math-2"}
    assert value(mine, "rollout_broker_open_runs") == 2


@pytest.mark.one_node
async def test_an_unreachable_store_keeps_the_request_metrics(api, monkeypatch):
    async def down(*_: Any, **__: Any) -> Any:
        raise RedisConnectionError("gone")

    await make_run(api, "u1")
    monkeypatch.setattr(RedisStore, "list_runs", down)
    samples = await scrape(api)
    assert value(samples, "rollout_broker_state_up") == 0
    assert runs_of(samples) == set()
    assert (
        value(
            samples,
            "rollout_broker_http_request_duration_seconds_count",
            route="/v1/runs",
            method="POST",
            status_class="2xx",
        )
        == 1
    )


@pytest.mark.one_node
async def test_a_request_that_raises_is_counted_as_5xx(api, monkeypatch):
    async def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(Broker, "get_run", broken)
    assert_error(await api.get("/v1/runs/x1"), 500, "InternalError")
    samples = await scrape(api)
    count = "rollout_broker_http_request_duration_seconds_count"
    assert value(samples, count, route="/v1/runs/{run_id}", method="GET", status_class="5xx") == 1


def families_of(text: str) -> dict[str, Any]:
    """The scrape's families by their name as the catalogue gives it (a counter's with
    ``_total``)."""
    out = {}
    for family in text_string_to_metric_families(text):
        name = f"{family.name}_total" if family.type == "counter" else family.name
        out[name] = family
    return out


async def test_every_metric_of_the_catalogue_is_exposed_as_declared(api, drain):
    # With difficulty pools: the per-pool family is only of such runs.
    pools = {"easy_above": 0.5, "hard_below": 0.1}
    await make_run(api, "c1", max_reuse=1, difficulty=pools)
    resp = await api.post("/v1/runs/c1/prompts", json={"prompts": [{"prompt_id": "p1"}]})
    assert resp.status_code == 202, resp.text
    assert (await api.post("/v1/runs/c1/work", json={"max_prompts": 1})).status_code == 200
    assert (await post(api, "c1", rollout("a"), rollout("b"))).status_code == 202
    batch = (await lease(api, "c1", 2)).json()
    new = {item["rollout_id"]: [-0.25] * 4 for item in batch["rollouts"]}
    assert (await ack(api, "c1", batch["batch_id"], logprobs=new)).status_code == 200
    await drain_once(drain)

    resp = await api.get("/metrics")
    families = families_of(resp.text)
    assert set(families) == {spec.name for spec in CATALOGUE}
    for spec in CATALOGUE:
        family = families[spec.name]
        assert family.type == spec.kind, spec.name
        assert family.documentation == spec.help, spec.name
        for sample in family.samples:
            extra = {"le"} if sample.name.endswith("_bucket") else set()
            assert set(sample.labels) == set(spec.labels) | extra, (spec.name, sample)


async def test_the_ledger_figures_equal_the_accounting(api, drain):
    """Each per-run figure against the same figure of GET /accounting, after traffic of every
    kind: prompts in work leases, duplicates, rejections, acks with logprobs, a nack, lag."""
    await make_run(api, "f1", max_reuse=1, max_staleness=4)
    resp = await api.post(
        "/v1/runs/f1/prompts", json={"prompts": [{"prompt_id": f"p{i}"} for i in range(3)]}
    )
    assert resp.status_code == 202, resp.text
    assert (await api.post("/v1/runs/f1/work", json={"max_prompts": 2})).status_code == 200
    assert (
        await post(api, "f1", *(rollout(f"r{i}", tokens=3 + i) for i in range(6)))
    ).status_code == 202
    assert (await post(api, "f1", rollout("r0"), rollout("late", version=9))).status_code == 202
    assert (await api.post("/v1/runs/f1/policy", json={"version": 2})).status_code == 200
    first = (await lease(api, "f1", 3)).json()
    new = {item["rollout_id"]: [-0.1] * len(item["response_ids"]) for item in first["rollouts"]}
    assert (await ack(api, "f1", first["batch_id"], logprobs=new)).status_code == 200
    second = (await lease(api, "f1", 2)).json()
    resp = await api.post(f"/v1/runs/f1/batches/{second['batch_id']}/nack", json={})
    assert resp.status_code == 200, resp.text
    await drain_once(drain)

    acc = (await api.get("/v1/runs/f1/accounting")).json()
    s = await scrape(api)

    def one(name: str, **labels: str) -> float | None:
        return value(s, f"rollout_broker_{name}", run="f1", **labels)

    def by(name: str, label: str) -> dict[str, float]:
        return {
            dict(labels)[label]: v
            for (n, labels), v in s.items()
            if n == f"rollout_broker_{name}" and ("run", "f1") in labels
        }

    assert acc["pending_events"] == 0 and acc["duplicates"] == 1 and acc["rejected"]
    assert one("rollouts_received_total") == acc["rollouts_received"] == 6
    assert one("rollouts_duplicate_total") == acc["duplicates"]
    assert by("rollouts_rejected_total", "reason") == acc["rejected"]
    assert by("batches_total", "outcome") == acc["batches"]
    assert by("lease_rollouts_total", "outcome") == {
        "leased": 5,
        "acked": 3,
        "nacked": 2,
        "expired": 0,
    }
    assert one("samples_consumed_total") == acc["samples_consumed"] == 3
    assert one("samples_rewound_total") == acc["samples_rewound"] == 0
    assert by("rollouts_retired_total", "reason") == acc["retired"]
    assert one("tokens_generated_total") == acc["tokens_generated"]
    assert one("tokens_consumed_total") == acc["tokens_consumed"]
    assert one("tokens_wasted_total") == acc["wasted_tokens"]
    assert one("kl_mean") == pytest.approx(acc["kl"]["mean"])
    assert one("kl_max") == pytest.approx(acc["kl"]["max"])
    assert one("importance_ratio_mean") == pytest.approx(acc["is_ratio"]["mean"])
    assert one("importance_ratio_clip_fraction") == pytest.approx(acc["is_ratio"]["clip_fraction"])
    assert by("prompt_passes", "state") == {
        k: acc["prompts"][k] for k in ("queued", "in_flight", "done", "failed", "skipped")
    }
    assert acc["prompts"]["pools"] is None and by("prompt_pool_passes", "pool") == {}
    assert one("prompt_passes", state="in_flight") == 2
    assert one("prompt_passes_registered_total") == acc["prompts"]["registered"] == 3
    assert one("prompt_retries_total") == acc["prompts"]["retried"]
    assert one("generator_wait_seconds_total") == acc["wait"]["generator_s"]
    assert one("trainer_wait_seconds_total") == acc["wait"]["trainer_s"]
    assert one("run_policy_version") == 2
    assert one("capacity_rollouts") == 100_000
    assert (one("accounting_drain_delay_seconds"), one("ledger_mismatch")) == (0, 0)
    # The lag histogram: cumulative buckets of acc's lag -> samples, its sum and count.
    lags = {int(k): n for k, n in acc["lag"]["histogram"].items()}
    assert lags == {2: 3}
    buckets = by("sample_lag_versions_bucket", "le")
    assert buckets == {
        le: sum(n for lag, n in lags.items() if le == "+Inf" or lag <= float(le))
        for le in [*(f"{b}.0" for b in (0, 1, 2, 4, 8, 16, 32, 64)), "+Inf"]
    }
    assert one("sample_lag_versions_sum") == sum(lag * n for lag, n in lags.items())
    assert one("sample_lag_versions_count") == acc["samples_consumed"]


async def test_max_staleness_is_each_runs_own_setting(api):
    """The lag alert compares a run's lag with the run's own max_staleness, so the gauge
    follows each run's setting and a config change at the next scrape."""
    await make_run(api, "s1", max_staleness=3)
    await make_run(api, "s2")
    s = await scrape(api)
    assert value(s, "rollout_broker_max_staleness", run="s1") == 3
    assert value(s, "rollout_broker_max_staleness", run="s2") == 1
    resp = await api.patch("/v1/runs/s1/config", json={"max_staleness": 5})
    assert resp.status_code == 200, resp.text
    s = await scrape(api)
    assert value(s, "rollout_broker_max_staleness", run="s1") == 5
    assert value(s, "rollout_broker_max_staleness", run="s2") == 1


async def test_the_token_figures_equal_the_accounting(api, drain):
    """Masked tokens, tokens masked stale at hand-out and the token-weighted lag: a multi-turn
    rollout spanning versions 0 and 1 (a tool token masked) handed out at version 2 under
    ``stale_tokens: mask`` (its three trained version-0 tokens masked), and a plain rollout at
    version 2."""
    await make_run(api, "t1", max_reuse=1, max_staleness=1, stale_tokens="mask")
    assert (await api.post("/v1/runs/t1/policy", json={"version": 1})).status_code == 200
    turns = rollout("a", tokens=6) | {"loss_mask": [1, 1, 1, 0, 1, 1], "versions": [[0, 0], [4, 1]]}
    assert (await post(api, "t1", turns)).status_code == 202
    assert (await api.post("/v1/runs/t1/policy", json={"version": 2})).status_code == 200
    assert (await post(api, "t1", rollout("b", version=2, tokens=4))).status_code == 202
    batch = (await lease(api, "t1", 2)).json()
    new = {item["rollout_id"]: [-0.5] * len(item["response_ids"]) for item in batch["rollouts"]}
    assert (await ack(api, "t1", batch["batch_id"], logprobs=new)).status_code == 200
    await drain_once(drain)

    acc = (await api.get("/v1/runs/t1/accounting")).json()
    s = await scrape(api)

    def one(name: str, **labels: str) -> float | None:
        return value(s, f"rollout_broker_{name}", run="t1", **labels)

    assert acc["pending_events"] == 0
    assert one("tokens_masked_total") == acc["tokens_masked"] == 1
    assert one("tokens_masked_stale_total") == acc["tokens_masked_stale"] == 3
    # a's two trained tokens at lag 1, b's four at lag 0; the samples' lags are 1 and 0
    assert one("token_lag_versions_mean") == pytest.approx(acc["lag"]["token_mean"])
    assert acc["lag"]["token_mean"] == pytest.approx(2 / 6) and acc["lag"]["mean"] == 0.5


async def test_the_partials_figures_follow_real_traffic(api, drain):
    """Partials given back, then handed out again and dropped: each figure is the ledger's."""
    await make_run(api, "pp", group_size=2, max_staleness=1)
    await register(api, "pp", "a", "b")
    first = await work(api, "pp", 2)
    assert first is not None
    ga, gb = (p["group_id"] for p in first["prompts"])
    parts = partial("a-0", ga, [1, 2, 3]), partial("a-1", ga, [4, 5]), partial("b-0", gb, [6])
    assert (await give_back(api, "pp", first["lease_id"], *parts)).status_code == 200
    second = await work(api, "pp", 1)  # a's two partials resumed: 5 tokens
    assert second is not None
    await api.post("/v1/runs/pp/policy", json={"version": 2})  # b-0 (version 0) too stale now
    third = await work(api, "pp", 1)  # b-0 dropped: 1 token
    assert third is not None and third["prompts"][0]["partials"] == []
    await drain_once(drain)

    acc = (await api.get("/v1/runs/pp/accounting")).json()
    s = await scrape(api)

    def by_outcome(name: str) -> dict[str, float]:
        return {
            dict(labels)["outcome"]: v
            for (n, labels), v in s.items()
            if n == f"rollout_broker_{name}" and ("run", "pp") in labels
        }

    p = acc["partials"]
    assert p == {
        "returned": 3,
        "resumed": 2,
        "dropped": 1,
        "tokens_resumed": 5,
        "tokens_dropped": 1,
    }
    assert by_outcome("partials_total") == {k: p[k] for k in ("returned", "resumed", "dropped")}
    assert by_outcome("partial_tokens_total") == {
        "resumed": p["tokens_resumed"],
        "dropped": p["tokens_dropped"],
    }


async def test_the_drain_delay_is_the_age_of_the_oldest_event_not_drained(
    api, drain, redis, prefix
):
    await make_run(api, "d1")
    assert (await post(api, "d1", rollout("a"))).status_code == 202
    events = EventStream(redis, prefix)

    async def delay_between_clock_reads() -> tuple[float, float, float]:
        before = await redis.time()
        got = value(await scrape(api), "rollout_broker_accounting_drain_delay_seconds", run="d1")
        after = await redis.time()
        assert got is not None
        return before[0] + before[1] / 1e6, got, after[0] + after[1] / 1e6

    async def oldest_ms() -> int:
        first = await redis.xrange(events.events_key("d1"), count=1)
        return int(first[0][0].split(b"-")[0])

    # Nothing read yet: the oldest event is the stream's first.
    written = await oldest_ms() / 1000
    before, delay, after = await delay_between_clock_reads()
    assert before - written - 0.001 <= delay <= after - written + 0.001
    await drain_once(drain)
    assert (await delay_between_clock_reads())[1] == 0

    # Delivered to a drain that died before applying it: the group's oldest pending entry.
    assert (await post(api, "d1", rollout("b"))).status_code == 202
    await events.ensure_group("d1")
    read = await redis.xreadgroup(events.group, "dead-drain", {events.events_key("d1"): ">"})
    pending_id = read[0][1][0][0]
    assert (await post(api, "d1", rollout("c"))).status_code == 202  # newer, undelivered
    written = int(pending_id.split(b"-")[0]) / 1000
    before, delay, after = await delay_between_clock_reads()
    assert before - written - 0.001 <= delay <= after - written + 0.001


async def test_a_ledger_that_disagrees_with_the_live_state_is_flagged(api, drain, redis, prefix):
    await make_run(api, "x1")
    assert (await post(api, "x1", rollout("a"), rollout("b"))).status_code == 202
    await drain_once(drain)
    assert value(await scrape(api), "rollout_broker_ledger_mismatch", run="x1") == 0
    # A live count the ledger never heard of (as after a failover lost acknowledged writes).
    await redis.hincrby(run_key(prefix, "x1"), "live", 1)
    acc = (await api.get("/v1/runs/x1/accounting")).json()
    assert acc["buffered"] != acc["live"]["buffered"]
    assert value(await scrape(api), "rollout_broker_ledger_mismatch", run="x1") == 1


@pytest.mark.one_node
async def test_metrics_off_serves_no_metrics_and_times_nothing(settings: Settings):
    app = create_app(settings.model_copy(update={"metrics": False}))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://broker") as c:
            await make_run(c, "off1")
            assert_error(await c.get("/metrics"), 404, "NotFound")
    assert not hasattr(app.state, "metrics")


@pytest.mark.one_node
def test_the_readme_lists_the_catalogue():
    """docs/metrics.md's table of metrics is the catalogue's: every name, type and label set."""
    readme = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    table = readme[readme.index("| metric | type | labels | from | what |") :].split("\n\n")[0]
    listed = {}
    for line in table.splitlines()[2:]:
        name, kind, labels = (cell.strip() for cell in line.split("|")[1:4])
        listed[name.strip("`")] = (kind, tuple(x.strip(" `") for x in labels.split(",") if x))
    assert listed == {spec.name: (spec.kind, spec.labels) for spec in CATALOGUE}
