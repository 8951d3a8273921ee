"""Every kernel once or twice on small random shapes, for compute-sanitizer (memcheck / racecheck), which is
too slow for the full test matrix:  compute-sanitizer --tool memcheck python -m tests.gpu.sanitize_smoke"""

from __future__ import annotations

import torch

from kernels_cu import build


def main() -> None:
    from kernels_cu.attention_decode import (attention_decode, attention_decode_quant, attention_decode_rope,
                                             attention_decode_rope_quant)
    from kernels_cu.attention_prefill import attention_prefill
    from kernels_cu.awq_gemm import awq_dequantize, awq_gemm
    from kernels_cu.awq_gemv import awq_batch_gemm, awq_linear, awq_packed_dequantize, pack_for_gemv
    from kernels_cu.embedding import embedding, embedding_fold
    from kernels_cu.norm_fold import FoldOut
    from kernels_cu.fp16_gemv import fp16_linear, fp16_swiglu, w8a16_linear
    from kernels_cu import awq_wgmma, awq_wgmma_decode
    from kernels_cu.int8_gemm import (DeferredQuant, NormQuant, int8_gemm, int8_gemm_deferred, int8_gemm_norm,
                                      int8_swiglu_norm)
    from kernels_cu.quantize import quantize
    from kernels_cu.rmsnorm import add_rmsnorm, add_rmsnorm_quant, rmsnorm, rmsnorm_quant
    from kernels_cu.rope_kv import rope_kv, rope_table
    from kernels_cu.sampling import GpuSampler
    from kernels_cu.silu_mul import silu_mul, silu_mul_quant
    from model_zoo.quant.awq_pack import quantize_awq
    from model_zoo.quant.int8 import quantize_weight_int8
    from model_zoo.sampling import SamplingConfig

    build.require_cuda()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, device=dev, dtype=torch.float16)
    with build.on_stream():
        H, F, V, nh, nkv, d = 576, 1536, 1000, 9, 3, 64
        for T in (1, 7, 33):
            x, w = r(T, H), r(H)
            rmsnorm(x, w, 1e-5)
            rmsnorm_quant(x, w, 1e-5)
            rmsnorm_quant(x, w, 1e-5, torch.tensor([3.0], device=dev))
            add_rmsnorm(r(T, H), x, w, 1e-5)
            add_rmsnorm_quant(r(T, H), x, w, 1e-5)
            quantize(x)
            silu_mul(r(T, 2 * F))
            silu_mul_quant(r(T, 2 * F))
            silu_mul_quant(r(T, 2 * F), split=True)  # silu_mul_part + quantize_fold (rows spread over blocks)
            silu_mul_quant(r(T, 2 * F), torch.tensor([3.0], device=dev), split=True)
            embedding(r(V, H), torch.randint(0, V, (T,), device=dev))
            for M in (T, 17):
                xm = r(M, H)
                wd = r(F, H)
                fp16_linear(xm, wd, residual=r(M, F))
                fp16_swiglu(xm, r(2 * F, H))
                qw, ws = quantize_weight_int8(wd.float())
                w8a16_linear(xm, qw, ws)
                qx, sx = quantize(xm)
                int8_gemm(qx, sx, qw, ws, residual=r(M, F))
                aq, az, asc = quantize_awq(wd.float(), 64)
                awq_gemm(xm, aq, az, asc, residual=r(M, F))
                ap = pack_for_gemv(aq, az, asc)
                awq_linear(xm, ap, residual=r(M, F))
                awq_linear(xm, pack_for_gemv(aq, az, asc, swiglu=True))
                awq_batch_gemm(xm, ap, residual=r(M, F), splits=3)  # K split: partials, counters, last block
                if M <= 8:  # the deferred RMSNorm: producers (residual GEMVs, embedding), then consumers
                    _, fe = embedding_fold(r(V, H), torch.randint(0, V, (M,), device=dev), r(H))
                    embedding_fold(r(V, H), torch.randint(0, V, (M,), device=dev), r(H), int8=True)
                    fp16_linear(fe.xg, wd, fold_in=fe.consumer(1e-5))
                    w8a16_linear(fe.xg, qw, ws, fold_in=fe.consumer(1e-5))
                    fp16_swiglu(fe.xg, r(2 * F, H), fold_in=fe.consumer(1e-5))
                    awq_linear(fe.xg, ap, fold_in=fe.consumer(1e-5))
                    awq_linear(fe.xg, pack_for_gemv(aq, az, asc, swiglu=True), fold_in=fe.consumer(1e-5))
                    wo = r(H, F)
                    if M == 1:  # the one-row int8 GEMVs that quantize their input in the main loop
                        f8 = FoldOut.new(r(H), 1, int8=True)
                        qo, so = quantize_weight_int8(wo.float())
                        a = r(1, F)
                        int8_gemm_deferred(DeferredQuant(a, a.float().abs().reshape(1, -1, 8).amax(-1)), qo, so,
                                           residual=r(1, H), fold_out=f8)  # f8 written: finite xg, sums, maxima
                        int8_gemm_norm(NormQuant(f8.xg, f8.mx, f8.part, 1e-5, zero=torch.ones(1, device=dev)),
                                       qw, ws)
                        qgu, sgu = quantize_weight_int8(r(2 * F, H).float())
                        int8_swiglu_norm(NormQuant(f8.xg, f8.mx, f8.part, 1e-5), qgu, sgu,
                                         row_amax=torch.zeros(1, device=dev))
                    fp16_linear(r(M, F), wo, residual=r(M, H), fold_out=FoldOut.new(r(H), M))
                    # groups of 128 over 768 panels: on 132 SMs the 2-warp AWQ entries (awq_gemv.gemv_warps)
                    a128 = quantize_awq(r(12288, 256).float(), 128)
                    p768 = pack_for_gemv(*a128)
                    awq_linear(r(M, 256), p768, residual=r(M, 12288), fold_out=FoldOut.new(r(12288), M))
                    awq_linear(r(M, 256), pack_for_gemv(*a128, swiglu=True))
                    _, f256 = embedding_fold(r(V, 256), torch.randint(0, V, (M,), device=dev), r(256))
                    awq_linear(f256.xg, p768, fold_in=f256.consumer(1e-5))
                    if T == 7:  # 8 rows over 1,100 panels: the 1-warp entries (gemv_warps at 8 rows on 114-132 SMs)
                        a1100 = quantize_awq(r(17600, 256).float(), 128)
                        p1100 = pack_for_gemv(*a1100)
                        awq_linear(r(8, 256), p1100, residual=r(8, 17600), fold_out=FoldOut.new(r(17600), 8))
                        awq_linear(r(8, 256), pack_for_gemv(*a1100, swiglu=True))
                        _, f8r = embedding_fold(r(V, 256), torch.randint(0, V, (8,), device=dev), r(256))
                        awq_linear(f8r.xg, p1100, fold_in=f8r.consumer(1e-5))
                    awq_linear(r(M, F), pack_for_gemv(*quantize_awq(wo.float(), 64)), residual=r(M, H),
                               fold_out=FoldOut.new(r(H), M))
            awq_dequantize(aq, az, asc)
            awq_packed_dequantize(ap)
        if build.has_wgmma(torch.cuda.current_device()):  # the Hopper prefill GEMMs, ragged tiles and tails
            xm = r(130, H)
            qw, ws = quantize_weight_int8(r(200, H).float())
            qx, sx = quantize(xm)
            int8_gemm(qx, sx, qw, ws, residual=r(130, 200), wgmma=True)
            p128 = pack_for_gemv(*quantize_awq(r(272, 640).float(), 128))
            awq_wgmma.launch(r(130, 640), p128, r(130, 272), None)
            for m, sp in ((40, 3), (32, None)):  # the decode-batch GEMM: a part-used token tile, K split 3 ways
                awq_wgmma_decode.launch(r(m, 640), pack_for_gemv(*quantize_awq(r(320, 640).float(), 128)),
                                        r(m, 320), None, splits=sp)
        B, L = 3, 300
        for kc, vc, ks, vs in kv_caches(B, nkv, L, d):
            cs = rope_table(d, 10000.0, L, dev)
            T = 20
            qkv = r(B * T, (nh + 2 * nkv) * d)
            pos = torch.arange(T, device=dev, dtype=torch.int32).repeat(B)
            row = torch.arange(B, device=dev, dtype=torch.int32).repeat_interleave(T)
            q = rope_kv(qkv, cs, pos, row, kc, vc, nh, nkv, k_scale=ks, v_scale=vs)
            lengths = torch.tensor([T, 5, 0], device=dev, dtype=torch.int32)
            qd = q.view(B, T, nh, d)[:, -1].contiguous()
            attention_decode(qd, kc, vc, lengths, ks, vs)
            attention_decode(qd, kc, vc, lengths, ks, vs, fused=False)
            attention_decode_quant(qd, kc, vc, lengths, None, ks, vs)
            qkv_new = r(B, (nh + 2 * nkv) * d)  # RoPE mode: position lengths - 1 written, then attended
            attention_decode_rope(qkv_new, cs, kc, vc, lengths, nh, ks, vs)
            attention_decode_rope_quant(qkv_new, cs, kc, vc, lengths, nh, None, ks, vs)
            if ks is None:  # fp16 cache
                attention_prefill(q.view(B, T, nh, d)[0], kc, vc, 0, 0)
        sampler = GpuSampler(4, V, eos_ids=[2], device=dev)
        for cfg in (SamplingConfig(temperature=0), SamplingConfig(temperature=0.9, top_k=40, top_p=0.9,
                                                                  repetition_penalty=1.2, seed=1)):
            sampler.set_config(cfg)
            for _ in range(3):
                sampler.sample(r(4, V).float())
        if build.has_wgmma(torch.cuda.current_device()):
            fp8_wgmma_decode_smoke()
    rope_kv_smoke()
    sampler_vocab_smoke()
    build.synchronize()
    print("sanitize smoke: all kernels ran")


