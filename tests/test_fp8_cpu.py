"""The FP8 kernels' CPU side: every fp8 .cu compiles for sm_90a with the entry points its launcher asks for, the
launchers check their arguments before touching the driver, the torch references are model_zoo/quant/fp8.py's
contract, and the engine's Fp8Op lays out gate|up for its SwiGLU epilogue. The kernels themselves run in
tests/gpu/test_fp8_kernels.py and tests/gpu/test_fp8_engine.py."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest
import torch

from kernels_cu import build, tuning
from kernels_cu.bench import random_weights
from kernels_cu.engine.config import EngineConfig
from kernels_cu.engine.fp8_op import Fp8Op
from kernels_cu.engine.plan import StepPlan, plan_step
from kernels_cu.fp8_gemm import (FoldQuant, NormIn, fp8_fold_quantize_ref, fp8_gemm, fp8_gemm_ref, fp8_linear,
                                 fp8_linear_ref, fp8_swiglu_ref, norm_launch)
from kernels_cu.fp8_quantize import (FP8, fp8_quantize, fp8_quantize_ref, fp8_rmsnorm, fp8_rmsnorm_ref, fp8_silu_mul,
                                     fp8_silu_mul_ref)
from kernels_cu.norm_fold import FoldOut
from kernels_cu.rmsnorm import rmsnorm_ref
from kernels_cu.silu_mul import silu_mul_ref
from kernels_cu.tuning import DEFAULT
from model_zoo.config import LlamaConfig
from model_zoo.errors import ConfigError
from model_zoo.quant import fp8 as contract
from model_zoo.quant.linear import Fp8Linear

ENTRY_POINTS = {
    "fp8_quantize.cu": [f"fp8_quantize_{m}_nv{n}" for m in ("dyn", "static") for n in (1, 2, 4, 8)]
                       + [f"fp8_rmsnorm_{m}_nv{n}" for m in ("dyn", "static", "add_dyn", "add_static")
                          for n in (1, 2, 4, 8)]
                       + [f"fp8_silu_mul_{m}_nv{n}" for m in ("dyn", "static") for n in (1, 2, 4)],
    "fp8_gemm.cu": [f"fp8_gemv_{m}{e}" for m in ("mt1", "mt2", "xq") for e in ("", "_res", "_silu")]
                   + ["fp8_gemv_nq", "fp8_gemv_nq_silu"],
    "fp8_wgmma.cu": [f"fp8_wgmma_{e}" for e in ("plain", "res", "silu")],
}


@pytest.mark.skipif(build.find_nvcc() is None, reason="nvcc is not installed")
@pytest.mark.parametrize("cu", sorted(ENTRY_POINTS))
def test_fp8_kernels_compile_for_hopper_with_their_entry_points(cu, tmp_path, monkeypatch):
    monkeypatch.setenv("FLLAMA_CUDA_CACHE", str(tmp_path))
    data = build.compile_cubin(cu, "sm_90a").read_bytes()
    for entry in ENTRY_POINTS[cu]:
        assert entry.encode() + b"\0" in data, f"{cu} lacks the entry point {entry}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_launchers_check_arguments_before_touching_the_driver():
    x8, a_scale = fp8_quantize_ref(torch.randn(4, 64).half())
    w8, w_scale = contract.quantize_weight_fp8(torch.randn(32, 64))
    with pytest.raises(ValueError, match="on the GPU"):
        fp8_gemm(x8, a_scale, w8, w_scale)
    with pytest.raises(ConfigError, match="multiple of 16"):
        fp8_gemm(x8[:, :40].contiguous(), a_scale, w8[:, :40].contiguous(), w_scale)
    with pytest.raises(ConfigError, match="multiple of 8"):
        fp8_quantize(torch.randn(4, 36).half())
    with pytest.raises(ValueError, match="on the GPU"):
        fp8_quantize(torch.randn(4, 64).half())
    with pytest.raises(ValueError, match="on the GPU"):  # the self-quantizing GEMV's launcher
        fp8_linear(torch.randn(1, 64).half(), w8, w_scale, xq=True)
    with pytest.raises(ValueError, match="on the GPU"):  # the fused norm and SwiGLU quantizations
        fp8_rmsnorm(torch.randn(4, 64).half(), torch.ones(64).half(), 1e-5)
    with pytest.raises(ValueError, match="multiple of 16"):
        fp8_silu_mul(torch.randn(4, 40).half())
    with pytest.raises(ValueError, match="no residual"):
        fp8_linear(torch.randn(1, 64).half(), w8, w_scale, residual=torch.zeros(1, 32).half(), swiglu=True)
    assert "pycuda" not in sys.modules


@pytest.mark.parametrize("static", [False, True])
def test_quantize_ref_is_the_contract(static):
    x = torch.randn(9, 256).half() * 5
    x[0, 0], x[1] = 3e4, 0.0  # a saturating value; an all-zero row
    got8, got_s = fp8_quantize_ref(x, 0.01 if static else None)
    want8, want_s = contract.quantize_act_fp8(x, 0.01) if static else contract.quantize_act_fp8_per_token(x)
    assert torch.equal(got8.view(torch.uint8), want8.view(torch.uint8)) and torch.equal(got_s, want_s.float())
    assert got8.dtype == FP8 and float(got8.float().abs().max()) == 448.0


def test_gemm_refs_are_the_contract():
    x8, a_scale = fp8_quantize_ref(torch.randn(7, 512).half())
    w8, w_scale = contract.quantize_weight_fp8(torch.randn(96, 512) * 0.05)
    got = fp8_gemm_ref(x8, a_scale, w8, w_scale).float()
    want = contract.fp8_gemm_ref(x8, w8, a_scale, w_scale, torch.float16).float()
    assert float((got - want).abs().max()) <= 2e-3 * float(want.abs().max())
    r = torch.randn(7, 96).half()
    assert torch.equal(fp8_gemm_ref(x8, a_scale, w8, w_scale, r), fp8_gemm_ref(x8, a_scale, w8, w_scale) + r)
    # the byte view of the codes is the same operand
    assert torch.equal(fp8_gemm_ref(x8.view(torch.uint8), a_scale, w8.view(torch.uint8), w_scale),
                       fp8_gemm_ref(x8, a_scale, w8, w_scale))


def test_fp8_op_interleaves_gate_up_for_its_swiglu_epilogue():
    F, K = 48, 128
    gate, up = Fp8Linear.from_dense(torch.randn(F, K) * 0.1), Fp8Linear.from_dense(torch.randn(F, K) * 0.1)
    w8 = torch.cat([gate.weight8.view(torch.uint8), up.weight8.view(torch.uint8)])  # [2F, K]
    op = Fp8Op(w8, torch.cat([gate.w_scale, up.w_scale]), None, swiglu=True)
    assert op.swiglu and op.w8.dtype == FP8 and op.nbytes() == 2 * F * K + 2 * F * 4
    x = torch.randn(5, K).half()
    got = fp8_linear_ref(x, op.w8, op.w_scale, swiglu=True)
    x8, a_scale = fp8_quantize_ref(x)
    gu = torch.cat([fp8_gemm_ref(x8, a_scale, l.weight8, l.w_scale) for l in (gate, up)], 1)  # [5, 2F]
    assert torch.equal(got, silu_mul_ref(gu))
    assert torch.equal(fp8_swiglu_ref(x8, a_scale, op.w8, op.w_scale), got)
    assert not Fp8Op(w8[:40], torch.ones(40), None, swiglu=True).swiglu  # 40 rows: no whole 16-row panels


def test_fp8_op_takes_the_norm_at_one_row():
    """The layer hands a one-row fp8 op its RMSNorm's input (layer.norm_in), which its GEMV normalizes itself."""
    op = Fp8Op(torch.zeros(32, 64, dtype=torch.uint8), torch.ones(32), None)
    h, w = torch.randn(1, 64).half(), torch.ones(64).half()
    x = op.norm_input(h, w, 1e-5)
    assert isinstance(x, NormIn) and x.h is h and x.w is w and x.eps == 1e-5
    with tuning.override(fp8_fused_quant=False):
        assert op.norm_input(torch.randn(2, 64).half(), w, 1e-5) is None  # tuning.fp8_xq_max_rows: the norm kernel
    with pytest.raises(ValueError, match="on the GPU"):  # beyond: fp8_rmsnorm's codes (the GPU test runs them)
        op.norm_input(torch.randn(2, 64).half(), w, 1e-5)
    assert norm_launch(4096) == (2, 256) and norm_launch(576) == (1, 96) and norm_launch(32768) is None


