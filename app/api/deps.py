"""What the routers take from the application state built in the lifespan."""

from __future__ import annotations

from fastapi import Request

from app.broker.service import Broker
from app.settings import Settings


def broker_of(request: Request) -> Broker:
    broker: Broker = request.app.state.broker
    return broker


def settings_of(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings
