"""The CUDA build layer and kernel launchers on a machine without a GPU: imports stay pycuda-free, errors
are one line, cache keys follow the sources, every .cu compiles, and the torch references agree with
model_zoo's math."""

from __future__ import annotations

import os
import pkgutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import kernels_cu
from kernels_cu import build
from kernels_cu.checks import check_tensor, row_launch, silu_row_launch
from kernels_cu.embedding import embedding_ref
from kernels_cu.quantize import quantize_ref
from kernels_cu.rmsnorm import rmsnorm, rmsnorm_ref
from kernels_cu.rope_kv import rope_kv_ref, rope_table
from kernels_cu.sampling import MAX_TOP_K, params_tensor, sampling_probs_ref
from kernels_cu.silu_mul import silu_mul_interleaved, silu_mul_ref
from kernels_cu.swiglu_layout import gate_up_order, swiglu_interleaved
from model_zoo.config import LlamaConfig
from model_zoo.errors import ConfigError, DeviceError
from model_zoo.reference import apply_rope, rms_norm, rope_cos_sin
from model_zoo.sampling import SamplingConfig

REPO = Path(__file__).resolve().parents[1]
CU_FILES = sorted(p.name for p in build.KERNEL_DIR.glob("*.cu"))

# The entry points each launcher asks for: they must exist in the compiled cubin.
ENTRY_POINTS = {
    "rmsnorm.cu": [f"rmsnorm_{v}_nv{n}" for v in ("plain", "dyn", "static", "add", "add_dyn", "add_static")
                   for n in (1, 2, 4, 8)],
    "quantize.cu": [f"quantize_{v}_nv{n}" for v in ("dyn", "static") for n in (1, 2, 4, 8)],
    "silu_mul.cu": [f"silu_mul_{v}_nv{n}" for v in ("plain", "dyn", "static") for n in (1, 2, 4)]
                   + ["silu_mul_interleaved"],
    "awq_gemv.cu": [f"awq_gemv_mt{m}_g{g}_{e}" for m in (1, 2, 4) for g in (1, 2, 4) for e in ("plain", "res", "silu")]
                   + [f"awq_gemv_mt1_g1_{e}_w{w}" for e in ("plain", "res", "silu") for w in (16, 8, 2, 1)],
    "awq_batch.cu": [f"awq_batch_mt{m}_g{g}_{e}" for m in (1, 2, 4) for g in (1, 2, 4)
                     for e in ("plain", "res", "silu")],
    "int8_wgmma.cu": ["int8_wgmma", "int8_wgmma_res"],
    "int8_gemm.cu": [f"int8_gemv_mt{m}{e}" for m in (1, 2) for e in ("", "_res", "_silu")]
                    + [f"int8_gemv_xq{r}{e}" for r in ("", "1") for e in ("", "_res")]
                    + ["int8_gemv_nq1", "int8_gemv_nq1_silu", "int8_dequant", "int8_dequant_res"],
    "awq_wgmma.cu": ["awq_wgmma_plain", "awq_wgmma_res", "awq_wgmma_silu"],
    "awq_wgmma_decode.cu": [f"awq_wgmma_decode_t{bt}_{e}" for bt in (32, 64) for e in ("plain", "res", "silu")],
    "embedding.cu": [f"embedding{v}_{t}" for v in ("", "_fold", "_fold8") for t in ("i32", "i64")],
    "rope_kv.cu": ["rope_kv_f16", "rope_kv_i8"],
    "sampling.cu": ["sample_f16", "sample_f32", "sample_f16_cl", "sample_f32_cl"],
    "fp16_gemv.cu": [f"fp16_gemv_mt{m}{e}" for m in (1, 2) for e in ("", "_res", "_silu")]
                    + ["w8a16_gemv_mt1", "w8a16_gemv_mt2"],
    "fp8_quantize.cu": [f"fp8_quantize_{v}_nv{n}" for v in ("dyn", "static") for n in (1, 2, 4, 8)]
                       + ["fp8_quantize_fold", "fp8_quantize_fold_h"],
    "fp8_gemm.cu": [f"fp8_gemv_{m}{e}" for m in ("mt1", "mt2", "mt4", "mt4a", "h1", "h2")
                    for e in ("", "_res", "_silu")]
                   + [f"fp8_gemv_xq{r}{e}" for r in ("", "1") for e in ("", "_res", "_silu")]
                   + [f"fp8_gemv_nq{r}{e}" for r in ("", "1") for e in ("", "_silu")]
                   + ["fp8_gemv_dq1", "fp8_gemv_dq1_res", "fp8_gemv_fq1", "fp8_gemv_fq1_silu"],
    "fp8_gemv_wide.cu": [f"fp8_gemv_w2x{w}{e}" for w in (4, 8) for e in ("", "_res", "_silu")],
    "attention_decode.cu": [f"attn_decode_d{d}{k}" for d in (64, 128) for k in ("", "_kv8", "_kvf8")]
                           + ["attn_decode_combine"],
    "attention_fused.cu": [f"attn_fused_d{d}{k}{c}" for d in (64, 128) for k in ("", "_kv8", "_kvf8")
                           for c in ("", "_cl")],
}


def test_importing_every_kernels_module_leaves_pycuda_unloaded():
    names = [f"kernels_cu.{m.name}" for m in pkgutil.iter_modules(kernels_cu.__path__)]
    code = ("import importlib, sys\n"
            f"for n in {names!r}: importlib.import_module(n)\n"
            "bad = [m for m in sys.modules if m == 'pycuda' or m.startswith('pycuda.')]\n"
            "assert not bad, bad\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_require_cuda_names_the_missing_piece_in_one_line():
    with pytest.raises(DeviceError) as e:
        build.require_cuda()
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("no CUDA GPU visible to PyTorch")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_launchers_check_arguments_before_touching_the_driver():
    x = torch.randn(4, 576).half()
    with pytest.raises(ValueError, match="on the GPU"):
        rmsnorm(x, torch.ones(576, dtype=torch.float16), 1e-5)
    with pytest.raises(ConfigError, match="multiple of 8"):
        rmsnorm(torch.randn(4, 100).half(), torch.ones(100, dtype=torch.float16), 1e-5)
    assert "pycuda" not in sys.modules


def test_check_tensor_catches_misaligned_slices():
    flat = torch.empty(1000, dtype=torch.float16)
    with pytest.raises(ValueError, match="16-byte aligned"):
        check_tensor(flat[1:577], "x", torch.float16)
    with pytest.raises(ValueError, match="float16"):
        check_tensor(flat.float(), "x", torch.float16)
    with pytest.raises(ValueError, match="contiguous"):
        check_tensor(flat[:800].view(40, 20).t(), "x", torch.float16)


@pytest.mark.parametrize("n_vec,want", [(72, (1, 96)), (256, (1, 256)), (512, (2, 256)), (1024, (4, 256)),
                                        (1376, (8, 192)), (3584, (8, 448)), (4096, (8, 512))])
def test_row_launch_shapes(n_vec, want):
    nv, threads = row_launch(n_vec)
    assert (nv, threads) == want and nv * threads >= n_vec and threads % 32 == 0


def test_row_launch_refuses_rows_beyond_the_limit():
    with pytest.raises(ConfigError):
        row_launch(4097)


@pytest.mark.parametrize("n_vec,want", [(192, (1, 192)), (512, (2, 256)), (1024, (4, 256)), (1376, (4, 352)),
                                        (1792, (4, 448)), (3584, (4, 896)), (4096, (4, 1024))])
def test_silu_row_launch_shapes(n_vec, want):
    """The SwiGLU rows stop at 4 vectors a thread (silu_mul.cuh's entries: NV 1, 2, 4) and take up to 1,024 threads."""
    nv, threads = silu_row_launch(n_vec)
    assert (nv, threads) == want and nv * threads >= n_vec and threads % 32 == 0
    with pytest.raises(ConfigError):
        silu_row_launch(4097)


def fake_kernels(tmp_path: Path) -> Path:
    (tmp_path / "k.cu").write_text('#include "h.cuh"\nextern "C" __global__ void k() {}\n')
    (tmp_path / "h.cuh").write_text("#pragma once\n")
    (tmp_path / "other.cuh").write_text("// not included\n")
    return tmp_path


def test_cache_key_follows_source_headers_options_arch_and_nvcc(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "KERNEL_DIR", fake_kernels(tmp_path))
    key = lambda **kw: build.cache_key("k.cu", kw.get("arch", "sm_90a"), kw.get("opts", ()), kw.get("nvcc", "V1"))
    base = key()
    assert key() == base
    (tmp_path / "other.cuh").write_text("// changed, still not included\n")
    assert key() == base
    (tmp_path / "h.cuh").write_text("#pragma once\n#define X 1\n")
    k_header = key()
    assert k_header != base
    (tmp_path / "k.cu").write_text('#include "h.cuh"\nextern "C" __global__ void k() { }\n')
    k_source = key()
    assert k_source != k_header
    assert len({k_source, key(arch="sm_80"), key(opts=("-DFOO",)), key(nvcc="V2")}) == 4


def test_device_arch_uses_the_arch_specific_target_on_hopper():
    assert build.device_arch((9, 0)) == "sm_90a"
    assert build.device_arch((8, 0)) == "sm_80"
    assert build._gencode("sm_90a") == "-gencode=arch=compute_90a,code=sm_90a"


@pytest.mark.skipif(build.find_nvcc() is None, reason="nvcc is not installed")
def test_every_kernel_compiles_for_hopper_with_its_entry_points(tmp_path, monkeypatch):
    monkeypatch.setenv("FLLAMA_CUDA_CACHE", str(tmp_path))
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        cubins = dict(zip(CU_FILES, pool.map(lambda f: build.compile_cubin(f, "sm_90a"), CU_FILES)))
    for name, path in cubins.items():
        data = path.read_bytes()
        assert data[:4] == b"\x7fELF", name
        for entry in ENTRY_POINTS.get(name, []):
            assert entry.encode() + b"\0" in data, f"{name} lacks the entry point {entry}"
    # cached: asking again returns the same file without running nvcc
    mtime = cubins["embedding.cu"].stat().st_mtime_ns
    assert build.compile_cubin("embedding.cu", "sm_90a").stat().st_mtime_ns == mtime


# What a decode step on an Ampere GPU compiles (the Hopper-only GEMMs, TMA and fp8 files are never asked for there).
AMPERE_FILES = ["attention_decode.cu", "attention_fused.cu", "awq_batch.cu", "awq_gemm.cu", "awq_gemv.cu",
                "embedding.cu", "fp16_gemv.cu", "int8_gemm.cu", "quantize.cu", "rmsnorm.cu", "rope_kv.cu",
                "sampling.cu", "silu_mul.cu"]


@pytest.mark.skipif(build.find_nvcc() is None, reason="nvcc is not installed")
def test_the_decode_kernels_compile_for_ampere(tmp_path, monkeypatch):
    """Clusters and PDL are Hopper's; below sm_90 their helpers compile to traps and no-ops (the launchers take the
    cluster entries only where the GPU has clusters), so the decode kernels build for sm_80."""
    monkeypatch.setenv("FLLAMA_CUDA_CACHE", str(tmp_path))
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        cubins = list(pool.map(lambda f: build.compile_cubin(f, "sm_80"), AMPERE_FILES))
    assert all(p.read_bytes()[:4] == b"\x7fELF" for p in cubins)


@pytest.mark.skipif(build.find_nvcc() is None, reason="nvcc is not installed")
def test_a_compile_error_is_a_device_error_with_nvccs_words(tmp_path, monkeypatch):
    kdir = tmp_path / "src"
    kdir.mkdir()
    (kdir / "bad.cu").write_text('extern "C" __global__ void bad() { undeclared_thing(); }\n')
    monkeypatch.setattr(build, "KERNEL_DIR", kdir)
    monkeypatch.setenv("FLLAMA_CUDA_CACHE", str(tmp_path / "cache"))
    with pytest.raises(DeviceError, match="undeclared_thing"):
        build.compile_cubin("bad.cu", "sm_90a")
    assert not list((tmp_path / "cache").glob("*"))  # no half-written cubin left behind


def test_prebuild_builds_what_is_not_cached_side_by_side(tmp_path, monkeypatch):
    """A first run on a Hopper machine builds every kernel file at once (nvcc stubbed: the files it would write,
    how many run together); what is cached is not built again; other archs build each file when first used."""
    import threading
    import time

    monkeypatch.setenv("FLLAMA_CUDA_CACHE", str(tmp_path))
    monkeypatch.setattr(build, "nvcc_version", lambda: "stub")
    running, peak, lock = [0], [0], threading.Lock()

    def fake_compile(cu_file, arch, options=()):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.05)
        path = build.cubin_path(cu_file, arch, options)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\x7fELF")
        with lock:
            running[0] -= 1
        return path

    monkeypatch.setattr(build, "compile_cubin", fake_compile)
    todo = build.unbuilt("sm_90a")
    assert todo == sorted(CU_FILES) and build.unbuilt("sm_80") == []
    done = []
    build.prebuild("sm_90a", todo, workers=4, done=done.append)
    assert sorted(done) == todo and peak[0] > 1 and build.unbuilt("sm_90a") == []
    (tmp_path / next(tmp_path.glob("sampling-*.cubin")).name).unlink()
    assert build.unbuilt("sm_90a") == ["sampling.cu"]

    def failing(cu_file, arch, options=()):
        raise DeviceError(f"nvcc failed on {cu_file} for {arch}: boom")

    monkeypatch.setattr(build, "compile_cubin", failing)
    with pytest.raises(DeviceError, match="boom"):
        build.prebuild("sm_90a", ["sampling.cu"], workers=2)


