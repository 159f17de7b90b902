"""Actuators: make the mesh's replica counts match a :class:`ScalingDecision`.

Contract of :class:`Actuator` (a ``typing.Protocol``):

- ``async apply(decision)``: brings every pool towards ``decision.desired`` (absolute
  counts, so applying the same decision twice changes nothing). Errors are logged and
  re-raised; the planner keeps ticking.
- ``async close()``: releases what the actuator holds (the local launcher stops the
  workers it started; the others do nothing).

Implementations:

- :class:`DryRunActuator`: logs each action and remembers the decisions it was given.
- :class:`LocalActuator`: spawns ``python -m workers`` children with
  :func:`services.common.procs.spawn` (role through ``KVMESH_ROLE``) and stops them with
  ``Child.stop`` — only children it started itself, newest first. It owns
  ``desired − external`` workers per pool, where ``external`` counts workers it did not
  start (e.g. those ``kvmesh up`` launched). Dead children are forgotten (and so replaced).
  ``prepare(name, folder)``, when given, runs (in a thread) before each spawn and returns
  extra env for that child. ``folder`` is the child's own identity folder
  ``<log_dir>/identities/<name>`` (the actuator creates ``identities`` with mode 0700 and
  removes a child's folder once it has stopped it or found it dead, or when ``prepare``
  or the spawn fails); in a mesh with certificates ``prepare`` copies the child's identity there and
  returns it as its ``KVMESH_TLS_DIR`` with its certificate and worker id
  (:func:`services.common.etcd_auth.enroll_worker`: the CA key, the admin certificate
  and the other secrets stay in the planner's folder). When it fails, the error is
  logged with the child's name and re-raised, and nothing is spawned.
- :class:`ComposeActuator`: runs ``docker compose [-f FILE] [-p PROJECT] up -d
  --no-recreate --scale SERVICE=N ... SERVICE ...`` through an injectable runner
  (:meth:`ComposeActuator.command` builds the argv).

- :class:`~services.planner.kubernetes.KubernetesActuator` (module
  :mod:`services.planner.kubernetes`, imported only when chosen): patches the scale
  subresource of one Deployment per pool through the official ``kubernetes`` client.

:func:`make_actuator` is the registry (``dry_run``, ``local``, ``compose``, ``kubernetes``).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from services.common.procs import Child, spawn
from services.planner.core import ScalingDecision

log = logging.getLogger(__name__)


class Actuator(Protocol):
    """Applies scaling decisions; see the module docstring."""

    async def apply(self, decision: ScalingDecision) -> None:
        """Moves every pool towards ``decision.desired``."""
        ...

    async def close(self) -> None:
        """Releases resources."""
        ...


class DryRunActuator:
    """Logs actions; changes nothing."""

    def __init__(self) -> None:
        self.applied: list[ScalingDecision] = []

    async def apply(self, decision: ScalingDecision) -> None:
        self.applied.append(decision)
        for a in decision.actions:
            log.info("[dry-run] %s %s by %d (%d → %d, %s): %s", a.kind, a.pool, a.n,
                     a.from_replicas, a.to_replicas, a.source, a.reason)

    async def close(self) -> None:
        return None


SpawnFn = Callable[[str, Sequence[str], Path, Mapping[str, str] | None], Child]


class LocalActuator:
    """Worker processes on this machine; see the module docstring."""

    def __init__(self, log_dir: Path, env: Mapping[str, str],
                 external: Mapping[str, int] | None = None,
                 argv: Sequence[str] = (sys.executable, "-m", "workers"),
                 spawn_fn: SpawnFn = spawn, stop_timeout_s: float = 30.0,
                 name_prefix: str = "planner",
                 prepare: Callable[[str, Path], Mapping[str, str]] | None = None) -> None:
        self._log_dir = log_dir
        self._prepare = prepare
        self._env = dict(env)
        self.external = dict(external or {})
        self._argv = list(argv)
        self._spawn = spawn_fn
        self._stop_timeout = stop_timeout_s
        self._prefix = name_prefix
        self._children: dict[str, list[Child]] = {}
        self._seq = 0

    def children(self, pool: str) -> list[Child]:
        """The live children this actuator started for ``pool``, oldest first."""
        kids = []
        for child in self._children.get(pool, []):
            if child.alive():
                kids.append(child)
            else:
                self._forget(child.name)
        self._children[pool] = kids
        return list(kids)

    def identity_dir(self, name: str) -> Path:
        """Child ``name``'s own identity folder (module docstring)."""
        return self._log_dir / "identities" / name

    def _forget(self, name: str) -> None:
        """Removes child ``name``'s identity folder (its key) once it no longer runs."""
        folder = self.identity_dir(name)
        if folder.exists():
            try:
                shutil.rmtree(folder)
            except OSError as exc:
                log.warning("cannot remove %s's identity folder %s: %s", name, folder, exc)

    def pids(self) -> set[int]:
        """PIDs of every live child this actuator started."""
        return {c.pid for pool in list(self._children) for c in self.children(pool)}

    async def apply(self, decision: ScalingDecision) -> None:
        for pool, desired in decision.desired.items():
            own = self.children(pool)
            want = max(0, desired - self.external.get(pool, 0))
            while len(own) < want:
                self._seq += 1
                name = f"{self._prefix}-{pool}-{self._seq}"
                env = {**self._env, "KVMESH_ROLE": pool}
                if self._prepare is not None:
                    folder = self.identity_dir(name)
                    try:
                        folder.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                        folder.parent.chmod(0o700)
                        env.update(await asyncio.to_thread(self._prepare, name, folder))
                    except Exception as exc:
                        log.error("cannot start %s: %s", name, exc)
                        self._forget(name)
                        raise
                try:
                    child = await asyncio.to_thread(self._spawn, name, self._argv,
                                                    self._log_dir, env)
                except Exception:
                    self._forget(name)
                    raise
                log.info("started %s (pid %d)", name, child.pid)
                own.append(child)
            surplus = own[want:][::-1]  # newest first
            own = own[:want]
            self._children[pool] = own
            for child in surplus:
                log.info("stopping %s (pid %d)", child.name, child.pid)
                await asyncio.to_thread(child.stop, self._stop_timeout)
                self._forget(child.name)

    async def close(self) -> None:
        for pool in list(self._children):
            for child in reversed(self.children(pool)):
                await asyncio.to_thread(child.stop, self._stop_timeout)
                self._forget(child.name)
        self._children.clear()


