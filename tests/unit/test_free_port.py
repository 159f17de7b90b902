"""services.common.procs.free_port: ports that an outgoing connection cannot take."""

from __future__ import annotations

import socket

import pytest

from services.common import procs


def test_ports_lie_outside_the_ephemeral_range_and_never_repeat() -> None:
    lo, hi = procs.ephemeral_range()
    ports = [procs.free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(not lo <= p <= hi and 1024 < p < 65536 for p in ports), ports


def test_a_port_is_bindable_when_given() -> None:
    port = procs.free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))
        s.listen()


def test_a_port_someone_listens_on_is_not_given(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        # the listening port is offered first
        monkeypatch.setattr(procs.random, "sample", lambda pop, k: [taken, *pop[:k]])
        monkeypatch.setattr(procs, "ephemeral_range", lambda: (65000, 65001))
        port = procs.free_port()
        assert port != taken and port not in (65000, 65001)


def test_no_port_outside_the_range_falls_back_to_the_kernel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    lo, hi = procs.ephemeral_range()  # the kernel's, where its choice falls
    monkeypatch.setattr(procs, "ephemeral_range", lambda: (1024, 65535))
    port = procs.free_port()
    assert lo <= port <= hi and port in procs._given_ports  # not given again either
