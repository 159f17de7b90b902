"""NIXL agent helpers shared by the benchmark and its peer process, and the peer itself.

Contracts:

- :func:`configure_ucx_env` pins UCX to loopback (``UCX_NET_DEVICES=lo``) and sets or clears
  ``UCX_TLS``. It must run before the first agent of the process is created; children
  started afterwards inherit it.
- :func:`make_agent` creates a NIXL agent with the progress thread off and one UCX backend
  (``ucx_error_handling_mode`` as given). Measured here with ``UCX_TLS`` including ``sm`` (or
  unset), READ/WRITE between two local processes use UCX's cma zero-copy in either mode
  (one syscall in the initiator; the target's CPU is not needed); ``"none"`` puts the
  active-message lane on sysv shared memory, ``"peer"`` puts it on tcp. With the progress
  thread off, UCX only progresses inside NIXL calls, so a target whose data path needs its
  CPU (tcp-only) must keep calling :func:`progress`.
- :func:`fill_pattern` / :func:`check_pattern` write / fully compare a deterministic,
  seed-dependent byte pattern, so either side can check what the other transferred.
- :func:`send_msg` / :func:`recv_msg` frame one JSON header plus an optional binary blob on
  a stream socket (the control channel on 127.0.0.1).
- ``python -m bench.transfer.agent --port P --size N`` is the peer: it connects to
  127.0.0.1:P, registers an N-byte DRAM buffer, sends ``{"name", "addr", "len"}`` with its
  agent metadata as the blob, then serves ``fill``/``verify``/``busy``/``exit`` requests
  (each answered with ``{"ok": ...}``). Between requests it progresses UCX about once a
  millisecond, or in a tight loop after ``{"op": "busy", "on": true}`` (which costs a core:
  on 2 cores that slows cma transfers, which need no target progress). It always ends
  with ``os._exit`` after cleanup, because NIXL 1.5.1 may segfault at interpreter exit.
- :class:`Peer` (benchmark side) spawns that process, accepts its connection, and
  :meth:`Peer.close` always stops it: ``exit`` request, then SIGTERM/SIGKILL by its PID.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

PATTERN_MULT = np.uint64(0x9E3779B97F4A7C15)
_HDR = struct.Struct("!II")  # JSON header length, blob length
REPO_ROOT = Path(__file__).resolve().parents[2]


def configure_ucx_env(tls: str, net_devices: str = "lo") -> dict[str, str | None]:
    """Set UCX_NET_DEVICES and UCX_TLS (``tls == ""`` unsets it); return the UCX env in force."""
    os.environ["UCX_NET_DEVICES"] = net_devices
    if tls:
        os.environ["UCX_TLS"] = tls
    else:
        os.environ.pop("UCX_TLS", None)
    return {k: os.environ.get(k) for k in ("UCX_NET_DEVICES", "UCX_TLS")}


def make_agent(name: str, err_mode: str = "none") -> Any:
    """A NIXL agent named ``name``: progress thread off, one UCX backend."""
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
    agent.create_backend("UCX", {"ucx_error_handling_mode": err_mode})
    return agent


def progress(agent: Any) -> None:
    """Drive UCX progress once (fetching notifications progresses the worker)."""
    agent.get_new_notifs()


def alloc_buffer(nbytes: int) -> np.ndarray:
    """A page-faulted-in (zeroed) uint8 buffer of ``nbytes``."""
    buf = np.empty(nbytes, dtype=np.uint8)
    buf.fill(0)
    return buf


def _expected(size: int, seed: int) -> np.ndarray:
    words = (size + 7) // 8
    vals = np.arange(words, dtype=np.uint64)
    vals *= PATTERN_MULT
    vals += np.uint64(seed)
    return vals.view(np.uint8)[:size]


def fill_pattern(buf: np.ndarray, size: int, seed: int) -> None:
    """Write the pattern for ``seed`` into ``buf[:size]``."""
    buf[:size] = _expected(size, seed)


def check_pattern(buf: np.ndarray, size: int, seed: int) -> bool:
    """True iff every byte of ``buf[:size]`` equals the pattern for ``seed``."""
    return bool(np.array_equal(buf[:size], _expected(size, seed)))


def send_msg(sock: socket.socket, header: dict[str, Any], blob: bytes = b"") -> None:
    """Send one framed message."""
    data = json.dumps(header).encode()
    sock.sendall(_HDR.pack(len(data), len(blob)) + data + blob)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < n:
        chunk = sock.recv(n - len(chunks))
        if not chunk:
            raise ConnectionError("control socket closed")
        chunks += chunk
    return bytes(chunks)


def recv_msg(sock: socket.socket) -> tuple[dict[str, Any], bytes]:
    """Receive one framed message (blocking)."""
    hlen, blen = _HDR.unpack(_recv_exact(sock, _HDR.size))
    header = json.loads(_recv_exact(sock, hlen))
    return header, _recv_exact(sock, blen) if blen else b""


class Peer:
    """The spawned peer process and its control socket; :meth:`close` always stops it."""

    def __init__(self, size: int, err_mode: str, start_timeout_s: float = 60.0) -> None:
        self.sock: socket.socket | None = None
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(1)
            listener.settimeout(0.5)
            port = listener.getsockname()[1]
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "bench.transfer.agent", "--port", str(port),
                 "--size", str(size), "--ucx-err-mode", err_mode],
                cwd=REPO_ROOT, stdin=subprocess.DEVNULL)
            deadline = time.monotonic() + start_timeout_s
            while self.sock is None:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"peer exited early with code {self.proc.returncode}")
                if time.monotonic() > deadline:
                    raise TimeoutError("peer did not connect")
                try:
                    self.sock, _ = listener.accept()
                except TimeoutError:
                    continue
        self.sock.settimeout(120)

    def hello(self) -> tuple[dict[str, Any], bytes]:
        """The peer's first message: ``{"name", "addr", "len"}`` and its agent metadata."""
        assert self.sock is not None
        return recv_msg(self.sock)

    def request(self, **req: Any) -> dict[str, Any]:
        """Send one request and return the reply."""
        assert self.sock is not None
        send_msg(self.sock, req)
        return recv_msg(self.sock)[0]

    def close(self) -> None:
        """Ask the peer to exit, then terminate / kill it by PID if it is still there."""
        try:
            if self.sock is not None and self.proc.poll() is None:
                self.request(op="exit")
            self.proc.wait(timeout=10)
        except Exception as exc:  # the peer may already be gone
            print(f"peer did not exit cleanly: {exc}", file=sys.stderr)
        finally:
            if self.sock is not None:
                self.sock.close()
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=5)


