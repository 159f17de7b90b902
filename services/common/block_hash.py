"""KV block hashing shared by router, indexer and workers (Dynamo's scheme).

Contract:

- :func:`local_block_hash` is XXH3-64 with seed 1337 over the block's token ids as
  little-endian u32.
- :func:`block_hashes` splits ``token_ids`` into full blocks of ``block_size`` (a partial
  tail block is not hashed: engines cache only full blocks) and returns the chained
  sequence hashes: ``seq[0] = local[0]``, ``seq[i] = xxh3_64(seq[i-1] ‖ local[i])`` with
  both as little-endian u64. Equal sequence hashes mean equal prefixes.
  With ``parent`` (the sequence hash of the block before ``token_ids``) the chain
  continues from it: ``block_hashes(a + b, n) == block_hashes(b, n, parent=block_hashes(a, n)[-1])``
  when ``len(a)`` is a multiple of ``n``.
- **Cache salt** (tenant isolation): with ``salt`` (a non-empty string) and no
  ``parent``, the chain starts from :func:`salt_root` of the salt instead of nothing:
  ``seq[0] = xxh3_64(salt_root(salt) ‖ local[0])``, so two salts never share a hash
  (nor does a salt share one with the unsalted chain). ``salt=""`` gives exactly the
  unsalted hashes. With ``parent`` the salt is ignored: the parent already carries it.
  The router, the indexer, the workers' event translation and the mock engine all hash
  with the request's salt, so nothing matches across tenants.
- Router and workers must use the same ``block_size``.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence

import xxhash

if array("I").itemsize != 4 or sys.byteorder != "little":  # pragma: no cover
    raise ImportError("block hashing needs 4-byte little-endian unsigned ints")

SEED = 1337


_PAIR = struct.Struct("<QQ")
_SALT_TAG = b"kvmesh-cache-salt\0"


def local_block_hash(tokens: Sequence[int]) -> int:
    """Hash of one block's tokens alone."""
    return int(xxhash.xxh3_64_intdigest(array("I", tokens).tobytes(), seed=SEED))


def salt_root(salt: str) -> int | None:
    """The chain's root for ``salt``: None for "" (unsalted), else XXH3-64 (seed 1337) of
    ``b"kvmesh-cache-salt\\0"`` + the salt's UTF-8 bytes."""
    if not salt:
        return None
    return int(xxhash.xxh3_64_intdigest(_SALT_TAG + salt.encode(), seed=SEED))


def block_hashes(token_ids: Sequence[int], block_size: int,
                 parent: int | None = None, salt: str = "") -> list[int]:
    """Chained hashes of every full block of ``token_ids`` (continuing ``parent``, else
    starting from ``salt``'s root)."""
    if block_size <= 0:
        raise ValueError("block_size must be > 0")
    n_full = len(token_ids) // block_size
    if not n_full:
        return []
    data = memoryview(array("I", token_ids[:n_full * block_size]).tobytes())
    step = block_size * 4
    digest, pack = xxhash.xxh3_64_intdigest, _PAIR.pack
    out: list[int] = []
    prev = parent if parent is not None else salt_root(salt)
    for i in range(n_full):
        local = digest(data[i * step:(i + 1) * step], seed=SEED)
        seq = local if prev is None else digest(pack(prev, local), seed=SEED)
        out.append(seq)
        prev = seq
    return out
