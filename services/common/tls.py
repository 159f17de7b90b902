"""The mesh's certificates: a CA, per-role certificates, and gRPC credentials from them.

Contract:

- Roles (:data:`ROLES`): frontend, router, indexer, worker, store_client, store_master,
  planner, admin, encoder (the E of EPD), and the infrastructure servers etcd and redis
  (their server certificates; :mod:`services.common.authz` grants them no kvmesh
  method). A certificate names its role twice: a SAN URI
  ``spiffe://kvmesh/<role>/<name>`` (:func:`spiffe_id`) and the subject's OU. Every leaf
  also carries the SANs that clients verify as the server name: DNS
  ``<role>.kvmesh.mesh`` (:func:`server_name`), :data:`MESH_SERVER_NAME`, ``localhost``
  and IP 127.0.0.1. Clients dial a mesh address with the expected server's role name as
  the TLS target name (:func:`channel_options`), so a certificate does not depend on the
  host a process runs on, and a server proves both that the mesh CA signed it and that
  it holds the role the client expects (a worker's certificate cannot pose as a router,
  nor the redis certificate as a worker). ``channel_options()`` (no role: plain
  :data:`MESH_SERVER_NAME`) accepts any mesh server, for tools.
- :func:`make_ca` / :func:`issue` generate keys (EC P-256) and certificates offline with
  ``cryptography`` (an instance name is neither a role's nor ``root``, and a worker
  instance name has no ``.``: it separates the sub-ids of
  :mod:`services.common.worker_ids`); :func:`write_mesh_certs` writes ``ca.pem``,
  ``ca-key.pem`` and, per role, ``<role>.pem`` + ``<role>-key.pem`` (keys mode 0600)
  into a folder, reusing an existing CA there (so new roles can be added) and never
  overwriting an existing role certificate unless ``force`` (or unless it lacks its
  role's server name: one issued before those existed is reissued).
- :func:`export_identity` copies one identity's files into a folder of its own: the CA
  certificate (never its key), the identity's certificate and key and the secrets its
  role reads (:data:`ROLE_SECRETS`), so a process is given only what it needs.
- Secrets, written by :func:`write_mesh_certs` next to the certificates (mode 0600):
  ``events.key`` (:data:`EVENTS_KEY`: the mesh's KV event secret, 32 random bytes, written
  once like the CA and read only by event consumers: the indexer, a router's embedded
  index); for each spec of a role in :data:`REDIS_ROLES` ``redis-<role>.pass``
  (:func:`redis_password_file`: that Redis ACL user's password, 64 hex characters, kept
  unless ``force``); and for each worker certificate (``worker`` or ``worker:<name>``)
  ``<stem>.evkey``, the worker's event signing key
  :func:`derive_event_key` (events secret, name) = HMAC-SHA256(secret,
  ``b"kvmesh-events/" + name``), so a consumer recomputes any worker's key from the
  secret and a worker holds only its own. An evkey is rewritten whenever it no longer
  matches the secret (it is derived, so this is idempotent).
- :func:`identity_of` reads (role, name) from a PEM certificate; a certificate without
  exactly one kvmesh SPIFFE URI, or with an unknown role, raises :class:`CertError`.
  :func:`verify_signed_by` checks a certificate against the CA (signature and validity).
- :class:`MeshTls` is one process's material: CA, its role's certificate and key, and
  where they came from (``folder``, ``stem``: its certificate is ``<stem>.pem``).
  :meth:`MeshTls.load` reads them from a folder (a missing file raises CertError naming
  it); :meth:`MeshTls.secret` reads a secret file of that folder (CertError naming a
  missing one); ``server_credentials()`` requires and verifies client certificates;
  ``channel_credentials()`` presents the role's certificate; :func:`channel_options`
  (the expected server's role) go with every TLS channel.
- :func:`tls_for(cfg, role)` is what services use: None when ``cfg.tls_dir`` is empty or
  ``cfg.insecure`` is set (the first such call logs one warning per process), else the
  MeshTls of ``cfg.tls_cert`` (a file stem such as ``worker-decode-0``) or of ``role``.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

log = logging.getLogger(__name__)

ROLES = ("frontend", "router", "indexer", "worker", "store_client", "store_master",
         "planner", "admin", "etcd", "redis", "encoder")
SPIFFE_PREFIX = "spiffe://kvmesh/"
MESH_SERVER_NAME = "kvmesh.mesh"
# The secrets each role reads (export_identity); "{stem}" is the identity's file stem.
ROLE_SECRETS: dict[str, tuple[str, ...]] = {
    "worker": ("{stem}.evkey", "redis-worker.pass"),
    "indexer": ("events.key", "redis-indexer.pass"),
    "router": ("events.key", "redis-router.pass"),
    "store_master": ("redis-store_master.pass",),
    "admin": ("redis-admin.pass",),
    "redis": ("redis-users.acl",),  # its ACL file (services.common.redis_acl)
}
VALID_DAYS = 825
CA_VALID_DAYS = 3650
# Roles that talk to Redis, each as an ACL user of its own (services.common.redis_acl).
REDIS_ROLES = ("worker", "indexer", "router", "store_master", "admin")
EVENTS_KEY = "events.key"
EVENT_KEY_SUFFIX = ".evkey"
EVENT_KEY_CONTEXT = b"kvmesh-events/"


class CertError(ValueError):
    """A certificate or key is missing, malformed, or not the mesh's."""


