"""What fp8 (e4m3) W8A8 with dynamic activations would take to cost <= +0.5% perplexity on SmolLM2-135M (issue 42),
judged as calibrate/lab/fp8_variants.py judges a variant (Sherlock windows of 512, KL against the fp16 export).

    python -m calibrate.lab.fp8_dynamic_options --stats stats.safetensors --out lab8 attr --part acts --by kind
    python -m calibrate.lab.fp8_dynamic_options --stats stats.safetensors --out lab8 attr --part acts --by layer
    python -m calibrate.lab.fp8_dynamic_options --stats stats.safetensors --out lab8 attr --part weights --by kind
    python -m calibrate.lab.fp8_dynamic_options --stats stats.safetensors --out lab8 mix --acts g64 --windows 32
    python -m calibrate.lab.fp8_dynamic_options --stats stats.safetensors --out lab8 mix --ignore 11.down,28.down
    python -m calibrate.lab.fp8_dynamic_options --stats stats.safetensors --out lab8 mix --ignore 11.down --regptq
    python -m calibrate.lab.fp8_dynamic_options --stats stats.safetensors --out lab8 int8 --calibrator mse --smooth 0.3

Weights are the GPTQ + search e4m3 weights of the dynamic run (`--gptq-tokens`, default 32,768 calibration tokens),
computed once and cached in --out as fp8_variants caches them (qw_dynamic_g<tokens>.pt); `--wgroup G`: one amax / 448
scale per 1 x G group of each row instead, GPTQ-rounded. Activations: `token` (model_zoo/quant/fp8.py's per-token
rule, the shipped numerics), `gG` (one amax / 448 scale per G consecutive inputs of a token, DeepSeek-V3's 1 x 128
groups; where G does not divide a row the last group is shorter, which vLLM's group kernel does not allow), or
`none`. `attr`: one part quantized at one place at a time (a linear kind: qkv, o, gate_up, down; or a layer), the
rest fp16. `mix`: every linear W8A8 except `--ignore` (kept fp16, weights and activations, as an llm-compressor
`ignore` list keeps them): items `L.kind`, `kind` (every layer) or `L` (every kind of layer L). Without `--regptq`
the ignored linears are swapped back into the cached weights; with it GPTQ runs again with them fp16 (what
llm-compressor's sequential GPTQ does). `int8`: calibrate.quantize's quantize_int8, as `fllama quantize --scheme
int8` runs it, scored here instead of by `fllama eval` (the same numbers to the last digit). A benchmark, not a
test; results go to --out/options.jsonl.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from calibrate.capture import CaptureConfig
from calibrate.gptq_round import GptqConfig, LayerHessians, gptq_round
from calibrate.lab.fp8_variants import (SEQ, EVAL_TOKENS, FakeLinear, baseline, cached_recapture, evaluate,
                                        lab_setup)
from calibrate.methods import CalibMethod
from calibrate.quantize import FP8_GPTQ, POINT_OF, QuantConfig, _fp8_weight, quantize_fp8, quantize_int8
from calibrate.stats import POINT_KINDS
from model_zoo.quant.formats import Scheme
from model_zoo.quant.fp8 import FP8_MAX, to_e4m3
from model_zoo.quant.int8 import AMAX_MIN, ActQuant
from model_zoo.quant.linear import Fp8Linear
from model_zoo.text_sources import load_text, token_windows
from model_zoo.weights import ModelWeights

Key = tuple[int, str]  # (layer, capture-point kind)


def parse_keys(spec: str | None, n_layers: int) -> set[Key]:
    """'11.down,28,o' -> {(11, 'down'), (28, every kind), (every layer, 'o')}."""
    keys: set[Key] = set()
    for item in filter(None, (spec or "").split(",")):
        layer, _, kind = item.partition(".") if "." in item else ((item, "", "") if item.isdigit() else ("", "", item))
        if kind and kind not in POINT_KINDS:
            raise SystemExit(f"unknown kind {kind!r} in {item!r}: one of {POINT_KINDS}")
        layers = [int(layer)] if layer else range(n_layers)
        keys |= {(i, k) for i in layers for k in ([kind] if kind else POINT_KINDS)}
    return keys


def build(weights: ModelWeights, qlayers: list, where: set[Key], wq: bool, acts: str) -> ModelWeights:
    """Linears at `where` get e4m3 weights (`wq`) and/or `acts` activations; the others stay as the fp16 export."""
    layers = []
    for i, (layer, ql) in enumerate(zip(weights.layers, qlayers)):
        lin = {}
        for attr, dense in layer.linears().items():
            if (i, POINT_OF[attr]) not in where:
                continue
            q = ql[attr] if isinstance(ql, dict) else getattr(ql, attr)
            if wq and acts == "token" and isinstance(q, Fp8Linear):  # the shipped Fp8Linear, exactly
                lin[attr] = q
                continue
            w = q.dense_weight().float() if wq else dense.dense_weight().float().half().float()  # [N, K]
            lin[attr] = FakeLinear(w, acts)
        layers.append(replace(layer, **lin))
    return replace(weights, layers=layers, meta={**weights.meta, "scheme": "fp8"})


def group_gptq(w: torch.Tensor, h: torch.Tensor, g: int, gptq: GptqConfig) -> FakeLinear:
    """e4m3 weights with one amax / 448 scale per 1 x g group of each row (no search), rounded by GPTQ."""
    n, k = w.shape
    scale = (w.abs().view(n, k // g, g).amax(-1).clamp(min=AMAX_MIN) / FP8_MAX).repeat_interleave(g, 1)  # [N, K]
    # in W's units: the columns' scales differ, so the errors GPTQ pushes across columns must be in real values
    return FakeLinear(gptq_round(w, h, lambda col, j: to_e4m3(col / scale[:, j]).float() * scale[:, j], gptq), "none")


def regptq(weights: ModelWeights, ignore: set[Key], windows, cap: CaptureConfig, gptq: GptqConfig,
           wgroup: int | None = None) -> list:
    """GPTQ + search e4m3 weights as quantize_fp8 makes them (dynamic), the `ignore`d linears left float so the
    later layers' Hessians see them so (`wgroup`: group_gptq's scales instead); returns per layer {attr: Fp8Linear,
    FakeLinear or the dense weight}."""
    cfg = QuantConfig(scheme=Scheme.FP8)
    inputs, out = LayerHessians(weights, windows, cap, gptq), []
    for i, layer in enumerate(weights.layers):
        h = inputs.hessians(layer)
        lin = {}
        for attr, dense in layer.linears().items():
            if (i, POINT_OF[attr]) in ignore:
                lin[attr] = dense
                continue
            w = dense.dense_weight().float()  # [N, K]
            if wgroup:
                lin[attr] = group_gptq(w, h[POINT_OF[attr]], wgroup, inputs.cfg)
                continue
            w8, w_scale = _fp8_weight(w, h[POINT_OF[attr]], cfg, inputs.cfg)
            lin[attr] = Fp8Linear(w8, w_scale, ActQuant.DYNAMIC, None, dtype=torch.float32)
        out.append(lin)
        inputs.advance(replace(layer, **lin))
        print(f"  regptq layer {i}", flush=True)
    return out


def linear_params(weights: ModelWeights, keys: set[Key]) -> int:
    return sum(lin.dense_weight().numel() for i, layer in enumerate(weights.layers)
               for attr, lin in layer.linears().items() if (i, POINT_OF[attr]) in keys)


class Judge:
    """Scores a model on the first `windows` Sherlock windows against the fp16 export's cached log-probs."""

    def __init__(self, weights: ModelWeights, tokenizer, out: Path, windows: int):
        ewin = token_windows(tokenizer.encode(load_text("gutenberg:sherlock")), SEQ, EVAL_TOKENS)  # [32, 512]
        self.base = baseline(out / f"base_sherlock{len(ewin)}.f32", weights, ewin)  # all 32, sliced below
        self.ewin = ewin[:windows]
        self.fp16_ppl = math.exp(-float(np.mean([self.base[i][np.arange(SEQ - 1), self.ewin[i][1:].numpy()].mean()
                                                 for i in range(len(self.ewin))])))

    def __call__(self, model: ModelWeights) -> dict:
        res = evaluate(model, self.ewin, self.base)
        return {**res, "vs_fp16_pct": 100 * (res["ppl"] / self.fp16_ppl - 1), "fp16_ppl": self.fp16_ppl}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stats", required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--gptq-tokens", type=int, default=FP8_GPTQ.tokens)
    ap.add_argument("--threads", type=int, default=2)
    sub = ap.add_subparsers(dest="cmd", required=True)
    at = sub.add_parser("attr", help="one part quantized at one place at a time")
    at.add_argument("--part", choices=("acts", "weights", "both"), required=True)
    at.add_argument("--by", choices=("kind", "layer"), required=True)
    at.add_argument("--acts", default="token")
    at.add_argument("--windows", type=int, default=8)
    at.add_argument("--only", default=None, help="these layers only (comma list); with --by kind each kind within them")
    i8 = sub.add_parser("int8", help="int8 W8A8 as `fllama quantize --scheme int8` builds it, scored in-process")
    i8.add_argument("--act", choices=("dynamic", "static"), default="static")
    i8.add_argument("--calibrator", default=None)
    i8.add_argument("--smooth", type=float, default=None)
    i8.add_argument("--windows", type=int, default=EVAL_TOKENS // SEQ)
    mx = sub.add_parser("mix", help="every linear W8A8 except --ignore")
    mx.add_argument("--acts", default="token", help="token, gG (e.g. g64, g128) or none")
    mx.add_argument("--weights", choices=("gptq", "fp16"), default="gptq")
    mx.add_argument("--ignore", default=None)
    mx.add_argument("--regptq", action="store_true")
    mx.add_argument("--wgroup", type=int, default=None, help="weights: amax scales per 1 x G group, GPTQ (regptq)")
    mx.add_argument("--windows", type=int, default=EVAL_TOKENS // SEQ)
    mx.add_argument("--tag", default=None)
    args = ap.parse_args()
    loaded, weights, stats, cwin = lab_setup(args)
    cap, gptq = CaptureConfig(batch=8), GptqConfig(tokens=args.gptq_tokens)
    n = len(weights.layers)

    def cached_weights() -> list:
        path = args.out / f"qw_dynamic_g{gptq.tokens}.pt"
        if not path.exists():
            torch.save(quantize_fp8(weights, QuantConfig(scheme=Scheme.FP8), stats, None, None, cwin, cap,
                                    gptq).layers, path)
        return torch.load(path, weights_only=False)

    judge = Judge(weights, loaded.tokenizer, args.out, args.windows)
    every = parse_keys(",".join(POINT_KINDS), n)

    def record(line: dict) -> None:
        line = {**line, "gptq_tokens": gptq.tokens}
        print(json.dumps(line), flush=True)
        with open(args.out / "options.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")

    if args.cmd == "int8":  # the smoothed model's re-capture cached per alpha, as fp8_variants caches it
        cfg = QuantConfig(scheme=Scheme.INT8, act=ActQuant(args.act), smooth=args.smooth,
                          calibrator=CalibMethod(args.calibrator) if args.calibrator else None)
        t0 = time.time()
        res = judge(quantize_int8(weights, cfg, stats, cached_recapture(args.out, args.smooth, cwin, stats, cap)))
        record({"exp": "int8", "config": cfg.describe(), **res, "s": round(time.time() - t0, 1)})
        return
    if args.cmd == "attr":
        wq, acts = args.part in ("weights", "both"), args.acts if args.part in ("acts", "both") else "none"
        qlayers = cached_weights() if wq else weights.layers
        places = (POINT_KINDS if args.by == "kind" else
                  [int(x) for x in args.only.split(",")] if args.only else range(n))  # --by kind --only L,..: within
        within = parse_keys(args.only, n) if args.only and args.by == "kind" else None
        for place in places:
            where = parse_keys(str(place), n) & within if within else parse_keys(str(place), n)
            t0 = time.time()
            res = judge(build(weights, qlayers, where, wq, acts))
            record({"exp": f"attr {args.part} by {args.by}", "at": place, "only": args.only, "acts": acts,
                    "weights": wq, **res, "eval_s": round(time.time() - t0, 1)})
        return
    ignore = parse_keys(args.ignore, n)
    t0 = time.time()
    if args.regptq or args.wgroup:  # cached per ignore list and weight groups
        path = args.out / f"qw_regptq_{args.ignore or 'none'}_w{args.wgroup}_g{gptq.tokens}.pt"
        if not path.exists():
            torch.save(regptq(weights, ignore, cwin, cap, gptq, args.wgroup), path)
        qlayers = torch.load(path, weights_only=False)
    else:
        qlayers = cached_weights() if args.weights == "gptq" else weights.layers
    model = build(weights, qlayers, every - ignore, args.weights == "gptq", args.acts)
    share = linear_params(weights, ignore) / linear_params(weights, every)
    res = judge(model)
    record({"exp": args.tag or "mix", "acts": args.acts, "weights": args.weights, "wgroup": args.wgroup,
            "ignore": args.ignore,
            "regptq": args.regptq, "fp16_linear_share": share,
            "extra_mib": linear_params(weights, ignore) / 2**20, **res, "s": round(time.time() - t0, 1)})


if __name__ == "__main__":
    main()
