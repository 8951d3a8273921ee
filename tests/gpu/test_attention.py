"""Decode attention (attention_fused.cu, attention_decode.cu) and prefill attention (SDPA) against float32 references.

Cache positions past each row's length hold NaN (fp16) or NaN scales (int8): a kernel that reads or
weights them fails loudly. Both decode paths run: fused (one launch, counters the kernel resets itself)
and fused=False (two kernels); the int8-output variant must equal quantize_ref of its own fp16 output
bit for bit, in plain calls, repeated calls and CUDA-graph replays. The RoPE mode (the fused kernel doing
rope_kv's work for the new token) must equal rope_kv followed by the fused kernel bit for bit: outputs and
whole caches.
"""

import pytest
import torch

from tests.gpu.conftest import GPU_STACK, SKIP_REASON, assert_equal, compare, poison, randn

if not GPU_STACK:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from kernels_cu import attention_decode as ad  # noqa: E402
from kernels_cu import build, counters, tuning  # noqa: E402
from kernels_cu.attention_decode import (attention_decode, attention_decode_quant, attention_decode_ref,  # noqa: E402
                                         attention_decode_rope, attention_decode_rope_quant)
from kernels_cu.quantize import quantize_ref  # noqa: E402
from kernels_cu.attention_prefill import attention_prefill, attention_prefill_ref  # noqa: E402
from kernels_cu.rope_kv import rope_kv, rope_table  # noqa: E402

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


# ---------------------------------------------------------------- RoPE mode (attention_decode_rope[_quant])

VARIANTS = pytest.mark.parametrize("variant", ["plain", "dynamic", "static"])


class RopeCase:
    """One decode step: qkv [B, (H + 2 Hkv) D], a cos/sin table, lengths, and two identical copies of the caches
    (new path, old path). Positions from each row's new token on hold NaN (fp16) or NaN scales (int8): the
    new token's slot must be written before it is read, and nothing past it may be read."""

    def __init__(self, H, Hkv, D, L, lengths, int8, seed, max_pos=None, clean_from=None):
        B = len(lengths)
        self.H, self.Hkv, self.D = H, Hkv, D
        self.lengths = torch.tensor(lengths, dtype=torch.int32, device="cuda")  # [B]
        self.qkv = randn(B, (H + 2 * Hkv) * D, scale=2.0, seed=seed)  # [B, (H + 2 Hkv) D]
        self.cos_sin = rope_table(D, 10000.0, max_pos or L + 16, device="cuda")  # [max_pos, D]
        first = [max(n - 1, 0) for n in lengths] if clean_from is None else clean_from
        k, v, ks, vs = make_cache(B, Hkv, L, D, torch.tensor(first), int8, seed + 1)
        self.new = [t if t is None else t.clone() for t in (k, v, ks, vs)]
        self.old = [t if t is None else t.clone() for t in (k, v, ks, vs)]

    def rope_kv(self) -> torch.Tensor:
        """The old path's first launch on the old caches: q [B, H, D]. An empty row's position -1 lies outside
        the table: q = 0 and no write, as the RoPE mode treats it."""
        k, v, ks, vs = self.old
        B = self.qkv.shape[0]
        row = torch.arange(B, dtype=torch.int32, device="cuda")
        return rope_kv(self.qkv, self.cos_sin, self.lengths - 1, row, k, v, self.H, self.Hkv, k_scale=ks, v_scale=vs)

    def assert_caches_equal(self, what: str) -> None:
        for name, a, b in zip(("k", "v", "k_scale", "v_scale"), self.new, self.old):
            if a is not None:
                assert_equal(a, b, f"{what}: {name} cache")


