"""awq_wgmma.cu (the Hopper AWQ prefill GEMM, w_hat made in registers, x by TMA shared by block pairs) against
float64 references.

Its w_hat is the reference dequantizer's bit for bit; the product is an fp32 sum rounded once, so it is held
to the same tolerance as cuBLAS on w_hat (check_gemm), and to the dequantize + cuBLAS path it replaces. The
ragged shapes cover a pair whose second block lies past N and token tiles the TMA box overhangs.
"""

import pytest
import torch

from tests.gpu.conftest import GPU_STACK, SKIP_REASON, awq_tensors, check_gemm, check_swiglu, randn

if not GPU_STACK:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from kernels_cu import awq_wgmma, build, tensor_map, tuning  # noqa: E402
from kernels_cu.awq_gemv import awq_linear, awq_linear_ref, awq_packed_dequantize, pack_for_gemv  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (torch.cuda.is_available() and build.has_wgmma(torch.cuda.current_device())),
    reason="wgmma needs an sm_90 GPU")]


def run(M: int, K: int, N: int, seed: int, residual: bool = False, swiglu: bool = False):
    """The kernel's output in a NaN-filled buffer with 8 spare rows (which must stay NaN), and the reference."""
    p = pack_for_gemv(*awq_tensors(K, N, 128, seed=seed), swiglu=swiglu)
    x = randn(M, K, seed=seed + 1)
    res = randn(M, N, seed=seed + 2) if residual else None
    big = torch.full((M + 8, p.out_features), float("nan"), dtype=torch.float16, device="cuda")
    y = awq_wgmma.launch(x, p, res, big[:M])
    assert bool(torch.isnan(big[M:]).all()), "rows past M were written"
    return y, awq_linear_ref(x, p, residual=res), x, p


@pytest.mark.parametrize("K,N", [(4096, 12288), (4096, 4096), (11008, 4096)])
@pytest.mark.parametrize("M", [128, 2048])
def test_llama_shapes(M, K, N):
    y, ref, _, _ = run(M, K, N, seed=M + K + N)
    check_gemm(y, ref, f"M={M} K={K} N={N}")


@pytest.mark.parametrize("M,K,N", [(1, 128, 16), (65, 384, 208), (129, 1152, 4112), (300, 640, 1536),
                                   (2600, 256, 784)])
def test_ragged_tiles(M, K, N):
    """M, N and K not multiples of the 256 x 128 x 64 block (K = 640: a half-used last tile); 2600 tokens are
    11 token tiles, a group of 8 and a short one (cluster_order), 784 channels 7 tiles in 4 pairs."""
    y, ref, _, _ = run(M, K, N, seed=3 * M + N)
    check_gemm(y, ref, f"M={M} K={K} N={N}")


@pytest.mark.parametrize("M", [70, 1000])
def test_fused_residual(M):
    y, ref, _, _ = run(M, 4096, 4096, seed=M, residual=True)
    check_gemm(y, ref, f"residual M={M}")


@pytest.mark.parametrize("M,F", [(70, 11008), (513, 1536)])
def test_swiglu_epilogue(M, F):
    y, ref, x, p = run(M, 4096, 2 * F, seed=M + F, swiglu=True)
    gu = awq_linear_ref(x, pack_for_gemv(*awq_tensors(4096, 2 * F, 128, seed=M + F)))  # [M, 2F], not interleaved
    check_swiglu(y, gu[:, :F], gu[:, F:], ref, f"swiglu M={M} F={F}")


def test_agrees_with_dequantize_and_cublas():
    p = pack_for_gemv(*awq_tensors(4096, 12288, 128, seed=9))
    x = randn(512, 4096, seed=10)
    y = awq_wgmma.launch(x, p, None, None)
    cublas = torch.matmul(x, awq_packed_dequantize(p).t())
    rel = float((y.double() - cublas.double()).norm() / cublas.double().norm())
    assert rel < 5e-4, f"relative difference {rel:.2e}"


