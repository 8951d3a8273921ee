"""SmoothQuant: move activation outliers into the weights with a per-channel scale folded into the RMSNorm.

For a linear y = x W^T fed by a norm, x' = x / s and W' = W * s give the same y; with
s_j = max|x_j|^alpha / max|W[:, j]|^(1 - alpha) the outlier channels of x shrink and the weights
absorb them, so per-token int8 activations lose less (Xiao et al. 2023; mit-han-lab smoothquant
`smooth_ln_fcs`). alpha 0 leaves the activations alone, 1 puts all the range into the weights.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from model_zoo.errors import ConfigError
from model_zoo.linear import DenseLinear
from model_zoo.weights import LayerWeights

SCALE_MIN = 1e-5  # an all-zero channel (activation or weight) still gets a finite, positive scale


def smooth_scales(act_max: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """act_max [K] (max |x| per input channel) and the weights [N_i, K] reading x -> s [K] fp32.

    s_j = act_max_j^alpha / (max_i max_n |W_i[n, j]|)^(1 - alpha); linears sharing an input share one s.
    """
    _check_alpha(alpha)
    if act_max.dim() != 1:
        raise ConfigError(f"act_max must be one value per input channel [K], got shape {tuple(act_max.shape)}")
    k = act_max.shape[0]
    if not weights:
        raise ConfigError("smoothing needs at least one weight reading the activation")
    for w in weights:
        if w.dim() != 2 or w.shape[1] != k:
            raise ConfigError(f"weight of shape {tuple(w.shape)} does not read {k} input channels")
    w_max = torch.stack([w.detach().float().abs().amax(dim=0) for w in weights]).amax(dim=0)  # [K]
    a = act_max.detach().float().clamp(min=SCALE_MIN)  # [K]
    s = a.pow(alpha) / w_max.clamp(min=SCALE_MIN).pow(1.0 - alpha)  # [K]
    return s.clamp(min=SCALE_MIN)


def apply_smoothing(layer: LayerWeights, qkv_act_max: torch.Tensor, gate_up_act_max: torch.Tensor,
                    alpha: float, down_act_max: torch.Tensor | None = None) -> LayerWeights:
    """A new LayerWeights computing the same function, with smoothed q/k/v and gate/up inputs, and with
    `down_act_max` also the down_proj input.

    The act maxima are those of the "qkv", "gate_up" (and "down") capture points of the unsmoothed layer.
    q/k/v and gate/up take 1/s into the preceding RMSNorm weight (mit-han-lab's smoothing of LLaMA). down_proj's
    input silu(gate) * up is linear in up, so 1/s folds exactly into up_proj's output rows — this matters on
    models whose down_proj inputs carry the largest outliers (SmolLM2: 20-100x the bulk). o_proj is left alone:
    folding into v_proj's rows is exact only when every query head has its own KV head (MHA), not under GQA.
    """
    _check_alpha(alpha)
    attn = ("wq", "wk", "wv")
    mlp = ("w_gate", "w_up")
    s_attn = smooth_scales(qkv_act_max, [getattr(layer, a).dense_weight() for a in attn], alpha)  # [H]
    s_mlp = smooth_scales(gate_up_act_max, [getattr(layer, a).dense_weight() for a in mlp], alpha)  # [H]
    changed = {"attn_norm": _divide(layer.attn_norm, s_attn), "ffn_norm": _divide(layer.ffn_norm, s_mlp)}
    for attrs, s in ((attn, s_attn), (mlp, s_mlp)):
        for a in attrs:
            changed[a] = DenseLinear(_scale_columns(getattr(layer, a).dense_weight(), s))
    if down_act_max is not None:
        s_down = smooth_scales(down_act_max, [layer.w_down.dense_weight()], alpha)  # [F]
        up = changed["w_up"].dense_weight()  # [F, H], already scaled by s_mlp along its columns
        changed["w_up"] = DenseLinear(_divide(up.T, s_down).T.contiguous())  # rows / s_down
        changed["w_down"] = DenseLinear(_scale_columns(layer.w_down.dense_weight(), s_down))
    return replace(layer, **changed)


def _divide(norm_weight: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    ct = torch.promote_types(norm_weight.dtype, torch.float32)  # fold in at least fp32, store as before
    return (norm_weight.to(ct) / s.to(norm_weight.device, ct)).to(norm_weight.dtype)  # [H]


def _scale_columns(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    ct = torch.promote_types(w.dtype, torch.float32)
    return (w.to(ct) * s.to(w.device, ct)[None, :]).to(w.dtype)  # [N, K]


def _check_alpha(alpha: float) -> None:
    if not 0.0 <= float(alpha) <= 1.0:
        raise ConfigError(f"SmoothQuant alpha must be in [0, 1], got {alpha}")
