#include "backends/cuda/llm_kernel_timer.h"

#include <algorithm>

namespace hearth::llm {

Result<cudaEvent_t> KernelTimer::NextEvent() {
  if (next_event_ == events_.size()) {
    cudaEvent_t event = nullptr;
    RETURN_IF_ERROR(cuda::CudaCheck(cudaEventCreate(&event), "cudaEventCreate"));
    events_.emplace_back(event);
  }
  return events_[next_event_++].get();
}

Result<std::vector<KernelTime>> KernelTimer::Collect() {
  std::vector<KernelTime> times;
  for (const Mark& mark : marks_) {
    float ms = 0;
    RETURN_IF_ERROR(
        cuda::CudaCheck(cudaEventElapsedTime(&ms, mark.start, mark.stop), "cudaEventElapsedTime"));
    auto it = std::find_if(times.begin(), times.end(),
                           [&](const KernelTime& k) { return k.name == mark.name; });
    if (it == times.end()) {
      times.push_back({mark.name, 0, 0});
      it = times.end() - 1;
    }
    ++it->launches;
    it->ms += ms;
  }
  marks_.clear();
  return times;
}

}  // namespace hearth::llm
