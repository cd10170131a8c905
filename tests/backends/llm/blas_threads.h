// OpenBLAS's thread count for the scope of a test (a process-wide setting),
// restored after.
#pragma once

// OpenBLAS's own functions (its cblas.h declares them, but its directory is
// the library's private include path); hearth_llm_model links OpenBLAS.
extern "C" void openblas_set_num_threads(int num_threads);
extern "C" int openblas_get_num_threads(void);

namespace hearth::llm::testing {

class BlasThreads {
 public:
  explicit BlasThreads(int threads) : saved_(openblas_get_num_threads()) {
    openblas_set_num_threads(threads);
  }
  ~BlasThreads() { openblas_set_num_threads(saved_); }
  BlasThreads(const BlasThreads&) = delete;
  BlasThreads& operator=(const BlasThreads&) = delete;

 private:
  int saved_;
};

}  // namespace hearth::llm::testing
