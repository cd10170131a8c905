// ParseInferRequest: the JSON of an infer request, read with simdjson's
// On-Demand API straight into the element types of the tensors, and the
// binary tensor data extension, whose inputs become views into the body.
//
// On-Demand reads a document once, front to back, and checks only what it is
// asked to read. The decoder therefore reads every value, those it has no use
// for through SkipChecked, so that malformed JSON anywhere is refused. When a
// request fails, the document is walked once more (CheckJson) so that a
// syntax error anywhere wins over a complaint about the content, as it did
// when the whole document was parsed before it was looked at.
#include <simdjson.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/bytes_tensor.h"
#include "common/checked_size.h"
#include "common/float16.h"
#include "http/json_tensor_data.h"
#include "http/json_values.h"
#include "http/kserve_codec.h"
#include "http/kserve_codec_internal.h"
#include "server/request_admission.h"

namespace hearth {
namespace {

namespace ondemand = simdjson::ondemand;
using json_tensor_data::DataTarget;
using json_tensor_data::ReadBytesData;
using json_tensor_data::ReadDataAs;
using json_values::CheckJson;
using json_values::Describe;
using json_values::IsJsonNumber;
using json_values::Malformed;
using json_values::SkipChecked;
using json_values::Token;
using json_values::TypeFault;
using kserve::DatatypeString;
using kserve::InputLabel;
using kserve::Quote;
using simdjson::error_code;

static_assert(kRequestBodyPadding >= simdjson::SIMDJSON_PADDING,
              "simdjson reads up to SIMDJSON_PADDING bytes past the JSON");

// Each I/O thread keeps one parser for documents up to this size; its buffers
// grow to about 6 bytes per byte of the largest one. Larger documents get a
// parser of their own, freed afterwards.
constexpr size_t kKeptParserBytes = size_t{4} << 20;

enum class ShapeFault { kNone, kMissing, kBadDim, kTooManyDims };

// What the first pass over an input object found. Checked in a fixed order
// once the input is read (or when `data` comes after name, datatype and
// shape), so that errors name the input whatever the order of its fields.
struct InputFields {
  std::optional<std::string> name;
  bool datatype_seen = false;
  std::optional<std::string> datatype;  // absent: missing or not a string
  bool shape_seen = false;
  std::vector<int64_t> shape;
  ShapeFault shape_fault = ShapeFault::kMissing;
  size_t rank = 0;
  bool parameters_bad = false;
  bool binary_size_bad = false;
  std::optional<uint64_t> binary_size;
  // Every parameter but binary_data_size, for the service.
  Parameters parameters;
  std::optional<size_t> data_field;  // position of `data` among the fields
  bool data_read = false;
  bool header_checked = false;
  uint64_t count = 0;
};

struct PendingOutput {
  std::string name;
  std::optional<bool> binary;
  Parameters parameters;  // every one but binary_data, for the service
};

// Inputs sent as binary data, in input order.
struct BinaryInput {
  size_t index;  // in InferRequest::inputs
  uint64_t size;
  uint64_t count;  // elements of its shape
};

// Reads the document into an InferRequest; binary inputs are left for the
// caller, who owns the body (TakeBinaryInputs()).
class RequestDecoder {
 public:
  explicit RequestDecoder(std::string_view json) : json_(json) {}

