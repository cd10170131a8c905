#include "http/kserve_codec.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <exception>
#include <limits>
#include <map>
#include <set>
#include <type_traits>
#include <utility>

#include <nlohmann/json.hpp>

#include "checkpoint/float16.h"

namespace hearth {
namespace {

using json = nlohmann::json;

// Dumps a string as a JSON string literal. Names and messages may carry bytes
// from the client that are not UTF-8; they are replaced rather than thrown on.
std::string Quote(std::string_view text) {
  return json(std::string(text)).dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string DatatypeString(DType dtype) {
  std::string_view name = KserveDatatypeName(dtype);
  return name.empty() ? std::string(DTypeName(dtype)) : std::string(name);
}

// prod(shape); nullopt on a negative dimension or overflow past 2^62.
std::optional<uint64_t> ElementCount(const std::vector<int64_t>& shape) {
  uint64_t count = 1;
  for (int64_t dim : shape) {
    if (dim < 0) return std::nullopt;
    uint64_t product = 0;
    if (__builtin_mul_overflow(count, static_cast<uint64_t>(dim), &product) ||
        product > (uint64_t{1} << 62)) {
      return std::nullopt;
    }
    count = product;
  }
  return count;
}

std::string InputLabel(const std::string& name) { return "input " + Quote(name); }

template <typename T>
void StoreElement(std::vector<std::byte>& data, size_t index, T value) {
  std::memcpy(data.data() + index * sizeof(T), &value, sizeof(T));
}

template <typename T>
Status StoreInteger(const json& element, size_t index, DType dtype, const std::string& input,
                    std::vector<std::byte>& data) {
  if (!element.is_number_integer()) {
    return InvalidArgument(InputLabel(input) + ": element " + std::to_string(index) + " (" +
                           element.dump(-1, ' ', false, json::error_handler_t::replace) +
                           ") is not an integer; " + DatatypeString(dtype) + " needs integers");
  }
  bool in_range = false;
  T value{};
  if (element.is_number_unsigned()) {
    const uint64_t raw = element.get<uint64_t>();
    in_range = raw <= static_cast<uint64_t>(std::numeric_limits<T>::max());
    value = static_cast<T>(raw);
  } else {
    const int64_t raw = element.get<int64_t>();
    in_range = raw >= static_cast<int64_t>(std::numeric_limits<T>::min()) &&
               (raw < 0 || static_cast<uint64_t>(raw) <=
                               static_cast<uint64_t>(std::numeric_limits<T>::max()));
    value = static_cast<T>(raw);
  }
  if (!in_range) {
    return InvalidArgument(InputLabel(input) + ": element " + std::to_string(index) + " (" +
                           element.dump() + ") is out of range for " + DatatypeString(dtype));
  }
  StoreElement(data, index, value);
  return Status::Ok();
}

Status StoreElementAs(const json& element, size_t index, DType dtype, const std::string& input,
                      std::vector<std::byte>& data) {
  switch (dtype) {
    case DType::kBool:
      if (!element.is_boolean()) {
        return InvalidArgument(InputLabel(input) + ": element " + std::to_string(index) + " (" +
                               element.dump(-1, ' ', false, json::error_handler_t::replace) +
                               ") is not a boolean; BOOL needs true or false");
      }
      StoreElement(data, index, static_cast<uint8_t>(element.get<bool>() ? 1 : 0));
      return Status::Ok();
    case DType::kU8:
      return StoreInteger<uint8_t>(element, index, dtype, input, data);
    case DType::kI8:
      return StoreInteger<int8_t>(element, index, dtype, input, data);
    case DType::kI16:
      return StoreInteger<int16_t>(element, index, dtype, input, data);
    case DType::kI32:
      return StoreInteger<int32_t>(element, index, dtype, input, data);
    case DType::kI64:
      return StoreInteger<int64_t>(element, index, dtype, input, data);
    case DType::kF16:
    case DType::kBF16:
    case DType::kF32:
    case DType::kF64: {
      if (!element.is_number()) {
        return InvalidArgument(InputLabel(input) + ": element " + std::to_string(index) + " (" +
                               element.dump(-1, ' ', false, json::error_handler_t::replace) +
                               ") is not a number; " + DatatypeString(dtype) + " needs numbers");
      }
      const double value = element.get<double>();
      if (dtype == DType::kF64) {
        StoreElement(data, index, value);
        return Status::Ok();
      }
      const auto narrow = static_cast<float>(value);
      bool finite = std::isfinite(narrow);
      uint16_t bits = 0;
      if (dtype == DType::kF16) {
        bits = FloatToHalf(narrow);
        finite = finite && std::isfinite(HalfToFloat(bits));
      } else if (dtype == DType::kBF16) {
        bits = FloatToBFloat16(narrow);
        finite = finite && std::isfinite(BFloat16ToFloat(bits));
      }
      if (!finite) {
        return InvalidArgument(InputLabel(input) + ": element " + std::to_string(index) + " (" +
                               element.dump() + ") is out of range for " + DatatypeString(dtype));
      }
      if (dtype == DType::kF32) {
        StoreElement(data, index, narrow);
      } else {
        StoreElement(data, index, bits);
      }
      return Status::Ok();
    }
    case DType::kF8E4M3:
    case DType::kF8E5M2:
      break;
  }
  return InvalidArgument(InputLabel(input) + ": datatype " + DatatypeString(dtype) +
                         " is not supported");
}

// Collects the scalars of nested `data` in row-major order, checking at each
// level that the array has shape[depth] entries.
Status FlattenNested(const json& node, const std::vector<int64_t>& shape, size_t depth,
                     const std::string& input, std::vector<const json*>& out) {
  if (!node.is_array() || node.size() != static_cast<uint64_t>(shape[depth])) {
    return InvalidArgument(InputLabel(input) + ": nested data does not match shape " +
                           ShapeString(shape) + " at depth " + std::to_string(depth) +
                           " (arrays must be rectangular)");
  }
  const bool last = depth + 1 == shape.size();
  for (const json& child : node) {
    if (last) {
      if (child.is_array() || child.is_object()) {
        return InvalidArgument(InputLabel(input) + ": nested data does not match shape " +
                               ShapeString(shape) + ": it is deeper than the shape");
      }
      out.push_back(&child);
    } else {
      RETURN_IF_ERROR(FlattenNested(child, shape, depth + 1, input, out));
    }
  }
  return Status::Ok();
}

Status ParseShape(const json& input, const std::string& name, std::vector<int64_t>& shape) {
  const auto it = input.find("shape");
  if (it == input.end() || !it->is_array()) {
    return InvalidArgument(InputLabel(name) + ": 'shape' must be an array of integers");
  }
  if (it->size() > kMaxTensorRank) {
    return InvalidArgument(InputLabel(name) + ": shape has " + std::to_string(it->size()) +
                           " dimensions; at most " + std::to_string(kMaxTensorRank) +
                           " are supported");
  }
  for (const json& dim : *it) {
    if (!dim.is_number_integer() || (!dim.is_number_unsigned() && dim.get<int64_t>() < 0) ||
        (dim.is_number_unsigned() &&
         dim.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))) {
      return InvalidArgument(InputLabel(name) + ": 'shape' must be an array of non-negative "
                                                "integers");
    }
    shape.push_back(dim.get<int64_t>());
  }
  return Status::Ok();
}

// Reads an optional boolean parameter; `out` keeps its value when absent.
Status OptionalBool(const json& parameters, const char* key, const std::string& where,
                    bool& out) {
  const auto it = parameters.find(key);
  if (it == parameters.end()) return Status::Ok();
  if (!it->is_boolean()) {
    return InvalidArgument(where + ": parameter '" + key + "' must be a boolean");
  }
  out = it->get<bool>();
  return Status::Ok();
}

Status ParametersObject(const json& holder, const std::string& where, const json** out) {
  static const json kEmpty = json::object();
  *out = &kEmpty;
  const auto it = holder.find("parameters");
  if (it == holder.end()) return Status::Ok();
  if (!it->is_object()) return InvalidArgument(where + ": 'parameters' must be an object");
  *out = &*it;
  return Status::Ok();
}

struct PendingBinary {
  size_t input_index;
  uint64_t size;
};

Result<InferRequest> ParseInferRequestOrThrow(std::string_view body,
                                              std::optional<uint64_t> json_length,
                                              std::string_view model, std::string_view version) {
  std::string_view json_text = body;
  std::string_view binary;
  if (json_length.has_value()) {
    if (*json_length > body.size()) {
      return InvalidArgument("Inference-Header-Content-Length " + std::to_string(*json_length) +
                             " exceeds the body's " + std::to_string(body.size()) + " bytes");
    }
    json_text = body.substr(0, *json_length);
    binary = body.substr(*json_length);
  }
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::parse_error& e) {
    return InvalidArgument(std::string("invalid JSON in the request: ") + e.what());
  }
  if (!root.is_object()) return InvalidArgument("the request must be a JSON object");

