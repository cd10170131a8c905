#include "server/request_admission.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <variant>

#include "common/checked_size.h"
#include "common/datatype.h"
#include "hearth/dtype.h"

namespace hearth {
namespace {

std::string Quote(std::string_view text) {
  return nlohmann::json(std::string(text))
      .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string DatatypeString(DType dtype) {
  std::string_view name = KserveDatatypeName(dtype);
  return name.empty() ? std::string(DTypeName(dtype)) : std::string(name);
}

std::string InputLabel(std::string_view name) { return "input " + Quote(name); }

const TensorMetadata* FindTensor(const std::vector<TensorMetadata>& tensors,
                                 const std::string& name) {
  for (const TensorMetadata& tensor : tensors) {
    if (tensor.name == name) return &tensor;
  }
  return nullptr;
}

// Overloads for std::visit.
template <typename... Fs>
struct Overloaded : Fs... {
  using Fs::operator()...;
};
template <typename... Fs>
Overloaded(Fs...) -> Overloaded<Fs...>;

// A count: an integer of either kind that is not negative.
std::optional<uint64_t> NonNegative(const Parameter& parameter) {
  if (const auto* i = std::get_if<int64_t>(&parameter.value); i != nullptr && *i >= 0)
    return static_cast<uint64_t>(*i);
  if (const auto* u = std::get_if<uint64_t>(&parameter.value)) return *u;
  return std::nullopt;
}

// An integer too large for 64 bits, as JSON can write one.
bool IsHugeInteger(const Parameter& parameter) {
  const auto* text = std::get_if<JsonText>(&parameter.value);
  return text != nullptr && !text->text.empty() &&
         text->text.find_first_not_of("0123456789") == std::string::npos;
}

// Anything but the "none" values 0, false, "" and null.
bool IsSet(const Parameter& parameter) {
  return std::visit(Overloaded{[](std::monostate) { return false; }, [](bool b) { return b; },
                               [](int64_t i) { return i != 0; }, [](uint64_t u) { return u != 0; },
                               [](double d) { return d != 0; },
                               [](const std::string& text) { return !text.empty(); },
                               [](const JsonText& json) { return json.text != "null"; }},
                    parameter.value);
}

// The value as JSON text (nothing: "nothing").
std::string ValueText(const Parameter& parameter) {
  return std::visit(Overloaded{[](std::monostate) { return std::string("nothing"); },
                               [](bool b) { return std::string(b ? "true" : "false"); },
                               [](int64_t i) { return std::to_string(i); },
                               [](uint64_t u) { return std::to_string(u); },
                               [](double d) { return nlohmann::json(d).dump(); },
                               [](const std::string& text) { return Quote(text); },
                               [](const JsonText& json) { return json.text; }},
                    parameter.value);
}

// The value as JSON text, for the model; InvalidArgument for one that JSON
// cannot hold (NaN, infinity) or that has no value.
Result<std::string> JsonOf(const Parameter& parameter) {
  const std::string label = "request: parameter " + Quote(parameter.name);
  if (std::holds_alternative<std::monostate>(parameter.value))
    return InvalidArgument(label + " has no value");
  if (const auto* d = std::get_if<double>(&parameter.value); d != nullptr && !std::isfinite(*d))
    return InvalidArgument(label + " must be a finite number (JSON has no NaN or infinity)");
  return ValueText(parameter);
}

const Parameter* Find(const Parameters& parameters, std::string_view name) {
  const Parameter* found = nullptr;
  for (const Parameter& p : parameters)
    if (p.name == name) found = &p;  // the last one given, as a JSON object reads
  return found;
}

// A tensor's region, offset and byte size, or nullopt when it names none.
Result<std::optional<SharedMemoryRef>> SharedMemoryOf(const Parameters& parameters,
                                                      const std::string& label) {
  const Parameter* region = Find(parameters, kRegionParameter);
  const Parameter* offset = Find(parameters, kOffsetParameter);
  const Parameter* byte_size = Find(parameters, kByteSizeParameter);
  const auto fault = [&](std::string_view name, std::string_view must) {
    return InvalidArgument(label + ": parameter '" + std::string(name) + "' must be " +
                           std::string(must));
  };
  if (region != nullptr) {
    const auto* name = std::get_if<std::string>(&region->value);
    if (name == nullptr || name->empty())
      return fault(kRegionParameter, "a string naming a registered region");
  }
  std::optional<uint64_t> at, size;
  if (offset != nullptr && !(at = NonNegative(*offset)))
    return fault(kOffsetParameter, "a non-negative integer");
  if (byte_size != nullptr && !(size = NonNegative(*byte_size)))
    return fault(kByteSizeParameter, "a non-negative integer");
  if (region == nullptr) {
    if (offset != nullptr || byte_size != nullptr)
      return InvalidArgument(label + ": parameters '" + std::string(kOffsetParameter) + "' and '" +
                             std::string(kByteSizeParameter) + "' need '" +
                             std::string(kRegionParameter) + "', the region they lie in");
    return std::optional<SharedMemoryRef>();
  }
  if (!size.has_value())
    return InvalidArgument(label + ": parameter '" + std::string(kByteSizeParameter) +
                           "' must be given with '" + std::string(kRegionParameter) + "'");
  return std::optional<SharedMemoryRef>(
      SharedMemoryRef(std::get<std::string>(region->value), at.value_or(0), *size));
}

Status AdmitInput(InferTensor& input) {
  if (input.parameters.empty()) return Status::Ok();
  const std::string label = InputLabel(input.name);
  ASSIGN_OR_RETURN(input.shm, SharedMemoryOf(input.parameters, label));
  input.parameters.clear();
  if (!input.shm.has_value()) return Status::Ok();
  if (!input.data.empty())
    return InvalidArgument(label + " is in shared memory and has data too; give it once");
  // BYTES elements are checked once the service has read them.
  if (input.dtype == DType::kBytes) return Status::Ok();
  ASSIGN_OR_RETURN(const uint64_t expected, ShapeBytes(input.dtype, input.shape, label));
  if (input.shm->byte_size != expected)
    return InvalidArgument(label + ": shared_memory_byte_size is " +
                           std::to_string(input.shm->byte_size) + " but shape " +
                           ShapeString(input.shape) + " of " + DatatypeString(input.dtype) +
                           " needs " + std::to_string(expected));
  return Status::Ok();
}

Status AdmitOutput(RequestedOutput& output) {
  if (output.parameters.empty()) return Status::Ok();
  const std::string label = "output " + Quote(output.name);
  ASSIGN_OR_RETURN(output.shm, SharedMemoryOf(output.parameters, label));
  const Parameters parameters = std::move(output.parameters);
  output.parameters.clear();
  for (const Parameter& p : parameters) {
    if (p.name == kClassificationParameter) {
      const std::optional<uint64_t> count = NonNegative(p);
      if (!count.has_value() || *count == 0 || *count > std::numeric_limits<uint32_t>::max())
        return InvalidArgument(label + ": parameter '" + std::string(kClassificationParameter) +
                               "' must be an integer in [1, " +
                               std::to_string(std::numeric_limits<uint32_t>::max()) +
                               "]: how many classes to answer, got " + DescribeParameter(p));
      output.class_count = static_cast<uint32_t>(*count);
    } else if (p.name == "class_count") {
      return InvalidArgument(label +
                             ": there is no parameter 'class_count'; Triton's gRPC protocol "
                             "names it '" +
                             std::string(kClassificationParameter) + "', as its REST one does");
    }
  }
  return Status::Ok();
}

}  // namespace

std::string DescribeParameter(const Parameter& parameter) {
  std::string text = ValueText(parameter);
  // A long value (an array, a long string) only begins the message.
  if (text.size() > 40) text = text.substr(0, 37) + "...";
  return text;
}

Status AdmitParameters(InferRequest& request) {
  std::string model_parameters;
  for (const Parameter& p : request.parameters) {
    if (p.name == kTimeoutParameter) {
      const std::optional<uint64_t> us = NonNegative(p);
      if (!us.has_value())
        return InvalidArgument(
            "request: parameter 'timeout' must be a non-negative integer of microseconds" +
            std::string(IsHugeInteger(p) ? " below 2^64" : "") + ", got " + DescribeParameter(p));
      // Kept as given: the server saturates a deadline too far away to represent.
      request.timeout_us = *us;
    } else if (p.name == kPriorityParameter) {
      const std::optional<uint64_t> level = NonNegative(p);
      if (!level.has_value())
        return InvalidArgument(
            "request: parameter 'priority' must be a non-negative integer (1 is the highest "
            "level, 0 the model's default), got " +
            DescribeParameter(p));
      request.priority = *level;
    } else if (p.name == kSequenceIdParameter) {
      if (const std::optional<uint64_t> id = NonNegative(p)) {
        request.sequence_number = *id;
        request.sequence_id = *id == 0 ? "" : std::to_string(*id);
        request.sequence_id_is_string = false;
      } else if (const auto* text = std::get_if<std::string>(&p.value)) {
        if (text->size() > kMaxSequenceIdBytes)
          return InvalidArgument("request: parameter 'sequence_id' is a string of " +
                                 std::to_string(text->size()) + " bytes, over the limit of " +
                                 std::to_string(kMaxSequenceIdBytes));
        request.sequence_id = *text;
        request.sequence_id_is_string = true;
        request.sequence_number = 0;
      } else if (IsSet(p)) {
        return InvalidArgument(
            "request: parameter 'sequence_id' must be a non-negative integer or a string, got " +
            DescribeParameter(p));
      }
    } else if (p.name == kSequenceStartParameter || p.name == kSequenceEndParameter) {
      const auto* flag = std::get_if<bool>(&p.value);
      if (flag == nullptr && IsSet(p))
        return InvalidArgument("request: parameter " + Quote(p.name) +
                               " must be true or false, got " + DescribeParameter(p));
      (p.name == kSequenceStartParameter ? request.sequence_start : request.sequence_end) =
          flag != nullptr && *flag;
    } else {
      ASSIGN_OR_RETURN(const std::string value, JsonOf(p));
      model_parameters += model_parameters.empty() ? "{" : ",";
      model_parameters += Quote(p.name) + ":" + value;
    }
  }
  if (!model_parameters.empty()) {
    if (!request.parameters_json.empty())
      return Internal("the request has the model's parameters both as text and as parameters");
    request.parameters_json = model_parameters + "}";
  }
  // Applied: a request admitted again (handed to a model's new runtime)
  // keeps what they set.
  request.parameters.clear();
  for (InferTensor& input : request.inputs) RETURN_IF_ERROR(AdmitInput(input));
  for (RequestedOutput& output : request.outputs) RETURN_IF_ERROR(AdmitOutput(output));
  return Status::Ok();
}

uint64_t SharedMemoryInputBytes(const InferRequest& request) {
  uint64_t total = 0;
  for (const InferTensor& input : request.inputs) {
    const Parameter* size = Find(input.parameters, kByteSizeParameter);
    const std::optional<uint64_t> bytes =
        size != nullptr ? NonNegative(*size) : std::optional<uint64_t>();
    if (!bytes.has_value()) continue;
    total = *bytes > std::numeric_limits<uint64_t>::max() - total
                ? std::numeric_limits<uint64_t>::max()
                : total + *bytes;
  }
  return total;
}

Status AdmitInferRequest(InferRequest& request, const ModelMetadata& metadata) {
  RETURN_IF_ERROR(AdmitParameters(request));
  return ValidateInferRequest(request, metadata);
}

Status ValidateInferRequest(const InferRequest& request, const ModelMetadata& metadata) {
  const std::string model = Quote(metadata.name);
  if (!metadata.sequence &&
      (!request.sequence_id.empty() || request.sequence_start || request.sequence_end)) {
    const char* given = !request.sequence_id.empty() ? "sequence_id"
                        : request.sequence_start     ? "sequence_start"
                                                     : "sequence_end";
    return InvalidArgument("model " + model + " has no sequence_batching: send its requests " +
                           "without sequence_id, sequence_start and sequence_end (this one " +
                           "sets " + given + ")");
  }
  if (metadata.sequence && request.sequence_id.empty())
    return InvalidArgument("inference request to model " + model +
                           " must specify a non-zero or non-empty correlation ID (the "
                           "parameter sequence_id): the model serves sequences");
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
    const bool rank_ok =
        expected->shape.size() >= skip && input.shape.size() == expected->shape.size();
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
    if (seen.count(expected.name) == 0 && !expected.optional) {
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

}  // namespace hearth
