"""Decode attention (attention_decode.cu) and prefill attention (SDPA) against float32 references.

Cache positions past each row's length hold NaN (fp16) or NaN scales (int8): a kernel that reads or
weights them fails loudly. Both decode paths run: fused (one launch, counters the kernel resets itself)
and fused=False (two kernels); the int8-output variant must equal quantize_ref of its own fp16 output
bit for bit, in plain calls, repeated calls and CUDA-graph replays.
"""

import pytest
import torch

from tests.gpu.conftest import GPU_STACK, SKIP_REASON, assert_equal, compare, poison, randn

if not GPU_STACK:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from kernels_cu import attention_decode as ad  # noqa: E402
from kernels_cu import build, counters  # noqa: E402
from kernels_cu.attention_decode import attention_decode, attention_decode_quant, attention_decode_ref  # noqa: E402
from kernels_cu.quantize import quantize_ref  # noqa: E402
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


def run_decode(B, H, Hkv, D, L, max_len, int8=False, chunk=None, seed=0, fused=True, lengths=None):
    lengths = ragged_lengths(B, max_len, seed) if lengths is None else lengths
    k, v, ks, vs = make_cache(B, Hkv, L, D, lengths, int8, seed)
    q = randn(B, H, D, seed=seed + 7)
    out = torch.empty(B, H, D, dtype=torch.float16, device="cuda")
    poison(out)
    attention_decode(q, k, v, lengths.cuda(), ks, vs, out=out, chunk=chunk, fused=fused)
    return out, attention_decode_ref(q, k, v, lengths, ks, vs)


def counters_are_zero() -> None:
    build.synchronize()
    for c in counters.pools(ad.COUNTER_POOL):
        assert int(c.abs().sum()) == 0, "a fused launch left a counter non-zero"


FUSED = pytest.mark.parametrize("fused", [True, False], ids=["fused", "2kernel"])


@FUSED
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("H,Hkv", HEADS)
@pytest.mark.parametrize("B,max_len", [(1, 1), (3, 37), (5, 700), (2, 4097)])
def test_decode(B, max_len, H, Hkv, D, fused):
    out, ref = run_decode(B, H, Hkv, D, L=max_len + 7, max_len=max_len, seed=B * max_len + H + D, fused=fused)
    check(out, ref, f"B={B} len<={max_len} H={H} Hkv={Hkv} D={D} fused={fused}")
    counters_are_zero()


@FUSED
@pytest.mark.parametrize("D", [64, 128])
def test_decode_batch_64(D, fused):
    out, ref = run_decode(64, 32, 8, D, L=1030, max_len=1025, seed=D, fused=fused)
    check(out, ref, f"B=64 D={D} fused={fused}")


@pytest.mark.parametrize("chunk", [16, 48, 128, 512])
def test_decode_any_chunk_size(chunk):
    out, ref = run_decode(4, 12, 4, 128, L=1500, max_len=1500, chunk=chunk, seed=chunk, fused=False)
    check(out, ref, f"chunk={chunk}")


@pytest.mark.parametrize("chunk", [16, 48, 64, 208, 1008])
@pytest.mark.parametrize("D,int8", [(128, False), (64, True)])
def test_fused_fixed_chunks(chunk, D, int8):
    """chunk fixes the positions per block: many partials (chunk 16: 94 per unit), multi-stage blocks."""
    out, ref = run_decode(4, 12, 4, D, L=1500, max_len=1500, int8=int8, chunk=chunk, seed=chunk + D)
    check(out, ref, f"fused chunk={chunk} D={D} int8={int8}")
    counters_are_zero()


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("H,Hkv", [(32, 32), (32, 8), (9, 3)])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 63, 64, 65, 576, 2048, 2049])
def test_fused_batch_1_every_split_shape(n, H, Hkv, D):
    """Batch 1, as the engine decodes: the split over the blocks changes with every length."""
    out, ref = run_decode(1, H, Hkv, D, L=2100, max_len=n, seed=n + H + D,
                          lengths=torch.tensor([n], dtype=torch.int32))
    check(out, ref, f"B=1 len={n} H={H} Hkv={Hkv} D={D}")


