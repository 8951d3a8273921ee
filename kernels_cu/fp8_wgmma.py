"""FP8 E4M3 W8A8 prefill GEMM on Hopper, the scales in the epilogue (fp8_gemm runs it above fp8_gemv_max_m rows).

    y[m, n] = fp16((acc * a_scale[m]) * w_scale[n])   (+ residual[m, n]),   acc = fp32 sum of x8[m, k] * w8[n, k]

Two ways, `launch` picks: cuBLASLt's fp8 GEMM through torch._scaled_mm (row-wise fp32 scales, fp16 output, exact
accumulation; the residual add or silu_mul after it) where this torch takes those scales (`library_takes`, probed once)
and tuning.fp8_prefill_library; else the wgmma kernel fp8_wgmma.cu, epilogues fused: a producer thread copies the
tiles by TMA into a ring of shared-memory stages, two consumer warpgroups run wgmma e4m3 (twice the fp16 rate) with
two-level accumulation: each 128-k stage is summed by the tensor cores from zero in chunk rounds (their e4m3
accumulator keeps only ~14 bits) and added into fp32 registers; with two chunk sets a round's adds run under the next
round's wgmma. The references are fp8_contract.fp8_gemm_ref / fp8_swiglu_ref.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels_cu import build, tensor_map, tuning
from kernels_cu.gemm_shapes import cdiv, sm_count
from kernels_cu.silu_mul import silu_mul_interleaved

BM, BK = 128, 128  # tokens per block, k codes per stage: fp8_wgmma.cu
THREADS = 384  # two consumer warpgroups and a producer warpgroup
SIGNATURE = "PPPiPPPiii"  # y, x8, a_scale, a_stride, w8, w_scale, residual, M, N, K (fp8_gemm's GEMVs too)
KERNEL_SIGNATURE = SIGNATURE  # the same with the tensor maps of x8 and w8 in place of x8 and w8


@dataclass(frozen=True)
class Variant:
    """A compiled tile of fp8_wgmma.cu: bn channels a block, each stage's 128 k's in `rounds` chunk rounds of
    bn / rounds channels, `chunks` chunk register sets (2: a round's adds overlap the next round), `stages` slots;
    `rs`: x read into registers once a stage (ldmatrix) and fed to every round from there, else every round reads
    it from shared memory again."""

    bn: int
    rounds: int
    chunks: int
    stages: int
    rs: bool = False
    speed: float = 1.0  # relative throughput of a full wave (H200, M = 2048), which `choose` weighs against idle SMs

    def __post_init__(self):
        if self.bn % (16 * self.rounds) or self.bn // self.rounds not in (64, 96, 128):
            raise ValueError(f"fp8_wgmma: a chunk round of {self.bn} // {self.rounds} channels has no wgmma here")
        if self.chunks not in (1, 2) or (self.chunks == 2 and self.rounds % 2):
            raise ValueError(f"fp8_wgmma: {self.chunks} chunk sets need an even number of rounds")
        if self.bn // 2 + self.chunks * self.bn // self.rounds // 2 + 16 * self.rs > 208:
            raise ValueError(f"fp8_wgmma: acc, {self.chunks} chunk sets and x need more than 208 registers")
        if self.stages - 2 < 1 or self.smem_bytes() > 227 * 1024:
            raise ValueError(f"fp8_wgmma: {self.stages} stages of 128 x {self.bn} do not fit")

    def options(self) -> tuple[str, ...]:
        return (f"-DFLLAMA_FP8_WGMMA_BN={self.bn}", f"-DFLLAMA_FP8_WGMMA_ROUNDS={self.rounds}",
                f"-DFLLAMA_FP8_WGMMA_CHUNKS={self.chunks}", f"-DFLLAMA_FP8_WGMMA_STAGES={self.stages}",
                f"-DFLLAMA_FP8_WGMMA_RS={int(self.rs)}")

    def smem_bytes(self) -> int:
        """The stages, their two mbarriers each, the 1024-byte alignment of the swizzled tiles (SMEM_BYTES)."""
        return self.stages * (BM + self.bn) * BK + 16 * self.stages + 1024


# Speeds: H200, 2048 tokens, LLaMA-2-7B's four linears, throughput over a wave's work against r256q's (r256q: 922, 900,
# 891 and 1,063 TFLOP/s on q|k|v, o, gate|up and down; n192: 924, 838, 908, 983; n256q: 894, 888, 882, 1,019; cuBLAS
# fp16 617-682). So n192 takes q|k|v and gate|up, r256q o and down. Ties go to the first.
VARIANTS = {
    "n192": Variant(192, 2, 2, 5, speed=1.016),  # two n96 rounds a stage, the first one's adds under the second
    "r256q": Variant(256, 4, 2, 4, rs=True),      # four n64 rounds, three of four adds under the next; x in registers
    "n256q": Variant(256, 4, 2, 4, speed=0.976),  # the same with x from shared memory every round
}


def choose(m: int, n: int, sms: int) -> str:
    """The variant with the least estimated time on `sms` SMs: waves of blocks (a partial wave costs a whole one)
    times a block's work (bn), over its measured speed."""

    def cost(v: Variant) -> float:
        return cdiv(cdiv(m, BM) * cdiv(n, v.bn), sms) * v.bn / v.speed

    return min(VARIANTS, key=lambda name: cost(VARIANTS[name]))


def takes(x8: torch.Tensor, n: int) -> bool:
    """Whether fp8_gemm uses this kernel: a Hopper GPU and more rows than the GEMV takes (tuning.fp8_gemv_max_m);
    N % 16 == 0 (the SwiGLU epilogue's panels; every LLaMA width is)."""
    if not (x8.is_cuda and x8.shape[0] > tuning.current().fp8_gemv_max_m and n % 16 == 0):
        return False
    return build.has_wgmma(x8.device.index or 0)


def library_runs(x8: torch.Tensor, n: int) -> bool:
    """Whether fp8_gemm's product of x8 [M, K] and n channels runs on cuBLASLt: a Hopper GPU whose torch takes the
    contract (library_takes), tuning.fp8_prefill_library, and more rows than the GEMV takes or at least
    tuning.fp8_library_min_m."""
    t = tuning.current()
    M = x8.shape[0]
    rows = M > t.fp8_gemv_max_m or M >= t.fp8_library_min_m
    if not (x8.is_cuda and t.fp8_prefill_library and n % 16 == 0 and rows):
        return False
    dev = x8.device.index or 0
    return build.has_wgmma(dev) and library_takes(dev)


def library_takes(device_index: int) -> bool:
    """Whether this device's torch._scaled_mm computes the contract: e4m3 x e4m3 with row-wise fp32 scales (per token
    x per channel), fp16 output written into a given tensor, fp32 accumulation (use_fast_accum=False). Probed once
    per device with a small product checked against the reference (outside a CUDA-graph capture, which cannot
    synchronize: until then the kernel runs)."""
    if device_index not in _library_ok:
        if torch.cuda.is_current_stream_capturing():
            return False
        _library_ok[device_index] = _probe_library(torch.device("cuda", device_index))
    return _library_ok[device_index]


_library_ok: dict[int, bool] = {}  # device index -> library_takes' answer


def _probe_library(dev: torch.device) -> bool:
    """All-positive products over K = 4096: an accumulator that truncates (e4m3 wgmma's own, "fast accumulation")
    drifts ~1% here, far outside the bound."""
    g = torch.Generator(device=dev).manual_seed(0)
    x8 = (torch.randn(80, 4096, device=dev, generator=g).abs() * 8).to(torch.float8_e4m3fn)  # [80, 4096]
    w8 = (torch.randn(48, 4096, device=dev, generator=g).abs() * 8).to(torch.float8_e4m3fn)  # [48, 4096]
    a, ws = torch.rand(80, device=dev) * 1e-3 + 1e-3, torch.rand(48, device=dev) * 1e-3 + 1e-3  # outputs ~0.4
    y = torch.empty(80, 48, dtype=torch.float16, device=dev)
    try:
        _scaled_mm(y, x8, a, 1, w8, ws)
    except (RuntimeError, TypeError, ValueError):
        return False
    want = ((x8.float().double() @ w8.float().double().t()) * a.double()[:, None] * ws.double()[None, :]).half()
    return bool(torch.allclose(y.float(), want.float(), rtol=2e-3, atol=0.0))


def _scaled_mm(y: torch.Tensor, x8: torch.Tensor, a_scale: torch.Tensor, a_stride: int, w8: torch.Tensor,
               w_scale: torch.Tensor) -> None:
    """y fp16 [M, N] = fp16((x8 w8^T) a_scale[m] w_scale[n]) by cuBLASLt (torch._scaled_mm, row-wise scales)."""
    M = x8.shape[0]
    sa = a_scale.reshape(-1, 1) if a_stride else a_scale.reshape(1, 1).expand(M, 1).contiguous()  # [M, 1]
    torch._scaled_mm(x8, w8.t(), scale_a=sa, scale_b=w_scale.reshape(1, -1), out_dtype=torch.float16,
                     use_fast_accum=False, out=y)


def _library(y: torch.Tensor, x8: torch.Tensor, a_scale: torch.Tensor, a_stride: int, w8: torch.Tensor,
             w_scale: torch.Tensor, residual: torch.Tensor | None, epilogue: str) -> None:
    """The GEMM by cuBLASLt, then the residual (an fp16 add, in place when y is the residual) or the SwiGLU of the
    interleaved gate|up product (silu_mul.cu), as the kernel's epilogues round them."""
    if epilogue == "plain":
        _scaled_mm(y, x8, a_scale, a_stride, w8, w_scale)
        return
    t = torch.empty(x8.shape[0], w8.shape[0], dtype=torch.float16, device=x8.device)  # [M, N]
    _scaled_mm(t, x8, a_scale, a_stride, w8, w_scale)
    if epilogue == "res":
        torch.add(t, residual, out=y)
    else:
        silu_mul_interleaved(t, out=y)


def launch(y: torch.Tensor, x8: torch.Tensor, a_scale: torch.Tensor, a_stride: int, w8: torch.Tensor,
           w_scale: torch.Tensor, residual: torch.Tensor | None, epilogue: str, variant: str | None = None) -> None:
    """y fp16 [M, N] (epilogue "silu": [M, N / 2]) = the GEMM; fp8_gemm checks the arguments, makes y and calls
    this inside `build.on_stream()` with M, N > 0. epilogue: "plain", "res" (with residual) or "silu". variant: a
    key of VARIANTS (tests, benchmarks) or "library" (torch._scaled_mm, where library_takes); None: the library
    where tuning.fp8_prefill_library and library_takes say so, else the tile `choose` takes for the shape."""
    M, K = x8.shape
    N = w8.shape[0]
    dev = x8.device.index or 0
    if variant == "library":
        _library(y, x8, a_scale, a_stride, w8, w_scale, residual, epilogue)
        return
    if variant is None and tuning.current().fp8_prefill_library and library_takes(dev):
        try:
            _library(y, x8, a_scale, a_stride, w8, w_scale, residual, epilogue)
            return
        except RuntimeError:  # a shape this torch's _scaled_mm declines (its checks run before any launch)
            pass
    v = VARIANTS[variant or choose(M, N, sm_count(dev))]
    fn = build.get_function("fp8_wgmma.cu", f"fp8_wgmma_{epilogue}", KERNEL_SIGNATURE, v.options())
    xmap = tensor_map.device_map(x8.view(torch.uint8), BK, BM)  # boxes of 128 k x a tile's rows
    wmap = tensor_map.device_map(w8.view(torch.uint8), BK, v.bn)
    fn((cdiv(M, BM) * cdiv(N, v.bn),), (THREADS,), y, xmap, a_scale, a_stride, wmap, w_scale, residual, M, N, K,
       shared=v.smem_bytes())  # a block a tile, tokens fastest