  Status Decode(ondemand::document& doc, InferRequest& request) {
    ondemand::object root;
    if (error_code e = doc.get_object().get(root)) {
      return e == simdjson::INCORRECT_TYPE ? InvalidArgument("the request must be a JSON object")
                                           : Malformed(e);
    }
    std::vector<PendingOutput> outputs;
    unsigned seen = 0;
    const Status walked =
        ForEachField(root, [&](std::string_view key, ondemand::value& value) -> Status {
          const unsigned bit = key == "id"           ? 1u
                               : key == "parameters" ? 2u
                               : key == "inputs"     ? 4u
                               : key == "outputs"    ? 8u
                                                     : 0u;
          if (bit != 0 && (seen & bit) != 0) {
            return InvalidArgument("the request has '" + std::string(key) + "' twice");
          }
          seen |= bit;
          if (bit == 1) {
            std::string_view id;
            if (error_code e = value.get_string().get(id)) {
              return TypeFault(value, e) == simdjson::INCORRECT_TYPE
                         ? InvalidArgument("'id' must be a string")
                         : Malformed(e);
            }
            request.id = std::string(id);
          } else if (bit == 2) {
            RETURN_IF_ERROR(RequestParameters(value, request));
          } else if (bit == 4) {
            RETURN_IF_ERROR(Inputs(value, request));
          } else if (bit == 8) {
            RETURN_IF_ERROR(Outputs(value, outputs));
          } else if (error_code e = SkipChecked(value, 1)) {
            return Malformed(e);
          }
          return Status::Ok();
        });
    if (!walked.ok()) return walked;
    if ((seen & 4) == 0) return InvalidArgument("the request needs an 'inputs' array");
    const char* trailing = nullptr;
    if (doc.current_location().get(trailing) == simdjson::SUCCESS) {
      return Malformed(simdjson::TRAILING_CONTENT);
    }
    for (PendingOutput& output : outputs) {
      RequestedOutput& o = request.outputs.emplace_back();
      o.name = std::move(output.name);
      o.binary = output.binary.value_or(request.binary_data_output);
      o.parameters = std::move(output.parameters);
    }
    return Status::Ok();
  }

  std::vector<BinaryInput> TakeBinaryInputs() { return std::move(binary_inputs_); }

 private:
  // The whole text of a value that starts at `start` (inside json_) and that
  // SkipChecked has found well-formed: a scalar's token, or an array or
  // object up to its closing bracket.
  std::string_view ValueText(std::string_view start) const {
    if (start.empty() || (start.front() != '[' && start.front() != '{')) return start;
    const size_t begin = static_cast<size_t>(start.data() - json_.data());
    int depth = 0;
    bool in_string = false;
    for (size_t i = begin; i < json_.size(); ++i) {
      const char c = json_[i];
      if (in_string) {
        if (c == '\\') {
          ++i;
        } else if (c == '"') {
          in_string = false;
        }
      } else if (c == '"') {
        in_string = true;
      } else if (c == '[' || c == '{') {
        ++depth;
      } else if ((c == ']' || c == '}') && --depth == 0) {
        return json_.substr(begin, i + 1 - begin);
      }
    }
    return start;  // unreachable for a well-formed value
  }

  // binary_data_output is the front-end's; every other parameter goes to
  // the service as it came (request_admission.h applies KServe's rules).
  Status RequestParameters(ondemand::value& value, InferRequest& request) {
    ondemand::object parameters;
    if (error_code e = value.get_object().get(parameters)) {
      return e == simdjson::INCORRECT_TYPE
                 ? InvalidArgument("request: 'parameters' must be an object")
                 : Malformed(e);
    }
    return ForEachField(parameters, [&](std::string_view key, ondemand::value& parameter) {
      if (key == "binary_data_output") {
        if (error_code e = parameter.get_bool().get(request.binary_data_output)) {
          return TypeFault(parameter, e) == simdjson::INCORRECT_TYPE
                     ? InvalidArgument("request: parameter 'binary_data_output' must be a boolean")
                     : Malformed(e);
        }
        return Status::Ok();
      }
      return ReadParameter(key, parameter, 2, request.parameters);
    });
  }

  // A parameter as the service takes it (Parameter): booleans, integers
  // that fit 64 bits and strings typed; any other value as its text.
  Status ReadParameter(std::string_view key, ondemand::value& value, int depth, Parameters& out) {
    Parameter& parameter = out.emplace_back();
    parameter.name = std::string(key);
    ondemand::json_type type;
    if (error_code e = value.type().get(type)) return Malformed(e);
    if (type == ondemand::json_type::boolean) {
      bool flag = false;
      if (error_code e = value.get_bool().get(flag)) return Malformed(e);
      parameter.value = flag;
      return Status::Ok();
    }
    if (type == ondemand::json_type::string) {
      std::string_view text;
      if (error_code e = value.get_string().get(text)) return Malformed(e);
      parameter.value = std::string(text);
      return Status::Ok();
    }
    const std::string_view start = Token(value);
    if (error_code e = SkipChecked(value, depth)) return Malformed(e);
    if (type == ondemand::json_type::number &&
        start.find_first_of(".eE") == std::string_view::npos) {
      const char* end = start.data() + start.size();
      int64_t i = 0;
      if (const auto [at, fault] = std::from_chars(start.data(), end, i);
          fault == std::errc() && at == end) {
        parameter.value = i;
        return Status::Ok();
      }
      uint64_t u = 0;
      if (const auto [at, fault] = std::from_chars(start.data(), end, u);
          fault == std::errc() && at == end) {
        parameter.value = u;
        return Status::Ok();
      }
    }
    parameter.value = JsonText{std::string(ValueText(start))};
    return Status::Ok();
  }

