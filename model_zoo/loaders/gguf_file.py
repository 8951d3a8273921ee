"""GGUF checkpoints (llama.cpp): config from metadata, every tensor dequantized to HF names and layout.

Two layout facts: the reader's numpy view of a 2-D tensor is [rows, cols] = HF [out, in] (GGUF lists dims
innermost first), and llama.cpp's converter permutes the rows of Q and K within each head (HF's rotate-half
RoPE -> interleaved pairs), which unpermute_qk undoes.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, Mapping

import gguf
import numpy as np
import torch

from model_zoo.config import LlamaConfig
from model_zoo.errors import CorruptCheckpointError, ModelSourceError, UnsupportedArchitectureError
from model_zoo.gguf_meta import GGUFTensor, read_gguf
from model_zoo.rope import RopeScaling, llama3_from_factors
from model_zoo.loaders.loaded_model import LoadedModel
from model_zoo.loaders.tensors import check_state_dict, cut_config, wanted
from model_zoo.tokenizer import Tokenizer

ROPE_FREQS = "rope_freqs.weight"  # Llama-3.1's RoPE scaling, as llama.cpp writes it
LLAMA3_CONTEXT = 8192  # Llama-3's pre-training context, the llama3 scaling's original_max_position_embeddings
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(gguf_name: str) -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; None for tensors LLaMA lacks."""
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    if len(parts) == 1 and parts[0] in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[parts[0]]}.{suffix}"
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{suffix}"
    return None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's row order for Q (n_head = heads) or K (n_head = KV heads): w [rows, cols]."""
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def gguf_config(meta: Mapping[str, Any], tensors: list[GGUFTensor]) -> LlamaConfig:
    """LlamaConfig from decoded metadata (and Llama-3's RoPE frequency factors); refuses what the llama reference
    model cannot run."""
    try:
        config = LlamaConfig.from_gguf(meta)
    except KeyError as e:
        raise CorruptCheckpointError(f"GGUF metadata lacks {e.args[0]!r}") from None
    if meta.get("llama.expert_count"):
        raise UnsupportedArchitectureError("mixture-of-experts llama GGUF files are not supported")
    names = [t.name for t in tensors]
    if ROPE_FREQS in names:
        config = config.replace(rope_scaling=_llama3_rope(meta, tensors[names.index(ROPE_FREQS)], config))
    return config.replace(tie_embeddings="output.weight" not in names)


def _llama3_rope(meta: Mapping[str, Any], t: GGUFTensor, config: LlamaConfig) -> RopeScaling:
    """llama.cpp writes Llama-3.1's RoPE scaling as a divisor per frequency: the llama3 scaling that gives them."""
    if config.rope_scaling is not None:
        raise UnsupportedArchitectureError("the GGUF file has both a RoPE scaling type and rope_freqs.weight")
    factors = torch.from_numpy(np.array(_dequantize(t, config), dtype=np.float32)).reshape(-1)  # [d/2]
    original = int(meta.get("llama.rope.scaling.original_context_length") or LLAMA3_CONTEXT)
    scaling = llama3_from_factors(factors, config.head_dim, config.rope_theta, original)
    if scaling is None:
        raise UnsupportedArchitectureError("the GGUF file's RoPE frequency factors (rope_freqs.weight) are not "
                                           "Llama-3's (low/high freq factors 1 and 4); fllama cannot compute them")
    return scaling


def read_gguf_config(path: Path) -> LlamaConfig:
    f = read_gguf(path)
    return gguf_config(f.meta, f.tensors)


def load_gguf(path: Path, *, dtype: torch.dtype, n_layers: int | None = None, source: str | None = None,
              kind: str = "gguf", shapes_only: bool = False) -> LoadedModel:
    """shapes_only: the state dict holds meta tensors of the dequantized shapes (nothing is dequantized)."""
    f = read_gguf(path)
    meta = f.meta
    config = cut_config(gguf_config(meta, f.tensors), n_layers)
    sd, types = {}, Counter()
    unknown = [t.name for t in f.tensors if hf_name(t.name) is None and t.name != ROPE_FREQS]
    if unknown:
        raise UnsupportedArchitectureError(f"the GGUF file holds tensors a LLaMA model has no place for: "
                                           f"{', '.join(unknown[:3])} (refusing rather than ignoring them)")
    for t in f.tensors:
        name = hf_name(t.name)
        if name is None or not wanted(name, n_layers):
            continue
        if name.endswith(".bias"):
            raise UnsupportedArchitectureError(f"the GGUF file has a bias ({t.name}); LLaMA layers have none")
        if shapes_only:
            sd[name] = torch.empty(tuple(reversed(t.shape)), dtype=dtype, device="meta")
        else:
            sd[name] = torch.from_numpy(_dequantize(t, config)).to(dtype)
        if len(t.shape) == 2:
            types[t.tensor_type.name] += 1
    check_state_dict(config, sd, quantized=False)
    info = {"quantization_config": None, "fllama": None, "dtype": types.most_common(1)[0][0] if types else "unknown",
            "gguf_file_type": _file_type(meta.get("general.file_type")), "gguf_tensor_types": dict(types),
            "gguf_name": meta.get("general.name"), "file": str(path)}
    return LoadedModel(config=config, tokenizer=Tokenizer.from_gguf(meta), state_dict=sd,
                       source=source or str(path), kind=kind, meta=info)


def _dequantize(t: GGUFTensor, config: LlamaConfig) -> np.ndarray:
    try:
        w = gguf.quants.dequantize(t.data, t.tensor_type)  # float32 [rows, cols] (or [n] for norms)
    except NotImplementedError:
        raise ModelSourceError(f"tensor {t.name} has GGUF type {t.tensor_type.name}, which the gguf package "
                               "cannot dequantize") from None
    except ValueError as e:
        raise CorruptCheckpointError(f"tensor {t.name} cannot be dequantized ({e})") from None
    expected = tuple(reversed(t.shape))
    if w.shape != expected:
        raise CorruptCheckpointError(f"tensor {t.name} dequantizes to {w.shape}, expected {expected}")
    if ".attn_q." in t.name:
        w = unpermute_qk(w, config.n_heads)
    elif ".attn_k." in t.name:
        w = unpermute_qk(w, config.n_kv_heads)
    # F32 tensors come back as views of the read-only memory map: copy those so torch owns writable memory
    return np.array(w, dtype=np.float32, order="C", copy=not w.flags.writeable or None)


def _file_type(value: Any) -> str | None:
    if value is None:
        return None
    try:
        return gguf.LlamaFileType(int(value)).name
    except ValueError:
        return str(value)
