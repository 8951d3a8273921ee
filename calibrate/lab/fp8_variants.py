"""FP8 W8A8 variants on SmolLM2-135M, quantized in-process and judged as docs/quality.md judges a checkpoint: the
first 16,384 Sherlock tokens in 32 windows of 512 (tokens 2..512 of each scored), perplexity, KL(fp16 || model) and
top-1 agreement against the fp16 export, plus the paired standard error of the perplexity ratio over the windows.

    python -m calibrate.lab.fp8_variants --stats stats.safetensors --out lab8                       # dynamic, defaults
    python -m calibrate.lab.fp8_variants --stats stats.safetensors --out lab8 --smooth 0.5          # + SmoothQuant
    python -m calibrate.lab.fp8_variants --stats stats.safetensors --out lab8 --act static --calibrator entropy
    python -m calibrate.lab.fp8_variants --stats stats.safetensors --out lab8 --act static --calibrator percentile \\
        --percentile 99.9999
    python -m calibrate.lab.fp8_variants --stats stats.safetensors --out lab8 --gptq-tokens 8192    # GPTQ on less text
    python -m calibrate.lab.fp8_variants --stats stats.safetensors --out lab8 --acts-only --smooth 0.5 --windows 8
    python -m calibrate.lab.fp8_variants --stats stats.safetensors --out lab8 --choose-kinds         # see below
    python -m calibrate.lab.fp8_variants --stats stats.safetensors --out lab8 --act static --calibrator max \
        --headroom 2 --eval-text heldout
    python -m calibrate.lab.fp8_variants --stats stats.safetensors --out lab8 --act static \\
        --calibrator qkv=mse,o=mse,gate_up=max,down=mse

Single calibrators run calibrate.quantize.quantize_fp8 as `fllama quantize --scheme fp8` does (with SmoothQuant and
static ranges the smoothed model is re-captured on the stats' 128 windows, cached per alpha under --out). A per-kind
calibrator (`qkv=...,o=...,gate_up=...,down=...`) builds the same static model with each capture-point kind's
ranges from its own method. `--acts-only`: float weights (fp16-rounded), dynamic e4m3 activations only.
`--headroom F`: the dynamic run's weights with static ranges of --calibrator times F. `--eval-text heldout`: score
on the 8 History windows after the stats' (text the stats never saw) instead of Sherlock. `--choose-kinds`: each
kind's method among max, mse and entropy by coordinate descent from all-max, judged by the KL of the model's
next-token distributions against the float model's on held-out CALIBRATION windows (the last 8 of the stats' text;
GPTQ reads the first 64), the GPTQ + search weights of the dynamic run held fixed; it never reads Sherlock and
prints the mix to evaluate. Results go to --out/results.jsonl. A benchmark, not a test: a run takes
2-10 minutes on 2 CPU cores (the 32-window evaluation about 1-3 of them).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from calibrate.calibration import DataConfig, calibration_windows
from calibrate.capture import CaptureConfig, capture_stats
from calibrate.gptq_round import GptqConfig, LayerHessians
from calibrate.methods import CalibConfig, CalibMethod, QuantGrid
from calibrate.quantize import FP8_GPTQ, POINT_OF, QuantConfig, _fp8_weight, quantize_fp8
from calibrate.ranges import compute_amax, scale_from_amax
from calibrate.smoothquant import apply_smoothing
from calibrate.stats import POINT_KINDS, CalibStats
from model_zoo.cpu_fast import CpuModel
from model_zoo.load import load_model
from model_zoo.quant.checkpoint import build_weights
from model_zoo.quant.formats import Scheme
from model_zoo.quant.fp8 import FP8_MAX, to_e4m3
from model_zoo.quant.int8 import AMAX_MIN, ActQuant
from model_zoo.quant.linear import Fp8Linear
from model_zoo.text_sources import load_text, token_windows
from model_zoo.weights import ModelWeights

SEQ, EVAL_TOKENS, HELD_OUT = 512, 16384, 8
CANDIDATES = ("max", "mse", "entropy")  # --choose-kinds


def fake_e4m3(x: torch.Tensor, acts: str) -> torch.Tensor:
    """x [M, K] fp32 -> its dynamic e4m3 rounding: per token, per group of G inputs ('gG'), or none."""
    if acts == "none":
        return x
    m, k = x.shape
    g = k if acts == "token" else int(acts[1:])
    pad = -k % g
    xp = torch.nn.functional.pad(x, (0, pad)).view(m, -1, g)  # [M, ceil(K/G), G]; zeros change no group's amax
    s = xp.abs().amax(dim=-1, keepdim=True).clamp(min=AMAX_MIN) / FP8_MAX  # [M, groups, 1]
    q = to_e4m3(xp * (1.0 / s)).float() * s  # [M, groups, G]: fp8.py's order, one division per scale
    return q.reshape(m, -1)[:, :k]


class FakeLinear:
    """W [N, K] (fp32: e4m3 codes times their scales, or the fp16 export's values) reading fake_e4m3(x); with the
    export's weights and per-token activations, what the activations alone cost."""

    def __init__(self, w: torch.Tensor, acts: str):
        self.w, self.acts = w.float(), acts  # [N, K]
        self.out_features, self.in_features = w.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).float()  # [M, K]
        y = fake_e4m3(x2, self.acts) @ self.w.T  # [M, N]
        return y.reshape(*x.shape[:-1], -1).to(x.dtype)

    def dense_weight(self) -> torch.Tensor:
        return self.w

    def to(self, device=None, dtype=None) -> "FakeLinear":
        return self