def test_build_kernels_prebuilds_only_on_a_gpu_with_nvcc(monkeypatch, capsys):
    from fllama_cli import runtime

    calls = []
    monkeypatch.setattr(build, "prebuild", lambda arch, files, done=None: calls.append((arch, files)))
    monkeypatch.setattr(build, "unbuilt", lambda arch: ["a.cu", "b.cu"])
    monkeypatch.setattr(build, "device_arch", lambda: "sm_90a")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    runtime.build_kernels()
    assert calls == []  # the engine says what is missing
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("kernels_cu.cuda_context.find_nvcc", lambda: "/usr/bin/nvcc")
    runtime.build_kernels()
    assert calls == [("sm_90a", ["a.cu", "b.cu"])]
    assert "building 2 CUDA kernel files for sm_90a" in capsys.readouterr().err  # a line even where no bar shows
    monkeypatch.setattr(build, "unbuilt", lambda arch: [])
    runtime.build_kernels()
    assert len(calls) == 1  # all cached: nothing to do


# ---------------------------------------------------------------- the torch references (CPU)

def test_quantize_ref_known_answer():
    x = torch.tensor([[1.0, -2.0, 0.5, 0.25], [0.0, 0.0, 0.0, 0.0]])
    q, s = quantize_ref(x)
    # 127 / 2 = 63.5: 1 -> 63.5 rounds half to even -> 64; 0.5 -> 31.75 -> 32; 0.25 -> 15.875 -> 16
    assert q.tolist() == [[64, -127, 32, 16], [0, 0, 0, 0]]
    assert s.tolist() == [pytest.approx(2.0 / 127), pytest.approx(1e-8 / 127)]
    q, s = quantize_ref(x, static_amax=1.0)  # static: values beyond the amax saturate
    assert q[0].tolist() == [127, -127, 64, 32] and s.tolist() == [pytest.approx(1 / 127)] * 2


