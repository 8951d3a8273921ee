"""sampling.cu's cluster path (the `_cl` entries, sm_90): a row's max/argmax pass, and for top-k / top-p its radix
select and candidate gather, over P blocks of one thread-block cluster give the one-block kernel's tokens and state
bit for bit, for every config, vocabulary, batch and edge case (ties across slices and past CAND_CAP, -inf and NaN
logits, chosen rows, finished and idle rows, a captured decode step)."""

from dataclasses import replace

import pytest
import torch

from tests.gpu.conftest import GPU_STACK, SKIP_REASON, assert_equal, randn

if not GPU_STACK:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from kernels_cu import build, tuning  # noqa: E402
from kernels_cu.sampling import SIGNATURE, GpuSampler, StepState, launch_blocks  # noqa: E402
from model_zoo.sampling import SamplingConfig  # noqa: E402

pytestmark = pytest.mark.gpu
CONFIGS = {
    "greedy": SamplingConfig(temperature=0.0),
    "temperature": SamplingConfig(temperature=0.9, top_k=0, top_p=1.0),
    "top_k": SamplingConfig(temperature=0.8, top_k=50, top_p=1.0),
    "top_p": SamplingConfig(temperature=1.0, top_k=0, top_p=0.9),
    "penalty": SamplingConfig(temperature=0.7, top_k=40, top_p=0.8, repetition_penalty=1.3),
}


@pytest.fixture(autouse=True)
def clusters(cuda):
    if not build.has_clusters(torch.cuda.current_device()):
        pytest.skip("thread-block clusters need sm_90")


def cluster_launches(dtype: torch.dtype) -> int:
    name = "sample_f16_cl" if dtype == torch.float16 else "sample_f32_cl"
    return build.get_function("sampling.cu", name, SIGNATURE).cluster_launches


def run(blocks: int, logits: torch.Tensor, cfg: SamplingConfig, calls: int = 3, batch: int | None = None,
        rows: torch.Tensor | None = None, prepare=None) -> tuple[list[torch.Tensor], int]:
    """Sample `calls` times with sample_cluster_blocks = blocks (every vocabulary) -> ([tokens of each call, seen,
    finished, rng], cluster launches)."""
    n, V = logits.shape
    s = GpuSampler(batch or n, V, [V + 1], seed=11, config=cfg)  # an eos id that never occurs
    if prepare is not None:
        prepare(s)
    before = cluster_launches(logits.dtype)
    with tuning.override(sample_cluster_blocks=blocks, sample_cluster_min_vocab=0):
        outs = [s.sample(logits, rows=rows).clone() for _ in range(calls)]
    build.synchronize()
    return outs + [s.seen.clone(), s.finished.clone(), s.rng.clone()], cluster_launches(logits.dtype) - before


def assert_same(one: list[torch.Tensor], cl: list[torch.Tensor], what: str) -> None:
    names = [f"tokens of call {i}" for i in range(len(one) - 3)] + ["seen", "finished", "rng"]
    for name, a, b in zip(names, one, cl):
        assert_equal(b, a, f"{what}: {name}")


def compare(logits: torch.Tensor, cfg: SamplingConfig, blocks: int = 8, **kw) -> list[torch.Tensor]:
    """The cluster launch against the one-block launch; -> the one-block results."""
    one, n_one = run(0, logits, cfg, **kw)
    cl, n_cl = run(blocks, logits, cfg, **kw)
    assert n_one == 0 and n_cl == len(one) - 3, f"cluster launches: {n_one} with the knob off, {n_cl} with it on"
    assert_same(one, cl, f"P={blocks}")
    return one