  // Calls each(key, value) for every field of `object`, in document order.
  template <typename Each>
  Status ForEachField(ondemand::object& object, Each&& each) {
    for (auto child : object) {
      ondemand::field field;
      std::string_view key;
      if (error_code e = std::move(child).get(field)) return Malformed(e);
      if (error_code e = field.unescaped_key().get(key)) return Malformed(e);
      RETURN_IF_ERROR(each(key, field.value()));
    }
    return Status::Ok();
  }

  // Calls each(element, index) for every element of the array `value`;
  // `not_array` is the error when `value` is something else.
  template <typename Each>
  Status ForEachElement(ondemand::value& value, const char* not_array, Each&& each) {
    ondemand::array array;
    if (error_code e = value.get_array().get(array)) {
      return e == simdjson::INCORRECT_TYPE ? InvalidArgument(not_array) : Malformed(e);
    }
    size_t index = 0;
    for (auto child : array) {
      ondemand::value element;
      if (error_code e = std::move(child).get(element)) return Malformed(e);
      RETURN_IF_ERROR(each(element, index));
      ++index;
    }
    return Status::Ok();
  }

  Status Inputs(ondemand::value& value, InferRequest& request) {
    return ForEachElement(
        value, "the request needs an 'inputs' array",
        [&](ondemand::value& input, size_t index) { return Input(input, index, request); });
  }

