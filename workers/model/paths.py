"""Filesystem locations and atomic folder publishing shared by the model tooling.

Contract:

- ``cache_dir() -> Path``: the kvmesh cache root. It is ``$KVMESH_CACHE_DIR`` when that
  variable is set and non-empty, otherwise ``~/.cache/kvmesh``. ``~`` is expanded; the
  directory is *not* created (callers create what they write into).
- ``models_dir() -> Path``: ``cache_dir() / "models"``, where converted and generated model
  folders live.
- ``build_atomically(final, build, is_complete) -> Path``: if ``is_complete(final)`` return
  ``final`` at once. Otherwise call ``build(tmp)`` on a fresh temporary sibling folder of
  ``final`` (``build`` must leave ``is_complete(tmp)`` true, typically by writing a marker
  file last), then rename ``tmp`` to ``final``. An existing incomplete ``final`` is moved
  aside and deleted first. If another process publishes ``final`` concurrently, its copy
  wins and ours is discarded. The temporary folder never survives, even on error.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

ENV_CACHE_DIR = "KVMESH_CACHE_DIR"
DEFAULT_CACHE_DIR = "~/.cache/kvmesh"


def cache_dir() -> Path:
    """Return the kvmesh cache root (``$KVMESH_CACHE_DIR`` or ``~/.cache/kvmesh``)."""
    raw = os.environ.get(ENV_CACHE_DIR) or DEFAULT_CACHE_DIR
    return Path(raw).expanduser()


def models_dir() -> Path:
    """Return the folder holding model folders: ``cache_dir() / "models"``."""
    return cache_dir() / "models"


def _make_readable(folder: Path) -> None:
    """mkdtemp makes 0700 folders (and some writers 0600 files): use ordinary modes."""
    folder.chmod(0o755)
    for entry in folder.rglob("*"):
        entry.chmod(0o755 if entry.is_dir() else 0o644)


def build_atomically(
    final: Path,
    build: Callable[[Path], None],
    is_complete: Callable[[Path], bool],
) -> Path:
    """Publish the folder ``build`` writes at ``final`` by an atomic rename (see module doc)."""
    if is_complete(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        build(tmp)
        if not is_complete(tmp):
            raise RuntimeError(f"build did not complete the folder {tmp}")
        _make_readable(tmp)
        if final.exists():
            if is_complete(final):  # another process won the race
                return final
            trash = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
            os.replace(final, trash / final.name)
            shutil.rmtree(trash, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if not is_complete(final):
                raise
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
