"""The CPU backend (model_zoo/cpu_fast.py, its ops model_zoo/cpu_ops.py) against the reference model: with fp32
weights logits equal to fp32 rounding, with fp16 weights (the default; FBGEMM's fp16 GEMM, or torch's fp16 GEMV
where FBGEMM is not) within 3e-3; the same greedy tokens; int8 outputs bit for bit; quantized weights prepared at
load and not at the first forward; an fp16 overflow recomputed in fp32."""

from __future__ import annotations

from dataclasses import replace
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import model_zoo.cpu_fast as cpu_fast
import model_zoo.cpu_int8 as cpu_int8
import model_zoo.cpu_ops as cpu_ops
from model_zoo.config import LlamaConfig
from model_zoo.cpu_fast import CpuDtype, CpuModel, default_threads
from model_zoo.cpu_ops import DenseOp, Int8Op, SplitOp, make_op
from model_zoo.errors import ConfigError, PromptError
from model_zoo.generation import GenerationConfig, generate
from model_zoo.linear import DenseLinear
from model_zoo.quant.linear import ActQuant, AwqLinear, Int8Linear
from model_zoo.reference import ReferenceModel, rms_norm
from model_zoo.sampling import SamplingConfig, TorchSampler
from model_zoo.weights import ModelWeights, random_state_dict
from tests._fixtures_loaders import SMOLLM2, needs_smollm2
from tests.helpers import TINY, byte_tokenizer, rel_err

CONFIGS = {
    "gqa": LlamaConfig(96, 3, 6, 2, 160, 131, rope_theta=500000.0, norm_eps=1e-5, max_positions=128),
    "mha_untied": LlamaConfig(64, 2, 4, 4, 128, 97, max_positions=128, tie_embeddings=False),
    "head_dim": LlamaConfig(64, 2, 2, 1, 64, 61, head_dim=48, rope_theta=20000.0, max_positions=128),
}
SCHEMES = ("fp16", "int8", "int8-static", "int8-static-split", "awq")
CFG = LlamaConfig(64, 2, 4, 2, 128, 512, max_positions=256, name="cpu-cli-tiny")  # conftest's model_dir
FP16, FP32 = CpuDtype.FP16, CpuDtype.FP32
TORCH16 = "fp16-torch"  # fp16 weights on torch's GEMV: the path of a torch without FBGEMM (cpu_ops.fbgemm_fp16)


