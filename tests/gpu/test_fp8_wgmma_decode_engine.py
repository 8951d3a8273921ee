"""Where fp8_gemm and the engine run the wgmma decode GEMM (fp8_wgmma_decode.py) and that the engine's answers stay
the reference's with it.

fp8_gemm takes it on Hopper for tuning.fp8_wgmma_decode_min_m up to fp8_library_min_m - 1 rows and products of at
least fp8_wgmma_decode_min_n channels (LLaMA-2-7B: q|k|v and gate|up at 17-32 rows), the GEMV elsewhere. The test
models are narrow, so the engine tests lower fp8_wgmma_decode_min_n: to their q|k|v width (the 7B split: q|k|v and
gate|up on the GEMM, o_proj and down_proj on the GEMV) and to 16 (every linear, split K and the fold epilogue too).
Its sums differ from the GEMV's by the e4m3 accumulator's truncation within a 128-k chunk (test_fp8_wgmma_decode.py),
far below fp8's own rounding: greedy tokens stay the CPU reference's.
"""

import pytest
import torch

from tests.gpu.conftest import GPU_STACK, SKIP_REASON, assert_equal

if not GPU_STACK:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from kernels_cu import build, tuning  # noqa: E402
from kernels_cu import fp8_wgmma_decode as dec  # noqa: E402
from kernels_cu.fp8_gemm import FoldQuant, fp8_gemm, fp8_gemm_fold, fp8_swiglu  # noqa: E402
from kernels_cu.norm_fold import FoldOut  # noqa: E402
from model_zoo.generation import GenerationConfig, generate  # noqa: E402
from model_zoo.reference import ReferenceModel  # noqa: E402
from model_zoo.sampling import SamplingConfig  # noqa: E402
from model_zoo.tokenizer import Tokenizer  # noqa: E402
from tests.gpu.test_engine import CONFIGS, decode_steps, rel  # noqa: E402
from tests.gpu.test_fp8_engine import LOGITS_REL, checkpoint  # noqa: E402
from tests.gpu.test_fp8_kernels import abs_products, acts, check_wgmma, swiglu_case, weight  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (torch.cuda.is_available() and build.has_wgmma(torch.cuda.current_device())),
    reason="wgmma e4m3 needs an sm_90 GPU")]

QKV = 960  # smol-like's q|k|v width (576 + 2 * 192); its gate|up is 3072, o_proj and down_proj 576
VARIANTS = {"wide": QKV, "all": 16}  # fp8_wgmma_decode_min_n: the 7B split, or every linear


@pytest.fixture
def launches(monkeypatch):
    """Every fp8_wgmma_decode.launch as (epilogue, M, N, K), the kernel still run."""
    seen, real = [], dec.launch

    def spy(y, x8, a_scale, w8, w_scale, residual, epilogue, *args, **kw):
        seen.append((epilogue, x8.shape[0], w8.shape[0], x8.shape[1]))
        real(y, x8, a_scale, w8, w_scale, residual, epilogue, *args, **kw)

    monkeypatch.setattr(dec, "launch", spy)
    return seen


@pytest.mark.parametrize("M,N,takes", [(17, 12288, True), (32, 12288, True), (32, 22016, True), (16, 12288, False),
                                       (33, 12288, False), (64, 12288, False), (32, 4096, False), (32, 11008, False)])
def test_fp8_gemm_takes_it_for_wide_products_of_17_to_32_rows(M, N, takes, launches):
    K = 4096
    x8, a_scale = acts(M, K, seed=M)
    w8, w_scale = weight(N, K, seed=N)
    y = fp8_gemm(x8, a_scale, w8, w_scale)
    assert launches == ([("plain", M, N, K)] if takes else []), launches
    if takes:
        assert_equal(y, dec.fp8_wgmma_decode(x8, a_scale, w8, w_scale), "fp8_gemm is the kernel's launch")
        check_wgmma(y, fp8_gemm(x8, a_scale, w8, w_scale, wgmma=False), abs_products(x8, a_scale, w8, w_scale),
                    f"vs the GEMV M={M} N={N}")
    launches.clear()
    off = fp8_gemm(x8, a_scale, w8, w_scale, wgmma=False) if takes else y  # 33-64 rows: cuBLASLt's, switch or not
    with tuning.override(fp8_wgmma_decode=False):
        assert_equal(fp8_gemm(x8, a_scale, w8, w_scale), off, "switched off: the path it replaced")
    assert launches == [], "switched off, or the GEMV forced"


