"""``GET /ui``: the page for a person watching runs (``app/ui/index.html``).

The page is self-contained: its style and script are inline and its charts are drawn by hand,
so it works offline. It needs no token to load; its data calls send the token the person types
(kept in the tab's ``sessionStorage``). The Content-Security-Policy allows this server and the
page's own inline script (by hash) and style, and nothing from anywhere else.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import re
from dataclasses import dataclass
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

__all__ = ["router"]

router = APIRouter(include_in_schema=False)

_SCRIPT = re.compile(r"<script>(.*?)</script>", re.DOTALL)


@dataclass(frozen=True, slots=True)
class Page:
    html: bytes
    headers: dict[str, str]


def content_security_policy(html: str) -> str:
    """Only this origin, plus the inline scripts of ``html`` by their hashes (a script injected
    into the page would not run) and inline style; no frames, plugins, forms or base URL."""
    hashes = " ".join(
        "'sha256-" + base64.b64encode(hashlib.sha256(s.encode()).digest()).decode() + "'"
        for s in _SCRIPT.findall(html)
    )
    return "; ".join(
        [
            "default-src 'self'",
            f"script-src {hashes}",
            "style-src 'self' 'unsafe-inline'",
            "img-src 'self' data:",
            "connect-src 'self'",
            "font-src 'none'",
            "object-src 'none'",
            "frame-src 'none'",
            "worker-src 'none'",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        ]
    )


@functools.cache
def page() -> Page:
    """The page and its headers, read from the package once, at the first request."""
    html = resources.files("app.ui").joinpath("index.html").read_text(encoding="utf-8")
    return Page(
        html.encode(),
        {
            "Content-Security-Policy": content_security_policy(html),
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer",
            "Cache-Control": "no-cache",
        },
    )


@router.get("/ui")
async def ui() -> Response:
    p = page()
    return Response(p.html, media_type="text/html; charset=utf-8", headers=p.headers)
