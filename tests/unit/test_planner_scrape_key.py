"""The planner's scrapes of a frontend's ``/metrics`` with ``--metrics-auth``: which key
it sends (``--frontend-api-key``, else ``KVMESH_API_KEY``), that it goes as a Bearer
token, and that a refused scrape logs once (naming the setting, never the key) until it
works again. The frontend's side is its own metrics rendered by an httpx transport that
checks the header as :mod:`services.frontend.http_api` does (the real frontend is
scraped in tests/security/test_planner_scrape.py)."""

from __future__ import annotations

import logging

import httpx
import pytest

from services.common.config import load_config
from services.frontend.metrics import FrontendMetrics
from services.planner.main import PlannerConfig
from services.planner.observe import MeshObserver

KEY = "sk-planner"


def test_the_key_comes_from_the_flag_else_kvmesh_api_key() -> None:
    cfg = load_config(PlannerConfig, ["--frontend-api-key", KEY], environ={})
    assert cfg.scrape_api_key({"KVMESH_API_KEY": "sk-other"}) == KEY
    env = {"KVMESH_FRONTEND_API_KEY": KEY}
    assert load_config(PlannerConfig, [], environ=env).scrape_api_key({}) == KEY
    cfg = load_config(PlannerConfig, [], environ={})
    assert cfg.scrape_api_key({"KVMESH_API_KEY": "sk-client"}) == "sk-client"
    assert cfg.scrape_api_key({}) == ""


def frontend(accepted: list[str], seen: list[str]) -> httpx.MockTransport:
    """/metrics that answers 200 only to ``Authorization: Bearer <a key in accepted>``."""
    metrics = FrontendMetrics()
    metrics.requests.labels("agg", "stop").inc(3)

    def handle(request: httpx.Request) -> httpx.Response:
        auth = request.headers.get("authorization", "")
        seen.append(auth)
        if auth.removeprefix("Bearer ") not in accepted or not auth.startswith("Bearer "):
            return httpx.Response(401, json={"error": {"code": "invalid_api_key"}})
        return httpx.Response(200, content=metrics.render())
    return httpx.MockTransport(handle)


URL = "http://frontend:8000/metrics"


def observer(transport: httpx.MockTransport, api_key: str = "") -> MeshObserver:
    """An observer of that frontend alone (its etcd watchers are never started)."""
    return MeshObserver("127.0.0.1:1", "ns", metrics_urls=[URL], transport=transport,
                        api_key=api_key)


async def collect_traffic(obs: MeshObserver) -> float | None:
    """The requests the frontend counted, as one collection sees them."""
    traffic = (await obs.collect()).observations.traffic
    return None if traffic is None else traffic.requests


async def test_scrapes_send_the_key_as_bearer() -> None:
    seen: list[str] = []
    obs = observer(frontend([KEY], seen), KEY)
    try:
        assert await collect_traffic(obs) == 3
    finally:
        await obs.close()
    assert seen == [f"Bearer {KEY}"]


async def test_a_refused_scrape_logs_once_until_it_works(
        caplog: pytest.LogCaptureFixture) -> None:
    accepted: list[str] = []
    seen: list[str] = []
    obs = observer(frontend(accepted, seen), KEY)
    caplog.set_level(logging.INFO, logger="services.planner.observe")
    try:
        for _ in range(3):
            assert await collect_traffic(obs) is None
        assert obs.scrape_failures == 3
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, warnings
        assert "401" in warnings[0] and "was refused" in warnings[0], warnings
        assert KEY not in caplog.text
        accepted.append(KEY)
        assert await collect_traffic(obs) == 3
        assert "works again after 3 failures" in caplog.text
    finally:
        await obs.close()


async def test_without_a_key_the_warning_names_the_settings(
        caplog: pytest.LogCaptureFixture) -> None:
    seen: list[str] = []
    obs = observer(frontend([KEY], seen))
    try:
        assert await collect_traffic(obs) is None
    finally:
        await obs.close()
    assert seen == [""]
    assert "--frontend-api-key" in caplog.text and "KVMESH_API_KEY" in caplog.text
