"""Where kvmesh's SGLang runtime lives and how one SGLang 0.5.23 CPU server is started.
Stdlib only, so it imports from ``.venv`` (the server itself runs in ``.sglvenv``).

Contract:

- :data:`SGLANG_VENV_ENV` (``KVMESH_SGLANG_VENV``): overrides the venv folder
  (default ``<repo>/.sglvenv``, built by ``make sglang``).
- :func:`sglang_python(repo_root=None) -> Path | None`: ``<venv>/bin/python`` when it
  exists and has ``sglang`` :data:`SGLANG_VERSION` installed (checked in a child process
  by its package metadata and import spec, without importing SGLang, which takes tens of
  seconds on 2 cores); None otherwise (tests skip). Cached per python path.
- :class:`ServerSpec`: one server. ``role`` is ``"agg"``, ``"prefill"`` or ``"decode"``;
  ``bootstrap_port`` (SGLang's ``CommonKVBootstrapServer``) is required for prefill and
  refused for the other roles; ``transfer_backend`` is ``"nixl"`` (the one proven here) or
  ``"mooncake"``; ``max_total_tokens`` 0 means :data:`DEFAULT_MAX_TOTAL_TOKENS` (SGLang's
  own sizing takes ``--mem-fraction-static`` of the host's free RAM: most of it on CPU);
  ``context_length`` 0 means the model's. ``kv_events_endpoint`` (``tcp://127.0.0.1:N`` or
  ``ipc://<absolute path>``)
  turns on SGLang's ZMQ KV-event publisher, bound there (topic ``""``); with
  ``kv_events_replay_endpoint`` it also binds the replay ROUTER. Only loopback hosts and
  endpoints are accepted. :meth:`ServerSpec.validate` raises ValueError naming the field.
- :func:`server_command(spec, repo_root) -> (argv, env)`: the argv (the venv's python,
  ``-m workers.engines.sglang.launch``, then SGLang's server flags: ``--device cpu
  --attention-backend torch_native --dtype float32``, CUDA graphs disabled for both
  phases, ``--sleep-on-idle`` (an idle scheduler otherwise busy-polls one core), page size,
  host, port, seed, token budget, role flags (decode also gets
  ``--disaggregation-decode-retraction-backup cpu_tensor``: SGLang's default host pool
  needs CUDA), events config, then ``extra_args``) and the
  environment additions (``SGLANG_USE_CPU_ENGINE=1``, ``UCX_NET_DEVICES=lo``, offline
  hub flags). Run it with ``cwd=repo_root``, in its own process group, and stop it by
  signalling the group (SGLang forks a scheduler and a detokenizer).

The server (SGLang's own HTTP API) serves:

- ``GET /health``: 503 while starting (including SGLang's warmup request), then 200.
- ``POST /generate`` ``{"rid", "input_ids", "sampling_params", "stream"}``; P/D adds
  ``bootstrap_host``, ``bootstrap_port``, ``bootstrap_room`` (int) on both P and D. A
  stream is SSE ``data: {json}`` lines, ``text`` and ``output_ids`` cumulative, ending
  ``data: [DONE]``; ``meta_info`` has ``id``, ``finish_reason`` (null, or ``{"type":
  "length"|"stop"|"abort", ...}``), ``prompt_tokens``, ``completion_tokens``,
  ``cached_tokens``.
- ``POST /abort_request`` ``{"rid"}``: 200 (also for unknown ids); the stream ends with
  finish_reason type ``"abort"``.
- ``GET /v1/loads``: ``{"loads": [{"num_running_reqs", "num_waiting_reqs",
  "max_total_num_tokens", "token_usage", "disaggregation": {...queues}, ...}]}``
  (``/get_load`` does not exist in 0.5.23).
- ``POST /flush_cache``: 200 when flushed (publishes AllBlocksCleared), 400 when refused.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

SGLANG_VENV_ENV = "KVMESH_SGLANG_VENV"
SGLANG_VERSION = "0.5.23"
DEFAULT_MAX_TOTAL_TOKENS = 16384
ROLES = ("agg", "prefill", "decode")
TRANSFER_BACKENDS = ("nixl", "mooncake")
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
_REPO_ROOT = Path(__file__).resolve().parents[3]

_CHECK = (
    "import importlib.metadata as m, importlib.util as u, sys; "
    f"sys.exit(0 if u.find_spec('sglang') and m.version('sglang') == {SGLANG_VERSION!r} else 1)"
)


def sglang_venv(repo_root: Path | None = None) -> Path:
    """The SGLang venv folder: ``$KVMESH_SGLANG_VENV`` or ``<repo_root>/.sglvenv``."""
    override = os.environ.get(SGLANG_VENV_ENV)
    if override:
        return Path(override).expanduser()
    return (repo_root or _REPO_ROOT) / ".sglvenv"


@functools.lru_cache(maxsize=8)
def _has_sglang(python: Path) -> bool:
    try:
        done = subprocess.run([str(python), "-c", _CHECK], capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def sglang_python(repo_root: Path | None = None) -> Path | None:
    """The venv's python when SGLang :data:`SGLANG_VERSION` is installed there, else None."""
    python = sglang_venv(repo_root) / "bin" / "python"
    if not python.exists():
        return None
    return python if _has_sglang(python) else None


