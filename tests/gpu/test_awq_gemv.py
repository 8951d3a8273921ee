"""awq_gemv / awq_packed_dequantize (the engine's repacked AWQ layout) against float64 references.

The dequantizer must match model_zoo.quant.awq_pack.dequantize_awq bit for bit; the GEMV (which scales each group's
exact (q - z) . x sum in fp32 instead of rounding w_hat to fp16 first) is compared with the float64 product
of w_hat rounded to fp16, at the same tolerance as the AutoAWQ-layout kernel.
"""

import pytest
import torch

from tests.gpu.conftest import (GPU_STACK, SKIP_REASON, assert_equal, awq_tensors, check_gemm, check_swiglu, compare,
                                poison, randn)

if not GPU_STACK:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from model_zoo.quant.awq_pack import dequantize_awq, quantize_awq  # noqa: E402
from kernels_cu.awq_gemm import awq_gemm  # noqa: E402
from kernels_cu.awq_gemv import (SIGNATURE, THREADS, awq_gemv, awq_linear,  # noqa: E402
                                 awq_linear_ref, awq_packed_dequantize, gemv_warps, pack_for_gemv)
from kernels_cu.tuning import DEFAULT  # noqa: E402

GEMV_MAX_M = DEFAULT.awq_gemv_max_m
from kernels_cu import build  # noqa: E402
from kernels_cu.gemm_shapes import cdiv, sm_count  # noqa: E402
from kernels_cu.swiglu_layout import gate_up_order  # noqa: E402

pytestmark = pytest.mark.gpu

# (K, N, G): SmolLM2 (hidden 576: K padded to 640, groups of 64 / 192 / 32), LLaMA-2-7B with 128, odd tiles,
# one whole step (2048)
SHAPES = [(576, 1536, 64), (1536, 576, 32), (576, 576, 192), (4096, 4096, 128), (4096, 12288, 128),
          (11008, 4096, 128), (4096, 1024, 32), (11008, 1024, 64), (2048, 2048, 128)]


@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("K,N,G", SHAPES)
def test_dequantize_is_bitwise(K, N, G, swiglu):
    qweight, qzeros, scales = awq_tensors(K, N, G, seed=K + N + G)
    p = pack_for_gemv(qweight, qzeros, scales, swiglu=swiglu)
    w_hat = torch.empty(N, K, dtype=torch.float16, device="cuda")
    poison(w_hat)
    awq_packed_dequantize(p, out=w_hat)
    ref = dequantize_awq(qweight, qzeros, scales, G)  # [N, K]
    if swiglu:
        ref = ref[gate_up_order(N, ref.device)]
    assert_equal(w_hat, ref.contiguous(), f"K={K} N={N} G={G} swiglu={swiglu}")


@pytest.mark.parametrize("K,N,G", SHAPES)
@pytest.mark.parametrize("M", [1, 2, 8, 9, 16, 17, 32, 33, 64, 65, 300])
def test_linear_matches_reference(M, K, N, G):
    qweight, qzeros, scales = awq_tensors(K, N, G, seed=M + K + N + G)
    p = pack_for_gemv(qweight, qzeros, scales)
    x = randn(M, K, seed=M)
    y = torch.empty(M, N, dtype=torch.float16, device="cuda")
    poison(y)
    awq_linear(x, p, out=y)
    check_gemm(y, awq_linear_ref(x, p), f"M={M} K={K} N={N} G={G}")


@pytest.mark.parametrize("M", [1, 5, 12, 30, 64, 100])
def test_fused_residual(M):
    qweight, qzeros, scales = awq_tensors(4096, 4096, 128, seed=M)
    p = pack_for_gemv(qweight, qzeros, scales)
    x, res = randn(M, 4096, seed=M), randn(M, 4096, seed=M + 1)
    check_gemm(awq_linear(x, p, residual=res), awq_linear_ref(x, p, residual=res), f"residual M={M}")