def test_an_fp8_step_defers_on_the_gemvs():
    """The plan of an fp8 decode step: on the GEMVs' rows (below tuning.fp8_library_min_m) int8's deferred chain (the
    norms folded in int8's format; dynamic activations: o_proj and down_proj quantized from the maxima attention and
    the gate|up GEMV wrote, at one row also its row max); beyond, the norm kernels and cuBLASLt's products."""
    def layer(static):
        op = Fp8Op(torch.zeros(32, 64, dtype=torch.uint8), torch.ones(32), torch.ones(1) if static else None)
        return type("L", (), {"qkv": op, "o": op, "gate_up": op, "down": op})()

    def plan(layers, m, cfg=EngineConfig(), t=DEFAULT):
        return plan_step(layers, "fp8", 512, cfg, t, m)

    assert plan([layer(False)], 1) == StepPlan(int8_fold=True, defer_o=True, defer_down=True, row_amax=True)
    for m in (2, 8, 16, 32):
        assert plan([layer(False)], m) == StepPlan(int8_fold=True, defer_o=True, defer_down=True)
        assert plan([layer(True)], m) == StepPlan(int8_fold=True)
    assert plan([layer(False)], 64) == StepPlan()  # cuBLASLt's GEMM (tuning.fp8_library_min_m)
    assert plan([layer(False)], 64, t=replace(DEFAULT, fp8_library_min_m=65)) != StepPlan()
    assert plan([layer(False)], 128) == StepPlan()  # the GEMM (tuning.fp8_gemv_max_m)
    assert plan([layer(False), layer(True)], 1) == StepPlan()  # one activation mode for the chain
    assert plan([layer(False)], 1, cfg=EngineConfig(fold_norms=False)) == StepPlan()
    assert plan([layer(False)], 1, t=replace(DEFAULT, fp8_defer_max_rows=0)) == StepPlan()
    assert plan([layer(False)], 16, t=replace(DEFAULT, fp8_defer_max_rows=8)) == StepPlan()


