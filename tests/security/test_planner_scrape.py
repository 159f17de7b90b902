"""The planner's scrape of the frontend's ``/metrics`` under ``--metrics-auth``: without a
key it is refused (no traffic observed, one warning naming the setting), with the key of
``--frontend-api-key`` it reads the frontend's counters."""

from __future__ import annotations

import logging

import httpx
import pytest

from services.planner.observe import MeshObserver
from tests.security.conftest import ALICE, MODEL, SecureMesh


async def observed_requests(mesh: SecureMesh, api_key: str) -> float | None:
    """Requests the frontend counted, as one planner collection sees them (None: none)."""
    observer = MeshObserver(mesh.launcher_etcd, mesh.namespace, 5.0, [f"{mesh.url}/metrics"],
                            mesh.tls("planner"), api_key=api_key)
    try:
        await observer.start()
        traffic = (await observer.collect()).observations.traffic
    finally:
        await observer.close()
    return None if traffic is None else traffic.requests


async def test_the_planner_scrapes_with_its_key(secure: SecureMesh,
                                                caplog: pytest.LogCaptureFixture) -> None:
    async with httpx.AsyncClient(base_url=secure.url, timeout=60) as client:
        resp = await client.post("/v1/completions", headers=ALICE, json={
            "model": MODEL, "prompt": "one two", "max_tokens": 2})
        assert resp.status_code == 200, resp.text
    caplog.set_level(logging.WARNING, logger="services.planner.observe")
    assert await observed_requests(secure, "") is None
    assert "401" in caplog.text and "--frontend-api-key" in caplog.text, caplog.text
    requests = await observed_requests(secure, ALICE["Authorization"].removeprefix("Bearer "))
    assert requests is not None and requests >= 1
