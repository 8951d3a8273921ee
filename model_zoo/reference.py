"""The torch reference LLaMA: the oracle for every kernel and quantizer, and fllama's CPU backend.

Plain functions over ModelWeights (gpt-fast style), HF numerics: RMSNorm in fp32 then cast, RoPE with
rotate_half and cos/sin cast to the activation dtype, SwiGLU, GQA, a KV cache with one length per row so
rows of a batch can sit at different positions (ragged prompts, chat turns).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from model_zoo import rope
from model_zoo.backend import check_token_ids
from model_zoo.config import LlamaConfig
from model_zoo.weights import LayerWeights, ModelWeights

# Called with (capture point, activation [T, C]) at the inputs of the quantized linears: "qkv", "o",
# "gate_up", "down". Calibration and AWQ use it; the plain forward passes None.
Observer = Callable[[str, torch.Tensor], None]


@dataclass
class KVCache:
    k: list[torch.Tensor]  # per layer [B, n_kv, max_len, head_dim]
    v: list[torch.Tensor]  # per layer [B, n_kv, max_len, head_dim]
    lengths: torch.Tensor  # [B] int64: tokens already cached per row

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2] if self.k else 0

    @classmethod
    def empty(cls, config: LlamaConfig, batch: int, max_len: int, dtype: torch.dtype,
              device: torch.device | str, n_layers: int | None = None) -> "KVCache":
        shape = (batch, config.n_kv_heads, max_len, config.head_dim)
        n = config.n_layers if n_layers is None else n_layers
        return cls(k=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)],
                   v=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)],
                   lengths=torch.zeros(batch, dtype=torch.int64, device=device))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rope_cos_sin(config: LlamaConfig, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [*positions.shape, head_dim] in `dtype`, computed in fp32 as transformers does (RoPE scaling
    included: dynamic NTK takes this call's longest position, as transformers' forward does)."""
    dynamic = config.rope_scaling is not None and config.rope_scaling.kind is rope.RopeType.DYNAMIC
    seq_len = int(positions.max()) + 1 if dynamic and positions.numel() else None  # a host sync: dynamic only
    inv_freq = rope.inv_freq(config.head_dim, config.rope_theta, config.rope_scaling, seq_len, positions.device)
    freqs = positions.float()[..., None] * inv_freq  # [..., d/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [..., d]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, heads, S, d]; cos/sin: [B, S, d]
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
              gqa_ratio: int) -> torch.Tensor:
    """q [B, nh, S, d] at positions q_pos [B, S]; k/v [B, n_kv, T, d] hold positions 0..T-1."""
    T = k.shape[2]
    k = k.repeat_interleave(gqa_ratio, dim=1)  # [B, nh, T, d]
    v = v.repeat_interleave(gqa_ratio, dim=1)
    key_pos = torch.arange(T, device=q.device)
    mask = key_pos[None, None, :] <= q_pos[:, :, None]  # [B, S, T]: causal, per row's own positions
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])  # [B, nh, S, d]


