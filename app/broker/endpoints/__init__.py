"""The broker's HTTP endpoints: runs and policy versions, rollouts, batches, prompts and work,
rewards, consumers.
Each parses the request with :mod:`app.api`, calls :class:`app.broker.service.Broker` and renders
its answer; the rules are the service's."""

from fastapi import APIRouter

from app.broker.endpoints import batches, consumers, prompts, rewards, rollouts, runs

ROUTERS: tuple[APIRouter, ...] = (
    runs.router,
    rollouts.router,
    batches.router,
    prompts.router,
    rewards.router,
    consumers.router,
)
"""In the order the app includes them."""

post_rollouts = rollouts.post_rollouts
"""The endpoint the app serves past the router (:mod:`app.api._direct`)."""

__all__ = ["ROUTERS", "post_rollouts"]
