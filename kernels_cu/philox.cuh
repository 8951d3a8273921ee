// Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3"): the sampler's random numbers,
// a pure function of (key, counter), so a graph replay draws fresh numbers by advancing a counter on the device.
#pragma once

#include <stdint.h>

namespace fllama {

__device__ __forceinline__ uint4 philox4x32_10(uint4 c, uint2 k) {
    constexpr uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        const uint32_t hi0 = __umulhi(M0, c.x), lo0 = M0 * c.x;
        const uint32_t hi1 = __umulhi(M1, c.z), lo1 = M1 * c.z;
        c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
        k.x += W0;
        k.y += W1;
    }
    return c;
}

// Uniform in [0, 1) with 24 random bits.
__device__ __forceinline__ float uniform01(unsigned long long seed, unsigned long long counter) {
    const uint4 ctr = make_uint4((uint32_t)counter, (uint32_t)(counter >> 32), 0u, 0x5a3f1c27u);
    const uint4 r = philox4x32_10(ctr, make_uint2((uint32_t)seed, (uint32_t)(seed >> 32)));
    return (float)(r.x >> 8) * (1.0f / 16777216.0f);
}

}  // namespace fllama
