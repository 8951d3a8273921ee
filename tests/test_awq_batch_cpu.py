"""awq_batch.py's launch plan (no GPU): K splits only where the 64-channel blocks leave SMs idle, as the
H200 sweep chose (docs/gpu.md), every split non-empty, and the shared memory the kernel's ring asks for."""

from kernels_cu import awq_batch
from kernels_cu.gemm_shapes import cdiv
from kernels_cu.tuning import DEFAULT

SMS = 132  # H100 / H200


def test_llama2_7b_shapes_at_32_tokens():
    # (N, tiles of 128 k) -> splits: q|k|v 2, o 4, gate|up 1, down 4
    want = {(12288, 32): 2, (4096, 32): 4, (22016, 32): 1, (4096, 86): 4}
    for (n, tiles), splits in want.items():
        lp = awq_batch.plan(32, n, tiles, 1, SMS)
        assert (lp.mt, lp.splits) == (4, splits), (n, tiles, lp)
        assert lp.grid(32, n) == (n // 64, splits, 1)


def test_splits_cover_every_tile_once():
    for tiles in range(1, 120):
        for forced in (None, 1, 2, 3, 4, 7, 200):
            lp = awq_batch.plan(40, 4096, tiles, 1, SMS, splits=forced)
            assert 1 <= lp.splits <= tiles
            assert (lp.splits - 1) * lp.tiles_per_split < tiles <= lp.splits * lp.tiles_per_split
            if forced is None:
                assert lp.splits == 1 or tiles // lp.splits >= DEFAULT.awq_batch_min_tiles_per_split - 1


def test_few_tiles_are_not_split():
    assert awq_batch.plan(16, 4096, 5, 1, SMS).splits == 1  # SmolLM2's K = 576: five tiles


def test_token_tiles_threads_and_ring_bytes():
    assert [awq_batch.plan(m, 4096, 32, 1, SMS).mt for m in (1, 8, 9, 16, 17, 32, 64)] == [1, 1, 2, 2, 4, 4, 4]
    assert cdiv(64, 8 * 4) == awq_batch.plan(64, 4096, 32, 1, SMS).grid(64, 4096)[2] == 2
    assert [awq_batch.threads(mt) for mt in (1, 2, 4)] == [128, 256, 256]
    # 32 token rows x 256 B + 4 KB of weights + 4 panels' terms, four slots
    assert awq_batch.plan(32, 4096, 32, 1, SMS).smem == 4 * (8192 + 4096 + 256)
    assert awq_batch.stage_bytes(4, 4) == 8192 + 4096 + 1024
    assert not awq_batch.takes(4096 + 16) and awq_batch.takes(22016)