def launch_rope(case: RopeCase, variant: str, new: bool, chunk=None):
    """One path on its own caches -> (out,) or (out, q_out, a_scale), outputs poisoned first. new: the RoPE
    mode; else rope_kv then the fused kernel on its q."""
    B, H, D = case.qkv.shape[0], case.H, case.D
    k, v, ks, vs = case.new if new else case.old
    out = torch.empty(B, H, D, dtype=torch.float16, device="cuda")
    poison(out)
    if variant == "plain":
        if new:
            attention_decode_rope(case.qkv, case.cos_sin, k, v, case.lengths, H, ks, vs, out=out, chunk=chunk)
        else:
            attention_decode(case.rope_kv(), k, v, case.lengths, ks, vs, out=out, chunk=chunk)
        return (out,)
    amax = torch.tensor([2.5], dtype=torch.float32, device="cuda") if variant == "static" else None
    q_out = torch.empty(B, H * D, dtype=torch.int8, device="cuda")
    a_scale = torch.empty(B, dtype=torch.float32, device="cuda")
    poison(q_out, a_scale)
    if new:
        attention_decode_rope_quant(case.qkv, case.cos_sin, k, v, case.lengths, H, amax, ks, vs, out=out,
                                    q_out=q_out, a_scale=a_scale, chunk=chunk)
    else:
        attention_decode_quant(case.rope_kv(), k, v, case.lengths, amax, ks, vs, out=out, q_out=q_out,
                               a_scale=a_scale, chunk=chunk)
    return out, q_out, a_scale


def assert_same(got, want, what: str) -> None:
    for name, a, b in zip(("out", "q_out | part", "a_scale"), got, want):
        assert_equal(a, b, f"{what}: {name}")


def check_rope(case: RopeCase, variant: str, chunk=None, what: str = "") -> None:
    got = launch_rope(case, variant, True, chunk)
    assert_same(got, launch_rope(case, variant, False, chunk), what)
    case.assert_caches_equal(what)
    counters_are_zero()
    # the comparison means something: the new token was written where it fits, and attended to
    L = case.new[0].shape[2]
    for b, n in enumerate(case.lengths.tolist()):
        if 0 < n <= L and n - 1 < case.cos_sin.shape[0]:
            slot = case.new[0 if case.new[2] is None else 2][b, :, n - 1]  # fp16 k, or the int8 k scales
            assert bool(torch.isfinite(slot.float()).all()), f"{what}: row {b} position {n - 1} not written"
    k, v, ks, vs = case.old
    q = case.rope_kv()  # rewrites the same bytes into the old caches
    check(got[0], attention_decode_ref(q, k, v, case.lengths.cpu(), ks, vs), f"{what}: vs float32 reference")


def rope_lengths(batch: str, L: int) -> list[int]:
    if batch == "one":
        return [L - 40]
    return [1, L // 2 + 1, 0, L + 1, L]  # length 1, odd, empty, new token past the cache, last slot


@VARIANTS
@pytest.mark.parametrize("batch", ["one", "ragged"])
@pytest.mark.parametrize("H,Hkv", HEADS)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("int8", [False, True], ids=["f16cache", "i8cache"])
def test_rope_mode_matches_rope_kv_then_attention(int8, D, H, Hkv, batch, variant):
    L = 2100 if batch == "one" else 700
    case = RopeCase(H, Hkv, D, L, rope_lengths(batch, L), int8, seed=D + H + Hkv + len(batch))
    check_rope(case, variant, what=f"rope {batch} H={H} Hkv={Hkv} D={D} int8={int8} {variant}")


@pytest.mark.parametrize("chunk", [16, 48, 208, 1008])
@pytest.mark.parametrize("D,int8,H,Hkv", [(128, False, 32, 8), (64, True, 16, 1), (128, True, 32, 32),
                                          (64, False, 9, 3)])
def test_rope_mode_fixed_chunks(chunk, D, int8, H, Hkv):
    """The new token in a block of many stages (its K/V stored while stage 0 streams) and in one of many
    partials, at the start, inside and at the end of its block."""
    L = 1500
    case = RopeCase(H, Hkv, D, L, [1500, 1, 777, 1024, 1025], int8, seed=chunk + D)
    variant = "dynamic" if chunk in (48, 1008) else "plain"
    check_rope(case, variant, chunk, f"rope chunk={chunk} D={D} int8={int8} H={H} Hkv={Hkv}")


@pytest.mark.parametrize("int8", [False, True], ids=["f16cache", "i8cache"])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 64, 65, 2049])
def test_rope_mode_batch_1_every_split_shape(n, int8):
    """(32, 32) heads at batch 1 spread a row over 12 (fp16) or 16 (int8) blocks: at 2049 positions the last
    block spans 3 stages, and its K/V store overlaps stage 0."""
    case = RopeCase(32, 32, 128, 2100, [n], int8, seed=n)
    check_rope(case, "plain", what=f"rope B=1 len={n} int8={int8}")


