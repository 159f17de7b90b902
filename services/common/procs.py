"""Child-process helpers shared by the launcher and the test fixtures.

Contract:

- :func:`free_port` returns a loopback TCP port that was free a moment ago, taken from
  outside the kernel's ephemeral range (``ip_local_port_range``) and never the same port
  twice in one process. A port from inside that range could be taken, between the pick
  and the child's bind, by any outgoing connection on the machine (the fault mesh's
  frontend once failed to bind that way); outside it only another explicit bind can.
- :func:`spawn` starts a child in its own process group (session), output appended to or
  replacing ``log_dir/<name>.log``, PID in ``log_dir/<name>.pid``. Called from the main
  thread (the default ``die_with_parent=True``), the child gets ``PR_SET_PDEATHSIG(SIGTERM)``
  (set by util-linux's ``setpriv --pdeathsig TERM``, which then execs the command, so the
  PID is the command's): when this process dies, even by SIGKILL, the kernel sends the
  child SIGTERM, so nothing is orphaned. PDEATHSIG fires when the *thread* that forked
  exits, so a spawn from another thread does not set it (the child would die with that
  thread). Elsewhere than Linux, or without setpriv, the flag is ignored.
- :func:`start_etcd` / :func:`start_redis` start Debian's ``etcd`` / ``redis-server`` bound
  to 127.0.0.1 on free ports in their own process group, wait until they answer, and
  return a :class:`Child`. They raise RuntimeError (with the tail of the log) on failure.
  :func:`etcd_argv` / :func:`redis_argv` are their command lines (to restart one the same
  way). Redis keeps nothing by default; with ``data_dir`` it keeps an append-only file
  there (``appendonly yes``, ``appendfsync everysec``: a crash loses at most the last
  ~1 s of writes) and a restart with the same ``data_dir`` reloads it. With ``tls_dir``
  Redis speaks only TLS (mesh CA, client certificates required) with the ACL users of
  :mod:`services.common.redis_acl`.
- :class:`Child` remembers the PID it started; ``stop()`` sends SIGTERM to that PID's
  process group only, waits, then SIGKILLs it. Nothing else is ever signalled.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

_LOWEST_PORT = 10000
_given_ports: set[int] = set()
_given_lock = threading.Lock()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range, both ends included (Linux's default elsewhere)."""
    with contextlib.suppress(OSError, ValueError):
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    return 32768, 60999


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A free port on 127.0.0.1, outside the ephemeral range, new to this process (see the
    module docstring). Falls back to a kernel-chosen port when no such port binds."""
    lo, hi = ephemeral_range()
    candidates = [*range(_LOWEST_PORT, lo), *range(hi + 1, 65536)]
    with _given_lock:
        for port in random.sample(candidates, min(len(candidates), 200)):
            if port not in _given_ports and _bindable(port):
                _given_ports.add(port)
                return port
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        _given_ports.add(port)
        return port


def port_open(host: str, port: int) -> bool:
    """True when something accepts TCP connections at host:port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


@dataclass
class Child:
    """A process this program started."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    address: str = ""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout: float = 10.0, sig: int = signal.SIGTERM) -> int | None:
        """Signals our own process group, waits, kills if needed; returns the exit code."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        self.stop(timeout=5, sig=signal.SIGKILL)


def _die_with_parent(argv: list[str]) -> list[str]:
    """``argv`` run under util-linux's ``setpriv --pdeathsig TERM`` (module docstring), or
    unchanged where that cannot be done (not Linux, not the main thread, no setpriv).

    Not a ``preexec_fn``: Python code between fork and exec makes subprocess fork()
    instead of vfork(), which runs gRPC's fork handlers in the child; with gRPC threads
    running that child died of SIGSEGV at once."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not \
            threading.main_thread():
        return argv
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM", "--", *argv] if setpriv else argv


def spawn(name: str, argv: Sequence[str], log_dir: Path,
          env: Mapping[str, str] | None = None, *, append: bool = False,
          die_with_parent: bool = True) -> Child:
    """Starts ``argv`` in its own process group with output to ``log_dir/name.log``
    (appended to with ``append``, else replaced); its PID is written to
    ``log_dir/name.pid``. ``die_with_parent``: see the module docstring."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    cmd = _die_with_parent(list(argv)) if die_with_parent else list(argv)
    with open(log_path, "ab" if append else "wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=dict(env) if env is not None else None, start_new_session=True,
        )
    (log_dir / f"{name}.pid").write_text(str(proc.pid))
    return Child(name, proc, log_path)