def test_fp8_fold_input_and_its_reference():
    """A deferred norm reaches an fp8 op as a FoldQuant; fp8_fold_quantize_ref: dynamic, xg's own codes by its max
    with rstd in a_scale; static, the codes of xg * rstd / scale."""
    op = Fp8Op(torch.zeros(32, 64, dtype=torch.uint8), torch.ones(32), None)
    fold = FoldOut.new(torch.ones(64).half(), 1, int8=True)
    fq = op.fold_input(fold, 1e-5, zero=torch.ones(1))
    assert isinstance(fq, FoldQuant) and fq.xg is fold.xg and fq.mx is fold.mx and fq.sq is fold.part
    h = torch.randn(1, 64).half()
    xg = h * torch.full((64,), 0.5).half()  # [1, 64]
    mx = xg.float().abs().reshape(1, 8, 8).amax(-1)  # [1, 8]
    sq = h.float().pow(2).reshape(1, 8, 8).sum(-1)  # [1, 8]
    rstd = float(torch.rsqrt(sq.double().sum() / 64 + 1e-5))
    x8, a_scale = fp8_fold_quantize_ref(FoldQuant(xg, mx, sq, 1e-5))
    assert torch.equal(x8, fp8_quantize_ref(xg)[0])
    assert a_scale.item() == pytest.approx(fp8_quantize_ref(xg)[1].item() * rstd, rel=1e-6)
    x8, a_scale = fp8_fold_quantize_ref(FoldQuant(xg, mx, sq, 1e-5), torch.tensor([0.01]))
    assert a_scale.item() == pytest.approx(0.01)
    assert torch.equal(x8, (xg.float() * float(torch.tensor(100.0).double() * rstd)).clamp(-448, 448).to(FP8))


def test_bench_random_weights_quantize_to_fp8():
    config = LlamaConfig(128, 1, 4, 2, 256, 64, max_positions=64, name="tiny")
    w = random_weights(config, "fp8", torch.device("cpu"))
    lin = w.layers[0].w_gate
    assert w.meta["scheme"] == "fp8" and isinstance(lin, Fp8Linear) and lin.weight8.shape == (256, 128)
    assert lin.a_scale is None


def test_fused_quantization_references_are_the_kernels_they_replace():
    """fp8_rmsnorm_ref / fp8_silu_mul_ref: the fp16 kernel's reference (rmsnorm_ref after the fp16 residual add;
    swiglu_interleaved) quantized by the contract's per-token (or static) rule."""
    g = torch.Generator().manual_seed(0)
    h, r = (torch.randn(5, 64, generator=g) * 3).half(), torch.randn(5, 64, generator=g).half()
    w = (1 + 0.1 * torch.randn(64, generator=g)).half()
    for static in (None, 0.01):
        x8, s = fp8_rmsnorm_ref(h, w, 1e-5, static, residual=r)
        y = rmsnorm_ref(r + h, w, 1e-5)
        want = (contract.quantize_act_fp8(y.float(), static) if static else
                contract.quantize_act_fp8_per_token(y.float()))
        assert torch.equal(x8.view(torch.uint8), want[0].view(torch.uint8))
        assert torch.equal(s.reshape(-1), want[1].reshape(-1).expand(5).float())
    gu = (torch.randn(3, 64, generator=g) * 2).half()  # 2F = 64: four panels of 8 gate + 8 up
    x8, s = fp8_silu_mul_ref(gu)
    v = silu_mul_ref(gu.view(3, 4, 2, 8).transpose(1, 2).reshape(3, 64))  # [gate; up] order
    assert torch.equal(x8.view(torch.uint8), fp8_quantize_ref(v)[0].view(torch.uint8))
