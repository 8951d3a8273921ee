"""The e4m3 grid as the range functions see it: what an amax costs when activations become float8_e4m3fn.

With amax a the scale is s = a / 448 and a value x is stored as s * e4m3(clamp(x / s, -448, 448)): relative
rounding of 2^-4 (normals), absolute steps of 2^-9 s near zero (subnormals), and saturation above a. The int8
grid's levels are uniform, so a histogram whose bins are much narrower than a level can take each value at its
bin centre (pytorch-quantization does); e4m3's steps near zero are far narrower than a bin, so here each bin's
values are taken as uniform within it and its expected squared error is integrated exactly over the grid's
rounding cells (`expected_sq_error`). The entropy search's levels are the grid's values (`level_starts`).
"""

from __future__ import annotations

import numpy as np
import torch

from model_zoo.quant.fp8 import FP8_DTYPE, FP8_MAX, to_e4m3

_CHUNK = 1 << 20  # candidate x bin cells per block of the direct path (float64 temporaries of 8 MiB each)


def _grid() -> np.ndarray:
    """The non-negative finite e4m3 values, ascending: 0, 2^-9, ..., 448 (127 values)."""
    vals = torch.arange(0, 0x7F, dtype=torch.uint8).view(FP8_DTYPE).double().numpy()  # 0x7F is NaN
    return np.unique(vals)


GRID = _grid()  # [127]
_MID = (GRID[1:] + GRID[:-1]) / 2  # [126] rounding boundaries (ties go to even; measure zero here)
_LO = np.concatenate([[0.0], _MID])  # [127] each cell's lower end, in code units
_HI = np.concatenate([_MID, [np.inf]])  # [127] upper ends; the last cell saturates to 448
# integral of (t - q(t))^2 over each whole cell below cell k, cumulative
_FULL = ((_HI[:-1] - GRID[:-1]) ** 3 - (_LO[:-1] - GRID[:-1]) ** 3) / 3  # [126]
_CUM = np.concatenate([[0.0], np.cumsum(_FULL)])  # [127]


def _integral(t: np.ndarray) -> np.ndarray:
    """F(t) = integral over [0, t] of (u - q(u))^2 du, q rounding to the e4m3 grid with saturation (t >= 0)."""
    k = np.searchsorted(_MID, t, side="right")  # cell of each t
    g = GRID[k]
    return _CUM[k] + ((t - g) ** 3 - (_LO[k] - g) ** 3) / 3


def expected_sq_error(edges: np.ndarray, amax: np.ndarray) -> np.ndarray:
    """[m, n]: the mean squared error of x in bin j (uniform over [edges[j], edges[j+1]]) stored with amax[i]."""
    s = amax[:, None] / FP8_MAX  # [m, 1]
    t = edges[None, :] / s  # [m, n + 1] the edges in code units
    width = np.maximum(np.diff(t, axis=1), 1e-300)  # [m, n]
    return s * s * np.diff(_integral(t), axis=1) / width  # [m, n]


def mse_curve(h: np.ndarray, e: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """[m]: count-weighted mean squared e4m3 error of the histogram for amax = the centre of each candidate bin
    (a common positive factor aside, which no argmin sees)."""
    table = _mse_table(h.size) if _uniform_from_zero(e) else None
    if table is None:
        return _mse_direct(h, e, (e[cand] + e[cand + 1]) / 2)
    hf = torch.from_numpy(h.astype(np.float32))
    return (torch.from_numpy(table[cand, : h.size]) @ hf).double().numpy()  # [m], in units of w^2 / 448^3


_TABLE_MAX = 4096  # table side, as int8's; a histogram grown past it (rare) is computed directly
_tables: dict[str, np.ndarray] = {}


def _mse_table(n: int) -> np.ndarray | None:
    """T[i, j] = (i + 1/2)^3 (F(448 (j+1) / (i+1/2)) - F(448 j / (i+1/2))): with edges k w, bin j's error with
    amax = centre i is w^2 T[i, j] / 448^3, so one table serves every histogram. Its side grows in steps of 1024
    with the histograms (HistogramCollector's grow past 2048 bins); built once a side, ~1.5 s per 2048^2 cells;
    float32 (64 MiB at 4096): 7 significant digits are far more than an argmin over a histogram needs."""
    side = -(-n // 1024) * 1024
    if side > _TABLE_MAX:
        return None
    table = _tables.get("fp8")
    if table is None or table.shape[0] < side:
        c = np.arange(side) + 0.5  # [side] candidate centres in units of w
        table = np.empty((side, side), dtype=np.float32)
        for lo in range(0, side, 256):
            f = _integral(FP8_MAX * np.arange(side + 1)[None, :] / c[lo:lo + 256, None])  # [b, side + 1]
            table[lo:lo + 256] = c[lo:lo + 256, None] ** 3 * np.diff(f, axis=1)
        _tables["fp8"] = table
    return table


def _uniform_from_zero(e: np.ndarray) -> bool:
    width = e[-1] / (e.size - 1)
    return e[0] == 0 and bool(np.all(np.abs(e - np.arange(e.size) * width) <= 1e-9 * e[-1]))


def _mse_direct(h: np.ndarray, e: np.ndarray, amaxes: np.ndarray) -> np.ndarray:
    total = max(h.sum(), 1.0)
    per_block = max(1, _CHUNK // h.size)
    out = np.empty(amaxes.size)  # [m]
    for lo in range(0, amaxes.size, per_block):
        err = expected_sq_error(e, amaxes[lo:lo + per_block])  # [b, n]
        out[lo:lo + per_block] = err @ h / total
    return out


def level_starts(cand: np.ndarray) -> np.ndarray:
    """[m, L + 1]: with amax = edges[i] (i = cand, uniform edges from zero) the first bin whose centre rounds to
    each grid value (bin j's centre is 448 (j + 0.5) / i in code units), and i at the end."""
    i = cand[:, None].astype(np.float64)  # [m, 1]
    starts = np.ceil(_LO[None, :] * i / FP8_MAX - 0.5).clip(min=0)  # [m, L]
    starts = np.minimum(starts, i)
    return np.concatenate([starts, i], axis=1).astype(np.int64)  # [m, L + 1]


def fake_quant_fp8(x: torch.Tensor, amax: float | torch.Tensor) -> torch.Tensor:
    """x through e4m3 with amax (scale amax / 448) and back, in float32 math; amax 0 maps everything to 0."""
    a = torch.as_tensor(amax, dtype=torch.float32, device=x.device).clamp_min(1e-30)
    s = a / FP8_MAX
    return (to_e4m3(x.float() * (1.0 / s)).float() * s).to(x.dtype)


def sqnr_db_fp8_from_hist(h: np.ndarray, e: np.ndarray, amax: float) -> float:
    """SQNR of e4m3 with amax over the histogram, each bin's values uniform within it."""
    if amax <= 0:
        return -np.inf if h.sum() else np.inf
    signal = float((((e[1:] ** 3 - e[:-1] ** 3) / 3 / np.maximum(e[1:] - e[:-1], 1e-300)) * h).sum())
    noise = float(expected_sq_error(e, np.array([amax]))[0] @ h)
    if noise == 0.0:
        return np.inf
    return -np.inf if signal == 0.0 else 10.0 * np.log10(signal / noise)
