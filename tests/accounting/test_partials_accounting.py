"""The accounting's `partials` figures (SPEC "Partial rollouts"): the real broker through HTTP,
then the real drain; each figure is the exact count of what the API was told and answered, and
the prompt and live invariants still hold."""

from __future__ import annotations

import httpx
from accounting_helpers import drain_all

from tests.api.test_partials import completed, give_back, partial
from tests.api.test_prompts import register, work
from tests.helpers import ack, lease, live_of_ledger, make_run, post, rollout


async def test_the_partials_figures_are_exact(api: httpx.AsyncClient, make_ctx) -> None:
    run = "parts"
    await make_run(api, run, group_size=2, max_staleness=1)
    await register(api, run, "a", "b")
    first = await work(api, run, 2, generator_id="gen-A")
    assert first is not None
    ga, gb = (p["group_id"] for p in first["prompts"])
    resp = await give_back(
        api,
        run,
        first["lease_id"],
        partial("a-0", ga, [1, 2, 3]),
        partial("a-1", ga, [4, 5]),
        partial("b-0", gb, [6, 7, 8, 9]),
    )
    assert resp.json() == {"returned": 2}  # returned: 3 partials
    await api.post(f"/v1/runs/{run}/policy", json={"version": 1})

    second = await work(api, run, 2, generator_id="gen-B")  # resumed: 3, of 3 + 2 + 4 tokens
    assert second is not None
    by_prompt = {p["prompt_id"]: p for p in second["prompts"]}
    pa = {q["rollout_id"]: q for q in by_prompt["a"]["partials"]}
    (pb,) = by_prompt["b"]["partials"]
    # a's group completes with a-0 continued and a fresh response: a-1 is dropped (2 tokens).
    fresh = rollout("a-new", 1, group=by_prompt["a"]["group_id"], reward=0.0)
    resp = await post(api, run, completed(pa["a-0"], [10]), fresh)
    assert resp.json()["accepted"] == 2, resp.text
    batch = (await lease(api, run, 2)).json()
    assert (await ack(api, run, batch["batch_id"])).status_code == 200  # a#1 done
    # b comes back with b-0 longer (6 tokens): returned once more, in place of the one kept.
    longer = {**pb, "response_ids": pb["response_ids"] + [11, 12]}
    longer["logprobs"] = pb["logprobs"] + [-0.5, -0.5]
    del longer["prompt_ids"], longer["metadata"]
    assert (await give_back(api, run, second["lease_id"], longer)).json() == {"returned": 1}

    await api.post(f"/v1/runs/{run}/policy", json={"version": 3})  # b-0's v0 is too stale now
    third = await work(api, run, 2, generator_id="gen-C")  # dropped: b-0, 6 tokens
    assert third is not None and [p["partials"] for p in third["prompts"]] == [[]]

    await drain_all(make_ctx())
    acc = (await api.get(f"/v1/runs/{run}/accounting")).json()
    assert acc["partials"] == {
        "returned": 4,
        "resumed": 3,
        "dropped": 2,
        "tokens_resumed": 9,
        "tokens_dropped": 8,
    }
    prompts = acc["prompts"]
    assert (
        prompts["registered"]
        == 2
        == sum(prompts[k] for k in ("queued", "in_flight", "done", "failed"))
    )
    assert (prompts["done"], prompts["in_flight"]) == (1, 1)
    assert acc["live"] == live_of_ledger(acc)
    assert acc["rollouts_received"] == 2 and acc["pending_events"] == 0
