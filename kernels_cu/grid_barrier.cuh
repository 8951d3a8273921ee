// A barrier across every block of a grid whose blocks are all resident at once (a cooperative launch: the
// persistent chain of awq_chain.cu). One uint32 in global memory, never reset: block 0 adds
// 2^31 - (blocks - 1) and every other block adds 1, so each barrier adds exactly 2^31 and flips the top bit
// once, whatever the order of arrival and whatever the word held before (cooperative_groups' grid sync counts
// the same way). A block has passed when it sees the top bit differ from the value its own add returned; a
// block cannot arrive at the next barrier before every block has left this one, so the bit cannot flip back
// under a waiter.
//
// Split in two so a block can issue loads that do not depend on the other blocks (the next phase's weights)
// between its arrival and its wait.
#pragma once
#include <stdint.h>

namespace fllama {

// Every thread of the block calls it after its last write of the phase; returns the arrival ticket (thread 0's).
__device__ __forceinline__ uint32_t grid_arrive(uint32_t* bar) {
    __syncthreads();  // the block's writes of the phase precede thread 0's release
    uint32_t old = 0;
    if (threadIdx.x == 0) {
        const uint32_t inc = blockIdx.x == 0 ? 0x80000000u - (gridDim.x - 1) : 1u;
        __threadfence();  // cumulative: the other warps' writes, ordered before it by the block barrier
        asm volatile("atom.add.release.gpu.u32 %0, [%1], %2;" : "=r"(old) : "l"(bar), "r"(inc) : "memory");
    }
    return old;
}

// Every thread calls it with the ticket grid_arrive returned; after it, every block's writes before its arrival
// are visible to every thread of this block.
__device__ __forceinline__ void grid_wait(const uint32_t* bar, uint32_t ticket) {
    if (threadIdx.x == 0) {
        uint32_t cur;
        do {
            asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(cur) : "l"(bar) : "memory");
        } while (((cur ^ ticket) & 0x80000000u) == 0);
        __threadfence();
    }
    __syncthreads();  // the acquire by thread 0 orders the block's later reads
}

}  // namespace fllama
