#include "common/tensor_spec.h"

#include <algorithm>

#include "common/checked_size.h"
#include "common/datatype.h"

namespace hearth {

Result<uint64_t> TensorSpec::bytes_per_sample() const {
  if (dtype == DType::kBytes)
    return InvalidArgument("'" + name + "' is BYTES: its elements have no fixed size");
  return ShapeBytes(dtype, dims, "'" + name + "'");
}

bool TensorSpec::fixed_size() const {
  return dtype != DType::kBytes &&
         std::none_of(dims.begin(), dims.end(), [](int64_t d) { return d < 0; });
}

std::string Describe(const TensorSpec& spec) {
  const std::string_view type = KserveDatatypeName(spec.dtype);
  return "'" + spec.name + "' " + std::string(type.empty() ? DTypeName(spec.dtype) : type) + " " +
         ShapeString(spec.dims);
}

}  // namespace hearth
