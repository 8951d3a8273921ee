"""The engine on FP8 E4M3 W8A8 checkpoints (Fp8Linear, dynamic and static activations) against the CPU reference.

The engine quantizes every linear's input as the reference does (fp8_quantize's codes are the contract's bits), in
decode (the GEMV) and prefill (the wgmma GEMM above tuning.fp8_gemv_max_m rows), so it runs the reference's
numerics up to fp16 activations and fp32 summation order, as the int8 engine does. The reference runs in fp32,
so where an fp16 activation lands on the other side of an e4m3 rounding boundary the code differs by one step
(6-12% of that value, where int8's step is ~1/127 of the row's max): the logits bound is 5e-2 where int8's is
2e-2 (the CPU reference in fp16 against itself in fp32 on these checkpoints: 2.6-3.6% for fp8, 1.4-1.7% for int8).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.gpu.conftest import GPU_STACK, SKIP_REASON

if not GPU_STACK:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from kernels_cu.fp8_quantize import has_fp8  # noqa: E402
from model_zoo.generation import GenerationConfig, generate  # noqa: E402
from model_zoo.quant.int8 import ActQuant  # noqa: E402
from model_zoo.quant.linear import Fp8Linear  # noqa: E402
from model_zoo.reference import ReferenceModel  # noqa: E402
from model_zoo.sampling import SamplingConfig  # noqa: E402
from model_zoo.tokenizer import Tokenizer  # noqa: E402
from model_zoo.weights import ModelWeights, random_state_dict  # noqa: E402
from tests.gpu.test_engine import CONFIGS, check_ragged_batch, decode_steps, rel  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (torch.cuda.is_available() and has_fp8(torch.cuda.current_device())),
    reason="FP8 E4M3 needs compute capability 8.9 or newer")]
SCHEMES = ("fp8-dynamic", "fp8-static")
STATIC_SCALE = 4.0 / 448  # an activation range of 4, as test_engine's static int8 checkpoints
LOGITS_REL = 5e-2  # see the module docstring


def checkpoint(config, scheme: str, seed: int = 0) -> ModelWeights:
    """Random weights quantized by model_zoo's Fp8Linear (per-channel e4m3 weights), as a loaded checkpoint."""
    sd = random_state_dict(config, seed=seed)
    sd["model.embed_tokens.weight"] *= 0.05 * config.hidden_size ** 0.5  # logits of a trained model's scale
    w = ModelWeights.from_state_dict(config, sd, meta={"scheme": "fp8"})
    static = scheme == "fp8-static"
    layers = []
    for layer in w.layers:
        lin = {attr: Fp8Linear.from_dense(dense.dense_weight().float(), ActQuant.STATIC if static else ActQuant.DYNAMIC,
                                          STATIC_SCALE if static else None)
               for attr, dense in layer.linears().items()}
        layers.append(dataclasses.replace(layer, **lin))
    return dataclasses.replace(w, layers=layers).to(dtype=torch.float16)


def engine_and_ref(config, scheme: str, **cfg):
    from kernels_cu.engine import Engine, EngineConfig

    w = checkpoint(config, scheme)
    return Engine(w, EngineConfig(max_len=256, **cfg)), ReferenceModel(w.to("cpu", torch.float32))


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_and_decode_logits_match_reference(name, scheme):
    """37 tokens x 2 rows: the prefill's 74 rows run the wgmma GEMM on Hopper (the GEMV elsewhere), decode the GEMV."""
    config = CONFIGS[name]
    eng, ref = engine_and_ref(config, scheme)
    tokens = torch.randint(0, config.vocab_size, (2, 37), generator=torch.Generator().manual_seed(1))
    want = ref.forward(tokens)  # [2, 37, V] fp32 on the CPU
    got = eng.forward(tokens)
    assert torch.isfinite(got).all()
    assert rel(got, want) < LOGITS_REL, f"prefill {name} {scheme}"
    steps, cache = decode_steps(eng, tokens, 30)
    assert rel(steps.transpose(0, 1), want[:, 30:]) < LOGITS_REL, f"decode {name} {scheme}"
    assert cache.lengths.tolist()[:2] == [37, 37]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_greedy_tokens_equal_reference_for_32_steps(scheme):
    config = CONFIGS["smol-like"]
    eng, ref = engine_and_ref(config, scheme)
    tok = Tokenizer.byte_fallback(config.vocab_size)
    cfg = GenerationConfig(max_new_tokens=32, sampling=SamplingConfig(temperature=0), stop_at_eos=False)
    prompt = [tok.encode("The engine and the reference agree")]
    assert generate(eng, tok, prompt, cfg)[0][0].tokens == generate(ref, tok, prompt, cfg)[0][0].tokens


def test_ragged_batch_equals_each_prompt_alone():
    check_ragged_batch(engine_and_ref(CONFIGS["gqa4-d64"], "fp8-dynamic")[0])


