"""The engine on Llama-3-family shapes: RoPE scaling (llama3, linear; dynamic within its original context), tied
embeddings, Mistral, a GPTQ checkpoint on the int4 kernels, the 128,256-token vocabulary (lm_head, sampler) and
the KV-cache memory check of --max-context. Each against the CPU reference on the same weights."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.conftest import GPU_STACK, SKIP_REASON

if not GPU_STACK:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from model_zoo.config import LlamaConfig  # noqa: E402
from model_zoo.errors import DeviceError, PromptError  # noqa: E402
from model_zoo.generation import GenerationConfig, generate  # noqa: E402
from model_zoo.load import load_model  # noqa: E402
from model_zoo.quant.checkpoint import build_weights  # noqa: E402
from model_zoo.reference import ReferenceModel  # noqa: E402
from model_zoo.rope import RopeScaling, RopeType  # noqa: E402
from model_zoo.sampling import SamplingConfig  # noqa: E402
from model_zoo.tokenizer import Tokenizer  # noqa: E402
from tests._serve_helpers import assert_same_greedy  # noqa: E402
from tests.gpu.test_engine import checkpoint, decode_steps, rel  # noqa: E402

pytestmark = pytest.mark.gpu

# original contexts of 64 positions, so that the scaled frequencies differ from plain RoPE within a short test
LLAMA31 = RopeScaling(RopeType.LLAMA3, 8.0, 64, 1.0, 4.0)
CONFIGS = {
    "llama3.1-d64": LlamaConfig(512, 2, 8, 2, 1024, 1000, rope_theta=5e5, max_positions=1024, rope_scaling=LLAMA31,
                                name="l31"),
    "llama3.1-d128": LlamaConfig(1024, 2, 8, 2, 1024, 1000, rope_theta=5e5, max_positions=1024,
                                 rope_scaling=LLAMA31, name="l31-128"),
    "llama3.2-tied": LlamaConfig(512, 2, 8, 2, 1024, 1000, rope_theta=5e5, max_positions=1024, tie_embeddings=True,
                                 rope_scaling=RopeScaling(RopeType.LLAMA3, 32.0, 64, 1.0, 4.0), name="l32"),
    "linear": LlamaConfig(512, 2, 8, 2, 1024, 1000, max_positions=1024,
                          rope_scaling=RopeScaling(RopeType.LINEAR, 4.0, 256), name="linear"),
    "mistral": LlamaConfig(512, 2, 8, 2, 1024, 1000, rope_theta=1e6, max_positions=256, sliding_window=256,
                           name="mistral"),
}


def engine_and_ref(config: LlamaConfig, scheme: str):
    from kernels_cu.engine import Engine, EngineConfig

    w = checkpoint(config, scheme)
    return Engine(w, EngineConfig(max_len=256)), ReferenceModel(w.to("cpu", torch.float32))


@pytest.mark.parametrize("scheme", ["fp16", "awq"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_and_decode_logits_past_the_original_context(name, scheme):
    config = CONFIGS[name]
    eng, ref = engine_and_ref(config, scheme)
    tokens = torch.randint(0, config.vocab_size, (2, 120), generator=torch.Generator().manual_seed(3))
    want = ref.forward(tokens)  # [2, 120, V]
    assert rel(eng.forward(tokens), want) < 2e-2, "prefill"
    steps, _ = decode_steps(eng, tokens, 100, max_len=128)  # decode (the fused RoPE in attention) at 100..119
    assert rel(steps.transpose(0, 1), want[:, 100:]) < 2e-2, "decode"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_tokens_equal_reference(name):
    config = CONFIGS[name]
    eng, ref = engine_and_ref(config, "fp16")
    tok = Tokenizer.byte_fallback(config.vocab_size)
    cfg = GenerationConfig(max_new_tokens=32, sampling=SamplingConfig(temperature=0), stop_at_eos=False)
    prompt = [tok.encode("Llama-3's RoPE scaling, on the GPU engine and on the CPU reference alike. " * 2)]
    assert len(prompt[0]) > 64  # past the original context from the first step
    # equal, or parted where the reference's two best logits tie within NEAR_TIE (Mistral's token 28 here: 2.96893
    # and 2.96871 in fp32, both 2.96875 in the engine's fp16 logits)
    got, want = generate(eng, tok, prompt, cfg)[0][0].tokens, generate(ref, tok, prompt, cfg)[0][0].tokens
    assert_same_greedy(ref, prompt[0], got, want)


def test_the_engine_rope_table_carries_the_scaling():
    from kernels_cu.rope_kv import rope_table

    config = CONFIGS["llama3.1-d64"]
    eng, _ = engine_and_ref(config, "fp16")
    plain = rope_table(config.head_dim, config.rope_theta, config.max_positions + 1, "cuda")
    assert torch.equal(eng.cos_sin, rope_table(config.head_dim, config.rope_theta, config.max_positions + 1, "cuda",
                                               config.rope_scaling))
    assert not torch.equal(eng.cos_sin, plain)


def test_dynamic_ntk_runs_within_the_original_context_and_is_refused_beyond():
    config = LlamaConfig(512, 2, 8, 2, 1024, 1000, max_positions=256,
                         rope_scaling=RopeScaling(RopeType.DYNAMIC, 2.0, 128), name="dyn")
    eng, ref = engine_and_ref(config, "fp16")
    tokens = torch.randint(0, config.vocab_size, (1, 100), generator=torch.Generator().manual_seed(4))
    assert rel(eng.forward(tokens), ref.forward(tokens)) < 2e-2
    with pytest.raises(PromptError, match="dynamic NTK"):
        eng.new_cache(1, 200)


@pytest.fixture(scope="module")
def gptq_dirs(tmp_path_factory):
    from tests.test_gptq import write_gptq_dir

    config = LlamaConfig(512, 2, 8, 2, 1024, 1000, rope_theta=5e5, max_positions=1024, rope_scaling=LLAMA31,
                         name="gptq")
    out = {}
    for key, kw in {"g128-sym-v1": dict(G=128, sym=True), "g64-asym-v2": dict(G=64, sym=False, v2=True),
                    "g32-sym-v1": dict(G=32, sym=True), "act-order": dict(G=128, sym=True, act_order=True)}.items():
        d = tmp_path_factory.mktemp(key)
        write_gptq_dir(d, config=config, **kw)
        out[key] = d
    return out


@pytest.mark.parametrize("key", ["g128-sym-v1", "g64-asym-v2", "g32-sym-v1"])
def test_gptq_checkpoint_runs_on_the_int4_kernels(gptq_dirs, key):
    from kernels_cu.engine import Engine, EngineConfig
    from kernels_cu.engine.linears import AwqOp

    loaded = load_model(gptq_dirs[key], dtype=torch.float16)
    eng = Engine.from_loaded(loaded, EngineConfig(max_len=256))
    assert eng.scheme == "awq" and isinstance(eng.layers[0].qkv, AwqOp)
    ref = ReferenceModel(build_weights(loaded, torch.float32))
    tokens = torch.randint(0, 1000, (2, 90), generator=torch.Generator().manual_seed(5))
    want = ref.forward(tokens)
    assert rel(eng.forward(tokens), want) < 2e-2
    steps, _ = decode_steps(eng, tokens, 80, max_len=96)
    assert rel(steps.transpose(0, 1), want[:, 80:]) < 2e-2
    tok = Tokenizer.byte_fallback(1000)
    cfg = GenerationConfig(max_new_tokens=24, sampling=SamplingConfig(temperature=0), stop_at_eos=False)
    prompt = [tok.encode("GPTQ on the AWQ kernels")]
    assert generate(eng, tok, prompt, cfg)[0][0].tokens == generate(ref, tok, prompt, cfg)[0][0].tokens


def test_act_order_gptq_is_refused_by_the_engine_in_one_line(gptq_dirs):
    from kernels_cu.engine import Engine

    with pytest.raises(DeviceError, match="act-order GPTQ"):
        Engine.from_loaded(load_model(gptq_dirs["act-order"], dtype=torch.float16))


@pytest.mark.parametrize("tied,lm_head_int8", [(True, False), (False, False), (True, True)])
def test_llama3_vocabulary_head_and_greedy_sampler(tied, lm_head_int8):
    """V = 128,256: the embedding, the lm_head GEMV (fp16 or int8 codes) and the GPU sampler against the reference."""
    import dataclasses

    from kernels_cu.engine import Engine, EngineConfig
    from model_zoo.quant.checkpoint import int8_round_trip

    config = LlamaConfig(256, 1, 4, 1, 512, 128256, rope_theta=5e5, max_positions=512, tie_embeddings=tied,
                         rope_scaling=LLAMA31, name="v128k")
    w = checkpoint(config, "fp16")
    eng = Engine(w, EngineConfig(max_len=128, lm_head_int8=lm_head_int8))
    rw = w.to("cpu", torch.float32)
    ref = ReferenceModel(dataclasses.replace(rw, lm_head=int8_round_trip(rw.lm_head)) if lm_head_int8 else rw)
    tokens = torch.randint(0, 128256, (3, 40), generator=torch.Generator().manual_seed(6))
    tokens[0, :3] = torch.tensor([128000, 128255, 0])  # the first and last rows of the table
    want = ref.forward(tokens)  # [3, 40, 128256]
    assert rel(eng.forward(tokens), want) < 2e-2
    steps, _ = decode_steps(eng, tokens, 32)
    assert rel(steps.transpose(0, 1), want[:, 32:]) < 2e-2
    tok = Tokenizer.byte_fallback(128256)
    cfg = GenerationConfig(max_new_tokens=16, sampling=SamplingConfig(temperature=0), stop_at_eos=False)
    prompts = [tok.encode("a"), tok.encode("the 128k vocabulary")]
    for p, r in zip(prompts, generate(eng, tok, prompts, cfg)[0]):
        assert_greedy_under_reference(ref, p, r.tokens)


def assert_greedy_under_reference(ref, prompt: list[int], got: list[int], tol: float = 0.05) -> None:
    """Each token the engine chose greedily is the reference's argmax given the same prefix, or within `tol`
    standard deviations of the logits below it: over 128k random-weight logits, near-ties that fp16 may order
    differently than fp32 occur, after which the sequences (rightly) part."""
    logits = ref.forward(torch.tensor([prompt + got]))[0, len(prompt) - 1:-1]  # [n, V]: what predicts each token
    chosen = logits.gather(1, torch.tensor(got)[:, None])[:, 0]
    gap = (logits.max(-1).values - chosen) / logits.std(-1)
    assert float(gap.max()) <= tol, gap.tolist()


@pytest.mark.parametrize("cfg", [SamplingConfig(temperature=0.8, top_k=40, top_p=0.95),
                                 SamplingConfig(temperature=1.0, top_k=0, top_p=0.9)])
def test_sampler_distribution_at_v_128256(cfg):
    from kernels_cu.sampling import GpuSampler, params_tensor, sampling_probs_ref
    from tests.gpu.conftest import randn
    from tests.gpu.test_sampling import chi_square_ok, draws

    V, B = 128256, 64
    row = randn(1, V, scale=1.0, seed=11).float()
    likely = torch.randperm(V, generator=torch.Generator().manual_seed(12))[:200]
    row[0, likely.cuda()] += 12.0  # 200 likely tokens across the vocabulary hold 99% of the mass: the nucleus
    row[0, V - 1] += 12.0  # (top_p alone searches the 1,024 largest logits, kernels_cu/sampling.py) and the last id
    s = GpuSampler(B, V, [V + 1], seed=99, config=cfg)
    tokens = draws(s, row.repeat(B, 1), 100)
    probs = sampling_probs_ref(row, params_tensor(cfg, 1).cuda(), torch.zeros(1, V, dtype=torch.uint8,
                                                                              device="cuda"))[0]
    assert bool((probs > 0)[tokens.view(-1)].all()), "sampled a token outside the top-k / nucleus"
    ok, msg = chi_square_ok(tokens, probs)
    assert ok, msg


def test_max_context_that_does_not_fit_says_what_fits():
    """A KV cache of 128 KiB per position (32 layers x 8 KV heads x 128 x K and V in fp16, Llama-3-8B's): 2M
    positions would take 250 GiB; the engine refuses at load and names how many positions fit."""
    from kernels_cu.engine import Engine, EngineConfig

    config = LlamaConfig(1024, 32, 8, 8, 256, 1000, head_dim=128, max_positions=2_000_000, name="long")
    w = checkpoint(config, "fp16")
    with pytest.raises(DeviceError, match=r"at most [\d,]+ positions fit"):
        Engine(w, EngineConfig(max_len=2_000_000))
    eng = Engine(w, EngineConfig(max_len=65536))  # 8 GiB: fits, and a batch of 4 short rows still works
    assert eng.new_cache(4, 100).capacity >= 100
