"""publish.cu: sampled ids stored by a kernel into pinned host memory, as the decode pipe reads them."""

import pytest
import torch

from tests.gpu.conftest import GPU_STACK, SKIP_REASON

if not GPU_STACK:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from kernels_cu import build  # noqa: E402
from kernels_cu.publish import publish_ids, publish_ids_ref  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("m", [1, 5, 32, 33, 1024])
def test_publish_ids_reach_the_host(m):
    """The ids land in host[:m] once an event after the kernel has passed; nothing past m is written."""
    g = torch.Generator().manual_seed(m)
    ids = torch.randint(0, 128_256, (m,), generator=g, dtype=torch.int32).cuda()
    host = torch.full((1024 + 8,), -1, dtype=torch.int32).pin_memory()
    ref = torch.full_like(host, -1)
    publish_ids_ref(ref, ids)
    with build.on_stream():
        publish_ids(host, ids)
        done = torch.cuda.Event()
        done.record(build.torch_stream())
    done.synchronize()
    assert torch.equal(host, ref)
    assert torch.equal(host[:m], ids.cpu()) and bool((host[m:] == -1).all())


def test_publish_ids_rows_of_a_ring():
    """A pipe's ring [slots, B]: each step's ids into its own row, the others untouched."""
    ring = torch.zeros(4, 8, dtype=torch.int32).pin_memory()
    for slot in range(4):
        publish_ids(ring[slot, :3], torch.full((3,), slot + 10, dtype=torch.int32, device="cuda"))
    build.synchronize()
    assert ring[:, :3].tolist() == [[10] * 3, [11] * 3, [12] * 3, [13] * 3]
    assert bool((ring[:, 3:] == 0).all())


def test_publish_ids_checks_its_inputs():
    ids = torch.zeros(4, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="pinned"):
        publish_ids(torch.zeros(4, dtype=torch.int32), ids)
    with pytest.raises(ValueError, match="pinned"):
        publish_ids(torch.zeros(4, dtype=torch.int64).pin_memory(), ids)
    with pytest.raises(ValueError, match="4 ids for a host buffer of 2"):
        publish_ids(torch.zeros(2, dtype=torch.int32).pin_memory(), ids)
    with pytest.raises(ValueError, match="ids must be"):
        publish_ids(torch.zeros(4, dtype=torch.int32).pin_memory(), ids.long())