def lab_setup(args: argparse.Namespace) -> tuple:
    """(loaded, fp32 weights, stats, calibration windows [128, 512]) of the real SmolLM2, as the lab drivers read
    them (args: threads, out, stats)."""
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    loaded = load_model(None, dtype=torch.float32)
    weights = build_weights(loaded, torch.float32, "cpu")
    stats = CalibStats.load(args.stats)
    stats.check_model(loaded.config)
    cwin = calibration_windows(loaded.tokenizer, DataConfig(stats.meta["source"], stats.meta["samples"], SEQ),
                               loaded.config.max_positions)  # [128, 512]
    return loaded, weights, stats, cwin


def cached_recapture(out: Path, alpha: float | None, cwin: torch.Tensor, stats: CalibStats, cap: CaptureConfig):
    """The quantizers' re-capture of a smoothed model, cached in `out` per alpha (the windows and stats never vary)."""

    def recapture(model: ModelWeights):
        path = out / f"points_smooth{alpha}.pt"
        if not path.exists():
            torch.save(capture_stats(model, cwin, stats.meta.get("bins", 2048), cap), path)
        return torch.load(path, weights_only=False)

    return recapture


def as_exported(weights: ModelWeights) -> ModelWeights:
    """What a checkpoint gives back: embedding, norms and lm_head stored in fp16."""
    h = lambda t: t.half().float()  # noqa: E731
    emb = h(weights.embed)
    head = emb if weights.lm_head is weights.embed else h(weights.lm_head)
    layers = [replace(l, attn_norm=h(l.attn_norm), ffn_norm=h(l.ffn_norm)) for l in weights.layers]
    return replace(weights, embed=emb, lm_head=head, norm=h(weights.norm), layers=layers)


