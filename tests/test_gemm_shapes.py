"""CPU checks of the GEMM / attention launch geometry and of the torch references the GPU tests trust."""

from __future__ import annotations

import math

import pytest
import torch

from kernels_cu.attention_decode import attention_decode_ref
from kernels_cu.attention_prefill import attention_prefill, attention_prefill_ref
from kernels_cu import gemm_shapes
from kernels_cu.gemm_shapes import (ATTN_CHUNKS, AWQ_TILE_K, AWQ_WARPS, GEMV_RING_BYTES, attn_chunk, awq_launch, cdiv,
                                    gemv_grid, gemv_shared, gemv_xq_shared, token_tile)
from kernels_cu.int8_gemm import int8_gemm_ref


@pytest.mark.parametrize("m", [1, 8, 9, 16, 17, 64])
@pytest.mark.parametrize("n,k", [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008), (576, 576), (1536, 64)])
@pytest.mark.parametrize("sms", [132, 78])
def test_awq_launch_covers_every_k_tile_once(m, n, k, sms):
    launch = awq_launch(m, n, k, sms)
    tiles = k // AWQ_TILE_K
    per_block = AWQ_WARPS * launch.tiles_per_warp
    assert launch.splits * per_block >= tiles > (launch.splits - 1) * per_block  # no split left empty
    grid = launch.grid(m, n)
    assert grid[0] * 256 >= n and grid[2] * 8 * launch.mt >= m
    assert grid[0] * grid[1] * grid[2] >= min(sms, cdiv(n, 256) * cdiv(tiles, AWQ_WARPS))  # fills the GPU


def test_awq_launch_honours_forced_splits():
    assert awq_launch(1, 4096, 4096, 132, splits=8).splits == 8
    assert awq_launch(1, 4096, 64, 132, splits=100).splits == 1  # 4 tiles: one block of 4 warps


def test_gemv_grid_and_token_tiles():
    assert [token_tile(m) for m in (1, 8, 9, 16, 40)] == [1, 1, 2, 2, 2]
    assert [token_tile(m, 4) for m in (1, 8, 9, 16, 17, 32, 40)] == [1, 1, 2, 2, 4, 4, 4]
    assert gemv_grid(1, 4096) == (256, 1)
    assert gemv_grid(16, 4100) == (257, 1)
    assert gemv_grid(40, 16) == (1, 3)


@pytest.mark.parametrize("sms,smem", [(132, 228 * 1024), (108, 164 * 1024)])
def test_gemv_shared_keeps_one_wave_grids_at_two_blocks_per_sm(monkeypatch, sms, smem):
    monkeypatch.setattr(gemm_shapes, "sm_count", lambda index=None: sms)
    monkeypatch.setattr(gemm_shapes, "smem_per_sm", lambda index: smem)
    static = 6 * 1024  # the kernels' static shared memory and the per-block reserve, rounded up
    for blocks in (1, 256, 2 * sms):
        got = gemv_shared(blocks, GEMV_RING_BYTES, 0)
        assert 2 * (got + static) <= smem < 3 * (got + static), (blocks, got)
    assert gemv_shared(2 * sms + 1, GEMV_RING_BYTES, 0) == GEMV_RING_BYTES  # more waves: as many per SM as fit
    assert gemv_shared(1, gemv_xq_shared(8, 11008), 0) == gemv_xq_shared(8, 11008)  # never less than needed
    assert gemv_xq_shared(1, 4096) == 4096 + GEMV_RING_BYTES and gemv_xq_shared(3, 11) % 128 == 0


def test_attention_chunk_depends_on_shape_only():
    assert attn_chunk(4096, 64, 32, 1, 132) == ATTN_CHUNKS[0]  # plenty of rows: fewest partials
    small = attn_chunk(4096, 1, 3, 1, 132)
    assert small == ATTN_CHUNKS[-1]  # one row, three kv heads: split the sequence finely
    assert 3 * cdiv(4096, small) >= 64
    for max_len in (1, 37, 4097):
        assert attn_chunk(max_len, 2, 8, 1, 132) in ATTN_CHUNKS


