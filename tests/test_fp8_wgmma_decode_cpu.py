"""fp8_wgmma_decode.py without a GPU: the launch plan (LLaMA-2-7B's shapes at 32 rows: q|k|v and gate|up unsplit,
o_proj / down_proj split), the rule that sends fp8_gemm's products to it (rows, width, switch), the ring's shared
memory and the launcher's refusals (the kernels run in tests/gpu/test_fp8_wgmma_decode*.py)."""

import dataclasses

import pytest
import torch

from kernels_cu import fp8_wgmma_decode as dec
from kernels_cu import tuning
from kernels_cu.tuning import DEFAULT, Tuning
from model_zoo.errors import ConfigError

SMS = 132  # H100 / H200


def test_llama2_7b_shapes_at_32_rows():
    # (N, K) -> splits: the column blocks of q|k|v (192) and gate|up (344) give every SM one: no split
    want = {(12288, 4096): 1, (22016, 4096): 1, (4096, 4096): 6, (4096, 11008): 6}
    for (n, k), splits in want.items():
        lp = dec.plan(32, n, k, SMS, t=DEFAULT)
        assert (lp.bt, lp.splits) == (32, splits), (n, k, lp)
        assert lp.grid(32, n) == (n // 64, splits, 1)


def test_columns_that_fill_the_sms_are_not_split():
    for n in (132 * 64, 133 * 64, 200 * 64):
        assert dec.plan(32, n, 4096, SMS, t=DEFAULT).splits == 1
    assert dec.plan(32, 131 * 64, 4096, SMS, t=DEFAULT).splits == 3  # 396 slots // 131 columns
    assert dec.plan(64, 4096, 4096, SMS, t=DEFAULT).splits == 6


def test_token_tile_follows_m():
    assert [dec.plan(m, 4096, 4096, SMS, t=DEFAULT).bt for m in (1, 17, 32, 33, 64)] == [32, 32, 32, 64, 64]
    assert dec.plan(65, 4096, 4096, SMS, t=DEFAULT).grid(65, 4096)[2] == 2  # the kernel itself takes any M


def test_splits_cover_every_tile_once():
    for k in range(16, 120 * 128, 16 * 37):
        tiles = -(-k // dec.BK)
        for forced in (None, 1, 2, 3, 7, 200):
            lp = dec.plan(40, 1024, k, SMS, splits=forced, t=DEFAULT)
            assert 1 <= lp.splits <= tiles
            assert (lp.splits - 1) * lp.tiles_per_split < tiles <= lp.splits * lp.tiles_per_split
            if forced is None:
                assert lp.splits <= DEFAULT.fp8_wgmma_decode_max_splits
                assert lp.splits == 1 or tiles // lp.splits >= DEFAULT.fp8_wgmma_decode_min_tiles_per_split - 1


def test_split_knobs_are_read_from_the_tuning():
    t = dataclasses.replace(DEFAULT, fp8_wgmma_decode_max_splits=2)
    assert dec.plan(32, 4096, 11008, SMS, t=t).splits == 2
    with tuning.override(fp8_wgmma_decode_blocks_per_sm=1):
        assert dec.plan(32, 4096, 11008, SMS).splits == 2  # 132 slots // 64 columns


def test_which_products_it_takes():
    """LLaMA-2-7B at 17-32 rows: q|k|v and gate|up; not o_proj / down_proj, 16 rows, cuBLASLt's 33 rows, off."""
    fits = lambda m, n, k=4096, t=DEFAULT: dec.shape_fits(m, n, k, t)  # noqa: E731
    assert fits(17, 12288) and fits(32, 12288) and fits(32, 22016)
    assert not fits(16, 12288) and not fits(33, 12288) and not fits(32, 4096) and not fits(32, 4096, 11008)
    assert not fits(32, 12288, 4104)  # K not 16-byte rows
    assert not fits(32, 12296)  # N not whole 16-channel panels
    assert not fits(32, 12288, t=Tuning(fp8_wgmma_decode=False))
    assert fits(40, 12288, t=Tuning(fp8_library_min_m=65))  # cuBLASLt moved up: 33-64 too
    assert not fits(40, 12288, t=Tuning(fp8_library_min_m=65, fp8_gemv_max_m=32))
    assert fits(32, 4096, t=Tuning(fp8_wgmma_decode_min_n=16))


def test_cpu_tensors_never_run_it():
    x8 = torch.zeros(32, 4096, dtype=torch.float8_e4m3fn)  # [M, K]
    assert not dec.runs(x8, torch.zeros(12288, 4096, dtype=torch.float8_e4m3fn))


def test_ring_bytes_fit_three_blocks():
    assert dec.smem_bytes(32) == 6 * (64 * 128 + 32 * 128) + 6 * 16 + 1024
    assert dec.smem_bytes(64) == 4 * (64 * 128 + 64 * 128) + 4 * 16 + 1024
    for bt in (32, 64):
        assert 3 * (dec.smem_bytes(bt) + 1024) <= 228 * 1024


def test_launch_plan_refuses_nonsense():
    with pytest.raises(ValueError, match="empty"):
        dec.plan(0, 4096, 4096, SMS, t=DEFAULT)
    with pytest.raises(ValueError, match="token tile"):
        dec.DecodeLaunch(48, 1, 1)
    with pytest.raises(ValueError, match="splits"):
        dec.DecodeLaunch(32, 0, 4)


def test_launcher_checks_shapes_before_the_gpu():
    x8 = torch.zeros(20, 256, dtype=torch.float8_e4m3fn)  # [M, K]
    a = torch.ones(20)
    w8, ws = torch.zeros(64, 256, dtype=torch.float8_e4m3fn), torch.ones(64)
    with pytest.raises(ConfigError, match="N"):
        dec.fp8_wgmma_decode(x8, a, w8[:40], ws[:40])
    with pytest.raises(ConfigError, match="K"):
        dec.fp8_wgmma_decode(x8[:, :72].contiguous(), a, w8[:, :72].contiguous(), ws)
    with pytest.raises(ValueError, match="K="):
        dec.fp8_wgmma_decode(x8, a, w8[:, :128].contiguous(), ws)
    with pytest.raises(ValueError, match="on the GPU"):
        dec.fp8_wgmma_decode(x8, a, w8, ws)
    with pytest.raises(ValueError, match="epilogue"):
        dec.launch(None, x8, a, w8, ws, None, "gelu")


def test_a_weight_map_is_made_before_any_capture(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="before the graph capture"):
        dec.keep_weight_map(torch.zeros(64, 256, dtype=torch.float8_e4m3fn))


def test_every_knob_has_its_reason():
    """The Tuning fields the kernel reads, each with a comment in tuning.py."""
    import inspect

    source = inspect.getsource(Tuning)
    for name in ("fp8_wgmma_decode", "fp8_wgmma_decode_min_m", "fp8_wgmma_decode_min_n",
                 "fp8_wgmma_decode_blocks_per_sm", "fp8_wgmma_decode_max_splits",
                 "fp8_wgmma_decode_min_tiles_per_split"):
        line = next(i for i, l in enumerate(source.splitlines()) if l.strip().startswith(f"{name}:"))
        assert source.splitlines()[line - 1].strip().startswith("#"), name