def wait_until(check: Callable[[], bool], child: Child, timeout: float, what: str) -> None:
    """Polls ``check`` until true; raises with the child's log if it dies or times out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        if not child.alive():
            raise RuntimeError(f"{child.name} exited ({child.proc.returncode}) before {what}:\n"
                               f"{child.log_tail()}")
        time.sleep(0.05)
    raise RuntimeError(f"{child.name}: timed out waiting for {what}:\n{child.log_tail()}")


def which_or_raise(binary: str) -> str:
    path = shutil.which(binary) or (f"/usr/bin/{binary}" if Path(f"/usr/bin/{binary}").exists()
                                    else None)
    if path is None:
        raise RuntimeError(f"{binary} not found; install Debian's package (make deps)")
    return path


def etcd_argv(work_dir: Path, port: int, peer_port: int,
              tls_dir: Path | None = None) -> list[str]:
    """etcd's command line: one member on 127.0.0.1 with its data in ``work_dir``. With
    ``tls_dir`` (a mesh certificate folder) its client URL is https and requires a client
    certificate signed by the mesh CA (``etcd.pem`` / ``etcd-key.pem`` its own, ``ca.pem``
    the trust root; with auth enabled etcd takes the user from the certificate's CN, see
    :mod:`services.common.etcd_auth`). The peer URL stays plain http on loopback: a single
    member has no peer to talk to."""
    scheme = "https" if tls_dir is not None else "http"
    url = f"{scheme}://127.0.0.1:{port}"
    data = work_dir / "etcd-data"
    data.mkdir(parents=True, exist_ok=True)
    secure = [] if tls_dir is None else [
        "--cert-file", str(tls_dir / "etcd.pem"), "--key-file", str(tls_dir / "etcd-key.pem"),
        "--trusted-ca-file", str(tls_dir / "ca.pem"), "--client-cert-auth"]
    return [
        which_or_raise("etcd"), "--name", "kvmesh", "--data-dir", str(data),
        "--listen-client-urls", url, "--advertise-client-urls", url, *secure,
        "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
        "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
        "--initial-cluster", f"kvmesh=http://127.0.0.1:{peer_port}",
        "--listen-metrics-urls", f"http://127.0.0.1:{free_port()}",
    ]


def start_etcd(work_dir: Path, log_dir: Path, port: int = 0, peer_port: int = 0,
               tls_dir: Path | None = None) -> Child:
    """etcd on 127.0.0.1 (``port`` and ``peer_port``, or free ones; the same ports and
    ``work_dir`` restart the same member with its data); ``child.address`` is host:port
    of the client URL, ``https://host:port`` with ``tls_dir`` (:func:`etcd_argv`)."""
    port, peer = port or free_port(), peer_port or free_port()
    child = spawn("etcd", etcd_argv(work_dir, port, peer, tls_dir), log_dir)
    child.address = f"{'https://' if tls_dir is not None else ''}127.0.0.1:{port}"
    wait_until(lambda: port_open("127.0.0.1", port), child, 20, "etcd to listen")
    return child


def redis_argv(port: int, data_dir: Path | None = None, tls_dir: Path | None = None,
               namespace: str = "kvmesh") -> list[str]:
    """redis-server's command line on 127.0.0.1: no persistence, or with ``data_dir`` an
    append-only file there fsynced every second (module docstring). No RDB snapshots.

    With ``tls_dir`` (a mesh certificate folder) Redis speaks only TLS on ``port``
    (``--port 0 --tls-port``), presents ``redis.pem``, requires a client certificate
    signed by the mesh CA, and loads the ACL users of :mod:`services.common.redis_acl`
    for ``namespace`` from ``redis-users.acl``, written here from the folder's
    ``redis-<role>.pass`` files (the ``default`` user is off)."""
    persist = ["--appendonly", "no"]
    if data_dir is not None:
        data_dir.mkdir(parents=True, exist_ok=True)
        persist = ["--dir", str(data_dir), "--appendonly", "yes", "--appendfsync", "everysec"]
    listen = ["--port", str(port)]
    if tls_dir is not None:
        from services.common.redis_acl import write_acl_file

        missing = [str(p) for p in (tls_dir / "redis.pem", tls_dir / "redis-key.pem",
                                    tls_dir / "ca.pem") if not p.is_file()]
        if missing:
            raise RuntimeError(f"tls_dir: missing {', '.join(missing)} (run `kvmesh certs "
                               f"--out {tls_dir}`)")
        listen = ["--port", "0", "--tls-port", str(port),
                  "--tls-cert-file", str(tls_dir / "redis.pem"),
                  "--tls-key-file", str(tls_dir / "redis-key.pem"),
                  "--tls-ca-cert-file", str(tls_dir / "ca.pem"), "--tls-auth-clients", "yes",
                  "--aclfile", str(write_acl_file(tls_dir, namespace))]
    return [which_or_raise("redis-server"), "--bind", "127.0.0.1", *listen,
            "--save", "", *persist, "--protected-mode", "yes"]


def start_redis(log_dir: Path, port: int = 0, data_dir: Path | None = None,
                tls_dir: Path | None = None, namespace: str = "kvmesh") -> Child:
    """redis-server on 127.0.0.1 (``port``, or a free one); no persistence unless
    ``data_dir``, TLS and ACL users with ``tls_dir`` (:func:`redis_argv`); address is
    host:port (the TLS port with ``tls_dir``: connect with ``rediss://``)."""
    port = port or free_port()
    child = spawn("redis", redis_argv(port, data_dir, tls_dir, namespace), log_dir)
    child.address = f"127.0.0.1:{port}"
    wait_until(lambda: port_open("127.0.0.1", port), child, 10, "redis to listen")
    return child