def sampler_vocab_smoke() -> None:
    """The sampler at Llama-3's 128,256 tokens, where top-p sorts its full 2,048 candidates: each kind of row
    (greedy, temperature, top-k, top-p with a penalty) on the cluster entry and on one block a row."""
    from kernels_cu import tuning
    from kernels_cu.sampling import GpuSampler
    from model_zoo.sampling import SamplingConfig

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(3)
    V = 128_256
    cfgs = (SamplingConfig(temperature=0), SamplingConfig(temperature=0.8, seed=1),
            SamplingConfig(temperature=0.7, top_k=50, seed=2),
            SamplingConfig(temperature=1.0, top_p=0.9, repetition_penalty=1.1, seed=3))
    with build.on_stream():
        for blocks in (8, 1):
            with tuning.override(sample_cluster_blocks=blocks):
                sampler = GpuSampler(2, V, eos_ids=[2], device=dev)
                for cfg in cfgs:
                    sampler.set_config(cfg)
                    sampler.sample(torch.randn(2, V, generator=g, device=dev, dtype=torch.float16) * 3)


def fp8_wgmma_decode_smoke() -> None:
    """fp8_wgmma_decode.cu's three epilogues (the fold and the SwiGLU maxima too) at both token tiles, with and without
    K splits, on ragged K and a partial channel block (an sm_90 GPU)."""
    from kernels_cu import fp8_wgmma_decode as dec
    from kernels_cu.norm_fold import FoldOut

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g, device=dev, dtype=torch.float16)
    e4m3 = lambda *s: (torch.randn(*s, generator=g, device=dev) * 4).to(torch.float8_e4m3fn)
    with build.on_stream():
        K, N, F = 272, 128, 40  # 2 tiles + 16 k; F = 40: a partial block of the SwiGLU's 80 rows
        for M, splits in ((17, None), (17, 2), (40, 2)):
            x8, a = e4m3(M, K), torch.rand(M, device=dev) * 1e-2 + 1e-3
            w8, ws = e4m3(N, K), torch.rand(N, device=dev) * 1e-2 + 1e-3
            dec.fp8_wgmma_decode(x8, a, w8, ws, splits=splits)
            dec.fp8_wgmma_decode(x8, a, w8, ws, residual=r(M, N), fold_out=FoldOut.new(r(N), M, int8=True),
                                 splits=splits)
            wg, wgs = e4m3(2 * F, K), torch.rand(2 * F, device=dev) * 1e-2 + 1e-3
            dec.fp8_wgmma_decode(x8, a, wg, wgs, swiglu=True, part=torch.empty(M, F // 8, device=dev), splits=splits)


def rope_kv_smoke() -> None:
    """rope_kv's launches of several heads a thread (rope_kv.rope_launch): a grid large enough for 4 heads a thread
    with a partial last block, a head count n does not divide, positions past the table and the cache, each cache kind."""
    from kernels_cu.rope_kv import rope_kv, rope_table

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(2)
    nh, nkv, d, B, L = 9, 3, 64, 8, 300  # 15 heads: the last head group of 4 is partial
    T = 2203  # > 132 SMs' worth of 256-thread blocks at 4 heads a thread; not a multiple of a block's tokens
    with build.on_stream():
        qkv = torch.randn(T, (nh + 2 * nkv) * d, generator=g, device=dev, dtype=torch.float16)
        t = torch.arange(T, device=dev, dtype=torch.int32)
        pos, row = t % (L + 10), t // (L + 10)  # positions L..L+9 and row 7's tail: no cache write
        cs = rope_table(d, 10000.0, L + 5, dev)  # positions past the table: q = 0
        for kc, vc, ks, vs in kv_caches(B, nkv, L, d):
            rope_kv(qkv, cs, pos, row, kc, vc, nh, nkv, k_scale=ks, v_scale=vs)


def silu_rows_smoke() -> None:
    """The SwiGLU rows at each width (silu_row_launch: 1, 2 and 4 vectors a thread, up to 1,024 threads), rows whose
    last threads' vectors fall past the row (the loads-first guards), int8 and fp8 codes, dynamic and static."""
    from kernels_cu.fp8_quantize import fp8_silu_mul, has_fp8
    from kernels_cu.silu_mul import silu_mul, silu_mul_quant

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(3)
    fp8 = has_fp8(torch.cuda.current_device())
    with build.on_stream():
        for F in (1032, 2056, 11008, 28680):  # 1 vector a thread, 2, 4 on 352 threads, 4 on 928 (some past the row)
            y = torch.randn(3, 2 * F, generator=g, device=dev, dtype=torch.float16)
            silu_mul(y)
            silu_mul_quant(y)
            silu_mul_quant(y, torch.tensor([3.0], device=dev))
            if fp8:
                fp8_silu_mul(y)
                fp8_silu_mul(y, torch.tensor([0.01], device=dev))


def kv_caches(B: int, nkv: int, L: int, d: int):
    """(k, v, k scales, v scales) of zeros for each cache kind this GPU has: fp16 (no scales), int8, e4m3."""
    from kernels_cu.fp8_quantize import has_fp8

    dev = torch.device("cuda")
    kinds = [torch.float16, torch.int8] + ([torch.float8_e4m3fn] if has_fp8(torch.cuda.current_device()) else [])
    for kv_dtype in kinds:
        kc = torch.zeros(B, nkv, L, d, device=dev, dtype=kv_dtype)
        scales = torch.zeros(B, nkv, L, device=dev) if kv_dtype != torch.float16 else None
        yield kc, torch.zeros_like(kc), scales, None if scales is None else torch.zeros_like(scales)


if __name__ == "__main__":
    main()
