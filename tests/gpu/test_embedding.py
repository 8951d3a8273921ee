"""embedding.cu: an exact gather for int32 and int64 ids; out-of-range ids give zero rows."""

import pytest
import torch

from tests.gpu.conftest import GPU_STACK, SKIP_REASON, assert_equal, poison, randn

if not GPU_STACK:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from kernels_cu.embedding import embedding, embedding_fold, embedding_ref  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("V,H", [(1000, 576), (32000, 4096), (49152, 576), (2048, 8192)])
@pytest.mark.parametrize("T", [1, 7, 33])
def test_gather_is_exact(T, V, H, id_dtype):
    table = randn(V, H, seed=V + H)
    g = torch.Generator().manual_seed(T)
    ids = torch.randint(0, V, (T,), generator=g)
    ids[0] = V - 1  # the last row is reachable
    ids = ids.to(id_dtype).cuda()
    out = torch.empty(T, H, dtype=torch.float16, device="cuda")
    poison(out)
    embedding(table, ids, out=out)
    assert_equal(out, table[ids.long()], "rows")


def test_out_of_range_ids_give_zero_rows():
    table = randn(100, 64, seed=1)
    ids = torch.tensor([5, -1, 100, 99], dtype=torch.int32, device="cuda")
    out = embedding(table, ids)
    assert_equal(out, embedding_ref(table, ids), "rows")
    assert int(out[1].abs().sum()) == 0 and int(out[2].abs().sum()) == 0


@pytest.mark.parametrize("fold", [False, True])
def test_step_lens_are_lengths_plus_one(fold):
    """A decode step's first kernel also writes the attention lengths (lengths + 1), rows unchanged."""
    table = randn(1000, 576, seed=3)
    ids = torch.tensor([5, 999, 0], dtype=torch.int32, device="cuda")
    lengths = torch.tensor([0, 17, 4095], dtype=torch.int32, device="cuda")
    lens = torch.full((3,), -7, dtype=torch.int32, device="cuda")
    if fold:
        out, _ = embedding_fold(table, ids, torch.ones(576, dtype=torch.float16, device="cuda"), step_lens=(lengths, lens))
    else:
        out = embedding(table, ids, step_lens=(lengths, lens))
    assert lens.tolist() == [1, 18, 4096] and lengths.tolist() == [0, 17, 4095]
    assert_equal(out, table[ids.long()], "rows")
