// InvariantGemm: sgemm in slices of `in`, on enough rows to stay off
// OpenBLAS's small-matrix kernel (invariant_gemm.h says why).
#include "backends/llm/invariant_gemm.h"

#include <algorithm>

#include "backends/cpu/blas.h"

namespace hearth::llm {

void InvariantGemm::Run(int64_t rows, int64_t out, int64_t in, const float* x, const float* w,
                        float* y, bool accumulate) {
  // Zero rows below the real ones: at least kMinRows, and out * rows >
  // kSmallProduct.
  const int64_t padded = std::max({rows, kMinRows, kSmallProduct / out + 1});
  const float* a = x;
  float* c = y;
  if (padded > rows) {
    x_pad_.assign(static_cast<size_t>(padded * in), 0.0f);
    y_pad_.assign(static_cast<size_t>(padded * out), 0.0f);
    std::copy_n(x, rows * in, x_pad_.data());
    if (accumulate) std::copy_n(y, rows * out, y_pad_.data());
    a = x_pad_.data();
    c = y_pad_.data();
  }
  for (int64_t k = 0; k < in; k += kMaxSlice) {
    const int64_t slice = std::min(kMaxSlice, in - k);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(padded),
                static_cast<int>(out), static_cast<int>(slice), 1.0f, a + k, static_cast<int>(in),
                w + k, static_cast<int>(in), accumulate || k > 0 ? 1.0f : 0.0f, c,
                static_cast<int>(out));
  }
  if (padded > rows) std::copy_n(y_pad_.data(), rows * out, y);
}

}  // namespace hearth::llm