def test_rope_mode_position_past_the_table():
    """p beyond the cos/sin table: q = 0 and no write, so position p keeps what the cache held (valid data
    here: the row's clean prefix reaches past p)."""
    case = RopeCase(8, 2, 64, 64, [5, 40, 20], False, seed=3, max_pos=20, clean_from=[4, 40, 20])
    check_rope(case, "plain", what="past the table")
    check_rope(case, "dynamic", what="past the table, quant")


def test_rope_mode_checks_its_arguments():
    case = RopeCase(8, 2, 64, 64, [5, 40], False, seed=3)
    k, v, _, _ = case.new
    with pytest.raises(ValueError, match="qkv"):
        attention_decode_rope(case.qkv[:, :-64].contiguous(), case.cos_sin, k, v, case.lengths, 8)
    with pytest.raises(ValueError, match="n_heads"):
        attention_decode_rope(case.qkv, case.cos_sin, k, v, case.lengths, 7)
    with pytest.raises(ValueError, match="cos_sin"):
        attention_decode_rope(case.qkv, case.cos_sin[:, :32].contiguous(), k, v, case.lengths, 8)
    with pytest.raises(ValueError, match="cos_sin"):
        attention_decode_rope(case.qkv, case.cos_sin.half(), k, v, case.lengths, 8)


@pytest.mark.parametrize("quant", [False, True], ids=["fp16", "int8-out"])
@pytest.mark.parametrize("int8", [False, True], ids=["f16cache", "i8cache"])
def test_rope_mode_replays_in_a_cuda_graph(quant, int8):
    """One capture of the RoPE mode; between replays qkv, lengths and the caches are rewritten in place. Each
    replay equals the old path run eagerly on its own copy of the caches."""
    B, H, Hkv, D, L = 3, 32, 8, 128, 3000
    live = RopeCase(H, Hkv, D, L, [1, 1, 1], int8, seed=41)  # the buffers the graph reads and writes
    k, v, ks, vs = live.new
    o16 = torch.empty(B, H, D, dtype=torch.float16, device="cuda")

    def call():
        if quant:
            return (o16, *attention_decode_rope_quant(live.qkv, live.cos_sin, k, v, live.lengths, H, None, ks, vs,
                                                      out=o16))
        return (attention_decode_rope(live.qkv, live.cos_sin, k, v, live.lengths, H, ks, vs, out=o16),)

    call()  # compile and allocate the counters outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=build.torch_stream()):
        res = call()
    for i, lens in enumerate(([5, 700, 2999], [2048, 0, 16], [1, 3000, 3001])):
        case = RopeCase(H, Hkv, D, L, lens, int8, seed=50 + i)
        live.qkv.copy_(case.qkv)
        live.lengths.copy_(case.lengths)
        for dst, src in zip(live.new, case.new):
            if dst is not None:
                dst.copy_(src)
        poison(*res)
        g.replay()
        build.synchronize()
        case.new = live.new
        what = f"graph replay lengths={lens}"
        assert_same(res, launch_rope(case, "dynamic" if quant else "plain", False), what)
        case.assert_caches_equal(what)
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


# ---------------------------------------------------------------- cluster combine (the `_cl` entries)

@pytest.mark.skipif(not (torch.cuda.is_available() and build.has_clusters(torch.cuda.current_device())),
                    reason="thread-block clusters need sm_90")