def test_the_deferred_chain_takes_it_with_its_epilogues(launches):
    """At 32 rows the chain's q|k|v (fp8_gemm_fold: plain) and gate|up (SwiGLU and its maxima per 8 outputs for
    down_proj) run it; o_proj's residual + fold where the switch reaches it (min_n lowered)."""
    M, K, F = 32, 4096, 11008
    x8, a_scale, w8, w_scale, want, gate, up = swiglu_case(M, K, F, seed=3)
    xg = torch.randn(M, K, device="cuda").half()  # [M, K] a deferred norm's input
    mx = xg.float().abs().reshape(M, -1, 8).amax(-1)  # [M, K / 8]
    sq = xg.float().pow(2).reshape(M, -1, 8).sum(-1)  # [M, K / 8]
    d = fp8_gemm_fold(FoldQuant(xg, mx, sq, 1e-5), w8, w_scale, swiglu=True, maxima=True)
    assert launches == [("silu", M, 2 * F, K)], launches
    assert_equal(d.part, d.x.float().abs().reshape(M, -1, 8).amax(-1), "the SwiGLU's maxima")
    y = fp8_swiglu(x8, a_scale, w8, w_scale)
    with tuning.override(fp8_wgmma_decode=False):
        assert rel(y, fp8_swiglu(x8, a_scale, w8, w_scale)) < 2e-3
    launches.clear()
    w8o, wso = weight(4096, K, seed=9)
    r = torch.randn(M, 4096, device="cuda").half()
    fold = FoldOut.new(torch.ones(4096, dtype=torch.float16, device="cuda"), M, int8=True)
    with tuning.override(fp8_wgmma_decode_min_n=16):
        fp8_gemm(x8, a_scale, w8o, wso, residual=r, fold_out=fold)
    assert launches == [("res", M, 4096, K)], launches


def engines(scheme: str = "fp8-dynamic"):
    """(the default engine on smol-like fp8 weights, the CPU reference)."""
    from kernels_cu.engine import Engine, EngineConfig

    w = checkpoint(CONFIGS["smol-like"], scheme)
    return Engine(w, EngineConfig(max_len=128)), ReferenceModel(w.to("cpu", torch.float32))


def test_a_decode_step_runs_it_where_tuned(launches):
    """One eager decode step at batch 32 (bucket 32): q|k|v and gate|up of each layer on the GEMM with min_n at the
    q|k|v width, every linear at 16; batch 16 and the switch off: none."""
    eng, _ = engines()
    eng = eng.variant(use_graphs=False)
    tokens = torch.randint(0, eng.config.vocab_size, (32, 9), generator=torch.Generator().manual_seed(2))
    layers = eng.config.n_layers
    want = {"wide": {("plain", 32, QKV, 576): layers, ("silu", 32, 3072, 576): layers},
            "all": {("plain", 32, QKV, 576): layers, ("silu", 32, 3072, 576): layers,
                    ("res", 32, 576, 576): layers, ("res", 32, 576, 1536): layers}}
    for name, min_n in VARIANTS.items():
        e = eng.variant(fp8_wgmma_decode_min_n=min_n)
        cache = e.new_cache(32, 16)
        e.forward(tokens[:, :8], cache)
        launches.clear()
        e.forward(tokens[:, 8:], cache)
        got = {k: launches.count(k) for k in set(launches)}
        assert got == want[name], (name, got)
    for e, rows in ((eng.variant(fp8_wgmma_decode_min_n=16), 16), (eng.variant(fp8_wgmma_decode=False), 32)):
        cache = e.new_cache(rows, 16)
        e.forward(tokens[:rows, :8], cache)
        launches.clear()
        e.forward(tokens[:rows, 8:], cache)
        assert launches == [], rows


@pytest.mark.parametrize("scheme", ["fp8-dynamic", "fp8-static"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_decode_logits_at_24_rows_match_reference(variant, scheme):
    """The graphs' decode steps at 24 rows (bucket 32) against the reference, about as near it as the GEMV's. (Not
    against the GEMV's logits themselves: each layer re-quantizes its activations, and a sum moved by the e4m3
    accumulator's truncation moves an activation code by a whole e4m3 step (6-12%) wherever it sat on a rounding
    boundary, so after a few layers the two GPU paths are about as far apart (2%) as each is from the reference.)"""
    eng, ref = engines(scheme)
    tokens = torch.randint(0, eng.config.vocab_size, (24, 20), generator=torch.Generator().manual_seed(11))
    want = ref.forward(tokens)[:, 12:].transpose(0, 1)  # [8, 24, V]
    got = decode_steps(eng.variant(fp8_wgmma_decode_min_n=VARIANTS[variant]), tokens, 12)[0]
    gemv = decode_steps(eng.variant(fp8_wgmma_decode=False), tokens, 12)[0]
    assert torch.isfinite(got).all()
    err, err_gemv = rel(got, want), rel(gemv, want)
    assert err < LOGITS_REL and err < 1.5 * err_gemv + 5e-3, (err, err_gemv)


@pytest.mark.parametrize("batch", [17, 32])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_tokens_equal_reference(variant, batch):
    """Greedy generation of `batch` prompts (bucket 32) gives the CPU reference's tokens."""
    eng, ref = engines()
    tok = Tokenizer.byte_fallback(eng.config.vocab_size)
    cfg = GenerationConfig(max_new_tokens=12, sampling=SamplingConfig(temperature=0), stop_at_eos=False)
    prompts = [tok.encode(f"prompt {i:02d} of the batch says") for i in range(batch)]  # one length: no ragged rows
    got = [r.tokens for r in generate(eng.variant(fp8_wgmma_decode_min_n=VARIANTS[variant]), tok, prompts, cfg)[0]]
    want = [r.tokens for r in generate(ref, tok, prompts, cfg)[0]]
    bad = [i for i in range(batch) if got[i] != want[i]]
    if bad:  # say whether the GEMV's step agrees there (the kernel's doing) or not (fp8 against fp32)
        gemv = [r.tokens for r in generate(eng.variant(fp8_wgmma_decode=False), tok, prompts, cfg)[0]]
        raise AssertionError(f"rows {bad} differ from the reference; with the GEMV rows "
                             f"{[i for i in range(batch) if gemv[i] != want[i]]}")
