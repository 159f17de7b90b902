"""vLLM's own ``MooncakeStoreConnector`` against the real Mooncake Store, measured like ours.

``python -m bench.store.mooncake_vllm --mooncake-python PY --model PATH [--prefixes
1024,2048,4096] [--reps 3] [--kv-gib 1.0] [--segment-mib 2048]``; run by
:func:`bench.store.run.mooncake_connector_ttft` inside a loopback-only network namespace
(``unshare -rn``), because Mooncake 0.3.13 binds wildcard listeners.

Contract:

- Mooncake comes from the environment of ``PY`` (``mooncake-transfer-engine-non-cuda``,
  not a kvmesh requirement). Only its ``mooncake`` package (and the bundled shared
  libraries next to it) is exposed to vLLM, through a temporary folder of symlinks
  appended to ``sys.path`` (which ``spawn`` hands to the EngineCore child): the rest of
  that environment (its numpy, aiohttp, ...) never shadows kvmesh's.
- Starts ``mooncake_master`` (HTTP metadata server, everything on 127.0.0.1) and one vLLM
  engine with ``kv_connector=MooncakeStoreConnector``, ``kv_role=kv_both`` (the engine's
  store client contributes a ``--segment-mib`` segment: Mooncake's "embedded" mode), TCP
  transport, ``MC_LEGACY_RPC_PORT_BINDING=1`` and
  ``MOONCAKE_REQUESTER_LOCAL_HOSTNAME=127.0.0.1:<port>`` (without both, Mooncake either
  advertises a LAN address or collides with its own handshake port).
- Measures with :class:`bench.store.reuse.ReuseProbe` (same prompts' shape, same
  miss/hit protocol as kvmesh's connector) and prints one JSON line:
  ``{"mooncake_miss": {L: s}, "mooncake_hit": ..., "mooncake_hit_tokens": ...,
  "mooncake_same_first": bool}`` (or ``{"error": ...}``). Exits with ``os._exit``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.process import run_and_exit
from bench.store.mooncake_peer import free_port, start_master, stop


def mooncake_site(python: str) -> Path:
    """The site-packages folder holding ``python``'s ``mooncake`` package."""
    code = "import mooncake, os; print(os.path.dirname(os.path.dirname(mooncake.__file__)))"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60,
                         check=True)
    return Path(out.stdout.strip())


def expose_mooncake(site: Path, into: Path) -> None:
    """Symlinks ``mooncake`` and its bundled ``*.libs`` folders from ``site`` into ``into``."""
    for entry in site.iterdir():
        if entry.name == "mooncake" or (entry.name.startswith("mooncake")
                                        and entry.name.endswith(".libs")):
            (into / entry.name).symlink_to(entry, target_is_directory=True)


async def measure(args: argparse.Namespace, master: str, meta: str, tmp: Path
                  ) -> dict[str, Any]:
    from bench.store.reuse import ReuseProbe, vocab_of
    from workers.engines.vllm_engine import VllmEngine, VllmEngineConfig

    config = {"metadata_server": meta, "master_server_address": master, "protocol": "tcp",
              "device_name": "", "global_segment_size": f"{args.segment_mib}MB",
              "local_buffer_size": "512MB"}
    (tmp / "mooncake.json").write_text(json.dumps(config))
    prefixes = [int(x) for x in args.prefixes.split(",")]
    env = {"MOONCAKE_CONFIG_PATH": str(tmp / "mooncake.json"),
           "MC_LEGACY_RPC_PORT_BINDING": "1",
           "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": f"127.0.0.1:{free_port()}",
           "VLLM_HOST_IP": "127.0.0.1"}
    sys.path.append(str(tmp / "site"))  # spawn hands this sys.path to the EngineCore child
    eng = VllmEngine(VllmEngineConfig(
        model_path=args.model, max_model_len=max(prefixes) + 64, block_size=32,
        kv_cache_space_gib=args.kv_gib, seed=0, env=env,
        kv_transfer_config={"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
                            "kv_connector_extra_config": {"load_async": True}}))
    await eng.start()
    probe = ReuseProbe(random.Random(1), vocab_of(args.model))
    result: dict[str, Any] = {}
    try:
        await probe.first_token(eng, probe.tokens(64))  # warm-up
        await probe.miss_then_hit(eng, "mooncake", prefixes, args.reps, result)
    finally:
        await eng.shutdown()
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    site = mooncake_site(args.mooncake_python)
    binary = site / "mooncake" / "mooncake_master"
    with tempfile.TemporaryDirectory(prefix="bench-mc-vllm-") as name:
        tmp = Path(name)
        (tmp / "site").mkdir()
        expose_mooncake(site, tmp / "site")
        try:
            master, master_addr, meta = start_master(binary)
        except RuntimeError as exc:
            return {"error": str(exc)}
        try:
            out = asyncio.run(measure(args, master_addr, meta, tmp))
        finally:
            stop(master)
    return out


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.store.mooncake_vllm")
    p.add_argument("--mooncake-python", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--prefixes", default="1024,2048,4096")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--kv-gib", type=float, default=1.0)
    p.add_argument("--segment-mib", type=int, default=2048)
    args = p.parse_args()
    print(json.dumps(run(args)), flush=True)
    return 0


if __name__ == "__main__":
    run_and_exit(main)
