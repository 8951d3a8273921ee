"""Decode attention (attention_decode.cu) and prefill attention (SDPA) against float32 references.

Cache positions past each row's length hold NaN (fp16) or NaN scales (int8): a kernel that reads or
weights them fails loudly.
"""

import pytest
import torch

from tests.gpu.conftest import GPU_STACK, SKIP_REASON, compare, poison, randn

if not GPU_STACK:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from kernels_cu.attention_decode import attention_decode, attention_decode_ref  # noqa: E402
from kernels_cu.attention_prefill import attention_prefill, attention_prefill_ref  # noqa: E402

pytestmark = pytest.mark.gpu

HEADS = [(8, 8), (9, 3), (32, 4), (16, 1)]  # (H, Hkv): GQA 1, 3, 8, 16 (two head groups per kv head)


def check(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert bool(torch.isfinite(out).all()), f"{what}: non-finite output"
    compare(out, ref, rtol=5e-3, atol=4e-3 * float(ref.float().abs().max()), what=what)
    rel = float((out.double() - ref.double()).norm() / ref.double().norm())
    assert rel < 2e-3, f"{what}: relative error {rel:.2e}"


def ragged_lengths(B: int, max_len: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = torch.randint(1, max_len + 1, (B,), generator=g)
    n[0] = 1
    if B > 1:
        n[1] = max_len
    if B > 2:
        n[2] = max(1, (max_len // 2) | 1)  # odd
    return n.to(torch.int32)


def make_cache(B, Hkv, L, D, lengths, int8: bool, seed: int):
    if not int8:
        k, v = randn(B, Hkv, L, D, seed=seed), randn(B, Hkv, L, D, seed=seed + 1)
        for b, n in enumerate(lengths.tolist()):
            k[b, :, n:] = float("nan")
            v[b, :, n:] = float("nan")
        return k, v, None, None
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(-127, 128, (B, Hkv, L, D), generator=g, dtype=torch.int8).cuda()
    v = torch.randint(-127, 128, (B, Hkv, L, D), generator=g, dtype=torch.int8).cuda()
    ks = (torch.rand(B, Hkv, L, generator=g) * 0.02 + 0.002).cuda()
    vs = (torch.rand(B, Hkv, L, generator=g) * 0.02 + 0.002).cuda()
    for b, n in enumerate(lengths.tolist()):
        ks[b, :, n:] = float("nan")
        vs[b, :, n:] = float("nan")
    return k, v, ks, vs


def run_decode(B, H, Hkv, D, L, max_len, int8=False, chunk=None, seed=0):
    lengths = ragged_lengths(B, max_len, seed)
    k, v, ks, vs = make_cache(B, Hkv, L, D, lengths, int8, seed)
    q = randn(B, H, D, seed=seed + 7)
    out = torch.empty(B, H, D, dtype=torch.float16, device="cuda")
    poison(out)
    attention_decode(q, k, v, lengths.cuda(), ks, vs, out=out, chunk=chunk)
    return out, attention_decode_ref(q, k, v, lengths, ks, vs)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("H,Hkv", HEADS)
@pytest.mark.parametrize("B,max_len", [(1, 1), (3, 37), (5, 700), (2, 4097)])
def test_decode(B, max_len, H, Hkv, D):
    out, ref = run_decode(B, H, Hkv, D, L=max_len + 7, max_len=max_len, seed=B * max_len + H + D)
    check(out, ref, f"B={B} len<={max_len} H={H} Hkv={Hkv} D={D}")


@pytest.mark.parametrize("D", [64, 128])
def test_decode_batch_64(D):
    out, ref = run_decode(64, 32, 8, D, L=1030, max_len=1025, seed=D)
    check(out, ref, f"B=64 D={D}")


@pytest.mark.parametrize("chunk", [16, 48, 128, 512])
def test_decode_any_chunk_size(chunk):
    out, ref = run_decode(4, 12, 4, 128, L=1500, max_len=1500, chunk=chunk, seed=chunk)
    check(out, ref, f"chunk={chunk}")


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("H,Hkv", [(9, 3), (32, 32)])
def test_decode_int8_cache(D, H, Hkv):
    out, ref = run_decode(3, H, Hkv, D, L=900, max_len=899, int8=True, seed=D + H)
    check(out, ref, f"int8 cache H={H} Hkv={Hkv} D={D}")


def test_decode_empty_row_gives_zeros():
    q, k, v = randn(2, 4, 64, seed=1), randn(2, 2, 32, 64, seed=2), randn(2, 2, 32, 64, seed=3)
    lengths = torch.tensor([0, 5], dtype=torch.int32, device="cuda")
    out = attention_decode(q, k, v, lengths)
    assert bool((out[0] == 0).all())
    check(out[1:], attention_decode_ref(q, k, v, lengths.cpu())[1:], "row of length 5")


def test_lengths_are_read_on_the_device():
    """The same launch serves a longer row after lengths change in place (what a CUDA graph replays)."""
    q, k, v = randn(1, 8, 128, seed=4), randn(1, 8, 600, 128, seed=5), randn(1, 8, 600, 128, seed=6)
    lengths = torch.tensor([100], dtype=torch.int32, device="cuda")
    out1 = attention_decode(q, k, v, lengths).clone()
    lengths.fill_(577)
    out2 = attention_decode(q, k, v, lengths)
    check(out1, attention_decode_ref(q, k, v, torch.tensor([100])), "length 100")
    check(out2, attention_decode_ref(q, k, v, torch.tensor([577])), "length 577")


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("H,Hkv", [(9, 3), (8, 8), (32, 4)])
@pytest.mark.parametrize("start,S", [(0, 1), (0, 37), (0, 512), (5, 1), (100, 33), (1000, 257)])
def test_prefill(start, S, H, Hkv, D):
    L = 1300
    k, v = randn(2, Hkv, L, D, seed=start + S), randn(2, Hkv, L, D, seed=start + S + 1)
    q = randn(S, H, D, seed=S)
    out = attention_prefill(q, k, v, row=1, start=start)
    check(out, attention_prefill_ref(q, k, v, row=1, start=start), f"start={start} S={S} H={H} D={D}")


def test_prefill_int8_cache():
    lengths = torch.tensor([300, 300], dtype=torch.int32)
    k, v, ks, vs = make_cache(2, 3, 320, 64, lengths, int8=True, seed=3)
    q = randn(45, 9, 64, seed=8)
    out = attention_prefill(q, k, v, row=0, start=255, k_scale=ks, v_scale=vs)
    check(out, attention_prefill_ref(q, k, v, row=0, start=255, k_scale=ks, v_scale=vs), "int8 prefill")


def test_prefill_last_query_equals_decode():
    """Two independent code paths over the same cache: SDPA's last row and the decode kernel."""
    k, v = randn(1, 4, 800, 128, seed=21), randn(1, 4, 800, 128, seed=22)
    q = randn(40, 16, 128, seed=23)
    pre = attention_prefill(q, k, v, row=0, start=700)  # positions 700 .. 739
    dec = attention_decode(q[-1:].contiguous(), k, v, torch.tensor([740], dtype=torch.int32, device="cuda"))
    check(dec[0], pre[-1], "decode vs prefill")
