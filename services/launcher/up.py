"""``kvmesh up``: start a whole local mesh as child processes, keep it running (restart what
dies), stop it with Ctrl-C.

Contract: :class:`LocalMesh` starts etcd and redis-server on free loopback ports, then the
indexer (with ``indexer="remote"``), the router (with the spec's admission control), the
worker(s) (publishing KV events to
Redis) and the frontend (each ``python -m ...`` in its own process group,
configured through ``KVMESH_*`` env vars), and waits until the frontend's ``/health``
answers 200 (a worker registered; with ``epd`` also the encoders, see below). With
``planner=True`` it then starts
``python -m services.planner`` with the dry-run actuator (it publishes desired counts,
scrapes the frontend's ``/metrics``, changes nothing). ``stop()`` stops everything it
started, in reverse start order, by PID. Logs go to ``log_dir/<name>.log``. A child that
dies while ``start()`` waits fails the start (and stops the rest).

Frontend replicas (``frontends`` > 1, ``kvmesh up --frontends N``): children
``frontend``, ``frontend-1`` ... share the HTTP port (``KVMESH_REUSE_PORT=1``,
``SO_REUSEPORT``: the kernel spreads connections over them), each with the frontend's
identity; the start waits until all N are in etcd. With ``--router embedded`` each
routes with ``--replica-sync`` (:mod:`services.router.replica_sync`); with a router
process they share it. The planner then scrapes each replica on its own port (from
discovery) rather than the shared one.

EPD (``epd=True``, ``kvmesh up --epd``): ``encoders`` encoder children ``encoder-<i>``
(``python -m services.encoder``, vLLM as an ``ec_producer``, identity ``encoder``) start
after the router, and the LM workers read image embeddings from them: mode ``disagg``
(default) is **E/P/D** (the prefill workers are ``--ec-role ec_consumer``; a decode worker
gets the images with the request, for vLLM's prompt processing, and P's KV over NIXL as
usual, never an embedding), mode ``agg`` is **E/PD** (each aggregated worker an
``ec_consumer``). The model defaults to ``tiny-vlm`` (the locally built tiny Idefics3,
:mod:`workers.model.tiny_vlm`); a text-only model is refused by :meth:`MeshSpec.problems`
(``smollm2``, ``tiny``, or a folder whose ``config.json`` has no ``vision_config``), as
are ``--engine mock`` and ``--encoders`` without ``--epd``. The frontend, the workers and
the encoders get the same image limit (``KVMESH_MAX_IMAGES``). The start also waits until
``encoders`` encoder records are in etcd (the router watches them; a request before that
would be encoded by the worker itself). Text-only requests never touch E. Without
``--epd`` a multimodal model is served by workers that encode their images themselves.

AFD (``afd=True``, ``kvmesh up --afd``): instead of the vLLM workers, one FFN worker
``afd-ffn-0`` and ``afd_attention`` attention workers ``afd-attention-<i>`` of the
built-in ``afd`` engine (:mod:`workers.engines.afd`) on a text model (``tiny`` or
``smollm2``), over ``afd_transport`` (``shm``; or ``nixl``: UCX on loopback, the FFN's
endpoint info in its etcd record, :mod:`workers.engines.afd.worker`); the start waits
until every attention worker is paired and registered. A killed FFN worker is restarted
like any child; its attention workers leave etcd meanwhile and come back once paired
again.

Supervision: once started, :meth:`LocalMesh.supervise` (called by ``kvmesh up`` every
0.2 s) restarts any child that exited without being asked to, whatever its exit code or
signal (a worker whose engine died exits non-zero on purpose, to be restarted), with the
backoff of :mod:`services.launcher.supervisor` (0.5 s doubling to 30 s, reset after 60 s
up; more than 5 exits in 120 s is a crash loop, retried every 30 s, never given up). Each
exit is one log line (name, pid, exit code or signal, the delay, the child's log), each
restart another; the restarted child keeps its name, command line and environment (etcd
and Redis their ports and data, the frontend its HTTP port; a worker registers anew, with
a new gRPC port, and a new id only when insecure), appends to its log, and rewrites its
``<name>.pid``. The exited child's process group is SIGKILLed as soon as the exit is
noticed, while the child is still an unreaped zombie (exits are detected with
``waitid(WNOWAIT)``): a SIGKILLed worker or encoder would otherwise leave its vLLM
EngineCore running, holding memory and its NIXL region, and the zombie keeps the group id
from being reused, so no other process's group is ever signalled; a reaped child's group
never is. ``stop()`` does the same after SIGTERM (SIGKILL after 10 s).
``log_dir/status.tsv`` is rewritten on every change: a header, then one tab-separated line
per child ``name pid state restarts last_exit address`` (state: running, restarting,
crashloop, stopped; ``-`` where empty); it is for people and tests to read, no service
reads it. Children are spawned from the main thread with
``PR_SET_PDEATHSIG`` (:func:`services.common.procs.spawn`), so even a SIGKILL of ``kvmesh
up`` takes them down (each gets SIGTERM).

gRPC inside the mesh is mTLS by default: ``start()`` writes a fresh CA and one
certificate per role (admin included, for operators' tools) into ``<state>/certs``
(:attr:`tls_dir`, the only folder holding the CA key) and gives every child a folder of
its own, ``<state>/identities/<child>`` (``KVMESH_TLS_DIR``, ``KVMESH_TLS_CERT``),
holding only the CA certificate, its own certificate and key and the secrets its role
reads (:func:`services.common.tls.export_identity`): a compromised child holds no other
role's key; ``insecure=True`` gives them ``KVMESH_INSECURE=1`` instead. The certificates
go with the state folder. With certificates etcd is TLS too (``https://`` endpoint,
client certificates required) with auth on: ``start()`` provisions etcd's users and
roles as the admin certificate (:func:`services.common.etcd_auth.provision`) before any
service starts. Each worker child gets its own instance certificate ``worker:<child
name>`` (``KVMESH_TLS_CERT=worker-<name>``) and the worker id ``<name>``
(``KVMESH_WORKER_ID``), and may write only its own etcd key; a restart keeps both.
``insecure=True`` keeps a plaintext etcd without auth, and workers with a random id per
launch. With certificates Redis speaks only TLS and has an ACL user per role
(:func:`services.common.procs.redis_argv`); children get a ``rediss://`` URL, and
workers sign their KV events with their ``worker-<name>.evkey``.

Redis runs with AOF (``appendonly yes``, ``appendfsync everysec``) in the mesh's state
folder, so what is in it (the KV event stream; store metadata, when a store master is
pointed at it: ``kvmesh up`` starts none) survives a Redis restart by the supervisor. A
Redis crash loses at most the last ~1 s of writes: the newest KV events (the indexer
resyncs from the workers) and store metadata updates (the store master rewrites its
metadata when it sees Redis restart). The state folder (etcd data, AOF) is
deleted by ``stop()``: nothing carries over to the next ``kvmesh up``.

:class:`MeshSpec`'s fields are the ``kvmesh up`` flags (those not marked ``flag: False``;
:func:`services.common.config.add_fields` builds them, with ``help`` and ``choices`` from
the field metadata). :meth:`MeshSpec.problems` checks their values at once, each problem
naming the flag and its ``KVMESH_*`` variable; ``LocalMesh`` does not re-check them.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shlex
import shutil
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from services.common.config import env_name, flag_name
from services.common.procs import (
    Child,
    etcd_argv,
    free_port,
    redis_argv,
    spawn,
    start_etcd,
    start_redis,
    wait_until,
)
from services.launcher.supervisor import RestartPolicy, Supervisor, describe_exit
from services.router.admission.core import POLICIES as ADMISSIONS
from services.router.indexer_modes import INDEXER_MODES as INDEXERS

CHILD_ENV = {
    "VLLM_HOST_IP": "127.0.0.1",
    "UCX_NET_DEVICES": "lo",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "PYTHONUNBUFFERED": "1",
}

MODES = ("disagg", "agg")
HANDOFFS = ("pull", "push")
ENGINES = ("vllm", "mock", "sglang")
STATUS_FILE = "status.tsv"


def _flag(name: str) -> str:
    return f"{flag_name(name)} ({env_name(name)})"


def _opt(default: Any, text: str, choices: tuple[str, ...] | None = None) -> Any:
    """A ``kvmesh up`` flag's field with help ``text`` (see
    :func:`services.common.config.add_fields`)."""
    meta: dict[str, Any] = {"help": text}
    if choices is not None:
        meta["choices"] = choices
    return field(default=default, metadata=meta)


def _fixed(default: Any) -> Any:
    """A field that is no ``kvmesh up`` flag (nor variable)."""
    return field(default=default, metadata={"flag": False})


@dataclass
class MeshSpec:
    """What to launch; the fields with a flag are ``kvmesh up``'s flags."""

    model: str = _opt("auto", "smollm2 | tiny | tiny-vlm | model folder | auto (smollm2; "
                      "tiny-vlm with --epd)")
    http_port: int = _opt(8000, "the frontend's HTTP port")
    mode: str = _opt("disagg", "disagg: 1 prefill + 1 decode worker (default); "
                     "agg: 1 aggregated", MODES)
    handoff: str = _opt("pull", "P→D KV handoff: pull (D READs, default) or push "
                        "(P WRITEs)", HANDOFFS)
    workers: int = _opt(1, "workers per role")
    engine: str = _opt("vllm", "worker engine: vllm, mock (simulated: no weights, the "
                       "model folder only gives the tokenizer) or sglang (a real SGLang "
                       "server per worker from .sglvenv: make sglang; P/D through its "
                       "bootstrap handshake)", ENGINES)
    policy: str = _opt("kv", "worker policy or profile (kv, approx, least_loaded, "
                       "round_robin, ...)")
    indexer: str = _opt("remote", "KV overlap source of the router: indexer service, "
                        "embedded, or the router's own request history", INDEXERS)
    router: str = _opt("standalone", "standalone: a router process; embedded: the router "
                       "runs inside the frontend (no router process)",
                       ("standalone", "embedded"))
    admission: str = _opt("none", "router admission control: none, early (Mooncake early "
                          "rejection) or current_load; rejected requests get 503 + "
                          "Retry-After", ADMISSIONS)
    admission_ttft_slo_ms: float = _opt(2000.0, "admission control's TTFT target in ms")
    admission_itl_slo_ms: float = _opt(50.0, "admission control's ITL target in ms")
    frontends: int = _opt(1, "frontend replicas sharing the HTTP port (SO_REUSEPORT); with "
                          "--router embedded each routes, in sync with the others over "
                          "Redis (--replica-sync)")
    planner: bool = _opt(False, "also run the planner (dry-run actuator: publishes desired "
                         "counts)")
    epd: bool = _opt(False, "EPD: also run encoder(s) on the multimodal model, the LM "
                     "workers reading image embeddings from them (disagg: E/P/D, agg: E/PD)")
    encoders: int = _opt(1, "encoders (E) with --epd")
    afd: bool = _opt(False, "AFD: one FFN worker and --afd-attention attention workers "
                     "(the built-in afd engine; attention and FFN exchange activations "
                     "per layer)")
    afd_transport: str = _opt("shm", "AFD activation transport", ("shm", "nixl"))
    afd_attention: int = _opt(1, "AFD attention workers sharing the FFN (2: 2A1F)")
    insecure: bool = _opt(False, "plaintext gRPC inside the mesh, no authorization (default: "
                          "mTLS with certificates generated into the state folder)")
    namespace: str = _fixed("kvmesh")
    kv_cache_gib: float = _opt(1.0, "KV cache per worker in GiB")
    max_model_len: int = _opt(2048, "longest sequence (tokens) a worker takes")
    block_size: int = _fixed(32)
    max_images: int = _fixed(4)  # images per request: frontend, workers and encoders
    lease_ttl: int = _fixed(5)
    log_dir: Path = field(default_factory=lambda: Path(".kvmesh/logs"),
                          metadata={"help": "folder of the processes' logs"})
    start_timeout_s: float = _fixed(600.0)

    def problems(self) -> list[str]:
        """What is wrong with the ``kvmesh up`` flags' values (empty when valid)."""
        out = []
        for f in fields(self):
            allowed = f.metadata.get("choices")
            if allowed is not None and getattr(self, f.name) not in allowed:
                out.append(f"{_flag(f.name)} must be one of {', '.join(allowed)}, "
                           f"got {getattr(self, f.name)!r}")
        for name in ("model", "policy"):
            if not getattr(self, name):
                out.append(f"{_flag(name)} must not be empty")
        if not 0 <= self.http_port <= 65535:
            out.append(f"{_flag('http_port')} out of range: {self.http_port}")
        for name in ("workers", "max_model_len", "encoders", "frontends"):
            if getattr(self, name) < 1:
                out.append(f"{_flag(name)} must be >= 1, got {getattr(self, name)}")
        for name in ("kv_cache_gib", "admission_ttft_slo_ms", "admission_itl_slo_ms"):
            if not getattr(self, name) > 0:
                out.append(f"{_flag(name)} must be > 0, got {getattr(self, name)}")
        if self.epd:
            if self.engine != "vllm":
                out.append(f"{_flag('epd')} needs {_flag('engine')} vllm (the encoder and "
                           f"the EC consumers are vLLM), got {self.engine!r}")
            if (why := text_only(self.served_model())) is not None:
                out.append(f"{_flag('epd')} needs a multimodal model, but {_flag('model')} "
                           f"{self.served_model()!r} {why}")
        elif self.encoders != 1:
            out.append(f"{_flag('encoders')} ({self.encoders}) needs {_flag('epd')}")
        out.extend(self._afd_problems())
        out.extend(self._sglang_problems())
        if self.frontends > 1 and self.router == "embedded" and self.admission != "none":
            out.append(f"{_flag('frontends')} {self.frontends} with {_flag('router')} "
                       f"embedded and {_flag('admission')} {self.admission} is not supported "
                       "(each replica's admission control would count only its own flights; "
                       "use a router process)")
        if self.router == "embedded" and not self.insecure:
            # each child holds its own identity alone; the frontend would need the router's
            out.append(f"{_flag('router')} embedded needs {_flag('insecure')} for now (with "
                       "mTLS the frontend would need the router's certificate)")
        return out

    def _sglang_problems(self) -> list[str]:
        """``--engine sglang``: SGLang's P/D has one handoff of its own (the bootstrap
        handshake), so ``--handoff push`` is refused rather than ignored; the venv must
        exist."""
        if self.engine != "sglang":
            return []
        out = []
        if self.handoff != "pull":
            out.append(f"{_flag('handoff')} {self.handoff} is vLLM's; {_flag('engine')} "
                       "sglang hands KV over through SGLang's bootstrap handshake (leave "
                       f"{_flag('handoff')} unset)")
        from workers.engines.sglang.server import sglang_python

        if sglang_python() is None:
            out.append(f"{_flag('engine')} sglang needs the SGLang venv: run `make sglang`")
        return out

    def worker_handoff(self, role: str) -> str:
        """The worker's ``KVMESH_HANDOFF`` for ``role``: none for agg, ``sglang`` for an
        SGLang P or D, else ``--handoff``."""
        if role == "agg":
            return "none"
        return "sglang" if self.engine == "sglang" else self.handoff

    def _afd_problems(self) -> list[str]:
        if not self.afd:
            return ([f"{_flag('afd_attention')} ({self.afd_attention}) needs {_flag('afd')}"]
                    if self.afd_attention != 1 else [])
        out = []
        if self.epd:
            out.append(f"{_flag('afd')} and {_flag('epd')} do not combine")
        if self.served_model() not in TEXT_MODELS and text_only(self.served_model()) is None:
            out.append(f"{_flag('afd')} needs a text Llama model, got {self.model!r}")
        if not 1 <= self.afd_attention <= 8:
            out.append(f"{_flag('afd_attention')} must be in [1, 8], got {self.afd_attention}")
        return out

    def served_model(self) -> str:
        """The model to serve: ``model`` unless ``auto``: then ``tiny-vlm`` with ``epd``,
        else ``smollm2``."""
        if self.model != "auto":
            return self.model
        return "tiny-vlm" if self.epd else "smollm2"