  Status Input(ondemand::value& value, size_t index, InferRequest& request) {
    const std::string number = "input #" + std::to_string(index);
    ondemand::object object;
    if (error_code e = value.get_object().get(object)) {
      return e == simdjson::INCORRECT_TYPE ? InvalidArgument(number + " must be an object")
                                           : Malformed(e);
    }
    InferTensor tensor;
    InputFields fields;
    size_t position = 0;
    unsigned seen = 0;
    const Status walked =
        ForEachField(object, [&](std::string_view key, ondemand::value& member) -> Status {
          const unsigned bit = key == "name"         ? 1u
                               : key == "datatype"   ? 2u
                               : key == "shape"      ? 4u
                               : key == "parameters" ? 8u
                               : key == "data"       ? 16u
                                                     : 0u;
          if (bit != 0 && (seen & bit) != 0) {
            return InvalidArgument(number + " has '" + std::string(key) + "' twice");
          }
          seen |= bit;
          if (key == "name") {
            std::string_view name;
            if (error_code e = member.get_string().get(name)) {
              return TypeFault(member, e) == simdjson::INCORRECT_TYPE
                         ? InvalidArgument(number + ": 'name' must be a string")
                         : Malformed(e);
            }
            fields.name = std::string(name);
          } else if (key == "datatype") {
            fields.datatype_seen = true;
            std::string_view datatype;
            const error_code e = member.get_string().get(datatype);
            if (e == simdjson::SUCCESS) {
              fields.datatype = std::string(datatype);
            } else if (TypeFault(member, e) != simdjson::INCORRECT_TYPE) {
              return Malformed(e);
            } else if (error_code skipped = SkipChecked(member, 3)) {
              return Malformed(skipped);
            }
          } else if (key == "shape") {
            fields.shape_seen = true;
            RETURN_IF_ERROR(ReadShape(member, fields));
          } else if (key == "parameters") {
            RETURN_IF_ERROR(InputParameters(member, fields));
          } else if (key == "data") {
            fields.data_field = position;
            // Read now when the fields it needs came first (the usual order);
            // else in a second pass once they are known.
            if (fields.name.has_value() && fields.datatype_seen && fields.shape_seen) {
              RETURN_IF_ERROR(CheckHeader(fields, index, tensor));
              RETURN_IF_ERROR(ReadTensorData(member, fields, tensor));
              fields.data_read = true;
            }
          } else if (error_code e = SkipChecked(member, 3)) {
            return Malformed(e);
          }
          ++position;
          return Status::Ok();
        });
    if (!walked.ok()) return walked;
    RETURN_IF_ERROR(CheckHeader(fields, index, tensor));
    const std::string label = InputLabel(tensor.name);
    if (fields.parameters_bad) return InvalidArgument(label + ": 'parameters' must be an object");
    if (fields.binary_size_bad) {
      return InvalidArgument(label +
                             ": parameter 'binary_data_size' must be a non-negative integer");
    }
    // The service reads the region and checks the parameters
    // (request_admission.h): any of them makes the input one in shared
    // memory, with no data here.
    const bool in_shared_memory =
        std::any_of(fields.parameters.begin(), fields.parameters.end(), [](const Parameter& p) {
          return p.name == kRegionParameter || p.name == kOffsetParameter ||
                 p.name == kByteSizeParameter;
        });
    tensor.parameters = std::move(fields.parameters);
    if (in_shared_memory) {
      if (fields.data_field.has_value() || fields.binary_size.has_value()) {
        return InvalidArgument(label + " is in shared memory and has " +
                               (fields.data_field.has_value() ? "'data'" : "binary data") +
                               " too; give it once");
      }
    } else if (fields.binary_size.has_value()) {
      if (fields.data_field.has_value()) {
        return InvalidArgument(label + " has both 'data' and parameter 'binary_data_size'");
      }
      const uint64_t size = *fields.binary_size;
      if (tensor.dtype == DType::kBytes) {
        // Any size may be right; the bytes are checked once they are found
        // in the body (Parse). Only too few for the prefixes is known now.
        const std::optional<uint64_t> prefixes = CheckedMul(fields.count, kBytesLengthPrefix);
        if (!prefixes.has_value() || *prefixes > size) {
          return InvalidArgument(label + " declares " + std::to_string(size) +
                                 " bytes of binary data, too few for shape " +
                                 ShapeString(tensor.shape) + " of BYTES: each of its " +
                                 std::to_string(fields.count) +
                                 " elements takes at least a 4-byte length");
        }
      } else {
        ASSIGN_OR_RETURN(const uint64_t needed,
                         CountBytes(fields.count, DTypeSize(tensor.dtype),
                                    label + ": shape " + ShapeString(tensor.shape) + " of " +
                                        DatatypeString(tensor.dtype)));
        if (size != needed) {
          return InvalidArgument("binary sizes do not add up: " + label + " declares " +
                                 std::to_string(size) + " bytes but shape " +
                                 ShapeString(tensor.shape) + " of " + DatatypeString(tensor.dtype) +
                                 " needs " + std::to_string(needed));
        }
      }
      binary_inputs_.push_back({request.inputs.size(), size, fields.count});
    } else if (!fields.data_field.has_value()) {
      return InvalidArgument(label + " has no 'data' and no parameter 'binary_data_size'");
    } else if (!fields.data_read) {
      // Second pass: back to the start of the object, on to `data`.
      bool not_empty = false;
      if (error_code e = object.reset().get(not_empty)) return Malformed(e);
      position = 0;
      for (auto child : object) {
        ondemand::field field;
        if (error_code e = std::move(child).get(field)) return Malformed(e);
        if (position++ != *fields.data_field) continue;
        RETURN_IF_ERROR(ReadTensorData(field.value(), fields, tensor));
        break;
      }
    }
    request.inputs.push_back(std::move(tensor));
    return Status::Ok();
  }

  Status ReadShape(ondemand::value& value, InputFields& fields) {
    ondemand::array dims;
    if (error_code e = value.get_array().get(dims)) {
      if (e != simdjson::INCORRECT_TYPE) return Malformed(e);
      if (error_code skipped = SkipChecked(value, 3)) return Malformed(skipped);
      return Status::Ok();  // shape_fault stays kMissing: not an array
    }
    fields.shape_fault = ShapeFault::kNone;
    for (auto child : dims) {
      ondemand::value dim;
      if (error_code e = std::move(child).get(dim)) return Malformed(e);
      ++fields.rank;
      if (fields.shape_fault == ShapeFault::kNone && fields.rank <= kMaxTensorRank) {
        int64_t size = 0;
        const error_code e = dim.get_int64().get(size);
        if (e == simdjson::SUCCESS && size >= 0) {
          fields.shape.push_back(size);
          continue;
        }
        if (e != simdjson::SUCCESS && TypeFault(dim, e) != simdjson::INCORRECT_TYPE) {
          return Malformed(e);
        }
        fields.shape_fault = ShapeFault::kBadDim;
        if (e == simdjson::SUCCESS) continue;  // a negative integer, read
      }
      if (error_code e = SkipChecked(dim, 4)) return Malformed(e);
    }
    if (fields.rank > kMaxTensorRank) fields.shape_fault = ShapeFault::kTooManyDims;
    return Status::Ok();
  }

