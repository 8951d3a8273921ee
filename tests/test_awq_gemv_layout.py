"""The AWQ GEMV layout (kernels_cu/awq_gemv.py), checked on the CPU: packing round-trips, and a lane-by-lane
emulation of awq_gemv.cu's reads (its word, shift, nibble and activation-index arithmetic, written out
here independently of the packer) reproduces x @ w_hat."""

import pytest
import torch

from kernels_cu import tuning
from kernels_cu.awq_gemv import gemv_takes, gemv_warps, pack_for_gemv, unpack_from_gemv
from kernels_cu.swiglu_layout import gate_up_order
from model_zoo.quant.awq_pack import dequantize_awq, quantize_awq


def awq_tensors(K: int, N: int, G: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g)
    return quantize_awq(w, G)  # qweight [K, N/8], qzeros [K/G, N/8], scales [K/G, N]


@pytest.mark.parametrize("K,N,G", [(256, 32, 128), (576, 64, 64), (576, 48, 192), (640, 32, 32), (384, 16, 384)])
@pytest.mark.parametrize("swiglu", [False, True])
def test_pack_round_trips(K, N, G, swiglu):
    qweight, qzeros, scales = awq_tensors(K, N, G, seed=K + N + G)
    p = pack_for_gemv(qweight, qzeros, scales, swiglu=swiglu)
    codes, zeros, sc = unpack_from_gemv(p)
    w_ref = dequantize_awq(qweight, qzeros, scales, G)  # [N, K]
    if swiglu:
        w_ref = w_ref[gate_up_order(N)]
    w = ((codes.short() - zeros.short().repeat_interleave(G, 1)).half() * sc.repeat_interleave(G, 1))
    assert torch.equal(w, w_ref)
    assert p.packed.shape == (N // 16, -(-K // 128), 256)


def emulate_gemv(x: torch.Tensor, p) -> torch.Tensor:
    """y [M, N] as awq_gemv.cu computes it (fp32 per group run, scaled by s), lane by lane."""
    M = x.shape[0]
    gs, gpt, T = p.gs, p.gpt, p.tiles
    mpg, run = 8 // gpt, gs // 4
    words = p.packed.to(torch.int64) & 0xFFFFFFFF  # [N/16, T, 256]
    terms = p.terms.to(torch.int64) & 0xFFFFFFFF  # [N/16, T*gpt, 8, 2]
    y = torch.zeros(M, p.n, dtype=torch.float64)
    xd = torch.nn.functional.pad(x.double(), (0, T * 128 - p.k))
    for panel in range(p.n // 16):
        for tile in range(T):
            for lane in range(32):
                g, t = lane // 4, lane % 4
                for h in range(2):
                    ws = words[panel, tile, h * 128 + lane * 4:h * 128 + lane * 4 + 4]
                    for q in range(gpt):
                        term = int(terms[panel, tile * gpt + q, g, h])
                        s = torch.tensor([term & 0xFFFF], dtype=torch.int16).view(torch.float16).double()
                        zm = torch.tensor([term >> 16], dtype=torch.int16).view(torch.float16).double()
                        z = float(zm) - 1024
                        part = torch.zeros(M, dtype=torch.float64)
                        for jj in range(mpg):
                            j = q * mpg + jj
                            wd = int(ws[j >> 1]) >> (8 * (j & 1))
                            vals = [wd & 15, (wd >> 16) & 15, (wd >> 4) & 15, (wd >> 20) & 15]  # e0..e3
                            i = j >> 1  # 16-byte activation load i holds positions 8i..8i+7
                            k0 = tile * 128 + (i // (4 // gpt)) * gs + t * run + (i % (4 // gpt)) * 8 + 4 * (j & 1)
                            for e in range(4):
                                part += (vals[e] - z) * xd[:, k0 + e]
                        y[:, panel * 16 + h * 8 + g] += float(s) * part
    return y


@pytest.mark.parametrize("K,N,G", [(256, 32, 128), (192, 16, 64), (128, 16, 32)])
def test_emulated_kernel_matches_dequantized_product(K, N, G):
    qweight, qzeros, scales = awq_tensors(K, N, G, seed=7)
    p = pack_for_gemv(qweight, qzeros, scales)
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(1)).half()
    w = dequantize_awq(qweight, qzeros, scales, G, torch.float64)  # [N, K]
    ref = x.double() @ w.t()
    got = emulate_gemv(x, p)
    assert torch.allclose(got, ref, rtol=1e-9, atol=1e-9)


def test_shapes_the_kernel_takes():
    assert gemv_takes(4096, 12288, 128) and gemv_takes(11008, 4096, 128) and gemv_takes(576, 1536, 192)
    assert not gemv_takes(4096, 4104, 128)  # N % 16
    assert not gemv_takes(4096, 4096, 16)  # runs of 16 k: not built


def test_warps_per_panel_for_the_7b_and_70b_decode_shapes():
    """LLaMA-2-7B on 132 SMs (H100 / H200 SXM): o_proj / down_proj (256 panels: one wave of 8-warp blocks, two a
    SM) on 8 warps, q|k|v (768: one wave of 2-warp blocks, eight a SM, 11.6 warps a SM) on 2, gate|up (1376) on 4.
    Llama-3-8B's q|k|v (384) and LLaMA-2-70B's o_proj / down_proj (512) are one wave of 4-warp blocks: 4, not 1.45 /
    1.94 waves of 8; 70B's q|k|v (640) would fill a 2-warp wave with 9.7 warps a SM and is more than a wave of 4: 8
    warps, gate|up (3584) 4 (the engine A/B in awq_gemv.py). On 114 SMs (H100 PCIe) 7B's q|k|v holds 13.5 warps a
    SM on 2 warps; its 256 panels are more than a wave of 8-warp blocks and one wave of 4: 4.
    At 8 rows 7B's gate|up is one wave of 1-warp blocks (10.4 / 12.1 warps a SM), not at 2-4 rows; 70B's (3584) is
    more than a wave of them: 4."""
    assert [gemv_warps(p, 132) for p in (256, 768, 1376)] == [8, 2, 4]
    assert [gemv_warps(p, 132) for p in (384, 512, 640, 3584)] == [4, 4, 8, 4]
    assert [gemv_warps(p, 114) for p in (256, 768, 1376)] == [4, 2, 4]
    assert [gemv_warps(p, 132, 8) for p in (256, 768, 1376, 512, 640, 3584)] == [8, 2, 1, 4, 8, 4]
    with tuning.override(awq_four_warp_one_wave=False):
        assert [gemv_warps(p, 132) for p in (384, 512, 640)] == [8, 8, 8]
    assert [gemv_warps(1376, 132, m) for m in (1, 2, 4, 7)] == [4, 4, 4, 4]
    assert [gemv_warps(p, 114, 8) for p in (256, 768, 1376)] == [4, 2, 1]


def test_sixteen_warps_where_the_panels_are_one_block_a_sm():
    """Llama-3.2-1B's down_proj (2,048 channels, 128 panels; K 8,192, 64 tiles) on 132 SMs: one 16-warp block a SM at
    one row (8 warps at 2-8); on 114 (H100 PCIe) its panels are more than the SMs: 8. Its o_proj (K 2,048: 16 tiles,
    one step of the 8-warp block) on 8 warps; the knob turns it off."""
    assert [gemv_warps(128, s, m, 64) for s in (132, 114) for m in (1, 2, 8)] == [16, 8, 8, 8, 8, 8]
    assert [gemv_warps(128, 132, 1, t) for t in (16, 17)] == [8, 16]
    assert [gemv_warps(p, 132, 1, 64) for p in (64, 132, 133)] == [16, 16, 8]
    with tuning.override(awq_sixteen_warp_one_block=False):
        assert gemv_warps(128, 132, 1, 64) == 8