  InferRequest request;
  request.model = std::string(model);
  request.version = std::string(version);
  if (const auto id = root.find("id"); id != root.end()) {
    if (!id->is_string()) return InvalidArgument("'id' must be a string");
    request.id = id->get<std::string>();
  }
  const json* parameters = nullptr;
  RETURN_IF_ERROR(ParametersObject(root, "request", &parameters));
  RETURN_IF_ERROR(
      OptionalBool(*parameters, "binary_data_output", "request", request.binary_data_output));
  if (const auto timeout = parameters->find("timeout"); timeout != parameters->end()) {
    if (!timeout->is_number_integer() ||
        (!timeout->is_number_unsigned() && timeout->get<int64_t>() < 0)) {
      return InvalidArgument(
          "request: parameter 'timeout' must be a non-negative integer (microseconds)");
    }
    request.timeout_us = timeout->get<uint64_t>();
  }

  const auto inputs = root.find("inputs");
  if (inputs == root.end() || !inputs->is_array()) {
    return InvalidArgument("the request needs an 'inputs' array");
  }
  std::vector<PendingBinary> pending;
  for (size_t i = 0; i < inputs->size(); ++i) {
    const json& input = (*inputs)[i];
    if (!input.is_object()) {
      return InvalidArgument("input #" + std::to_string(i) + " must be an object");
    }
    const auto name = input.find("name");
    if (name == input.end() || !name->is_string()) {
      return InvalidArgument("input #" + std::to_string(i) + ": 'name' must be a string");
    }
    InferTensor tensor;
    tensor.name = name->get<std::string>();
    const std::string label = InputLabel(tensor.name);
    const auto datatype = input.find("datatype");
    if (datatype == input.end() || !datatype->is_string()) {
      return InvalidArgument(label + ": 'datatype' must be a string");
    }
    const std::optional<DType> dtype = ParseKserveDatatype(datatype->get<std::string>());
    if (!dtype.has_value()) {
      return InvalidArgument(label + ": unsupported datatype " + Quote(datatype->get<std::string>()));
    }
    tensor.dtype = *dtype;
    RETURN_IF_ERROR(ParseShape(input, tensor.name, tensor.shape));
    const std::optional<uint64_t> count = ElementCount(tensor.shape);
    if (!count.has_value()) {
      return InvalidArgument(label + ": shape " + ShapeString(tensor.shape) + " is too large");
    }
    const uint64_t element_size = DTypeSize(tensor.dtype);

    const json* input_parameters = nullptr;
    RETURN_IF_ERROR(ParametersObject(input, label, &input_parameters));
    const auto binary_size = input_parameters->find("binary_data_size");
    const auto data = input.find("data");
    if (binary_size != input_parameters->end()) {
      if (data != input.end()) {
        return InvalidArgument(label + " has both 'data' and parameter 'binary_data_size'");
      }
      if (!binary_size->is_number_unsigned()) {
        return InvalidArgument(label +
                               ": parameter 'binary_data_size' must be a non-negative integer");
      }
      const uint64_t size = binary_size->get<uint64_t>();
      // count <= 2^62 and element_size <= 8: no overflow.
      if (size != *count * element_size) {
        return InvalidArgument("binary sizes do not add up: " + label + " declares " +
                               std::to_string(size) + " bytes but shape " +
                               ShapeString(tensor.shape) + " of " + DatatypeString(tensor.dtype) +
                               " needs " + std::to_string(*count * element_size));
      }
      pending.push_back({request.inputs.size(), size});
    } else {
      if (data == input.end()) {
        return InvalidArgument(label + " has no 'data' and no parameter 'binary_data_size'");
      }
      std::vector<const json*> elements;
      if (!data->is_array()) {
        return InvalidArgument(label + ": 'data' must be an array");
      }
      const bool nested = !data->empty() && (*data)[0].is_array();
      if (nested && !tensor.shape.empty()) {
        RETURN_IF_ERROR(FlattenNested(*data, tensor.shape, 0, tensor.name, elements));
      } else {
        elements.reserve(data->size());
        for (const json& element : *data) elements.push_back(&element);
      }
      if (elements.size() != *count) {
        return InvalidArgument(label + ": 'data' has " + std::to_string(elements.size()) +
                               " elements but shape " + ShapeString(tensor.shape) + " needs " +
                               std::to_string(*count));
      }
      tensor.data.resize(elements.size() * element_size);
      for (size_t e = 0; e < elements.size(); ++e) {
        RETURN_IF_ERROR(StoreElementAs(*elements[e], e, tensor.dtype, tensor.name, tensor.data));
      }
    }
    request.inputs.push_back(std::move(tensor));
  }