def test_int8_reference_epilogue_order_and_residual():
    g = torch.Generator().manual_seed(0)
    q_x = torch.randint(-127, 128, (3, 32), generator=g, dtype=torch.int8)
    qw = torch.randint(-127, 128, (5, 32), generator=g, dtype=torch.int8)
    a, w = torch.rand(3, generator=g) + 0.5, torch.rand(5, generator=g) + 0.5
    res = torch.randn(3, 5, generator=g).half()
    acc = q_x.long() @ qw.long().T  # exact
    want = ((acc.float() * a[:, None]) * w[None, :]).half() + res
    assert torch.equal(int8_gemm_ref(q_x, a, qw, w, residual=res), want)
    static = int8_gemm_ref(q_x, a[:1], qw, w)  # one per-tensor scale broadcasts
    assert torch.equal(static, ((acc.float() * a[0]) * w[None, :]).half())


def test_decode_reference_is_the_last_prefill_query():
    g = torch.Generator().manual_seed(1)
    k = torch.randn(2, 3, 50, 64, generator=g).half()
    v = torch.randn(2, 3, 50, 64, generator=g).half()
    q = torch.randn(6, 9, 64, generator=g).half()
    pre = attention_prefill_ref(q, k, v, row=1, start=30)  # positions 30 .. 35
    dec = attention_decode_ref(q[-1:], k[1:], v[1:], torch.tensor([36]))
    torch.testing.assert_close(dec[0], pre[-1], rtol=2e-3, atol=2e-3)


def test_decode_reference_by_hand():
    """One head, two positions: softmax of two scores mixes two value rows."""
    q = torch.zeros(1, 1, 64).half()
    q[0, 0, 0] = 1.0
    k = torch.zeros(1, 1, 4, 64).half()
    k[0, 0, 1, 0] = math.sqrt(64) * math.log(3.0)  # score ln 3 against 0: weights 1/4, 3/4
    v = torch.zeros(1, 1, 4, 64).half()
    v[0, 0, 0, :] = 4.0
    v[0, 0, 1, :] = 8.0
    v[0, 0, 2:, :] = float("nan")  # past the length: never read
    out = attention_decode_ref(q, k, v, torch.tensor([2]))
    torch.testing.assert_close(out.float(), torch.full((1, 1, 64), 7.0), rtol=1e-3, atol=1e-2)


@pytest.mark.parametrize("start,S", [(0, 9), (7, 5), (20, 1)])
def test_prefill_sdpa_matches_reference_on_cpu(start, S):
    g = torch.Generator().manual_seed(start + S)
    k = torch.randn(1, 2, 32, 64, generator=g).half()
    v = torch.randn(1, 2, 32, 64, generator=g).half()
    q = torch.randn(S, 6, 64, generator=g).half()
    torch.testing.assert_close(attention_prefill(q, k, v, 0, start), attention_prefill_ref(q, k, v, 0, start),
                               rtol=2e-3, atol=2e-3)


def test_prefill_sdpa_never_takes_cudnn(monkeypatch):
    """cuDNN's attention builds a graph per sequence length (41 ms each on an H200): a new prompt length would wait
    for it, so SDPA runs with that backend off (and is left as it was after)."""
    import kernels_cu.attention_prefill as ap

    seen = []
    sdpa = ap.F.scaled_dot_product_attention
    monkeypatch.setattr(ap.F, "scaled_dot_product_attention",
                        lambda *a, **k: (seen.append(torch.backends.cuda.cudnn_sdp_enabled()), sdpa(*a, **k))[1])
    before = torch.backends.cuda.cudnn_sdp_enabled()
    g = torch.Generator().manual_seed(1)
    k, v = (torch.randn(1, 2, 16, 64, generator=g).half() for _ in range(2))
    for start in (0, 4):  # plain causal, and the lower-right bias after a cached prefix
        attention_prefill(torch.randn(4, 2, 64, generator=g).half(), k, v, 0, start)
    assert seen == [False, False] and torch.backends.cuda.cudnn_sdp_enabled() == before


def test_int8_head_warps():
    """The int8 lm_head's blocks: 4 warps for one token tile up to w8a16_four_warp_max_k (Llama-3.2-1B's 2,048),
    else 8; 0 turns the 4-warp entry off."""
    from kernels_cu import tuning
    from kernels_cu.fp16_gemv import w8a16_warps

    assert [w8a16_warps(m, 2048) for m in (1, 8, 9, 64)] == [4, 4, 8, 8]
    assert [w8a16_warps(1, k) for k in (576, 3072, 4096)] == [4, 8, 8]
    with tuning.override(w8a16_four_warp_max_k=0):
        assert w8a16_warps(1, 2048) == 8
