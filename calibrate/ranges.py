"""Range functions: pure functions from an |x| histogram (counts, edges) to an amax, plus int8 fake-quant.

On the int8 grid (the default) they follow NVIDIA pytorch-quantization's calib/histogram.py (REFERENCE.md
section 1), which users compare against: same candidates, same tie rules, same returned edge or centre. The loops
there are vectorised here (prefix sums for entropy, a candidates x bins matrix for MSE) so that 1920 candidates
over 2048 bins take milliseconds. On the fp8 grid (QuantGrid.FP8) MSE and entropy judge the same candidates by
e4m3's rounding and saturation instead (calibrate/fp8_grid.py). Histograms are read as float64 numpy arrays.
"""

from __future__ import annotations

import math
from typing import Union

import numpy as np
import torch

from calibrate import fp8_grid
from calibrate.methods import CalibConfig, CalibMethod, QuantGrid
from model_zoo.errors import ConfigError

ArrayLike = Union[np.ndarray, torch.Tensor]

INT8_MAX = 127
_MSE_CHUNK = 1 << 22  # candidate x bin cells per MSE block (32 MiB of float64)


def amax_max(hist: ArrayLike, edges: ArrayLike) -> float:
    """Upper edge of the last non-empty bin: the max |x|, rounded up to the bin width."""
    h, e = _as_numpy(hist, edges)
    nonzero = np.flatnonzero(h)
    return 0.0 if nonzero.size == 0 else float(e[nonzero[-1] + 1])


def amax_percentile(hist: ArrayLike, edges: ArrayLike, percentile: float = 99.99) -> float:
    """Left edge of the bin where the CDF of |x| reaches percentile / 100."""
    if not (0.0 < percentile <= 100.0):
        raise ConfigError(f"invalid percentile {percentile}: it must be in (0, 100]")
    h, e = _as_numpy(hist, edges)
    total = h.sum()
    if total == 0:
        return 0.0
    cdf = np.cumsum(h) / total  # [n] (counts sum exactly; cumsum(h / total) can stop one bin short)
    idx = int(np.searchsorted(cdf, percentile / 100.0))  # first bin with cdf >= p (may be n: the last edge)
    return float(e[idx])


def amax_mse(hist: ArrayLike, edges: ArrayLike, start_bin: int = 128, stride: int = 1, num_bits: int = 8,
             grid: QuantGrid = QuantGrid.INT8) -> float:
    """Centre of the bin i >= start_bin whose use as amax minimises the count-weighted fake-quant MSE
    (first one on ties). With no bin at or above start_bin: the last centre. int8: the MSE of the bin centres;
    fp8: the expected e4m3 error of each bin's values taken uniform within it."""
    h, e = _as_numpy(hist, edges)
    if e[-1] == 0 or h.sum() == 0:
        return 0.0
    centers = (e[1:] + e[:-1]) / 2  # [n]
    cand = np.arange(start_bin, centers.size, stride)  # [m] candidate bin indices
    if cand.size == 0:
        return float(centers[-1])
    if QuantGrid(grid) is QuantGrid.FP8:
        return float(centers[cand[int(np.argmin(fp8_grid.mse_curve(h, e, cand)))]])
    table = _mse_table(centers.size, num_bits) if _uniform_from_zero(e) else None
    if table is not None:
        rows = table[start_bin: centers.size: stride, : centers.size]  # [m, n] a view, not a copy
        # [m] in units of (w / 2)^2 * n (same argmin); torch's matrix-vector product beats numpy's ~5x here
        mses = (torch.from_numpy(rows) @ torch.from_numpy(h)).numpy()
    else:
        mses = _mse_direct(h, centers, cand, num_bits)
    return float(centers[cand[int(np.argmin(mses))]])