  uint64_t declared = 0;
  for (const PendingBinary& part : pending) declared += part.size;  // each <= 2^65: see above
  if (declared != binary.size()) {
    return InvalidArgument("binary sizes do not add up: inputs declare " +
                           std::to_string(declared) + " bytes of binary data but the body has " +
                           std::to_string(binary.size()) + " after the JSON" +
                           (json_length.has_value() ? ""
                                                    : " (no Inference-Header-Content-Length)"));
  }
  size_t offset = 0;
  for (const PendingBinary& part : pending) {
    const auto* begin = reinterpret_cast<const std::byte*>(binary.data() + offset);
    request.inputs[part.input_index].data.assign(begin, begin + part.size);
    offset += part.size;
  }

  if (const auto outputs = root.find("outputs"); outputs != root.end()) {
    if (!outputs->is_array()) return InvalidArgument("'outputs' must be an array");
    for (size_t i = 0; i < outputs->size(); ++i) {
      const json& output = (*outputs)[i];
      if (!output.is_object()) {
        return InvalidArgument("output #" + std::to_string(i) + " must be an object");
      }
      const auto name = output.find("name");
      if (name == output.end() || !name->is_string()) {
        return InvalidArgument("output #" + std::to_string(i) + ": 'name' must be a string");
      }
      RequestedOutput requested;
      requested.name = name->get<std::string>();
      requested.binary = request.binary_data_output;
      const std::string label = "output " + Quote(requested.name);
      const json* output_parameters = nullptr;
      RETURN_IF_ERROR(ParametersObject(output, label, &output_parameters));
      RETURN_IF_ERROR(OptionalBool(*output_parameters, "binary_data", label, requested.binary));
      request.outputs.push_back(std::move(requested));
    }
  }
  return request;
}

const TensorMetadata* FindTensor(const std::vector<TensorMetadata>& tensors,
                                 const std::string& name) {
  for (const TensorMetadata& tensor : tensors) {
    if (tensor.name == name) return &tensor;
  }
  return nullptr;
}

// Appends the elements of `tensor` as JSON values; floats in their shortest
// form that reads back to the same value, non-finite values as null (JSON has
// no NaN or infinity).
template <typename T>
void AppendNumber(std::string& out, T value) {
  if constexpr (std::is_floating_point_v<T>) {
    if (!std::isfinite(value)) {
      out += "null";
      return;
    }
  }
  char buffer[64];
  const auto result = std::to_chars(buffer, buffer + sizeof(buffer), value);
  out.append(buffer, result.ptr);
}

template <typename T>
T LoadElement(const std::vector<std::byte>& data, size_t index) {
  T value;
  std::memcpy(&value, data.data() + index * sizeof(T), sizeof(T));
  return value;
}

void AppendData(std::string& out, const InferTensor& tensor, size_t count) {
  out += '[';
  for (size_t i = 0; i < count; ++i) {
    if (i > 0) out += ',';
    switch (tensor.dtype) {
      case DType::kBool:
        out += LoadElement<uint8_t>(tensor.data, i) != 0 ? "true" : "false";
        break;
      case DType::kU8:
        AppendNumber(out, LoadElement<uint8_t>(tensor.data, i));
        break;
      case DType::kI8:
        AppendNumber(out, LoadElement<int8_t>(tensor.data, i));
        break;
      case DType::kI16:
        AppendNumber(out, LoadElement<int16_t>(tensor.data, i));
        break;
      case DType::kI32:
        AppendNumber(out, LoadElement<int32_t>(tensor.data, i));
        break;
      case DType::kI64:
        AppendNumber(out, LoadElement<int64_t>(tensor.data, i));
        break;
      case DType::kF16:
        AppendNumber(out, HalfToFloat(LoadElement<uint16_t>(tensor.data, i)));
        break;
      case DType::kBF16:
        AppendNumber(out, BFloat16ToFloat(LoadElement<uint16_t>(tensor.data, i)));
        break;
      case DType::kF32:
        AppendNumber(out, LoadElement<float>(tensor.data, i));
        break;
      case DType::kF64:
        AppendNumber(out, LoadElement<double>(tensor.data, i));
        break;
      case DType::kF8E4M3:
      case DType::kF8E5M2:
        out += "null";  // refused before encoding; see EncodeInferResponse
        break;
    }
  }
  out += ']';
}

void AppendShape(std::string& out, const std::vector<int64_t>& shape) {
  out += ShapeString(shape);
}

}  // namespace