MULTIMODAL_MODELS = ("tiny-vlm",)
TEXT_MODELS = ("smollm2", "tiny")


def text_only(model: str) -> str | None:
    """Why ``model`` (a name :func:`workers.main.resolve_model_path` knows, or a folder)
    cannot serve images, or None when it can: a folder is multimodal when its
    ``config.json`` has a ``vision_config`` (as Idefics3, SmolVLM and llava have)."""
    if model in MULTIMODAL_MODELS:
        return None
    if model in TEXT_MODELS:
        return "is a text-only model (use tiny-vlm, or a multimodal model folder)"
    path = Path(model) / "config.json"
    try:
        config = json.loads(path.read_text())
    except OSError as exc:
        return f"has no readable config.json ({exc.strerror or exc})"
    except ValueError as exc:
        return f"has a config.json that is no JSON ({exc})"
    if not isinstance(config, dict) or "vision_config" not in config:
        return "is a text-only model (its config.json has no vision_config)"
    return None


# Users' API keys (the frontend's alone); KVMESH_FRONTEND_API_KEY is the planner's.
USER_KEY_VARS = ("KVMESH_API_KEY", "KVMESH_FRONTEND_API_KEY")


def scrape_keys(environ: Mapping[str, str], token: Callable[[], str]) -> tuple[
        dict[str, str], dict[str, str]]:
    """(frontend env, planner env) for the planner's /metrics scrapes: a key that reads
    metrics and nothing else (``KVMESH_METRICS_API_KEYS`` on the frontend), the one given
    as ``KVMESH_FRONTEND_API_KEY`` or a fresh ``token()``, so the planner never holds a
    user's key."""
    key = environ.get("KVMESH_FRONTEND_API_KEY", "") or token()
    given = [k for k in environ.get("KVMESH_METRICS_API_KEYS", "").split(",") if k.strip()]
    return ({"KVMESH_METRICS_API_KEYS": ",".join(dict.fromkeys([*given, key]))},
            {"KVMESH_FRONTEND_API_KEY": key})


