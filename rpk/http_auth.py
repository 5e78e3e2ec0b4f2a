"""The bearer-token check every rpk HTTP service (reward server, engine host) shares."""

from __future__ import annotations

import hmac
from typing import Any

from aiohttp import web


def bearer_auth(token: str) -> Any:
    """aiohttp middleware: every route but `/health` needs `Authorization: Bearer token`."""
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
        given = request.headers.get("Authorization", "").encode()
        # Constant-time: the comparison must not leak how much of a guess was right.
        if request.path != "/health" and not hmac.compare_digest(given, expected):
            raise web.HTTPUnauthorized(
                text="missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"}
            )
        return await handler(request)

    return auth
