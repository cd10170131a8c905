#include "http/json_tensor_data.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "common/bytes_tensor.h"
#include "common/checked_size.h"
#include "common/float16.h"
#include "http/json_values.h"
#include "http/kserve_codec_internal.h"

namespace hearth::json_tensor_data {
namespace {

namespace ondemand = simdjson::ondemand;
using json_values::Describe;
using json_values::IsJsonNumber;
using json_values::Malformed;
using json_values::SkipChecked;
using json_values::Token;
using kserve::DatatypeString;
using simdjson::error_code;

// Element readers: each reads one JSON value into its datatype and returns
// SUCCESS, INCORRECT_TYPE (not a boolean, an integer, a number, as the
// datatype needs), NUMBER_OUT_OF_RANGE (more than the datatype holds) or the
// error of malformed JSON.
struct BoolElement {
  static constexpr size_t kSize = 1;
  static error_code Read(ondemand::value& value, std::byte* out) {
    bool flag = false;
    if (error_code e = value.get_bool().get(flag)) return e;
    *out = std::byte{static_cast<uint8_t>(flag ? 1 : 0)};
    return simdjson::SUCCESS;
  }
};

// Why an integer element failed to read: simdjson says INCORRECT_TYPE for
// 1.5 and for 2^63 alike (and fails get_uint64 for -1, 2^64 and 1.5); a JSON
// number without a fraction or exponent is out of range, one with them is
// not an integer.
error_code IntegerFault(ondemand::value& value, error_code e) {
  if (e == simdjson::INCORRECT_TYPE || e == simdjson::NUMBER_ERROR ||
      e == simdjson::NUMBER_OUT_OF_RANGE) {
    const std::string_view token = Token(value);
    if (IsJsonNumber(token)) {
      return token.find_first_of(".eE") == std::string_view::npos ? simdjson::NUMBER_OUT_OF_RANGE
                                                                  : simdjson::INCORRECT_TYPE;
    }
  }
  return e;
}

template <typename T>
struct IntegerElement {
  static constexpr size_t kSize = sizeof(T);
  static error_code Read(ondemand::value& value, std::byte* out) {
    int64_t raw = 0;
    const error_code e = value.get_int64().get(raw);
    if (e == simdjson::SUCCESS) [[likely]] {
      if constexpr (!std::is_same_v<T, int64_t>) {
        if (raw < static_cast<int64_t>(std::numeric_limits<T>::min()) ||
            raw > static_cast<int64_t>(std::numeric_limits<T>::max())) {
          return simdjson::NUMBER_OUT_OF_RANGE;
        }
      }
      const T narrow = static_cast<T>(raw);
      std::memcpy(out, &narrow, sizeof(T));
      return simdjson::SUCCESS;
    }
    return IntegerFault(value, e);
  }
};

// UINT64 reaches past int64's range: read as unsigned.
struct Uint64Element {
  static constexpr size_t kSize = sizeof(uint64_t);
  static error_code Read(ondemand::value& value, std::byte* out) {
    uint64_t raw = 0;
    const error_code e = value.get_uint64().get(raw);
    if (e == simdjson::SUCCESS) [[likely]] {
      std::memcpy(out, &raw, sizeof(raw));
      return simdjson::SUCCESS;
    }
    return IntegerFault(value, e);
  }
};

error_code ReadDouble(ondemand::value& value, double* out) {
  const error_code e = value.get_double().get(*out);
  if (e == simdjson::SUCCESS) [[likely]] {
    return e;
  }
  // 1e400 is JSON, but past a double.
  if (e == simdjson::NUMBER_ERROR && IsJsonNumber(Token(value))) {
    return simdjson::NUMBER_OUT_OF_RANGE;
  }
  return e;
}

struct F64Element {
  static constexpr size_t kSize = 8;
  static error_code Read(ondemand::value& value, std::byte* out) {
    double number = 0;
    if (error_code e = ReadDouble(value, &number)) return e;
    std::memcpy(out, &number, sizeof(number));
    return simdjson::SUCCESS;
  }
};

// FP32, FP16 and BF16: the double rounded to float, then to 16 bits; a value
// that becomes infinite is out of range.
template <DType kType>
struct NarrowFloatElement {
  static constexpr size_t kSize = kType == DType::kF32 ? 4 : 2;
  static error_code Read(ondemand::value& value, std::byte* out) {
    double number = 0;
    if (error_code e = ReadDouble(value, &number)) return e;
    const auto narrow = static_cast<float>(number);
    if (!std::isfinite(narrow)) return simdjson::NUMBER_OUT_OF_RANGE;
    if constexpr (kType == DType::kF32) {
      std::memcpy(out, &narrow, sizeof(narrow));
    } else {
      const uint16_t bits = kType == DType::kF16 ? FloatToHalf(narrow) : FloatToBFloat16(narrow);
      const float back = kType == DType::kF16 ? HalfToFloat(bits) : BFloat16ToFloat(bits);
      if (!std::isfinite(back)) return simdjson::NUMBER_OUT_OF_RANGE;
      std::memcpy(out, &bits, sizeof(bits));
    }
    return simdjson::SUCCESS;
  }
};

// Where the elements of a fixed-size type go: element i at out + i x kSize,
// in a buffer with room for DataTarget::capacity of them.
template <typename Element>
struct FixedSink {
  std::byte* out;
  error_code Read(ondemand::value& value, uint64_t index) {
    return Element::Read(value, out + index * Element::kSize);
  }
};

// BYTES: each element a JSON string, appended unescaped (UTF-8, as simdjson
// checked the whole document) in the serialised form of common/bytes_tensor.h.
// INCORRECT_TYPE for anything but a string; NUMBER_OUT_OF_RANGE for a string
// longer than a length prefix holds (which simdjson's 4 GiB document limit
// rules out).
struct BytesSink {
  std::vector<std::byte>* out;
  error_code Read(ondemand::value& value, uint64_t /*index*/) {
    std::string_view text;
    if (error_code e = value.get_string().get(text)) return e;
    if (!AppendBytesElement(*out, text, "").ok()) return simdjson::NUMBER_OUT_OF_RANGE;
    return simdjson::SUCCESS;
  }
};

// Decodes `data`, flat or nested along the shape, into one element type
// through `Sink` (FixedSink or BytesSink), which takes elements 0..capacity-1.
template <typename Sink>
class DataReader {
 public:
  DataReader(const DataTarget& target, Sink sink) : t_(target), sink_(sink) {}