def test_fused_matches_two_kernel_path():
    a, ref = run_decode(3, 32, 8, 128, L=3000, max_len=2999, seed=11)
    b, _ = run_decode(3, 32, 8, 128, L=3000, max_len=2999, seed=11, fused=False)
    check(a, ref, "fused")
    check(b, ref, "two kernels")
    compare(a, b, rtol=2e-3, atol=2e-3 * float(ref.float().abs().max()), what="fused vs two kernels")


@FUSED
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("H,Hkv", [(9, 3), (32, 32)])
def test_decode_int8_cache(D, H, Hkv, fused):
    out, ref = run_decode(3, H, Hkv, D, L=900, max_len=899, int8=True, seed=D + H, fused=fused)
    check(out, ref, f"int8 cache H={H} Hkv={Hkv} D={D} fused={fused}")


@FUSED
def test_decode_empty_row_gives_zeros(fused):
    q, k, v = randn(2, 4, 64, seed=1), randn(2, 2, 32, 64, seed=2), randn(2, 2, 32, 64, seed=3)
    lengths = torch.tensor([0, 5], dtype=torch.int32, device="cuda")
    out = torch.empty(2, 4, 64, dtype=torch.float16, device="cuda")
    poison(out)
    attention_decode(q, k, v, lengths, out=out, fused=fused)
    assert bool((out[0] == 0).all())
    check(out[1:], attention_decode_ref(q, k, v, lengths.cpu())[1:], "row of length 5")


@FUSED
def test_lengths_are_read_on_the_device(fused):
    """The same launch serves a longer row after lengths change in place (what a CUDA graph replays)."""
    q, k, v = randn(1, 8, 128, seed=4), randn(1, 8, 600, 128, seed=5), randn(1, 8, 600, 128, seed=6)
    lengths = torch.tensor([100], dtype=torch.int32, device="cuda")
    out1 = attention_decode(q, k, v, lengths, fused=fused).clone()
    lengths.fill_(577)
    out2 = attention_decode(q, k, v, lengths, fused=fused)
    check(out1, attention_decode_ref(q, k, v, torch.tensor([100])), "length 100")
    check(out2, attention_decode_ref(q, k, v, torch.tensor([577])), "length 577")


# ---------------------------------------------------------------- int8 output (attention_decode_quant)

def run_quant(B, H, Hkv, D, L, lengths, int8_cache=False, static=None, seed=0, chunk=None):
    """-> (q_out, a_scale, fp16 out) from one poisoned launch, and the float32 reference output."""
    k, v, ks, vs = make_cache(B, Hkv, L, D, lengths, int8_cache, seed)
    q = randn(B, H, D, seed=seed + 7)
    out = torch.empty(B, H, D, dtype=torch.float16, device="cuda")
    q_out = torch.empty(B, H * D, dtype=torch.int8, device="cuda")
    a_scale = torch.empty(B, dtype=torch.float32, device="cuda")
    poison(out, q_out, a_scale)
    amax = None if static is None else torch.tensor([static], dtype=torch.float32, device="cuda")
    got = attention_decode_quant(q, k, v, lengths.cuda(), amax, ks, vs, out=out, q_out=q_out, a_scale=a_scale,
                                 chunk=chunk)
    assert got[0] is q_out and got[1] is a_scale
    return q_out, a_scale, out, amax, attention_decode_ref(q, k, v, lengths, ks, vs)


def check_quant(q_out, a_scale, out, amax, ref, what):
    check(out, ref, what)
    B = out.shape[0]
    want_q, want_s = quantize_ref(out.reshape(B, -1), amax)
    assert_equal(q_out, want_q, f"{what}: q_out vs quantize_ref(out)")
    assert_equal(a_scale, want_s, f"{what}: a_scale vs quantize_ref(out)")