def _handle(req: dict[str, Any], buf: np.ndarray) -> dict[str, Any]:
    op = req.get("op")
    if op == "fill":
        fill_pattern(buf, int(req["size"]), int(req["seed"]))
        return {"ok": True}
    if op == "verify":
        return {"ok": check_pattern(buf, int(req["size"]), int(req["seed"]))}
    return {"ok": False, "error": f"unknown op {op!r}"}


def serve(port: int, size: int, err_mode: str) -> int:
    """Run the peer until ``exit`` or a closed socket; return the exit code."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.settimeout(None)
    agent = make_agent(f"peer-{os.getpid()}", err_mode)
    buf = alloc_buffer(size)
    reg = agent.register_memory([(buf.ctypes.data, size, 0, "")], "DRAM")
    code = 1
    try:
        send_msg(sock, {"name": agent.name, "addr": buf.ctypes.data, "len": size},
                 agent.get_agent_metadata())
        busy = False  # spin on UCX progress, or progress about once a millisecond
        while True:
            ready, _, _ = select.select([sock], [], [], 0 if busy else 0.001)
            if not ready:
                progress(agent)
                continue
            req, _ = recv_msg(sock)
            if req.get("op") == "exit":
                send_msg(sock, {"ok": True})
                code = 0
                break
            if req.get("op") == "busy":
                busy = bool(req["on"])
                send_msg(sock, {"ok": True})
                continue
            send_msg(sock, _handle(req, buf))
    except ConnectionError:
        print("peer: control socket closed", file=sys.stderr)
    finally:
        try:
            agent.deregister_memory(reg)
        except Exception as exc:  # best effort before os._exit
            print(f"peer: deregister failed: {exc}", file=sys.stderr)
        sock.close()
    return code


def main(argv: list[str] | None = None) -> None:
    """Entry point of the peer process; never returns (``os._exit``)."""
    p = argparse.ArgumentParser(prog="python -m bench.transfer.agent")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--ucx-err-mode", default="none")
    args = p.parse_args(argv)
    code = 1
    try:
        code = serve(args.port, args.size, args.ucx_err_mode)
    except BaseException as exc:  # report, then hard-exit
        print(f"peer: {type(exc).__name__}: {exc}", file=sys.stderr)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    main()