  Status InputParameters(ondemand::value& value, InputFields& fields) {
    ondemand::object parameters;
    if (error_code e = value.get_object().get(parameters)) {
      if (e != simdjson::INCORRECT_TYPE) return Malformed(e);
      fields.parameters_bad = true;
      if (error_code skipped = SkipChecked(value, 3)) return Malformed(skipped);
      return Status::Ok();
    }
    return ForEachField(parameters,
                        [&](std::string_view key, ondemand::value& parameter) -> Status {
                          if (key == "binary_data_size") {
                            uint64_t size = 0;
                            const error_code e = parameter.get_uint64().get(size);
                            if (e == simdjson::SUCCESS) {
                              fields.binary_size = size;
                              return Status::Ok();
                            }
                            if (TypeFault(parameter, e) != simdjson::INCORRECT_TYPE)
                              return Malformed(e);
                            fields.binary_size_bad = true;
                            if (error_code skipped = SkipChecked(parameter, 4))
                              return Malformed(skipped);
                            return Status::Ok();
                          }
                          return ReadParameter(key, parameter, 4, fields.parameters);
                        });
  }

  // Checks name, datatype and shape and puts them into `tensor`, once.
  Status CheckHeader(InputFields& fields, size_t index, InferTensor& tensor) {
    if (fields.header_checked) return Status::Ok();
    if (!fields.name.has_value()) {
      return InvalidArgument("input #" + std::to_string(index) + ": 'name' must be a string");
    }
    tensor.name = *fields.name;
    const std::string label = InputLabel(tensor.name);
    if (!fields.datatype.has_value())
      return InvalidArgument(label + ": 'datatype' must be a string");
    const std::optional<DType> dtype = ParseKserveDatatype(*fields.datatype);
    if (!dtype.has_value()) {
      return InvalidArgument(label + ": unsupported datatype " + Quote(*fields.datatype));
    }
    tensor.dtype = *dtype;
    switch (fields.shape_fault) {
      case ShapeFault::kNone:
        break;
      case ShapeFault::kMissing:
        return InvalidArgument(label + ": 'shape' must be an array of integers");
      case ShapeFault::kBadDim:
        return InvalidArgument(label + ": 'shape' must be an array of non-negative integers");
      case ShapeFault::kTooManyDims:
        return InvalidArgument(label + ": shape has " + std::to_string(fields.rank) +
                               " dimensions; at most " + std::to_string(kMaxTensorRank) +
                               " are supported");
    }
    tensor.shape = fields.shape;
    ASSIGN_OR_RETURN(fields.count, ShapeElements(tensor.shape, label));
    fields.header_checked = true;
    return Status::Ok();
  }

  Status ReadTensorData(ondemand::value& value, const InputFields& fields, InferTensor& tensor) {
    const std::string label = InputLabel(tensor.name);
    // Nested when the first entry is an array (and the shape has dimensions
    // to nest along); told from the text, as On-Demand cannot look ahead.
    const std::string_view token = value.raw_json_token();
    bool nested = false;
    if (!tensor.shape.empty() && !token.empty() && token.front() == '[') {
      const char* end = json_.data() + json_.size();
      const char* next = token.data() + 1;
      while (next < end && (*next == ' ' || *next == '\t' || *next == '\n' || *next == '\r')) {
        ++next;
      }
      nested = next < end && *next == '[';
    }
    ondemand::array array;
    if (error_code e = value.get_array().get(array)) {
      if (TypeFault(value, e) != simdjson::INCORRECT_TYPE) return Malformed(e);
      return InvalidArgument(label + ": 'data' must be an array");
    }
    if (tensor.dtype == DType::kBytes) {
      // Each string takes at least three characters (`"",`); its encoded
      // form grows as the strings are read (at most 4/3 of the text for the
      // prefixes, and no more bytes than the text for the strings).
      const uint64_t capacity = fields.count <= (json_.size() + 1) / 3 ? fields.count : 0;
      std::vector<std::byte> bytes;
      bytes.reserve(capacity * kBytesLengthPrefix);
      const DataTarget target{&label, tensor.dtype, &tensor.shape, fields.count, capacity};
      RETURN_IF_ERROR(ReadBytesData(target, &bytes, array, nested));
      tensor.data = std::move(bytes);
      return Status::Ok();
    }
    // Each element takes at least two characters ("1,"): a shape that needs
    // more elements than the text can hold gets no buffer, and the count
    // check reports it.
    const uint64_t capacity = fields.count <= (json_.size() + 1) / 2 ? fields.count : 0;
    ASSIGN_OR_RETURN(const uint64_t buffer_bytes,
                     CountBytes(capacity, DTypeSize(tensor.dtype), label + ": 'data'"));
    std::vector<std::byte> bytes(buffer_bytes);
    const DataTarget target{&label, tensor.dtype, &tensor.shape, fields.count, capacity};
    RETURN_IF_ERROR(ReadDataAs(target, bytes.data(), array, nested));
    tensor.data = std::move(bytes);
    return Status::Ok();
  }

