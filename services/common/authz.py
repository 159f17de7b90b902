"""Authorization by role: one gRPC server interceptor for every kvmesh service.

Contract:

- A caller's role is read from its verified client certificate (the TLS layer has
  already checked it against the mesh CA): the SAN URI ``spiffe://kvmesh/<role>/<name>``
  (:func:`services.common.tls.identity_of`). A method whose entry is ``public`` needs
  none (the servicer authenticates the user: the Frontend API's API keys). Otherwise no
  certificate, or one naming no kvmesh role: UNAUTHENTICATED. A role the method's entry
  does not list: PERMISSION_DENIED with the method and the role in the message. A method
  missing from :data:`POLICY`: PERMISSION_DENIED (fail closed). Every refusal is logged
  (once per method, role and code) and counted in :attr:`AuthzInterceptor.refused`.
- During an allowed call, :func:`caller` returns the caller's :class:`Identity` (a
  contextvar the interceptor sets), so a servicer can check ownership (the store master
  binds a segment to the identity that mounted it). Without the interceptor (insecure
  mode) it returns None.
- The table (``*`` = any authenticated role; "health/reflection" = the standard
  ``grpc.health.v1.Health`` and ``grpc.reflection.v1alpha.ServerReflection``):

  ================================  =============================================
  method                            roles
  ================================  =============================================
  Worker.Generate / Abort /         frontend
  GenerateMux
  Worker.GetLoad                    router, planner, admin
  Worker.GetKvState                 router, indexer, admin
  Router.Route / Release /          frontend
  PrefillDone / ReportFailure
  Router.ListWorkers                frontend, planner, admin
  Indexer.FindMatches               router
  Indexer.Stats                     router, planner, admin
  Indexer.Dump                      admin
  Encoder.Encode                    frontend, router
  Encoder.Stats                     frontend, router, admin
  StoreMaster.Put* / Get* / Exist*  worker, store_client (Batch* alike)
  / SetPin / Ping / Batch*
  StoreMaster.MountSegment          worker, store_client (owner recorded)
  StoreMaster.UnmountSegment        worker, store_client (owner only, in servicer)
  StoreMaster.Stats                 worker, store_client, planner, admin
  StoreMaster.Remove / RemoveAll    admin
  Frontend.*                        public (users: API keys, checked by the servicer)
  health, reflection                *
  ================================  =============================================
"""

from __future__ import annotations

import contextvars
import logging
from collections import Counter
from collections.abc import Mapping
from typing import Any

import grpc

from services.common import grpc_streams
from services.common.tls import CertError, Identity, identity_of

log = logging.getLogger(__name__)

ANY = "*"
PUBLIC = "public"  # no certificate needed: the servicer authenticates (API keys)
_STORE_DATA = ("worker", "store_client")

POLICY: dict[str, tuple[str, ...]] = {
    "/kvmesh.worker.Worker/Generate": ("frontend",),
    "/kvmesh.worker.Worker/GenerateMux": ("frontend",),
    "/kvmesh.worker.Worker/Abort": ("frontend",),
    "/kvmesh.worker.Worker/GetLoad": ("router", "planner", "admin"),
    "/kvmesh.worker.Worker/GetKvState": ("router", "indexer", "admin"),
    "/kvmesh.router.Router/Route": ("frontend",),
    "/kvmesh.router.Router/Release": ("frontend",),
    "/kvmesh.router.Router/PrefillDone": ("frontend",),
    "/kvmesh.router.Router/ReportFailure": ("frontend",),
    "/kvmesh.router.Router/ListWorkers": ("frontend", "planner", "admin"),
    "/kvmesh.indexer.Indexer/FindMatches": ("router",),
    "/kvmesh.indexer.Indexer/Stats": ("router", "planner", "admin"),
    "/kvmesh.indexer.Indexer/Dump": ("admin",),
    "/kvmesh.encoder.Encoder/Encode": ("frontend", "router"),
    "/kvmesh.encoder.Encoder/Stats": ("frontend", "router", "admin"),
    **{f"/kvmesh.store.StoreMaster/{m}": _STORE_DATA for m in (
        "PutStart", "PutEnd", "PutRevoke", "GetReplicaList", "ExistKey", "BatchExistKey",
        "SetPin", "Ping", "BatchPutStart", "BatchPutEnd", "BatchPutRevoke",
        "BatchGetReplicaList", "MountSegment", "UnmountSegment")},
    "/kvmesh.store.StoreMaster/Stats": (*_STORE_DATA, "planner", "admin"),
    "/kvmesh.store.StoreMaster/Remove": ("admin",),
    "/kvmesh.store.StoreMaster/RemoveAll": ("admin",),
    "/kvmesh.frontend.Frontend/Generate": (PUBLIC,),
    "/kvmesh.frontend.Frontend/ListModels": (PUBLIC,),
}
# Services open to any authenticated caller (to anyone on a user-facing port, whose TLS
# asks for no client certificate: the frontend's).
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                 "/grpc.reflection.v1.ServerReflection/")

