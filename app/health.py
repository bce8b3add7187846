"""Liveness and readiness."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from app.api import errors, render

router = APIRouter(tags=["health"])


class Alive(BaseModel):
    status: Literal["ok"]


class Ready(BaseModel):
    status: Literal["ready"]
    checks: dict[str, Literal["ok"]]


@router.get("/healthz", response_model=Alive)
async def healthz() -> Response:
    return render({"status": "ok"})


@router.get(
    "/readyz",
    response_model=Ready,
    responses=errors((503, "Redis or Postgres is unreachable, or not migrated")),
)
async def readyz(request: Request) -> Response:
    checks: dict[str, Any] = {}
    try:
        await request.app.state.redis.ping()
        checks["redis"] = "ok"
    except Exception as exc:  # readiness reports the failure instead of raising it
        checks["redis"] = f"unreachable: {type(exc).__name__}"
    probe = getattr(request.app.state, "readiness_probe", None)
    if probe is not None:
        checks.update(await probe())
    ready = all(v == "ok" for v in checks.values())
    if not ready:
        failing = ", ".join(f"{k} {v}" for k, v in checks.items() if v != "ok")
        return render({"error": "Unavailable", "detail": f"not ready: {failing}"}, status_code=503)
    return render({"status": "ready", "checks": checks})
