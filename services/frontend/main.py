"""Frontend process wiring: etcd watches → catalog + router address → HTTP and gRPC APIs.

API keys (:mod:`.auth`): ``--api-key K`` (repeatable) and ``--api-keys K1,K2`` /
``KVMESH_API_KEYS`` (each key its own tenant), ``--api-key-file`` / ``KVMESH_API_KEY_FILE``
(``key [tenant]`` lines); a bad file or key is a config error naming it (exit 2). With no
key the APIs are open and one warning says so at start. ``--metrics-auth`` puts
``/metrics`` behind the keys too (default: open, like ``/health``, for scrapers on the
private network). ``--shared-prefix-cache`` lets all tenants share one prefix cache
(salt ""); the default isolates each tenant.

Images (EPD): ``--max-images`` per request, ``--max-image-bytes`` per file and
``--max-pixels`` per image (:class:`~services.encoder.images.ImageLimits`, the checks the
encoder applies too), and ``--encode-timeout-s`` for the encoder's Encode call (past it,
the worker encodes the images itself). Remote (http/https) image URLs are refused (400)
unless ``--allow-remote-images`` (``KVMESH_ALLOW_REMOTE_IMAGES``); then the frontend
fetches them (:mod:`~services.frontend.remote_images`) within
``--remote-image-max-bytes`` per body and ``--remote-image-timeout-s`` per fetch.

Responses API storage (:mod:`~services.frontend.responses_store`): up to
``--responses-store-size`` objects (``KVMESH_RESPONSES_STORE_SIZE``; 0 stores nothing, and
``store: true`` is then a 400), ``--responses-store-mib`` in all, each kept
``--responses-store-ttl-s`` at most, per tenant, in this frontend's memory (not shared
between frontends, lost on restart).

Tokenizers run on the threads that call them (``TOKENIZERS_PARALLELISM=false``, unless
set: :func:`~services.frontend.models.tokenize_on_calling_threads`).

Routing: ``--router standalone`` (default) calls the router at ``--router-address`` or the
first one in etcd; ``--router embedded`` (``KVMESH_ROUTER``) starts a router in this
process (:mod:`services.router.embedded`, configured by ``--router-args``, e.g. ``'--policy
kv --indexer embedded'``, which also embeds the KV index) and calls it without a channel.
It is stopped after the HTTP server. With ``--router-address`` it is a config error.

Replicas: ``--reuse-port`` binds the HTTP port with ``SO_REUSEPORT``, so several frontend
processes share it (the kernel spreads connections over them; ``kvmesh up --frontends
N``). Each replica also serves the same app on a port of its own (any free), and that one
is the ``http_address`` of its etcd record: a scraper reaches every replica's
``/metrics``, not whichever the kernel picks. With embedded routers, give each
``--router-args '... --replica-sync'`` (:mod:`services.router.replica_sync`) so that each
counts the others' in-flight requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import shlex
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import uvicorn

from protos import discovery_pb2, frontend_pb2, frontend_pb2_grpc
from services.common.config import BaseConfig, ConfigError, load_config
from services.common.discovery import InstanceWatcher
from services.common.server import MeshServer, ServiceSpec, serve_main
from services.common.tls import tls_for
from services.encoder.images import ImageFlags
from services.frontend import tool_chat
from services.frontend.auth import ApiKeys, KeyFileError, merge_api_key_flags
from services.frontend.http_api import HttpLimits, create_app
from services.frontend.http_server import http_config
from services.frontend.models import ModelCatalog, tokenize_on_calling_threads
from services.frontend.pipeline import (
    DEFAULT_ENCODE_TIMEOUT_S,
    DEFAULT_MIGRATION_LIMIT,
    Pipeline,
)
from services.frontend.remote_images import RemoteImageLimits
from services.frontend.responses_store import ResponseStore
from services.frontend.service import FrontendServicer
from services.router.embedded import EmbeddedRouter, start_embedded_router
from services.router.main import RouterConfig

log = logging.getLogger(__name__)

@dataclasses.dataclass
class FrontendConfig(BaseConfig, ImageFlags):
    """kvmesh frontend: OpenAI HTTP API and gRPC API."""

    http_host: str = dataclasses.field(default="127.0.0.1", metadata={"help": "HTTP bind host"})
    http_port: int = dataclasses.field(default=8000, metadata={"help": "HTTP port (0 = any)"})
    router_address: str = dataclasses.field(
        default="", metadata={"help": "router host:port (default: discover in etcd)"}
    )
    router: str = dataclasses.field(
        default="standalone", metadata={
            "help": "standalone: call a router process over gRPC; embedded: run the router "
                    "in this process (services.router.embedded) with --router-args",
            "choices": ("standalone", "embedded")}
    )
    router_args: str = dataclasses.field(
        default="", metadata={"help": "the embedded router's flags, as for `kvmesh router` "
                                      "(e.g. '--policy kv --indexer embedded'); etcd, "
                                      "namespace, Redis, TLS and logging are this "
                                      "frontend's"}
    )
    max_body_mib: float = dataclasses.field(
        default=4.0, metadata={"help": "largest HTTP request body in MiB (larger: 413)"}
    )
    body_timeout_s: float = dataclasses.field(
        default=30.0, metadata={"help": "an HTTP body not received within this: 408"}
    )
    max_connections: int = dataclasses.field(
        default=2048, metadata={"help": "concurrent HTTP connections + requests beyond "
                                        "which new ones get 503"}
    )
    header_timeout_s: float = dataclasses.field(
        default=10.0, metadata={"help": "a connection whose first request headers are not "
                                        "complete after this many seconds is closed"}
    )
    reuse_port: bool = dataclasses.field(
        default=False, metadata={"help": "share --http-port with other frontend replicas "
                                         "(SO_REUSEPORT); this one is also served on a port "
                                         "of its own, advertised in etcd"}
    )
    keep_alive_s: int = dataclasses.field(
        default=5, metadata={"help": "an idle keep-alive HTTP connection is closed after "
                                     "this many seconds"}
    )

    migration_limit: int = dataclasses.field(
        default=DEFAULT_MIGRATION_LIMIT, metadata={
            "help": "times one request may move to another worker after a worker failure "
                    "(re-sending prompt + tokens so far); 0: never"}
    )

    worker_transport: str = dataclasses.field(
        default="tcp", metadata={
            "help": "tcp: the calls to each worker multiplexed on one TCP connection to "
                    "its request plane (least CPU; services.frontend.request_plane), on "
                    "its GenerateMux where it has none; stream: on one long-lived "
                    "GenerateMux (services.frontend.worker_stream); call: one gRPC "
                    "Generate call per worker call",
            "choices": ("call", "stream", "tcp")}
    )

    first_token_from_prefill: bool = dataclasses.field(
        default=True, metadata={
            "help": "pull P/D: send P's sampled token as the first token and let D continue "
                    "after it (TTFT is P's; D computes the second token instead of "
                    "recomputing the first), where the sampling allows; false: D "
                    "generates every token"}
    )

    api_keys: str = dataclasses.field(
        default="", metadata={"help": "comma-separated API keys clients send as "
                                      "'Authorization: Bearer <key>' (also --api-key K, "
                                      "repeatable); each key is its own tenant. None and "
                                      "no --api-key-file: the API is open"}
    )
    api_key_file: str = dataclasses.field(
        default="", metadata={"help": "file of 'key [tenant]' lines (# comments): keys "
                                      "sharing a tenant share its prefix cache"}
    )
    metrics_auth: bool = dataclasses.field(
        default=False, metadata={"help": "require an API key for /metrics too"}
    )
    metrics_api_keys: str = dataclasses.field(
        default="", metadata={"help": "comma-separated keys that may read /metrics and "
                                      "nothing else (a planner's), with --metrics-auth"}
    )
    shared_prefix_cache: bool = dataclasses.field(
        default=False, metadata={"help": "all tenants share one prefix cache (opt-in: "
                                         "cached_tokens then reveals other tenants' "
                                         "prompts)"}
    )
    encode_timeout_s: float = dataclasses.field(
        default=DEFAULT_ENCODE_TIMEOUT_S,
        metadata={"help": "longest wait for the encoder's embeddings (then the worker "
                          "encodes the images itself)"}
    )
    allow_remote_images: bool = dataclasses.field(
        default=False, metadata={"help": "fetch http(s) image URLs (opt-in: clients can then "
                                         "make the frontend GET any address it reaches)"}
    )
    remote_image_max_bytes: int = dataclasses.field(
        default=16 << 20, metadata={"help": "bytes per fetched image body at most"}
    )
    remote_image_timeout_s: float = dataclasses.field(
        default=10.0, metadata={"help": "longest time for one remote image fetch "
                                        "(redirects and body included)"}
    )

    responses_store_size: int = dataclasses.field(
        default=10000, metadata={"help": "Responses API objects kept for GET and "
                                         "previous_response_id (least recently used "
                                         "evicted); 0: store nothing (store: true is a 400)"}
    )
    responses_store_mib: float = dataclasses.field(
        default=256.0, metadata={"help": "MiB of stored Responses API objects and their "
                                         "prompts at most"}
    )
    responses_store_ttl_s: float = dataclasses.field(
        default=86400.0, metadata={"help": "seconds a stored Responses API object is kept "
                                           "at most"}
    )

    def responses_store(self) -> ResponseStore | None:
        """The configured store (None with ``responses_store_size`` 0)."""
        if self.responses_store_size == 0:
            return None
        return ResponseStore(self.responses_store_size,
                             int(self.responses_store_mib * (1 << 20)),
                             self.responses_store_ttl_s, time.monotonic)

    def remote_image_limits(self) -> RemoteImageLimits:
        return RemoteImageLimits(self.remote_image_max_bytes, self.remote_image_timeout_s)

    def load_api_keys(self) -> ApiKeys:
        """The configured keys (KeyFileError / OSError for a bad key or file)."""
        text = Path(self.api_key_file).read_text() if self.api_key_file else None
        try:
            return ApiKeys.from_sources(self.api_keys, text, shared=self.shared_prefix_cache)
        except KeyFileError as exc:
            where = f"api_key_file {self.api_key_file}" if self.api_key_file else "api_keys"
            raise KeyFileError(f"{where}: {exc}") from None

    def embedded_router_config(self) -> RouterConfig:
        """The embedded router's config: ``router_args`` plus this frontend's etcd,
        namespace, Redis, host, lease, grace, logging and TLS (a free gRPC port; no
        ``KVMESH_*`` variable of this process: they are the frontend's). ConfigError
        naming ``router_args`` when they are bad."""
        shared = ["--namespace", self.namespace, "--etcd-endpoint", self.etcd_endpoint,
                  "--redis-url", self.redis_url, "--host", self.host,
                  "--advertise-host", self.advertise_host,
                  "--lease-ttl", str(self.lease_ttl), "--grace-s", str(self.grace_s),
                  "--log-level", self.log_level, "--tls-dir", self.tls_dir,
                  "--insecure", str(self.insecure).lower(), "--port", "0"]
        try:
            return load_config(RouterConfig, [*shared, *shlex.split(self.router_args)], {})
        except (ConfigError, ValueError) as exc:
            raise ConfigError(f"router_args {self.router_args!r}: {exc}") from None

    def http_limits(self) -> HttpLimits:
        return HttpLimits(max_body_bytes=int(self.max_body_mib * (1 << 20)),
                          body_timeout_s=self.body_timeout_s)

    def problems(self) -> list[str]:
        out = super().problems()
        if not 0 <= self.http_port <= 65535:
            out.append(f"http_port out of range: {self.http_port}")
        for name in ("max_body_mib", "body_timeout_s", "header_timeout_s", "keep_alive_s"):
            if not getattr(self, name) > 0:
                out.append(f"{name} must be > 0, got {getattr(self, name)}")
        if self.migration_limit < 0:
            out.append(f"migration_limit must be >= 0, got {self.migration_limit}")
        if self.max_connections < 1:
            out.append(f"max_connections must be >= 1, got {self.max_connections}")
        if self.responses_store_size < 0:
            out.append(f"responses_store_size must be >= 0, got {self.responses_store_size}")
        for name in ("responses_store_mib", "responses_store_ttl_s"):
            if not getattr(self, name) > 0:
                out.append(f"{name} must be > 0, got {getattr(self, name)}")
        if self.router == "embedded":
            if self.router_address:
                out.append("router_address is for --router standalone; --router embedded "
                           "runs its own")
            try:
                self.embedded_router_config()
            except ConfigError as exc:
                out.append(str(exc))
        elif self.router_args:
            out.append("router_args needs --router embedded")
        if not self.encode_timeout_s > 0:
            out.append(f"encode_timeout_s must be > 0, got {self.encode_timeout_s}")
        try:
            self.limits().validate()
            self.remote_image_limits().validate()
        except ValueError as exc:
            out.append(str(exc))
        try:
            self.load_api_keys()
        except (KeyFileError, OSError) as exc:
            out.append(str(exc) if isinstance(exc, KeyFileError)
                       else f"api_key_file {self.api_key_file}: {exc.strerror or exc}")
        return out


@dataclasses.dataclass
class FrontendApp:
    """A started frontend."""

    server: MeshServer
    pipeline: Pipeline
    http: uvicorn.Server
    http_port: int
    http_task: asyncio.Task[None]
    router: EmbeddedRouter | None = None  # with --router embedded

    @property
    def base_url(self) -> str:
        return f"http://{self.server.cfg.public_host}:{self.http_port}"


async def start_frontend(cfg: FrontendConfig) -> FrontendApp:
    """Builds and starts the frontend; stop it with ``app.server.stop()``."""
    catalog = ModelCatalog()
    tls = tls_for(cfg, "frontend")
    workers = InstanceWatcher(cfg.etcd_endpoint, cfg.namespace, "worker", tls=tls)
    workers.on_change(catalog.on_workers)
    routers = InstanceWatcher(cfg.etcd_endpoint, cfg.namespace, "router", tls=tls)
    await workers.start()
    await routers.start()

    def router_address() -> str | None:
        if cfg.router_address:
            return cfg.router_address
        live = sorted(routers.instances().values(), key=lambda r: r.instance_id)
        return live[0].address if live else None

    keys = cfg.load_api_keys()
    if not keys.enabled:
        log.warning("no API key configured (--api-key, KVMESH_API_KEYS, --api-key-file): "
                    "the frontend's HTTP and gRPC APIs are open to anyone who reaches them")
    embedded: EmbeddedRouter | None = None
    if cfg.router == "embedded":  # the router in this process, called without a channel
        embedded = await start_embedded_router(cfg.embedded_router_config())
    pipeline = Pipeline(catalog, router_address, migration_limit=cfg.migration_limit,
                        first_token_from_prefill=cfg.first_token_from_prefill,
                        worker_streams=cfg.worker_transport == "stream",
                        request_planes=cfg.worker_transport == "tcp",
                        router_stub=embedded.stub if embedded is not None else None,
                        tls=tls, image_limits=dataclasses.replace(
                            cfg.limits(), remote_urls=cfg.allow_remote_images),
                        encode_timeout_s=cfg.encode_timeout_s,
                        remote_images=cfg.remote_image_limits())
    sock = _listen(cfg.http_host, cfg.http_port, cfg.reuse_port)
    http_port = own_port = sock.getsockname()[1]
    sockets = [sock]
    if cfg.reuse_port:  # plus a port of this replica alone (module docstring)
        sockets.append(_listen(cfg.http_host, 0, False))
        own_port = sockets[1].getsockname()[1]
    app = create_app(pipeline, cfg.http_limits(), keys, metrics_auth=cfg.metrics_auth,
                     metrics_keys=ApiKeys.from_sources(cfg.metrics_api_keys),
                     responses_store=cfg.responses_store())
    http = uvicorn.Server(http_config(app,
                                      max_connections=cfg.max_connections,
                                      keep_alive_s=cfg.keep_alive_s,
                                      header_timeout_s=cfg.header_timeout_s,
                                      direct=app.direct_routes))
    http_task = asyncio.create_task(http.serve(sockets=sockets), name="http")

    async def stop_http() -> None:
        http.should_exit = True
        await http_task
        await pipeline.close()

    def record(address: str) -> discovery_pb2.InstanceRecord:
        return discovery_pb2.InstanceRecord(
            instance_id=f"frontend-{address}", component="frontend", address=address,
            http_address=f"{cfg.public_host}:{own_port}",
        )

    spec = ServiceSpec(frontend_pb2_grpc.add_FrontendServicer_to_server,
                       FrontendServicer(pipeline, keys),
                       frontend_pb2.DESCRIPTOR.services_by_name["Frontend"].full_name)
    # users reach the gRPC Frontend API with an API key, not a mesh certificate
    on_stop: list[Callable[[], Awaitable[None]]] = [stop_http, workers.close, routers.close]
    if embedded is not None:  # after the HTTP server: its last Releases go through it
        on_stop.append(embedded.stop)
    server = MeshServer(cfg, "frontend", [spec], record_factory=record,
                        on_stop=on_stop, client_auth=False)
    # vLLM's tool parser imports in 10-18 s: in a thread, so text requests do not wait
    # (a tools request that comes first waits for it, see tool_chat.WARMUP)
    tool_chat.WARMUP.start()
    await server.start()
    return FrontendApp(server, pipeline, http, http_port, http_task, embedded)


def _listen(host: str, port: int, reuse_port: bool) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``SO_REUSEPORT`` when ``reuse_port``)."""
    # proto=IPPROTO_TCP: asyncio only sets TCP_NODELAY on accepted sockets whose proto is
    # TCP; with the default 0 every response waited ~40 ms for the peer's delayed ACK.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(1024)
    return sock


async def _serve(cfg: FrontendConfig) -> MeshServer:
    app = await start_frontend(cfg)
    print(f"kvmesh frontend: HTTP {app.base_url}  gRPC {app.server.address}", flush=True)
    return app.server


def main(argv: Sequence[str] | None = None) -> int:
    tokenize_on_calling_threads()
    try:
        args = merge_api_key_flags(sys.argv[1:] if argv is None else argv)
    except KeyFileError as exc:
        print(f"api_keys: {exc}", file=sys.stderr)
        return 2
    return serve_main(FrontendConfig, args, "frontend", _serve)
