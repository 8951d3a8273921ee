"""The static-shape torch.compile baseline against the reference model (CPU, fp32), and its user errors.

Inductor on this 2-core CPU takes ~30 s cold, so the compile check traces with the aot_eager backend:
fullgraph=True fails on any graph break (.item(), int(tensor), branching on tensor values), and aot_eager
functionalizes the cache mutation the way inductor does.
"""

import time

import pytest
import torch

from kernels_cu.torch_baseline import StaticKVDecoder, time_baseline
from model_zoo.config import LlamaConfig
from model_zoo.errors import ConfigError, DeviceError
from model_zoo.reference import ReferenceModel
from model_zoo.weights import ModelWeights, random_state_dict

CONFIGS = {
    "mha": LlamaConfig(64, 2, 4, 4, 128, 97, norm_eps=1e-6, max_positions=128),
    "gqa": LlamaConfig(96, 3, 6, 2, 160, 131, rope_theta=500000.0, max_positions=128),
    "tied": LlamaConfig(48, 2, 3, 1, 96, 89, rope_theta=100000.0, max_positions=128, tie_embeddings=True),
    "head_dim": LlamaConfig(64, 2, 2, 1, 64, 61, head_dim=48, rope_theta=20000.0, max_positions=128),
}
BATCH, MAX_LEN = 2, 24


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def build(name: str, dtype: torch.dtype = torch.float32) -> tuple[ReferenceModel, StaticKVDecoder]:
    config = CONFIGS[name]
    weights = ModelWeights.from_state_dict(config, random_state_dict(config, seed=len(name)))
    weights = weights.to(dtype=dtype)
    return ReferenceModel(weights), StaticKVDecoder(weights, BATCH, MAX_LEN, dtype=dtype, device="cpu")


def prompt(config: LlamaConfig, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (BATCH, length), generator=torch.Generator().manual_seed(seed))


def run_both(ref: ReferenceModel, dec, chunks: list[torch.Tensor], decode_steps: int):
    """Feed the prompt chunks, then greedy decode; yields (reference logits, decoder logits) per call."""
    cache = ref.new_cache(BATCH, MAX_LEN)
    pos = 0
    with torch.no_grad():
        for chunk in chunks:
            S = chunk.shape[1]
            yield ref.forward(chunk, cache), dec(chunk, torch.arange(pos, pos + S))
            pos += S
        tok = chunks[-1][:, -1:]
        for _ in range(decode_steps):
            want = ref.forward(tok, cache)
            yield want, dec(tok, torch.tensor([pos]))
            tok, pos = want[:, -1].argmax(-1, keepdim=True), pos + 1  # [B, 1]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_then_decode_matches_reference(name):
    ref, dec = build(name)
    calls = list(run_both(ref, dec, [prompt(ref.config, 9)], decode_steps=5))
    assert len(calls) == 6
    for want, got in calls:
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert rel_err(got, want) < 1e-5


def test_chunked_prefill_at_an_offset_matches_reference():
    ref, dec = build("gqa")
    p = prompt(ref.config, 11, seed=3)
    for want, got in run_both(ref, dec, [p[:, :6], p[:, 6:]], decode_steps=3):
        assert rel_err(got, want) < 1e-5


