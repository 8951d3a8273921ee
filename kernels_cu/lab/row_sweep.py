"""Lab: the fp8 prefill's row kernels (fp8_silu_mul, fp8_rmsnorm with the residual, fp8_quantize; int8's SwiGLU row
timed beside them) against variants of their width (vectors a thread, threads a row) and register budget
(lab/row_sweep.cu), LLaMA-2-7B's 2,048-token shapes. Each variant's codes and scales are compared bit for bit with the
product kernel's; times are CUDA events over back-to-back launches (median of 15 batches of 20), inputs rotated past
the L2.

    python -m kernels_cu.lab.row_sweep [--tokens 2048] [--hidden 4096] [--ffn 11008]
"""
from __future__ import annotations

import argparse
import re
import statistics

import torch

from kernels_cu import build
from kernels_cu.checks import row_launch, silu_row_launch
from kernels_cu.fp8_quantize import SIGNATURE, SILU_SIGNATURE
from kernels_cu.rmsnorm import SIGNATURE as NORM_SIGNATURE
from kernels_cu.silu_mul import SIGNATURE as I8_SILU_SIGNATURE

LAB = "lab/row_sweep.cu"


def timed(call, sets: int, batches: int = 15, per: int = 20) -> float:
    """Median us of one call (call(i) uses input set i % sets)."""
    for i in range(5):
        call(i)
    out = []
    for _ in range(batches):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(build.torch_stream())
        for i in range(per):
            call(i)
        b.record(build.torch_stream())
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / per)
    return statistics.median(out)


def variants(prefix: str) -> list[tuple[str, int, int]]:
    """(entry, NV, threads) of the lab file's entries named prefix_nv{NV}_t{T}_b{B}."""
    text = (build.KERNEL_DIR / LAB).read_text()
    found = []
    macro = {"silu": "SILU_V", "norm": "NORM_V", "quant": "QUANT_V"}[prefix]
    for nv, t, b in re.findall(macro + r"\((\d+), (\d+), (\d+)\)", text):
        found.append((f"{prefix}_nv{nv}_t{t}_b{b}", int(nv), int(t)))
    return found


def run_family(title, product, lab_prefixes, sig, make_args, outputs, sets, mbytes, rows):
    """Time the product entry and each lab variant; print us, TB/s, registers and bit equality."""
    p_name, p_threads = product
    fn = build.get_function(p_name[0], p_name[1], sig)
    fn_call = lambda f, threads: (lambda i: f((rows,), (threads,), *make_args(i)))
    base_t = timed(fn_call(fn, p_threads), sets)
    fn_call(fn, p_threads)(0)
    want = [o.clone() for o in outputs(0)]
    print(f"\n{title}: product {p_name[1]} ({p_threads} threads, {fn.num_regs} regs) {base_t:.2f} us "
          f"({mbytes / base_t:.2f} TB/s)")
    for prefix in lab_prefixes:
        for name, nv, threads in variants(prefix):
            f = build.get_function(LAB, name, sig)
            for o in outputs(0):
                o.fill_(0)
            fn_call(f, threads)(0)
            same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(outputs(0), want))
            t = timed(fn_call(f, threads), sets)
            print(f"  {name:22s} {f.num_regs:3d} regs {t:7.2f} us {mbytes / t:5.2f} TB/s  x{base_t / t:5.3f}  "
                  f"bits {'equal' if same else 'DIFFER'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=11008)
    a = ap.parse_args()
    T, H, F = a.tokens, a.hidden, a.ffn
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    with build.on_stream():
        # SwiGLU: one 90 MB input already exceeds the L2
        gu = [(torch.randn(T, 2 * F, device=dev, generator=g) * 3).half() for _ in range(2)]  # [T, 2F] interleaved
        q_f = [torch.empty(T, F, dtype=torch.uint8, device=dev) for _ in range(2)]
        s_f = [torch.empty(T, device=dev) for _ in range(2)]
        nv, threads = silu_row_launch(F // 8)
        run_family("fp8_silu_mul", (("fp8_quantize.cu", f"fp8_silu_mul_dyn_nv{nv}"), threads), ("silu",),
                   SILU_SIGNATURE, lambda i: (q_f[i % 2], s_f[i % 2], None, gu[i % 2], F),
                   lambda i: (q_f[i % 2], s_f[i % 2]), 2, (T * 2 * F * 2 + T * F) / 1e6, T)

        q_i = [torch.empty(T, F, dtype=torch.int8, device=dev) for _ in range(2)]
        run_family("int8 silu_mul_dyn (the same bytes as [gate | up])", (("silu_mul.cu", f"silu_mul_dyn_nv{nv}"),
                   threads), (),
                   I8_SILU_SIGNATURE, lambda i: (None, q_i[i % 2], s_f[i % 2], None, gu[i % 2], F),
                   lambda i: (q_i[i % 2], s_f[i % 2]), 2, (T * 2 * F * 2 + T * F) / 1e6, T)

        sets = 4  # 4 x 32 MB of inputs rotate past the 50 MB L2
        x = [(torch.randn(T, H, device=dev, generator=g)).half() for _ in range(sets)]
        res = [(torch.randn(T, H, device=dev, generator=g) * 4).half() for _ in range(sets)]
        res0 = res[0].clone()
        w = (torch.rand(H, device=dev, generator=g) + 0.5).half()
        q_h = [torch.empty(T, H, dtype=torch.uint8, device=dev) for _ in range(sets)]
        s_h = [torch.empty(T, device=dev) for _ in range(sets)]
        nv, threads = row_launch(H // 8)

        def norm_args(i):
            if i == 0:
                res[0].copy_(res0)  # the product's and each variant's first run see the same residual
            return (None, q_h[i % sets], s_h[i % sets], None, res[i % sets], x[i % sets], w, H, 1e-5)

        run_family("fp8_rmsnorm add (residual += x, codes)", (("fp8_quantize.cu", f"fp8_rmsnorm_add_dyn_nv{nv}"),
                   threads), ("norm",), NORM_SIGNATURE, norm_args,
                   lambda i: (q_h[i % sets], s_h[i % sets], res[i % sets]), sets, (T * H * 2 * 3 + T * H) / 1e6, T)
        run_family("fp8_quantize", (("fp8_quantize.cu", f"fp8_quantize_dyn_nv{nv}"), threads), ("quant",),
                   SIGNATURE, lambda i: (q_h[i % sets], s_h[i % sets], None, x[i % sets], H),
                   lambda i: (q_h[i % sets], s_h[i % sets]), sets, (T * H * 2 + T * H) / 1e6, T)


if __name__ == "__main__":
    main()