def layer_forward(layer: LayerWeights, config: LlamaConfig, x: torch.Tensor, positions: torch.Tensor,
                  cache: tuple[torch.Tensor, torch.Tensor] | None = None, rows: torch.Tensor | None = None,
                  observer: Observer | None = None) -> torch.Tensor:
    """One decoder layer. x [B, S, H]; positions [B, S]; cache (k, v) [B_all, n_kv, L, d] written at
    (rows, positions) and attended over up to each row's last position."""
    B, S, H = x.shape
    c = config
    h = rms_norm(x, layer.attn_norm, c.norm_eps)  # [B, S, H]
    if observer:
        observer("qkv", h.reshape(B * S, H))
    q = layer.wq(h).view(B, S, c.n_heads, c.head_dim).transpose(1, 2)  # [B, nh, S, d]
    k = layer.wk(h).view(B, S, c.n_kv_heads, c.head_dim).transpose(1, 2)  # [B, n_kv, S, d]
    v = layer.wv(h).view(B, S, c.n_kv_heads, c.head_dim).transpose(1, 2)  # [B, n_kv, S, d]
    cos, sin = rope_cos_sin(c, positions, q.dtype)  # [B, S, d]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if cache is not None:
        k_cache, v_cache = cache
        r = rows[:, None]  # [B, 1]
        k_cache[r, :, positions] = k.transpose(1, 2).to(k_cache.dtype)  # [B, S, n_kv, d] into (row, :, pos)
        v_cache[r, :, positions] = v.transpose(1, 2).to(v_cache.dtype)
        T = int(positions.max()) + 1
        if B == k_cache.shape[0] and bool((rows == torch.arange(B, device=rows.device)).all()):
            k, v = k_cache[:, :, :T], v_cache[:, :, :T]  # every row in order: a view, no gather
        else:
            k, v = k_cache[rows, :, :T], v_cache[rows, :, :T]  # [B, n_kv, T, d]
        k, v = k.to(q.dtype), v.to(q.dtype)
    o = attention(q, k, v, positions, c.gqa_ratio)  # [B, nh, S, d]
    o = o.transpose(1, 2).reshape(B, S, c.q_size)  # [B, S, nh*d]
    if observer:
        observer("o", o.reshape(B * S, c.q_size))
    x = x + layer.wo(o).to(x.dtype)
    h = rms_norm(x, layer.ffn_norm, c.norm_eps)
    if observer:
        observer("gate_up", h.reshape(B * S, H))
    a = F.silu(layer.w_gate(h)) * layer.w_up(h)  # [B, S, F]
    if observer:
        observer("down", a.reshape(B * S, c.ffn_size))
    return x + layer.w_down(a).to(x.dtype)


class ReferenceModel:
    """The reference backend: forward(tokens, cache, rows) -> fp32 logits."""

    name = "reference"

    def __init__(self, weights: ModelWeights):
        self.weights = weights
        self.config = weights.config

    @property
    def device(self) -> torch.device:
        return self.weights.device

    @property
    def scheme(self) -> str:
        return self.weights.meta.get("scheme", "fp16")

    @property
    def dtype(self) -> torch.dtype:
        return self.weights.dtype

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache.empty(self.config, batch, max_len, self.dtype, self.device)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.weights.embed[tokens]  # [B, S, H]

    def head(self, x: torch.Tensor) -> torch.Tensor:
        x = rms_norm(x, self.weights.norm, self.config.norm_eps)
        return F.linear(x, self.weights.lm_head).float()  # [B, S, V]

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None, rows: torch.Tensor | None = None,
                observer: Observer | None = None, *, last: bool = False) -> torch.Tensor:
        """tokens [B, S] -> logits [B, S, V] (fp32). With a cache, each row continues at its own length.
        last: each row's last position only, [B, 1, V]."""
        tokens = tokens.to(self.device)
        check_token_ids(tokens, self.config.vocab_size)
        B, S = tokens.shape
        if cache is None:
            positions = torch.arange(S, device=self.device).expand(B, S)  # [B, S]
        else:
            rows = torch.arange(B, device=self.device) if rows is None else rows.to(self.device)
            start = cache.lengths[rows]  # [B]
            if int(start.max()) + S > cache.max_len:
                raise ValueError(f"KV cache of {cache.max_len} positions cannot hold {int(start.max()) + S}")
            positions = start[:, None] + torch.arange(S, device=self.device)  # [B, S]
        x = self.embed(tokens)
        for i, layer in enumerate(self.weights.layers):
            kv = None if cache is None else (cache.k[i], cache.v[i])
            x = layer_forward(layer, self.config, x, positions, kv, rows,
                              None if observer is None else _prefixed(observer, i))
        if cache is not None:
            cache.lengths[rows] += S
        return self.head(x[:, -1:] if last else x)


def _prefixed(observer: Observer, layer: int) -> Observer:
    return lambda point, x: observer(f"layers.{layer}.{point}", x)