@pytest.fixture(autouse=True)
def one_thread():
    """The reference on one thread too: on a busy 2-core machine each threaded GEMM waits for a descheduled
    thread (cpu_fast.default_threads), which made this file 5x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def quantized(weights: ModelWeights, scheme: str) -> ModelWeights:
    """The weights as a checkpoint of `scheme` holds them (int8: per-channel codes; awq: RTN int4, group 32).
    int8-static: one calibrated amax per capture point, as checkpoints share it; -split: one per linear."""
    if scheme == "fp16":
        return weights
    layers = []
    for layer in weights.layers:
        lin = {}
        for i, (attr, l) in enumerate(layer.linears().items()):
            w = l.dense_weight()
            if scheme == "awq":
                lin[attr] = AwqLinear.from_dense(w, 32)
            elif scheme == "int8":
                lin[attr] = Int8Linear.from_dense(w, ActQuant.DYNAMIC, scale_dtype=torch.float16)
            else:
                amax = 3.0 + (0.25 * i if scheme.endswith("split") else 0.0)
                lin[attr] = Int8Linear.from_dense(w, ActQuant.STATIC, amax)
        layers.append(replace(layer, **lin))
    return replace(weights, layers=layers, meta={"scheme": scheme.split("-")[0]})


def cpu_model(weights: ModelWeights, dtype: CpuDtype | str = FP32) -> CpuModel:
    """CpuModel on one thread; TORCH16: fp16 weights as a torch without FBGEMM lays them out."""
    packs = dtype != TORCH16 and cpu_ops.fbgemm_fp16()
    with mock.patch.object(cpu_ops, "fbgemm_fp16", lambda: packs):
        return CpuModel(weights, threads=1, weight_dtype=FP16 if dtype == TORCH16 else dtype)


def pair(config: LlamaConfig, scheme: str = "fp16", seed: int = 0,
         dtype: CpuDtype | str = FP32) -> tuple[ReferenceModel, CpuModel]:
    weights = quantized(ModelWeights.from_state_dict(config, random_state_dict(config, seed=seed)), scheme)
    return ReferenceModel(weights), cpu_model(weights, dtype)


def close(got: torch.Tensor, want: torch.Tensor, scheme: str, dtype: CpuDtype | str = FP32) -> None:
    # fp32 GEMVs in another summation order; int8 adds a rare activation code one step away on a rounding tie;
    # fp16 weights (and, on torch's one-row GEMV, fp16 activations and products) round at ~5e-4 each
    tol = 1e-5 if scheme in ("fp16", "awq") else 2e-3
    assert rel_err(got, want) < (tol if dtype is FP32 else 3e-3)


@pytest.mark.parametrize("dtype", [FP32, FP16, TORCH16])
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_full_forward_matches_reference(name, scheme, dtype):
    ref, fast = pair(CONFIGS[name], scheme, seed=len(name), dtype=dtype)
    tokens = torch.randint(0, ref.config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(1))
    close(fast.forward(tokens), ref.forward(tokens), scheme, dtype)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("dtype", [FP32, FP16, TORCH16])
@pytest.mark.parametrize("scheme", ["fp16", "int8", "int8-static"])
def test_cached_prefill_and_decode_match_reference(scheme, dtype, batch):
    """batch 1 decodes one row a step: fp16 GEMVs and Int8Op's scalar paths (with fp16 weights the norm folded
    into the activation scale); batch 2 the several-row paths."""
    ref, fast = pair(CONFIGS["gqa"], scheme, seed=5, dtype=dtype)
    tokens = torch.randint(0, 131, (batch, 16), generator=torch.Generator().manual_seed(2))
    caches = ref.new_cache(batch, 24), fast.new_cache(batch, 24)
    close(fast.forward(tokens[:, :9], caches[1]), ref.forward(tokens[:, :9], caches[0]), scheme, dtype)
    for i in range(9, 16):
        close(fast.forward(tokens[:, i:i + 1], caches[1]), ref.forward(tokens[:, i:i + 1], caches[0]), scheme,
              dtype)
    assert caches[1].lengths.tolist() == [16] * batch
    close(caches[1].k[1], caches[0].k[1], scheme, dtype)  # the cache holds what the reference's holds


def test_ragged_rows_gathered_rows_and_continued_prompts():
    """Rows at different positions (mask), rows out of order (gather), a multi-token chunk after a cached
    prefix (a chat turn): each as the reference computes it."""
    ref, fast = pair(CONFIGS["head_dim"], seed=7)
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(0, 61, (1, 11), generator=g), torch.randint(0, 61, (1, 5), generator=g)
    runs = []
    for model in (ref, fast):
        cache = model.new_cache(3, 32)
        model.forward(a, cache, torch.tensor([0]))
        model.forward(b, cache, torch.tensor([2]))
        step = model.forward(torch.tensor([[4], [9]]), cache, torch.tensor([2, 0]))  # [2, 1, V]
        turn = model.forward(torch.tensor([[1, 2, 3, 5]]), cache, torch.tensor([2]))  # starts at 6
        runs.append((step, turn, cache.lengths.tolist()))
    assert runs[1][2] == runs[0][2] == [12, 0, 10]
    assert rel_err(runs[1][0], runs[0][0]) < 1e-5 and rel_err(runs[1][1], runs[0][1]) < 1e-5


@pytest.mark.parametrize("scheme", ["fp16", "int8", "awq"])
def test_greedy_tokens_equal_the_reference(scheme):
    ref, fast = pair(TINY, scheme, seed=11)  # fp32 weights: fp16's are tested on the real model, with margins
    tok = byte_tokenizer(TINY.vocab_size)
    prompts = [[5, 17, 33, 2, 90, 41, 7], [8, 64]]  # ragged: a batch decodes rows at different positions
    cfg = GenerationConfig(max_new_tokens=12, sampling=SamplingConfig(temperature=0), stop_at_eos=False)
    want = [r.tokens for r in generate(ref, tok, prompts, cfg)[0]]
    assert [r.tokens for r in generate(fast, tok, prompts, cfg)[0]] == want


KERNELS = {"fbgemm": cpu_int8.FbgemmInt8, "int_mm": cpu_int8.IntMM}


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_int8_products_are_exact(kernel):
    """Both kernels give q @ codes^T exactly, at the extremes too (every code +-127, K = 1536: sums past fp32's
    2^24 and pairs past int16); one row written in place (row()) as several rows. FBGEMM is chosen where exact."""
    if kernel == "fbgemm" and not cpu_int8.fbgemm_int8_exact():
        pytest.skip("FBGEMM's int8 sums are not exact here (no FBGEMM, or no VNNI): torch._int_mm is used")
    g = torch.Generator().manual_seed(12)
    codes = torch.randint(-127, 128, (40, 1536), generator=g, dtype=torch.int8)  # [N, K]
    codes[:4] = 127
    codes[2:4, ::2] = -127
    q = torch.randint(-127, 128, (3, 1536), generator=g).float()  # [M, K]
    q[0], q[1, ::3] = 127.0, -127.0
    want = q.double() @ codes.double().T  # [3, 40], exact
    op = KERNELS[kernel](codes)
    assert torch.equal(op(q).double(), want)
    row = op.row().copy_(q[:1])  # [1, K]: where Int8Op writes one row's codes
    assert torch.equal(op(row).double(), want[:1]) and torch.equal(op(q[2:]).double(), want[2:])
    assert isinstance(cpu_int8.int8_products(codes), cpu_int8.FbgemmInt8 if cpu_int8.fbgemm_int8_exact()
                      else cpu_int8.IntMM)


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("static", [False, True])
def test_int8_op_equals_int8_linear_bit_for_bit(static, kernel, monkeypatch):
    """One fused op of three Int8Linears gives each one's outputs exactly (exact int32 accumulation)."""
    if kernel == "fbgemm" and not cpu_int8.fbgemm_int8_exact():
        pytest.skip("FBGEMM's int8 sums are not exact here: torch._int_mm is used")
    monkeypatch.setattr(cpu_ops, "int8_products", KERNELS[kernel])
    g = torch.Generator().manual_seed(4)
    act, amax = (ActQuant.STATIC, 2.5) if static else (ActQuant.DYNAMIC, None)
    lins = [Int8Linear.from_dense(torch.randn(n, 1536, generator=g), act, amax) for n in (96, 32, 32)]
    x = torch.randn(7, 1536, generator=g) * 3  # K = 1536: past fp32's exact 2^24 for a single product sum
    x[3] *= 1e-10  # a row below the smallest range (AMAX_MIN)
    op = make_op(lins, torch.float32)
    assert isinstance(op, Int8Op)
    assert torch.equal(op(x), torch.cat([lin(x) for lin in lins], dim=-1))
    for row in x.split(1):  # one row takes the scalar path
        assert torch.equal(op(row), torch.cat([lin(row) for lin in lins], dim=-1))


