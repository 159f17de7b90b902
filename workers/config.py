"""Worker configuration (flags + ``KVMESH_*`` env vars).

Worker id and certificate: with TLS on and ``tls_cert`` naming a worker *instance*
certificate (``worker:<name>``, file stem ``worker-<name>``; :mod:`services.common.tls`),
the worker id is that name (or, for a fleet certificate ``worker:fleet-<x>`` only, one of
its sub-ids ``<name>.<suffix>``: :func:`services.common.worker_ids.may_act_as`): the
default worker id becomes the name, and a configured ``worker_id`` the certificate may
not act as is refused by ``problems()`` naming both fields (etcd's auth lets that
certificate write only ``/<ns>/instances/worker/<name>``, and a fleet certificate its
sub-ids too; see :mod:`services.common.etcd_auth`;
an indexer drops events it signs for any other id). The shared role certificate
``worker`` binds no id. :meth:`WorkerConfig.certificate_identity` is the certificate's
identity (None without TLS), for :mod:`workers.fleet`.
"""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path

from services.common.config import BaseConfig
from services.common.tls import CertError, Identity, identity_of
from services.common.worker_ids import SHARED_NAME, has_sub_ids, may_act_as

ROLES = ("agg", "prefill", "decode")
AFD_ROLES = ("attention", "ffn")


def kv_event_problems(cfg: WorkerConfig) -> list[str]:
    """What is wrong with ``cfg``'s KV event relay options."""
    out = []
    if cfg.kv_events_maxlen < 1000:
        out.append("kv_events_maxlen must be >= 1000")
    if not 0 <= cfg.kv_event_flush_ms <= 1000:
        out.append(f"kv_event_flush_ms must be in [0, 1000], got {cfg.kv_event_flush_ms}")
    return out


