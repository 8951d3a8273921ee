"""profile_engine.decode_timeline on the GPU: CUPTI sees every kernel of a replayed decode graph (PyCUDA's,
launched with programmatic dependencies), and the critical path it adds up is the step the events time."""

from __future__ import annotations

import statistics

import pytest
import torch

from kernels_cu.bench import random_weights
from kernels_cu.engine import Engine, EngineConfig
from kernels_cu.profile_engine import decode_timeline
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
