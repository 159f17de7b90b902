"""workers.engines.afd.transport_nixl without NIXL: the endpoint info wire format and the
peer-process check (the transport itself runs between processes in
tests/integration/test_afd_nixl.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from workers.engines.afd.connector import AfdTransportConfig
from workers.engines.afd.transport_nixl import EndpointInfo, _pid_gone


def test_endpoint_info_round_trip() -> None:
    info = EndpointInfo("ffn", -1, "afd-ffn-0-abc", 0x7F00_0000_1000,
                        AfdTransportConfig(576, 64, 2, 2), 4242, "host-a", b"\x00md\xffbytes")
    assert EndpointInfo.from_bytes(info.to_bytes()) == info


@pytest.mark.parametrize("data", [
    b"", b"short", b"NOTMAGIC" + b"\x02\x00\x00\x00{}",
    EndpointInfo("attention", 0, "a", 1, AfdTransportConfig(8, 1), 1, "h", b"").to_bytes()[:20],
    b"KVAFDNX1" + (2).to_bytes(4, "little") + b"{}",  # fields missing
    b"KVAFDNX1" + (3).to_bytes(4, "little") + b"[1]",  # not an object
])
def test_endpoint_info_rejects_garbage(data: bytes) -> None:
    with pytest.raises(ValueError):
        EndpointInfo.from_bytes(data)


def test_endpoint_info_rejects_bad_role() -> None:
    good = EndpointInfo("attention", 0, "a", 1, AfdTransportConfig(8, 1), 1, "h", b"m")
    bad = good.to_bytes().replace(b'"attention"', b'"decoder"')
    with pytest.raises(ValueError, match="role"):
        EndpointInfo.from_bytes(bad[:8] + (len(bad) - 13).to_bytes(4, "little") + bad[12:])


def test_pid_gone() -> None:
    assert not _pid_gone(os.getpid())
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: no /proc entry
    assert _pid_gone(proc.pid)