  Status Read(ondemand::array& array, bool nested) {
    RETURN_IF_ERROR(nested ? Level(array, 0) : Flat(array));
    if (index_ != t_.count || index_ > t_.capacity) {
      return InvalidArgument(*t_.label + ": 'data' has " + std::to_string(index_) +
                             " elements but shape " + ShapeString(*t_.shape) + " needs " +
                             std::to_string(t_.count));
    }
    return Status::Ok();
  }

 private:
  Status Flat(ondemand::array& array) {
    for (auto child : array) {
      ondemand::value value;
      if (error_code e = std::move(child).get(value)) return Malformed(e);
      if (index_ < t_.capacity) [[likely]] {
        const error_code fault = sink_.Read(value, index_);
        if (fault != simdjson::SUCCESS) [[unlikely]] {
          return ElementError(value, fault);
        }
      } else if (error_code e = SkipChecked(value, 0)) {
        return Malformed(e);
      }
      ++index_;
    }
    return Status::Ok();
  }

  Status Level(ondemand::array& array, size_t depth) {
    const auto want = static_cast<uint64_t>((*t_.shape)[depth]);
    const bool last = depth + 1 == t_.shape->size();
    uint64_t entries = 0;
    for (auto child : array) {
      ondemand::value value;
      if (error_code e = std::move(child).get(value)) return Malformed(e);
      if (entries == want) {
        return Mismatch("an array at depth " + std::to_string(depth) + " has more than " +
                        std::to_string(want) + " entries");
      }
      if (last) {
        const error_code fault =
            index_ < t_.capacity ? sink_.Read(value, index_) : simdjson::INCORRECT_TYPE;
        if (fault != simdjson::SUCCESS) [[unlikely]] {
          RETURN_IF_ERROR(LeafFault(value, fault));
        }
        ++index_;
      } else {
        ondemand::array inner;
        const error_code e = value.get_array().get(inner);
        if (e == simdjson::INCORRECT_TYPE) {
          return Mismatch("entry " + std::to_string(entries) + " of an array at depth " +
                          std::to_string(depth) + " is " + Describe(value) +
                          " where an array belongs");
        }
        if (e) return Malformed(e);
        RETURN_IF_ERROR(Level(inner, depth + 1));
      }
      ++entries;
    }
    if (entries != want) {
      return Mismatch("an array at depth " + std::to_string(depth) + " has " +
                      std::to_string(entries) + " entries, not " + std::to_string(want));
    }
    return Status::Ok();
  }

