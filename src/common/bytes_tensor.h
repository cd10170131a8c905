// BYTES tensors (DType::kBytes) in the one form hearth keeps them in: KServe's
// binary tensor data extension's. For each element, in row-major order, a
// 4-byte little-endian length, then that many bytes; nothing else (no
// padding, no terminator, no count: an empty tensor is no bytes at all).
// The HTTP binary extension, the server's requests and the worker's slot all
// hold this same form, so that a binary BYTES input travels without being
// re-encoded. Elements are arbitrary bytes: nothing here assumes UTF-8.
//
// Everything below is bounds-checked against the span it is given: a
// malformed buffer (a length prefix cut short, a length past the end, bytes
// left over) is reported, never read past.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <span>
#include <string_view>
#include <vector>

#include "hearth/status.h"

namespace hearth {

inline constexpr size_t kBytesLengthPrefix = 4;
// The longest element a 4-byte length can describe.
inline constexpr uint64_t kMaxBytesElement = 0xffffffffu;

// OK when `data` is exactly `count` well-formed elements. Otherwise
// InvalidArgument whose message starts with `what` (`input "x"`) and says
// which element and why: its length prefix is cut short, its length runs
// past the end, the data holds fewer or more elements than `count`, or bytes
// that make no whole element follow the last one. Reads only the length
// prefixes: O(elements), whatever `count` claims.
Status ValidateBytesTensor(std::span<const std::byte> data, uint64_t count, std::string_view what);

// The number of elements in `data`; InvalidArgument naming `what` if `data`
// is not a sequence of whole elements.
Result<uint64_t> CountBytesElements(std::span<const std::byte> data, std::string_view what);

// Appends one element (its length prefix, then its bytes) to `out`.
// InvalidArgument naming `what` if the element is longer than
// kMaxBytesElement. Throws std::bad_alloc as vector does.
Status AppendBytesElement(std::vector<std::byte>& out, std::string_view element,
                          std::string_view what);

// Bytes that an element of `length` bytes takes: its prefix and itself.
constexpr uint64_t BytesElementSize(uint64_t length) { return kBytesLengthPrefix + length; }

// The elements of a serialised BYTES tensor, front to back, as views into it:
//   for (std::string_view element : BytesElements(data)) ...
// Iteration stops at the end of the data or at the first element that does
// not fit in it, so it never reads out of bounds; it cannot tell the two
// apart, so validate first (ValidateBytesTensor) where the difference
// matters. Does not own the bytes, which must outlive it and its iterators.
class BytesElements {
 public:
  explicit BytesElements(std::span<const std::byte> data) : data_(data) {}

  class Iterator {
   public:
    using iterator_category = std::input_iterator_tag;
    using value_type = std::string_view;
    using difference_type = std::ptrdiff_t;
    using pointer = const std::string_view*;
    using reference = std::string_view;

    Iterator() = default;  // the end
    std::string_view operator*() const { return element_; }
    pointer operator->() const { return &element_; }
    Iterator& operator++() {
      Advance();
      return *this;
    }
    Iterator operator++(int) {
      Iterator before = *this;
      Advance();
      return before;
    }
    // Iterators at the end compare equal whatever their data.
    bool operator==(const Iterator& other) const {
      return at_end_ == other.at_end_ && (at_end_ || next_ == other.next_);
    }
    // The offset of the current element's length prefix in the data.
    size_t offset() const { return offset_; }

   private:
    friend class BytesElements;
    explicit Iterator(std::span<const std::byte> data) : data_(data), at_end_(false) { Advance(); }
    void Advance();

    std::span<const std::byte> data_;
    std::string_view element_;
    size_t offset_ = 0;  // of the current element's prefix
    size_t next_ = 0;    // of the next element's prefix
    bool at_end_ = true;
  };

  Iterator begin() const { return Iterator(data_); }
  Iterator end() const { return Iterator(); }

 private:
  std::span<const std::byte> data_;
};

}  // namespace hearth
