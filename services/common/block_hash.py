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
- **Multimodal keys** (vLLM's ``("mm", identifier, offset)`` extra keys): every image
  token has the same token id, so a block holding (part of) an image also hashes the
  image's identity. ``mm_keys`` gives, per full block, the ``(identifier, offset)`` pairs
  of the images it holds (``offset`` = the image's start relative to the block's first
  token, negative when the image began in an earlier block), exactly as vLLM publishes
  them untagged in ``BlockStored.extra_keys``; :func:`mm_block_keys` derives them from
  absolute :class:`MmSpan` placeholder ranges by vLLM's rule (a block holds an image when
  ``block_start < offset + length`` and ``block_end > offset``). A block with keys has
  the local hash ``xxh3_64(tokens ‖ b"kvmesh-mm\0" ‖ (identifier UTF-8 ‖ NUL ‖ offset as
  little-endian i64)...)``; a block without keys (every text-only block) keeps the plain
  local hash, so text-only hashes are unchanged. The router hashes with the keys the
  frontend derived from the placeholder positions; the workers' event translation with
  the keys vLLM published: both give the same hashes.
- Router and workers must use the same ``block_size``.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeGuard

import xxhash

if array("I").itemsize != 4 or sys.byteorder != "little":  # pragma: no cover
    raise ImportError("block hashing needs 4-byte little-endian unsigned ints")

SEED = 1337


_PAIR = struct.Struct("<QQ")
_SALT_TAG = b"kvmesh-cache-salt\0"
_MM_TAG = b"kvmesh-mm\0"
_I64 = struct.Struct("<q")
MmKey = tuple[str, int]  # (identifier, offset relative to the block's first token)


@dataclass(frozen=True)
class MmSpan:
    """One multimodal item's placeholder tokens: ``identifier`` (vLLM's mm_hash) and the
    absolute ``offset`` and ``length`` of its placeholder range in the prompt."""

    identifier: str
    offset: int
    length: int


def mm_block_keys(spans: Sequence[MmSpan], n_tokens: int,
                  block_size: int) -> list[tuple[MmKey, ...]]:
    """Per full block of an ``n_tokens`` prompt, the (identifier, offset) keys of the
    spans it holds (vLLM's ``_gen_mm_extra_hash_keys``), in span order."""
    if block_size <= 0:
        raise ValueError("block_size must be > 0")
    out: list[tuple[MmKey, ...]] = []
    ordered = sorted(spans, key=lambda s: s.offset)
    for b in range(n_tokens // block_size):
        start, end = b * block_size, (b + 1) * block_size
        out.append(tuple((s.identifier, s.offset - start) for s in ordered
                         if end > s.offset and start < s.offset + s.length))
    return out


def _mm_suffix(keys: Sequence[MmKey]) -> bytes:
    return _MM_TAG + b"".join(str(ident).encode() + b"\0" + _I64.pack(int(off))
                              for ident, off in keys)


def local_block_hash(tokens: Sequence[int]) -> int:
    """Hash of one block's tokens alone."""
    return int(xxhash.xxh3_64_intdigest(array("I", tokens).tobytes(), seed=SEED))


def salt_root(salt: str) -> int | None:
    """The chain's root for ``salt``: None for "" (unsalted), else XXH3-64 (seed 1337) of
    ``b"kvmesh-cache-salt\\0"`` + the salt's UTF-8 bytes."""
    if not salt:
        return None
    return int(xxhash.xxh3_64_intdigest(_SALT_TAG + salt.encode(), seed=SEED))


def _packed(token_ids: Sequence[int]) -> TypeGuard[array[int]]:
    return isinstance(token_ids, array) and token_ids.typecode == "I"


def packed_tokens(token_ids: Sequence[int]) -> array[int]:
    """``token_ids`` as the u32 array :func:`block_hashes` hashes (given to it, it is not
    converted again); OverflowError for an id outside [0, 2**32)."""
    return token_ids if _packed(token_ids) else array("I", token_ids)


def block_hashes(token_ids: Sequence[int], block_size: int,
                 parent: int | None = None, salt: str = "",
                 mm_keys: Sequence[Sequence[MmKey]] | None = None) -> list[int]:
    """Chained hashes of every full block of ``token_ids`` (a sequence of ints, or
    :func:`packed_tokens`' array: not copied), continuing ``parent``, else starting from
    ``salt``'s root; ``mm_keys[i]``: block i's multimodal keys (see the module docstring;
    missing or empty: none)."""
    if block_size <= 0:
        raise ValueError("block_size must be > 0")
    n_full = len(token_ids) // block_size
    if not n_full:
        return []
    end = n_full * block_size  # a partial tail is neither hashed nor converted
    data = memoryview(token_ids if _packed(token_ids)
                      else array("I", token_ids[:end]))[:end].cast("B")
    step = block_size * 4
    digest, pack = xxhash.xxh3_64_intdigest, _PAIR.pack
    out: list[int] = []
    prev = parent if parent is not None else salt_root(salt)
    if mm_keys:
        for i in range(n_full):
            block = data[i * step:(i + 1) * step]
            keys = mm_keys[i] if i < len(mm_keys) else None
            local = digest(bytes(block) + _mm_suffix(keys) if keys else block, seed=SEED)
            prev = local if prev is None else digest(pack(prev, local), seed=SEED)
            out.append(prev)
        return out
    start = 0
    if prev is None:
        prev = digest(data[:step], seed=SEED)
        out.append(prev)
        start = step
    append = out.append
    for off in range(start, n_full * step, step):  # text only: the usual prompt
        prev = digest(pack(prev, digest(data[off:off + step], seed=SEED)), seed=SEED)
        append(prev)
    return out