@pytest.mark.parametrize("K,N", [(2048, 2048), (8192, 2048), (4096, 4096), (1024, 12288), (1024, 17600),
                                 (4096, 22016)])
@pytest.mark.parametrize("M", [1, 3, 8, 12, 30])
def test_settled_residual(M, K, N):
    """residual_settled: one token tile's entries (16, 8, 4, 2 and 1 warps by the shape) read the residual before
    their PDL wait, into their epilogue rows; the same bits as reading it in the epilogue. Wider tiles (12, 30
    rows) ignore it."""
    qweight, qzeros, scales = awq_tensors(K, N, 128, seed=M + K + N)
    p = pack_for_gemv(qweight, qzeros, scales)
    x, res = randn(M, K, seed=M), randn(M, N, seed=M + 1)
    y = awq_gemv(x, p, residual=res)
    check_gemm(y, awq_linear_ref(x, p, residual=res), f"M={M} K={K} N={N}")
    early = torch.empty_like(y)
    poison(early)
    assert_equal(awq_gemv(x, p, residual=res, out=early, residual_settled=True), y, f"settled M={M} K={K} N={N}")


@pytest.mark.parametrize("epi", ["plain", "res", "silu"])
@pytest.mark.parametrize("K,N", [(4096, 4096), (11008, 4096), (2048, 2048), (8192, 2048), (4224, 2048),
                                 (4096, 12288), (4096, 22016), (2176, 17600)])