@pytest.mark.parametrize("static", [False, True])
def test_int8_op_takes_a_one_row_norm_into_its_scale(static):
    """normed_row(x, w) is the op of rms_norm(x) * w with 1 / rms folded into the activation scale: the same
    codes but where fp32 rounding moves a tie (a rare code one step away)."""
    g = torch.Generator().manual_seed(5)
    act, amax = (ActQuant.STATIC, 4.0) if static else (ActQuant.DYNAMIC, None)
    lins = [Int8Linear.from_dense(torch.randn(n, 576, generator=g), act, amax) for n in (96, 32)]
    op, w = make_op(lins, torch.float32), torch.rand(576, generator=g) + 0.5
    for scale in (1e-3, 1.0, 300.0):
        x = torch.randn(1, 576, generator=g) * scale
        want = torch.cat([lin(rms_norm(x, w, 1e-5)) for lin in lins], dim=-1)
        assert rel_err(op.normed_row(x, w, 1e-5), want) < 1e-3


def test_linears_that_cannot_share_a_weight_run_side_by_side():
    g = torch.Generator().manual_seed(6)
    w = [torch.randn(16, 32, generator=g) for _ in range(2)]
    lins = [Int8Linear.from_dense(w[0], ActQuant.STATIC, 1.0), Int8Linear.from_dense(w[1], ActQuant.STATIC, 2.0)]
    op = make_op(lins, torch.float32)
    x = torch.randn(3, 32, generator=g)
    assert isinstance(op, SplitOp) and torch.equal(op(x), torch.cat([lins[0](x), lins[1](x)], dim=-1))


