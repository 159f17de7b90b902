"""A Llama-style decoder in plain PyTorch, split into an attention side and an FFN side.

Only ``config.json`` and ``model.safetensors`` are read (with ``safetensors``); no
transformers modelling code runs. It loads SmolLM2-135M (tied lm_head) and the tiny test
model (untied lm_head), float32.

Where the residual lives (what crosses the wire). Decoder layer ``l`` of HF Llama is::

    mid = h + o_proj(attn(rope(qkv(input_norm(h)))))      # attention part
    h'  = mid + down(silu(gate(n)) * up(n)), n = post_norm(mid)   # FFN part

The attention side computes ``mid`` (the residual add of attention included) and sends
it; the FFN side computes ``h'`` (post-attention norm, SwiGLU MLP and the MLP's residual
add) and sends it back. So exactly one ``[num_tokens, hidden]`` float32 tensor crosses
each way per layer: attention -> FFN is the residual stream after attention, FFN ->
attention is the layer's output (the next layer's input *and* residual). The attention
worker holds the residual stream between layers; the FFN worker keeps nothing between
messages (no KV cache, no request state).

Contracts:

- :func:`load_config` reads a model folder's ``config.json`` into :class:`ModelConfig`
  (ValueError naming the field for unsupported settings: a non-default RoPE, biases,
  an activation other than silu).
- :func:`load_attention_side` / :func:`load_ffn_side` read only their own tensors.
- :meth:`AttentionLayer.forward` and :meth:`FfnLayer.forward` take ``[T, hidden]`` rows
  (the batch's tokens, concatenated request by request) and return new ``[T, hidden]``.
- Batch invariance: every projection goes through :func:`linear`, which pads the rows
  to a multiple of :data:`ROW_CHUNK` and runs one GEMM per chunk of exactly that many
  rows. Every GEMM then has the same shape, so MKL takes the same kernel path whatever
  the batch size, and a row's result does not depend on how many other rows share the
  batch (checked by ``tests/unit/test_afd_model.py``). Padding alone to a multiple of 4
  held on AVX2 machines but not on AVX-512 ones, where MKL picks its kernel by the row
  count. FFN-side batching across attention workers and microbatch splits thus give
  bitwise the same rows as unsplit. Norms, RoPE and SwiGLU are row-wise; attention runs
  per request.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROW_CHUNK = 16  # rows per GEMM, padded (batch invariance, module docstring)


@dataclass(frozen=True)
class ModelConfig:
    """The Llama shape this engine supports."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_id: int | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read ``config.json``; ValueError naming the field for what this engine can't run."""
    raw: dict[str, Any] = json.loads((Path(model_dir) / "config.json").read_text())
    if raw.get("model_type") not in ("llama", None):
        raise ValueError(f"model_type {raw.get('model_type')!r} is not supported (llama only)")
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {raw['hidden_act']!r} is not supported (silu only)")
    for field in ("attention_bias", "mlp_bias"):
        if raw.get(field):
            raise ValueError(f"{field}=true is not supported")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r} is not supported (default only)")
    theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
    heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    kv_heads = int(raw.get("num_key_value_heads", heads))
    if heads % kv_heads:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    eos = raw.get("eos_token_id")
    return ModelConfig(
        vocab_size=int(raw["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]), num_heads=heads, num_kv_heads=kv_heads,
        head_dim=int(raw.get("head_dim", hidden // heads)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=theta,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        eos_token_id=eos if isinstance(eos, int) else None)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for ``x`` of ``[T, in]``, batch-invariant (module docstring)."""
    rows = x.shape[0]
    pad = (-rows) % ROW_CHUNK
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    if x.shape[0] == ROW_CHUNK:
        return F.linear(x, weight)[:rows]
    return torch.cat([F.linear(chunk, weight) for chunk in x.split(ROW_CHUNK)])[:rows]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm in float32, row-wise."""
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Rope:
    """Default Llama RoPE: ``cos``/``sin`` tables for positions ``[0, max_positions)``."""

    def __init__(self, head_dim: int, theta: float, max_positions: int) -> None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64)
                                    .to(torch.float32) / head_dim))
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos()
        self.sin = emb.sin()
        self.max_positions = max_positions

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` of ``[T, heads, head_dim]`` at ``positions`` (``[T]`` int64)."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return x * cos + _rotate_half(x) * sin


@dataclass(frozen=True)
class SeqSlice:
    """One request's rows in a batch: rows ``[row, row + num_tokens)`` are its tokens at
    positions ``[start, start + num_tokens)``."""

    request_id: str
    row: int
    start: int
    num_tokens: int


class KvAccess:
    """What attention needs from a KV cache (see :mod:`workers.engines.afd.kv_cache`)."""

    def write(self, layer: int, request_id: str, start: int, k: torch.Tensor,
              v: torch.Tensor) -> None:
        raise NotImplementedError

    def read(self, layer: int, request_id: str, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


@dataclass
class AttentionLayer:
    """Input norm, q/k/v projections, RoPE, GQA attention against the KV cache, o_proj
    and the attention residual add (module docstring)."""

    index: int
    input_norm: torch.Tensor
    q_proj: torch.Tensor
    k_proj: torch.Tensor
    v_proj: torch.Tensor
    o_proj: torch.Tensor

    def forward(self, hidden: torch.Tensor, seqs: Sequence[SeqSlice], positions: torch.Tensor,
                kv: KvAccess, cfg: ModelConfig, rope: Rope) -> torch.Tensor:
        """Return ``hidden + attention(hidden)`` for the rows of ``seqs``; writes this
        layer's K/V of those rows into ``kv`` first."""
        x = rms_norm(hidden, self.input_norm, cfg.rms_norm_eps)
        rows = x.shape[0]
        q = rope.apply(linear(x, self.q_proj).view(rows, cfg.num_heads, cfg.head_dim), positions)
        k = rope.apply(linear(x, self.k_proj).view(rows, cfg.num_kv_heads, cfg.head_dim),
                       positions)
        v = linear(x, self.v_proj).view(rows, cfg.num_kv_heads, cfg.head_dim)
        out = torch.empty(rows, cfg.num_heads, cfg.head_dim, dtype=hidden.dtype)
        for s in seqs:
            sl = slice(s.row, s.row + s.num_tokens)
            kv.write(self.index, s.request_id, s.start, k[sl], v[sl])
            end = s.start + s.num_tokens
            keys, values = kv.read(self.index, s.request_id, end)  # [end, kvh, d]
            qpos = torch.arange(s.start, end).unsqueeze(1)
            mask = torch.arange(end).unsqueeze(0) <= qpos  # [n, end]
            att = F.scaled_dot_product_attention(
                q[sl].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                attn_mask=mask, enable_gqa=cfg.num_heads != cfg.num_kv_heads)
            out[sl] = att.transpose(0, 1)
        return hidden + linear(out.reshape(rows, cfg.q_size), self.o_proj)


@dataclass
class FfnLayer:
    """Post-attention norm, SwiGLU MLP and the MLP residual add. Stateless."""

    index: int
    post_norm: torch.Tensor
    gate_proj: torch.Tensor
    up_proj: torch.Tensor
    down_proj: torch.Tensor

    def forward(self, mid: torch.Tensor, eps: float) -> torch.Tensor:
        """Return ``mid + mlp(post_norm(mid))``, row by row."""
        x = rms_norm(mid, self.post_norm, eps)
        return mid + linear(F.silu(linear(x, self.gate_proj)) * linear(x, self.up_proj),
                            self.down_proj)


@dataclass
class AttentionSide:
    """Everything the attention worker holds: embeddings, per-layer attention, the final
    norm and the lm_head."""

    config: ModelConfig
    embed: torch.Tensor
    layers: list[AttentionLayer]
    final_norm: torch.Tensor
    lm_head: torch.Tensor
    rope: Rope

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` int64 token ids -> ``[T, hidden]``."""
        return self.embed[token_ids]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and lm_head: ``[R, hidden]`` -> ``[R, vocab]``."""
        return linear(rms_norm(hidden, self.final_norm, self.config.rms_norm_eps), self.lm_head)


@dataclass
class FfnSide:
    """Everything the FFN worker holds: per-layer post-attention norm and MLP."""

    config: ModelConfig
    layers: list[FfnLayer]

    def forward(self, layer: int, mid: torch.Tensor) -> torch.Tensor:
        return self.layers[layer].forward(mid, self.config.rms_norm_eps)


class _Weights:
    def __init__(self, model_dir: Path) -> None:
        from safetensors import safe_open

        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {model_dir}")
        self._where: dict[str, Path] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as h:
                for key in h.keys():  # noqa: SIM118 (safe_open is not a dict)
                    self._where[key] = f

    def has(self, key: str) -> bool:
        return key in self._where

    def get(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        if key not in self._where:
            raise KeyError(f"weight {key!r} missing from the model folder")
        with safe_open(str(self._where[key]), framework="pt") as h:
            return h.get_tensor(key).to(torch.float32).contiguous()


def load_attention_side(model_dir: str | Path, cfg: ModelConfig | None = None) -> AttentionSide:
    """Load embeddings, every layer's attention weights, the final norm and the lm_head
    (the embeddings when tied)."""
    path = Path(model_dir)
    cfg = cfg or load_config(path)
    w = _Weights(path)
    embed = w.get("model.embed_tokens.weight")
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        layers.append(AttentionLayer(
            i, w.get(p + "input_layernorm.weight"), w.get(p + "self_attn.q_proj.weight"),
            w.get(p + "self_attn.k_proj.weight"), w.get(p + "self_attn.v_proj.weight"),
            w.get(p + "self_attn.o_proj.weight")))
    if cfg.tie_word_embeddings or not w.has("lm_head.weight"):
        lm_head = embed
    else:
        lm_head = w.get("lm_head.weight")
    rope = Rope(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)
    return AttentionSide(cfg, embed, layers, w.get("model.norm.weight"), lm_head, rope)


def load_ffn_side(model_dir: str | Path, cfg: ModelConfig | None = None) -> FfnSide:
    """Load every layer's post-attention norm and MLP weights."""
    path = Path(model_dir)
    cfg = cfg or load_config(path)
    w = _Weights(path)
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        layers.append(FfnLayer(
            i, w.get(p + "post_attention_layernorm.weight"), w.get(p + "mlp.gate_proj.weight"),
            w.get(p + "mlp.up_proj.weight"), w.get(p + "mlp.down_proj.weight")))
    return FfnSide(cfg, layers)