  // An element that the sink refused (or one past a buffer too small
  // for the shape, which is only checked): the error, if it is one.
  Status LeafFault(ondemand::value& value, error_code fault) {
    ondemand::json_type type;
    if (error_code e = value.type().get(type)) return Malformed(e);
    if (type == ondemand::json_type::array || type == ondemand::json_type::object) {
      return InvalidArgument(*t_.label + ": nested data does not match shape " +
                             ShapeString(*t_.shape) + ": it is deeper than the shape");
    }
    if (index_ < t_.capacity) return ElementError(value, fault);
    if (error_code e = SkipChecked(value, 0)) return Malformed(e);
    return Status::Ok();
  }

  Status Mismatch(const std::string& detail) const {
    return InvalidArgument(*t_.label + ": nested data does not match shape " +
                           ShapeString(*t_.shape) + ": " + detail +
                           " (arrays must be rectangular)");
  }

  Status ElementError(ondemand::value& value, error_code fault) const {
    const std::string element =
        *t_.label + ": element " + std::to_string(index_) + " (" + Describe(value) + ")";
    const std::string datatype = DatatypeString(t_.dtype);
    if (fault == simdjson::NUMBER_OUT_OF_RANGE) {
      if (t_.dtype == DType::kBytes) {
        return InvalidArgument(element + " is longer than the " + std::to_string(kMaxBytesElement) +
                               " bytes of a BYTES element");
      }
      return InvalidArgument(element + " is out of range for " + datatype);
    }
    if (fault != simdjson::INCORRECT_TYPE) return Malformed(fault);
    switch (t_.dtype) {
      case DType::kBytes:
        return InvalidArgument(element + " is not a string; BYTES needs strings");
      case DType::kBool:
        return InvalidArgument(element + " is not a boolean; BOOL needs true or false");
      case DType::kF16:
      case DType::kBF16:
      case DType::kF32:
      case DType::kF64:
        return InvalidArgument(element + " is not a number; " + datatype + " needs numbers");
      default:
        return InvalidArgument(element + " is not an integer; " + datatype + " needs integers");
    }
  }

  DataTarget t_;
  Sink sink_;
  uint64_t index_ = 0;
};

template <typename Element>
Status ReadData(const DataTarget& target, std::byte* out, ondemand::array& array, bool nested) {
  return DataReader<FixedSink<Element>>(target, FixedSink<Element>{out}).Read(array, nested);
}

}  // namespace

Status ReadDataAs(const DataTarget& target, std::byte* out, ondemand::array& array, bool nested) {
  switch (target.dtype) {
    case DType::kBool:
      return ReadData<BoolElement>(target, out, array, nested);
    case DType::kU8:
      return ReadData<IntegerElement<uint8_t>>(target, out, array, nested);
    case DType::kU16:
      return ReadData<IntegerElement<uint16_t>>(target, out, array, nested);
    case DType::kU32:
      return ReadData<IntegerElement<uint32_t>>(target, out, array, nested);
    case DType::kU64:
      return ReadData<Uint64Element>(target, out, array, nested);
    case DType::kI8:
      return ReadData<IntegerElement<int8_t>>(target, out, array, nested);
    case DType::kI16:
      return ReadData<IntegerElement<int16_t>>(target, out, array, nested);
    case DType::kI32:
      return ReadData<IntegerElement<int32_t>>(target, out, array, nested);
    case DType::kI64:
      return ReadData<IntegerElement<int64_t>>(target, out, array, nested);
    case DType::kF16:
      return ReadData<NarrowFloatElement<DType::kF16>>(target, out, array, nested);
    case DType::kBF16:
      return ReadData<NarrowFloatElement<DType::kBF16>>(target, out, array, nested);
    case DType::kF32:
      return ReadData<NarrowFloatElement<DType::kF32>>(target, out, array, nested);
    case DType::kF64:
      return ReadData<F64Element>(target, out, array, nested);
    case DType::kF8E4M3:
    case DType::kF8E5M2:
    case DType::kBytes:
      break;
  }
  return InvalidArgument(*target.label + ": datatype " + DatatypeString(target.dtype) +
                         " is not supported");
}

Status ReadBytesData(const DataTarget& target, std::vector<std::byte>* out,
                     simdjson::ondemand::array& array, bool nested) {
  return DataReader<BytesSink>(target, BytesSink{out}).Read(array, nested);
}

}  // namespace hearth::json_tensor_data
