"""The router's KV overlap sources by name (``--indexer``), in a module without grpc so the
launcher can check ``kvmesh up --indexer`` without importing the router's RPC code.

- ``none``: the router's own request history; ``remote``: the indexer service;
  ``embedded``: an in-process index (see :mod:`services.router.overlaps`).
"""

from __future__ import annotations

INDEXER_MODES = ("none", "remote", "embedded")
