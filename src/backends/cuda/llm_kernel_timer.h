// Times each launch of one eager llm step with a CUDA event pair around it,
// and sums the times by name (bench/llm's --profile-seqs): what each kind of
// kernel costs in a step, to read against the floor it is bound by.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <type_traits>
#include <utility>
#include <vector>

#include "backends/cuda/cuda_util.h"
#include "backends/cuda/llm_executor.h"
#include "hearth/status.h"

namespace hearth::llm {

class KernelTimer {
 public:
  // From Begin(on) to End(), Time records an event pair around each launch
  // when `on`; otherwise it only launches.
  void Begin(bool on) {
    on_ = on;
    next_event_ = 0;
    marks_.clear();
  }
  void End() { on_ = false; }

  // Runs `launch` (returning cudaError_t or Status) on `stream`, timed as
  // `name` (a string that outlives the step).
  template <typename Launch>
  Status Time(const char* name, cudaStream_t stream, Launch&& launch) {
    cudaEvent_t start = nullptr, stop = nullptr;
    if (on_) {
      ASSIGN_OR_RETURN(start, NextEvent());
      ASSIGN_OR_RETURN(stop, NextEvent());
      RETURN_IF_ERROR(cuda::CudaCheck(cudaEventRecord(start, stream), "cudaEventRecord"));
    }
    using R = decltype(launch());
    if constexpr (std::is_same_v<R, cudaError_t>) {
      RETURN_IF_ERROR(cuda::CudaCheck(launch(), name));
    } else {
      RETURN_IF_ERROR(launch());
    }
    if (on_) {
      RETURN_IF_ERROR(cuda::CudaCheck(cudaEventRecord(stop, stream), "cudaEventRecord"));
      marks_.push_back({name, start, stop});
    }
    return Status::Ok();
  }

  // After the step's stream is synchronised: the times of the launches
  // recorded since Begin, summed by name in order of first launch (and
  // forgotten).
  Result<std::vector<KernelTime>> Collect();

 private:
  struct Mark {
    const char* name;
    cudaEvent_t start, stop;
  };
  Result<cudaEvent_t> NextEvent();

  bool on_ = false;
  std::vector<cuda::CudaEvent> events_;  // reused from step to step
  size_t next_event_ = 0;
  std::vector<Mark> marks_;
};

}  // namespace hearth::llm
