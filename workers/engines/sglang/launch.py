"""Run SGLang 0.5.23's own HTTP server on a CPU-only machine. Runs INSIDE ``.sglvenv``
(``make sglang``); started by the argv of :func:`workers.engines.sglang.server.server_command`.

Usage: ``python -m workers.engines.sglang.launch <sglang server args>`` (cwd = repo root).

Contract:

- At import time (so also in SGLang's ``spawn`` children, which re-import this module as
  ``__mp_main__``): sets ``SGLANG_USE_CPU_ENGINE=1`` unless set, installs the CPU
  ``sgl_kernel`` shim (:mod:`workers.engines.sglang.sgl_kernel_shim`) and the runtime
  patches (:mod:`workers.engines.sglang.cpu_patches`). It refuses to run when a real
  ``sgl_kernel`` is importable (that one would be the CUDA build).
- :func:`main` parses the args with SGLang's ``prepare_server_args`` and calls SGLang's
  ``run_server`` (what ``python -m sglang.launch_server`` does), returning its exit code.
- Imports nothing from kvmesh beyond this folder's shim and patch modules.
"""

from __future__ import annotations

import os
import sys

from workers.engines.sglang import cpu_patches, sgl_kernel_shim

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
sgl_kernel_shim.install()
cpu_patches.install_all()


def main(argv: list[str]) -> int:
    """Run SGLang's HTTP server with ``argv`` (SGLang's own server flags)."""
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    server_args = prepare_server_args(argv)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
