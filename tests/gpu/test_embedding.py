"""embedding.cu: an exact gather for int32 and int64 ids; out-of-range ids give zero rows."""

import pytest
import torch

from tests.gpu.conftest import GPU_STACK, SKIP_REASON, assert_equal, poison, randn

if not GPU_STACK:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from kernels_cu.embedding import embedding, embedding_ref  # noqa: E402

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
