"""etcd over mTLS, and etcd's users and roles for the mesh's identities.

Contract:

- Endpoints: ``https://host:port`` is an etcd that requires mTLS (``kvmesh up`` starts one
  when the mesh has certificates: :func:`services.common.procs.etcd_argv` with a
  ``tls_dir``); ``host:port`` (or ``http://host:port``) is plaintext.
  :func:`parse_endpoint` → (host, port, tls?).
- :class:`SecureEtcdClient` is an ``aetcd.Client`` whose ``connect()`` opens a
  ``grpc.aio.secure_channel`` with the process's :class:`MeshTls` (its certificate as the
  client certificate, the mesh CA as the only trust root, target name
  ``etcd.kvmesh.mesh``: only etcd's certificate is accepted) instead of aetcd's insecure
  channel; no
  token, no password: etcd (``--client-cert-auth``) takes the user name from the
  certificate's CN.
- Identity → etcd user: the user is the certificate's CN, which :func:`tls.issue` sets to
  the identity's name: the role for a role certificate (``router``), the instance name
  for an instance certificate (``worker:prefill-0`` → ``prefill-0``). etcd sees nothing
  else of a certificate, so :func:`plan` refuses two identities that share a CN, and an
  identity named ``root``.
- What each identity may do (:func:`plan`, pure), under ``/<ns>/instances/``:

  ========================================  ==============================================
  identity                                  etcd permissions
  ========================================  ==============================================
  admin (any name)                          the ``root`` role (everything, auth included)
  frontend, router, indexer, planner,       read the prefix; read-write its component's
  store_master, encoder (any name)          prefix ``/<ns>/instances/<role>/``
  worker instance ``worker:<id>``           read the prefix; read-write exactly
                                            ``/<ns>/instances/worker/<id>``
  fleet certificate ``worker:fleet[-<x>]``  the same, and the prefix
                                            ``/<ns>/instances/worker/<id>.`` (its
                                            sub-ids: a mock fleet's workers)
  worker role certificate (``worker``),     read the prefix only
  store_client
  etcd, redis (servers)                     no user
  ========================================  ==============================================

  A worker registers under its worker id, so with etcd auth on a worker needs an
  instance certificate ``worker:<name>`` that may act as its id
  (:func:`services.common.worker_ids.may_act_as`: ``<name>`` itself, or, for a fleet
  certificate only (:func:`~services.common.worker_ids.has_sub_ids`: ``fleet`` or
  ``fleet-<x>``), a sub-id ``<name>.<suffix>`` as a mock fleet's workers are;
  ``workers.config`` refuses any other id); every other worker instance certificate
  (``decode-0``, ``w0``) gets exactly its one key, so a compromised worker cannot
  register extra records. The shared ``worker`` certificate can watch but not register.
  etcd grants a prefix, so a fleet's ``<name>.`` also covers keys the rule refuses
  (``<name>.x.y``, ``<name>.x/y``), all still under that identity's own name, and
  indexers drop events signed for such ids. A worker instance name with a ``.`` is
  refused (ValueError naming it), so no identity's sub-ids are another's id. These keys
  are all the mesh writes to etcd (discovery records; the planner's desired counts are
  in its own record). Leases need no grant: etcd 3.4 lets any user grant and keep alive
  a lease, and checks revoke, and a put under a lease, against the keys attached to it.
- :func:`provision` applies a plan as the admin identity over the secure channel, and
  enables auth: it creates the ``root`` role and user (no password) and grants the
  ``root`` role to each admin user, so the admin certificate (CN ``admin``) acts as root.
  Users get no password (``no_password``): only a certificate names them. Roles are
  ``<ns>/read``, ``<ns>/<component>`` and ``<ns>/worker/<id>``. It is idempotent (an
  existing user or role is kept, grants are repeated) and may run again once auth is on,
  to add identities (a worker the planner starts). It is synchronous (plain gRPC), for
  ``kvmesh up`` and threads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import aetcd
import grpc
from aetcd import rpc, watcher

from services.common.tls import CertError, Identity, MeshTls, channel_options, identity_of
from services.common.worker_ids import SEPARATOR, has_sub_ids

log = logging.getLogger(__name__)

ROOT = "root"
READ, WRITE, READWRITE = 0, 1, 2  # authpb.Permission.Type
COMPONENT_WRITERS = ("frontend", "router", "indexer", "planner", "store_master", "encoder")
READERS = ("worker", "store_client")
NO_USER = ("etcd", "redis")
HTTPS = "https://"
RETRY = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def parse_endpoint(endpoint: str) -> tuple[str, int, bool]:
    """``[https://|http://]host:port`` → (host, port, tls). ValueError names the field."""
    tls = endpoint.startswith(HTTPS)
    rest = endpoint.removeprefix(HTTPS).removeprefix("http://")
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"etcd_endpoint must be [https://]host:port, got {endpoint!r}")
    return host, int(port), tls


