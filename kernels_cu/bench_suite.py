"""`fllama bench` as one library call: every scheme and batch size on one GPU, the torch.compile baseline beside it.

run_bench(BenchRequest) -> (rows, meta): a row per (scheme, batch) with bench.bench_engine's figures and the
speedups over the baseline of the same batch; meta says what ran where (GPU, copy bandwidth, options).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Callable

import torch

from kernels_cu.bench import SCHEMES, BenchConfig, bench_baseline, bench_engine, copy_bandwidth, random_weights
from kernels_cu.bench_loop import bench_generate
from kernels_cu.build import device_info, pdl_supported, require_cuda
from kernels_cu.engine import Engine, EngineConfig
from kernels_cu.kv_codes import KvKind
from model_zoo.config import LlamaConfig
from model_zoo.errors import ConfigError, DeviceError
from model_zoo.load import load_model, load_tokenizer
from model_zoo.quant.checkpoint import build_weights
from model_zoo.weights import ModelWeights


@dataclass(frozen=True)
class BenchRequest:
    source: str | None  # a checkpoint, or a preset name with `random`
    schemes: tuple[str, ...] = SCHEMES
    cfg: BenchConfig = BenchConfig()
    baseline: bool = True  # the fp16 model under torch.compile
    random: bool = False
    seed: int = 0
    pdl: bool | None = None  # programmatic dependent launch: None leaves FLLAMA_PDL as it is
    fold_norms: bool = True
    fuse_rope: bool = True
    kv: KvKind = KvKind.FP16  # the engines' KV cache (the baseline keeps fp16)
    lm_head_int8: bool = False  # int8 and awq engines only: fp16 is the unquantized model
    loop: bool = True  # batch 1 also through the generation loop (what `fllama generate` gets)

    def __post_init__(self) -> None:
        bad = [s for s in self.schemes if s not in SCHEMES]
        if bad or not self.schemes:
            raise ConfigError(f"unknown scheme {bad[0] if bad else ''!r}; schemes: {', '.join(SCHEMES)}")

    def engine_config(self, scheme: str) -> EngineConfig:
        return EngineConfig(max_len=self.cfg.prompt_len + self.cfg.gen_len + 1, fold_norms=self.fold_norms,
                            fuse_rope=self.fuse_rope, kv=self.kv,
                            lm_head_int8=self.lm_head_int8 and scheme != "fp16")


def _weights(req: BenchRequest, scheme: str, dev: torch.device) -> tuple[ModelWeights, LlamaConfig]:
    if req.random:
        config = LlamaConfig.from_name(req.source or "llama2-7b")
        return random_weights(config, scheme, dev, req.seed, req.cfg.group_size), config
    loaded = load_model(req.source, dtype=torch.float16)  # the engine's fp16, without an fp32 host copy
    weights = build_weights(loaded, torch.float16, "cpu")
    have = weights.meta.get("scheme", "fp16")
    if scheme != have:
        raise ConfigError(f"{loaded.source} is a {have} checkpoint; give --scheme {have} or use --random for other "
                          f"schemes")
    return weights, loaded.config


def run_bench(req: BenchRequest, progress: Callable[[str], None] = lambda _: None) -> tuple[list[dict], dict]:
    """Time every (scheme, batch) of `req` on the current GPU, then the baseline; progress(msg) as it goes."""
    if not torch.cuda.is_available():
        raise DeviceError("fllama bench needs an NVIDIA GPU (none is visible to PyTorch)")
    require_cuda()
    if req.pdl is not None:
        os.environ["FLLAMA_PDL"] = "1" if req.pdl else "0"  # read by the build layer at each launch
    dev = torch.device("cuda", torch.cuda.current_device())
    info = device_info()
    bw = copy_bandwidth(dev)
    progress(f"{info['name']} · driver {info.get('driver_version')} · copy bandwidth {bw / 1e12:.2f} TB/s")
    rows, base_rows, config = [], {}, None
    tokenizer = None if req.random else load_tokenizer(req.source)
    for s in req.schemes:
        weights, config = _weights(req, s, dev)
        engine = Engine(weights, req.engine_config(s))
        for b in req.cfg.batches:
            progress(f"engine {s} batch {b} ...")
            rows.append({"scheme": s, **bench_engine(engine, b, req.cfg, bw)})
            if b == 1 and req.loop:
                progress(f"generate {s} batch 1 ...")
                rows[-1].update(bench_generate(engine, tokenizer, req.cfg))
                rows[-1]["generate_vs_engine"] = rows[-1]["generate_tok_s"] / rows[-1]["decode_tok_s"]
        if s == "fp16" and req.baseline:  # the fp16 weights are at hand: no second load
            base_rows = _baseline(weights, req.cfg, progress)
        del engine, weights
        torch.cuda.empty_cache()
    if req.baseline and not base_rows:
        fp16 = (random_weights(config, "fp16", dev, req.seed) if req.random
                else build_weights(load_model(req.source, dtype=torch.float16), torch.float16, "cuda"))
        base_rows = _baseline(fp16, req.cfg, progress)
    for r in rows:
        _add_speedups(r, base_rows.get(r["batch"]))
    meta = {"gpu": info["name"], "driver": info.get("driver_version"), "date": datetime.date.today().isoformat(),
            "model": req.source or "llama2-7b", "random": req.random, "copy_bandwidth_tb_s": bw / 1e12,
            "prompt_len": req.cfg.prompt_len, "gen_len": req.cfg.gen_len, "repeat": req.cfg.repeat,
            "baseline": base_rows, "programmatic_launch": pdl_supported(), "fold_norms": req.fold_norms,
            "fuse_rope": req.fuse_rope, "kv_cache": KvKind(req.kv).value, "lm_head_int8": req.lm_head_int8,
            "loop": req.loop, "sampling": _sampling_note(req.cfg.sampling)}
    return rows, meta


def _sampling_note(s) -> str:
    """'greedy', or the sampled decode's settings (the header's words)."""
    if s.temperature == 0:
        return "greedy"
    return f"temperature {s.temperature:g}, top-k {s.top_k}, top-p {s.top_p:g}"


def _baseline(weights: ModelWeights, cfg: BenchConfig, progress: Callable[[str], None]) -> dict[int, dict]:
    out = {}
    for b in cfg.batches:
        progress(f"baseline torch.compile batch {b} (compiles first) ...")
        out[b] = bench_baseline(weights, b, cfg)
    return out


def _add_speedups(row: dict, base: dict | None) -> None:
    if base:
        row["baseline_decode_tok_s"] = base["decode_tok_s"]
        row["baseline_prefill_tok_s"] = base["prefill_tok_s"]
        row["speedup_decode"] = row["decode_tok_s"] / base["decode_tok_s"]
        row["speedup_prefill"] = row["prefill_tok_s"] / base["prefill_tok_s"]
