#include "backends/cuda/dependent_launch.h"

#include <cstdlib>
#include <cstring>

namespace hearth::cuda {
namespace {

std::atomic<bool>& Flag() {
  static std::atomic<bool> on{[] {
    const char* v = std::getenv("HEARTH_CUDA_DEPENDENT_LAUNCH");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }()};
  return on;
}

}  // namespace

bool DependentLaunchEnabled() { return Flag().load(std::memory_order_relaxed); }

void SetDependentLaunch(bool on) { Flag().store(on, std::memory_order_relaxed); }

}  // namespace hearth::cuda
