// The `data` of a tensor in a KServe JSON request, read with simdjson's
// On-Demand API straight into the tensor's element type: flat or nested along
// its shape, each element checked against its datatype (a boolean, an integer
// that fits, a number, a string for BYTES).
#pragma once

#include <simdjson.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "hearth/dtype.h"
#include "hearth/status.h"

namespace hearth::json_tensor_data {

// Where a tensor's `data` goes and what it must look like.
struct DataTarget {
  const std::string* label;  // `input "x"`
  DType dtype;
  const std::vector<int64_t>* shape;
  uint64_t count;     // elements the shape needs
  uint64_t capacity;  // count, or 0 when the text cannot hold count elements
};

// Fixed-size datatypes, into `out`, which has room for target.capacity elements.
Status ReadDataAs(const DataTarget& target, std::byte* out, simdjson::ondemand::array& array,
                  bool nested);
// BYTES: appended to `out` in the serialised form of common/bytes_tensor.h.
Status ReadBytesData(const DataTarget& target, std::vector<std::byte>* out,
                     simdjson::ondemand::array& array, bool nested);

}  // namespace hearth::json_tensor_data
