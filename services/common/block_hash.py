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


def local_block_hash(tokens: Sequence[int]) -> int:
    """Hash of one block's tokens alone."""
    return int(xxhash.xxh3_64_intdigest(array("I", tokens).tobytes(), seed=SEED))


def block_hashes(token_ids: Sequence[int], block_size: int,
                 parent: int | None = None) -> list[int]:
    """Chained hashes of every full block of ``token_ids`` (continuing ``parent``)."""
    if block_size <= 0:
        raise ValueError("block_size must be > 0")
    n_full = len(token_ids) // block_size
    if not n_full:
        return []
    data = memoryview(array("I", token_ids[:n_full * block_size]).tobytes())
    step = block_size * 4
    digest, pack = xxhash.xxh3_64_intdigest, _PAIR.pack
    out: list[int] = []
    prev = parent
    for i in range(n_full):
        local = digest(data[i * step:(i + 1) * step], seed=SEED)
        seq = local if prev is None else digest(pack(prev, local), seed=SEED)
        out.append(seq)
        prev = seq
    return out