@pytest.mark.parametrize("variant", ["plain", "dynamic", "static", "parts"])
@pytest.mark.parametrize("D,int8,H,Hkv,lengths", [
    (128, False, 32, 32, [576]),              # LLaMA-2-7B batch 1: 12 splits, one cluster per head
    (128, True, 32, 32, [577]),
    (64, False, 64, 4, [1, 3000, 0, 1499]),   # GQA 16 (two head groups), an empty row, n_act from 1 to S
    (64, True, 36, 12, [17, 1024, 33]),       # GQA 3
    (128, False, 32, 8, [2049, 16, 700]),     # GQA 4
    # GQA 8, one stage a block (32 units: S <= 16, clusters): partials pushed into block 0 (100, 40) or, too many
    # for its free shared memory, pulled (520, 300); the int8 cache's push area is smaller (60, 17, 33 / 100)
    (128, False, 64, 8, [100, 520, 40, 300]),
    (128, True, 64, 8, [60, 100, 17, 33]),
])
def test_cluster_combine_equals_the_workspace_combine(variant, D, int8, H, Hkv, lengths):
    """The cluster entries combine the same partials in the same order: at the split count the launcher picks
    for clusters, out (and q_out, a_scale) bit for bit the workspace path's, in RoPE mode too (caches
    included), counters back at zero."""
    B, L = len(lengths), max(lengths) + 5
    amax = torch.tensor([2.5], device="cuda") if variant == "static" else None
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    k, v, ks, vs = make_cache(B, Hkv, L, D, lens.cpu(), int8, seed=D + H)
    q = randn(B, H, D, seed=7)
    case = RopeCase(H, Hkv, D, L, lengths, int8, seed=B * D + H)
    quant = variant in ("dynamic", "static")
    parts = variant == "parts"  # each unit's max |out| for an o_proj that quantizes its input (int8_gemm.py)
    S = None

    def run(clusters: bool, rope: bool):
        with tuning.override(attention_clusters=clusters):
            return _run(clusters, rope)

    def _run(clusters: bool, rope: bool):
        out = torch.empty(B, H, D, dtype=torch.float16, device="cuda")
        poison(out)
        if rope:  # each path on its own copy of the caches
            kc, vc, ksc, vsc = case.new if clusters else case.old
            got = ad._launch_fused(case.qkv, kc, vc, case.lengths, ksc, vsc, out, None, quant, static_amax=amax,
                                   splits=S, cos_sin=case.cos_sin, n_heads=H, parts=parts)
        else:
            got = ad._launch_fused(q, k, v, lens, ks, vs, out, None, quant, static_amax=amax, splits=S, parts=parts)
        if parts:
            unit_max = got[0].float().abs().reshape(B, got[3].shape[1], -1).amax(dim=2)  # [B, units of a row]
            assert_equal(got[3], unit_max, "each unit's max |out|")
            return got[:1] + (got[3],)
        return got[:3] if quant else got[:1]

    cl_fn = build.get_function("attention_fused.cu", f"attn_fused_d{D}{'_kv8' if int8 else ''}_cl", ad.SIGNATURE)
    before = cl_fn.cluster_launches
    groups = -(-(H // Hkv) // ad.SLOTS)
    S = ad.fused_launch(L, B, Hkv, groups, D, int8, ad.sm_count(0), ad.smem_per_sm(0),
                        max_clusters=lambda s: cl_fn.max_active_clusters((s, B * Hkv * groups), (ad.FUSED_THREADS,),
                                                                         ad.fused_smem_bytes(D, int8), (s, 1, 1))).splits
    for rope in (False, True):
        what = f"{variant} D={D} int8={int8} H={H} Hkv={Hkv} lengths={lengths} rope={rope} S={S}"
        got, want = run(True, rope), run(False, rope)
        assert bool(torch.isfinite(got[0]).all()), what
        assert_same(got, want, what)
        if rope:
            case.assert_caches_equal(what)
        counters_are_zero()
    assert cl_fn.cluster_launches == before + 2, "the cluster entry did not run"


@pytest.mark.skipif(not (torch.cuda.is_available() and build.has_clusters(torch.cuda.current_device())),
                    reason="thread-block clusters need sm_90")
@pytest.mark.parametrize("B,D,int8", [(1, 128, False), (1, 128, True), (2, 128, False), (4, 64, True)])
def test_cluster_grid_fits_in_one_wave(B, D, int8):
    """LLaMA-2-7B-like heads: the launcher's S keeps every unit's cluster resident at once (the GPU's own count)."""
    H = Hkv = 32
    L = 4097
    fn = build.get_function("attention_fused.cu", f"attn_fused_d{D}{'_kv8' if int8 else ''}_cl", ad.SIGNATURE)
    smem = ad.fused_smem_bytes(D, int8)
    units = B * Hkv

    def fits(s):
        return fn.max_active_clusters((s, units), (ad.FUSED_THREADS,), smem, (s, 1, 1))
    launch = ad.fused_launch(L, B, Hkv, 1, D, int8, ad.sm_count(0), ad.smem_per_sm(0),
                             max_clusters=fits)
    assert launch.cluster and 2 <= launch.splits <= ad.CLUSTER_MAX, launch
    assert fits(launch.splits) >= units
    out, ref = run_decode(B, H, Hkv, D, L=L, max_len=L - 1, int8=int8, seed=B + D)
    check(out, ref, f"B={B} D={D} int8={int8} S={launch.splits}")
    counters_are_zero()
