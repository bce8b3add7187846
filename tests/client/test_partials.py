"""Partial rollouts through the client: a generator gives back what it sampled so far of its
prompts' responses, the next work lease shows them on its prompts, another generator continues
and posts them; a trainer's batch names each work rollout's prompt and its registered tokens."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from rollout_broker_client import AsyncBrokerClient, AsyncWork, Partial, ValidationFailed


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
async def test_partials_given_back_are_continued_by_the_next_lease(
    api: httpx.AsyncClient, fmt
) -> None:
    async with AsyncBrokerClient(http=api, format=fmt) as broker:
        await broker.create_run("r", {"group_size": 2})
        await broker.register_prompts("r", [{"prompt_id": "q", "prompt_ids": [7, 8]}])
        first = await broker.work_lease("r", 1, generator_id="gen-A")
        assert first is not None
        async with AsyncWork(broker, "r", first) as work:
            (prompt,) = work.prompts
            sampled = {
                "rollout_id": "q-0",
                "policy_version": 0,
                "response_ids": np.array([3, 4, 5]),
                "logprobs": np.array([-0.5, -0.25, -1.0], dtype=np.float32),
            }
            assert await work.give_back(partials={prompt: [sampled]}) == 1
            assert work.unposted == []

        second = await broker.work_lease("r", 1, generator_id="gen-B")
        assert second is not None
        (prompt,) = second.prompts
        (p,) = prompt.partials
        assert isinstance(p, Partial) and (p.rollout_id, p.group_id) == ("q-0", prompt.group_id)
        np.testing.assert_array_equal(p.response_ids, [3, 4, 5])
        async with AsyncWork(broker, "r", second) as work:
            tampered = p.continued([6], 1.0, [-0.5])
            tampered.response_ids[0] = 9  # type: ignore[index]
            with pytest.raises(ValidationFailed, match="prefix_mismatch"):
                await work.post(prompt, [tampered])
            fresh = {"rollout_id": "q-1", "response_ids": [1], "reward": 0.0}
            result = await work.post(prompt, [p.continued([6], 1.0, [-0.5]), fresh])
            assert result.accepted == 2

        batch = await broker.lease_batch("r", 2)
        assert batch is not None
        by_id = {r.rollout_id: r for r in batch.rollouts}
        np.testing.assert_array_equal(by_id["q-0"].response_ids, [3, 4, 5, 6])
        np.testing.assert_array_equal(by_id["q-0"].logprobs, [-0.5, -0.25, -1.0, -0.5])
        assert by_id["q-0"].prompt_id == by_id["q-1"].prompt_id == "q"
        np.testing.assert_array_equal(by_id["q-1"].prompt_ids, [7, 8])


async def test_a_continued_partial_may_be_posted_unscored(api: httpx.AsyncClient) -> None:
    """A generator whose rewards come from a verifier continues a partial with no reward: the
    rollout waits for its score before any trainer gets it."""
    async with AsyncBrokerClient(http=api) as broker:
        await broker.create_run("r", {"group_size": 1})
        await broker.register_prompts("r", [{"prompt_id": "q", "prompt_ids": [7]}])
        first = await broker.work_lease("r", 1)
        assert first is not None
        async with AsyncWork(broker, "r", first) as work:
            (prompt,) = work.prompts
            sampled = {"rollout_id": "q-0", "policy_version": 0, "response_ids": np.array([3])}
            assert await work.give_back(partials={prompt: [sampled]}) == 1
        second = await broker.work_lease("r", 1)
        assert second is not None
        async with AsyncWork(broker, "r", second) as work:
            (prompt,) = work.prompts
            (p,) = prompt.partials
            done = p.continued([4], None)
            assert done.reward is None
            assert (await work.post(prompt, [done])).accepted == 1
        assert await broker.lease_batch("r", 1) is None  # it awaits its reward
        lease = await broker.reward_lease("r", 1)
        assert lease is not None and [r.rollout_id for r in lease.rollouts] == ["q-0"]
        await broker.score("r", {"q-0": 1.0}, lease_id=lease.lease_id)
        batch = await broker.lease_batch("r", 1)
        assert batch is not None
        np.testing.assert_array_equal(batch.rollouts[0].response_ids, [3, 4])