def test_takes_groups_of_128_only():
    x = randn(100, 512, seed=1)
    assert awq_wgmma.takes(x, pack_for_gemv(*awq_tensors(512, 256, 128, seed=2)))
    assert not awq_wgmma.takes(x, pack_for_gemv(*awq_tensors(512, 256, 64, seed=2)))


def test_residual_in_place():
    """The engine passes the residual stream as both residual and out."""
    p = pack_for_gemv(*awq_tensors(1024, 512, 128, seed=21))
    x = randn(300, 1024, seed=22)
    res = randn(300, 512, seed=23)
    ref = awq_linear_ref(x, p, residual=res)
    y = awq_wgmma.launch(x, p, res, res)
    assert y.data_ptr() == res.data_ptr()
    check_gemm(y, ref, "in place")


def test_awq_linear_prefill_takes_the_fused_gemm(monkeypatch):
    """awq_linear above the GEMV's rows runs this kernel (tuning.awq_fused_prefill), and w_hat + cuBLAS when it is
    off."""
    p = pack_for_gemv(*awq_tensors(512, 256, 128, seed=31))
    x = randn(200, 512, seed=32)
    calls = []
    launch = awq_wgmma.launch
    monkeypatch.setattr(awq_wgmma, "launch", lambda *a: calls.append(1) or launch(*a))
    fused = awq_linear(x, p)
    assert calls == [1]
    with tuning.override(awq_fused_prefill=False):
        unfused = awq_linear(x, p)
    assert calls == [1]
    ref = awq_linear_ref(x, p)
    check_gemm(fused, ref, "fused")
    check_gemm(unfused, ref, "dequantize + cuBLAS")


def test_tensor_maps_are_kept_per_buffer():
    x = randn(300, 512, seed=41)
    a = tensor_map.device_map(x, 64, 128)
    assert tensor_map.device_map(x, 64, 128) is a
    assert tensor_map.device_map(x[:256], 64, 128) is not a  # same address, other shape: another map
    assert a.numel() == tensor_map.MAP_BYTES and a.is_cuda


def test_a_captured_gemm_puts_the_map_of_a_buffer_the_capture_allocates(monkeypatch):
    """Under CUDA-graph capture (the engine's prefill graphs) x is made inside the capture, so its map cannot be
    uploaded from the host: put_map writes it on every replay, for a buffer with an eager map in the cache too (the
    cache may drop that one while the graph lives). Three GEMMs in one graph: replays with new inputs equal eager
    launches. (This small graph passes without the tensormap-proxy fences too; test_engine.py's
    test_awq_prefill_graph_on_the_fused_gemm_equals_eager is the one that fails without them.)"""
    p = pack_for_gemv(*awq_tensors(1024, 768, 128, seed=5))
    src = randn(200, 1024, seed=6)
    awq_wgmma.launch(src, p, None, None)  # eager first: kernels built, src's map cached
    build.synchronize()
    puts, put = [], tensor_map._put_map
    monkeypatch.setattr(tensor_map, "_put_map", lambda m, raw: puts.append(m.data_ptr()) or put(m, raw))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=build.torch_stream()):
        x = src * 1.0  # an address only the capture knows
        y = awq_wgmma.launch(x, p, None, None)
        y2 = awq_wgmma.launch(src * 2.0, p, None, None)
        y3 = awq_wgmma.launch(src, p, None, None)  # cached eagerly: put in the graph's pool all the same
    assert len(puts) == 3
    assert not any(k[1] == x.data_ptr() for k in tensor_map._cache)  # a captured map is the graph's alone
    for seed in (7, 8):
        src.copy_(randn(200, 1024, seed=seed))
        graph.replay()
        want = awq_wgmma.launch(src.clone(), p, None, None)
        assert torch.equal(y, want) and torch.equal(y3, want), seed
        assert torch.equal(y2, awq_wgmma.launch(src * 2.0, p, None, None)), seed


def test_tensor_map_refuses_unaligned_rows():
    with pytest.raises(ValueError, match="16-byte"):
        tensor_map.encode_2d(randn(8, 12, seed=1), 8, 8)