def test_graph_replay_equals_eager_decode_and_the_plan():
    from kernels_cu.engine import Engine, EngineConfig
    from kernels_cu.engine.fp8_op import Fp8Op
    from kernels_cu.engine.plan import StepPlan

    config = CONFIGS["gqa4-d64"]
    w = checkpoint(config, "fp8-static")
    graphed, eager = Engine(w, EngineConfig(max_len=128)), Engine(w, EngineConfig(max_len=128, use_graphs=False))
    assert all(isinstance(op, Fp8Op) for l in graphed.layers for op in (l.qkv, l.o, l.gate_up, l.down))
    assert graphed.layers[0].gate_up.swiglu and not graphed.plan(128).folds_any  # the wgmma GEMM's rows
    assert graphed.plan(4) == StepPlan(int8_fold=True)  # static: the chain's norms, no row maxima
    tokens = torch.randint(0, config.vocab_size, (3, 12))
    outs = [decode_steps(eng, tokens, 8)[0] for eng in (graphed, eager)]
    assert rel(outs[0], outs[1]) < 1e-3
    for op in (graphed.layers[0].qkv, graphed.layers[0].down):  # one byte a weight and an fp32 scale a channel
        assert op.w8.dtype == torch.float8_e4m3fn and op.nbytes() == op.w8.numel() + 4 * op.w8.shape[0]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_one_row_fused_step_equals_the_unfused_kernels_bitwise(scheme):
    """Without the deferred chain, at one row the GEMVs apply the RMSNorm and quantize their input themselves
    (fp8_gemv_nq / _xq): five kernels a layer. With tuning.fp8_xq_max_rows = 0 the norm and quantize kernels run
    instead: the same logits, bit for bit."""
    from kernels_cu.engine import Engine, EngineConfig

    config = CONFIGS["smol-like"]
    fused = Engine(checkpoint(config, scheme), EngineConfig(max_len=128)).variant(fp8_defer_max_rows=0)
    plain = fused.variant(fp8_xq_max_rows=0)
    tokens = torch.randint(0, config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(3))
    a, b = (decode_steps(eng, tokens, 12)[0] for eng in (fused, plain))
    assert torch.isfinite(a).all() and torch.equal(a, b)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("name,rows", [("smol-like", 1), ("gqa4-d64", 1), ("gqa4-d64", 3), ("smol-like", 20)])
def test_deferred_chain_matches_reference(name, rows, scheme):
    """Decode steps on the GEMVs run int8's deferred chain (plan.fp8_chain): the norms folded into o_proj /
    down_proj (int8's format), the inputs of q|k|v and gate|up quantized from those partials, of o_proj and
    down_proj (dynamic) from the maxima attention and the gate|up GEMV wrote; in the GEMVs at one row, by
    fp8_quantize_fold beyond. Logits: the reference's to the fp8 bound, about as near it as the unchained step's (the
    fold drops an fp16 rounding and moves the rstd into a_scale, so some codes move by one step)."""
    from kernels_cu.engine import Engine, EngineConfig
    from kernels_cu.engine.plan import StepPlan

    config = CONFIGS[name]
    w = checkpoint(config, scheme)
    eng, ref = Engine(w, EngineConfig(max_len=128)), ReferenceModel(w.to("cpu", torch.float32))
    dynamic = scheme == "fp8-dynamic"
    assert eng.plan(1) == StepPlan(int8_fold=True, defer_o=dynamic, defer_down=dynamic, row_amax=dynamic)
    assert eng.plan(32) == StepPlan(int8_fold=True, defer_o=dynamic, defer_down=dynamic)
    tokens = torch.randint(0, config.vocab_size, (rows, 24), generator=torch.Generator().manual_seed(7))
    got = decode_steps(eng, tokens, 12)[0]  # [12, rows, V]
    assert torch.isfinite(got).all()
    want = ref.forward(tokens)[:, 12:].transpose(0, 1)  # [12, rows, V]
    plain = decode_steps(eng.variant(fp8_defer_max_rows=0), tokens, 12)[0]
    err_chain, err_plain = rel(got, want), rel(plain, want)
    assert err_chain < LOGITS_REL and err_chain < 1.5 * err_plain + 5e-3, (err_chain, err_plain)
    if rows > 1:  # the GEMVs on the codes' fp16 values (tuning.fp8_gemv_fp16_x): the same codes and products
        values = decode_steps(eng.variant(fp8_gemv_fp16_x=True), tokens, 12)[0]
        assert rel(values, want) < LOGITS_REL and rel(values, got) < 2e-2


def test_kv_int8_with_fp8_linears():
    config = CONFIGS["smol-like"]
    eng, ref = engine_and_ref(config, "fp8-dynamic", kv="int8")
    tokens = torch.randint(0, config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(5))
    want = ref.forward(tokens)
    cache = eng.new_cache(2, 64)
    got = torch.cat([eng.forward(tokens[:, :32], cache)] +
                    [eng.forward(tokens[:, i:i + 1], cache) for i in range(32, 40)], 1)
    assert rel(got, want) < LOGITS_REL + 2e-2  # the int8 cache's own error on top (test_engine: 5e-2 with fp16)


def test_gpu_without_fp8_gets_one_line(monkeypatch):
    """On compute capability < 8.9 the engine refuses fp8 weights with one DeviceError line (faked here)."""
    from kernels_cu import fp8_quantize
    from kernels_cu.engine import Engine, EngineConfig
    from model_zoo.errors import DeviceError

    monkeypatch.setattr(fp8_quantize, "has_fp8", lambda index: False)
    with pytest.raises(DeviceError) as e:
        Engine(checkpoint(CONFIGS["gqa4-d64"], "fp8-dynamic"), EngineConfig(max_len=64))
    assert "\n" not in str(e.value) and "8.9 or newer" in str(e.value)
