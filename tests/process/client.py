"""Small helpers for talking to a node process over HTTP with an ``aiohttp.ClientSession``."""

from __future__ import annotations

from typing import Any

import aiohttp

from tests.harness import SkyringProcess


async def create_timer(
    http: aiohttp.ClientSession, node: SkyringProcess, body: dict[str, Any], timer_id: str | None = None
) -> str:
    """POST /timer; asserts 201 and returns the timer's id."""
    headers = {"x-timer-id": timer_id} if timer_id is not None else None
    async with http.post(f"{node.url}/timer", json=body, headers=headers) as response:
        assert response.status == 201, await response.text()
        return response.headers["Location"].removeprefix("/timer/")


async def get_timer(http: aiohttp.ClientSession, node: SkyringProcess, timer_id: str) -> tuple[int, Any]:
    """GET /timer/<id>: the status and the JSON body."""
    async with http.get(f"{node.url}/timer/{timer_id}") as response:
        return response.status, await response.json()


async def cancel_timer(http: aiohttp.ClientSession, node: SkyringProcess, timer_id: str) -> int:
    """DELETE /timer/<id>: the status."""
    async with http.delete(f"{node.url}/timer/{timer_id}") as response:
        await response.read()
        return response.status


async def health(http: aiohttp.ClientSession, node: SkyringProcess) -> dict[str, Any]:
    """GET /health; asserts 200 and returns the report."""
    async with http.get(f"{node.url}/health") as response:
        assert response.status == 200, await response.text()
        report: dict[str, Any] = await response.json()
        return report
