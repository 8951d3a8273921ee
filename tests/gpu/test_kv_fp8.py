"""The FP8 (E4M3) KV cache (--kv-fp8): rope_kv's codes and scales bit for bit against kv_codes.quantize_kv_ref,
decode attention (fused, clusters, two kernels, RoPE mode) and prefill attention on an fp8 cache against the float32
references over ragged odd lengths, GQA and batches, and the engine's greedy tokens against the fp16 cache's.

Cache bytes past each row's length hold 0x7F (an e4m3 NaN, which no quantization writes) and their scales NaN: a
kernel that reads or weights them fails loudly, as test_attention's int8 cases do with NaN scales.
"""

import pytest
import torch

from tests.gpu.conftest import GPU_STACK, SKIP_REASON, assert_equal, poison, randn

if not GPU_STACK:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from kernels_cu.attention_decode import (attention_decode, attention_decode_quant, attention_decode_ref,  # noqa: E402
                                         attention_decode_rope, attention_decode_rope_quant)
from kernels_cu.attention_prefill import attention_prefill, attention_prefill_ref  # noqa: E402
from kernels_cu.fp8_quantize import has_fp8  # noqa: E402
from kernels_cu.kv_codes import KvKind, quantize_kv_ref  # noqa: E402
from kernels_cu.rope_kv import rope_kv, rope_table, write_kv_ref  # noqa: E402
from tests.gpu.test_attention import check, counters_are_zero, ragged_lengths  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (torch.cuda.is_available() and has_fp8(torch.cuda.current_device())),
    reason="the fp8 KV cache needs compute capability 8.9 or newer")]

FP8 = torch.float8_e4m3fn
NAN_CODE = 0x7F  # e4m3fn NaN: satfinite conversions never produce it
HEADS = [(8, 8), (9, 3), (32, 4), (16, 1)]  # (H, Hkv): GQA 1, 3, 8, 16


def poison_codes(*caches: torch.Tensor) -> None:
    for c in caches:
        c.view(torch.uint8).fill_(NAN_CODE)