@pytest.mark.parametrize("shape", [(960, 576), (576, 1536)])
def test_dense_layout_by_shape(shape):
    """Wide outputs stored transposed, narrow ones as they are; the same product either way."""
    g = torch.Generator().manual_seed(8)
    w, x = torch.randn(*shape, generator=g), torch.randn(2, shape[1], generator=g)
    op = DenseOp([w], torch.float32)
    assert op.transposed == (shape[0] >= shape[1])
    torch.testing.assert_close(op(x), F.linear(x, w), rtol=1e-5, atol=1e-4)


def test_fp16_weights_one_row_in_fp16_several_rows_in_fp32():
    """fp16 weights: one row through the fp16 GEMV (fp32 accumulation, an fp16 output), several rows (or upcast)
    through an fp32 GEMM of the same fp16 values."""
    g = torch.Generator().manual_seed(8)
    w, x = torch.randn(960, 576, generator=g), torch.randn(3, 576, generator=g)
    op = DenseOp([w], torch.float16)
    assert op.halves and not op.transposed and op.w.dtype == torch.float16
    exact = (x.double() @ w.half().double().T)  # [3, 960]: the fp16 weights' exact products
    many, one, wide = op(x), op(x[:1]), op(x[:1], upcast=True)
    assert many.dtype == wide.dtype == torch.float32 and one.dtype == torch.float16
    assert rel_err(many, exact) < 1e-6 and rel_err(wide, exact[:1]) < 1e-6
    assert rel_err(one, exact[:1]) < 1e-3  # x rounded to fp16 and the output too; the sum in fp32


@pytest.mark.skipif(not cpu_ops.fbgemm_fp16(), reason="this torch has no FBGEMM (x86 builds do)")
def test_fp16_weights_packed_for_fbgemm():
    """fp16 weights read by fp32 activations: packed for FBGEMM with the values .half() gives, every row count in
    fp32 (no fp16 activations or outputs); weights past fp16's range stay fp32; fp16 activations keep torch's."""
    g = torch.Generator().manual_seed(8)
    w, x = torch.randn(960, 576, generator=g), torch.randn(5, 1152, generator=g)[:, ::2]  # x: a strided view
    w[0, :4] = torch.tensor([1e-7, 3e-8, 65504.0, -2.5e-5])  # fp16 subnormals and its largest value
    op = cpu_ops.dense_op([w[:600], w[600:]], torch.float16)
    assert isinstance(op, cpu_ops.PackedFp16Op) and not op.halves
    assert torch.equal(op.weight(), w.half().float())
    exact = x.double() @ w.half().double().T  # [5, 960]: the fp16 weights' exact products
    for rows in (x, x[:1]):
        y = op(rows)
        assert y.dtype == torch.float32 and rel_err(y, exact[:len(rows)]) < 1e-6
    w[1, 2] = 7e4  # rounds to inf in fp16
    wide = cpu_ops.dense_op([w], torch.float16)
    assert isinstance(wide, DenseOp) and wide.w.dtype == torch.float32
    assert isinstance(cpu_ops.dense_op([w[2:]], torch.float16, torch.float16), DenseOp)


def test_fp32_norm_is_the_reference_norm_bit_for_bit():
    g = torch.Generator().manual_seed(9)
    x, w = torch.randn(5, 576, generator=g) * 7, torch.randn(576, generator=g)
    assert torch.equal(cpu_fast._norm(x, w, 1e-5), rms_norm(x, w, 1e-5))


def test_quantized_weights_are_prepared_at_load_not_at_the_first_forward(monkeypatch):
    """AWQ is dequantized when the model is built (load time); forward dequantizes nothing, and the int8 codes
    are never widened to fp32 (the reference's lazy copy stays unmade)."""
    calls = []
    real = cpu_ops.dequantize_awq
    monkeypatch.setattr(cpu_ops, "dequantize_awq", lambda *a, **k: calls.append(1) or real(*a, **k))
    config = CONFIGS["gqa"]
    dense = ModelWeights.from_state_dict(config, random_state_dict(config, seed=1))
    awq = CpuModel(quantized(dense, "awq"), threads=1)
    assert len(calls) == 7 * config.n_layers
    int8_weights = quantized(dense, "int8")
    int8 = CpuModel(int8_weights, threads=1)
    tokens = torch.randint(0, config.vocab_size, (1, 6))
    awq.forward(tokens)
    int8.forward(tokens)
    assert len(calls) == 7 * config.n_layers
    assert all(lin._qweight_f is None for layer in int8_weights.layers for lin in layer.linears().values())