@dataclasses.dataclass
class WorkerConfig(BaseConfig):
    """kvmesh worker: one engine behind the Worker gRPC API."""

    engine: str = dataclasses.field(default="vllm", metadata={"help": "engine kind"})
    model_path: str = dataclasses.field(
        default="", metadata={"help": "model folder (HF safetensors); 'tiny' = test model"}
    )
    model_name: str = dataclasses.field(
        default="", metadata={"help": "served model name (default: folder name)"}
    )
    role: str = dataclasses.field(default="agg", metadata={"help": "agg | prefill | decode"})
    worker_id: str = dataclasses.field(
        default="", metadata={"help": "instance id (default: random, unique per launch)"}
    )
    block_size: int = dataclasses.field(default=32, metadata={"help": "KV block size (tokens)"})
    max_model_len: int = dataclasses.field(default=2048, metadata={"help": "context length"})
    kv_cache_gib: float = dataclasses.field(default=1.0, metadata={"help": "KV cache GiB"})
    dtype: str = dataclasses.field(default="float32", metadata={"help": "model dtype"})
    max_num_seqs: int = dataclasses.field(default=64, metadata={"help": "max batched requests"})
    seed: int = dataclasses.field(default=0, metadata={"help": "engine seed"})
    handoff: str = dataclasses.field(
        default="", metadata={"help": "P/D KV handoff: pull | push | none | sglang "
                                      "(default: pull for prefill/decode, none for agg; "
                                      "engine sglang: its bootstrap handshake, sglang)"}
    )
    kv_load_failure_policy: str = dataclasses.field(
        default="recompute", metadata={"help": "D when loading P's KV fails: recompute | fail"}
    )
    kv_handoff_timeout_s: float = dataclasses.field(
        default=10.0, metadata={"help": "D, pull mode: longest wait for P's KV (until its "
                                        "first token); then recompute or fail by "
                                        "--kv-load-failure-policy"}
    )
    metrics_port: int = dataclasses.field(
        default=0, metadata={"help": "Prometheus /metrics port (0 = any free, -1 = off)"}
    )
    nixl_port: int = dataclasses.field(
        default=0, metadata={"help": "NIXL side-channel port (0 = any free)"}
    )
    request_plane_port: int = dataclasses.field(
        default=0, metadata={"help": "TCP request plane port: Generate calls multiplexed on "
                                     "plain TCP, mTLS with --tls-dir (0 = any free, -1 = "
                                     "off: callers use the gRPC port)"}
    )
    store_master: str = dataclasses.field(
        default="", metadata={"help": "store master host:port: save prefix KV to the shared "
                                      "store and load it back (empty: off)"}
    )
    store_l1_mib: int = dataclasses.field(
        default=0, metadata={"help": "CPU (L1) pool in front of the store, MiB (0: none)"}
    )
    store_replicas: int = dataclasses.field(
        default=1, metadata={"help": "store replicas per saved block"}
    )
    store_async_load: bool = dataclasses.field(
        default=False, metadata={"help": "load store hits asynchronously (vLLM parks the "
                                         "request until its KV arrives)"}
    )
    kv_events: bool = dataclasses.field(
        default=True, metadata={"help": "publish KV events to the Redis stream "
                                        "(needs --redis-url)"}
    )
    kv_events_maxlen: int = dataclasses.field(
        default=1_000_000, metadata={"help": "approximate MAXLEN of the KV event stream"}
    )
    kv_event_flush_ms: float = dataclasses.field(
        default=2.0, metadata={"help": "the KV event relay publishes a batch this long after "
                                      "its first event, with every event that came "
                                      "meanwhile in the same round trip (0: at once)"}
    )
    ec_role: str = dataclasses.field(
        default="", metadata={"help": "EPD: 'ec_consumer' reads image embeddings an encoder "
                                      "published (a multimodal model; empty: off): an agg "
                                      "worker for E/PD, the prefill worker for E/P/D (its "
                                      "decode worker needs none)"}
    )
    ec_backend: str = dataclasses.field(
        default="nixl", metadata={"help": "EC connector: nixl (kvmesh's, default) or example "
                                          "(vLLM's ECExampleConnector, --ec-shared-path)"}
    )
    ec_shared_path: str = dataclasses.field(
        default="", metadata={"help": "the example EC connector's shared folder"}
    )
    max_images: int = dataclasses.field(
        default=4, metadata={"help": "images per request at most (multimodal models)"}
    )
    stream_interval: int = dataclasses.field(
        default=1, metadata={"help": "vLLM's --stream-interval: a streamed answer's tokens "
                                     "after its first go in messages of at least this "
                                     "many (a request's stream_interval may ask for more)"}
    )
    # AFD (--engine afd): attention and FFN on separate workers (workers.engines.afd)
    afd_role: str = dataclasses.field(
        default="", metadata={"help": "AFD: attention (KV cache, lm_head; serves requests) or "
                                      "ffn (the FFN side of attention workers; no requests)"}
    )
    afd_transport: str = dataclasses.field(
        default="shm", metadata={"help": "AFD activation transport: shm (shared memory, this "
                                         "host) or nixl"}
    )
    afd_ffn_id: str = dataclasses.field(
        default="", metadata={"help": "AFD attention: the worker id of the FFN worker to "
                                      "pair with"}
    )
    afd_attention_id: int = dataclasses.field(
        default=0, metadata={"help": "AFD attention: this worker's slot on its FFN, in "
                                     "[0, --afd-attention-workers)"}
    )
    afd_attention_workers: int = dataclasses.field(
        default=1, metadata={"help": "AFD: attention workers sharing the FFN (1: 1A1F, "
                                     "2: 2A1F); equal on both sides"}
    )
    afd_microbatches: int = dataclasses.field(
        default=2, metadata={"help": "AFD: microbatches per step (2: ping-pong overlap); "
                                     "equal on both sides"}
    )
    afd_max_batch_tokens: int = dataclasses.field(
        default=512, metadata={"help": "AFD: tokens per step (the transport's slot rows); "
                                       "equal on both sides"}
    )
    afd_threads: int = dataclasses.field(
        default=1, metadata={"help": "AFD: torch intra-op threads of the engine"}
    )
    afd_recv_timeout_s: float = dataclasses.field(
        default=10.0, metadata={"help": "AFD attention: longest wait for one FFN answer"}
    )
    afd_pair_timeout_s: float = dataclasses.field(
        default=120.0, metadata={"help": "AFD attention: longest wait at start for the FFN"}
    )

    def problems(self) -> list[str]:
        out = super().problems()
        try:
            bound = self.certificate_worker_id()
        except CertError as exc:
            out.append(f"tls_cert: {exc}")
        else:
            if bound and self.worker_id and not may_act_as(bound, self.worker_id):
                subs = (f"nor one of its sub-ids '{bound}.<suffix>' (letters, digits, "
                        f"'-', '_')" if has_sub_ids(bound) else
                        "and it has no sub-ids (only a fleet certificate "
                        "worker:fleet-<x> has)")
                out.append(f"worker_id {self.worker_id!r} is not the instance name "
                           f"{bound!r} in tls_cert {self.tls_cert!r} {subs}: a worker "
                           f"registers only under an id its certificate may act as "
                           f"(drop --worker-id, or use the instance certificate of that "
                           f"id's owner)")
        if self.role not in ROLES:
            out.append(f"role must be one of {ROLES}, got {self.role!r}")
        vllm = self.engine == "vllm"
        if vllm and not self.model_path:
            out.append("model_path is required")
        if self.block_size <= 0 or (vllm and self.block_size % 32):
            out.append("block_size must be a positive multiple of 32 (vLLM-CPU)")
        if self.max_model_len < 16:
            out.append("max_model_len must be >= 16")
        if self.kv_cache_gib <= 0:
            out.append("kv_cache_gib must be > 0")
        if self.dtype not in ("float32", "bfloat16", "float16", "auto"):
            out.append(f"unknown dtype {self.dtype!r}")
        if self.max_num_seqs < 1:
            out.append("max_num_seqs must be >= 1")
        if self.handoff not in ("", "none", "pull", "push", "sglang"):
            out.append(f"handoff must be pull, push, none or sglang, got {self.handoff!r}")
        out.extend(self._sglang_problems())
        if vllm and self.role != "agg" and self.resolved_handoff() == "none":
            out.append(f"a {self.role} worker needs a KV handoff (pull or push)")
        if self.kv_load_failure_policy not in ("recompute", "fail"):
            out.append("kv_load_failure_policy must be recompute or fail")
        if not 0 < self.kv_handoff_timeout_s <= 3600:
            out.append("kv_handoff_timeout_s must be in (0, 3600], "
                       f"got {self.kv_handoff_timeout_s}")
        if not -1 <= self.metrics_port <= 65535:
            out.append(f"metrics_port out of range: {self.metrics_port}")
        if not -1 <= self.request_plane_port <= 65535:
            out.append(f"request_plane_port out of range: {self.request_plane_port}")
        if not 0 <= self.nixl_port <= 65535:
            out.append(f"nixl_port out of range: {self.nixl_port}")
        if self.store_master and ":" not in self.store_master:
            out.append(f"store_master must be host:port, got {self.store_master!r}")
        if self.store_l1_mib < 0 or self.store_replicas < 1:
            out.append("store_l1_mib must be >= 0 and store_replicas >= 1")
        if self.store_master and self.engine != "vllm":
            out.append("the KV store connector needs the vllm engine")
        out += kv_event_problems(self)
        if self.ec_role not in ("", "ec_consumer"):
            out.append(f"ec_role must be ec_consumer or empty, got {self.ec_role!r}")
        if self.ec_role and self.engine != "vllm":
            out.append("ec_role needs the vllm engine")
        if self.ec_backend not in ("nixl", "example"):
            out.append(f"ec_backend must be nixl or example, got {self.ec_backend!r}")
        if self.ec_role and self.ec_backend == "example" and not self.ec_shared_path:
            out.append("ec_backend example needs ec_shared_path")
        if self.max_images < 1:
            out.append(f"max_images must be >= 1, got {self.max_images}")
        if self.stream_interval < 1:
            out.append(f"stream_interval must be >= 1, got {self.stream_interval}")
        out.extend(self._afd_problems())
        return out

    def _sglang_problems(self) -> list[str]:
        """Engine sglang: P/D only through SGLang's bootstrap handshake; the handoff
        mode sglang only with engine sglang (the store, EC and AFD need other engines:
        checked with them)."""
        if self.engine != "sglang":
            return ["handoff sglang needs engine sglang"] if self.handoff == "sglang" else []
        out = []
        if not self.model_path:
            out.append("model_path is required")
        if self.handoff not in ("", "sglang") and not (self.role == "agg"
                                                       and self.handoff == "none"):
            out.append(f"engine sglang hands KV off only through SGLang's bootstrap "
                       f"(handoff sglang), got handoff {self.handoff!r}")
        if self.role == "agg" and self.handoff == "sglang":
            out.append("handoff sglang needs role prefill or decode")
        return out

    def _afd_problems(self) -> list[str]:
        afd = self.engine == "afd"
        if not afd:
            return ["afd_role needs engine afd"] if self.afd_role else []
        out = []
        if not self.model_path:
            out.append("model_path is required")
        if self.afd_role not in AFD_ROLES:
            out.append(f"afd_role must be one of {AFD_ROLES} with engine afd, "
                       f"got {self.afd_role!r}")
        if self.afd_transport not in ("shm", "nixl"):
            out.append(f"afd_transport must be shm or nixl, got {self.afd_transport!r}")
        if self.role != "agg":
            out.append(f"engine afd serves whole requests: role must be agg, got {self.role!r}")
        if self.afd_role == "attention" and not self.afd_ffn_id:
            out.append("afd_ffn_id is required with afd_role attention (the FFN worker's id)")
        if self.afd_role == "ffn" and not (self.worker_id or self.tls_cert):
            out.append("an AFD FFN worker needs a fixed worker_id (its attention workers "
                       "pair with it by --afd-ffn-id)")
        if self.afd_attention_workers < 1:
            out.append(f"afd_attention_workers must be >= 1, got {self.afd_attention_workers}")
        elif not 0 <= self.afd_attention_id < self.afd_attention_workers:
            out.append(f"afd_attention_id must be in [0, afd_attention_workers="
                       f"{self.afd_attention_workers}), got {self.afd_attention_id}")
        if self.afd_microbatches not in (1, 2):
            out.append(f"afd_microbatches must be 1 or 2, got {self.afd_microbatches}")
        if not 1 <= self.afd_max_batch_tokens <= self.max_model_len:
            out.append(f"afd_max_batch_tokens must be in [1, max_model_len="
                       f"{self.max_model_len}], got {self.afd_max_batch_tokens}")
        if self.afd_threads < 1:
            out.append(f"afd_threads must be >= 1, got {self.afd_threads}")
        for name in ("afd_recv_timeout_s", "afd_pair_timeout_s"):
            if not 0 < getattr(self, name) <= 3600:
                out.append(f"{name} must be in (0, 3600], got {getattr(self, name)}")
        return out

    def publishes_kv_events(self) -> bool:
        """KV events are on and there is a bus to publish them to (never for the AFD
        engine: it has no prefix cache, so no KV events)."""
        return self.kv_events and bool(self.redis_url) and self.engine != "afd"

    def resolved_handoff(self) -> str:
        """The handoff mode in force: the configured one, else pull for P/D, none for agg."""
        if self.handoff:
            return self.handoff
        if self.role == "agg":
            return "none"
        return "sglang" if self.engine == "sglang" else "pull"

    def certificate_identity(self) -> Identity | None:
        """The identity of the certificate this process presents (``tls_cert``, default the
        role certificate ``worker``); None without TLS. CertError when it cannot be
        read."""
        if not self.tls_dir or self.insecure:
            return None
        path = Path(self.tls_dir, f"{self.tls_cert or 'worker'}.pem")
        try:
            return identity_of(path.read_bytes())
        except OSError as exc:
            raise CertError(f"cannot read {path}: {exc.strerror}") from exc

    def certificate_worker_id(self) -> str:
        """The worker id the TLS certificate binds (module docstring), or "" (no TLS, no
        ``tls_cert``, or a role certificate). CertError when it cannot be read."""
        if not self.tls_cert:
            return ""
        ident = self.certificate_identity()
        if ident is None or ident.role != "worker" or ident.name == SHARED_NAME:
            return ""
        return ident.name

    def resolved_worker_id(self) -> str:
        """The instance id: the configured one, else the certificate's instance name,
        else a fresh random one per launch."""
        if not self.worker_id:
            self.worker_id = (self.certificate_worker_id()
                              or f"worker-{uuid.uuid4().hex[:12]}")
        return self.worker_id
