"""KV block hashing shared by router, indexer and workers (Dynamo's scheme).

Contract:

- :func:`local_block_hash` is XXH3-64 with seed 1337 over the block's token ids as
  little-endian u32.
- :func:`block_hashes` splits ``token_ids`` into full blocks of ``block_size`` (a partial
  tail block is not hashed: engines cache only full blocks) and returns the chained
  sequence hashes: ``seq[0] = local[0]``, ``seq[i] = xxh3_64(seq[i-1] ‖ local[i])`` with
  both as little-endian u64. Equal sequence hashes mean equal prefixes.
- Router and workers must use the same ``block_size``.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

SEED = 1337


def local_block_hash(tokens: Sequence[int]) -> int:
    """Hash of one block's tokens alone."""
    return int(xxhash.xxh3_64_intdigest(struct.pack(f"<{len(tokens)}I", *tokens), seed=SEED))


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of every full block of ``token_ids``."""
    if block_size <= 0:
        raise ValueError("block_size must be > 0")
    out: list[int] = []
    prev: int | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        local = local_block_hash(token_ids[start:start + block_size])
        if prev is None:
            seq = local
        else:
            seq = int(xxhash.xxh3_64_intdigest(struct.pack("<QQ", prev, local), seed=SEED))
        out.append(seq)
        prev = seq
    return out
