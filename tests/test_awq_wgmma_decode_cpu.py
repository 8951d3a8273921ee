"""awq_wgmma_decode.py's launch plan (no GPU): the token tile by M, K splits where the 64-channel blocks alone leave
SMs idle (the H100 sweep's choices for LLaMA-2-7B at 32 tokens), every split non-empty, the ring's shared memory."""

from kernels_cu import awq_wgmma_decode as dec
from kernels_cu.tuning import DEFAULT

SMS = 132  # H100 / H200


def test_llama2_7b_shapes_at_32_tokens():
    # (N, tiles of 128 k) -> splits: q|k|v 2, o 4, gate|up 1, down 4
    want = {(12288, 32): 2, (4096, 32): 4, (22016, 32): 1, (4096, 86): 4}
    for (n, tiles), splits in want.items():
        lp = dec.plan(32, n, tiles, SMS)
        assert (lp.bt, lp.splits) == (32, splits), (n, tiles, lp)
        assert lp.grid(32, n) == (n // 64, splits, 1)


def test_token_tile_follows_m():
    assert [dec.plan(m, 4096, 32, SMS).bt for m in (17, 32, 33, 64)] == [32, 32, 64, 64]
    assert dec.plan(64, 4096, 32, SMS).grid(64, 4096)[2] == 1
    assert dec.plan(65, 4096, 32, SMS).grid(65, 4096)[2] == 2  # the kernel itself takes any M


def test_splits_cover_every_tile_once():
    for tiles in range(1, 120):
        for forced in (None, 1, 2, 3, 4, 7, 200):
            lp = dec.plan(40, 4096, tiles, SMS, splits=forced)
            assert 1 <= lp.splits <= tiles
            assert (lp.splits - 1) * lp.tiles_per_split < tiles <= lp.splits * lp.tiles_per_split
            if forced is None:
                assert lp.splits <= DEFAULT.awq_wgmma_decode_max_splits
                assert lp.splits == 1 or tiles // lp.splits >= DEFAULT.awq_wgmma_decode_min_tiles_per_split - 1


def test_few_tiles_are_not_split():
    assert dec.plan(32, 576, 5, SMS).splits == 1  # SmolLM2's K = 576: five tiles


def test_ring_bytes():
    # eight stages of BT rows x 128 bytes, their 16 mbarrier bytes each, 1 KB for the swizzle alignment
    assert dec.smem_bytes(32) == 8 * 32 * 128 + 8 * 16 + 1024
    assert dec.smem_bytes(64) == 8 * 64 * 128 + 8 * 16 + 1024
