#include "backends/cuda/dependent_launch.h"

#include <cstdlib>
#include <cstring>

namespace hearth::cuda {
namespace {

std::atomic<bool>& Flag() {
  static std::atomic<bool> on{[] {
#if !HEARTH_DEPENDENT_LAUNCH
    // Built for a GPU before sm_90: its kernels' waits compile to nothing.
    return false;
#endif
    const char* v = std::getenv("HEARTH_CUDA_DEPENDENT_LAUNCH");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }()};
  return on;
}

}  // namespace

bool DependentLaunchEnabled() { return Flag().load(std::memory_order_relaxed); }

void SetDependentLaunch(bool on) {
  Flag().store(on && HEARTH_DEPENDENT_LAUNCH != 0, std::memory_order_relaxed);
}

}  // namespace hearth::cuda
