"""Lab: L2 cache policies for streamed weights (lab/l2_hint.cu).

A Llama-3.2-1B decode step pays for code that the lm_head's 263 MB stream pushed out of the L2: the sampler, and
layer 0's kernels after it (docs/gpu.md, sampling). Loading the head's weight (or every weight) with an evict_first
policy might keep that code resident. This tool answers two questions on a GPU:
1. Which forms run? Each is launched in a child process, since an illegal instruction poisons the context.
   On the H200 on 2026-11-28, the engine's cp_async16 and ld_stream with such a policy died that way.
2. For the forms that run: the stream's rate, and the read time of a hot buffer (default 4 MB) after a stream of
   that form (default 512 MB). The hot buffer hits the L2 if the stream spared it.

    python -m kernels_cu.lab.l2_hint [--stream-mb 512] [--hot-mb 4] [--pdl]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

import torch

from kernels_cu import build

LAB = "lab/l2_hint.cu"
SIG = "PqP"  # (src, 16-byte words, out)
FORMS = {0: "cp.async.cg", 1: "cp.async.cg, evict_first policy", 2: "cp.async.cg, policy and src-size",
         3: "ld.global.nc.L1::no_allocate, policy", 4: "ld.global.cs"}


def launch(name: str, buf: torch.Tensor, out: torch.Tensor, blocks: int) -> None:
    build.get_function(LAB, name, SIG)((blocks,), (256,), buf, buf.numel() // 4, out)  # int32 words: 4 a uint4


def run_once(form: int, pdl: bool) -> None:
    """The child: one stream of `form` over 64 MB, synchronized (a fault surfaces here)."""
    buf = torch.randint(0, 2**30, (16 * 2**20,), dtype=torch.int32, device="cuda")
    out = torch.zeros(1, dtype=torch.int32, device="cuda")
    with build.on_stream():
        if pdl:
            with build.programmatic():
                launch(f"stream_f{form}", buf, out, 264)
                launch(f"stream_f{form}", buf, out, 264)
        else:
            launch(f"stream_f{form}", buf, out, 264)
        build.synchronize()
    print("ok")


def runs(form: int, pdl: bool) -> str:
    cmd = [sys.executable, "-m", "kernels_cu.lab.l2_hint", "--one", str(form)] + (["--pdl"] if pdl else [])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if r.returncode == 0 and r.stdout.strip().endswith("ok"):
        return "ok"
    lines = [ln for ln in (r.stderr + r.stdout).splitlines() if ln.strip()]
    return "FAILS: " + (lines[-1] if lines else f"exit {r.returncode}")


def events_us(fn, reps: int = 15) -> float:
    """Median us of fn(), each call between two events (after the work queued before it)."""
    ts = build.torch_stream()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fn(before=lambda: a.record(ts), after=lambda: b.record(ts))
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3)
    return statistics.median(out)


def measure(form: int, stream_mb: int, hot_mb: int) -> tuple[float, float]:
    """(stream GB/s, hot read us after the stream) for a form that runs."""
    big = torch.randint(0, 2**30, (stream_mb * 2**18,), dtype=torch.int32, device="cuda")
    hot = torch.randint(0, 2**30, (hot_mb * 2**18,), dtype=torch.int32, device="cuda")
    out = torch.zeros(1, dtype=torch.int32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    with build.on_stream():
        def stream_timed(before, after):
            launch("hot_read", hot, out, sms)  # the hot buffer in the L2
            before()
            launch(f"stream_f{form}", big, out, 2 * sms)
            after()

        def hot_timed(before, after):
            launch("hot_read", hot, out, sms)
            launch(f"stream_f{form}", big, out, 2 * sms)
            before()
            launch("hot_read", hot, out, sms)
            after()

        stream_us = events_us(stream_timed)
        hot_us = events_us(hot_timed)
    return stream_mb * 2**20 / stream_us / 1e3, hot_us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stream-mb", type=int, default=512)
    ap.add_argument("--hot-mb", type=int, default=4)
    ap.add_argument("--pdl", action="store_true", help="also launch each form with programmatic dependent launch")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # the child of a form's check
    args = ap.parse_args()
    build.require_cuda()
    if args.one is not None:
        run_once(args.one, args.pdl)
        return
    ok = []
    for form, what in FORMS.items():
        status = runs(form, False) + (f"; with PDL {runs(form, True)}" if args.pdl else "")
        print(f"form {form} ({what}): {status}", flush=True)
        if status.startswith("ok"):
            ok.append(form)
    print(f"\nstream {args.stream_mb} MB, then a {args.hot_mb} MB hot buffer read again (us; L2-resident if spared)")
    for form in ok:
        gbs, hot = measure(form, args.stream_mb, args.hot_mb)
        print(f"  form {form} ({FORMS[form]}): stream {gbs:7.1f} GB/s, hot read after it {hot:6.2f} us", flush=True)


if __name__ == "__main__":
    main()
