"""rope_kv.cu against rope_kv_ref (transformers' numerics) and a float64 oracle, fp16 and int8 KV caches."""

import pytest
import torch

from tests.gpu.conftest import GPU_STACK, SKIP_REASON, assert_equal, compare, poison, randn

if not GPU_STACK:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from kernels_cu.rope_kv import rope_kv, rope_kv_ref, rope_table, write_kv_ref  # noqa: E402

pytestmark = pytest.mark.gpu
B, L = 4, 64
# (n_heads, n_kv_heads): GQA ratios 1, 3, 8
HEADS = [(2, 2), (6, 2), (16, 2), (32, 8)]


def case(T, n_heads, n_kv, d, theta=10000.0, max_pos=128, seed=0):
    qkv = randn(T, (n_heads + 2 * n_kv) * d, scale=2.0, seed=seed)
    table = rope_table(d, theta, max_pos, device="cuda")
    g = torch.Generator().manual_seed(seed + 1)
    slots = torch.randperm(B * L, generator=g)[:T]  # distinct (row, position) per token
    row = (slots // L).to(torch.int32).cuda()
    pos = (slots % L).to(torch.int32).cuda()
    return qkv, table, pos, row


def caches(n_kv, d, dtype):
    k = torch.empty(B, n_kv, L, d, dtype=dtype, device="cuda")
    v = torch.empty_like(k)
    poison(k, v)
    return k, v


def written_mask(pos, row):
    mask = torch.zeros(B, L, dtype=torch.bool)
    mask[row.long().cpu(), pos.long().cpu()] = True
    return mask  # [B, L]


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("n_heads,n_kv", HEADS)
@pytest.mark.parametrize("T", [1, 7, 33])
def test_rope_kv_fp16_cache(T, n_heads, n_kv, d):
    qkv, table, pos, row = case(T, n_heads, n_kv, d, seed=T + d)
    k_cache, v_cache = caches(n_kv, d, torch.float16)
    q_out = torch.empty(T, n_heads, d, dtype=torch.float16, device="cuda")
    poison(q_out)
    rope_kv(qkv, table, pos, row, k_cache, v_cache, n_heads, n_kv, q_out=q_out)

    q16, k16, v16 = rope_kv_ref(qkv, table, pos, n_heads, n_kv)
    q64, k64, _ = rope_kv_ref(qkv, table, pos, n_heads, n_kv, compute_dtype=torch.float64)
    scale = float(qkv.float().abs().max())
    compare(q_out, q16, rtol=1e-3, atol=1e-3 * scale, what="q vs HF fp16")
    compare(q_out, q64, rtol=0, atol=4e-3 * scale, what="q vs float64")
    r, p = row.long(), pos.long()
    compare(k_cache[r, :, p], k16, rtol=1e-3, atol=1e-3 * scale, what="k cache vs HF fp16")
    compare(k_cache[r, :, p], k64, rtol=0, atol=4e-3 * scale, what="k cache vs float64")
    assert_equal(v_cache[r, :, p], v16, "v cache")
    untouched = ~written_mask(pos, row)
    assert bool(k_cache.cpu().permute(0, 2, 1, 3)[untouched].isnan().all()), "a slot no token owns was written"
    assert bool(v_cache.cpu().permute(0, 2, 1, 3)[untouched].isnan().all())


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("n_heads,n_kv", [(6, 2), (32, 8)])
def test_rope_matches_transformers_bitwise(n_heads, n_kv, d):
    """cos/sin rounded to fp16 and every op rounded to fp16: the same bits as torch's eager fp16 math."""
    T = 33
    qkv, table, pos, row = case(T, n_heads, n_kv, d, theta=500000.0, max_pos=L, seed=5)
    k_cache, v_cache = caches(n_kv, d, torch.float16)
    q_out = rope_kv(qkv, table, pos, row, k_cache, v_cache, n_heads, n_kv)
    q16, k16, _ = rope_kv_ref(qkv, table, pos, n_heads, n_kv)
    assert_equal(q_out, q16, "q")
    assert_equal(k_cache[row.long(), :, pos.long()], k16, "k")


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("n_heads,n_kv", HEADS)
@pytest.mark.parametrize("T", [1, 7, 33])
def test_rope_kv_int8_cache_is_bitwise(T, n_heads, n_kv, d):
    qkv, table, pos, row = case(T, n_heads, n_kv, d, seed=3 * T + d)
    k16c, v16c = caches(n_kv, d, torch.float16)
    q_ref = rope_kv(qkv, table, pos, row, k16c, v16c, n_heads, n_kv)
    r, p = row.long(), pos.long()

    k8, v8 = caches(n_kv, d, torch.int8)
    ks = torch.empty(B, n_kv, L, dtype=torch.float32, device="cuda")
    vs = torch.empty_like(ks)
    poison(ks, vs)
    q_out = rope_kv(qkv, table, pos, row, k8, v8, n_heads, n_kv, k_scale=ks, v_scale=vs)
    assert_equal(q_out, q_ref, "q")

    want_k, want_v = torch.full_like(k8, -128), torch.full_like(v8, -128)
    want_ks, want_vs = torch.full_like(ks, float("nan")), torch.full_like(vs, float("nan"))
    write_kv_ref(want_k, want_v, k16c[r, :, p], v16c[r, :, p], pos, row, want_ks, want_vs)
    assert_equal(k8, want_k, "k int8 cache (whole cache: untouched slots stay poisoned)")
    assert_equal(v8, want_v, "v int8 cache")
    assert_equal(ks, want_ks, "k scales")
    assert_equal(vs, want_vs, "v scales")
    deq = k8[r, :, p].float() * ks[r, :, p][..., None]
    compare(deq, k16c[r, :, p].float(), rtol=0, atol=float(ks.nan_to_num().max()) * 0.5001, what="k dequant")


def test_long_positions_with_large_theta():
    n_heads, n_kv, d, T = 8, 2, 128, 7
    qkv = randn(T, (n_heads + 2 * n_kv) * d, seed=9)
    table = rope_table(d, 500000.0, 8192, device="cuda")
    pos = torch.tensor([0, 1, 63, 1000, 4095, 6000, 8191], dtype=torch.int32, device="cuda")
    row = torch.zeros(T, dtype=torch.int32, device="cuda")
    k_cache = torch.empty(1, n_kv, 8192, d, dtype=torch.float16, device="cuda")
    v_cache = torch.empty_like(k_cache)
    q_out = rope_kv(qkv, table, pos, row, k_cache, v_cache, n_heads, n_kv)
    q16, k16, _ = rope_kv_ref(qkv, table, pos, n_heads, n_kv)
    compare(q_out, q16, rtol=1e-3, atol=1e-3 * 4, what="q")
    compare(k_cache[0, :, pos.long()].transpose(0, 1), k16, rtol=1e-3, atol=1e-3 * 4, what="k")


def test_positions_outside_table_or_cache_are_not_written():
    n_heads, n_kv, d = 4, 2, 64
    qkv = randn(4, (n_heads + 2 * n_kv) * d, seed=4)
    table = rope_table(d, 10000.0, 80, device="cuda")  # positions 0..79; the cache holds 0..63
    pos = torch.tensor([3, -1, 70, 90], dtype=torch.int32, device="cuda")
    row = torch.tensor([0, 1, 2, 3], dtype=torch.int32, device="cuda")
    k_cache, v_cache = caches(n_kv, d, torch.float16)
    q_out = torch.empty(4, n_heads, d, dtype=torch.float16, device="cuda")
    poison(q_out)
    rope_kv(qkv, table, pos, row, k_cache, v_cache, n_heads, n_kv, q_out=q_out)
    assert int(k_cache[0, :, 3].isnan().sum()) == 0  # the valid token was written
    written = ~k_cache.isnan()
    written[0, :, 3] = False  # the one slot that should hold data
    assert int(written.sum()) == 0, "an out-of-range token wrote into the cache"
    assert int(q_out[1].abs().sum()) == 0 and int(q_out[3].abs().sum()) == 0  # outside the table: q = 0
    q16, _, _ = rope_kv_ref(qkv[2:3], table, pos[2:3], n_heads, n_kv)
    compare(q_out[2:3], q16, rtol=1e-3, atol=4e-3, what="rotated q of a token beyond the cache")


def test_decode_step_of_64_rows():
    n_heads, n_kv, d, rows, L_ = 24, 8, 128, 64, 40
    qkv = randn(rows, (n_heads + 2 * n_kv) * d, seed=6)
    table = rope_table(d, 10000.0, L_, device="cuda")
    row = torch.arange(rows, dtype=torch.int32, device="cuda")
    pos = torch.randint(0, L_, (rows,), generator=torch.Generator().manual_seed(6)).to(torch.int32).cuda()
    k_cache = torch.empty(rows, n_kv, L_, d, dtype=torch.float16, device="cuda")
    v_cache = torch.empty_like(k_cache)
    poison(k_cache, v_cache)
    q_out = rope_kv(qkv, table, pos, row, k_cache, v_cache, n_heads, n_kv)
    q16, k16, v16 = rope_kv_ref(qkv, table, pos, n_heads, n_kv)
    compare(q_out, q16, rtol=1e-3, atol=4e-3, what="q")
    compare(k_cache[row.long(), :, pos.long()], k16, rtol=1e-3, atol=4e-3, what="k")
    assert_equal(v_cache[row.long(), :, pos.long()], v16, "v")
    assert int((~k_cache.isnan()).sum()) == rows * n_kv * d  # one slot per row, nothing else


@pytest.fixture
def forced_heads(monkeypatch):
    """Run rope_kv at a given heads-per-thread whatever T is: one SM as far as the launcher knows, so it never lowers
    the tuning's value to spread a small grid."""
    import kernels_cu.rope_kv as module
    from kernels_cu import tuning

    monkeypatch.setattr(module, "sm_count", lambda index=None: 1)
    return lambda n: tuning.override(rope_heads_per_thread=n)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("n_heads,n_kv,d", [(6, 2, 64), (32, 8, 128), (2, 1, 16), (4, 2, 80)])
@pytest.mark.parametrize("T", [1, 5, 257])
def test_heads_per_thread_bitwise(T, n_heads, n_kv, d, n, forced_heads):
    """Each thread's n heads (10 heads: the last head block part empty at n = 3, 4; T = 257: tokens straddle blocks)
    give transformers' bits in q and the fp16 cache, and write no other slot; int8 codes and scales as write_kv_ref."""
    Bq, Lq = 3, 100
    qkv = randn(T, (n_heads + 2 * n_kv) * d, scale=2.0, seed=T + n)
    table = rope_table(d, 10000.0, Lq, device="cuda")
    slots = torch.randperm(Bq * Lq, generator=torch.Generator().manual_seed(n))[:T]  # distinct (row, position)
    row, pos = (slots // Lq).to(torch.int32).cuda(), (slots % Lq).to(torch.int32).cuda()
    q16, k16, v16 = rope_kv_ref(qkv, table, pos, n_heads, n_kv)
    kc, vc = (torch.full((Bq, n_kv, Lq, d), float("nan"), dtype=torch.float16, device="cuda") for _ in range(2))
    with forced_heads(n):
        q_out = rope_kv(qkv, table, pos, row, kc, vc, n_heads, n_kv)
    assert_equal(q_out, q16, "q")
    want_k, want_v = torch.full_like(kc, float("nan")), torch.full_like(vc, float("nan"))
    write_kv_ref(want_k, want_v, k16, v16, pos, row)
    assert_equal(kc, want_k, "k cache (whole)")
    assert_equal(vc, want_v, "v cache (whole)")
    if (d // 16) & (d // 16 - 1):
        return  # the 8-bit caches need a power-of-two d / 16
    k8, v8 = (torch.full((Bq, n_kv, Lq, d), -128, dtype=torch.int8, device="cuda") for _ in range(2))
    ks, vs = (torch.full((Bq, n_kv, Lq), float("nan"), device="cuda") for _ in range(2))
    with forced_heads(n):
        assert_equal(rope_kv(qkv, table, pos, row, k8, v8, n_heads, n_kv, k_scale=ks, v_scale=vs), q16, "q (int8)")
    want_k, want_v = torch.full_like(k8, -128), torch.full_like(v8, -128)
    want_ks, want_vs = torch.full_like(ks, float("nan")), torch.full_like(vs, float("nan"))
    write_kv_ref(want_k, want_v, k16, v16, pos, row, want_ks, want_vs)
    for got, want, what in ((k8, want_k, "k int8"), (v8, want_v, "v int8"), (ks, want_ks, "k scales"),
                            (vs, want_vs, "v scales")):
        assert_equal(got, want, what)


@pytest.mark.parametrize("n", [1, 4])
def test_guards_at_every_heads_per_thread(n, forced_heads):
    """Outside the table: q = 0, no write; outside the cache: rotated q, no write; with 4 heads a thread too."""
    n_heads, n_kv, d = 4, 2, 64
    qkv = randn(5, (n_heads + 2 * n_kv) * d, seed=4)
    table = rope_table(d, 10000.0, 80, device="cuda")  # positions 0..79; the cache holds 0..63
    pos = torch.tensor([3, -1, 70, 90, 5], dtype=torch.int32, device="cuda")
    row = torch.tensor([0, 1, 2, 3, 4], dtype=torch.int32, device="cuda")  # row 4: outside the cache
    k_cache, v_cache = caches(n_kv, d, torch.float16)
    with forced_heads(n):
        q_out = rope_kv(qkv, table, pos, row, k_cache, v_cache, n_heads, n_kv)
    written = ~k_cache.isnan() | ~v_cache.isnan()
    assert bool(written[0, :, 3].all())
    written[0, :, 3] = False
    assert int(written.sum()) == 0, "an out-of-range token wrote into the cache"
    assert int(q_out[1].abs().sum()) == 0 and int(q_out[3].abs().sum()) == 0
    ok = torch.tensor([0, 2, 4], device="cuda")
    q16, _, _ = rope_kv_ref(qkv[ok], table, pos[ok], n_heads, n_kv)
    assert_equal(q_out[ok], q16, "rotated q of the tokens inside the table")
