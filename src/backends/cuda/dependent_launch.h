// Programmatic dependent launch (Hopper and later): a kernel queued behind
// another on a stream may start while the other still runs, and waits for
// it (all its blocks done, their writes visible) where it first needs its
// results. A decode step of one sequence is ~200 short kernels, each of
// which otherwise pays the launch and the ramp of the one before; with it,
// the next kernel's blocks are resident when the last one ends, and a GEMM
// has its weights (which no kernel writes) in flight before the wait.
//
// The rules every kernel launched with LaunchDependent keeps:
//   - it calls DependentWait() before it reads anything an earlier kernel
//     wrote and before it writes anything (an earlier kernel may still read
//     it); only memory no kernel of the step writes (weights, norms, the
//     RoPE table) may be read before;
//   - every block calls DependentWait() (so that the kernel's end implies
//     the end of the kernels before it, which the kernel after it relies on);
//   - it calls DependentRelease() once it no longer needs the SMs to itself:
//     the next kernel's blocks may then be scheduled beside its own.
// Launched in a CUDA graph capture, the dependency becomes a programmatic
// edge of the graph. On GPUs before sm_90 the two calls compile to nothing
// and the launch is an ordinary one.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <utility>

namespace hearth::cuda {

// On by default where every kernel is built for sm_90 or later (the build's
// HEARTH_CUDA_ARCHITECTURES); HEARTH_CUDA_DEPENDENT_LAUNCH=0 in the
// environment turns it off (read once), as does SetDependentLaunch(false)
// for launches after it (true turns it on only in a build where it is on by
// default).
bool DependentLaunchEnabled();
void SetDependentLaunch(bool on);

#ifdef __CUDACC__
__device__ __forceinline__ void DependentWait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void DependentRelease() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// kernel<<<grid, block, smem, stream>>>(args...), as a dependent launch
// where enabled. Returns the launch's error.
template <typename... Params, typename... Args>
cudaError_t LaunchDependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                            cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = DependentLaunchEnabled() ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}
#endif

}  // namespace hearth::cuda