@dataclass(frozen=True)
class Identity:
    """Who a certificate names: its role and instance name."""

    role: str
    name: str

    def __str__(self) -> str:
        return f"{self.role}/{self.name}"


def server_name(role: str) -> str:
    """The DNS name a ``role`` server's certificate carries and its clients verify."""
    return f"{role}.{MESH_SERVER_NAME}"


def channel_options(server_role: str = "") -> list[tuple[str, str]]:
    """Channel options for a TLS channel to a ``server_role`` server (any mesh server
    when empty)."""
    return [("grpc.ssl_target_name_override",
             server_name(server_role) if server_role else MESH_SERVER_NAME)]


def spiffe_id(role: str, name: str) -> str:
    """``spiffe://kvmesh/<role>/<name>``."""
    return f"{SPIFFE_PREFIX}{role}/{name}"


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _pem_cert(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def make_ca(common_name: str = "kvmesh mesh CA") -> tuple[bytes, bytes]:
    """A self-signed CA: (certificate PEM, key PEM)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = _now()
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CA_VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                       critical=False)
        .sign(key, hashes.SHA256())
    )
    return _pem_cert(cert), _pem_key(key)


def issue(ca_cert_pem: bytes, ca_key_pem: bytes, role: str, name: str = "") -> tuple[bytes,
                                                                                    bytes]:
    """A leaf for ``role`` (instance ``name``, default the role) signed by the CA, usable
    as both server and client certificate: (certificate PEM, key PEM)."""
    if role not in ROLES:
        raise CertError(f"role: unknown {role!r}; one of {', '.join(ROLES)}")
    if name and (name in ROLES or name == "root") and name != role:
        # the CN is the etcd user: worker:router would be the router's user, x:root root
        raise CertError(f"name: {name!r} is reserved (a role's or etcd's root user name)")
    name = name or role
    if not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise CertError(f"name: {name!r} must be letters, digits, '-', '_' or '.'")
    if role == "worker" and "." in name:  # '.' separates sub-ids (services.common.worker_ids)
        raise CertError(f"name: {name!r}: a worker instance name has no '.' (worker "
                        f"{name.partition('.')[0]!r} would act as it)")
    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kvmesh"),
        x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
        x509.NameAttribute(NameOID.COMMON_NAME, name),
    ])
    sans: list[x509.GeneralName] = [
        x509.UniformResourceIdentifier(spiffe_id(role, name)),
        x509.DNSName(server_name(role)), x509.DNSName(MESH_SERVER_NAME),
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
    ]
    now = _now()
    cert = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(ca_cert.subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.ExtendedKeyUsage([x509.ExtendedKeyUsageOID.SERVER_AUTH,
                                              x509.ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
            ca_cert.public_key()), critical=False)  # type: ignore[arg-type]
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    return _pem_cert(cert), _pem_key(key)


def identity_of(cert_pem: bytes) -> Identity:
    """The (role, name) of a mesh certificate; CertError when it names none."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as exc:
        raise CertError(f"certificate: not PEM ({exc})") from exc
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound as exc:
        raise CertError("certificate: no subjectAltName (no kvmesh role)") from exc
    uris = [u for u in san.get_values_for_type(x509.UniformResourceIdentifier)
            if u.startswith(SPIFFE_PREFIX)]
    if len(uris) != 1:
        raise CertError(f"certificate: {len(uris)} kvmesh SPIFFE URIs, need exactly 1")
    role, _, name = uris[0][len(SPIFFE_PREFIX):].partition("/")
    if role not in ROLES or not name:
        raise CertError(f"certificate: {uris[0]!r} names no known role")
    return Identity(role, name)


def verify_signed_by(cert_pem: bytes, ca_cert_pem: bytes) -> None:
    """Raises CertError unless ``cert_pem`` is signed by the CA and valid now."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    ca = x509.load_pem_x509_certificate(ca_cert_pem)
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError) as exc:
        raise CertError(f"certificate: not issued by this CA ({exc})") from exc
    except Exception as exc:  # InvalidSignature
        raise CertError(f"certificate: bad signature for this CA ({type(exc).__name__})") \
            from exc
    now = _now()
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise CertError("certificate: outside its validity period")


def _write(path: Path, data: bytes, private: bool) -> None:
    mode = 0o600 if private else 0o644
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), mode)  # an existing file keeps its mode through O_CREAT
        f.write(data)


def parse_role_spec(spec: str) -> tuple[str, str]:
    """``role`` or ``role:name`` → (role, name); name "" means the role's own
    certificate (file stem ``role``, else ``role-name``)."""
    role, _, name = spec.partition(":")
    return role, name


def redis_password_file(role: str) -> str:
    """The file (in a tls folder) holding the Redis ACL password of ``role``."""
    return f"redis-{role}.pass"


def derive_event_key(events_secret: bytes, name: str) -> bytes:
    """The event signing key of worker ``name``: HMAC-SHA256(secret, b"kvmesh-events/" +
    name as UTF-8)."""
    return hmac.new(events_secret, EVENT_KEY_CONTEXT + name.encode(), hashlib.sha256).digest()


def _write_secrets(out: Path, specs: list[tuple[str, str]], force: bool) -> list[Path]:
    """``events.key`` (if absent), the Redis passwords and worker event keys of ``specs``
    (module docstring); returns the files written."""
    written: list[Path] = []
    events_path = out / EVENTS_KEY
    if not events_path.exists():
        _write(events_path, secrets.token_bytes(32), True)
        written.append(events_path)
    events_secret = events_path.read_bytes()
    for role, name in specs:
        if role in REDIS_ROLES:
            pw = out / redis_password_file(role)
            if force or not pw.exists():
                _write(pw, secrets.token_hex(32).encode(), True)
                written.append(pw)
        if role == "worker":
            stem = f"{role}-{name}" if name else role
            evkey = out / f"{stem}{EVENT_KEY_SUFFIX}"
            want = derive_event_key(events_secret, name or role)
            if not evkey.exists() or evkey.read_bytes() != want:
                _write(evkey, want, True)
                written.append(evkey)
    return list(dict.fromkeys(written))


def write_mesh_certs(out: Path, roles: tuple[str, ...] | list[str] = ROLES,
                     force: bool = False) -> list[Path]:
    """Writes the CA (if absent) and each role's certificate + key into ``out``; an entry
    ``role:name`` makes an instance certificate ``<role>-<name>.pem``; then the secrets of
    the module docstring. Returns the files written (existing ones are kept unless
    ``force``)."""
    out.mkdir(parents=True, exist_ok=True)
    ca_path, ca_key_path = out / "ca.pem", out / "ca-key.pem"
    written: list[Path] = []
    if ca_path.exists() and ca_key_path.exists():
        ca_cert, ca_key = ca_path.read_bytes(), ca_key_path.read_bytes()
    else:
        ca_cert, ca_key = make_ca()
        _write(ca_key_path, ca_key, True)
        _write(ca_path, ca_cert, False)
        written += [ca_path, ca_key_path]
    specs = [parse_role_spec(spec) for spec in roles]
    for role, name in specs:
        stem = f"{role}-{name}" if name else role
        cert_path, key_path = out / f"{stem}.pem", out / f"{stem}-key.pem"
        if (cert_path.exists() and key_path.exists() and not force
                and _has_server_name(cert_path.read_bytes(), role)):
            continue
        cert, key = issue(ca_cert, ca_key, role, name)
        _write(key_path, key, True)
        _write(cert_path, cert, False)
        written += [cert_path, key_path]
    return written + _write_secrets(out, specs, force)


def _has_server_name(cert_pem: bytes, role: str) -> bool:
    cert = x509.load_pem_x509_certificate(cert_pem)
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return False
    return server_name(role) in sans.get_values_for_type(x509.DNSName)


def export_identity(source: Path, dest: Path, stem: str) -> Path:
    """Copies identity ``stem`` from ``source`` (a folder :func:`write_mesh_certs` wrote)
    into ``dest``: ``ca.pem``, ``<stem>.pem``, ``<stem>-key.pem`` and its role's secrets
    (:data:`ROLE_SECRETS`); never the CA key nor another identity's files. Returns
    ``dest``; CertError naming a missing source file."""
    role = identity_of((source / f"{stem}.pem").read_bytes()).role if (
        source / f"{stem}.pem").is_file() else ""
    names = ["ca.pem", f"{stem}.pem", f"{stem}-key.pem",
             *(n.format(stem=stem) for n in ROLE_SECRETS.get(role, ()))]
    missing = [n for n in names if not (source / n).is_file()]
    if missing:
        raise CertError(f"tls_dir: {source} lacks {', '.join(missing)} for {stem!r}")
    dest.mkdir(parents=True, exist_ok=True)
    os.chmod(dest, 0o700)
    for n in names:
        public = n.endswith(".pem") and not n.endswith("-key.pem")  # certificates
        _write(dest / n, (source / n).read_bytes(), private=not public)
    return dest


@dataclass(frozen=True)
class MeshTls:
    """One process's TLS material: the CA and its role's certificate and key."""

    ca: bytes
    cert: bytes
    key: bytes
    identity: Identity
    folder: Path | None = None  # where load() read them (None: built in memory)
    stem: str = ""  # the certificate's file stem there

    @classmethod
    def load(cls, folder: Path | str, stem: str) -> MeshTls:
        """Reads ``ca.pem``, ``<stem>.pem`` and ``<stem>-key.pem`` from ``folder``."""
        base = Path(folder)
        paths = [base / "ca.pem", base / f"{stem}.pem", base / f"{stem}-key.pem"]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise CertError(f"tls_dir: missing {', '.join(missing)} (run `kvmesh certs --out "
                            f"{base}`)")
        ca, cert, key = (p.read_bytes() for p in paths)
        verify_signed_by(cert, ca)
        return cls(ca, cert, key, identity_of(cert), base, stem)

    def path(self, filename: str) -> Path:
        """``filename`` in the folder this material was loaded from."""
        if self.folder is None:
            raise CertError(f"tls: {filename} needs material loaded from a tls_dir")
        return self.folder / filename

    def secret(self, filename: str) -> bytes:
        """The bytes of secret ``filename`` in that folder; CertError naming it when
        missing."""
        path = self.path(filename)
        if not path.is_file():
            raise CertError(f"tls_dir: missing {path} (run `kvmesh certs --out "
                            f"{self.folder}` with this role)")
        return path.read_bytes()

    def server_credentials(self, client_auth: bool = True) -> grpc.ServerCredentials:
        """Server side: present this certificate; require a client certificate signed by
        the mesh CA (``client_auth``), or verify one only when the client presents it
        (a user-facing port: callers prove themselves with API keys)."""
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=client_auth)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Client side: trust only the mesh CA, present this certificate."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def ssl_context(self, server: bool) -> ssl.SSLContext:
        """A Python ``ssl`` context with the same rules, for plain asyncio connections (the
        TCP request plane): TLS 1.2+, trusting only the mesh CA, presenting this
        certificate; a server requires a client certificate, a client checks the
        server's name (connect with ``server_hostname=server_name(role)``)."""
        ctx = ssl.create_default_context(
            ssl.Purpose.CLIENT_AUTH if server else ssl.Purpose.SERVER_AUTH,
            cadata=self.ca.decode())
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if server:
            ctx.verify_mode = ssl.CERT_REQUIRED
        if self.folder is not None:
            ctx.load_cert_chain(self.folder / f"{self.stem}.pem",
                                self.folder / f"{self.stem}-key.pem")
        else:  # built in memory: ssl reads a chain from files only
            with tempfile.TemporaryDirectory(prefix="kvmesh-tls-") as tmp:
                cert, key = Path(tmp) / "cert.pem", Path(tmp) / "key.pem"
                _write(cert, self.cert, private=False)
                _write(key, self.key, private=True)
                ctx.load_cert_chain(cert, key)
        return ctx


_warned_insecure = False


def tls_for(cfg: Any, role: str) -> MeshTls | None:
    """The TLS material from ``cfg.tls_dir``: certificate stem ``cfg.tls_cert``, else
    ``role`` (``<stem>.pem``); or None when it is empty (insecure: logs one warning per
    process)."""
    global _warned_insecure
    folder = getattr(cfg, "tls_dir", "")
    if not folder or getattr(cfg, "insecure", False):
        if not _warned_insecure:
            _warned_insecure = True
            log.warning("gRPC without TLS or authorization (--insecure or no --tls-dir): "
                        "any local process can call every mesh service")
        return None
    return MeshTls.load(folder, getattr(cfg, "tls_cert", "") or role)
