"""Shared DRAM regions and the NIXL endpoint of the kvmesh EC connector.

- :class:`Region`: a file in ``region_dir`` (``/dev/shm``) mapped ``MAP_SHARED``, so
  vLLM's scheduler half (which owns the NIXL agent and the slots) and its worker half
  (which holds the encoder cache) see the same bytes, whether the worker runs in the
  EngineCore process (uniproc executor) or in its own. ``Region.create`` makes (or
  truncates) the file, ``Region.open`` maps an existing one; ``tensor`` is a uint8 view,
  ``addr`` its address; ``read(off, n)`` / ``write(off, data)`` copy bytes;
  ``close(unlink)`` unmaps it (and removes the file). Region files are named
  :func:`region_path` ``(dir, engine_id, side, pid)``: one per engine launch and side,
  with the owner's pid; ``Region.create`` first removes the region files in ``dir`` whose
  owner process is gone (EngineCore killed before its shutdown removed them).
  :func:`find_region` finds an engine's region file (its owner's pid unknown), and
  :func:`peek` reads bytes of one (e.g. a slot header, the stats block) from another
  process on the host, without mapping it.
- :class:`Endpoint`: one NIXL agent (UCX, progress thread off:
  :func:`workers.kv.store_client.make_agent`) with a region registered as DRAM;
  ``metadata`` is what peers need to reach it. Every call takes one lock.
  ``notifications()`` drives UCX progress and returns new notification messages (a
  target, E, must call it regularly so consumers can connect and READ);
  ``start_read(local_addr, remote_addr, nbytes, agent, agent_metadata, notif)`` starts a
  one-sided READ (the peer gets ``notif`` when it completes), returns a handle;
  ``poll(handle)`` → "PROC" | "DONE" | "ERR" (and releases the handle once it ended);
  ``notify(agent, agent_metadata, msg)`` sends a notification (best effort);
  ``close()`` releases everything (NIXL may still crash at interpreter exit: processes
  end with ``os._exit``).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


_PREFIX = "kvmesh-ec-"


def region_path(region_dir: str, engine_id: str, side: str, pid: int | None = None) -> str:
    """The region file of one engine launch's ``side`` ("producer" or "consumer")."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in engine_id)
    return str(Path(region_dir) / f"{_PREFIX}{safe}-{side}-{os.getpid() if pid is None else pid}")


def find_region(region_dir: str, engine_id: str, side: str) -> str | None:
    """The newest region file of ``engine_id``'s ``side`` in ``region_dir``, if any."""
    stem = Path(region_path(region_dir, engine_id, side, 0)).name[:-1]  # "...-<side>-"
    found = [p for p in Path(region_dir).glob(f"{stem}*") if p.name[len(stem):].isdigit()]
    return str(max(found, key=lambda p: p.stat().st_mtime)) if found else None