def observe_leaders(s: GpuSampler, logits: torch.Tensor) -> None:
    """Mark each row's 20 largest logits as seen, so the repetition penalty changes what wins."""
    for r in range(s.batch):
        s.observe(r, logits[r % logits.shape[0]].float().topk(20).indices.tolist())


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("V", [128256, 49152, 32000, 32003])
@pytest.mark.parametrize("B", [1, 3, 8])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_cluster_equals_one_block(name, B, V, dtype):
    logits = randn(B, V, scale=4.0, seed=V + 7 * B, dtype=dtype)  # fp16 at scale 4: ties among the largest
    cfg = CONFIGS[name]
    prepare = (lambda s: observe_leaders(s, logits)) if cfg.repetition_penalty != 1.0 else None
    one = compare(logits, cfg, prepare=prepare)
    if cfg.greedy:
        assert_equal(one[0].long(), logits.float().argmax(-1), "greedy")


def slice_tokens(V: int, P: int) -> int:
    """Tokens a block of a P-block cluster owns (whole 8-token chunks), as sampling.cu splits a row."""
    return -(-(-(-V // 8)) // P) * 8


@pytest.mark.parametrize("blocks", [2, 3, 8, 16])
def test_ties_across_slices_take_the_lowest_index(blocks):
    V = 128256
    with tuning.override(sample_cluster_blocks=blocks, sample_cluster_min_vocab=0):
        if launch_blocks(3, V, torch.float16, torch.cuda.current_device()) != blocks:
            pytest.skip(f"three clusters of {blocks} blocks do not fit on this GPU at once")
    w = slice_tokens(V, blocks)
    logits = torch.full((3, V), -3.0, dtype=torch.float16, device="cuda")
    logits[0, [V - 1, (blocks - 1) * w + 10, w + 9, 2 * w - 1]] = 5.0  # the lowest in slice 1
    logits[1, [w, w - 1]] = 6.0  # either side of the first boundary
    logits[2] = -1.0
    logits[2, [w + 3, (blocks - 1) * w + 4]] = 0.0
    logits[2, w + 3] = -0.0  # -0.0 == +0.0: the lower index wins
    one = compare(logits, CONFIGS["greedy"], blocks=blocks, calls=1)
    assert one[0].tolist() == [w + 9, w - 1, w + 3] == logits.float().argmax(-1).tolist()


@pytest.mark.parametrize("name", ["greedy", "temperature"])
def test_inf_and_nan_rows(name):
    """A NaN is never chosen (the first non-NaN value starts each thread's search); a row of -inf picks token 0, a
    row of NaN falls back to token 0, as the one-block kernel does."""
    V = 128256
    w = slice_tokens(V, 8)
    logits = randn(4, V, seed=3, dtype=torch.float16)
    logits[0] = float("-inf")
    logits[1, [0, w, 2 * w, 7 * w]] = float("nan")  # the first token of several slices
    logits[1, 3 * w + 17] = 50.0
    logits[2] = float("nan")
    logits[3] = float("-inf")
    logits[3, [5, w + 1]] = float("nan")
    logits[3, V - 1] = -2.0
    one = compare(logits, CONFIGS[name])
    if name == "greedy":
        assert one[0].tolist() == [0, 3 * w + 17, 0, V - 1]


@pytest.mark.parametrize("name", ["greedy", "top_p", "penalty"])
def test_chosen_rows(name):
    """sample(rows=...): logits row i is state row rows[i] (the cluster's row is blockIdx.y); other rows untouched."""
    V, B = 128256, 8
    logits = randn(3, V, scale=3.0, seed=21, dtype=torch.float32)
    rows = torch.tensor([5, 0, 6], dtype=torch.int32, device="cuda")
    one = compare(logits, CONFIGS[name], batch=B, rows=rows)
    seen, rng = one[-3], one[-1]
    assert int(seen[[1, 2, 3, 4, 7]].sum()) == 0 and rng[[1, 2, 3, 4, 7], 1].tolist() == [0] * 5
    if name == "greedy":
        assert_equal(one[0].long(), logits.argmax(-1), "greedy of chosen rows")


def step_run(blocks: int, logits: torch.Tensor, replays: int = 4) -> list[torch.Tensor]:
    """A decode step's sampling captured in a CUDA graph (per-row configs, one finished row, one idle row),
    replayed: every replay's ids and the state after them."""
    B, V = logits.shape
    s = GpuSampler(B, V, [V + 1], seed=5)  # an eos id that never occurs
    for r, cfg in enumerate(CONFIGS.values()):
        s.configure_row(r, replace(cfg, seed=100 + r))
    s.finished[B - 1] = 1
    step = StepState(torch.full((B,), -1, dtype=torch.int32, device="cuda"),
                     torch.arange(10, 10 + B, dtype=torch.int32, device="cuda"),
                     torch.tensor([1] * (B - 2) + [0, 1], dtype=torch.int32, device="cuda"))
    with tuning.override(sample_cluster_blocks=blocks):
        s.sample(logits, step)  # compile outside the capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=build.torch_stream()):
            s.sample(logits, step)
    outs = []
    for _ in range(replays):
        g.replay()
        outs += [s.out.clone(), step.next_ids.clone()]
    build.synchronize()
    return outs + [step.lengths.clone(), s.seen.clone(), s.finished.clone(), s.rng.clone()]


@pytest.mark.parametrize("blocks", [3, 8, 16])
def test_captured_decode_step(blocks):
    V, B = 128256, 8
    logits = randn(B, V, scale=2.0, seed=8, dtype=torch.float16)
    before = cluster_launches(torch.float16)
    one = step_run(0, logits)
    assert cluster_launches(torch.float16) == before
    cl = step_run(blocks, logits)
    assert cluster_launches(torch.float16) == before + 2  # the eager call and the captured one
    for i, (a, b) in enumerate(zip(one, cl)):
        assert_equal(b, a, f"captured step, output {i}")
    lengths, rng = one[-4], one[-1]
    assert lengths.tolist() == [10 + r + 5 for r in range(B - 2)] + [16, 22]  # the idle row stays, finished advances
    assert rng[:, 1].tolist() == [5] * (B - 2) + [0, 0]
    assert one[-3][B - 2].sum() == 0  # the idle row marks nothing


def test_small_vocabularies_and_the_knob_off_keep_one_block():
    logits = randn(2, 16000, seed=1, dtype=torch.float16)
    big = randn(2, 128256, seed=2, dtype=torch.float16)
    s, sb = GpuSampler(2, 16000, [2]), GpuSampler(2, 128256, [2])
    before = cluster_launches(torch.float16)
    s.sample(logits)  # the defaults: 16,000 is below sample_cluster_min_vocab
    with tuning.override(sample_cluster_blocks=1):
        sb.sample(big)
    assert cluster_launches(torch.float16) == before
    sb.sample(big)  # the defaults at 128,256 tokens
    assert cluster_launches(torch.float16) == before + 1


SELECT = {  # the radix-select path: top-k, top-p alone, both, temperature, repetition penalty
    "top_k 1 (greedy)": SamplingConfig(temperature=0.8, top_k=1, top_p=1.0),
    "top_k 2": SamplingConfig(temperature=1.0, top_k=2, top_p=1.0),
    "top_k 40": SamplingConfig(temperature=0.7, top_k=40, top_p=1.0),
    "top_k 50": SamplingConfig(temperature=1.3, top_k=50, top_p=1.0),
    "top_k 1024": SamplingConfig(temperature=1.0, top_k=1024, top_p=1.0),
    "top_p 0.9": SamplingConfig(temperature=1.0, top_k=0, top_p=0.9),
    "top_p 0.5 t0.6": SamplingConfig(temperature=0.6, top_k=0, top_p=0.5),
    "default": SamplingConfig(temperature=0.7, top_k=40, top_p=0.95),
    "penalty": SamplingConfig(temperature=0.9, top_k=50, top_p=0.9, repetition_penalty=1.3),
}


def select_logits(B: int, V: int, seed: int, dtype=torch.float16) -> torch.Tensor:
    """Random logits [B, V] with a few likely tokens in every row, spread over the row (as real logits)."""
    logits = randn(B, V, scale=3.0, seed=seed, dtype=dtype)
    g = torch.Generator().manual_seed(seed + 1)
    logits[:, torch.randint(0, V, (12,), generator=g)] += 6.0
    return logits


@pytest.mark.parametrize("V", [128256, 49152, 32003])
@pytest.mark.parametrize("B", [1, 3, 8])
@pytest.mark.parametrize("name", list(SELECT))
def test_select_over_the_cluster_equals_one_block(name, B, V):
    logits = select_logits(B, V, seed=V + B)
    cfg = SELECT[name]
    prepare = (lambda s: observe_leaders(s, logits)) if cfg.repetition_penalty != 1.0 else None
    compare(logits, cfg, prepare=prepare)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("V", [128256, 32003])
@pytest.mark.parametrize("blocks", [2, 3, 16])
@pytest.mark.parametrize("name", ["top_k 50", "top_p 0.9", "default", "penalty"])
def test_select_for_every_cluster_size(name, blocks, V, dtype):
    logits = select_logits(3, V, seed=blocks + V, dtype=dtype)
    cfg = SELECT[name]
    prepare = (lambda s: observe_leaders(s, logits)) if cfg.repetition_penalty != 1.0 else None
    compare(logits, cfg, blocks=blocks, prepare=prepare)


@pytest.mark.parametrize("blocks", [2, 3, 8, 16])
def test_ties_at_the_kth_value_across_slices_and_past_the_candidate_cap(blocks):
    """Row 0: 600 tokens tie at the 50th value, spread over every slice: all are candidates (k = 1024: the 2048 - 606
    lowest-index ties at -3 join them). Row 1: the whole row ties: the 2,048 lowest indices are the candidates
    (CAND_CAP), whichever block holds them. Row 2: 40 tokens above 3,000 ties, past the cap. Row 3: fp16 runs of
    equal neighbours, every digit of the select resolved."""
    V = 128256
    logits = torch.full((4, V), -3.0, dtype=torch.float16, device="cuda")
    spread = torch.linspace(0, V - 1, 600).round().long().cuda()
    logits[0, spread] = 2.0
    logits[0, spread[::100] + 1] = 4.0
    logits[1] = 1.0
    logits[2, torch.linspace(0, V - 1, 3000).round().long().cuda()] = 0.5
    logits[2, torch.linspace(7, V - 8, 40).round().long().cuda()] = 1.5
    logits[3] = torch.linspace(-1.0, 1.0, V, device="cuda").half()  # fp16: runs of equal neighbours
    for cfg in (SELECT["top_k 50"], SELECT["top_p 0.9"], SELECT["top_k 1024"]):
        one = compare(logits, cfg, blocks=blocks)
        tokens = torch.stack(one[:3]).long()  # [calls, 4]
        if cfg.top_k == 50:
            assert set(tokens[:, 0].tolist()) <= set(spread.tolist()) | set((spread[::100] + 1).tolist())
        assert int(tokens[:, 1].max()) < 2048, "the lowest indices of a tie past CAND_CAP"


@pytest.mark.parametrize("name", ["top_k 50", "top_p 0.9", "penalty"])
def test_inf_and_nan_rows_in_the_select(name):
    V = 128256
    w = slice_tokens(V, 8)
    logits = randn(4, V, scale=2.0, seed=13, dtype=torch.float16)
    logits[0, ::3] = float("-inf")
    logits[1, [0, w, 2 * w, 7 * w, 5 * 8192 + 3]] = float("nan")
    logits[1, 3 * w + 17] = 50.0
    logits[2] = float("-inf")
    logits[2, [11, w + 5, V - 1]] = 1.0  # three finite values: fewer than k
    logits[3] = float("-inf")
    logits[3, [5, w + 1, V - 3]] = float("nan")
    logits[3, V - 1] = -2.0
    prepare = (lambda s: observe_leaders(s, logits.nan_to_num(0.0))) if name == "penalty" else None
    one = compare(logits, SELECT[name], prepare=prepare)
    tokens = torch.stack(one[:3])  # [calls, 4]
    assert set(tokens[:, 2].tolist()) <= {11, w + 5, V - 1} and tokens[:, 3].tolist() == [V - 1] * 3
