"""sampling.cu: greedy exact, distributions against model_zoo's rules, flags, RNG state, graph capture."""

import pytest
import torch

from tests.gpu.conftest import GPU_STACK, SKIP_REASON, assert_equal, randn

if not GPU_STACK:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from kernels_cu import build, tuning  # noqa: E402
from kernels_cu.sampling import GpuSampler, StepState, params_tensor, sampling_probs_ref  # noqa: E402
from model_zoo.sampling import SamplingConfig  # noqa: E402

pytestmark = pytest.mark.gpu
EOS = [2]


def draws(sampler: GpuSampler, logits: torch.Tensor, n_calls: int) -> torch.Tensor:
    out = []
    for _ in range(n_calls):
        sampler.seen.zero_()  # keep the distribution fixed (no penalty in these configs anyway)
        out.append(sampler.sample(logits).clone())
    return torch.stack(out).long().cpu()  # [n_calls, B]


def chi_square_ok(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[bool, str]:
    """Pearson chi-square of token counts against probs (bins with expected >= 5; the rest pooled)."""
    n = tokens.numel()
    counts = torch.bincount(tokens.view(-1), minlength=probs.numel()).double()
    expected = probs.double().cpu() * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    bound = dof + 6 * (2 * dof) ** 0.5 + 10  # far in the tail: a correct sampler fails ~never
    return stat < bound, f"chi2={stat:.1f} dof={dof} bound={bound:.1f}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("B,V", [(1, 32000), (7, 49152), (64, 1000), (33, 128256), (3, 1001)])
def test_greedy_is_argmax(B, V, dtype):
    logits = randn(B, V, scale=4.0, seed=V + B, dtype=dtype)
    s = GpuSampler(B, V, EOS, config=SamplingConfig(temperature=0.0))
    out = s.sample(logits)
    assert_equal(out.long(), logits.float().argmax(-1), "greedy")
    assert bool(s.seen[torch.arange(B), out.long()].all())


def test_greedy_takes_the_lowest_index_on_ties():
    logits = torch.zeros(3, 5000, dtype=torch.float16, device="cuda") - 1
    logits[0, [4000, 17, 2500]] = 3.0
    logits[1, [4999, 4998]] = 7.0
    logits[2, [0, 1023, 1024]] = 1.0
    out = GpuSampler(3, 5000, EOS, config=SamplingConfig(temperature=0.0)).sample(logits)
    assert out.tolist() == [17, 4998, 0]


def test_top_k_one_is_greedy():
    logits = randn(16, 32000, scale=2.0, seed=1, dtype=torch.float32)
    s = GpuSampler(16, 32000, EOS, config=SamplingConfig(temperature=0.8, top_k=1, top_p=0.9))
    assert_equal(s.sample(logits).long(), logits.argmax(-1), "top_k=1")


def test_repetition_penalty_changes_the_argmax():
    V = 1024
    logits = torch.full((2, V), -5.0, device="cuda")
    logits[0, :2] = torch.tensor([2.0, 1.9])  # seen token 0: 2.0 / 1.2 = 1.67 < 1.9
    logits[1, :2] = torch.tensor([-0.5, -0.55])  # seen token 0: -0.5 * 1.2 = -0.6 < -0.55
    s = GpuSampler(2, V, EOS, config=SamplingConfig(temperature=0.0, repetition_penalty=1.2))
    assert s.sample(logits).tolist() == [0, 0]  # without history the penalty changes nothing
    s.seen.zero_()
    s.observe(0, [0])
    s.observe(1, [0])
    want = sampling_probs_ref(logits, s.params, s.seen.clone()).argmax(-1).tolist()
    assert s.sample(logits).tolist() == want == [1, 1]


@pytest.mark.parametrize("V,cfg", [
    (16, SamplingConfig(temperature=1.0, top_k=0, top_p=1.0)),
    (5000, SamplingConfig(temperature=0.7, top_k=0, top_p=1.0)),
    (16, SamplingConfig(temperature=1.3, top_k=5, top_p=1.0)),
    (5000, SamplingConfig(temperature=1.0, top_k=20, top_p=1.0)),
    (5000, SamplingConfig(temperature=1.0, top_k=0, top_p=0.8)),
    (5000, SamplingConfig(temperature=0.9, top_k=50, top_p=0.7)),
    (1001, SamplingConfig(temperature=0.9, top_k=50, top_p=0.7)),  # V % 8 != 0: one load per token
])
def test_distribution_matches_model_zoo(V, cfg):
    B, calls = 64, 150
    row = randn(1, V, scale=2.0, seed=V).float()
    row[0, :8] += 4.0  # a few likely tokens, as in real logits
    logits = row.repeat(B, 1)
    s = GpuSampler(B, V, [V + 1], seed=1234, config=cfg)  # an eos id that never occurs
    tokens = draws(s, logits, calls)
    probs = sampling_probs_ref(row, params_tensor(cfg, 1).cuda(), torch.zeros(1, V, dtype=torch.uint8, device="cuda"))[0]
    support = probs > 0
    assert bool(support[tokens.view(-1)].all()), "sampled a token outside the top-k / nucleus"
    ok, msg = chi_square_ok(tokens, probs)
    assert ok, msg


def test_ties_at_the_kth_value_are_all_candidates():
    V = 300
    row = torch.full((1, V), -4.0, dtype=torch.float16, device="cuda")
    row[0, [10, 20, 30]] = 2.0
    row[0, 100:110] = 1.0  # the 4th..13th largest are a tie: top_k=5 keeps all ten, as torch does
    cfg = SamplingConfig(temperature=1.0, top_k=5, top_p=1.0)
    s = GpuSampler(64, V, [V + 1], seed=7, config=cfg)
    tokens = draws(s, row.repeat(64, 1), 100)
    probs = sampling_probs_ref(row, params_tensor(cfg, 1).cuda(), torch.zeros(1, V, dtype=torch.uint8, device="cuda"))[0]
    assert int((probs > 0).sum()) == 13
    assert set(tokens.view(-1).tolist()) == set(torch.nonzero(probs > 0).view(-1).tolist())
    ok, msg = chi_square_ok(tokens, probs)
    assert ok, msg


@pytest.mark.parametrize("blocks", [0, 8])
@pytest.mark.parametrize("V", [32000, 128256])
@pytest.mark.parametrize("temperature,penalty", [(1.0, 1.0), (0.7, 1.0), (0.37, 1.3), (3.0, 1.3)])
def test_top_k_at_a_key_bin_edge_keeps_exactly_the_top_k(blocks, V, temperature, penalty):
    """The select skips tokens by bounds on the penalized logit (sample_select.cuh) and takes its first digit
    from the max pass: 32 values a few ulps either side of 4.0 (an edge of every digit's bins) after the penalty
    and the temperature, spread over the row's segments, still split exactly at the k-th: the draws cover the
    reference's top 16 (ties kept) and nothing else, on one block and on a cluster."""
    if blocks and not build.has_clusters(torch.cuda.current_device()):
        pytest.skip("thread-block clusters need sm_90")
    g = torch.Generator().manual_seed(V)
    t32 = torch.tensor(temperature, dtype=torch.float32)
    idx = torch.randperm(V, generator=g)[:32]
    seen_idx = idx[::2] if penalty != 1.0 else idx[:0]  # half of them seen: their logits / penalty land there too
    steps = torch.cat([torch.arange(1, 17), -torch.arange(1, 17)])[torch.randperm(32, generator=g)]
    row = torch.full((V,), -8.0)  # [V]
    for i, step in zip(idx.tolist(), steps.tolist()):
        edge = torch.tensor(4.0) * t32 * (torch.tensor(penalty) if i in set(seen_idx.tolist()) else 1.0)
        row[i] = (edge.view(torch.int32) + step).view(torch.float32)
    B, calls = 64, 60
    logits = row.cuda().repeat(B, 1)  # [B, V] fp32
    mask = torch.zeros(B, V, dtype=torch.uint8, device="cuda")  # [B, V]
    mask[:, seen_idx.cuda()] = 1
    cfg = SamplingConfig(temperature=temperature, top_k=16, top_p=1.0, repetition_penalty=penalty)
    s = GpuSampler(B, V, [V + 1], seed=5, config=cfg)
    out = []
    with tuning.override(sample_cluster_blocks=blocks, sample_cluster_min_vocab=0):
        for _ in range(calls):
            s.seen.copy_(mask)  # the penalty's state fixed (the kernel marks what it samples)
            out.append(s.sample(logits).clone())
    tokens = torch.stack(out).long().cpu()  # [calls, B]
    probs = sampling_probs_ref(logits[:1], params_tensor(cfg, 1).cuda(), mask[:1])[0]
    support = set(torch.nonzero(probs > 0).view(-1).tolist())
    assert len(support) >= 16 and support <= set(idx.tolist())
    assert set(tokens.view(-1).tolist()) == support


def test_step_state_feeds_the_next_step():
    """With a StepState the sampler writes the next step's ids and advances the active rows' lengths, finished
    rows included (they feed eos_ids[0]); an inactive row draws nothing and writes nothing."""
    V = 1000
    logits = randn(3, V, seed=4, dtype=torch.float16)
    logits[:, 2] = -60.0
    logits[1, 7] = 60.0  # row 1 samples eos 7 on the first call
    s = GpuSampler(3, V, [2, 7], config=SamplingConfig(temperature=0.0))
    step = StepState(torch.full((3,), -1, dtype=torch.int32, device="cuda"),
                     torch.tensor([10, 20, 30], dtype=torch.int32, device="cuda"),
                     torch.tensor([1, 1, 0], dtype=torch.int32, device="cuda"))
    first = s.sample(logits, step).tolist()
    assert step.next_ids.tolist() == first[:2] + [-1] and first[1] == 7
    assert step.lengths.tolist() == [11, 21, 30]
    assert s.rng[:, 1].tolist() == [1, 1, 0] and int(s.seen[2].sum()) == 0  # row 2 is idle
    second = s.sample(logits, step).tolist()
    assert second[1] == 2 and step.next_ids.tolist() == second[:2] + [-1]  # finished: eos_ids[0]
    assert step.lengths.tolist() == [12, 22, 30]


def test_finished_rows_stay_finished_and_output_eos():
    V = 1000
    logits = randn(3, V, seed=2, dtype=torch.float32)
    logits[:, [2, 7]] = -50.0
    logits[1, 7] = 50.0  # row 1 greedily picks 7, an eos id; rows 0 and 2 pick neither eos id
    s = GpuSampler(3, V, [2, 7], config=SamplingConfig(temperature=0.0))
    first = s.sample(logits).tolist()
    assert first[1] == 7 and s.finished.tolist() == [0, 1, 0]
    rng_before = s.rng.clone()
    seen_before = s.seen.clone()
    second = s.sample(logits).tolist()
    assert second[1] == 2  # finished: eos_ids[0]
    assert second[0] == first[0] and second[2] == first[2]
    assert s.finished.tolist() == [0, 1, 0]
    assert int(s.rng[1, 1]) == int(rng_before[1, 1]) and torch.equal(s.seen[1], seen_before[1])


def test_every_eos_id_finishes_a_row():
    """Six eos ids: the first four are read before the kernel's PDL wait, the rest after it; a row that samples
    any of them finishes, and a finished row feeds eos_ids[0]."""
    V, eos = 1000, [2, 3, 4, 5, 6, 7]
    logits = randn(3, V, seed=5, dtype=torch.float16)
    logits[:, eos] = -60.0
    logits[0, 7] = 60.0  # the sixth id
    logits[1, 3] = 60.0  # the second
    s = GpuSampler(3, V, eos, config=SamplingConfig(temperature=0.0))
    first = s.sample(logits).tolist()
    assert first[:2] == [7, 3] and first[2] not in eos
    assert s.finished.tolist() == [1, 1, 0]
    assert s.sample(logits).tolist()[:2] == [2, 2]


def test_rng_advances_and_reseeding_repeats():
    V, B = 1000, 64
    logits = randn(1, V, scale=0.5, seed=3, dtype=torch.float32).repeat(B, 1)
    s = GpuSampler(B, V, [V + 1], seed=99, config=SamplingConfig(temperature=1.0, top_k=0, top_p=1.0))
    a, b = s.sample(logits).clone(), s.sample(logits).clone()
    assert not torch.equal(a, b), "two calls drew the same tokens in every row"
    assert len(set(a.tolist())) > 10, "rows share one random stream"
    assert s.rng[:, 1].tolist() == [2] * B
    s.reset(99)
    assert_equal(s.sample(logits), a, "same seed, same first draw")


def test_sampling_replays_in_a_cuda_graph_with_fresh_draws():
    V, B = 2000, 16
    logits = randn(B, V, scale=0.5, seed=4, dtype=torch.float16)
    s = GpuSampler(B, V, [V + 1], seed=5, config=SamplingConfig(temperature=1.0, top_k=50, top_p=0.95))
    s.sample(logits)  # compile and warm up outside the capture
    s.reset(5)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=build.torch_stream()):
        s.sample(logits)
    s.reset(5)
    seen = []
    for _ in range(3):
        g.replay()
        seen.append(s.out.clone())
    build.synchronize()
    assert s.rng[:, 1].tolist() == [3] * B
    assert not (torch.equal(seen[0], seen[1]) and torch.equal(seen[1], seen[2]))
    s.reset(5)
    s.set_config(SamplingConfig(temperature=0.0))  # new values, same buffer: the graph turns greedy
    g.replay()
    assert_equal(s.out.long(), logits.float().argmax(-1), "graph replay after set_config")