def _logp(model: CpuModel, window: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(model.forward(window[None])[0, :-1].float(), dim=-1)  # [L-1, V]


def baseline(path: Path, weights: ModelWeights, windows: torch.Tensor) -> np.memmap:
    """The fp16 export's log-probabilities on `windows` [n, L], cached in `path` (n x (L-1) x V fp32)."""
    shape = (windows.shape[0], windows.shape[1] - 1, weights.config.vocab_size)
    if not path.exists():
        model = CpuModel(as_exported(weights))
        tmp = np.memmap(path.with_suffix(".tmp"), dtype=np.float32, mode="w+", shape=shape)
        for i, w in enumerate(windows):
            tmp[i] = _logp(model, w).numpy()
        tmp.flush()
        del tmp
        os.replace(path.with_suffix(".tmp"), path)
    return np.memmap(path, dtype=np.float32, mode="r", shape=shape)


def evaluate(weights: ModelWeights, windows: torch.Tensor, base: np.memmap) -> dict:
    """Perplexity, mean KL(base || model), top-1 agreement, and the standard error (in % of perplexity) of the
    perplexity ratio from the per-window differences of mean NLL (paired: the same tokens)."""
    model = CpuModel(as_exported(weights))
    nll = kl = agree = count = 0.0
    diffs = []
    for i, w in enumerate(windows):
        lp, b, t = _logp(model, w), torch.from_numpy(np.array(base[i])), w[1:, None]  # [L-1, V] x2, [L-1, 1]
        nll += float(-lp.gather(-1, t).sum())
        diffs.append(float((b.gather(-1, t) - lp.gather(-1, t)).mean()))
        kl += float((b.exp() * (b - lp)).sum())
        agree += int((b.argmax(-1) == lp.argmax(-1)).sum())
        count += t.numel()
    d = np.array(diffs)
    se = 100 * float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else float("nan")
    return {"ppl": math.exp(nll / count), "kl": kl / count, "top1": agree / count, "se_pct": se, "windows": len(d)}


def kind_mix(spec: str) -> dict[str, str] | None:
    """'qkv=mse,o=mse,gate_up=max,down=mse' -> {kind: method}; a single method name -> None."""
    if "=" not in spec:
        return None
    mix = dict(part.split("=", 1) for part in spec.split(","))
    if set(mix) != set(POINT_KINDS):
        raise SystemExit(f"a per-kind calibrator names every kind {POINT_KINDS} once, got {spec}")
    return mix


def kind_amax(stats: CalibStats, i: int, kind: str, method: str, percentile: float | None) -> float:
    p = stats.points[f"layers.{i}.{kind}"]
    if method == "max":
        return p.amax
    calib = CalibConfig(method=CalibMethod(method), **({"percentile": percentile} if percentile else {}))
    return compute_amax(CalibMethod(method), p.hist, p.edges, calib, QuantGrid.FP8)


def static_scale(amax: float) -> float:
    return float(scale_from_amax(torch.tensor(amax), QuantGrid.FP8))


def quantize_mix(weights: ModelWeights, stats: CalibStats, mix: dict, windows, cap, gptq: GptqConfig) -> ModelWeights:
    """Static fp8 as quantize_fp8 builds it (GPTQ + search, each layer's Hessians from its inputs with the layers
    before quantized), each kind's ranges from mix[kind]."""
    cfg = QuantConfig(scheme=Scheme.FP8, act=ActQuant.STATIC, calibrator=CalibMethod.MAX)
    inputs, out = LayerHessians(weights, windows, cap, gptq), []
    for i, layer in enumerate(weights.layers):
        h = inputs.hessians(layer)
        linears = {}
        for attr, lin in layer.linears().items():
            w8, w_scale = _fp8_weight(lin.dense_weight().float(), h[POINT_OF[attr]], cfg, inputs.cfg)
            amax = kind_amax(stats, i, POINT_OF[attr], mix[POINT_OF[attr]], None)
            linears[attr] = Fp8Linear(w8, w_scale, ActQuant.STATIC, static_scale(amax), dtype=torch.float32)
        out.append(replace(layer, **linears))
        inputs.advance(out[-1])
    return replace(weights, layers=out, meta={**weights.meta, "scheme": "fp8"})


def with_static_mix(weights: ModelWeights, quantized: list, stats: CalibStats, mix: dict,
                    headroom: float = 1.0) -> ModelWeights:
    """The e4m3 weights of `quantized` (layers of Fp8Linears) with static activation ranges from `mix` x headroom."""
    layers = [replace(layer, **{attr: Fp8Linear(lin.weight8, lin.w_scale, ActQuant.STATIC,
                                                static_scale(headroom * kind_amax(stats, i, POINT_OF[attr],
                                                                                  mix[POINT_OF[attr]], None)),
                                                dtype=torch.float32)
                                for attr, lin in layer.linears().items()})
              for i, layer in enumerate(quantized)]
    return replace(weights, layers=layers, meta={**weights.meta, "scheme": "fp8"})


def smoothed(weights: ModelWeights, stats: CalibStats, alpha: float) -> ModelWeights:
    pts = stats.points
    layers = [apply_smoothing(l, pts[f"layers.{i}.qkv"].max_abs, pts[f"layers.{i}.gate_up"].max_abs, alpha,
                              pts[f"layers.{i}.down"].max_abs) for i, l in enumerate(weights.layers)]
    return replace(weights, layers=layers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stats", required=True, help="`fllama calibrate --method all` statistics (gutenberg:history)")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--act", choices=("dynamic", "static"), default="dynamic")
    ap.add_argument("--calibrator", default=None, help="a method, or a per-kind mix qkv=..,o=..,gate_up=..,down=..")
    ap.add_argument("--percentile", type=float, default=None)
    ap.add_argument("--smooth", type=float, default=None)
    ap.add_argument("--gptq-tokens", type=int, default=FP8_GPTQ.tokens)
    ap.add_argument("--acts-only", action="store_true")
    ap.add_argument("--choose-kinds", action="store_true")
    ap.add_argument("--headroom", type=float, default=None)
    ap.add_argument("--eval-text", choices=("sherlock", "heldout"), default="sherlock")
    ap.add_argument("--windows", type=int, default=EVAL_TOKENS // SEQ, help="Sherlock windows to score (of 32)")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    loaded, weights, stats, cwin = lab_setup(args)
    ewin = token_windows(loaded.tokenizer.encode(load_text("gutenberg:sherlock")), SEQ, EVAL_TOKENS)[: args.windows]
    if args.eval_text == "heldout":  # the windows after the stats' own
        n = stats.meta["samples"]
        ewin = calibration_windows(loaded.tokenizer, DataConfig(stats.meta["source"], n + HELD_OUT, SEQ),
                                   loaded.config.max_positions)[n:]  # [8, 512]
    cap, gptq = CaptureConfig(batch=8), GptqConfig(tokens=args.gptq_tokens)
    t0, extra = time.time(), {}

    def dynamic_layers() -> list:
        path = args.out / f"qw_dynamic_g{gptq.tokens}.pt"
        if not path.exists():
            torch.save(quantize_fp8(weights, QuantConfig(scheme=Scheme.FP8), stats, None, None, cwin, cap, gptq).layers,
                       path)
        return torch.load(path, weights_only=False)

    if args.choose_kinds:
        qlayers, held = dynamic_layers(), cwin[-HELD_OUT:]
        base = baseline(args.out / "base_calib_heldout.f32", weights, held)
        mix = {k: "max" for k in POINT_KINDS}
        best = evaluate(with_static_mix(weights, qlayers, stats, mix), held, base)["kl"]
        for kind in POINT_KINDS:
            for m in CANDIDATES:
                trial = {**mix, kind: m}
                if m != mix[kind]:
                    kl = evaluate(with_static_mix(weights, qlayers, stats, trial), held, base)["kl"]
                    print(json.dumps({"calibration_kl": kl, **trial}), flush=True)
                    best, mix = (kl, trial) if kl < best else (best, mix)
        print("chosen on calibration text:", ",".join(f"{k}={v}" for k, v in mix.items()), f"(KL {best:.4f})")
        return
    if args.headroom is not None:
        if args.act != "static" or not args.calibrator or kind_mix(args.calibrator):
            raise SystemExit("--headroom scales the static ranges of one --calibrator (with --act static)")
        q = with_static_mix(weights, dynamic_layers(), stats, {k: args.calibrator for k in POINT_KINDS}, args.headroom)
    elif args.acts_only:
        model = smoothed(weights, stats, args.smooth) if args.smooth is not None else weights
        q = replace(model, layers=[replace(l, **{a: FakeLinear(lin.dense_weight().half().float(), "token") for a, lin in l.linears().items()})
                                   for l in model.layers])
    elif args.calibrator and kind_mix(args.calibrator):
        if args.smooth is not None:  # the stats' ranges describe the unsmoothed activations
            raise SystemExit("a per-kind --calibrator reads the stats' ranges as they are: no --smooth")
        q = quantize_mix(weights, stats, kind_mix(args.calibrator), cwin, cap, gptq)
    else:
        cfg = QuantConfig(scheme=Scheme.FP8, act=ActQuant(args.act), percentile=args.percentile, smooth=args.smooth,
                          calibrator=CalibMethod(args.calibrator) if args.calibrator else None)
        recapture = cached_recapture(args.out, args.smooth, cwin, stats, cap)
        q = quantize_fp8(weights, cfg, stats, recapture, None, cwin, cap, gptq)
        extra["config"] = cfg.describe()
    extra["quantize_s"] = round(time.time() - t0, 1)
    base = baseline(args.out / f"base_{args.eval_text}{len(ewin)}.f32", weights, ewin)
    res = evaluate(q, ewin, base)
    fp16_ppl = math.exp(-float(np.mean([base[i][np.arange(SEQ - 1), ewin[i][1:].numpy()].mean()
                                        for i in range(len(ewin))])))  # every window scores SEQ - 1 tokens
    name = args.tag or " ".join(f"{k}={v}" for k, v in vars(args).items()
                                if k not in ("stats", "out", "threads", "tag", "windows") and v not in (None, False))
    line = {"variant": name, **res, "vs_fp16_pct": 100 * (res["ppl"] / fp16_ppl - 1), "fp16_ppl": fp16_ppl,
            "gptq_tokens": gptq.tokens, **extra}
    print(json.dumps(line), flush=True)
    with open(args.out / "results.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
