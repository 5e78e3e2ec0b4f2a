"""What every rpk HTTP service (reward server, engine host and its judge and speculation
routes) shares: the bearer-token check, the JSON object a route reads."""

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


async def json_body(request: web.Request, *, optional: bool = False) -> dict[str, Any]:
    """The request's JSON object; 400 naming what came instead. `optional`: a request
    without a body reads as {}."""
    if optional and not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except ValueError as e:
        raise web.HTTPBadRequest(text=f"request body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text=f"request body must be a JSON object, got {type(body).__name__}")
    return body