  Status Outputs(ondemand::value& value, std::vector<PendingOutput>& outputs) {
    return ForEachElement(
        value, "'outputs' must be an array",
        [&](ondemand::value& output, size_t index) { return Output(output, index, outputs); });
  }

  Status Output(ondemand::value& value, size_t index, std::vector<PendingOutput>& outputs) {
    const std::string number = "output #" + std::to_string(index);
    ondemand::object object;
    if (error_code e = value.get_object().get(object)) {
      return e == simdjson::INCORRECT_TYPE ? InvalidArgument(number + " must be an object")
                                           : Malformed(e);
    }
    std::optional<std::string> name;
    std::optional<bool> binary;
    bool parameters_bad = false;
    bool binary_bad = false;
    Parameters kept;
    for (auto child : object) {
      ondemand::field field;
      std::string_view key;
      if (error_code e = std::move(child).get(field)) return Malformed(e);
      if (error_code e = field.unescaped_key().get(key)) return Malformed(e);
      ondemand::value& member = field.value();
      if (key == "name") {
        std::string_view text;
        if (error_code e = member.get_string().get(text)) {
          return TypeFault(member, e) == simdjson::INCORRECT_TYPE
                     ? InvalidArgument(number + ": 'name' must be a string")
                     : Malformed(e);
        }
        name = std::string(text);
      } else if (key == "parameters") {
        ondemand::object parameters;
        if (error_code e = member.get_object().get(parameters)) {
          if (e != simdjson::INCORRECT_TYPE) return Malformed(e);
          parameters_bad = true;
          if (error_code skipped = SkipChecked(member, 3)) return Malformed(skipped);
          continue;
        }
        const Status walked = ForEachField(
            parameters, [&](std::string_view parameter_key, ondemand::value& parameter) -> Status {
              if (parameter_key != "binary_data")
                return ReadParameter(parameter_key, parameter, 4, kept);
              bool flag = false;
              const error_code e = parameter.get_bool().get(flag);
              if (e == simdjson::SUCCESS) {
                binary = flag;
                return Status::Ok();
              }
              if (TypeFault(parameter, e) != simdjson::INCORRECT_TYPE) return Malformed(e);
              binary_bad = true;
              if (error_code skipped = SkipChecked(parameter, 4)) return Malformed(skipped);
              return Status::Ok();
            });
        if (!walked.ok()) return walked;
      } else if (error_code e = SkipChecked(member, 3)) {
        return Malformed(e);
      }
    }
    if (!name.has_value()) return InvalidArgument(number + ": 'name' must be a string");
    const std::string label = "output " + Quote(*name);
    if (parameters_bad) return InvalidArgument(label + ": 'parameters' must be an object");
    if (binary_bad) return InvalidArgument(label + ": parameter 'binary_data' must be a boolean");
    outputs.push_back({std::move(*name), binary, std::move(kept)});
    return Status::Ok();
  }

