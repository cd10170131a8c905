#include "common/bytes_tensor.h"

#include <string>

namespace hearth {
namespace {

enum class Step { kElement, kEnd, kShortPrefix, kPastEnd };

uint32_t LoadLittleEndian32(const std::byte* p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
         static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24;
}

// Reads the element whose prefix is at `offset` (<= data.size()): kElement
// with its length, kEnd when nothing is left, or what is wrong with it.
Step ReadElement(std::span<const std::byte> data, size_t offset, uint32_t* length) {
  const size_t left = data.size() - offset;
  if (left == 0) return Step::kEnd;
  if (left < kBytesLengthPrefix) return Step::kShortPrefix;
  *length = LoadLittleEndian32(data.data() + offset);
  if (*length > left - kBytesLengthPrefix) return Step::kPastEnd;
  return Step::kElement;
}

// The error for element `index`, at `offset`, which ReadElement refused.
Status ElementError(std::span<const std::byte> data, size_t offset, uint64_t index, Step step,
                    uint32_t length, std::string_view what) {
  const size_t left = data.size() - offset;
  const std::string element = std::string(what) + ": BYTES element " + std::to_string(index) +
                              " (at byte " + std::to_string(offset) + ")";
  if (step == Step::kShortPrefix) {
    return InvalidArgument(element + " has a truncated length prefix: " + std::to_string(left) +
                           " of its 4 bytes");
  }
  return InvalidArgument(
      element + " has length " + std::to_string(length) + ", past the end of the data: " +
      std::to_string(left - kBytesLengthPrefix) + " bytes follow its length prefix");
}

}  // namespace

Status ValidateBytesTensor(std::span<const std::byte> data, uint64_t count, std::string_view what) {
  size_t offset = 0;
  uint64_t index = 0;
  // Ends within data.size() / 4 steps whatever `count` says.
  for (; index < count; ++index) {
    uint32_t length = 0;
    const Step step = ReadElement(data, offset, &length);
    if (step == Step::kEnd) {
      return InvalidArgument(std::string(what) +
                             ": BYTES data has too few elements: " + std::to_string(index) +
                             " where " + std::to_string(count) + " are expected");
    }
    if (step != Step::kElement) return ElementError(data, offset, index, step, length, what);
    offset += BytesElementSize(length);
  }
  if (offset == data.size()) return Status::Ok();
  // Something follows the last element: more whole elements, or bytes that
  // are none.
  const size_t last_end = offset;
  uint64_t more = 0;
  for (;;) {
    uint32_t length = 0;
    const Step step = ReadElement(data, offset, &length);
    if (step == Step::kEnd) break;
    if (step != Step::kElement) {
      return InvalidArgument(std::string(what) + ": BYTES data has " +
                             std::to_string(data.size() - last_end) + " trailing bytes after its " +
                             std::to_string(count) + " elements (from byte " +
                             std::to_string(last_end) + ")");
    }
    offset += BytesElementSize(length);
    ++more;
  }
  return InvalidArgument(std::string(what) +
                         ": BYTES data has too many elements: " + std::to_string(count + more) +
                         " where " + std::to_string(count) + " are expected");
}

Result<uint64_t> CountBytesElements(std::span<const std::byte> data, std::string_view what) {
  size_t offset = 0;
  uint64_t index = 0;
  for (;; ++index) {
    uint32_t length = 0;
    const Step step = ReadElement(data, offset, &length);
    if (step == Step::kEnd) return index;
    if (step != Step::kElement) return ElementError(data, offset, index, step, length, what);
    offset += BytesElementSize(length);
  }
}

Status AppendBytesElement(std::vector<std::byte>& out, std::string_view element,
                          std::string_view what) {
  if (element.size() > kMaxBytesElement) {
    return InvalidArgument(std::string(what) + ": a BYTES element of " +
                           std::to_string(element.size()) + " bytes is longer than the " +
                           std::to_string(kMaxBytesElement) + " a length prefix can hold");
  }
  const auto length = static_cast<uint32_t>(element.size());
  const std::byte prefix[kBytesLengthPrefix] = {
      std::byte(length & 0xff), std::byte((length >> 8) & 0xff), std::byte((length >> 16) & 0xff),
      std::byte((length >> 24) & 0xff)};
  const auto* bytes = reinterpret_cast<const std::byte*>(element.data());
  out.insert(out.end(), prefix, prefix + kBytesLengthPrefix);
  out.insert(out.end(), bytes, bytes + element.size());
  return Status::Ok();
}

void BytesElements::Iterator::Advance() {
  if (at_end_) return;
  uint32_t length = 0;
  if (ReadElement(data_, next_, &length) != Step::kElement) {
    *this = Iterator();
    return;
  }
  offset_ = next_;
  element_ = std::string_view(
      reinterpret_cast<const char*>(data_.data() + offset_ + kBytesLengthPrefix), length);
  next_ = offset_ + BytesElementSize(length);
}

}  // namespace hearth
