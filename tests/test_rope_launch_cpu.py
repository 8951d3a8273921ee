"""rope_kv's launch geometry (rope_launch) and its tuning knob, on CPU."""

import pytest

from kernels_cu.rope_kv import THREADS, rope_launch
from kernels_cu.tuning import Tuning


def test_prefill_takes_the_tunings_heads_per_thread():
    # LLaMA-2-7B, 2,048 tokens: 96 heads in 24 head blocks of 4, 8 chunk pairs each
    assert rope_launch(2048, 96, 128, 4, 132) == (4, 2048 * 24 * 8 // THREADS)
    assert rope_launch(2048, 96, 128, 1, 132) == (1, 2048 * 96 * 8 // THREADS)


def test_small_grids_spread_over_the_sms_first():
    assert rope_launch(1, 96, 128, 4, 132) == (1, 3)  # one token: 768 threads over 3 SMs
    assert rope_launch(16, 96, 128, 4, 132) == (1, 48)
    # Llama-3.2-1B-like, 512 tokens: 96 blocks at 4 heads, 128 at 3, 192 at 2
    assert rope_launch(512, 48, 64, 4, 132) == (2, 192)
    assert rope_launch(512, 48, 64, 4, 64) == (4, 96)


def test_too_many_tokens_for_one_launch_is_refused():
    with pytest.raises(ValueError, match="too many"):
        rope_launch(2 ** 24, 96, 128, 4, 132)  # 3.2e9 threads


@pytest.mark.parametrize("bad", [0, 5])
def test_heads_per_thread_is_bounded(bad):
    with pytest.raises(ValueError, match="rope_heads_per_thread"):
        Tuning(rope_heads_per_thread=bad)
