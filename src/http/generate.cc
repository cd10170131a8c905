#include "http/generate.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <new>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/bytes_tensor.h"
#include "common/datatype.h"
#include "common/float16.h"
#include "http/json_body.h"
#include "http/kserve_codec.h"
#include "http/kserve_codec_internal.h"

namespace hearth {
namespace {

using Json = nlohmann::json;
using kserve::DatatypeString;
using kserve::InputLabel;
using kserve::Quote;

const TensorMetadata* FindInput(const ModelMetadata& metadata, const std::string& name) {
  for (const TensorMetadata& input : metadata.inputs) {
    if (input.name == name) return &input;
  }
  return nullptr;
}

std::string InputNames(const ModelMetadata& metadata) {
  std::string names;
  for (const TensorMetadata& input : metadata.inputs) {
    if (!names.empty()) names += ", ";
    names += Quote(input.name);
  }
  return names.empty() ? "none" : names;
}

template <typename T>
void AppendRaw(std::vector<std::byte>& out, T value) {
  const size_t at = out.size();
  out.resize(at + sizeof(T));
  std::memcpy(out.data() + at, &value, sizeof(T));
}

// Appends one JSON value as an element of `dtype`; InvalidArgument naming
// `label` when it is not of that kind or does not fit.
Status AppendElement(std::vector<std::byte>& out, DType dtype, const Json& value,
                     const std::string& label) {
  const std::string datatype = DatatypeString(dtype);
  auto wrong = [&](const char* wanted) {
    return InvalidArgument(
        label + " is " + datatype + ": expected " + wanted + ", got " +
        value.dump(-1, ' ', false, Json::error_handler_t::replace).substr(0, 40));
  };
  auto out_of_range = [&] {
    return InvalidArgument(label + ": " + value.dump() + " is out of the range of " + datatype);
  };
  auto integer = [&]<typename T>(T /*tag*/) -> Status {
    if (!value.is_number_integer()) return wrong("an integer");
    if (value.is_number_unsigned()) {
      const auto v = value.get<uint64_t>();
      if (v > static_cast<uint64_t>(std::numeric_limits<T>::max())) return out_of_range();
      AppendRaw(out, static_cast<T>(v));
    } else {
      const auto v = value.get<int64_t>();
      if (v < static_cast<int64_t>(std::numeric_limits<T>::min()) ||
          (v > 0 &&
           static_cast<uint64_t>(v) > static_cast<uint64_t>(std::numeric_limits<T>::max()))) {
        return out_of_range();
      }
      AppendRaw(out, static_cast<T>(v));
    }
    return Status::Ok();
  };
  auto number = [&]() -> Result<double> {
    if (!value.is_number()) return wrong("a number");
    const auto v = value.get<double>();
    if (!std::isfinite(v)) return out_of_range();
    return v;
  };
  switch (dtype) {
    case DType::kBytes:
      if (!value.is_string()) return wrong("a string");
      return AppendBytesElement(out, value.get_ref<const std::string&>(), label);
    case DType::kBool:
      if (!value.is_boolean()) return wrong("true or false");
      out.push_back(std::byte{static_cast<uint8_t>(value.get<bool>() ? 1 : 0)});
      return Status::Ok();
    case DType::kU8:
      return integer(uint8_t{});
    case DType::kU16:
      return integer(uint16_t{});
    case DType::kU32:
      return integer(uint32_t{});
    case DType::kU64:
      return integer(uint64_t{});
    case DType::kI8:
      return integer(int8_t{});
    case DType::kI16:
      return integer(int16_t{});
    case DType::kI32:
      return integer(int32_t{});
    case DType::kI64:
      return integer(int64_t{});
    case DType::kF64: {
      ASSIGN_OR_RETURN(const double v, number());
      AppendRaw(out, v);
      return Status::Ok();
    }
    case DType::kF32:
    case DType::kF16:
    case DType::kBF16: {
      ASSIGN_OR_RETURN(const double v, number());
      const auto narrow = static_cast<float>(v);
      if (!std::isfinite(narrow)) return out_of_range();
      if (dtype == DType::kF32) {
        AppendRaw(out, narrow);
        return Status::Ok();
      }
      const uint16_t bits = dtype == DType::kF16 ? FloatToHalf(narrow) : FloatToBFloat16(narrow);
      const float back = dtype == DType::kF16 ? HalfToFloat(bits) : BFloat16ToFloat(bits);
      if (!std::isfinite(back)) return out_of_range();
      AppendRaw(out, bits);
      return Status::Ok();
    }
    case DType::kF8E4M3:
    case DType::kF8E5M2:
      break;
  }
  return InvalidArgument(label + " has datatype " + datatype +
                         ", which a generate request cannot give");
}

// The input `key` of the body, with the value `value`.
Result<InferTensor> ParseInput(const std::string& key, const Json& value,
                               const ModelMetadata& metadata) {
  const std::string label = InputLabel(key);
  const TensorMetadata* expected = FindInput(metadata, key);
  if (expected == nullptr) {
    return InvalidArgument("unknown " + label + " for model " + Quote(metadata.name) +
                           " (its inputs: " + InputNames(metadata) + ")");
  }
  InferTensor tensor;
  tensor.name = key;
  tensor.dtype = expected->dtype;
  std::vector<std::byte> bytes;
  int64_t count = 1;
  if (value.is_array()) {
    count = static_cast<int64_t>(value.size());
    for (size_t i = 0; i < value.size(); ++i) {
      const Json& element = value[i];
      if (element.is_array() || element.is_object()) {
        return InvalidArgument(label + ": a list of values has one dimension; element " +
                               std::to_string(i) + " is a " + element.type_name());
      }
      RETURN_IF_ERROR(
          AppendElement(bytes, tensor.dtype, element, label + " element " + std::to_string(i)));
    }
  } else if (value.is_object() || value.is_null()) {
    return InvalidArgument(label + ": expected a string, a number, a boolean or a list, got " +
                           value.type_name());
  } else {
    RETURN_IF_ERROR(AppendElement(bytes, tensor.dtype, value, label));
  }
  tensor.shape =
      metadata.max_batch_size > 0 ? std::vector<int64_t>{1, count} : std::vector<int64_t>{count};
  tensor.data = std::move(bytes);
  return tensor;
}

Result<InferRequest> Parse(std::string_view body, const ModelMetadata& metadata,
                           std::string_view version) {
  ASSIGN_OR_RETURN(const Json doc, ParseJsonBody(body));
  if (!doc.is_object()) {
    return InvalidArgument(std::string("a generate request must be a JSON object, got ") +
                           doc.type_name());
  }
  InferRequest request;
  request.model = metadata.name;
  request.version = std::string(version);
  for (const auto& [key, value] : doc.items()) {
    if (key == "id") {
      if (!value.is_string()) {
        return InvalidArgument(std::string("'id' must be a string, got ") + value.type_name());
      }
      request.id = value.get<std::string>();
    } else if (key == "parameters") {
      if (!value.is_object()) {
        return InvalidArgument(std::string("'parameters' must be an object, got ") +
                               value.type_name());
      }
      const std::optional<std::string_view> text = TopLevelValueText(body, "parameters");
      if (!text.has_value()) return Internal("the parameters' text was not found in the body");
      request.parameters_json = std::string(*text);
    } else {
      ASSIGN_OR_RETURN(InferTensor input, ParseInput(key, value, metadata));
      request.inputs.push_back(std::move(input));
    }
  }
  return request;
}

}  // namespace

Result<InferRequest> ParseGenerateRequest(std::string_view body, const ModelMetadata& metadata,
                                          std::string_view version) {
  try {
    return Parse(body, metadata, version);
  } catch (const std::bad_alloc&) {
    return ResourceExhausted("out of memory parsing the generate request");
  }
}

Result<std::string> GenerateResponseJson(const InferResponse& response, std::string_view id) {
  try {
    std::string out = "{\"model_name\":" + Quote(response.model) +
                      ",\"model_version\":" + Quote(response.version);
    const std::string_view shown = response.id.empty() ? id : std::string_view(response.id);
    if (!shown.empty()) out += ",\"id\":" + Quote(shown);
    std::set<std::string_view> written = {"model_name", "model_version", "id"};
    for (const InferTensor& output : response.outputs) {
      if (!written.insert(output.name).second) continue;
      ASSIGN_OR_RETURN(const uint64_t count, kserve::CheckOutputTensor(output));
      out += ',' + Quote(output.name) + ':';
      if (count != 1) {
        kserve::AppendData(out, output, count);
        continue;
      }
      if (output.dtype == DType::kBytes) {
        for (std::string_view element : BytesElements(output.data.bytes())) {
          kserve::AppendBytesString(out, element);
        }
        continue;
      }
      // One element: the list's only value, without its brackets.
      std::string list;
      kserve::AppendData(list, output, 1);
      out.append(list, 1, list.size() - 2);
    }
    out += '}';
    return out;
  } catch (const std::bad_alloc&) {
    return ResourceExhausted("out of memory encoding the response");
  }
}

}  // namespace hearth
