import random

import pytest

from services.router.core import RouterCore
from services.router.plan import NoWorkers, RoutingError, UnknownModel, WorkerRecord
from services.router.policies.base import RouteContext
from services.router.policies.registry import PolicyRegistry, register_all
from services.router.policy_setup import default_registry


def clock() -> float:
    return 0.0


def rec(i: str, model: str = "m", role: str = "agg") -> WorkerRecord:
    return WorkerRecord(i, f"127.0.0.1:{1000 + int(i[-1])}", model, role, 32, 2048)


def core(policy: str) -> RouterCore:
    c = RouterCore(policy=default_registry().create(policy, random.Random(0)), clock=clock)
    c.set_workers([rec("w1"), rec("w2"), rec("w3")])
    return c


def test_round_robin_cycles_in_id_order() -> None:
    c = core("round_robin")
    picks = [c.route(RouteContext(f"r{i}", "m")).worker.instance_id for i in range(6)]
    assert picks == ["w1", "w2", "w3", "w1", "w2", "w3"]


def test_least_loaded_uses_reports_and_in_flight() -> None:
    c = core("least_loaded")
    c.update_load("w1", num_running=3, num_waiting=1, kv_usage=0.5)
    c.update_load("w2", num_running=0, num_waiting=0, kv_usage=0.1)
    c.update_load("w3", num_running=0, num_waiting=0, kv_usage=0.2)
    assert c.route(RouteContext("a", "m")).worker.instance_id == "w2"
    # w2 now has one in flight, so w3 (load 0.2) beats w2 (1.1)
    assert c.route(RouteContext("b", "m")).worker.instance_id == "w3"
    assert c.in_flight() == {"w2": 1, "w3": 1}
    assert c.release("a") and not c.release("a")
    assert c.route(RouteContext("c", "m")).worker.instance_id == "w2"


def test_unknown_model_vs_no_live_worker() -> None:
    c = core("round_robin")
    with pytest.raises(UnknownModel):
        c.route(RouteContext("x", "other"))
    c.set_workers([])  # every lease expired
    with pytest.raises(NoWorkers):
        c.route(RouteContext("y", "m"))


def test_vanished_worker_leaves_candidates_and_loads() -> None:
    c = core("least_loaded")
    c.update_load("w1", 0, 0, 0.0)
    c.set_workers([rec("w2")])
    assert [w.instance_id for w in c.workers()] == ["w2"]
    assert c.route(RouteContext("a", "m")).worker.instance_id == "w2"
    c.update_load("w1", 0, 0, 0.0)  # late report of a gone worker is ignored
    assert c.route(RouteContext("b", "m")).worker.instance_id == "w2"


def test_only_generating_roles_are_candidates() -> None:
    c = RouterCore(policy=default_registry().create("round_robin", random.Random(0)),
                   clock=clock)
    c.set_workers([rec("w1", role="prefill")])
    with pytest.raises(NoWorkers, match="generate"):
        c.route(RouteContext("a", "m"))


def test_duplicate_request_id_rejected() -> None:
    c = core("round_robin")
    c.route(RouteContext("a", "m"))
    with pytest.raises(RoutingError):
        c.route(RouteContext("a", "m"))


def test_registry_rejects_duplicates_and_unknown_names() -> None:
    reg = register_all(PolicyRegistry())
    with pytest.raises(ValueError, match="already registered"):
        register_all(reg)
    with pytest.raises(KeyError, match="known"):
        reg.create("nope", random.Random(0))
    assert {"round_robin", "least_loaded"} <= set(reg.names())


def test_clock_and_rng_are_required() -> None:
    reg = default_registry()
    with pytest.raises(TypeError, match="clock"):
        RouterCore(policy=reg.create("round_robin", random.Random(0)))  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="rng"):
        reg.create("random")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="clock"):
        reg.create("approx", random.Random(0))  # no clock in the registry's context
    approx = default_registry(context={"clock": clock}).create("approx", random.Random(0))
    assert approx.name == "approx"
