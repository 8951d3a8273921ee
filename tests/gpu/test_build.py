"""The build layer on a real GPU: shared context, one stream, cubin cache, launch checks, graph capture."""

import pytest
import torch

from tests.gpu.conftest import GPU_STACK, SKIP_REASON, assert_equal, randn

if not GPU_STACK:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from kernels_cu import build  # noqa: E402
from kernels_cu.embedding import SIGNATURE as EMBEDDING_SIGNATURE, embedding  # noqa: E402
from kernels_cu.quantize import quantize, quantize_ref  # noqa: E402

pytestmark = pytest.mark.gpu


def test_device_info_names_the_gpu():
    info = build.device_info()
    assert info["name"] == torch.cuda.get_device_name()
    assert info["cc"] == "{}.{}".format(*torch.cuda.get_device_capability())
    assert info["sm_count"] == torch.cuda.get_device_properties(0).multi_processor_count
    assert info["l2_bytes"] > 0 and info["driver_version"] and "cuda" in info["nvcc_version"].lower()


def test_pycuda_shares_torchs_primary_context():
    import pycuda.driver as drv
    x = torch.arange(8, dtype=torch.float32, device="cuda")
    host = torch.empty(8, dtype=torch.float32).numpy()
    build.synchronize()
    drv.memcpy_dtoh(host, x.data_ptr())  # a torch pointer is valid in pycuda's context
    assert host.tolist() == list(range(8))


def test_cubins_are_cached_on_disk_and_functions_in_process(tmp_path, monkeypatch):
    monkeypatch.setenv("FLLAMA_CUDA_CACHE", str(tmp_path))
    path = build.compile_cubin("embedding.cu", build.device_arch())
    assert path.parent == tmp_path and path.stat().st_size > 0
    mtime = path.stat().st_mtime_ns
    assert build.compile_cubin("embedding.cu", build.device_arch()) == path
    assert path.stat().st_mtime_ns == mtime  # the second call did not recompile
    # the launcher's own signature: a stale one here is cached and breaks every later embedding launch
    f1 = build.get_function("embedding.cu", "embedding_i32", EMBEDDING_SIGNATURE)
    assert build.get_function("embedding.cu", "embedding_i32", EMBEDDING_SIGNATURE) is f1
    with pytest.raises(ValueError, match="signature"):
        build.get_function("embedding.cu", "embedding_i32", EMBEDDING_SIGNATURE[:-1])


def test_launch_off_fllamas_stream_is_refused():
    x = randn(2, 64)
    with torch.cuda.stream(torch.cuda.Stream()):
        with pytest.raises(RuntimeError, match="on_stream"):
            quantize(x)


def test_launch_error_becomes_device_error():
    from model_zoo.errors import DeviceError
    fn = build.get_function("quantize.cu", "quantize_dyn_nv1", "PPPPi")
    with pytest.raises(DeviceError, match="quantize_dyn_nv1"):
        fn((1,), (2048,), None, None, None, None, 8)  # 2048 threads per block: an invalid launch


def test_torch_graph_captures_pycuda_launches_with_torch_ops():
    table = randn(100, 576, seed=1)
    ids = torch.tensor([3, 1, 4, 1, 5], dtype=torch.int32, device="cuda")
    q = torch.empty(5, 576, dtype=torch.int8, device="cuda")
    s = torch.empty(5, dtype=torch.float32, device="cuda")
    rows = embedding(table, ids)  # warm-up: compile outside the capture
    quantize(rows * 2, q=q, a_scale=s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=build.torch_stream()):
        rows = embedding(table, ids)
        doubled = rows * 2  # a torch op between two pycuda launches
        quantize(doubled, q=q, a_scale=s)
    ids.copy_(torch.tensor([9, 8, 7, 6, 5], dtype=torch.int32))
    q.zero_()
    g.replay()
    build.synchronize()
    want_q, want_s = quantize_ref(table[ids.long()] * 2)
    assert_equal(q, want_q, "q after replay with new ids")
    assert_equal(s, want_s, "a_scale after replay")


def test_dynamic_shared_memory_above_48k_is_opted_in(tmp_path, monkeypatch):
    (tmp_path / "smem_probe.cu").write_text(
        'extern "C" __global__ void smem_probe(float* out, int n) {\n'
        "    extern __shared__ float buf[];\n"
        "    for (int i = threadIdx.x; i < n; i += blockDim.x) buf[i] = 1.0f;\n"
        "    __syncthreads();\n"
        "    if (threadIdx.x == 0) { float s = 0.0f; for (int i = 0; i < n; ++i) s += buf[i]; out[0] = s; }\n"
        "}\n")
    monkeypatch.setattr(build, "KERNEL_DIR", tmp_path)
    monkeypatch.setenv("FLLAMA_CUDA_CACHE", str(tmp_path / "cache"))
    fn = build.get_function("smem_probe.cu", "smem_probe", "Pi")
    n = 24 * 1024  # 96 KB of floats: above the 48 KB a kernel gets without opting in
    out = torch.zeros(1, device="cuda")
    fn((1,), (256,), out, n, shared=n * 4)
    build.synchronize()
    assert out.item() == n