Result<InferRequest> ParseInferRequest(std::string_view body, std::optional<uint64_t> json_length,
                                       std::string_view model, std::string_view version) {
  try {
    return ParseInferRequestOrThrow(body, json_length, model, version);
  } catch (const std::bad_alloc&) {
    return ResourceExhausted("out of memory parsing the request");
  } catch (const std::exception& e) {
    // nlohmann's accessors are guarded by type checks above; this is a backstop.
    return InvalidArgument(std::string("malformed request: ") + e.what());
  }
}

Status ValidateInferRequest(const InferRequest& request, const ModelMetadata& metadata) {
  const std::string model = Quote(metadata.name);
  std::set<std::string> seen;
  std::optional<int64_t> batch;
  std::string batch_input;
  for (const InferTensor& input : request.inputs) {
    const std::string label = InputLabel(input.name);
    if (!seen.insert(input.name).second) return InvalidArgument("duplicate " + label);
    const TensorMetadata* expected = FindTensor(metadata.inputs, input.name);
    if (expected == nullptr) return InvalidArgument("unknown " + label + " for model " + model);
    if (input.dtype != expected->dtype) {
      return InvalidArgument(label + ": datatype " + DatatypeString(input.dtype) +
                             " does not match the model's " + DatatypeString(expected->dtype));
    }
    const bool batched = metadata.max_batch_size > 0;
    // With batching the model's shape starts with -1 for the batch.
    const size_t skip = batched ? 1 : 0;
    const bool rank_ok = expected->shape.size() >= skip && input.shape.size() == expected->shape.size();
    bool dims_ok = rank_ok;
    for (size_t d = skip; dims_ok && d < input.shape.size(); ++d) {
      dims_ok = expected->shape[d] < 0 || expected->shape[d] == input.shape[d];
    }
    if (!dims_ok) {
      return InvalidArgument(label + ": shape " + ShapeString(input.shape) +
                             " does not match the model's " + ShapeString(expected->shape));
    }
    if (batched) {
      const int64_t n = input.shape[0];
      if (n < 1) return InvalidArgument(label + ": batch of " + std::to_string(n) + " is empty");
      if (n > metadata.max_batch_size) {
        return InvalidArgument(label + ": batch of " + std::to_string(n) +
                               " exceeds max_batch_size " +
                               std::to_string(metadata.max_batch_size));
      }
      if (!batch.has_value()) {
        batch = n;
        batch_input = input.name;
      } else if (*batch != n) {
        return InvalidArgument("inputs disagree on the batch size: " + InputLabel(batch_input) +
                               " has " + std::to_string(*batch) + ", " + label + " has " +
                               std::to_string(n));
      }
    }
  }
  for (const TensorMetadata& expected : metadata.inputs) {
    if (seen.count(expected.name) == 0) {
      return InvalidArgument("missing " + InputLabel(expected.name) + " for model " + model);
    }
  }
  std::set<std::string> requested;
  for (const RequestedOutput& output : request.outputs) {
    if (FindTensor(metadata.outputs, output.name) == nullptr) {
      return InvalidArgument("unknown output " + Quote(output.name) + " requested from model " +
                             model);
    }
    if (!requested.insert(output.name).second) {
      return InvalidArgument("output " + Quote(output.name) + " is requested twice");
    }
  }
  return Status::Ok();
}

