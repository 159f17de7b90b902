"""Dynamo 1.6.1's frontend and mockers as child processes on loopback, for the side-by-side
bench. Optional: Dynamo is not a requirement of kvmesh.

Contracts:

- :func:`ensure_dynvenv(path)` installs Dynamo 1.6.1 on demand into its own venv
  (``.dynvenv``, gitignored): ``ai-dynamo-runtime==1.6.1`` (with its dependencies, among
  them its pydantic pin, which is why it is not in ``.venv``), then ``ai-dynamo==1.6.1
  --no-deps``, then ai-dynamo's unconditional dependencies except ``aisimulate`` (its
  sdist downloads from outside) and the runtime already there. A stamp file marks a
  finished install; returns ``{"python", "installed_now", "install_s", "versions"}``.
  Raises :class:`DynamoError` with pip's tail when a step fails.
- :func:`dynamo_env(kv_dir, base)` is the children's environment: file discovery in
  ``kv_dir``, TCP request plane, ZMQ event plane, every ``DYN_*_HOST`` (those in ``base``,
  :data:`HOST_VARS` and :data:`EXTRA_HOST_VARS`) = 127.0.0.1, no system port, no
  self-hosted metadata, warn-level logs, no ``PYTHONPATH`` (``.dynvenv``'s packages only).
- :class:`DynamoMesh` (context manager) starts ``dynamo.frontend --router-mode kv`` on a
  free loopback port and ``workers`` × ``dynamo.mocker`` (block size 32, 4096 blocks,
  speedup 10000) on the given model folder, waits until ``/v1/models`` lists the model
  AND one completion of ``max_tokens`` tokens answers (raising :class:`DynamoError` with
  the children's log tails on timeout or when a child exits), and on exit stops every
  child's process group by PID (SIGTERM, then SIGKILL after a grace).
  :meth:`DynamoMesh.advertised` lists the addresses the children advertise to each other.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from bench.offline.dynamo import HOST_VARS, DynamoError
from services.common.procs import Child, free_port, spawn

ROOT = Path(__file__).resolve().parents[2]
DYNVENV = ROOT / ".dynvenv"
VERSION = "1.6.1"
SKIP_DEPS = ("aisimulate", "ai-dynamo-runtime", "ai_dynamo_runtime")
_STAMP = f".kvmesh-dynamo-{VERSION}"
# host variables Dynamo 1.6.1 reads beyond bench.offline.dynamo's (the event plane's ZMQ
# publisher, the TCP response stream, a prefill mocker's bootstrap) - unset, they bind
# 0.0.0.0 or the host's address
_ADDR = re.compile(r"\b(\d{1,3}(?:\.\d{1,3}){3}:\d{1,5})\b")
EXTRA_HOST_VARS = ("DYN_EVENT_PLANE_HOST", "DYN_TCP_RESPONSE_STREAM_HOST",
                   "DYN_HTTP_RPC_HOST")

__all__ = ["DYNVENV", "DynamoError", "DynamoMesh", "dynamo_env", "ensure_dynvenv",
           "filter_requirements"]


def filter_requirements(reqs: list[str]) -> list[str]:
    """ai-dynamo's ``Requires-Dist`` lines → those to install: no extras-only ones (a
    ``extra ==`` marker), none of :data:`SKIP_DEPS`."""
    out = []
    for r in reqs:
        spec, _, marker = r.partition(";")
        if "extra ==" in marker.replace("extra==", "extra =="):
            continue
        name = spec.strip().split("[")[0]
        for ch in "<>=!~ (":
            name = name.split(ch)[0]
        if name.strip().lower().replace("_", "-") in SKIP_DEPS:
            continue
        out.append(r.strip())
    return out


def _pip(py: Path, *args: str, timeout_s: float = 1800.0) -> None:
    p = subprocess.run([str(py), "-m", "pip", "install", "-q",
                        "--disable-pip-version-check", *args],
                       capture_output=True, text=True, timeout=timeout_s, check=False)
    if p.returncode != 0:
        tail = "\n".join((p.stderr or p.stdout).strip().splitlines()[-8:])
        raise DynamoError(f"pip install {' '.join(args)} failed: {tail}")


def _versions(py: Path) -> dict[str, str | None]:
    code = ("import importlib.metadata as m, json\n"
            "out = {}\n"
            "for d in ('ai-dynamo', 'ai-dynamo-runtime', 'pydantic'):\n"
            "    try: out[d] = m.version(d)\n"
            "    except m.PackageNotFoundError: out[d] = None\n"
            "print(json.dumps(out))")
    p = subprocess.run([str(py), "-c", code], capture_output=True, text=True, check=False,
                       timeout=120)
    if p.returncode != 0:
        raise DynamoError(f"cannot read .dynvenv's versions: {p.stderr.strip()[-300:]}")
    return dict(json.loads(p.stdout))


def ensure_dynvenv(path: Path = DYNVENV, base_python: str | None = None) -> dict[str, Any]:
    """See the module docstring."""
    py = path / "bin" / "python"
    stamp = path / _STAMP
    if stamp.exists() and py.exists():
        return {"python": str(py), "installed_now": False, "install_s": None,
                "versions": _versions(py)}
    t0 = time.monotonic()
    if not py.exists():
        base = base_python or shutil.which("python3") or "python3"
        p = subprocess.run([base, "-m", "venv", str(path)], capture_output=True, text=True,
                           check=False)
        if p.returncode != 0:
            raise DynamoError(f"cannot create {path}: {p.stderr.strip()[-300:]}")
    _pip(py, f"ai-dynamo-runtime=={VERSION}")
    _pip(py, f"ai-dynamo=={VERSION}", "--no-deps")
    p = subprocess.run([str(py), "-c", "import importlib.metadata as m, json; "
                        "print(json.dumps(m.requires('ai-dynamo') or []))"],
                       capture_output=True, text=True, check=False, timeout=120)
    if p.returncode != 0:
        raise DynamoError(f"cannot read ai-dynamo's requirements: {p.stderr[-300:]}")
    deps = filter_requirements(json.loads(p.stdout))
    if deps:
        _pip(py, *deps)
    stamp.write_text(json.dumps(deps))
    return {"python": str(py), "installed_now": True, "install_s": time.monotonic() - t0,
            "versions": _versions(py), "deps": deps}


def dynamo_env(kv_dir: Path | str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """See the module docstring."""
    env = dict(os.environ if base is None else base)
    for k in list(env):
        if k.startswith("DYN_") and k.endswith("_HOST"):
            env[k] = "127.0.0.1"
    for k in (*HOST_VARS, *EXTRA_HOST_VARS):
        env[k] = "127.0.0.1"
    env.update({"DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(kv_dir),
                "DYN_REQUEST_PLANE": "tcp", "DYN_EVENT_PLANE": "zmq",
                "DYN_SYSTEM_PORT": "-1", "DYN_SELF_HOST_METADATA": "0",
                "DYN_LOG": env.get("DYN_LOG", "warn")})
    env.pop("PYTHONPATH", None)  # .dynvenv's own packages only
    return env


class DynamoMesh:
    """See the module docstring."""

    def __init__(self, python: str | Path, model_path: str | Path, model_name: str,
                 workers: int = 2, block_size: int = 32, num_blocks: int = 4096,
                 speedup: float = 10000.0, ready_timeout_s: float = 240.0) -> None:
        self.python = str(python)
        self.model_path = str(model_path)
        self.model = model_name
        self.workers = workers
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.speedup = speedup
        self.ready_timeout_s = ready_timeout_s
        self.tmp = Path(tempfile.mkdtemp(prefix="kvmesh-dynamo-"))
        self.logs = self.tmp / "logs"
        self.children: list[Child] = []
        self.url = ""

    def argv(self, port: int) -> dict[str, list[str]]:
        """Each child's command line, by name."""
        out = {"dynamo-frontend": [self.python, "-m", "dynamo.frontend", "--http-host",
                                   "127.0.0.1", "--http-port", str(port),
                                   "--router-mode", "kv"]}
        for i in range(self.workers):
            out[f"dynamo-mocker{i}"] = [
                self.python, "-m", "dynamo.mocker", "--model-path", self.model_path,
                "--model-name", self.model, "--block-size", str(self.block_size),
                "--num-gpu-blocks-override", str(self.num_blocks),
                "--speedup-ratio", f"{self.speedup:g}"]
        return out

    def __enter__(self) -> DynamoMesh:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def _start(self) -> None:
        port = free_port()
        kv = self.tmp / "kv"
        kv.mkdir(parents=True)
        env = dynamo_env(kv)
        for name, argv in self.argv(port).items():
            self.children.append(spawn(name, argv, self.logs, env))
        self.url = f"http://127.0.0.1:{port}"
        self._wait(self._lists_model, "its /v1/models to list the model")
        self._wait(self._answers, "one completion to answer")

    def _lists_model(self) -> bool:
        try:
            r = httpx.get(f"{self.url}/v1/models", timeout=2)
            return r.status_code == 200 and any(
                m.get("id") == self.model for m in r.json().get("data", []))
        except (httpx.HTTPError, ValueError):
            return False

    def _answers(self) -> bool:
        try:
            r = httpx.post(f"{self.url}/v1/completions", timeout=30, json={
                "model": self.model, "prompt": "hello world", "max_tokens": 2,
                "ignore_eos": True})
            return r.status_code == 200
        except httpx.HTTPError:
            return False

    def _wait(self, check: Any, what: str) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            if check():
                return
            dead = [c for c in self.children if not c.alive()]
            if dead:
                raise DynamoError(f"{dead[0].name} exited ({dead[0].proc.returncode}) "
                                  f"before {what}:\n{self.log_tails()}")
            if time.monotonic() > deadline:
                raise DynamoError(f"Dynamo: timed out after {self.ready_timeout_s:g} s "
                                  f"waiting for {what}:\n{self.log_tails()}")
            time.sleep(0.2)

    def log_tails(self, lines: int = 12) -> str:
        """The last lines of every child's log."""
        return "\n".join(f"--- {c.name}\n{c.log_tail(lines)}" for c in self.children)

    def advertised(self) -> list[str]:
        """Every ``host:port`` the children advertise in the file discovery folder (what
        the others connect to; Dynamo 1.6.1 binds its ZMQ publishers on the wildcard
        whatever ``DYN_EVENT_PLANE_HOST`` says, but advertises that host)."""
        found: set[str] = set()
        for f in (self.tmp / "kv").rglob("*"):
            if f.is_file():
                with contextlib.suppress(OSError):
                    found.update(_ADDR.findall(f.read_text(errors="replace")))
        return sorted(found)

    def pids(self) -> dict[str, int]:
        """Each child's PID, by name."""
        return {c.name: c.pid for c in self.children}

    def close(self) -> None:
        """Stops every child's process group (newest first); removes the folder."""
        for child in reversed(self.children):
            child.stop(timeout=10)
        self.children.clear()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