def test_threads_are_set_for_each_call_and_restored():
    ref, fast = pair(CONFIGS["mha_untied"])
    torch.set_num_threads(2)
    fast.forward(torch.tensor([[1, 2, 3]]))
    assert torch.get_num_threads() == 2 and fast.threads == 1
    cache = fast.new_cache(1, 8)
    sampler = TorchSampler(SamplingConfig(temperature=0), 1, ref.config.vocab_size)
    seen = []
    sampler.sample = lambda logits, rows: seen.append(torch.get_num_threads()) or logits.argmax(-1)
    fast.decode_sampled(torch.tensor([5]), cache, [0], sampler)
    assert seen == [1] and torch.get_num_threads() == 2 and cache.lengths.tolist() == [1]
    assert 1 <= default_threads() <= max(1, torch.get_num_threads())
    with pytest.raises(ConfigError, match="threads"):
        CpuModel(ref.weights, threads=0)


@pytest.mark.parametrize("bad", [-1, 97])
def test_token_ids_outside_the_vocabulary_are_refused(bad):
    _, fast = pair(CONFIGS["mha_untied"])
    with pytest.raises(PromptError, match=str(bad)):
        fast.forward(torch.tensor([[1, bad]]))


@pytest.mark.parametrize("dtype", [TORCH16, FP16])
def test_fp16_overflow_is_recomputed_in_fp32(monkeypatch, dtype):
    """A one-row step whose fp16 product overflows (a down projection past 65504) on torch's fp16 GEMV is run
    again on fp32 products: finite logits, as the reference's, and the cache holds the recomputed K/V. FBGEMM's
    fp32 outputs do not overflow: nothing to run again."""
    config = CONFIGS["gqa"]
    weights = ModelWeights.from_state_dict(config, random_state_dict(config, seed=3))
    layer = weights.layers[1]
    up, down = (DenseLinear(lin.dense_weight() * f) for lin, f in ((layer.w_up, 100), (layer.w_down, 1e3)))
    weights = replace(weights, layers=[weights.layers[0], replace(layer, w_up=up, w_down=down),
                                       *weights.layers[2:]])  # down outputs ~2e5: fp32's range, not fp16's
    ref, fast = ReferenceModel(weights), cpu_model(weights, dtype)
    runs = []
    real = CpuModel._steps
    monkeypatch.setattr(CpuModel, "_steps", lambda self, *a, **k: runs.append(k["upcast"]) or real(self, *a, **k))
    tokens = torch.randint(0, config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(4))
    caches = ref.new_cache(1, 8), fast.new_cache(1, 8)
    ref.forward(tokens[:, :5], caches[0])
    fast.forward(tokens[:, :5], caches[1])  # several rows: fp32 GEMMs of the fp16 weights, no overflow
    got = fast.forward(tokens[:, 5:], caches[1])
    recomputed = dtype == TORCH16 or not cpu_ops.fbgemm_fp16()
    assert runs == ([False, False, True] if recomputed else [False, False]) and torch.isfinite(got).all()
    close(got, ref.forward(tokens[:, 5:], caches[0]), "fp16", FP16)
    close(caches[1].v[2], caches[0].v[2], "fp16", FP16)


def smollm2_weights():
    from model_zoo.load import load_model
    from model_zoo.quant.checkpoint import build_weights

    loaded = load_model(str(SMOLLM2), dtype=torch.float32)
    return loaded.tokenizer, build_weights(loaded, torch.float32, "cpu")


@needs_smollm2
def test_smollm2_greedy_tokens_equal_the_reference():
    """The default model with fp32 weights: the fast backend's greedy reply, teacher-forced through the
    reference's full forward, is the reference's argmax at every position, and the logits agree to fp32
    rounding."""
    tokenizer, weights = smollm2_weights()
    fast = CpuModel(weights, weight_dtype=FP32)
    prompt = tokenizer.encode("The capital of France is")
    cfg = GenerationConfig(max_new_tokens=16, sampling=SamplingConfig(temperature=0), stop_at_eos=False)
    reply = generate(fast, tokenizer, [prompt], cfg)[0][0].tokens
    tokens = torch.tensor([prompt + reply])
    want = ReferenceModel(weights).forward(tokens)[0, len(prompt) - 1:-1]  # [16, V]
    assert want.argmax(-1).tolist() == reply
    assert rel_err(fast.forward(tokens)[0, len(prompt) - 1:-1], want) < 1e-5