def test_cache_holds_the_reference_keys_and_values():
    ref, dec = build("gqa")
    p = prompt(ref.config, 7, seed=4)
    cache = ref.new_cache(BATCH, MAX_LEN)
    with torch.no_grad():
        ref.forward(p, cache)
        dec(p, torch.arange(7))
    for i, block in enumerate(dec.layers):
        torch.testing.assert_close(block.k_cache[:, :, :7], cache.k[i][:, :, :7], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(block.v_cache[:, :, :7], cache.v[i][:, :, :7], rtol=1e-5, atol=1e-6)
        assert not block.k_cache[:, :, 7:].any()  # nothing written past the prompt


def test_fp16_decoder_tracks_fp16_reference():
    ref, dec = build("mha", torch.float16)
    assert dec.layers[0].wqkv.dtype == torch.float16 and dec.layers[0].k_cache.dtype == torch.float16
    for want, got in run_both(ref, dec, [prompt(ref.config, 8, seed=5)], decode_steps=3):
        assert rel_err(got, want) < 1e-2


def test_tied_embeddings_share_one_tensor():
    _, dec = build("tied")
    assert dec.lm_head is dec.embed
    _, untied = build("mha")
    assert untied.lm_head is not untied.embed


def test_reset_zeroes_the_cache_in_place_and_reruns_identically():
    ref, dec = build("gqa")
    p = prompt(ref.config, 8, seed=6)
    with torch.no_grad():
        first = dec(p, torch.arange(8))
        dec(p[:, -1:], torch.tensor([8]))
        ptrs = [b.k_cache.data_ptr() for b in dec.layers] + [b.v_cache.data_ptr() for b in dec.layers]
        assert all(b.k_cache.any() and b.v_cache.any() for b in dec.layers)
        dec.reset()
        assert not any(b.k_cache.any() or b.v_cache.any() for b in dec.layers)
        # compiled graphs point at these buffers: reset must not reallocate them
        assert [b.k_cache.data_ptr() for b in dec.layers] + [b.v_cache.data_ptr() for b in dec.layers] == ptrs
        again = dec(p, torch.arange(8))
    torch.testing.assert_close(again, first, rtol=0, atol=0)


def test_traces_as_one_graph_and_matches_eager():
    ref, dec = build("gqa")
    compiled = torch.compile(dec.forward, backend="aot_eager", fullgraph=True, dynamic=False)
    twin = StaticKVDecoder(ref.weights, BATCH, MAX_LEN, dtype=torch.float32, device="cpu")
    p = prompt(ref.config, 6, seed=7)
    with torch.no_grad():
        torch.testing.assert_close(compiled(p, torch.arange(6)), twin(p, torch.arange(6)), rtol=1e-5, atol=1e-5)
        tok = p[:, -1:]
        for pos in (6, 7):
            torch.testing.assert_close(compiled(tok, torch.tensor([pos])), twin(tok, torch.tensor([pos])),
                                       rtol=1e-5, atol=1e-5)
    for b, t in zip(dec.layers, twin.layers):  # the compiled graph really mutated the cache buffers
        torch.testing.assert_close(b.k_cache, t.k_cache, rtol=1e-5, atol=1e-6)
        assert b.k_cache[:, :, 7].any() and not b.k_cache[:, :, 8:].any()


def test_shape_errors_are_config_errors():
    ref, dec = build("mha")
    with pytest.raises(ConfigError, match="batch"):
        dec(torch.zeros(BATCH + 1, 1, dtype=torch.long), torch.tensor([0]))
    with pytest.raises(ConfigError, match="positions"):
        dec(torch.zeros(BATCH, MAX_LEN + 1, dtype=torch.long), torch.arange(MAX_LEN + 1))
    with pytest.raises(ConfigError, match="positive"):
        StaticKVDecoder(ref.weights, 0, MAX_LEN, device="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_time_baseline_without_cuda_raises_device_error(device):
    ref, _ = build("mha")
    with pytest.raises(DeviceError, match="CUDA"):
        time_baseline(ref.weights, 1, 8, 4, 1, device)


def test_time_baseline_checks_device_before_building_weights():
    def factory():
        raise AssertionError("weights must not be built without a usable device")

    with pytest.raises(DeviceError):
        time_baseline(factory, 1, 8, 4, 1, "cpu")


class FakeEvent:
    """Stands in for torch.cuda.Event on CPU: wall-clock stamps."""

    def __init__(self, enable_timing: bool = False):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, other: "FakeEvent") -> float:
        return (other.t - self.t) * 1e3


def test_timing_loop_feeds_greedy_tokens_at_consecutive_positions(monkeypatch):
    import kernels_cu.torch_baseline as tb

    ref, _ = build("tied")
    calls = {"prefill": [], "step": []}

    def eager(kind):
        def wrap(decoder):
            def run(tokens, input_pos):
                calls[kind].append((tokens.clone(), input_pos.clone()))
                return decoder(tokens, input_pos)
            return run
        return wrap

    monkeypatch.setattr(tb, "_cuda_device", lambda device: torch.device("cpu"))
    monkeypatch.setattr(tb, "compiled_prefill", eager("prefill"))
    monkeypatch.setattr(tb, "compiled_decode_step", eager("step"))
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    prompt_len, gen_len, repeat = 5, 4, 2
    r = time_baseline(lambda: ref.weights, BATCH, prompt_len, gen_len, repeat, "cuda")
    assert set(r) == {"prefill_s", "prefill_tok_s", "decode_ms_median", "decode_ms_p90", "decode_tok_s", "compile_s"}
    assert all(v > 0 for v in r.values()) and r["decode_ms_p90"] >= r["decode_ms_median"]
    assert r["decode_tok_s"] == pytest.approx(BATCH / (r["decode_ms_median"] / 1e3))
    assert len(calls["prefill"]) == repeat + 1  # warm-up + timed
    assert len(calls["step"]) == tb.WARMUP_STEPS + repeat * gen_len
    timed = calls["step"][-gen_len:]
    assert [int(pos) for _, pos in timed] == list(range(prompt_len, prompt_len + gen_len))
    # every step feeds the argmax of the previous logits: replay the prompt through the fp16 reference
    ref16 = ReferenceModel(ref.weights.to(dtype=torch.float16))
    cache = ref16.new_cache(BATCH, 16)
    with torch.no_grad():
        tok = ref16.forward(calls["prefill"][-1][0], cache)[:, -1].argmax(-1, keepdim=True)  # [B, 1]
        for fed, _ in timed:
            assert torch.equal(fed, tok)
            tok = ref16.forward(tok, cache)[:, -1].argmax(-1, keepdim=True)