def test_rmsnorm_ref_matches_model_zoo():
    x = torch.randn(5, 64).half()
    w = (torch.rand(64) + 0.5).half()
    assert torch.equal(rmsnorm_ref(x, w, 1e-5, compute_dtype=torch.float32), rms_norm(x, w, 1e-5))
    r = torch.randn(5, 64).half()
    assert torch.equal(rmsnorm_ref(x, w, 1e-5, residual=r, compute_dtype=torch.float32), rms_norm(r + x, w, 1e-5))


def test_rope_table_and_ref_match_model_zoo():
    cfg = LlamaConfig(64 * 6, 1, 6, 2, 128, 100, head_dim=64, rope_theta=500000.0)
    T, nh, nkv, d = 9, 6, 2, 64
    pos = torch.tensor([0, 1, 2, 5, 17, 100, 511, 1000, 4095])
    table = rope_table(d, cfg.rope_theta, 4096)
    cos, sin = rope_cos_sin(cfg, pos[None], torch.float16)  # [1, T, d]
    assert torch.equal(torch.cat((table[pos, :32], table[pos, :32]), -1).half(), cos[0])
    assert torch.equal(torch.cat((table[pos, 32:], table[pos, 32:]), -1).half(), sin[0])
    qkv = torch.randn(T, (nh + 2 * nkv) * d).half()
    q, k, v = rope_kv_ref(qkv, table, pos, nh, nkv)
    heads = qkv.view(T, nh + 2 * nkv, d).transpose(0, 1)[None]  # [1, heads, T, d]
    want = apply_rope(heads, cos, sin)[0].transpose(0, 1)  # [T, heads, d]
    assert torch.equal(q, want[:, :nh]) and torch.equal(k, want[:, nh:nh + nkv])
    assert torch.equal(v, qkv.view(T, -1, d)[:, nh + nkv:])


