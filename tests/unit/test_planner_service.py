"""Planner service glue without network: metrics parsing, config, one loop step."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from protos import discovery_pb2
from services.common.config import ConfigError, load_config
from services.common.perf_model import PolynomialPerfModel
from services.frontend.metrics import FrontendMetrics
from services.planner.actuators import DryRunActuator, LocalActuator
from services.planner.core import Observations, PlannerCore, TrafficCounters, WorkerLoad
from services.planner.main import PlannerConfig, PlannerLoop, external_workers
from services.planner.observe import Snapshot, add_traffic, traffic_from_metrics
from tests.unit.test_planner_actuators import FakeSpawn


def test_traffic_from_the_frontends_metrics() -> None:
    fm = FrontendMetrics()
    fm.requests.labels("agg", "ok").inc(3)
    fm.requests.labels("disagg", "error").inc(1)
    fm.ttft.labels("agg").observe(0.2)
    fm.ttft.labels("disagg").observe(0.4)
    # the metrics the planner also reads (proposed for the frontend)
    r = CollectorRegistry()
    Counter("kvmesh_prompt_tokens", "", registry=r).inc(4000)
    Counter("kvmesh_completion_tokens", "", registry=r).inc(400)
    itl = Histogram("kvmesh_itl_seconds", "", registry=r)
    for v in (0.01, 0.03):
        itl.observe(v)
    text = fm.render().decode() + generate_latest(r).decode()
    t = traffic_from_metrics(text)
    assert t.requests == 4 and t.input_tokens == 4000 and t.output_tokens == 400
    assert t.ttft_count == 2 and t.ttft_sum_s == pytest.approx(0.6)
    assert t.itl_count == 2 and t.itl_sum_s == pytest.approx(0.04)
    assert traffic_from_metrics("") == TrafficCounters()
    assert add_traffic([t, t]).requests == 8


def test_config_validation_and_settings() -> None:
    cfg = load_config(PlannerConfig, ["--max-decode", "4", "--predictor", "kalman",
                                      "--compose-services", "decode=dw"],
                      {"KVMESH_LOAD_INTERVAL_S": "2"})
    s = cfg.settings()
    assert s.limit("decode").max_replicas == 4 and s.predictor == "kalman"
    assert cfg.resolved_tick_s() == 2 and cfg.compose_map() == {"decode": "dw"}
    for argv in (["--actuator", "k8s"], ["--predictor", "prophet"], ["--min-decode", "9"],
                 ["--worker-env", "[1]"], ["--perf-model", "/nonexistent.json"],
                 ["--throughput-interval-s", "0", "--load-interval-s", "0"]):
        with pytest.raises(ConfigError):
            load_config(PlannerConfig, argv, {})


class FakeObserver:
    def __init__(self, snaps: list[Snapshot]) -> None:
        self.snaps = snaps

    async def collect(self) -> Snapshot:
        return self.snaps.pop(0)


def snap(n_p: int, n_d: int, **load: float) -> Snapshot:
    workers = ([WorkerLoad(f"p{i}", "prefill", **load) for i in range(n_p)]  # type: ignore[arg-type]
               + [WorkerLoad(f"d{i}", "decode", **load) for i in range(n_d)])  # type: ignore[arg-type]
    return Snapshot(Observations(tuple(workers)), {})


async def test_loop_step_applies_and_publishes() -> None:
    now = [0.0]
    core = PlannerCore(PlannerConfig(throughput_interval_s=0, load_interval_s=5,
                                     cooldown_s=0).settings(), PolynomialPerfModel())
    act = DryRunActuator()
    published = []

    async def publish(d):  # type: ignore[no-untyped-def]
        published.append(d.desired)

    loop = PlannerLoop(core, FakeObserver([snap(1, 1), snap(1, 1), snap(1, 1, num_waiting=9)]),
                       act, 5.0, clock=lambda: now[0], publish=publish)
    d0 = await loop.step()
    assert d0.desired == {"prefill": 1, "decode": 1} and act.applied == []  # nothing to do
    now[0] = 5.0
    await loop.step()
    now[0] = 10.0
    d2 = await loop.step()
    assert d2.desired == {"prefill": 2, "decode": 2} and act.applied == [d2]
    assert published[-1] == {"prefill": 2, "decode": 2}


def test_external_workers_by_published_pid() -> None:
    recs = {
        "p0": discovery_pb2.InstanceRecord(instance_id="p0", pid=11),
        "p1": discovery_pb2.InstanceRecord(instance_id="p1", pid=22),
        "d0": discovery_pb2.InstanceRecord(instance_id="d0"),
    }
    s = Snapshot(Observations((WorkerLoad("p0", "prefill"), WorkerLoad("p1", "prefill"),
                               WorkerLoad("d0", "decode"))), recs)
    assert external_workers(s, {22}) == {"prefill": 1, "decode": 1}


async def test_loop_tells_the_local_actuator_which_workers_are_not_its_own(
        tmp_path: Path) -> None:
    spawn = FakeSpawn()
    act = LocalActuator(tmp_path, {}, spawn_fn=spawn)  # type: ignore[arg-type]
    core = PlannerCore(PlannerConfig(throughput_interval_s=0, load_interval_s=5,
                                     cooldown_s=0).settings(), PolynomialPerfModel())

    def mesh(waiting: int, own: dict[str, int]) -> Snapshot:
        """One external worker per pool plus the actuator's own (pool -> pid)."""
        loads = [WorkerLoad(f"{pool}-ext", pool, num_waiting=waiting)
                 for pool in ("prefill", "decode")]
        loads += [WorkerLoad(f"{pool}-own", pool) for pool in own]
        recs = {f"{pool}-own": discovery_pb2.InstanceRecord(instance_id=f"{pool}-own", pid=pid)
                for pool, pid in own.items()}
        return Snapshot(Observations(tuple(loads)), recs)

    now = [0.0]
    observer = FakeObserver([mesh(0, {}), mesh(9, {})])
    loop = PlannerLoop(core, observer, act, 5.0, clock=lambda: now[0])
    await loop.step()
    assert act.external == {"prefill": 1, "decode": 1} and spawn.children == []
    now[0] = 5.0
    d = await loop.step()  # queues are long: one more per pool, started by the actuator
    assert d.desired == {"prefill": 2, "decode": 2}
    assert [c.env["KVMESH_ROLE"] for c in spawn.children] == ["prefill", "decode"]
    observer.snaps.append(mesh(0, {c.env["KVMESH_ROLE"]: c.pid for c in spawn.children}))
    await loop.step()  # the new workers carry the actuator's pids: still one external each
    assert act.external == {"prefill": 1, "decode": 1}
    assert len(spawn.children) == 2 and not any(c.stopped for c in spawn.children)