@pytest.mark.parametrize("M", [1, 3, 8])
def test_sixteen_eight_two_and_one_warp_entries(M, K, N, epi, monkeypatch):
    """The 16-, 8-, 2- and 1-warp entries (gemv_warps: 16 for one row where the panels are at most one a SM and K more
    than an 8-warp step, else the widest block whose grid is one wave): the 16-warp entry's two full steps (K 8192)
    and a full step with a guarded last one (4224: 33 tiles over steps of 32); the 8-warp one's single step (2048),
    full steps and a guarded last step (11008: 86 tiles over steps of 16; 2176: 17 tiles over steps of 2 on one
    warp); the widest shapes on the 4-warp entry, or at 8 rows on the 1-warp one."""
    qweight, qzeros, scales = awq_tensors(K, N, 128, seed=M + K + N)
    p = pack_for_gemv(qweight, qzeros, scales, swiglu=epi == "silu")
    x, res = randn(M, K, seed=M), (randn(M, N, seed=M + 1) if epi == "res" else None)
    names, get = [], build.get_function
    monkeypatch.setattr(build, "get_function", lambda cu, name, *a: names.append(name) or get(cu, name, *a))
    y = torch.empty(M, N // 2 if epi == "silu" else N, dtype=torch.float16, device="cuda")
    poison(y)
    awq_linear(x, p, residual=res, out=y)
    warps = gemv_warps(N // 16, sm_count(), M, p.tiles)
    assert names == [f"awq_gemv_mt1_g1_{epi}" + ("" if warps == 4 else f"_w{warps}")], names
    ref = awq_linear_ref(x, p, residual=res)
    if epi == "silu":
        gu = awq_linear_ref(x, pack_for_gemv(qweight, qzeros, scales))  # [M, N]: gate | up
        check_swiglu(y, gu[:, :N // 2], gu[:, N // 2:], ref, f"{warps} warps swiglu M={M} K={K} N={N}")
    else:
        check_gemm(y, ref, f"{warps} warps {epi} M={M} K={K} N={N}")


@pytest.mark.parametrize("K,F,G", [(4096, 11008, 128), (576, 1536, 64), (576, 1536, 192)])
@pytest.mark.parametrize("M", [1, 8, 13, 32, 70])
def test_swiglu_epilogue(M, K, F, G):
    """gate|up with silu(gate) * up in the epilogue: equal to silu_mul of the plain product's halves."""
    qweight, qzeros, scales = awq_tensors(K, 2 * F, G, seed=M + F)
    p = pack_for_gemv(qweight, qzeros, scales, swiglu=True)
    x = randn(M, K, seed=M, scale=2.0)
    y = torch.empty(M, F, dtype=torch.float16, device="cuda")
    poison(y)
    awq_linear(x, p, out=y)
    ref = awq_linear_ref(x, p)
    assert ref.shape == (M, F)
    assert bool(torch.isfinite(y).all())
    plain_p = pack_for_gemv(qweight, qzeros, scales)  # the same weight, gate|up not interleaved
    gu = awq_linear_ref(x, plain_p)  # [M, 2F]
    check_swiglu(y, gu[:, :F], gu[:, F:], ref, f"swiglu M={M} K={K} F={F}")
    # and the same channels as the un-interleaved op followed by torch's SiLU (same sums, same rounding)
    plain = awq_linear(x, plain_p)  # [M, 2F]
    want = torch.nn.functional.silu(plain[:, :F]) * plain[:, F:]
    compare(y, want, rtol=2e-3, what="swiglu vs plain + silu")


def test_agrees_with_the_autoawq_layout_kernel():
    qweight, qzeros, scales = awq_tensors(4096, 12288, 128, seed=3)
    p = pack_for_gemv(qweight, qzeros, scales)
    for M in (1, 8, 16, GEMV_MAX_M):
        x = randn(M, 4096, seed=M + 40)
        check_gemm(awq_gemv(x, p), awq_gemm(x, qweight, qzeros, scales), f"new vs old layout M={M}")


def test_real_quantizer_output():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(1536, 576, generator=g) * 0.05  # [N, K]
    qweight, qzeros, scales = (t.cuda() for t in quantize_awq(w, 64))
    p = pack_for_gemv(qweight, qzeros, scales)
    x = randn(3, 576, seed=6)
    y = awq_linear(x, p)
    check_gemm(y, awq_linear_ref(x, p), "quantize_awq output")
    dense = (x.double() @ w.double().t().cuda()).float()
    assert float((y.float() - dense).norm() / dense.norm()) < 0.15


def test_graph_replay_and_determinism():
    qweight, qzeros, scales = awq_tensors(4096, 4096, 128, seed=8)
    p = pack_for_gemv(qweight, qzeros, scales)
    x = randn(4, 4096, seed=9)
    first = awq_gemv(x, p)
    for _ in range(3):
        assert_equal(awq_gemv(x, p), first, "run to run")


@pytest.mark.parametrize("mt", [1, 2, 4])
@pytest.mark.parametrize("gpt", [1, 2, 4])
@pytest.mark.parametrize("epi", ["plain", "res", "silu"])
def test_gemv_resources(mt, gpt, epi):
    """No variant spills, and the 8-token, groups-of-128 kernel keeps four blocks resident per SM (the
    register budget its U = 2 was chosen for: docs/gpu.md, AWQ GEMV step 5)."""
    fn = build.get_function("awq_gemv.cu", f"awq_gemv_mt{mt}_g{gpt}_{epi}", SIGNATURE)
    res = fn.resources()
    assert res["local_bytes"] == 0, res
    blocks = 4 if (mt, gpt) == (1, 1) else 3
    per_thread = cdiv(res["registers"], 8) * 8  # the register file is handed out in steps of 8 per thread
    assert per_thread * THREADS * blocks <= 65536, res


@pytest.mark.parametrize("epi", ["plain", "res", "silu"])
@pytest.mark.parametrize("warps", [16, 8, 2, 1])
def test_sixteen_eight_two_and_one_warp_entry_resources(epi, warps):
    """The 16-, 8-, 2- and 1-warp entries: no spills, and the same 16 warps per SM as four 4-warp blocks (one
    512-thread block, two 256-thread ones, eight 64-thread ones, sixteen of 32)."""
    res = build.get_function("awq_gemv.cu", f"awq_gemv_mt1_g1_{epi}_w{warps}", SIGNATURE).resources()
    assert res["local_bytes"] == 0, res
    assert cdiv(res["registers"], 8) * 8 * 32 * warps * (16 // warps) <= 65536, res