def test_silu_and_embedding_refs():
    gu = torch.randn(3, 16).half()
    assert torch.equal(silu_mul_ref(gu), torch.nn.functional.silu(gu[:, :8]) * gu[:, 8:])
    table = torch.randn(10, 8).half()
    out = embedding_ref(table, torch.tensor([1, -1, 10, 9]))
    assert torch.equal(out[0], table[1]) and torch.equal(out[3], table[9])
    assert int(out[1].abs().sum()) == 0 and int(out[2].abs().sum()) == 0


def test_swiglu_interleaved_is_silu_mul_ref_in_the_interleaved_order():
    gate_up = torch.randn(3, 64).half()  # [T, 2F] as [gate | up], F = 32: two panels
    y = gate_up[:, gate_up_order(64)]  # [T, 2F] interleaved: gate 0..7, up 0..7, gate 8..15, ...
    assert torch.equal(y[:, 8:16], gate_up[:, 32:40]) and torch.equal(y[:, 16:24], gate_up[:, 8:16])
    assert torch.equal(swiglu_interleaved(y), silu_mul_ref(gate_up))


def test_silu_mul_interleaved_checks_arguments_before_touching_the_driver():
    y = torch.randn(4, 32).half()
    with pytest.raises(ValueError, match="on the GPU"):
        silu_mul_interleaved(y)
    with pytest.raises(ValueError, match="multiple of 16"):
        silu_mul_interleaved(torch.randn(4, 24).half())
    with pytest.raises(ValueError, match=r"\[M, 2F\]"):
        silu_mul_interleaved(torch.randn(32).half())
    with pytest.raises(ValueError, match="y must be torch.float16"):
        silu_mul_interleaved(y.float())
    with pytest.raises(ValueError, match="contiguous"):
        silu_mul_interleaved(torch.randn(4, 64).half()[:, :32])