def peek(path: str, offset: int, nbytes: int) -> bytes:
    """``nbytes`` of the region file ``path`` at ``offset`` (OSError if it is gone)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, nbytes, offset)
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(region_dir: str) -> list[str]:
    """Remove region files whose owner process is gone; return their paths."""
    removed = []
    for path in Path(region_dir).glob(f"{_PREFIX}*"):
        tail = path.name.rsplit("-", 1)[-1]
        if tail.isdigit() and not _alive(int(tail)):
            try:
                path.unlink()
                removed.append(str(path))
            except FileNotFoundError:
                continue  # another process swept it first: the goal is reached
            except OSError as exc:
                log.warning("EC region %s of a dead process not removed: %s", path, exc)
    return removed


class Region:
    """A shared, file-backed DRAM region (see the module docstring)."""

    def __init__(self, path: str, nbytes: int, *, create: bool) -> None:
        import torch

        flags = os.O_RDWR | (os.O_CREAT | os.O_TRUNC if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, nbytes)
            elif os.fstat(fd).st_size < nbytes:
                raise ValueError(f"EC region {path} is smaller than {nbytes} B")
            self._map = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.path, self.nbytes = path, nbytes
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self.addr = int(self.tensor.data_ptr())

    @classmethod
    def create(cls, path: str, nbytes: int) -> Region:
        removed = sweep_stale(str(Path(path).parent))
        if removed:
            log.info("kvmesh EC: removed %d stale region files", len(removed))
        return cls(path, nbytes, create=True)

    @classmethod
    def open(cls, path: str, nbytes: int) -> Region:
        return cls(path, nbytes, create=False)

    def read(self, offset: int, nbytes: int) -> bytes:
        return bytes(self._map[offset:offset + nbytes])

    def write(self, offset: int, data: bytes) -> None:
        self._map[offset:offset + len(data)] = data

    def close(self, unlink: bool = False) -> None:
        self.tensor = None  # type: ignore[assignment]
        try:
            self._map.close()
        except BufferError:  # a view still exported: the mapping lives until it is gone
            log.debug("EC region %s still has views", self.path)
        if unlink:
            with contextlib.suppress(FileNotFoundError):  # already gone: the goal is reached
                os.unlink(self.path)


class Endpoint:
    """One NIXL agent with ``region`` registered (see the module docstring)."""

    def __init__(self, name: str, region: Region) -> None:
        from workers.kv.store_client import make_agent

        self.name = name
        self._lock = threading.Lock()
        self._agent: Any = make_agent(name)
        self._reg = self._agent.register_memory([(region.addr, region.nbytes, 0, "")], "DRAM")
        self.metadata: bytes = self._agent.get_agent_metadata()
        self._remotes: dict[str, str] = {}  # agent name -> name NIXL returned

    def _remote(self, agent: str, agent_metadata: bytes) -> str:
        name = self._remotes.get(agent)
        if name is None:
            raw = self._agent.add_remote_agent(agent_metadata)
            name = raw.decode() if isinstance(raw, bytes) else str(raw)
            self._remotes[agent] = name
        return name

    def notifications(self) -> list[bytes]:
        with self._lock:
            notifs = self._agent.get_new_notifs()
        return [m for msgs in notifs.values() for m in msgs]

    def start_read(self, local_addr: int, remote_addr: int, nbytes: int, agent: str,
                   agent_metadata: bytes, notif: bytes) -> Any:
        with self._lock:
            remote = self._remote(agent, agent_metadata)
            local = self._agent.get_xfer_descs([(local_addr, nbytes, 0)], "DRAM")
            far = self._agent.get_xfer_descs([(remote_addr, nbytes, 0)], "DRAM")
            handle = self._agent.initialize_xfer("READ", local, far, remote, notif)
            state = self._agent.transfer(handle)
            if state == "ERR":
                self._agent.release_xfer_handle(handle)
                raise RuntimeError(f"NIXL READ from {agent} failed to start")
        return handle

    def poll(self, handle: Any) -> str:
        with self._lock:
            state = str(self._agent.check_xfer_state(handle))
            if state != "PROC":
                self._agent.release_xfer_handle(handle)
        return state

    def forget(self, agent: str) -> None:
        """Drop a peer (e.g. after a failed READ: a restarted E has a new agent anyway)."""
        with self._lock:
            name = self._remotes.pop(agent, None)
            if name is not None:
                try:
                    self._agent.remove_remote_agent(name)
                except Exception as exc:  # best effort: the peer may be gone
                    log.debug("remove_remote_agent %s: %s", name, exc)

    def notify(self, agent: str, agent_metadata: bytes, msg: bytes) -> bool:
        try:
            with self._lock:
                self._agent.send_notif(self._remote(agent, agent_metadata), msg)
            return True
        except Exception as exc:  # best effort: E's lease frees the slot anyway
            log.warning("kvmesh EC: notification to %s failed: %s", agent, exc)
            return False

    def close(self) -> None:
        with self._lock:
            for name in self._remotes.values():
                try:
                    self._agent.remove_remote_agent(name)
                except Exception as exc:
                    log.debug("remove_remote_agent %s: %s", name, exc)
            self._remotes.clear()
            try:
                self._agent.deregister_memory(self._reg)
            except Exception as exc:
                log.debug("deregister_memory: %s", exc)
