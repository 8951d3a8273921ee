"""The deferred RMSNorm's references (norm_fold.py) on the CPU: the partial sums and rstd reproduce
LlamaRMSNorm's statistics, and xg * rstd its output up to one fp16 rounding."""

import torch

from kernels_cu.norm_fold import CHANNELS, fold_out_ref, rstd_ref, takes
from kernels_cu.rmsnorm import rmsnorm_ref


def test_rstd_from_partial_sums_is_rmsnorms():
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(5, 576, generator=g) * torch.tensor([0.01, 0.3, 1.0, 7.0, 40.0])[:, None]).half()
    w = (torch.randn(576, generator=g) * 0.2 + 1).half()
    xg, part = fold_out_ref(h, w)
    assert part.shape == (5, 576 // CHANNELS) and xg.dtype == torch.float16
    want = torch.rsqrt(h.double().pow(2).mean(-1) + 1e-5)
    torch.testing.assert_close(rstd_ref(part, 1e-5), want, rtol=1e-12, atol=0)
    normed = xg.double() * rstd_ref(part, 1e-5)[:, None]
    ref = rmsnorm_ref(h, w, 1e-5).double()
    err = (normed - ref).abs() / ref.abs().clamp_min(1e-3)
    assert float(err.max()) < 2e-3  # two fp16 roundings in the reference, one here


def test_shapes_the_kernels_take():
    assert takes(576) and takes(4096) and takes(8192) and not takes(600) and not takes(40)


def test_consumer_partial_sums_must_be_16_byte_aligned():
    """fold_rstd reads the partial sums as float4: a view starting 4 bytes into a buffer is refused, before any
    GPU work (the alignment is checked ahead of the device)."""
    import pytest

    from kernels_cu.norm_fold import FoldIn, check_in

    buf = torch.zeros(2 * 256 + 4)
    with pytest.raises(ValueError, match="16-byte aligned"):
        check_in(FoldIn(buf[1:1 + 2 * 256].view(2, 256), 1e-5), 2, 4096)
    with pytest.raises(ValueError, match="K % 64"):
        check_in(FoldIn(buf[:2 * 36].view(2, 36), 1e-5), 2, 600)
