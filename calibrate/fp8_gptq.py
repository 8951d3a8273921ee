"""fp8 weights rounded onto e4m3's grid by GPTQ (calibrate/gptq_round.py; Frantar et al. 2022, on a float grid).

The format does not change: codes float8_e4m3fn [N, K] and one fp32 scale per output channel, given (amax / 448,
or calibrate/fp8_scale.py's search). Only which e4m3 value each weight takes changes. e4m3 keeps three mantissa
bits (a relative step of 1/8), so round-to-nearest moves every weight by up to 1/16 of itself; the compensation
cancels much of what that does to the outputs.
"""

from __future__ import annotations

import torch

from calibrate.gptq_round import GptqConfig, gptq_round
from model_zoo.quant.fp8 import quantize_weight_fp8, to_e4m3


@torch.no_grad()
def gptq_fp8(w: torch.Tensor, h: torch.Tensor, cfg: GptqConfig = GptqConfig(),
             scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] and H [K, K] -> (w8 float8_e4m3fn [N, K], w_scale fp32 [N]), W ~ float(w8) * w_scale[:, None];
    the scale is round-to-nearest's (amax / 448) unless given, the codes minimise ||(W - W8) X|| column by column."""
    if scale is None:
        _, scale = quantize_weight_fp8(w)  # [N]
    work = w.detach().float().cpu() / scale[:, None].cpu()  # [N, K] in code units: errors are pushed here
    codes = gptq_round(work, h, lambda col, _j: to_e4m3(col).float(), cfg)  # [N, K]
    return to_e4m3(codes), scale  # the codes are e4m3 values already: the cast is exact
