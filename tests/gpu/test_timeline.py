"""profile_engine.decode_timeline on the GPU: CUPTI sees every kernel of a replayed decode graph (PyCUDA's,
launched with programmatic dependencies), and the critical path it adds up is the step the events time."""

from __future__ import annotations

import dataclasses
import statistics

import pytest
import torch

from kernels_cu.bench import random_weights
from kernels_cu.engine import Engine, EngineConfig
from kernels_cu.lab.profile_engine import decode_timeline
from model_zoo.config import LlamaConfig
from model_zoo.sampling import SamplingConfig

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("scheme", ["fp16", "int8"])
def test_decode_timeline_is_the_step(cuda, scheme):
    config = LlamaConfig.from_name("smollm2-135m")
    engine = Engine(random_weights(config, scheme, cuda), EngineConfig(max_len=128))
    cache = engine.new_cache(1, 128)
    cache.lengths.fill_(40)
    engine.decode_sampled(torch.zeros(1, dtype=torch.long), cache, [0], engine.make_sampler(SamplingConfig(), 1))
    engine.replay_steps(cache, 5)  # warm
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        engine.replay_steps(cache, 4)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / 4)
    t = decode_timeline(engine, cache, 8)
    assert t.steps == 6
    attention = [c for c in t.costs if c.name.startswith("attn_fused")]
    assert len(attention) == 1 and attention[0].per_step == config.n_layers  # one launch a layer, every step
    assert sum(c.per_step_us for c in t.costs) == pytest.approx(t.step_mean_us, rel=1e-6)
    # the profiler adds a little per kernel; a missed kernel or step would show as far less
    assert 0.8 * statistics.median(times) < t.step_us < 1.5 * statistics.median(times), (t.step_us, times)


def test_o_proj_starts_under_attention(cuda):
    """At a context that leaves a split of each attention cluster idle (LLaMA-2-7B heads, 33 tiles of 16 positions
    over 10 splits: 9 active), the idle blocks trigger the next kernel too. Before they did, they waited in the
    cluster's barriers untriggered and o_proj could start only after attention ended (H200, batch 1: fp16 +1.1%,
    int8 +0.65%, awq +0.6% with the trigger)."""
    config = dataclasses.replace(LlamaConfig.from_name("llama2-7b"), n_layers=2, vocab_size=4096)
    engine = Engine(random_weights(config, "fp16", cuda), EngineConfig(max_len=640))
    cache = engine.new_cache(1, 640)
    cache.lengths.fill_(519)  # the step's new token makes 520 positions: 33 tiles
    engine.decode_sampled(torch.zeros(1, dtype=torch.long), cache, [0], engine.make_sampler(SamplingConfig(), 1))
    engine.replay_steps(cache, 3)
    t = decode_timeline(engine, cache, 6)  # lengths 523 -> 529: still 9 active splits (33-36 tiles)
    names = [name for name, _, _ in t.sequence]
    after = [t.sequence[i + 1] for i, name in enumerate(names[:-1]) if name.startswith("attn_fused_d128_cl")]
    assert len(after) == config.n_layers, names
    # (name, start, end) from attention's end. H200: o_proj starts 3.4-4.2 us before it with the trigger, 0.03 us
    # before to 0.4 us after without
    assert all(start < -1.0 for _, start, _ in after), after