@needs_smollm2
def test_smollm2_fp16_decode_steps_against_the_reference():
    """The default run (fp16 weights, one row a step): the greedy reply, teacher-forced through the fp32
    reference, is its argmax wherever the reference's top two logits are 0.1 apart or more (on this prompt:
    everywhere), and each step's logits are within 1.5e-3 of the reference's with FBGEMM (measured 5.4e-4; only
    the weights round), 3e-3 on torch's fp16 GEMV (measured 1.2e-3)."""
    tokenizer, weights = smollm2_weights()
    fast = CpuModel(weights)
    assert fast.weight_dtype is FP16 and "weights in fp16" in fast.compute
    prompt = tokenizer.encode("The capital of France is")
    cache = fast.new_cache(1, 40)
    steps = [fast.forward(torch.tensor([prompt]), cache)[0, -1]]  # [V]
    for _ in range(23):
        steps.append(fast.forward(steps[-1].argmax().view(1, 1), cache)[0, 0])
    reply = [int(s.argmax()) for s in steps]
    want = ReferenceModel(weights).forward(torch.tensor([prompt + reply[:-1]]))[0, len(prompt) - 1:]  # [24, V]
    top2 = want.topk(2, -1).values
    clear = (top2[:, 0] - top2[:, 1]) >= 0.1
    assert clear.sum() >= 20 and want.argmax(-1)[clear].tolist() == torch.tensor(reply)[clear].tolist()
    packed = isinstance(fast.head, cpu_ops.PackedFp16Op)
    assert rel_err(torch.stack(steps), want) < (1.5e-3 if packed else 3e-3)


def test_open_model_prepares_an_awq_checkpoint_at_load(tmp_path_factory, monkeypatch):
    """`fllama generate --device cpu` on an AWQ checkpoint: the dequantization happens in open_model (reported
    as load), none in the generation that follows."""
    from calibrate.pipeline import QuantizeJob, run_quantize
    from calibrate.quantize import AwqMethod, QuantConfig
    from fllama_cli.options import DeviceChoice
    from fllama_cli.runtime import open_model
    from model_zoo.quant.formats import Scheme
    from tests.helpers import tiny_hf_dir

    config = LlamaConfig(64, 2, 4, 2, 128, 512, max_positions=256, name="cpu-tiny")  # a trainable vocabulary
    src = tiny_hf_dir(tmp_path_factory, config)
    out = tmp_path_factory.mktemp("awq") / "ck"
    run_quantize(QuantizeJob(str(src), out, QuantConfig(Scheme.AWQ, group_size=32, awq_method=AwqMethod.RTN),
                             device="cpu"))
    calls = []
    real = cpu_ops.dequantize_awq
    monkeypatch.setattr(cpu_ops, "dequantize_awq", lambda *a, **k: calls.append(1) or real(*a, **k))
    opened = open_model(str(out), device=DeviceChoice.cpu)
    assert isinstance(opened.backend, CpuModel) and opened.backend.scheme == "awq"
    assert len(calls) == 7 * config.n_layers and opened.load_s > 0 and "load" in opened.describe()
    assert "weights in fp16" in opened.describe()  # the default CPU dtype, said where the speed is reported
    cfg = GenerationConfig(max_new_tokens=4, sampling=SamplingConfig(temperature=0), stop_at_eos=False)
    generate(opened.backend, opened.tokenizer, [opened.tokenizer.encode("hello")], cfg)
    assert len(calls) == 7 * config.n_layers
    assert opened.loaded.state_dict == {}  # the backend holds its weights: the host copies do not outlive the load


def test_cpu_dtype_option_chooses_the_weights(capsys, monkeypatch, model_dir):
    """`fllama generate` keeps float weights in fp16 by default and says so; `--cpu-dtype fp32` keeps the
    reference's fp32."""
    from tests.test_cli import fllama

    said = {}
    for extra in ((), ("--cpu-dtype", "fp32")):
        code, _, err = fllama(capsys, monkeypatch, "generate", model_dir, "-p", "hello", "-n", "4",
                              "--temperature", "0", "--device", "cpu", *extra)
        assert code == 0, err
        said[extra] = " ".join(err.split())
    assert "float weights in fp16, fp32 accumulation" in said[()]
    assert "fp32 compute" in said[("--cpu-dtype", "fp32")] and "in fp16" not in said[("--cpu-dtype", "fp32")]
