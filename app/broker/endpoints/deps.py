"""What the broker's endpoints take from the application state: the broker service."""

from __future__ import annotations

from fastapi import Request

from app.broker.service import Broker


def broker_of(request: Request) -> Broker:
    broker: Broker = request.app.state.broker
    return broker
