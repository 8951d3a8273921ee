"""ModelWeights: the reference model's parameters, built from an HF-named state dict or at random.

HF names are the canonical names everywhere in fllama (loaders convert to them, exporters write them):
model.embed_tokens.weight, model.layers.{i}.{input_layernorm,post_attention_layernorm}.weight,
model.layers.{i}.self_attn.{q,k,v,o}_proj.*, model.layers.{i}.mlp.{gate,up,down}_proj.*,
model.norm.weight, lm_head.weight (absent when embeddings are tied).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping

import torch

from model_zoo.config import LlamaConfig
from model_zoo.errors import CorruptCheckpointError
from model_zoo.linear import DenseLinear, Linear

# (attribute on LayerWeights, HF module path inside a layer)
LINEAR_NAMES: tuple[tuple[str, str], ...] = (
    ("wq", "self_attn.q_proj"),
    ("wk", "self_attn.k_proj"),
    ("wv", "self_attn.v_proj"),
    ("wo", "self_attn.o_proj"),
    ("w_gate", "mlp.gate_proj"),
    ("w_up", "mlp.up_proj"),
    ("w_down", "mlp.down_proj"),
)

# Given a module prefix ("model.layers.3.self_attn.q_proj") and the state dict, build its Linear.
LinearFactory = Callable[[str, Mapping[str, torch.Tensor]], Linear]


def dense_factory(prefix: str, sd: Mapping[str, torch.Tensor]) -> Linear:
    return DenseLinear(get_tensor(sd, prefix + ".weight"))


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [H]
    wq: Linear  # H -> n_heads * head_dim
    wk: Linear  # H -> n_kv_heads * head_dim
    wv: Linear
    wo: Linear  # n_heads * head_dim -> H
    ffn_norm: torch.Tensor  # [H]
    w_gate: Linear  # H -> F
    w_up: Linear
    w_down: Linear  # F -> H

    def linears(self) -> dict[str, Linear]:
        return {attr: getattr(self, attr) for attr, _ in LINEAR_NAMES}

    def to(self, device=None, dtype=None) -> "LayerWeights":
        moved = {a: lin.to(device, dtype) for a, lin in self.linears().items()}
        return replace(self, attn_norm=self.attn_norm.to(device, dtype), ffn_norm=self.ffn_norm.to(device, dtype),
                       **moved)


@dataclass
class ModelWeights:
    config: LlamaConfig
    embed: torch.Tensor  # [V, H]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H]; the same tensor as embed when tied
    meta: dict = field(default_factory=dict)  # scheme and provenance of quantized checkpoints

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def to(self, device=None, dtype=None) -> "ModelWeights":
        embed = self.embed.to(device, dtype)
        lm_head = embed if self.config.tie_embeddings else self.lm_head.to(device, dtype)
        return replace(self, embed=embed, layers=[l.to(device, dtype) for l in self.layers],
                       norm=self.norm.to(device, dtype), lm_head=lm_head)

    def nbytes(self) -> int:
        n = self.embed.numel() * self.embed.element_size() + self.norm.numel() * self.norm.element_size()
        if not self.config.tie_embeddings:
            n += self.lm_head.numel() * self.lm_head.element_size()
        for layer in self.layers:
            n += sum(lin.nbytes() for lin in layer.linears().values())
            n += (layer.attn_norm.numel() + layer.ffn_norm.numel()) * layer.attn_norm.element_size()
        return n

    @classmethod
    def from_state_dict(cls, config: LlamaConfig, sd: Mapping[str, torch.Tensor],
                        linear_factory: LinearFactory = dense_factory, meta: dict | None = None) -> "ModelWeights":
        """Build from HF-named tensors; raises CorruptCheckpointError on missing or mis-shaped tensors."""
        layers = []
        for i in range(config.n_layers):
            p = f"model.layers.{i}."
            linears = {attr: linear_factory(p + path, sd) for attr, path in LINEAR_NAMES}
            layers.append(LayerWeights(attn_norm=get_tensor(sd, p + "input_layernorm.weight"),
                                       ffn_norm=get_tensor(sd, p + "post_attention_layernorm.weight"), **linears))
        embed = get_tensor(sd, "model.embed_tokens.weight")
        if config.tie_embeddings:
            lm_head = embed
        else:
            lm_head = get_tensor(sd, "lm_head.weight")
        w = cls(config=config, embed=embed, layers=layers, norm=get_tensor(sd, "model.norm.weight"), lm_head=lm_head,
                meta=dict(meta or {}))
        w.check_shapes()
        return w

    def check_shapes(self) -> None:
        c = self.config
        expect = {"embed": (self.embed.shape, (c.vocab_size, c.hidden_size)),
                  "lm_head": (self.lm_head.shape, (c.vocab_size, c.hidden_size)),
                  "norm": (self.norm.shape, (c.hidden_size,))}
        for i, layer in enumerate(self.layers):
            dims = {"wq": (c.q_size, c.hidden_size), "wk": (c.kv_size, c.hidden_size),
                    "wv": (c.kv_size, c.hidden_size), "wo": (c.hidden_size, c.q_size),
                    "w_gate": (c.ffn_size, c.hidden_size), "w_up": (c.ffn_size, c.hidden_size),
                    "w_down": (c.hidden_size, c.ffn_size)}
            for attr, want in dims.items():
                lin = getattr(layer, attr)
                expect[f"layers.{i}.{attr}"] = ((lin.out_features, lin.in_features), want)
            expect[f"layers.{i}.attn_norm"] = (layer.attn_norm.shape, (c.hidden_size,))
            expect[f"layers.{i}.ffn_norm"] = (layer.ffn_norm.shape, (c.hidden_size,))
        for name, (got, want) in expect.items():
            if tuple(got) != tuple(want):
                raise CorruptCheckpointError(
                    f"tensor {name} has shape {tuple(got)} but the config needs {tuple(want)}")

    def state_dict(self) -> dict[str, torch.Tensor]:
        """HF-named dense tensors (quantized linears are dequantized)."""
        sd = {"model.embed_tokens.weight": self.embed, "model.norm.weight": self.norm}
        if not self.config.tie_embeddings:
            sd["lm_head.weight"] = self.lm_head
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            sd[p + "input_layernorm.weight"] = layer.attn_norm
            sd[p + "post_attention_layernorm.weight"] = layer.ffn_norm
            for attr, path in LINEAR_NAMES:
                sd[p + path + ".weight"] = getattr(layer, attr).dense_weight()
        return sd


def random_state_dict(config: LlamaConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                      device: torch.device | str = "cpu", n_layers: int | None = None) -> dict[str, torch.Tensor]:
    """Seeded random HF-named weights with the scale of a trained model (std 1/sqrt(fan_in)).

    Norm weights are drawn around 1 so that they are never trivially ones. `n_layers` may cut the depth.
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    c = config

    def rnd(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(device=device, dtype=dtype)

    def norm() -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(c.hidden_size, generator=g)).to(device=device, dtype=dtype)

    h = c.hidden_size
    sd = {"model.embed_tokens.weight": rnd(c.vocab_size, h, std=1.0), "model.norm.weight": norm()}
    if not c.tie_embeddings:
        sd["lm_head.weight"] = rnd(c.vocab_size, h, std=1 / math.sqrt(h))
    shapes = {"self_attn.q_proj": (c.q_size, h), "self_attn.k_proj": (c.kv_size, h),
              "self_attn.v_proj": (c.kv_size, h), "self_attn.o_proj": (h, c.q_size),
              "mlp.gate_proj": (c.ffn_size, h), "mlp.up_proj": (c.ffn_size, h), "mlp.down_proj": (h, c.ffn_size)}
    for i in range(c.n_layers if n_layers is None else n_layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = norm()
        sd[p + "post_attention_layernorm.weight"] = norm()
        for path, (n, k) in shapes.items():
            sd[p + path + ".weight"] = rnd(n, k, std=1 / math.sqrt(k))
    return sd


def get_tensor(sd: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    """sd[name], or one line naming the missing tensor (every checkpoint reader goes through it)."""
    try:
        return sd[name]
    except KeyError:
        raise CorruptCheckpointError(f"checkpoint lacks the tensor {name!r}") from None