def _mse_direct(h: np.ndarray, centers: np.ndarray, cand: np.ndarray, num_bits: int) -> np.ndarray:
    """Count-weighted MSE of fake-quantizing the centres with amax = centers[i], for each candidate i."""
    qmax = float(2 ** (num_bits - 1) - 1)
    per_block = max(1, _MSE_CHUNK // centers.size)
    mses = np.empty(cand.size)  # [m]
    for lo in range(0, cand.size, per_block):
        amax = centers[cand[lo:lo + per_block], None]  # [b, 1]
        scale = qmax / amax  # [b, 1]
        q = np.clip(np.rint(centers[None, :] * scale), -qmax - 1, qmax)  # [b, n]
        mses[lo:lo + per_block] = ((q / scale - centers) ** 2 * h).mean(axis=1)  # [b]
    return mses


_MSE_TABLE_MAX = 4096  # table side; beyond it (a histogram grown past 2x) compute directly
_mse_cache: dict[int, np.ndarray] = {}


def _mse_table(n: int, num_bits: int) -> np.ndarray | None:
    """E[i, j] = squared fake-quant error of centre j with amax = centre i, in units of (w / 2)^2.

    With edges k * w the centres are (2k + 1) w / 2, so E depends on i and j only, never on w:
    one table (built once, ~60 ms) turns each MSE search into a matrix-vector product.
    """
    side = -(-n // 1024) * 1024
    if side > _MSE_TABLE_MAX:
        return None
    table = _mse_cache.get(num_bits)
    if table is None or table.shape[0] < side:
        qmax = 2 ** (num_bits - 1) - 1
        odd = 2.0 * np.arange(side) + 1  # [side] centres in units of w / 2
        # q never sits exactly on a half: qmax * odd_j / odd_i is odd over odd, so rint matches any rounding mode
        q = np.minimum(np.rint(qmax * odd[None, :] / odd[:, None]), qmax)  # [side, side]
        table = (q * odd[:, None] / qmax - odd[None, :]) ** 2  # [side, side]
        _mse_cache[num_bits] = table
    return table


def _uniform_from_zero(e: np.ndarray) -> bool:
    width = e[-1] / (e.size - 1)
    return e[0] == 0 and bool(np.all(np.abs(e - np.arange(e.size) * width) <= 1e-9 * e[-1]))


def amax_entropy(hist: ArrayLike, edges: ArrayLike, start_bin: int = 128, stride: int = 1, num_bits: int = 8,
                 grid: QuantGrid = QuantGrid.INT8) -> float:
    """TensorRT's KL calibration: amax = edges[i] for the i >= start_bin minimising KL(P || Q) (last on ties).

    P = hist[:i] with the tail hist[i:] folded into bin i-1 (saturation). Q = hist[:i] (before the fold, as in
    pytorch-quantization) merged into levels and spread back evenly over each level's non-empty bins: int8's
    2^(num_bits-1) uniform levels, or (fp8) the e4m3 values the bin centres round to with amax = edges[i].
    Bin 0 takes bin 1's count first (pytorch-quantization: a spike of exact zeros, e.g. after ReLU, must not
    steer the search). Edges must be uniform from zero (HistogramCollector's).
    """
    h, e = _as_numpy(hist, edges)
    if e[-1] == 0 or h.sum() == 0:
        return 0.0
    b = h.copy()
    if b.size > 1:
        b[0] = b[1]
    levels = 1 << (num_bits - 1)
    cand = np.arange(start_bin, b.size + 1, stride)  # [m] bins kept (i)
    if cand.size == 0:
        return float(e[-1])
    if QuantGrid(grid) is QuantGrid.FP8:
        kl = _kl_from_starts(b, cand, fp8_grid.level_starts(cand))  # [m]
    else:
        kl = _kl_divergences(b, cand, levels)  # [m]
    last_argmin = kl.size - 1 - int(np.argmin(kl[::-1]))
    return float(e[cand[last_argmin]])


def _kl_divergences(b: np.ndarray, cand: np.ndarray, levels: int) -> np.ndarray:
    """KL(P_i || Q_i) for every candidate i with int8's uniform levels, from prefix sums: O(candidates x levels)."""
    # bin j < i lies in level floor(j * levels / i), so level l starts at bin ceil(l * i / levels)
    ls = np.arange(levels + 1)  # [L + 1]
    starts = (ls[None, :] * cand[:, None] + levels - 1) // levels  # [m, L + 1]
    return _kl_from_starts(b, cand, starts)


def _kl_from_starts(b: np.ndarray, cand: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """KL(P_i || Q_i) for every candidate i, level l of candidate i covering bins [starts[i, l], starts[i, l+1])."""
    total = b.sum()
    cum = np.concatenate([[0.0], np.cumsum(b)])  # [n + 1] counts of bins < k
    nnz = np.concatenate([[0], np.cumsum(b > 0)])  # [n + 1] non-empty bins < k
    cum_xlogx = np.concatenate([[0.0], np.cumsum(_xlogx(b))])  # [n + 1]
    s = cum[starts[:, 1:]] - cum[starts[:, :-1]]  # [m, L] counts per level
    c = nnz[starts[:, 1:]] - nnz[starts[:, :-1]]  # [m, L] non-empty bins per level
    with np.errstate(divide="ignore", invalid="ignore"):
        q_level = np.where(c > 0, s / np.maximum(c, 1), 0.0)  # [m, L] Q on each non-empty bin of the level
        sum_b_log_q = np.where(c > 0, s * np.log(np.where(c > 0, q_level, 1.0)), 0.0).sum(axis=1)  # [m]
        rows = np.arange(cand.size)  # [m]
        last_level = (starts[:, :-1] <= (cand - 1)[:, None]).sum(axis=1) - 1  # [m] level of bin i-1 (starts rise)
        q_last = q_level[rows, last_level]  # [m]
        b_last = b[cand - 1]  # [m]
        tail = total - cum[cand]  # [m] mass folded into bin i-1
        sum_p_log_p = cum_xlogx[cand - 1] + _xlogx(b_last + tail)  # [m]
        sum_p_log_q = sum_b_log_q + np.where(tail > 0, tail * np.log(np.where(q_last > 0, q_last, 1.0)), 0.0)
        sum_q = cum[cand]  # [m]
        kl = (sum_p_log_p - sum_p_log_q) / total - math.log(total) + np.log(np.where(sum_q > 0, sum_q, 1.0))
    # P > 0 where Q = 0 (tail folded onto an empty bin) is infinite divergence; so is an empty Q
    # (pytorch-quantization gets NaN there and may pick it; an amax below all the data is never right)
    kl[(b_last == 0) & (tail > 0)] = np.inf
    kl[sum_q == 0] = np.inf
    return kl


def _xlogx(v: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(v > 0, v * np.log(np.where(v > 0, v, 1.0)), 0.0)


def compute_amax(method: CalibMethod | str, hist: ArrayLike, edges: ArrayLike, cfg: CalibConfig | None = None,
                 grid: QuantGrid = QuantGrid.INT8) -> float:
    """amax of one histogram under one method, with cfg's parameters, judged on `grid` (max and percentile
    do not depend on it)."""
    cfg = cfg or CalibConfig()
    method = CalibMethod.parse(method)
    if method is CalibMethod.MAX:
        return amax_max(hist, edges)
    if method is CalibMethod.PERCENTILE:
        return amax_percentile(hist, edges, cfg.percentile)
    if method is CalibMethod.MSE:
        return amax_mse(hist, edges, cfg.start_bin, cfg.stride, cfg.num_bits, grid)
    if method is CalibMethod.OUTPUT:
        raise ConfigError("the output calibrator reads the quantized model, not a histogram "
                          "(calibrate/fp8_act_range.py)")
    return amax_entropy(hist, edges, cfg.start_bin, cfg.stride, cfg.num_bits, grid)


def scale_from_amax(amax: float | torch.Tensor, grid: QuantGrid = QuantGrid.INT8) -> float | torch.Tensor:
    """Symmetric scale: x ~ q * scale with q in [-127, 127] (int8: amax / 127) or in [-448, 448] (fp8: amax / 448)."""
    return amax / (fp8_grid.FP8_MAX if QuantGrid(grid) is QuantGrid.FP8 else INT8_MAX)


def fake_quant(x: torch.Tensor, amax: float | torch.Tensor) -> torch.Tensor:
    """Quantize to symmetric int8 and back: q = clamp(round(x * 127 / amax), -127, 127); x_hat = q * amax / 127.

    torch.round rounds half to even, as CUDA's rint does in the kernels. amax is a float or a tensor
    broadcastable to x (e.g. [C] per channel); amax 0 maps everything to 0. Math in float32.
    """
    xf = x.float()
    a = torch.as_tensor(amax, dtype=torch.float32, device=x.device).clamp_min(1e-30)  # [] or [C]
    q = torch.clamp(torch.round(xf * (INT8_MAX / a)), -INT8_MAX, INT8_MAX)  # like x
    return (q * (a / INT8_MAX)).to(x.dtype)


def sqnr_db(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio 10 log10(sum x^2 / sum (x - x_hat)^2), in float64; inf if exact."""
    xd = x.double()
    signal = float((xd * xd).sum())
    noise = float(((xd - x_hat.double()) ** 2).sum())
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def sqnr_db_from_hist(hist: ArrayLike, edges: ArrayLike, amax: float, grid: QuantGrid = QuantGrid.INT8) -> float:
    """SQNR estimated from the histogram alone, for saved stats: int8 with every value at its bin centre; fp8
    with each bin's values uniform within it (e4m3's steps near zero are finer than a bin)."""
    h, e = _as_numpy(hist, edges)
    if QuantGrid(grid) is QuantGrid.FP8:
        return float(fp8_grid.sqnr_db_fp8_from_hist(h, e, float(amax)))
    centers = (e[1:] + e[:-1]) / 2  # [n]
    x_hat = fake_quant(torch.from_numpy(centers), amax).numpy()  # [n]
    signal = float((centers ** 2 * h).sum())
    noise = float(((x_hat - centers) ** 2 * h).sum())
    if noise == 0.0:
        return math.inf
    return -math.inf if signal == 0.0 else 10.0 * math.log10(signal / noise)


def _as_numpy(hist: ArrayLike, edges: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    h = _to_f64(hist)
    e = _to_f64(edges)
    if h.ndim != 1 or e.ndim != 1 or h.size == 0 or e.size != h.size + 1:
        raise ConfigError(f"a histogram needs counts [n] and edges [n + 1], got {h.shape} and {e.shape}")
    return h, e


def _to_f64(a: ArrayLike) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        return a.detach().to("cpu", torch.float64).numpy()
    return np.asarray(a, dtype=np.float64)