def _local_endpoint(field: str, endpoint: str) -> None:
    """A ZMQ endpoint only this host reaches: ``tcp://127.0.0.1:<port>`` or ``ipc://<abs
    path>`` (the worker's relay uses private ipc paths, as for vLLM)."""
    if endpoint.startswith("ipc://"):
        if not endpoint[len("ipc://"):].startswith("/"):
            raise ValueError(f"{field} must be ipc://<absolute path>, got {endpoint!r}")
        return
    parts = urlsplit(endpoint)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "tcp" or parts.hostname not in LOOPBACK_HOSTS or not port:
        raise ValueError(f"{field} must be tcp://127.0.0.1:<port> or ipc://<absolute path>, "
                         f"got {endpoint!r}")


@dataclass(frozen=True)
class ServerSpec:
    """One SGLang server (see the module docstring for each field's meaning)."""

    model_path: str
    port: int
    role: str
    page_size: int = 32
    host: str = "127.0.0.1"
    seed: int = 0
    context_length: int = 0
    max_total_tokens: int = 0
    bootstrap_port: int = 0
    transfer_backend: str = "nixl"
    kv_events_endpoint: str = ""
    kv_events_replay_endpoint: str = ""
    extra_args: tuple[str, ...] = ()

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field."""
        if not self.model_path:
            raise ValueError("model_path must be set")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.page_size <= 0:
            raise ValueError(f"page_size must be positive, got {self.page_size}")
        if self.host not in LOOPBACK_HOSTS:
            raise ValueError(f"host must be a loopback address {LOOPBACK_HOSTS}, got {self.host!r}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.context_length < 0:
            raise ValueError(f"context_length must be >= 0, got {self.context_length}")
        if self.max_total_tokens < 0:
            raise ValueError(f"max_total_tokens must be >= 0, got {self.max_total_tokens}")
        if self.role == "prefill":
            if not 0 < self.bootstrap_port < 65536:
                raise ValueError("bootstrap_port must be in 1..65535 for role prefill, "
                                 f"got {self.bootstrap_port}")
            if self.bootstrap_port == self.port:
                raise ValueError("bootstrap_port must differ from port")
        elif self.bootstrap_port:
            raise ValueError(f"bootstrap_port is only for role prefill, not {self.role!r}")
        if self.role != "agg" and self.transfer_backend not in TRANSFER_BACKENDS:
            raise ValueError(f"transfer_backend must be one of {TRANSFER_BACKENDS}, "
                             f"got {self.transfer_backend!r}")
        if self.kv_events_endpoint:
            _local_endpoint("kv_events_endpoint", self.kv_events_endpoint)
        if self.kv_events_replay_endpoint:
            if not self.kv_events_endpoint:
                raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")
            _local_endpoint("kv_events_replay_endpoint", self.kv_events_replay_endpoint)
            if self.kv_events_replay_endpoint == self.kv_events_endpoint:
                raise ValueError("kv_events_replay_endpoint must differ from kv_events_endpoint")


def kv_events_config(spec: ServerSpec) -> str:
    """The ``--kv-events-config`` JSON for ``spec`` ("" when KV events are off)."""
    if not spec.kv_events_endpoint:
        return ""
    config: dict[str, object] = {
        "publisher": "zmq",
        "endpoint": spec.kv_events_endpoint,
        "bind": True,
        "topic": "",
    }
    if spec.kv_events_replay_endpoint:
        config["replay_endpoint"] = spec.kv_events_replay_endpoint
    return json.dumps(config, separators=(",", ":"))


def server_command(spec: ServerSpec, repo_root: Path) -> tuple[list[str], dict[str, str]]:
    """The argv and the environment additions that start ``spec`` (see module docstring).

    Raises ValueError for an invalid spec and RuntimeError when ``.sglvenv`` is missing.
    """
    spec.validate()
    python = sglang_venv(repo_root) / "bin" / "python"
    if not python.exists():
        raise RuntimeError(f"{python} is missing: run `make sglang` first")
    argv = [
        str(python), "-m", "workers.engines.sglang.launch",
        "--model-path", spec.model_path,
        "--device", "cpu",
        "--attention-backend", "torch_native",
        "--sampling-backend", "pytorch",
        "--dtype", "float32",
        "--cuda-graph-backend-decode", "disabled",
        "--cuda-graph-backend-prefill", "disabled",
        "--sleep-on-idle",
        "--page-size", str(spec.page_size),
        "--host", spec.host,
        "--port", str(spec.port),
        "--random-seed", str(spec.seed),
        "--max-total-tokens", str(spec.max_total_tokens or DEFAULT_MAX_TOTAL_TOKENS),
    ]  # fmt: skip
    if spec.context_length:
        argv += ["--context-length", str(spec.context_length)]
    if spec.role != "agg":
        argv += [
            "--disaggregation-mode", spec.role,
            "--disaggregation-transfer-backend", spec.transfer_backend,
        ]  # fmt: skip
    if spec.role == "prefill":
        argv += ["--disaggregation-bootstrap-port", str(spec.bootstrap_port)]
    if spec.role == "decode":
        # SGLang's default here is a HiCache host pool pinned with cudaHostRegister: CUDA only.
        argv += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
    events = kv_events_config(spec)
    if events:
        argv += ["--kv-events-config", events]
    argv += list(spec.extra_args)
    env = {
        "SGLANG_USE_CPU_ENGINE": "1",
        "UCX_NET_DEVICES": "lo",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "DO_NOT_TRACK": "1",
        "PYTHONUNBUFFERED": "1",
    }
    return argv, env