@pytest.mark.parametrize("static", [None, 3.0], ids=["dynamic", "static"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("H,Hkv", [(32, 32), (9, 3), (32, 4), (16, 1)])
@pytest.mark.parametrize("B,max_len", [(1, 1), (1, 2048), (3, 37), (5, 700)])
def test_decode_quant(B, max_len, H, Hkv, D, static):
    lengths = ragged_lengths(B, max_len, seed=B + max_len + D)
    res = run_quant(B, H, Hkv, D, L=max_len + 9, lengths=lengths, static=static, seed=B * max_len + H)
    check_quant(*res, f"quant B={B} len<={max_len} H={H} Hkv={Hkv} D={D} static={static}")
    counters_are_zero()


@pytest.mark.parametrize("static", [None, 0.5], ids=["dynamic", "static"])
def test_decode_quant_int8_cache_empty_row_batch_64(static):
    lengths = ragged_lengths(64, 1025, seed=3)
    lengths[5] = 0  # an empty row: zeros, amax clamped to 1e-8
    res = run_quant(64, 32, 8, 128, L=1030, lengths=lengths, int8_cache=True, static=static, seed=5)
    check_quant(*res, f"quant int8 cache B=64 static={static}")
    assert bool((res[0][5] == 0).all())
    counters_are_zero()


@pytest.mark.parametrize("chunk", [16, 112])
def test_decode_quant_many_partials(chunk):
    lengths = torch.tensor([1500, 1, 777], dtype=torch.int32)
    res = run_quant(3, 32, 8, 128, L=1500, lengths=lengths, seed=chunk, chunk=chunk)
    check_quant(*res, f"quant chunk={chunk}")
    counters_are_zero()


def test_repeated_calls_reuse_the_counters():
    """Counters return to zero after every launch, so back-to-back launches (and interleaved variants,
    which share the counters) stay right."""
    for i, n in enumerate([2048, 5, 1111, 2048]):
        lengths = torch.tensor([n, max(1, n // 3)], dtype=torch.int32)
        out, ref = run_decode(2, 32, 32, 128, L=2050, max_len=n, seed=i, lengths=lengths)
        check(out, ref, f"call {i} fused")
        res = run_quant(2, 32, 32, 128, L=2050, lengths=lengths, seed=i + 10)
        check_quant(*res, f"call {i} quant")
        counters_are_zero()


@pytest.mark.parametrize("quant", [False, True], ids=["fp16", "int8-out"])
def test_fused_replays_in_a_cuda_graph(quant):
    """One capture, three replays with new lengths written in place: each replay matches the reference, and
    no memset node is needed because the kernel zeroes its own counters."""
    B, H, Hkv, D, L = 3, 32, 8, 128, 3000
    clean_k, clean_v = randn(B, Hkv, L, D, seed=31), randn(B, Hkv, L, D, seed=32)
    k, v = clean_k.clone(), clean_v.clone()
    q = randn(B, H, D, seed=33)
    lengths = torch.tensor([1, 2999, 1500], dtype=torch.int32, device="cuda")

    def call():
        if quant:
            return attention_decode_quant(q, k, v, lengths, out=o16)
        return attention_decode(q, k, v, lengths, out=o16), None

    o16 = torch.empty(B, H, D, dtype=torch.float16, device="cuda")
    call()  # compile and allocate the counters outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=build.torch_stream()):
        res = call()
    for lens in ([5, 700, 2999], [2048, 0, 16], [1, 2999, 2049]):
        k.copy_(clean_k)
        v.copy_(clean_v)
        for b, n in enumerate(lens):
            k[b, :, n:] = float("nan")
            v[b, :, n:] = float("nan")
        lengths.copy_(torch.tensor(lens, dtype=torch.int32))
        poison(o16, *([res[0], res[1]] if quant else []))
        g.replay()
        build.synchronize()
        ref = attention_decode_ref(q, k, v, torch.tensor(lens))
        if quant:
            check_quant(res[0], res[1], o16, None, ref, f"graph replay lengths={lens}")
        else:
            check(res[0], ref, f"graph replay lengths={lens}")
        counters_are_zero()


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
