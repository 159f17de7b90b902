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
- ``write_json(path, data)``: indented, key-sorted JSON with a final newline.
- Generated model folders (tiny-llama, tiny-idefics3) end with a marker file
  :data:`MARKER` holding ``{"seed", "format_version"}``:
  ``marker_matches(path, seed=, format_version=)`` says whether ``path`` holds one with
  those values; ``ensure_generated(path, default_name, build, seed=, format_version=)``
  returns ``path`` (default ``models_dir() / default_name``) complete, building it with
  ``build(tmp, seed)`` and the marker through ``build_atomically`` when it does not match.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

MARKER = ".kvmesh-complete"
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


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Indented, key-sorted JSON with a final newline."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def marker_matches(path: str | Path, *, seed: int, format_version: int) -> bool:
    """Whether ``path`` holds a finished generated folder of ``seed`` and format."""
    try:
        info = json.loads((Path(path) / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return bool(info.get("seed") == seed and info.get("format_version") == format_version)


def ensure_generated(path: str | Path | None, default_name: str,
                     build: Callable[[Path, int], object], *, seed: int,
                     format_version: int) -> Path:
    """A complete generated folder at ``path`` (see the module docstring)."""
    final = Path(path).expanduser() if path is not None else models_dir() / default_name

    def build_marked(tmp: Path) -> None:
        build(tmp, seed)
        write_json(tmp / MARKER, {"seed": seed, "format_version": format_version})

    return build_atomically(final, build_marked, lambda p: marker_matches(
        p, seed=seed, format_version=format_version))
