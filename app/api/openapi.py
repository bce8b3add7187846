"""The API description (``/openapi.json``) and its pages (``/docs``, ``/redoc``)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse


def install_openapi(app: FastAPI) -> None:
    """Serve /docs and /redoc for ``app`` (created with ``docs_url=None, redoc_url=None``)."""

    @app.get("/docs", include_in_schema=False)
    async def _docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - docs")

    @app.get("/redoc", include_in_schema=False)
    async def _redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url="/openapi.json", title=f"{app.title} - ReDoc")
