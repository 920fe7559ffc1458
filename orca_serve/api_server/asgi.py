"""ASGI plumbing shared by the middleware and the vote's sample requests."""

from __future__ import annotations

from collections.abc import Awaitable, Callable


def replay_body(body: bytes, then: Callable[[], Awaitable[dict]]) -> Callable[[], Awaitable[dict]]:
    """A `receive` that hands `body` (read, maybe rewritten) to the app once, then answers with
    `then` (the client's own `receive`, or a wait for its disconnect): vLLM's handlers keep
    watching `receive` for a disconnect after the body."""
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await then()

    return receive
