"""The minimal runtime patches that let SGLang 0.5.23 serve (agg and P/D over NIXL) on a
CPU-only machine. Each patch is one named function; its docstring says what SGLang does
and why that fails on CPU.

Contract:

- :func:`install_all` applies every patch once, in the current process. It must run
  before SGLang is imported: :mod:`workers.engines.sglang.launch` calls it at import
  time, so SGLang's ``spawn`` children (which re-import the launch module as
  ``__mp_main__``) get the same patches.
- Patches to SGLang modules are applied lazily, right after the module is first imported
  (:func:`after_import`), so a process that never loads, say, the NIXL connector never
  pays for importing it.
- Nothing here imports from kvmesh; stdlib, torch and (lazily) SGLang only.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

_SGLANG_DIR_MARK = f"{os.sep}sglang{os.sep}"
_hooks: dict[str, list[Callable[[types.ModuleType], None]]] = {}
_installed = False


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of a hooked module to run its hooks."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _hooks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is None:
                continue
            loader = spec.loader
            if loader is None or not hasattr(loader, "exec_module"):
                return spec
            original_exec = loader.exec_module

            def exec_module(module: types.ModuleType, _exec: Any = original_exec) -> None:
                _exec(module)
                for hook in _hooks.get(fullname, ()):
                    hook(module)

            loader.exec_module = exec_module  # type: ignore[method-assign]
            return spec
        return None


_post_import_finder = _PostImportFinder()


def after_import(module_name: str, hook: Callable[[types.ModuleType], None]) -> None:
    """Run ``hook(module)`` right after ``module_name`` is imported (now, if it already is)."""
    if module_name in sys.modules:
        hook(sys.modules[module_name])
        return
    _hooks.setdefault(module_name, []).append(hook)
    if _post_import_finder not in sys.meta_path:
        sys.meta_path.insert(0, _post_import_finder)


class _AbsentModule(types.ModuleType):
    """Stands in for a package that is not installed: any attribute is another placeholder
    (so module-level ``from x import A`` and ``A.B`` work); calling one raises."""

    def __getattr__(self, name: str) -> _AbsentModule:
        if name.startswith("__"):
            raise AttributeError(name)
        child = _AbsentModule(f"{self.__name__}.{name}")
        setattr(self, name, child)
        return child

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"{self.__name__} is unavailable: torchvision is not installed in kvmesh's SGLang "
            "CPU runtime (no CPU build of it matches torch 2.13.0+cpu), so image and video "
            "preprocessing is not supported"
        )


class _TorchvisionPlaceholderFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``torchvision`` placeholders to imports written in SGLang's own files only."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] != "torchvision" or not _imported_from_sglang():
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _AbsentModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def _imported_from_sglang() -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not (filename.startswith("<frozen") or f"{os.sep}importlib{os.sep}" in filename
                or filename == __file__):
            return _SGLANG_DIR_MARK in filename
        frame = frame.f_back  # type: ignore[assignment]
    return False


def patch_torchvision_placeholder() -> None:
    """SGLang imports ``torchvision`` at module level in config modules that every process
    loads (``sglang.srt.configs`` -> ``nano_nemotron_vl`` -> ``multimodal.internvl_utils``;
    ``configs.deepseek_ocr``), even for text-only models. PyPI's torchvision wheels are
    CUDA builds whose ops fail to load on torch 2.13.0+cpu, and no CPU build is reachable
    here, so those imports raise ModuleNotFoundError. The fix serves a placeholder package
    to imports made from SGLang's own files (calling anything in it raises); other
    importers (transformers' availability probe) still see torchvision as absent.
    """
    if not any(isinstance(f, _TorchvisionPlaceholderFinder) for f in sys.meta_path):
        sys.meta_path.append(_TorchvisionPlaceholderFinder())


def patch_nixl_kv_as_dram() -> None:
    """SGLang's NIXL connector (``sglang.srt.disaggregation.nixl.conn``) describes the KV
    cache as ``"VRAM"`` memory with the GPU id as device: ``_normalize_kv_mem_kinds`` and
    ``_unpack_kv_mem_kinds`` default every KV buffer to VRAM, and decode announces VRAM to
    prefill. On CPU the KV pool is host memory, so NIXL's UCX backend cannot register or
    transfer it as VRAM. The fix maps every KV memory kind to ``"DRAM"`` (device id 0), on
    both sides, so registration, the kinds D sends to P, and the transfer descriptors agree.
    """

    def hook(conn: types.ModuleType) -> None:
        normalize = getattr(conn, "_normalize_kv_mem_kinds")  # noqa: B009
        if getattr(normalize, "__kvmesh_patched__", False):
            return

        def normalize_as_dram(kinds: list[str] | None, expected_len: int) -> list[str]:
            return ["DRAM" for _ in normalize(kinds, expected_len)]

        def unpack_as_dram(buf: bytes, expected_len: int) -> list[str]:
            return normalize_as_dram(
                buf.decode("ascii").split(",") if buf else None, expected_len
            )

        normalize_as_dram.__kvmesh_patched__ = True  # type: ignore[attr-defined]
        setattr(conn, "_normalize_kv_mem_kinds", normalize_as_dram)  # noqa: B010
        setattr(conn, "_unpack_kv_mem_kinds", unpack_as_dram)  # noqa: B010

    after_import("sglang.srt.disaggregation.nixl.conn", hook)


# The NIXL progress thread's poll delay in microseconds (NIXL's Python API fixes it at 0).
NIXL_PROGRESS_DELAY_US = int(os.environ.get("KVMESH_SGLANG_NIXL_DELAY_US", "1000"))


def patch_nixl_progress_delay() -> None:
    """SGLang's NIXL connector needs NIXL's progress thread (with it off, P/D hangs: its
    transfer and notification paths do not drive UCX themselves), and NIXL's Python API
    builds every agent with ``pthrDelay = 0`` (``nixl_cu12/_api.py``), so the thread spins
    on a zero-timeout poll: each idle P or D then keeps most of a core busy, which on a
    2-core CPU host slows everything else down. The fix makes the agent config's
    ``pthrDelay`` at least :data:`NIXL_PROGRESS_DELAY_US` (the thread's poll timeout: a
    transfer is still progressed when UCX signals it; ``KVMESH_SGLANG_NIXL_DELAY_US=0``
    restores NIXL's own setting)."""
    if NIXL_PROGRESS_DELAY_US <= 0:
        return

    def hook(bindings: types.ModuleType) -> None:
        base = bindings.nixlAgentConfig
        if getattr(base, "__kvmesh_patched__", False):
            return
        delay = base.pthrDelay  # the pybind11 property

        class AgentConfig(base):  # type: ignore[misc, valid-type]
            __kvmesh_patched__ = True

            @property
            def pthrDelay(self) -> int:  # noqa: N802 (NIXL's name)
                return int(delay.__get__(self))

            @pthrDelay.setter
            def pthrDelay(self, value: int) -> None:  # noqa: N802
                delay.__set__(self, max(int(value), NIXL_PROGRESS_DELAY_US))

        setattr(bindings, "nixlAgentConfig", AgentConfig)  # noqa: B010

    after_import("nixl_cu12._bindings", hook)


def install_all() -> None:
    """Apply every patch of this module once (see the module docstring)."""
    global _installed
    if _installed:
        return
    _installed = True
    patch_torchvision_placeholder()
    patch_nixl_kv_as_dram()
    patch_nixl_progress_delay()