OutputSelection SelectionOf(const InferRequest& request) {
  return OutputSelection{request.id, request.outputs, request.binary_data_output};
}

Result<EncodedInferResponse> EncodeInferResponse(const InferResponse& response,
                                                 const OutputSelection& selection) {
  struct Chosen {
    const InferTensor* tensor;
    bool binary;
  };
  std::vector<Chosen> chosen;
  if (selection.outputs.empty()) {
    for (const InferTensor& output : response.outputs) {
      chosen.push_back({&output, selection.binary_data_output});
    }
  } else {
    for (const RequestedOutput& requested : selection.outputs) {
      const InferTensor* found = nullptr;
      for (const InferTensor& output : response.outputs) {
        if (output.name == requested.name) found = &output;
      }
      if (found == nullptr) {
        return Internal("the model did not return requested output " + Quote(requested.name));
      }
      chosen.push_back({found, requested.binary});
    }
  }
  try {
    std::string out = "{\"model_name\":" + Quote(response.model) +
                      ",\"model_version\":" + Quote(response.version);
    const std::string& id = response.id.empty() ? selection.id : response.id;
    if (!id.empty()) out += ",\"id\":" + Quote(id);
    out += ",\"outputs\":[";
    size_t binary_bytes = 0;
    for (size_t i = 0; i < chosen.size(); ++i) {
      const InferTensor& tensor = *chosen[i].tensor;
      const std::string_view datatype = KserveDatatypeName(tensor.dtype);
      if (datatype.empty()) {
        return Internal("output " + Quote(tensor.name) + " has datatype " +
                        std::string(DTypeName(tensor.dtype)) + ", which KServe cannot name");
      }
      const std::optional<uint64_t> count = ElementCount(tensor.shape);
      if (!count.has_value() || tensor.data.size() != *count * DTypeSize(tensor.dtype)) {
        return Internal("output " + Quote(tensor.name) + " has " +
                        std::to_string(tensor.data.size()) + " bytes, which does not match shape " +
                        ShapeString(tensor.shape) + " of " + std::string(datatype));
      }
      if (i > 0) out += ',';
      out += "{\"name\":" + Quote(tensor.name) + ",\"datatype\":\"" + std::string(datatype) +
             "\",\"shape\":";
      AppendShape(out, tensor.shape);
      if (chosen[i].binary) {
        out += ",\"parameters\":{\"binary_data_size\":" + std::to_string(tensor.data.size()) + "}}";
        binary_bytes += tensor.data.size();
      } else {
        out += ",\"data\":";
        AppendData(out, tensor, static_cast<size_t>(*count));
        out += '}';
      }
    }
    out += "]}";
    EncodedInferResponse encoded;
    const bool any_binary =
        std::any_of(chosen.begin(), chosen.end(), [](const Chosen& c) { return c.binary; });
    if (any_binary) {
      encoded.json_length = out.size();
      out.reserve(out.size() + binary_bytes);
      for (const Chosen& c : chosen) {
        if (!c.binary) continue;
        out.append(reinterpret_cast<const char*>(c.tensor->data.data()), c.tensor->data.size());
      }
    }
    encoded.body = std::move(out);
    return encoded;
  } catch (const std::bad_alloc&) {
    return ResourceExhausted("out of memory encoding the response");
  }
}

