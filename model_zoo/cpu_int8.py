"""Exact products of int8 codes on a CPU, for the CPU backend's Int8Op (model_zoo/cpu_ops.py): activation codes
q [M, K] (integers in -127..127, held in fp32) times weight codes [N, K] -> q @ codes^T [M, N], every sum exact
(int32), so the dequant epilogue that follows gives Int8Linear's outputs bit for bit.

Two kernels, chosen at load: FBGEMM's int8 GEMM (x86 builds) where a probe shows it sums exactly here, else
torch._int_mm. FBGEMM's (quantized.linear_dynamic) quantizes its fp32 input itself, per tensor, from the input's
min and max: two sentinel inputs, -128 and 127, against zero weights make that range 255 wide, so its scale is
1.0, its zero point 128 and its uint8 codes q + 128 exactly; with weight scales of 1.0 its fp32 output is
float(the int32 sum). Its u8 x s8 products are summed in int32 by AVX512-VNNI; a CPU without VNNI would pair
them through saturating int16 (255 * 127 * 2 > 32767), which the probe detects. SmolLM2's 30 layers, one row,
one thread: 9.9 ms against 12.2 on torch._int_mm (and 12.2 for the same weights in fp16 on FBGEMM).
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch

_SENTINELS = (-128.0, 127.0)  # the codes' range as FBGEMM must see it: scale (127 + 128) / 255 = 1, zero point 128


def int8_products(codes: torch.Tensor):
    """The exact product op of weight codes [N, K] int8: FBGEMM's where exact here, else torch._int_mm's."""
    return FbgemmInt8(codes) if fbgemm_int8_exact() else IntMM(codes)


class IntMM:
    """q [M, K] @ codes^T on torch._int_mm: int32 [M, N], exact."""

    def __init__(self, codes: torch.Tensor):
        self.codes_t = codes.T  # [K, N], a view: what _int_mm multiplies by

    def row(self) -> torch.Tensor:
        """Where one row's codes may be written (fp32 [1, K])."""
        return torch.empty(1, self.codes_t.shape[0])

    def __call__(self, q: torch.Tensor) -> torch.Tensor:
        return torch._int_mm(q.to(torch.int8), self.codes_t)  # [M, N] int32


class FbgemmInt8:
    """q [M, K] @ codes^T on FBGEMM's int8 GEMM: fp32 [M, N] holding the exact int32 sums (see the module doc)."""

    def __init__(self, codes: torch.Tensor):
        n, self.k = codes.shape
        wide = torch.cat([codes, codes.new_zeros(n, len(_SENTINELS))], dim=1)  # [N, K + 2]
        with warnings.catch_warnings(), _fbgemm_engine():
            warnings.simplefilter("ignore")  # torch deprecates quantized tensors; this one only carries the codes
            qw = torch._make_per_channel_quantized_tensor(wide, torch.ones(n, dtype=torch.double),
                                                          torch.zeros(n, dtype=torch.long), 0)
            self.packed = torch.ops.quantized.linear_prepack(qw, None)
        self.sentinels = torch.tensor([_SENTINELS])  # [1, 2]
        self._row = torch.cat([torch.zeros(1, self.k), self.sentinels], dim=1)  # [1, K + 2]: one row's input
        self._codes = self._row[:, :self.k]  # [1, K], a view made once (a slice is an op a call)

    def row(self) -> torch.Tensor:
        """Where one row's codes are written: a view of the input buffer that carries the sentinels."""
        return self._codes

    def __call__(self, q: torch.Tensor) -> torch.Tensor:
        if q.shape[0] == 1 and q.data_ptr() == self._row.data_ptr():
            x = self._row  # the codes were written in place (row())
        else:
            x = torch.cat([q, self.sentinels.expand(q.shape[0], -1)], dim=1)  # [M, K + 2]
        return torch.ops.quantized.linear_dynamic(x, self.packed, False)  # [M, N] fp32, exact integers


@contextlib.contextmanager
def _fbgemm_engine():
    """Prepack for FBGEMM (the packed weight keeps its kernel), then restore torch's quantized engine."""
    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = "fbgemm"
    try:
        yield
    finally:
        torch.backends.quantized.engine = before


@functools.cache
def fbgemm_int8_exact() -> bool:
    """Whether this torch has FBGEMM and its int8 sums are exact on this CPU: probed once on the worst case
    (every code at +-127, where int16 pairs would saturate) against the exact sums."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    codes = torch.full((4, 64), 127, dtype=torch.int8)  # [N, K]
    codes[1], codes[3, ::3] = -127, -127
    q = torch.full((2, 64), 127.0)  # [M, K]
    q[1, ::2] = -127.0
    want = (q.double() @ codes.double().T).float()  # [2, 4], exact
    try:
        op = FbgemmInt8(codes)
        op.row().copy_(q[1:])
        return torch.equal(op(q), want) and torch.equal(op(op.row()), want[1:])
    except (RuntimeError, AttributeError):  # a torch whose quantized ops differ: torch._int_mm it is
        return False
