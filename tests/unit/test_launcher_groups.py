"""``kvmesh up`` takes an exited child's process group down, and never a reaped one's.

Real processes: a bash child that leaves a ``sleep`` grandchild in its own process group
(as a vLLM worker leaves its EngineCore) and exits. The exit is seen without reaping the
child (its zombie keeps the group id from being reused), the leftover is SIGKILLed, then
the child is reaped; a child that was already reaped has its group left alone, since its
id may belong to another process by then.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from services.common.procs import Child, spawn
from services.launcher.up import _exited, _finish, _stop_child
from tests.waiting import wait_for


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive: it only waits for its parent
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def _leaver(tmp_path: Path, name: str, code: int = 3) -> tuple[Child, int]:
    """A child whose ``sleep`` grandchild stays in its group after it exits."""
    pid_file = tmp_path / f"{name}.grandchild"
    child = spawn(name, ["bash", "-c", f"sleep 1000 & echo $! > {pid_file}; "
                                       f"while [ ! -s {pid_file} ]; do :; done; exit {code}"],
                  tmp_path)
    await wait_for(lambda: pid_file.exists() and pid_file.read_text().strip().isdigit(), 10,
                   "the grandchild's pid")
    return child, int(pid_file.read_text())


async def test_an_exited_childs_leftovers_die_with_it(tmp_path: Path) -> None:
    child, grandchild = await _leaver(tmp_path, "w")
    await wait_for(lambda: _exited(child), 10, "the child's exit")
    assert child.proc.returncode is None  # seen, not reaped: the group id is still held
    assert _alive(grandchild)
    _finish(child)
    assert child.proc.returncode == 3
    await wait_for(lambda: not _alive(grandchild), 10, "the grandchild killed")


async def test_a_reaped_childs_group_is_never_signalled(tmp_path: Path) -> None:
    child, grandchild = await _leaver(tmp_path, "r")
    child.proc.wait()  # reaped elsewhere: its id is no longer ours to signal
    try:
        _finish(child)
        assert _alive(grandchild)
    finally:
        os.kill(grandchild, signal.SIGKILL)


async def test_stop_child_terms_a_running_child_and_its_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "s.grandchild"
    child = spawn("s", ["bash", "-c", f"sleep 1000 & echo $! > {pid_file}; wait"], tmp_path)
    await wait_for(lambda: pid_file.exists() and pid_file.read_text().strip().isdigit(), 10,
                   "the grandchild's pid")
    grandchild = int(pid_file.read_text())
    _stop_child(child, timeout_s=10)
    assert child.proc.returncode == -signal.SIGTERM
    await wait_for(lambda: not _alive(grandchild), 10, "the grandchild gone")
