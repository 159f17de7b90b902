"""The frontend's side of images (EPD): checks, identities and placeholder positions.

No gRPC, no asyncio: the pipeline runs these in a thread (decoding is CPU work).

Contract:

- :class:`ImageExpander(model_path)`: the model's Hugging Face processor, loaded from its
  folder (never a hub). ``image_token_id`` is the marker the chat template renders for an
  image part (one token per image); ``placeholder(image)`` is the token ids that marker
  becomes for that image (the processor run on the marker alone: e.g. Idefics3's
  ``<fake_token_around_image><global-img><image>×4<fake_token_around_image>``), which is
  what vLLM's prompt update puts in its place, so ``expand(ids, images)`` gives the
  prompt as the model sees it plus each image's placeholder ``(offset, length)``: the
  range vLLM's ``("mm", identifier, offset)`` block keys are computed from.
  ValueError when the marker count differs from the image count. Placeholders are cached
  by the image's content hash (:data:`CACHE_ENTRIES`).
- :func:`mm_prompt(ids, parts, salt, limits, expander)` -> :class:`MmPrompt`: decodes and
  checks each image (:func:`services.encoder.images.open_image`: not an image, a format
  other than PNG/JPEG, over the pixel or byte limit; :class:`InputError` naming the
  part's field), computes its content hash and its key (:func:`services.encoder.core.
  cache_key`, salted with the tenant's ``salt``: the mm_hash that E, the worker's vLLM
  and the router all use) and expands the prompt.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from services.encoder.core import cache_key, content_hash
from services.encoder.images import ImageLimits, open_image

CACHE_ENTRIES = 4096


@dataclass(frozen=True)
class ImageSpec:
    """One image of a prompt."""

    data: bytes  # the file, as the client sent it
    digest: str  # sha256 hex of ``data``
    mm_hash: str  # the embedding-cache key (digest salted with the tenant's salt)
    offset: int  # its placeholder tokens in MmPrompt.token_ids
    length: int


@dataclass(frozen=True)
class MmPrompt:
    """A prompt with images: as the model sees it and as the engine gets it."""

    token_ids: list[int]  # each image expanded to its placeholder tokens
    engine_ids: list[int]  # one marker token per image (the engine expands it)
    images: list[ImageSpec]


class ImageExpander:
    """See the module docstring."""

    def __init__(self, model_path: str) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        from transformers import AutoProcessor

        self._proc = AutoProcessor.from_pretrained(model_path, local_files_only=True)
        token = getattr(self._proc, "image_token", None)
        tokenizer = getattr(self._proc, "tokenizer", None)
        if token is None or tokenizer is None:
            raise ValueError(f"the processor of {model_path} has no image token")
        self.image_token = str(getattr(token, "content", token))
        self.image_token_id = int(tokenizer.convert_tokens_to_ids(self.image_token))
        self._cache: OrderedDict[str, list[int]] = OrderedDict()

    def placeholder(self, image: Any, digest: str = "") -> list[int]:
        """The tokens the image marker becomes for ``image``."""
        if digest and digest in self._cache:
            self._cache.move_to_end(digest)
            return self._cache[digest]
        out = self._proc(text=self.image_token, images=[image], add_special_tokens=False)
        ids = [int(t) for t in out["input_ids"][0]]
        if digest:
            self._cache[digest] = ids
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return ids

    def expand(self, ids: Sequence[int], images: Sequence[Any],
               digests: Sequence[str] = ()) -> tuple[list[int], list[tuple[int, int]]]:
        """The expanded prompt and each image's (offset, length) in it."""
        positions = [k for k, t in enumerate(ids) if t == self.image_token_id]
        if len(positions) != len(images):
            raise ValueError(f"the rendered prompt has {len(positions)} image markers for "
                             f"{len(images)} images")
        out: list[int] = []
        spans: list[tuple[int, int]] = []
        prev = 0
        for k, (pos, image) in enumerate(zip(positions, images, strict=True)):
            out.extend(ids[prev:pos])
            rep = self.placeholder(image, digests[k] if k < len(digests) else "")
            spans.append((len(out), len(rep)))
            out.extend(rep)
            prev = pos + 1
        out.extend(ids[prev:])
        return out, spans


def mm_prompt(ids: Sequence[int], parts: Sequence[tuple[str, bytes]], salt: str,
              limits: ImageLimits, expander: ImageExpander) -> MmPrompt:
    """``parts`` = (field, file bytes) per image in prompt order; see the module doc."""
    decoded = [open_image(data, field, limits) for field, data in parts]
    digests = [content_hash(data) for _, data in parts]
    expanded, spans = expander.expand(ids, decoded, digests)
    images = [ImageSpec(data, digest, cache_key(digest, salt), off, n)
              for (_, data), digest, (off, n) in zip(parts, digests, spans, strict=True)]
    return MmPrompt(expanded, list(ids), images)
