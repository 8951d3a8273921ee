"""sampling.cu per row: each row's own params and seed (configure_row), sampling chosen rows only, leading views;
a seeded row draws the same tokens in any slot, as in model_zoo's TorchSampler."""

import pytest
import torch

from tests.gpu.conftest import GPU_STACK, SKIP_REASON, assert_equal, randn

if not GPU_STACK:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from kernels_cu.sampling import GpuSampler  # noqa: E402
from model_zoo.sampling import SamplingConfig  # noqa: E402

pytestmark = pytest.mark.gpu
HOT = SamplingConfig(temperature=1.0, top_k=0, top_p=1.0, seed=42)


def slot_draws(slot: int, B: int, logits: torch.Tensor, steps: int) -> list[int]:
    """The tokens a row seeded 42 draws in `slot`, the other rows sampling with other seeds and settings."""
    s = GpuSampler(B, logits.shape[1], [-1], seed=7, config=SamplingConfig(temperature=0.9, top_k=20))
    for r in range(B):
        s.configure_row(r, SamplingConfig(temperature=0.7, top_p=0.9, seed=1000 + r))
    s.configure_row(slot, HOT)
    out = []
    for _ in range(steps):
        out.append(int(s.sample(logits)[slot]))  # the whole batch, as a decode graph samples it
    return out


def test_a_seeded_row_draws_the_same_tokens_in_any_slot():
    V, B = 3000, 8
    logits = randn(1, V, scale=0.5, seed=11, dtype=torch.float16).repeat(B, 1)  # every row sees the same logits
    ref = slot_draws(0, B, logits, 12)
    assert len(set(ref)) > 3, "a temperature-1 row drew nearly one token"
    for slot in (3, 7):
        assert slot_draws(slot, B, logits, 12) == ref, f"slot {slot}"


def test_sampling_chosen_rows_leaves_the_others_untouched():
    V, B = 2000, 6
    s = GpuSampler(B, V, [-1], seed=3, config=SamplingConfig(temperature=1.0, top_k=0, top_p=1.0))
    seen, rng = s.seen.clone(), s.rng.clone()
    logits = randn(2, V, seed=5, dtype=torch.float32)
    rows = torch.tensor([4, 1], dtype=torch.int32, device="cuda")
    out = s.sample(logits, rows=rows).long()
    assert out.shape == (2,)
    others = [0, 2, 3, 5]
    assert torch.equal(s.seen[others], seen[others]) and torch.equal(s.rng[others], rng[others])
    assert s.rng[[4, 1], 1].tolist() == [1, 1]
    assert bool(s.seen[4, out[0]]) and bool(s.seen[1, out[1]])


def test_chosen_rows_draw_what_the_whole_batch_draws():
    """A row's first token sampled alone (after a prefill) and its next ones in the batch follow one stream."""
    V, B = 2000, 4
    logits = randn(1, V, scale=0.5, seed=9, dtype=torch.float32).repeat(B, 1)
    a = GpuSampler(B, V, [-1], config=HOT)
    a.configure_row(2, HOT)
    alone = [int(a.sample(logits[2:3], rows=torch.tensor([2], dtype=torch.int32, device="cuda"))[0]) for _ in range(5)]
    b = GpuSampler(B, V, [-1], config=HOT)
    b.configure_row(2, HOT)
    batch = [int(b.sample(logits)[2]) for _ in range(5)]
    assert alone == batch


def test_configure_row_sets_params_and_clears_history():
    V, B = 1000, 3
    logits = randn(B, V, scale=3.0, seed=2, dtype=torch.float16)
    s = GpuSampler(B, V, [5], config=SamplingConfig(temperature=1.0, top_k=0, top_p=1.0))
    s.finished.fill_(1)
    s.seen.fill_(1)
    s.configure_row(1, SamplingConfig(temperature=0.0, repetition_penalty=1.3))
    assert s.params[1].tolist() == pytest.approx([0.0, 40.0, 0.95, 1.3])
    assert int(s.finished[1]) == 0 and int(s.seen[1].sum()) == 0 and int(s.rng[1, 1]) == 0
    assert int(s.finished[0]) == 1 and int(s.seen[0].sum()) == V  # other rows as they were
    out = s.sample(logits)
    assert int(out[1]) == int(logits[1].float().argmax())  # greedy: nothing seen, so no penalty yet


def test_leading_view_shares_the_buffers():
    V, B = 1000, 8
    s = GpuSampler(B, V, [-1], seed=1, config=SamplingConfig(temperature=0.0))
    view = s.leading(4)
    logits = randn(4, V, seed=8, dtype=torch.float16)
    out = view.sample(logits)
    assert_equal(out.long(), logits.float().argmax(-1), "greedy through the view")
    assert s.rng[:4, 1].tolist() == [1] * 4 and s.rng[4:, 1].tolist() == [0] * 4
    assert bool(s.seen[torch.arange(4), out.long()].all())
