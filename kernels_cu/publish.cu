// A decode step's sampled ids [m] (int32, on the GPU) stored straight into pinned host memory: under unified
// addressing a pinned allocation's own pointer is valid in kernels, so the decode pipe (engine/pipe.py) hands each
// step's ids to the host without a copy-engine transfer, which costs the stream more than this one-block kernel.
// The host reads them once an event recorded after this kernel has passed (kernel completion makes them visible).
// grid 1, block 32 * ceil(m / 32) (m <= 1024).
#include "common.cuh"

using namespace fllama;

extern "C" __global__ void __launch_bounds__(1024) publish_ids(int* __restrict__ host, const int* __restrict__ ids,
                                                                int m) {
    pdl_enter();  // the ids are the previous kernel's output
    if ((int)threadIdx.x < m) host[threadIdx.x] = ids[threadIdx.x];
}
