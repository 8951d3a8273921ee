"""The reference model against transformers' LlamaForCausalLM, and its KV cache against a full forward."""

import pytest
import torch

from model_zoo.config import LlamaConfig
from model_zoo.reference import ReferenceModel
from model_zoo.weights import ModelWeights, random_state_dict

transformers = pytest.importorskip("transformers")

TINY = {
    "mha": LlamaConfig(64, 2, 4, 4, 128, 97, rope_theta=10000.0, norm_eps=1e-6, max_positions=128, tie_embeddings=False),
    "gqa": LlamaConfig(96, 3, 6, 2, 160, 131, rope_theta=500000.0, norm_eps=1e-5, max_positions=128),
    "tied": LlamaConfig(48, 2, 3, 1, 96, 89, rope_theta=100000.0, max_positions=128, tie_embeddings=True),
    "head_dim": LlamaConfig(64, 2, 2, 1, 64, 61, head_dim=48, rope_theta=20000.0, max_positions=128),
}


def hf_model(config: LlamaConfig, sd: dict) -> "transformers.LlamaForCausalLM":
    hf_cfg = transformers.LlamaConfig(**{k: v for k, v in config.to_hf().items() if k not in ("architectures", "model_type", "torch_dtype")})
    hf_cfg._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(hf_cfg).eval()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing)
    return model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("name", list(TINY))
def test_logits_match_transformers(name):
    config = TINY[name]
    sd = random_state_dict(config, seed=hash(name) % 1000)
    ref = ReferenceModel(ModelWeights.from_state_dict(config, sd))
    model = hf_model(config, sd)
    tokens = torch.randint(0, config.vocab_size, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(tokens).logits
    got = ref.forward(tokens)
    assert rel_err(got, want) < 1e-4
    # element-wise, not only in norm
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_kv_cache_decode_equals_full_forward():
    config = TINY["gqa"]
    ref = ReferenceModel(ModelWeights.from_state_dict(config, random_state_dict(config, seed=3)))
    tokens = torch.randint(0, config.vocab_size, (3, 20), generator=torch.Generator().manual_seed(2))
    full = ref.forward(tokens)
    cache = ref.new_cache(3, 32)
    prefill = ref.forward(tokens[:, :12], cache)
    steps = [ref.forward(tokens[:, i:i + 1], cache)[:, 0] for i in range(12, 20)]
    incremental = torch.cat([prefill, torch.stack(steps, 1)], 1)
    assert rel_err(incremental, full) < 1e-5


def test_ragged_rows_continue_at_their_own_positions():
    config = TINY["tied"]
    ref = ReferenceModel(ModelWeights.from_state_dict(config, random_state_dict(config, seed=4)))
    a = torch.randint(0, config.vocab_size, (1, 9))
    b = torch.randint(0, config.vocab_size, (1, 4))
    cache = ref.new_cache(2, 16)
    ref.forward(a[:, :-1], cache, rows=torch.tensor([0]))
    ref.forward(b[:, :-1], cache, rows=torch.tensor([1]))
    step = ref.forward(torch.stack([a[0, -1:], b[0, -1:]]), cache)  # both rows at different positions
    assert rel_err(step[0, 0], ref.forward(a)[0, -1]) < 1e-5
    assert rel_err(step[1, 0], ref.forward(b)[0, -1]) < 1e-5
    assert cache.lengths.tolist() == [9, 4]