def prefix_end(prefix: bytes) -> bytes:
    """etcd's range end of every key starting with ``prefix``."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


@dataclass(frozen=True)
class Grant:
    """One permission: ``key`` alone (``range_end`` b"") or the range [key, range_end)."""

    perm: int
    key: bytes
    range_end: bytes = b""


@dataclass
class UserPlan:
    """An etcd user (a certificate's CN) and its roles (name → grants; ``root``: none)."""

    user: str
    identity: Identity
    roles: dict[str, list[Grant]] = field(default_factory=dict)


def user_of(identity: Identity) -> str:
    """The etcd user of a certificate: its CN, i.e. the identity's name."""
    return identity.name


def plan(namespace: str, identities: Iterable[Identity]) -> list[UserPlan]:
    """The users and roles of ``identities`` in ``namespace`` (module docstring). Raises
    ValueError naming both identities when two share an etcd user, or one is ``root``."""
    base = f"/{namespace}/instances/".encode()
    read = (f"{namespace}/read", [Grant(READ, base, prefix_end(base))])
    out: dict[str, UserPlan] = {}
    for ident in sorted(set(identities), key=str):
        if ident.role in NO_USER:
            continue
        user = user_of(ident)
        if user == ROOT:
            raise ValueError(f"identity {ident}: the name 'root' is etcd's own superuser")
        if user in out:
            raise ValueError(f"identities {out[user].identity} and {ident} are both etcd user "
                             f"{user!r} (etcd knows a certificate only by its CN)")
        up = out[user] = UserPlan(user, ident)
        if ident.role == "admin":
            up.roles[ROOT] = []
            continue
        up.roles[read[0]] = read[1]
        if ident.role in COMPONENT_WRITERS:
            own = base + f"{ident.role}/".encode()
            up.roles[f"{namespace}/{ident.role}"] = [Grant(READWRITE, own, prefix_end(own))]
        elif ident.role == "worker" and ident.name != ident.role:
            if SEPARATOR in ident.name:
                raise ValueError(f"identity {ident}: a worker instance name has no "
                                 f"{SEPARATOR!r} (it separates sub-ids, "
                                 f"services.common.worker_ids)")
            key = base + f"worker/{ident.name}".encode()
            grants = [Grant(READWRITE, key)]
            if has_sub_ids(ident.name):  # a fleet certificate: its workers' sub-ids too
                subs = key + SEPARATOR.encode()
                grants.append(Grant(READWRITE, subs, prefix_end(subs)))
            up.roles[f"{namespace}/worker/{ident.name}"] = grants
        elif ident.role not in READERS:
            raise ValueError(f"identity {ident}: role {ident.role!r} has no etcd permissions")
    return list(out.values())


def identities_in(tls_dir: Path | str) -> list[Identity]:
    """The identities of every certificate in a mesh certificate folder (not the CA)."""
    out = []
    for path in sorted(Path(tls_dir).glob("*.pem")):
        if path.name == "ca.pem" or path.name.endswith("-key.pem"):
            continue
        try:
            out.append(identity_of(path.read_bytes()))
        except CertError as exc:
            raise CertError(f"{path}: {exc}") from exc
    return out


def _exists(exc: grpc.RpcError) -> bool:
    return exc.code() == grpc.StatusCode.FAILED_PRECONDITION and "already exists" in str(
        exc.details())


class EtcdAuthError(RuntimeError):
    """Provisioning etcd's users and roles failed."""


def provision(endpoint: str, admin: MeshTls, namespace: str, identities: Iterable[Identity],
              timeout_s: float = 20.0) -> list[UserPlan]:
    """Creates the users and roles of :func:`plan` as ``admin`` (an admin certificate)
    and enables auth; returns the plan. Waits up to ``timeout_s`` for etcd to answer;
    raises EtcdAuthError naming the step that failed."""
    if admin.identity.role != "admin":
        raise EtcdAuthError(f"provision needs an admin certificate, got {admin.identity}")
    host, port, tls = parse_endpoint(endpoint)
    if not tls:
        raise EtcdAuthError(f"etcd_endpoint {endpoint!r}: auth by certificate needs an "
                            f"https:// etcd")
    users = plan(namespace, [admin.identity, *identities])
    with grpc.secure_channel(f"{host}:{port}", admin.channel_credentials(),
                             options=channel_options("etcd")) as ch:
        stub = rpc.AuthStub(ch)
        step = ""
        deadline = time.monotonic() + timeout_s

        def call(what: str, method: str, request: object) -> None:
            nonlocal step
            step = what
            while True:
                try:
                    getattr(stub, method)(request, timeout=timeout_s)
                    return
                except grpc.RpcError as exc:
                    if _exists(exc):
                        return
                    # A fresh member may answer before it has a leader.
                    if exc.code() not in RETRY or time.monotonic() > deadline:
                        raise
                time.sleep(0.1)

        try:
            roles = {ROOT: [], **{r: g for u in users for r, g in u.roles.items()}}
            for role, grants in roles.items():
                call(f"role add {role}", "RoleAdd", rpc.AuthRoleAddRequest(name=role))
                for g in grants:
                    call(f"grant {role} {g.key!r}", "RoleGrantPermission",
                         rpc.AuthRoleGrantPermissionRequest(name=role, perm=rpc.Permission(
                             permType=g.perm, key=g.key, range_end=g.range_end)))
            for u in [UserPlan(ROOT, Identity("admin", ROOT), {ROOT: []}), *users]:
                call(f"user add {u.user}", "UserAdd", rpc.AuthUserAddRequest(
                    name=u.user, options=rpc.UserAddOptions(no_password=True)))
                for role in u.roles:
                    call(f"grant role {role} to {u.user}", "UserGrantRole",
                         rpc.AuthUserGrantRoleRequest(user=u.user, role=role))
            call("auth enable", "AuthEnable", rpc.AuthEnableRequest())
        except grpc.RpcError as exc:
            raise EtcdAuthError(f"etcd auth provisioning at {endpoint}: {step}: "
                                f"{exc.code().name} {exc.details()}") from exc
    log.info("etcd auth on at %s: %d user(s) for namespace %s", endpoint, len(users),
             namespace)
    return users


def permission_denied(exc: BaseException) -> bool:
    """True for etcd's PERMISSION_DENIED (aetcd raises it as a bare ClientError)."""
    cause = exc if isinstance(exc, grpc.RpcError) else exc.__cause__
    code = getattr(cause, "code", None)
    return callable(code) and code() == grpc.StatusCode.PERMISSION_DENIED


class SecureEtcdClient(aetcd.Client):
    """An aetcd client over mTLS (module docstring); every other method is aetcd's."""

    def __init__(self, host: str, port: int, tls: MeshTls, **kwargs: object) -> None:
        super().__init__(host=host, port=port, **kwargs)  # type: ignore[arg-type]
        self._tls = tls

    async def connect(self) -> None:
        """aetcd's connect, on a secure channel (no token: the certificate names the
        user)."""
        if self._connected.is_set():
            return
        if self._is_connecting:  # type: ignore[has-type]
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        self._is_connecting = True
        try:
            self.channel = grpc.aio.secure_channel(
                f"{self._host}:{self._port}", self._tls.channel_credentials(),
                options=[*self._options.items(), *channel_options("etcd")])
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = watcher.Watcher(rpc.WatchStub(self.channel),
                                            timeout=self._timeout, metadata=None)
            self._connected.set()
        finally:
            self._is_connecting = False


def enroll_worker(tls_dir: Path | str, endpoint: str, namespace: str, name: str,
                  dest: Path | str) -> dict[str, str]:
    """For a worker started later (the planner's local actuator): issues its instance
    certificate ``worker:<name>`` into ``tls_dir`` (the planner's privileged folder: its
    CA key signs it; an existing one is kept), adds its etcd user as the folder's admin
    certificate when ``endpoint`` is https, then copies that identity alone into ``dest``
    (a folder the caller owns; :func:`services.common.tls.export_identity`, mode 0700):
    ``ca.pem``, ``worker-<name>.pem`` and its key, ``worker-<name>.evkey`` and
    ``redis-worker.pass``, never the CA key, the admin certificate, ``events.key`` or
    another identity's files. Returns the worker's ``KVMESH_*`` settings: tls dir
    ``dest``, its certificate and worker id.

    The mesh's secrets are required, never created (a fresh ``events.key`` would make the
    worker's events look forged, a fresh ``redis-worker.pass`` fail its Redis login):
    CertError naming each missing file when ``tls_dir`` lacks ``ca.pem``,
    ``ca-key.pem``, ``events.key`` or ``redis-worker.pass``, or (https etcd) ``admin.pem`` /
    ``admin-key.pem`` (a read-only certificate volume: issue ``worker:<name>`` with
    ``kvmesh certs`` instead)."""
    from services.common.tls import (
        EVENTS_KEY,
        export_identity,
        redis_password_file,
        write_mesh_certs,
    )

    folder = Path(tls_dir)
    https = parse_endpoint(endpoint)[2]
    needed = ["ca.pem", "ca-key.pem", EVENTS_KEY, redis_password_file("worker"),
              *(("admin.pem", "admin-key.pem") if https else ())]
    missing = [p for p in needed if not (folder / p).is_file()]
    if missing:
        raise CertError(f"tls_dir {folder}: cannot enroll worker {name!r} without "
                        f"{', '.join(missing)}")
    stem = f"worker-{name}"
    try:
        write_mesh_certs(folder, [f"worker:{name}"])
    except OSError as exc:
        raise CertError(f"tls_dir {folder}: cannot write {stem}.pem: {exc}") from exc
    if https:
        ident = identity_of((folder / f"{stem}.pem").read_bytes())
        provision(endpoint, MeshTls.load(folder, "admin"), namespace, [ident])
    try:
        own = export_identity(folder, Path(dest), stem)
    except OSError as exc:
        raise CertError(f"cannot copy {stem} into {dest}: {exc}") from exc
    return {"KVMESH_TLS_DIR": str(own), "KVMESH_INSECURE": "0",
            "KVMESH_TLS_CERT": stem, "KVMESH_WORKER_ID": name}