std::string ModelMetadataJson(const ModelMetadata& metadata) {
  auto tensors = [](const std::vector<TensorMetadata>& list) {
    json out = json::array();
    for (const TensorMetadata& tensor : list) {
      out.push_back({{"name", tensor.name},
                     {"datatype", DatatypeString(tensor.dtype)},
                     {"shape", tensor.shape}});
    }
    return out;
  };
  json out = {{"name", metadata.name},
              {"versions", metadata.versions},
              {"platform", metadata.platform},
              {"inputs", tensors(metadata.inputs)},
              {"outputs", tensors(metadata.outputs)}};
  if (metadata.max_batch_size > 0) out["max_batch_size"] = metadata.max_batch_size;
  return out.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string ServerMetadataJson(std::string_view name, std::string_view version,
                               const std::vector<std::string>& extensions) {
  const json out = {
      {"name", std::string(name)}, {"version", std::string(version)}, {"extensions", extensions}};
  return out.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string ErrorJson(std::string_view message) { return "{\"error\":" + Quote(message) + "}"; }

int HttpStatusFor(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return 200;
    case StatusCode::kInvalidArgument:
    case StatusCode::kFailedPrecondition:
      return 400;
    case StatusCode::kNotFound:
      return 404;
    case StatusCode::kResourceExhausted:
    case StatusCode::kUnavailable:
      return 503;
    case StatusCode::kDeadlineExceeded:
      return 504;
    default:
      return 500;
  }
}

Result<uint64_t> ParseJsonLength(std::string_view value) {
  uint64_t length = 0;
  const auto result = std::from_chars(value.data(), value.data() + value.size(), length);
  if (value.empty() || result.ec != std::errc() || result.ptr != value.data() + value.size() ||
      value.front() == '-' || value.front() == '+') {
    return InvalidArgument("Inference-Header-Content-Length must be a byte count, got " +
                           Quote(value));
  }
  return length;
}

}  // namespace hearth