def same_bytes(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert out.dtype == ref.dtype, what
    assert_equal(out.view(torch.uint8), ref.view(torch.uint8), what)


def fp8_cache(B, Hkv, L, D, lengths, seed: int, scale: float = 1.0):
    """Codes and scales of random fp16 K / V (quantize_kv_ref: what rope_kv writes); positions from each row's
    length on poisoned."""
    k16, v16 = randn(B * Hkv * L, D, scale=scale, seed=seed), randn(B * Hkv * L, D, scale=scale, seed=seed + 1)
    k, ks = quantize_kv_ref(k16, KvKind.FP8)
    v, vs = quantize_kv_ref(v16, KvKind.FP8)
    k, v = k.view(B, Hkv, L, D).contiguous(), v.view(B, Hkv, L, D).contiguous()  # [B, Hkv, L, D] e4m3
    ks, vs = ks.view(B, Hkv, L).contiguous(), vs.view(B, Hkv, L).contiguous()  # [B, Hkv, L] fp32
    for b, n in enumerate(lengths.tolist()):
        for c in (k, v):
            c[b, :, max(n, 0):].view(torch.uint8).fill_(NAN_CODE)
        ks[b, :, max(n, 0):] = float("nan")
        vs[b, :, max(n, 0):] = float("nan")
    return k, v, ks, vs


# ---------------------------------------------------------------- rope_kv writes the codes

@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("n_heads,n_kv", [(2, 2), (6, 2), (32, 8)])
@pytest.mark.parametrize("T", [1, 7, 33])
def test_rope_kv_fp8_cache_is_bitwise(T, n_heads, n_kv, d):
    """rope_kv on an fp8 cache: q as the fp16 cache's run gives it, and k (rotated) and v as quantize_kv_ref's codes
    and scales of the fp16 cache's values, bit for bit; slots no token writes keep their poison."""
    B, L = 4, 64
    qkv = randn(T, (n_heads + 2 * n_kv) * d, scale=2.0, seed=T + d)
    table = rope_table(d, 10000.0, 128, device="cuda")
    slots = torch.randperm(B * L, generator=torch.Generator().manual_seed(T))[:T]
    row, pos = (slots // L).to(torch.int32).cuda(), (slots % L).to(torch.int32).cuda()
    r, p = row.long(), pos.long()
    k16 = torch.empty(B, n_kv, L, d, dtype=torch.float16, device="cuda")
    v16 = torch.empty_like(k16)
    q_ref = rope_kv(qkv, table, pos, row, k16, v16, n_heads, n_kv)

    k8 = torch.empty(B, n_kv, L, d, dtype=FP8, device="cuda")
    v8 = torch.empty_like(k8)
    ks = torch.empty(B, n_kv, L, dtype=torch.float32, device="cuda")
    vs = torch.empty_like(ks)
    poison_codes(k8, v8)
    poison(ks, vs)
    q_out = rope_kv(qkv, table, pos, row, k8, v8, n_heads, n_kv, k_scale=ks, v_scale=vs)
    assert_equal(q_out, q_ref, "q")

    want_k, want_v = torch.empty_like(k8), torch.empty_like(v8)
    poison_codes(want_k, want_v)
    want_ks, want_vs = torch.full_like(ks, float("nan")), torch.full_like(vs, float("nan"))
    write_kv_ref(want_k, want_v, k16[r, :, p], v16[r, :, p], pos, row, want_ks, want_vs)
    same_bytes(k8, want_k, "k fp8 cache (whole cache: untouched slots stay poisoned)")
    same_bytes(v8, want_v, "v fp8 cache")
    assert_equal(ks, want_ks, "k scales")
    assert_equal(vs, want_vs, "v scales")
    deq = k8[r, :, p].float() * ks[r, :, p][..., None]  # [T, n_kv, d]
    err = (deq - k16[r, :, p].float()).abs()
    assert bool((err <= k16[r, :, p].float().abs() * 2.0**-4 + ks[r, :, p][..., None] * 2.0**-9).all())


# ---------------------------------------------------------------- decode attention reads them

def run_decode(B, H, Hkv, D, L, max_len, chunk=None, seed=0, fused=True, lengths=None):
    lengths = ragged_lengths(B, max_len, seed) if lengths is None else lengths
    k, v, ks, vs = fp8_cache(B, Hkv, L, D, lengths, seed)
    q = randn(B, H, D, seed=seed + 7)
    out = torch.empty(B, H, D, dtype=torch.float16, device="cuda")
    poison(out)
    attention_decode(q, k, v, lengths.cuda(), ks, vs, out=out, chunk=chunk, fused=fused)
    return out, attention_decode_ref(q, k, v, lengths, ks, vs)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "2kernel"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("H,Hkv", HEADS)
@pytest.mark.parametrize("B,max_len", [(1, 1), (3, 37), (5, 701), (2, 2049)])
def test_decode_fp8_cache(B, max_len, H, Hkv, D, fused):
    out, ref = run_decode(B, H, Hkv, D, L=max_len + 3, max_len=max_len, seed=B + H + D, fused=fused)
    check(out, ref, f"fp8 cache B={B} len<={max_len} H={H} Hkv={Hkv} D={D} fused={fused}")
    counters_are_zero()


@pytest.mark.parametrize("n", [1, 15, 17, 65, 577, 2049])
def test_decode_fp8_batch_1_every_split_shape(n):
    """LLaMA-2-7B's heads at batch 1: a row spread over a cluster of blocks (fewer at short lengths)."""
    out, ref = run_decode(1, 32, 32, 128, L=2100, max_len=n, seed=n, lengths=torch.tensor([n], dtype=torch.int32))
    check(out, ref, f"fp8 batch 1 len={n}")


@pytest.mark.parametrize("chunk", [16, 48, 208])
def test_decode_fp8_fixed_chunks(chunk):
    out, ref = run_decode(4, 12, 4, 64, L=1500, max_len=1500, chunk=chunk, seed=chunk)
    check(out, ref, f"fp8 chunk={chunk}")


@pytest.mark.parametrize("static", [None, 3.0], ids=["dynamic", "static"])
def test_decode_quant_on_fp8_cache(static):
    """The int8-output variant on an fp8 cache: its fp16 output near the reference, its codes quantize_ref's of it."""
    from kernels_cu.quantize import quantize_ref

    B, H, Hkv, D, L = 5, 32, 8, 128, 800
    lengths = ragged_lengths(B, 777, seed=4)
    k, v, ks, vs = fp8_cache(B, Hkv, L, D, lengths, seed=4)
    q = randn(B, H, D, seed=11)
    amax = None if static is None else torch.tensor([static], dtype=torch.float32, device="cuda")
    out = torch.empty(B, H, D, dtype=torch.float16, device="cuda")
    poison(out)
    q_out, a_scale = attention_decode_quant(q, k, v, lengths.cuda(), amax, ks, vs, out=out)
    check(out, attention_decode_ref(q, k, v, lengths, ks, vs), "fp8 cache, int8 output")
    want_q, want_s = quantize_ref(out.reshape(B, H * D), amax)
    assert_equal(q_out, want_q, "q_out")
    assert_equal(a_scale, want_s, "a_scale")
    counters_are_zero()


# ---------------------------------------------------------------- RoPE mode writes and reads them

def rope_case(H, Hkv, D, L, lengths, seed):
    """qkv, the table, lengths and two copies of an fp8 cache poisoned from each row's new token on."""
    B = len(lengths)
    qkv = randn(B, (H + 2 * Hkv) * D, scale=2.0, seed=seed)  # [B, (H + 2 Hkv) D]
    table = rope_table(D, 10000.0, L + 16, device="cuda")
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")  # [B]
    cache = fp8_cache(B, Hkv, L, D, torch.tensor([max(n - 1, 0) for n in lengths]), seed + 1)
    return qkv, table, lens, [t.clone() for t in cache], [t.clone() for t in cache]


@pytest.mark.parametrize("quant", [False, True], ids=["fp16-out", "int8-out"])
@pytest.mark.parametrize("H,Hkv", HEADS)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("lengths", [[1, 351, 0, 701, 700], [2049], [17, 64, 65]], ids=["ragged", "one", "three"])
def test_rope_mode_on_fp8_cache_equals_rope_kv_then_attention(lengths, D, H, Hkv, quant):
    """The fused kernel's RoPE mode (it writes the new token's codes itself) against rope_kv then attention, bit for
    bit (outputs and whole caches), and near the float32 reference: length 1, odd, empty, past the cache, last slot."""
    L = 700 if len(lengths) == 5 else 2100
    qkv, table, lens, new, old = rope_case(H, Hkv, D, L, lengths, seed=D + H + len(lengths))
    B = len(lengths)
    row = torch.arange(B, dtype=torch.int32, device="cuda")
    outs = []
    for fused_rope, (k, v, ks, vs) in ((True, new), (False, old)):
        out = torch.empty(B, H, D, dtype=torch.float16, device="cuda")
        poison(out)
        res = ()  # (q_out, a_scale) of the int8-output variants; out is written in place
        if fused_rope and quant:
            res = attention_decode_rope_quant(qkv, table, k, v, lens, H, None, ks, vs, out=out)
        elif fused_rope:
            attention_decode_rope(qkv, table, k, v, lens, H, ks, vs, out=out)
        else:
            q = rope_kv(qkv, table, lens - 1, row, k, v, H, Hkv, k_scale=ks, v_scale=vs)
            if quant:
                res = attention_decode_quant(q, k, v, lens, None, ks, vs, out=out)
            else:
                attention_decode(q, k, v, lens, ks, vs, out=out)
        outs.append((out, *res))
    for name, a, b in zip(("out", "q_out", "a_scale"), outs[0], outs[1]):
        assert_equal(a, b, f"{name}")
    for name, a, b in zip(("k", "v", "k_scale", "v_scale"), new, old):
        same_bytes(a, b, f"{name} cache")
    counters_are_zero()
    k, v, ks, vs = old
    for b, n in enumerate(lengths):
        if 0 < n <= L:
            assert bool(torch.isfinite(ks[b, :, n - 1]).all()), f"row {b}: the new token was not written"
    q = rope_kv(qkv, table, lens - 1, row, k, v, H, Hkv, k_scale=ks, v_scale=vs)
    check(outs[0][0], attention_decode_ref(q, k, v, lens.cpu(), ks, vs), "rope mode vs float32 reference")


# ---------------------------------------------------------------- prefill attention reads them

@pytest.mark.parametrize("H,Hkv", [(9, 3), (8, 8), (32, 4)])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("start,S", [(0, 1), (0, 37), (0, 513), (5, 1), (100, 33), (1000, 257)])
def test_prefill_fp8_cache(start, S, D, H, Hkv):
    L = 1300
    lengths = torch.tensor([start + S, start + S], dtype=torch.int32)
    k, v, ks, vs = fp8_cache(2, Hkv, L, D, lengths, seed=start + S + D)
    q = randn(S, H, D, seed=S)
    out = attention_prefill(q, k, v, row=1, start=start, k_scale=ks, v_scale=vs)
    ref = attention_prefill_ref(q, k, v, row=1, start=start, k_scale=ks, v_scale=vs)
    check(out, ref, f"fp8 prefill start={start} S={S} H={H} Hkv={Hkv} D={D}")


def test_prefill_last_query_equals_decode_on_fp8_cache():
    """Two code paths over the same fp8 cache: SDPA's last row and the decode kernel."""
    lengths = torch.tensor([301], dtype=torch.int32)
    k, v, ks, vs = fp8_cache(1, 4, 320, 128, lengths, seed=12)
    q = randn(45, 32, 128, seed=13)
    pre = attention_prefill(q, k, v, row=0, start=256, k_scale=ks, v_scale=vs)[-1]  # [H, D]
    dec = attention_decode(q[-1:].contiguous(), k, v, lengths.cuda(), ks, vs)[0]  # [H, D]
    check(dec, pre, "decode vs prefill's last query")


# ---------------------------------------------------------------- the engine

def test_engine_greedy_tokens_with_the_fp8_cache():
    """A random tiny model, greedy: the fp8 cache's tokens follow the fp16 cache's (a long common prefix, and where
    the fp16 engine's own tokens are fed to both, the same argmax nearly everywhere); logits near the reference."""
    from kernels_cu.engine import Engine, EngineConfig
    from model_zoo.generation import GenerationConfig, generate
    from model_zoo.reference import ReferenceModel
    from model_zoo.sampling import SamplingConfig
    from model_zoo.tokenizer import Tokenizer
    from tests.gpu.test_engine import CONFIGS, checkpoint, rel

    config = CONFIGS["smol-like"]
    w = checkpoint(config, "fp16")
    e16, e8 = Engine(w, EngineConfig(max_len=256)), Engine(w, EngineConfig(max_len=256, kv=KvKind.FP8))
    tok = Tokenizer.byte_fallback(config.vocab_size)
    cfg = GenerationConfig(max_new_tokens=48, sampling=SamplingConfig(temperature=0), stop_at_eos=False)
    prompts = [tok.encode(p) for p in ("The fp8 cache and the fp16 cache agree", "a second, shorter row")]
    want = [r.tokens for r in generate(e16, tok, prompts, cfg)[0]]
    got = [r.tokens for r in generate(e8, tok, prompts, cfg)[0]]
    prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(got, want)]
    seq = torch.tensor([prompts[0] + want[0]])  # [1, T]
    l16, l8 = e16.forward(seq), e8.forward(seq[:, :-1])
    cache = e8.new_cache(1, seq.shape[1])
    e8.forward(seq[:, :len(prompts[0])], cache)
    steps = torch.cat([e8.forward(seq[:, i:i + 1], cache) for i in range(len(prompts[0]), seq.shape[1] - 1)], 1)
    agree = float((steps[0].argmax(-1) == l16[0, len(prompts[0]):-1].argmax(-1)).float().mean())
    err = rel(l8, ReferenceModel(w.to("cpu", torch.float32)).forward(seq[:, :-1]))
    print(f"fp8 KV: greedy common prefix {prefix} of 48, teacher-forced decode top-1 agreement {agree:.3f}, "
          f"prefill logits rel err vs reference {err:.4f}")
    assert min(prefix) >= 16 and agree >= 0.95 and err < 5e-2  # H200: 48 and 48 of 48, 1.000, 0.0125
    assert e8.kv_bytes(1, 100) * 2 * 64 == e16.kv_bytes(1, 100) * (64 + 4)  # head_dim 64: codes + a scale