def test_local_actuator_env_does_not_leak_planner_settings(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from services.planner.main import build_actuator

    monkeypatch.setenv("KVMESH_PORT", "50051")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cfg = load_config(PlannerConfig, ["--actuator", "local", "--etcd-endpoint", "e:1",
                                      "--worker-env", '{"KVMESH_ENGINE": "mock"}',
                                      "--worker-log-dir", str(tmp_path)], {})
    act = build_actuator(cfg)
    assert isinstance(act, LocalActuator)
    env = act._env
    assert "KVMESH_PORT" not in env and env["OMP_NUM_THREADS"] == "1"
    assert env["KVMESH_ETCD_ENDPOINT"] == "e:1" and env["KVMESH_ENGINE"] == "mock"


def test_isl_is_averaged_over_finished_requests_not_rejected_ones() -> None:
    from services.planner.observe import traffic_from_metrics

    text = "\n".join([
        "# TYPE kvmesh_requests_total counter",
        'kvmesh_requests_total{path="agg",outcome="stop"} 3',
        'kvmesh_requests_total{path="agg",outcome="length"} 1',
        'kvmesh_requests_total{path="none",outcome="rejected"} 6',
        "# TYPE kvmesh_prompt_tokens_total counter",
        "kvmesh_prompt_tokens_total 4000",
        ""])
    t = traffic_from_metrics(text)
    assert t.requests == 10 and t.finished == 4 and t.input_tokens / t.finished == 1000
