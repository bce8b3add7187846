from tests.helpers import ack, lease, make_run, post, rollout


async def test_round_trip(client):
    await make_run(client, "r1", max_reuse=2)
    resp = await post(client, "r1", rollout("a"), rollout("b"))
    assert resp.status_code == 202, resp.text
    assert resp.json() == {"accepted": 2, "duplicates": 0, "rejected": []}
    resp = await lease(client, "r1", 2)
    assert resp.status_code == 200, resp.text
    batch = resp.json()
    assert {r["rollout_id"] for r in batch["rollouts"]} == {"a", "b"}
    lp = {r["rollout_id"]: [-0.4] * 4 for r in batch["rollouts"]}
    resp = await ack(client, "r1", batch["batch_id"], logprobs=lp)
    assert resp.status_code == 200, resp.text
    print(resp.json())