def health(url: str) -> tuple[int, dict[str, object]]:
    """GET url/health → (status, body); (0, {}) when unreachable."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, {}
    except (urllib.error.URLError, OSError, ValueError):
        return 0, {}


def _exited(child: Child) -> bool:
    """Whether ``child`` has exited, **without reaping it**: its zombie keeps its pid, and
    so its process group id, from being reused, so :func:`_finish` can still signal the
    group safely. True for a child already reaped (returncode set)."""
    if child.proc.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, child.pid,
                         os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped behind Popen's back: nothing is held any more
        child.proc.poll()
        return True


def _finish(child: Child) -> None:
    """SIGKILLs what is left of an exited ``child``'s process group (each child leads its
    own: the processes it started, such as vLLM's EngineCore, outlive a SIGKILLed child
    otherwise), then reaps it. Only while the child is unreaped, i.e. while its zombie
    holds the group id: a reaped child's id may belong to another process by now, so its
    group is never signalled."""
    if child.proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGKILL)
        child.proc.wait()


def _stop_child(child: Child, timeout_s: float = 10.0) -> None:
    """SIGTERM to a running child's group, SIGKILL after ``timeout_s``; then
    :func:`_finish` (the group's leftovers die with it)."""
    if not _exited(child):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while not _exited(child) and time.monotonic() < deadline:
            time.sleep(0.05)
    _finish(child)


@dataclass
class _Recipe:
    """How to start a child again: its command line (computed at each start), environment
    and address."""

    argv: Callable[[], list[str]]
    env: dict[str, str] | None
    address: str = ""


class LocalMesh:
    """A mesh of child processes; see the module docstring. ``clock`` (monotonic seconds)
    drives the restart backoff; ``log`` gets the supervision lines."""

    def __init__(self, spec: MeshSpec, policy: RestartPolicy | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 log: Callable[[str], None] | None = None) -> None:
        self.spec = spec
        self.children: list[Child] = []
        self.url = ""
        self.etcd: Child | None = None
        self.redis: Child | None = None
        self.supervisor = Supervisor(policy)
        self._clock = clock
        self._log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self._recipes: dict[str, _Recipe] = {}
        self._state: Path | None = None
        self._etcd_error = ""  # the last failed etcd read of registered(), for messages
        self._tls: dict[str, str] = {}
        self.tls_dir: Path | None = None

    def _env(self, **extra: str) -> dict[str, str]:
        assert self.etcd is not None and self.redis is not None
        env = {**os.environ, **CHILD_ENV, "KVMESH_ETCD_ENDPOINT": self.etcd.address,
               "KVMESH_REDIS_URL": f"{'rediss' if self.tls_dir else 'redis'}://"
                                   f"{self.redis.address}",
               "KVMESH_NAMESPACE": self.spec.namespace,
               "KVMESH_LEASE_TTL": str(self.spec.lease_ttl), **self._tls}
        env.update(extra)
        return env

    def _track(self, child: Child, argv: Callable[[], list[str]],
               env: dict[str, str] | None) -> Child:
        self.children.append(child)
        self._recipes[child.name] = _Recipe(argv, env, child.address)
        self.supervisor.started(child.name, self._clock())
        self._write_status()
        return child

    def child_env(self, name: str, identity: str = "") -> dict[str, str]:
        """The environment of a child ``name`` started beside the mesh (e.g. a store
        master): the mesh's endpoints and, with certificates, a folder holding identity
        ``identity`` (default ``name``) alone. Users' API keys (``KVMESH_API_KEY*``) go to
        the frontend only: any other child holding them could act as any tenant."""
        env = self._env(**self._child_tls(name, identity or name))
        if (identity or name) != "frontend":
            for var in [v for v in env if v.startswith(USER_KEY_VARS)]:
                del env[var]
        return env

    def _python(self, name: str, module: str, *args: str, identity: str = "",
                **env: str) -> Child:
        """Spawns ``python -m module`` as child ``name``; with certificates it gets the
        folder of certificate stem ``identity`` (default: the child's name)."""
        argv = [sys.executable, "-m", module, *args]
        full_env = {**self.child_env(name, identity), **env}
        return self._track(spawn(name, argv, self.spec.log_dir, full_env), lambda: argv,
                           full_env)

    def start(self) -> str:
        """Starts everything; returns the frontend's base URL."""
        s = self.spec
        s.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            s.log_dir.parent.mkdir(parents=True, exist_ok=True)
            state = self._state = Path(tempfile.mkdtemp(prefix="etcd-", dir=s.log_dir.parent))
            roles = ["agg"] if s.mode == "agg" else ["prefill", "decode"]
            names = [f"{role}-{i}" for role in roles for i in range(s.workers)]
            if s.afd:  # AFD: afd-ffn-0 and its attention workers instead
                roles, names = [], ["afd-ffn-0", *(f"afd-attention-{i}"
                                                   for i in range(s.afd_attention))]
            model = s.served_model()
            self._setup_tls(state, names)
            port, peer, certs = free_port(), free_port(), self.tls_dir
            self.etcd = self._track(start_etcd(state, s.log_dir, port, peer, certs),
                                    lambda: etcd_argv(state, port, peer, certs), None)
            self._provision_etcd()
            redis_port = free_port()
            self.redis = self._track(
                start_redis(s.log_dir, redis_port, state / "redis", certs, s.namespace),
                lambda: redis_argv(redis_port, state / "redis", certs, s.namespace), None)
            if s.indexer == "remote":
                self._python("indexer", "services.indexer")  # identity "indexer"
            if s.router == "standalone":
                self._python("router", "services.router", KVMESH_POLICY=s.policy,
                             KVMESH_INDEXER=s.indexer, **self.admission_env())
            images = {"KVMESH_MAX_IMAGES": str(s.max_images)}
            for i in range(s.encoders if s.epd else 0):
                self._python(f"encoder-{i}", "services.encoder", identity="encoder",
                             KVMESH_MODEL_PATH=model, **images)
            for role in roles:
                for i in range(s.workers):
                    self._python(f"{role}-{i}", "workers", identity=f"worker-{role}-{i}",
                                 **self._worker_tls(f"{role}-{i}"), **images,
                                 **self.ec_env(role),
                                 KVMESH_MODEL_PATH=model,
                                 KVMESH_ENGINE=s.engine,
                                 KVMESH_ROLE=role, KVMESH_HANDOFF=s.worker_handoff(role),
                                 KVMESH_KV_CACHE_GIB=str(s.kv_cache_gib),
                                 KVMESH_MAX_MODEL_LEN=str(s.max_model_len),
                                 KVMESH_BLOCK_SIZE=str(s.block_size))
            if s.afd:
                self._start_afd(model)
            port = s.http_port or free_port()
            front_scrape, planner_scrape = scrape_keys(os.environ, secrets.token_hex) \
                if s.planner else ({}, {})
            for name in self.frontend_names():
                self._python(name, "services.frontend", identity="frontend",
                             KVMESH_HTTP_PORT=str(port), **images, **front_scrape,
                             **self.embedded_router_env(), **self.reuse_port_env())
            front = self.child("frontend")
            self.url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + s.start_timeout_s

            def ready() -> bool:
                for c in self.children:
                    if _exited(c):
                        _finish(c)  # its group's leftovers go while it still holds the id
                        raise RuntimeError(f"{c.name} exited ({c.proc.returncode}):\n"
                                           f"{c.log_tail()}")
                code, body = health(self.url)
                if s.afd:  # every attention worker paired and registered (the FFN too)
                    if code != 200 or time.monotonic() < polled[0] + 0.5:
                        return False
                    polled[0] = time.monotonic()
                    return self.registered_afd_attention() >= s.afd_attention
                if code != 200 or int(str(body.get("workers", 0))) < s.workers * len(roles):
                    return False
                if not s.epd and s.frontends == 1:
                    return True
                if time.monotonic() < polled[0] + 0.5:  # etcd is read twice a second
                    return False
                polled[0] = time.monotonic()
                if s.epd and self.registered("encoder") < s.encoders:
                    return False
                return s.frontends == 1 or self.registered("frontend") >= s.frontends

            polled = [0.0]
            try:
                wait_until(ready, front, max(deadline - time.monotonic(), 1),
                           "the mesh to serve")
            except RuntimeError as exc:
                if self._etcd_error:  # why the encoders never showed up, not just "timed out"
                    raise RuntimeError(f"{exc}\nthe last etcd read of the encoders failed: "
                                       f"{self._etcd_error}") from exc
                raise
            if s.planner:
                # one frontend: its URL; replicas: each one's own, from discovery
                urls = {"KVMESH_METRICS_URLS": f"{self.url}/metrics"} \
                    if s.frontends == 1 else {}
                self._python("planner", "services.planner", KVMESH_ACTUATOR="dry_run",
                             KVMESH_MODE="agg" if s.mode == "agg" else "disagg",
                             **urls, **planner_scrape)
        except BaseException:
            self.stop()
            raise
        return self.url

    def supervise(self) -> None:
        """One supervision step (module docstring): notes the children that exited since
        the last step, logs each once and schedules its restart; restarts those due."""
        now = self._clock()
        changed = False
        for c in self.children:
            if self.supervisor.pending(c.name) or not _exited(c):
                continue
            _finish(c)  # what it left behind (a vLLM EngineCore) goes now, then it is reaped
            how = describe_exit(c.proc.returncode)
            d = self.supervisor.exited(c.name, how, now)
            loop = (f"; crash loop ({d.exits_in_window} exits within "
                    f"{self.supervisor.policy.crashloop_window_s:g} s)" if d.crashloop else "")
            self._log(f"kvmesh up: {c.name} (pid {c.pid}) exited ({how}){loop}; restarting "
                      f"in {d.delay_s:g} s; log: {c.log_path}")
            changed = True
        for name in self.supervisor.due(now):
            self._restart(name, now)
            changed = True
        if changed:
            self._write_status()

    def _restart(self, name: str, now: float) -> None:
        at = next(i for i, c in enumerate(self.children) if c.name == name)
        old, recipe = self.children[at], self._recipes[name]
        state = self.supervisor.state(name)
        try:
            with open(old.log_path, "ab") as log:
                log.write(f"--- kvmesh up: restart {state.restarts + 1} (last exit: "
                          f"{state.last_exit}) ---\n".encode())
            child = spawn(name, recipe.argv(), self.spec.log_dir, recipe.env, append=True)
        except (OSError, RuntimeError) as exc:  # a binary gone, a full disk, ...
            d = self.supervisor.exited(name, f"restart failed: {exc}", now)
            self._log(f"kvmesh up: {name} could not be restarted ({exc}); retrying in "
                      f"{d.delay_s:g} s")
            return
        child.address = recipe.address
        self.children[at] = child
        if name == "etcd":
            self.etcd = child
        elif name == "redis":
            self.redis = child
        restarts = self.supervisor.started(name, now).restarts
        self._log(f"kvmesh up: {name} restarted (pid {child.pid}, restarts {restarts})")

    def _write_status(self, stopped: bool = False) -> None:
        pids = {c.name: c.pid for c in self.children}
        lines = ["name\tpid\tstate\trestarts\tlast_exit\taddress"]
        for st in self.supervisor.states():
            state = ("stopped" if stopped else "running" if st.restart_at is None else
                     "crashloop" if st.crashloop else "restarting")
            cells = [st.name, str(pids.get(st.name, "-")), state, str(st.restarts),
                     st.last_exit or "-", self._recipes[st.name].address or "-"]
            lines.append("\t".join(" ".join(c.split()) for c in cells))  # one line, no tabs
        path = self.spec.log_dir / STATUS_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(path)

    def _setup_tls(self, state: Path, workers: list[str]) -> None:
        """Certificates for every role and one per worker (``workers``: child names) into
        ``state/certs`` (or insecure children)."""
        if self.spec.insecure:
            self._tls = {"KVMESH_INSECURE": "1", "KVMESH_TLS_DIR": ""}
            return
        from services.common.tls import ROLES, write_mesh_certs

        self.tls_dir = state / "certs"
        write_mesh_certs(self.tls_dir, [*ROLES, *(f"worker:{n}" for n in workers)])
        self._tls = {"KVMESH_INSECURE": "0"}  # each child's folder: _child_tls

    def _child_tls(self, name: str, stem: str) -> dict[str, str]:
        """Child ``name``'s TLS env: a folder with identity ``stem`` alone ({} insecure)."""
        if self.tls_dir is None or self._state is None:
            return {}
        from services.common.tls import export_identity

        folder = export_identity(self.tls_dir, self._state / "identities" / name, stem)
        return {"KVMESH_TLS_DIR": str(folder), "KVMESH_TLS_CERT": stem}

    def _provision_etcd(self) -> None:
        """etcd's users and roles for every certificate in :attr:`tls_dir`, auth on."""
        if self.tls_dir is None:
            return
        from services.common.etcd_auth import identities_in, provision
        from services.common.tls import MeshTls

        assert self.etcd is not None
        provision(self.etcd.address, MeshTls.load(self.tls_dir, "admin"), self.spec.namespace,
                  identities_in(self.tls_dir))

    def _worker_tls(self, name: str) -> dict[str, str]:
        """A worker child's worker id (its certificate's name); none when insecure."""
        if self.tls_dir is None:
            return {}
        return {"KVMESH_WORKER_ID": name}

    def ec_env(self, role: str) -> dict[str, str]:
        """A worker's EPD settings: with ``epd`` the aggregated and prefill workers read
        embeddings from the encoders (``ec_consumer``); decode workers take the images
        with the request and P's KV, never an embedding."""
        consumer = self.spec.epd and role in ("agg", "prefill")
        return {"KVMESH_EC_ROLE": "ec_consumer" if consumer else ""}

    def records(self, component: str) -> list[Any]:
        """The ``component`` records (``discovery_pb2.InstanceRecord``) in etcd now, read
        as the admin certificate with certificates; raises when etcd does not answer
        within 5 s."""
        import asyncio

        from services.common.discovery import read_instance_records

        assert self.etcd is not None
        address, tls = self.etcd.address, None
        if self.tls_dir is not None:
            from services.common.tls import MeshTls

            tls = MeshTls.load(self.tls_dir, "admin")
        return asyncio.run(asyncio.wait_for(read_instance_records(
            address, self.spec.namespace, component, tls), 5))

    def registered(self, component: str) -> int:
        """How many ``component`` records are in etcd now (0 when etcd does not answer:
        the error is kept in ``_etcd_error`` for the start's timeout message, and
        cleared by the next read that works)."""
        try:
            found = len(self.records(component))
        except Exception as exc:  # noqa: BLE001  etcd busy or restarting: not yet
            self._etcd_error = f"{type(exc).__name__}: {exc}"
            return 0
        self._etcd_error = ""
        return found

    def embedded_router_env(self) -> dict[str, str]:
        """With ``--router embedded``: the frontend's ``KVMESH_ROUTER`` and
        ``KVMESH_ROUTER_ARGS`` (the policy, indexer and admission a router process would
        get); else nothing."""
        s = self.spec
        if s.router != "embedded":
            return {}
        args = [f"--policy={s.policy}", f"--indexer={s.indexer}"] + [
            f"--{k[len('KVMESH_'):].lower().replace('_', '-')}={v}"
            for k, v in self.admission_env().items()]
        if s.frontends > 1:  # one router per replica: each counts the others' requests
            args.append("--replica-sync")
        return {"KVMESH_ROUTER": "embedded", "KVMESH_ROUTER_ARGS": shlex.join(args)}

    def frontend_names(self) -> list[str]:
        """The frontend children: ``frontend``, then ``frontend-1`` ... (``--frontends``)."""
        return ["frontend", *(f"frontend-{i}" for i in range(1, self.spec.frontends))]

    def reuse_port_env(self) -> dict[str, str]:
        """``KVMESH_REUSE_PORT=1`` with several frontends (they share the HTTP port)."""
        return {"KVMESH_REUSE_PORT": "1"} if self.spec.frontends > 1 else {}

    def _start_afd(self, model: str) -> None:
        """``kvmesh up --afd``: the FFN worker ``afd-ffn-0`` (worker id ``afd-ffn-0`` in
        both modes: its attention workers pair by it), then ``afd-attention-<i>``, each
        ``--afd-attention-id i`` of ``afd_attention`` (1A1F, 2A1F, ...)."""
        s = self.spec
        common = {"KVMESH_ENGINE": "afd", "KVMESH_MODEL_PATH": model, "KVMESH_ROLE": "agg",
                  "KVMESH_AFD_TRANSPORT": s.afd_transport,
                  "KVMESH_AFD_ATTENTION_WORKERS": str(s.afd_attention),
                  "KVMESH_KV_CACHE_GIB": str(s.kv_cache_gib),
                  "KVMESH_MAX_MODEL_LEN": str(s.max_model_len),
                  "KVMESH_BLOCK_SIZE": str(s.block_size)}
        self._python("afd-ffn-0", "workers", identity="worker-afd-ffn-0", **common,
                     KVMESH_WORKER_ID="afd-ffn-0", KVMESH_AFD_ROLE="ffn")
        for i in range(s.afd_attention):
            name = f"afd-attention-{i}"
            self._python(name, "workers", identity=f"worker-{name}", **self._worker_tls(name),
                         **common, KVMESH_AFD_ROLE="attention", KVMESH_AFD_FFN_ID="afd-ffn-0",
                         KVMESH_AFD_ATTENTION_ID=str(i))

    def registered_afd_attention(self) -> int:
        """AFD attention worker records in etcd now (0 when etcd does not answer)."""
        from services.common.discovery import AFD_ATTENTION

        try:
            return sum(AFD_ATTENTION in r.capabilities for r in self.records("worker"))
        except Exception as exc:  # noqa: BLE001  etcd busy or restarting: not yet
            self._etcd_error = f"{type(exc).__name__}: {exc}"
            return 0

    def admission_env(self) -> dict[str, str]:
        """The router's admission settings as ``KVMESH_*`` env vars."""
        s = self.spec
        return {"KVMESH_ADMISSION": s.admission,
                "KVMESH_ADMISSION_TTFT_SLO_MS": str(s.admission_ttft_slo_ms),
                "KVMESH_ADMISSION_ITL_SLO_MS": str(s.admission_itl_slo_ms)}

    def child(self, name: str) -> Child:
        """The child process named ``name``."""
        return next(c for c in self.children if c.name == name)

    def stop(self) -> None:
        """Stops every child, in reverse start order, by PID (no restarts after this)."""
        for child in reversed(self.children):
            _stop_child(child)
        if self.children:
            self._write_status(stopped=True)
        for child in self.children:
            self.supervisor.forget(child.name)
        self.children.clear()
        if self._state is not None:
            shutil.rmtree(self._state, ignore_errors=True)
            self._state = None
