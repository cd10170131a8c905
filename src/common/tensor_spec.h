// One input or output of a model, per sample: without the batch dimension
// when the model batches. A dimension of -1 varies between requests; BYTES
// (DType::kBytes) elements vary in size. What a backend reports, a config
// declares and the worker protocol carries.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hearth/dtype.h"
#include "hearth/status.h"

namespace hearth {

struct TensorSpec {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> dims;
  bool operator==(const TensorSpec&) const = default;

  // Bytes of one sample: dtype size x the product of dims. InvalidArgument
  // naming the tensor when it has no fixed size (BYTES, a -1 dimension) or
  // the product passes 2^63 bytes.
  Result<uint64_t> bytes_per_sample() const;
  // Neither BYTES nor a variable dimension.
  bool fixed_size() const;
};

// "'x' FP32 [-1,16]": how errors name a spec.
std::string Describe(const TensorSpec& spec);

}  // namespace hearth