def test_sampling_params_and_reference_distribution():
    with pytest.raises(ConfigError, match="top-k"):
        params_tensor(SamplingConfig(top_k=MAX_TOP_K + 1), 1)
    p = params_tensor([SamplingConfig(temperature=0.0), SamplingConfig(temperature=1.0, top_k=2, top_p=1.0)], 2)
    assert p.tolist() == [[0.0, 40.0, pytest.approx(0.95), 1.0], [1.0, 2.0, 1.0, 1.0]]
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]] * 2)
    probs = sampling_probs_ref(logits, p, torch.zeros(2, 4, dtype=torch.uint8))
    assert probs[0].tolist() == [0.0, 1.0, 0.0, 0.0]
    e = torch.tensor([3.0, 2.0]).double().softmax(0)
    assert torch.allclose(probs[1], torch.tensor([0.0, e[0], e[1], 0.0], dtype=torch.float64))


def test_engine_variant_shares_weights_and_splits_config_from_tuning():
    """Engine.variant (what engine_ab compares): the same uploaded layers, caches and graphs of its own, each field
    given to EngineConfig or Tuning by its name; the engine it came from is unchanged."""
    from kernels_cu.engine import Engine, EngineConfig
    from kernels_cu.tuning import DEFAULT
    from model_zoo.config import LlamaConfig

    base = Engine.__new__(Engine)  # no GPU: only the fields variant() reads
    base.cfg, base.tuning, base.config = EngineConfig(), DEFAULT, LlamaConfig.from_name("llama2-7b")
    base.layers, base.max_len = [object()], 4096
    base._fresh_state()
    base._caches[(1, False)] = "cache"
    other = base.variant(fold_norms=False, attention_clusters=False, quant_fold_early_rows=4)
    assert other.layers is base.layers and other._caches == {} and base._caches == {(1, False): "cache"}
    assert other.cfg == EngineConfig(fold_norms=False) and base.cfg == EngineConfig()
    assert other.tuning.attention_clusters is False and other.tuning.quant_fold_early_rows == 4
    assert base.tuning is DEFAULT and DEFAULT.attention_clusters is True
    with pytest.raises(TypeError):
        base.variant(no_such_field=1)


def test_engine_ab_checks_its_switch():
    """`--switch`: an EngineConfig or Tuning field, a boolean for an A/B, a number for a sweep (--values); anything
    else is refused with one line, before any GPU work."""
    from kernels_cu.lab.engine_ab import check_switch, typed

    check_switch("fold_norms")
    check_switch("attention_clusters")
    check_switch("quant_fold_early_rows", numeric=True)
    check_switch("awq_wide_waves", numeric=True)
    for bad, numeric, msg in [("nope", False, "unknown EngineConfig or Tuning field 'nope'"),
                              ("awq_gemv_max_m", False, "is not a boolean"),
                              ("fold_int8", True, "is not a number"), ("fold_norms", True, "is not a number")]:
        with pytest.raises(SystemExit, match=msg):
            check_switch(bad, numeric=numeric)
    assert typed("quant_fold_early_rows", 4.0) == 4 and isinstance(typed("quant_fold_early_rows", 4.0), int)
    assert typed("awq_wide_waves", 1.25) == 1.25
    proc = subprocess.run([sys.executable, "-m", "kernels_cu.lab.engine_ab", "--switch", "no_such_field"], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "unknown EngineConfig or Tuning field 'no_such_field'" in proc.stderr


def test_engine_ab_values_and_table():
    """--values parsing and the gain column: against the first value of a sweep, on against off for an A/B."""
    from kernels_cu.lab.engine_ab import format_runs, parse_values

    assert parse_values("0,0.25,0.5") == [0.0, 0.25, 0.5]
    for bad in ("0", "a,b"):
        with pytest.raises(SystemExit):
            parse_values(bad)
    line = format_runs({0.0: [100.0, 100.0], 0.5: [101.0, 103.0]}, sweep=True)
    assert line == "0: 100.0 / 100.0 (+0.0%) | 0.5: 101.0 / 103.0 (+2.0%)"
    assert format_runs({True: [102.0], False: [100.0]}, sweep=False) == "on 102.0 | off 100.0 | +2.0%"