Runner = Callable[[Sequence[str]], Awaitable[int]]


async def run_command(argv: Sequence[str]) -> int:
    """Runs ``argv``, logs its output, returns the exit code."""
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await proc.communicate()
    if out:
        log.info("%s: %s", argv[0], out.decode(errors="replace").strip()[-2000:])
    return int(proc.returncode or 0)


class ComposeActuator:
    """``docker compose ... up -d --scale``; see the module docstring."""

    def __init__(self, services: Mapping[str, str], compose_file: str = "",
                 project: str = "", docker: str = "docker", runner: Runner = run_command) -> None:
        self.services = dict(services)  # pool → compose service name
        self._file = compose_file
        self._project = project
        self._docker = docker
        self._runner = runner
        self._last: dict[str, int] = {}

    def command(self, desired: Mapping[str, int]) -> list[str]:
        """The argv that scales the pools' services to ``desired``."""
        argv = [self._docker, "compose"]
        if self._file:
            argv += ["-f", self._file]
        if self._project:
            argv += ["-p", self._project]
        argv += ["up", "-d", "--no-recreate"]
        names = []
        for pool, n in sorted(desired.items()):
            svc = self.services.get(pool)
            if svc is None:
                continue
            argv += ["--scale", f"{svc}={n}"]
            names.append(svc)
        return argv + names

    async def apply(self, decision: ScalingDecision) -> None:
        desired = {p: n for p, n in decision.desired.items() if p in self.services}
        if desired == self._last:
            return
        argv = self.command(desired)
        rc = await self._runner(argv)
        if rc != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {rc}")
        self._last = desired

    async def close(self) -> None:
        return None


ACTUATORS = ("dry_run", "local", "compose", "kubernetes")


def make_actuator(name: str, **kwargs: Any) -> Actuator:
    """An actuator by registry name; ``kwargs`` go to its constructor."""
    if name == "dry_run":
        return DryRunActuator()
    if name == "local":
        return LocalActuator(**kwargs)
    if name == "compose":
        return ComposeActuator(**kwargs)
    if name == "kubernetes":
        from services.planner.kubernetes import KubernetesActuator

        return KubernetesActuator(**kwargs)
    raise ValueError(f"unknown actuator {name!r}; known: {', '.join(ACTUATORS)}")