  std::string_view json_;
  std::vector<BinaryInput> binary_inputs_;
};

ondemand::parser& KeptParser() {
  thread_local ondemand::parser parser;
  return parser;
}

Result<InferRequest> Parse(std::string body, std::optional<uint64_t> json_length,
                           std::string_view model, std::string_view version) {
  const size_t body_size = body.size();
  size_t json_size = body_size;
  if (json_length.has_value()) {
    if (*json_length > body_size) {
      return InvalidArgument("Inference-Header-Content-Length " + std::to_string(*json_length) +
                             " exceeds the body's " + std::to_string(body_size) + " bytes");
    }
    json_size = static_cast<size_t>(*json_length);
  }
  // simdjson reads up to kRequestBodyPadding bytes past the JSON: the binary
  // data after it, or bytes appended here, within the capacity the front-end
  // reserved (a body without it is reallocated, i.e. copied, once).
  if (body_size - json_size < kRequestBodyPadding) body.append(kRequestBodyPadding, ' ');
  InferRequest request;
  request.model = std::string(model);
  request.version = std::string(version);
  std::vector<BinaryInput> binary_inputs;
  {
    // The padding must be whitespace while the JSON is parsed: simdjson
    // 3.0.1's On-Demand parser takes the byte just past a document that ends
    // early (`"shape":`) for one more token, and a '[' or '{' there sent it
    // past its index into uninitialised memory (found by
    // fuzz/kserve_request_fuzzer). Binary data serving as padding is put
    // back afterwards: 64 bytes copied twice, the body itself never.
    char* const padding = body.data() + json_size;
    std::array<char, kRequestBodyPadding> binary_start;
    std::memcpy(binary_start.data(), padding, kRequestBodyPadding);
    std::memset(padding, ' ', kRequestBodyPadding);
    struct Restore {
      char* at;
      const char* from;
      ~Restore() { std::memcpy(at, from, kRequestBodyPadding); }
    } restore{padding, binary_start.data()};

    const char* json = body.data();
    const size_t capacity = json_size + kRequestBodyPadding;  // the whitespace only
    std::optional<ondemand::parser> own_parser;
    ondemand::parser& parser = json_size <= kKeptParserBytes ? KeptParser() : own_parser.emplace();
    RequestDecoder decoder(std::string_view(json, json_size));
    ondemand::document doc;
    Status status;
    if (error_code e = parser.iterate(json, json_size, capacity).get(doc)) {
      status = Malformed(e);
    } else {
      status = decoder.Decode(doc, request);
    }
    if (!status.ok()) {
      RETURN_IF_ERROR(CheckJson(json, json_size, capacity));
      return status;
    }
    binary_inputs = decoder.TakeBinaryInputs();
  }
  // Shared from here on: binary inputs become views into it (a move: the
  // bytes stay where they are).
  const auto owner = std::make_shared<const std::string>(std::move(body));
  const char* json = owner->data();

  // Each part matched its shape (below 2^63 bytes), but many of them can
  // still add up past 2^64.
  uint64_t declared = 0;
  for (const BinaryInput& part : binary_inputs) {
    const std::optional<uint64_t> sum = CheckedAdd(declared, part.size);
    if (!sum.has_value()) {
      return InvalidArgument(
          "binary sizes do not add up: inputs declare more than 2^64 bytes of binary data; the "
          "body has " +
          std::to_string(body_size - json_size) + " after the JSON");
    }
    declared = *sum;
  }
  const uint64_t available = body_size - json_size;
  if (declared != available) {
    return InvalidArgument(
        "binary sizes do not add up: inputs declare " + std::to_string(declared) +
        " bytes of binary data but the body has " + std::to_string(available) + " after the JSON" +
        (json_length.has_value() ? "" : " (no Inference-Header-Content-Length)"));
  }
  size_t offset = json_size;
  for (const BinaryInput& part : binary_inputs) {
    const auto* begin = reinterpret_cast<const std::byte*>(json + offset);
    InferTensor& input = request.inputs[part.index];
    input.data = TensorData::Shared(std::span<const std::byte>(begin, part.size), owner);
    offset += part.size;
    if (input.dtype == DType::kBytes) {
      RETURN_IF_ERROR(ValidateBytesTensor(input.data.bytes(), part.count, InputLabel(input.name)));
    }
  }
  return request;
}

}  // namespace

Result<InferRequest> ParseInferRequest(std::string body, std::optional<uint64_t> json_length,
                                       std::string_view model, std::string_view version) {
  try {
    return Parse(std::move(body), json_length, model, version);
  } catch (const std::bad_alloc&) {
    return ResourceExhausted("out of memory parsing the request");
  }
}

}  // namespace hearth
