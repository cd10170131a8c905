#include "server/response_assembly.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "common/checked_size.h"
#include "common/float16.h"

namespace hearth {
namespace {

// Element e of a numeric tensor's bytes, as a double.
double ElementAt(const std::byte* p, DType dtype, size_t e) {
  auto get = [&](auto v) {
    std::memcpy(&v, p + e * sizeof v, sizeof v);
    return v;
  };
  switch (dtype) {
    case DType::kF64:
      return get(double{});
    case DType::kF32:
      return get(float{});
    case DType::kF16:
      return HalfToFloat(get(uint16_t{}));
    case DType::kBF16:
      return BFloat16ToFloat(get(uint16_t{}));
    case DType::kI64:
      return static_cast<double>(get(int64_t{}));
    case DType::kI32:
      return get(int32_t{});
    case DType::kI16:
      return get(int16_t{});
    case DType::kI8:
      return get(int8_t{});
    case DType::kU8:
      return get(uint8_t{});
    case DType::kU16:
      return get(uint16_t{});
    case DType::kU32:
      return get(uint32_t{});
    case DType::kU64:
      return static_cast<double>(get(uint64_t{}));
    case DType::kBool:
      return get(uint8_t{}) != 0 ? 1.0 : 0.0;
    default:
      return 0;
  }
}

}  // namespace

// Byte ranges of `rows` consecutive rows of a slot tensor, split per
// request: fixed-size types by bytes per row, BYTES by walking its elements.
// The walk is bounded by the tensor's own bytes, which were validated, but
// which the worker can still write: a length rewritten since then makes this
// fail rather than read past the tensor (nullopt).
std::optional<std::vector<std::span<const std::byte>>> SplitRows(
    const std::byte* base, const control::SlotTensor& t, DType dtype,
    const std::vector<int64_t>& rows_per_job) {
  std::vector<std::span<const std::byte>> parts;
  const std::byte* p = base + t.offset;
  const std::byte* const end = p + t.bytes;
  const int64_t rows = t.shape.empty() ? 1 : t.shape[0];
  if (dtype != DType::kBytes) {
    const uint64_t row_bytes = rows > 0 ? t.bytes / static_cast<uint64_t>(rows) : 0;
    for (int64_t r : rows_per_job) {
      const uint64_t n = row_bytes * static_cast<uint64_t>(r);
      parts.emplace_back(p, n);
      p += n;
    }
    return parts;
  }
  uint64_t per_row = 1;
  for (size_t i = 1; i < t.shape.size(); ++i) per_row *= static_cast<uint64_t>(t.shape[i]);
  for (int64_t r : rows_per_job) {
    const std::byte* start = p;
    for (uint64_t e = 0; e < per_row * static_cast<uint64_t>(r); ++e) {
      if (end - p < 4) return std::nullopt;
      uint32_t len;
      std::memcpy(&len, p, 4);
      if (static_cast<uint64_t>(end - p - 4) < len) return std::nullopt;
      p += 4 + len;
    }
    parts.emplace_back(start, static_cast<size_t>(p - start));
  }
  return parts;
}

// Triton's classification: per row (the batch dimension, or the whole
// tensor for a model that does not batch), the `count` largest elements
// as BYTES "value:index[:label]", largest first (ties: the lower index
// first).
InferTensor Classify(const InferTensor& t, uint32_t count, bool batching,
                     const std::vector<std::string>* labels) {
  const int64_t rows = batching && !t.shape.empty() ? t.shape[0] : 1;
  const size_t width =
      rows > 0 ? t.data.size() / DTypeSize(t.dtype) / static_cast<size_t>(rows) : 0;
  const size_t n = std::min<size_t>(count, width);
  InferTensor out;
  out.name = t.name;
  out.dtype = DType::kBytes;
  out.shape = batching ? std::vector<int64_t>{rows, static_cast<int64_t>(n)}
                       : std::vector<int64_t>{static_cast<int64_t>(n)};
  std::vector<std::byte> bytes;
  std::vector<size_t> order(width);
  for (int64_t r = 0; r < rows; ++r) {
    const size_t base = static_cast<size_t>(r) * width;
    for (size_t k = 0; k < width; ++k) order[k] = k;
    std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(n), order.end(),
                      [&](size_t a, size_t b) {
                        const double va = ElementAt(t.data.data(), t.dtype, base + a);
                        const double vb = ElementAt(t.data.data(), t.dtype, base + b);
                        return va > vb || (va == vb && a < b);
                      });
    for (size_t k = 0; k < n; ++k) {
      std::string e = std::to_string(ElementAt(t.data.data(), t.dtype, base + order[k])) + ":" +
                      std::to_string(order[k]);
      if (labels != nullptr && order[k] < labels->size() && !(*labels)[order[k]].empty())
        e += ":" + (*labels)[order[k]];
      const auto len = static_cast<uint32_t>(e.size());
      const auto* l = reinterpret_cast<const std::byte*>(&len);
      bytes.insert(bytes.end(), l, l + 4);
      const auto* c = reinterpret_cast<const std::byte*>(e.data());
      bytes.insert(bytes.end(), c, c + e.size());
    }
  }
  out.data = std::move(bytes);
  return out;
}

Status JoinPiece(JoinedOutput& j, const TensorSpec& spec, const std::vector<int64_t>& shape,
                 std::span<const std::byte> data) {
  if (spec.dtype != DType::kBytes) {
    // A vector of any length (dims [-1], token ids): the pieces one after
    // the other. Any other: as the last response gave it.
    const bool vector = spec.dims == std::vector<int64_t>{-1};
    if (vector && j.seen && !shape.empty() && j.shape.size() == shape.size() &&
        std::equal(shape.begin(), shape.end() - 1, j.shape.begin())) {
      j.shape.back() += shape.back();
      j.bytes.insert(j.bytes.end(), data.begin(), data.end());
      return Status::Ok();
    }
    j.shape = shape;
    j.bytes.assign(data.begin(), data.end());
    j.seen = true;
    return Status::Ok();
  }
  std::vector<std::string> elements;
  for (size_t at = 0; at + 4 <= data.size();) {
    uint32_t len;
    std::memcpy(&len, data.data() + at, 4);
    elements.emplace_back(reinterpret_cast<const char*>(data.data() + at + 4), len);
    at += 4 + len;
  }
  if (!j.seen) {
    j.shape = shape;
    j.elements = std::move(elements);
    j.seen = true;
    return Status::Ok();
  }
  if (shape != j.shape)
    return InvalidArgument("output '" + spec.name + "' changed its shape mid-stream, from " +
                           ShapeString(j.shape) + " to " + ShapeString(shape) +
                           ": its pieces cannot be joined");
  for (size_t e = 0; e < elements.size(); ++e) j.elements[e] += elements[e];
  return Status::Ok();
}

}  // namespace hearth
