// Weights a kernel asks the L2 cache to fetch for the kernels after it.
//
// In a decode step of a few sequences each GEMM streams its weights and the
// kernels between GEMMs (norms, attention) read a few KB: the memory idles
// from one GEMM's last loads to the next one's first, and each GEMM ramps up
// from cold. A kernel that runs in such a window (the attention) issues
// bulk prefetches of the weights the next GEMMs read, so that those find
// them in L2. A hint: no result depends on it, and weights are never
// written, so the requests may go out before the kernel waits for the one
// before it (dependent_launch.h).
#pragma once

#include <cstdint>

namespace hearth::cuda {

inline constexpr int kMaxL2Prefetch = 3;

// Up to kMaxL2Prefetch byte ranges; one whose bytes are not 0 starts 16-byte
// aligned and spans a multiple of 16 bytes (launchers refuse others:
// L2PrefetchValid).
struct L2Prefetch {
  const void* ptr[kMaxL2Prefetch] = {};
  uint64_t bytes[kMaxL2Prefetch] = {};
};

inline bool L2PrefetchValid(const L2Prefetch& p) {
  for (int r = 0; r < kMaxL2Prefetch; ++r) {
    if (p.bytes[r] == 0) continue;
    if (p.ptr[r] == nullptr || reinterpret_cast<uintptr_t>(p.ptr[r]) % 16 != 0 ||
        p.bytes[r] % 16 != 0)
      return false;
  }
  return true;
}

// The ranges are cut into chunks of this many bytes, one bulk prefetch each.
inline constexpr uint64_t kL2PrefetchChunk = uint64_t{16} << 10;

#ifdef __CUDACC__
// Issues issuer's share of p's chunks: chunk j of all the ranges together
// goes to issuer j % issuers. Every issuer of a launch calls it once with the
// same p and issuers. Nothing on GPUs before sm_90.
__device__ __forceinline__ void PrefetchL2(const L2Prefetch& p, uint64_t issuer, uint64_t issuers) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint64_t first = 0;  // chunks of the ranges before this one
#pragma unroll
  for (int r = 0; r < kMaxL2Prefetch; ++r) {
    const uint64_t bytes = p.bytes[r];
    if (bytes == 0) continue;  // the common case: no 64-bit divisions
    const uint64_t chunks = (bytes + kL2PrefetchChunk - 1) / kL2PrefetchChunk;
    for (uint64_t c = (issuer + issuers - first % issuers) % issuers; c < chunks; c += issuers) {
      const char* at = static_cast<const char*>(p.ptr[r]) + c * kL2PrefetchChunk;
      const uint64_t left = bytes - c * kL2PrefetchChunk;
      const auto size = static_cast<uint32_t>(left < kL2PrefetchChunk ? left : kL2PrefetchChunk);
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(at), "r"(size) : "memory");
    }
    first += chunks;
  }
#endif
}
#endif

}  // namespace hearth::cuda