_caller: contextvars.ContextVar[Identity | None] = contextvars.ContextVar(
    "kvmesh_caller", default=None)


def caller() -> Identity | None:
    """The identity of the current RPC's caller (None without the interceptor)."""
    return _caller.get()


def allowed_roles(method: str, policy: Mapping[str, tuple[str, ...]] = POLICY,
                  user_facing: bool = False) -> tuple[str, ...]:
    """The roles that may call ``method`` (``("*",)`` for any authenticated caller,
    ``("public",)`` for anyone); empty = nobody. On a ``user_facing`` port health and
    reflection are public."""
    if method.startswith(OPEN_PREFIXES):
        return (PUBLIC,) if user_facing else (ANY,)
    return policy.get(method, ())


def decide(method: str, identity: Identity | None,
           policy: Mapping[str, tuple[str, ...]] = POLICY,
           user_facing: bool = False) -> tuple[grpc.StatusCode, str] | None:
    """None when ``identity`` may call ``method``, else (status, message)."""
    roles = allowed_roles(method, policy, user_facing)
    if PUBLIC in roles:
        return None
    if identity is None:
        return (grpc.StatusCode.UNAUTHENTICATED,
                f"{method}: no kvmesh client certificate (role unknown)")
    if ANY in roles or identity.role in roles:
        return None
    allowed = ", ".join(roles) or "nobody"
    return (grpc.StatusCode.PERMISSION_DENIED,
            f"{method}: role {identity.role!r} ({identity}) may not call it (allowed: "
            f"{allowed})")


def identity_from_auth_context(auth: Mapping[str, Any]) -> Identity | None:
    """The caller's identity from ``context.auth_context()`` (its ``x509_pem_cert``)."""
    pems = auth.get("x509_pem_cert") or []
    if not pems:
        return None
    try:
        return _identity_cached(bytes(pems[0]))
    except CertError:
        return None


_cache: dict[bytes, Identity] = {}
_CACHE_MAX = 4096


def _identity_cached(pem: bytes) -> Identity:
    found = _cache.get(pem)
    if found is None:
        found = identity_of(pem)
        if len(_cache) >= _CACHE_MAX:
            _cache.clear()
        _cache[pem] = found
    return found


class AuthzInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Checks every call against :data:`POLICY`; see the module docstring."""

    def __init__(self, policy: Mapping[str, tuple[str, ...]] = POLICY,
                 user_facing: bool = False) -> None:
        self._policy = policy
        self._user_facing = user_facing
        self.refused: Counter[tuple[str, str, str]] = Counter()

    def _refuse(self, method: str, identity: Identity | None, code: grpc.StatusCode,
                message: str) -> None:
        key = (method, identity.role if identity else "", code.name)
        if not self.refused[key]:
            log.warning("refused %s", message)
        self.refused[key] += 1

    async def _check(self, method: str, context: Any) -> None:
        identity = identity_from_auth_context(context.auth_context())
        verdict = decide(method, identity, self._policy, self._user_facing)
        if verdict is not None:
            self._refuse(method, identity, *verdict)
            await context.abort(*verdict)
        _caller.set(identity)

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        method: str = details.method
        check = self._check

        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _unary(check, method, handler.unary_unary),
                handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _streaming(check, method, handler.unary_stream),
                handler.request_deserializer, handler.response_serializer)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                _unary(check, method, handler.stream_unary),
                handler.request_deserializer, handler.response_serializer)
        return grpc.stream_stream_rpc_method_handler(
            _streaming(check, method, handler.stream_stream),
            handler.request_deserializer, handler.response_serializer)


def _unary(check: Any, method: str, behavior: Any) -> Any:
    """Wraps a handler with one response (its request a message or a stream)."""
    async def wrapped(request: Any, context: Any) -> Any:
        await check(method, context)
        return await behavior(request, context)
    return wrapped


def _streaming(check: Any, method: str, behavior: Any) -> Any:
    """Wraps a response-streaming handler (an async generator, or a coroutine that writes
    with ``context.write`` as the health service's Watch)."""
    async def wrapped(request: Any, context: Any) -> Any:
        await check(method, context)
        result = grpc_streams.opened(behavior(request, context))
        if hasattr(result, "__aiter__"):
            async for item in result:
                yield item
        else:
            await result
    return wrapped
