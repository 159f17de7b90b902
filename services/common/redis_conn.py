"""The one place that builds Redis clients: plaintext, or TLS with a mesh ACL user.

Contract of :func:`redis_client` (url, tls, role):

- ``redis://`` or ``unix://``: today's plaintext client, no user (``tls`` unused). When
  the process has mesh TLS material, one warning per process says that its Redis traffic
  is neither encrypted nor authenticated.
- ``rediss://`` (what ``kvmesh up`` gives its children when it runs with certificates):
  TLS that trusts only the mesh CA and presents the process's certificate
  (``<stem>.pem`` / ``<stem>-key.pem`` of ``tls.folder``), then AUTH as the ACL user
  ``role`` (default: the certificate's role) with the password in
  ``redis-<role>.pass`` (:func:`services.common.tls.redis_password_file`). The host name
  is not checked: every mesh leaf carries the same server names, so the mesh CA's
  signature is all that a server certificate proves. Without ``tls`` (or with material
  that was not loaded from a folder) a ``rediss://`` URL raises
  :class:`~services.common.tls.CertError`, and so does a missing password file. Both
  name the file or the flag.
"""

from __future__ import annotations

import logging

import redis.asyncio as aioredis

from services.common.tls import CertError, MeshTls, redis_password_file

log = logging.getLogger(__name__)
_warned_plain = False


def redis_client(url: str, tls: MeshTls | None, role: str = "") -> aioredis.Redis:
    """A client for ``url``; see the module docstring."""
    global _warned_plain
    if not url.startswith("rediss://"):
        if tls is not None and not _warned_plain:
            _warned_plain = True
            log.warning("Redis at %s without TLS or an ACL user although --tls-dir is set "
                        "(use rediss:// for the mesh's Redis)", url)
        return aioredis.Redis.from_url(url)
    if tls is None:
        raise CertError(f"redis_url: {url} (rediss://) needs --tls-dir (the mesh "
                        "certificates and Redis passwords)")
    user = role or tls.identity.role
    password = tls.secret(redis_password_file(user)).decode().strip()
    return aioredis.Redis.from_url(
        url, username=user, password=password, ssl_cert_reqs="required",
        ssl_ca_data=tls.ca.decode(), ssl_certfile=str(tls.path(f"{tls.stem}.pem")),
        ssl_keyfile=str(tls.path(f"{tls.stem}-key.pem")), ssl_check_hostname=False)
