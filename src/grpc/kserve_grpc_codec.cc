#include "grpc/kserve_grpc_codec.h"

#include <google/protobuf/util/json_util.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <new>
#include <nlohmann/json.hpp>
#include <optional>
#include <type_traits>
#include <utility>

#include "common/bytes_tensor.h"
#include "common/checked_size.h"
#include "common/datatype.h"
#include "server/protocol_codes.h"
#include "server/request_admission.h"

namespace hearth {
namespace {

using inference::InferParameter;
using inference::InferTensorContents;
using inference::ModelInferRequest;

// How messages write a name: a JSON string literal, as the REST front-end's.
std::string Quote(std::string_view text) {
  return nlohmann::json(std::string(text))
      .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string InputLabel(std::string_view name) { return "input " + Quote(name); }

std::string DatatypeString(DType dtype) {
  const std::string_view name = KserveDatatypeName(dtype);
  return name.empty() ? std::string(DTypeName(dtype)) : std::string(name);
}

// Which typed field of InferTensorContents holds each datatype, and how many
// values each field has.
enum class ContentsField { kNone, kBool, kInt, kInt64, kUint, kUint64, kFp32, kFp64, kBytes };

ContentsField FieldFor(DType dtype) {
  switch (dtype) {
    case DType::kBool:
      return ContentsField::kBool;
    case DType::kI8:
    case DType::kI16:
    case DType::kI32:
      return ContentsField::kInt;
    case DType::kI64:
      return ContentsField::kInt64;
    case DType::kU8:
    case DType::kU16:
    case DType::kU32:
      return ContentsField::kUint;
    case DType::kU64:
      return ContentsField::kUint64;
    case DType::kF32:
      return ContentsField::kFp32;
    case DType::kF64:
      return ContentsField::kFp64;
    case DType::kBytes:
      return ContentsField::kBytes;
    default:
      return ContentsField::kNone;  // FP16, BF16: raw only
  }
}

const char* FieldName(ContentsField field) {
  switch (field) {
    case ContentsField::kBool:
      return "bool_contents";
    case ContentsField::kInt:
      return "int_contents";
    case ContentsField::kInt64:
      return "int64_contents";
    case ContentsField::kUint:
      return "uint_contents";
    case ContentsField::kUint64:
      return "uint64_contents";
    case ContentsField::kFp32:
      return "fp32_contents";
    case ContentsField::kFp64:
      return "fp64_contents";
    case ContentsField::kBytes:
      return "bytes_contents";
    case ContentsField::kNone:
      break;
  }
  return "(none)";
}

int FieldSize(const InferTensorContents& c, ContentsField field) {
  switch (field) {
    case ContentsField::kBool:
      return c.bool_contents_size();
    case ContentsField::kInt:
      return c.int_contents_size();
    case ContentsField::kInt64:
      return c.int64_contents_size();
    case ContentsField::kUint:
      return c.uint_contents_size();
    case ContentsField::kUint64:
      return c.uint64_contents_size();
    case ContentsField::kFp32:
      return c.fp32_contents_size();
    case ContentsField::kFp64:
      return c.fp64_contents_size();
    case ContentsField::kBytes:
      return c.bytes_contents_size();
    case ContentsField::kNone:
      break;
  }
  return 0;
}

constexpr ContentsField kAllFields[] = {
    ContentsField::kBool,   ContentsField::kInt,  ContentsField::kInt64, ContentsField::kUint,
    ContentsField::kUint64, ContentsField::kFp32, ContentsField::kFp64,  ContentsField::kBytes};

// The values of one repeated field, each narrowed to the datatype's element.
template <typename Out, typename Values>
Status CopyNarrowed(const Values& values, const std::string& label, const char* datatype,
                    std::vector<std::byte>& bytes) {
  bytes.resize(static_cast<size_t>(values.size()) * sizeof(Out));
  std::byte* out = bytes.data();
  for (int i = 0; i < values.size(); ++i) {
    const auto value = values.Get(i);
    if constexpr (!std::is_same_v<Out, std::remove_cv_t<decltype(value)>>) {
      if (value < std::numeric_limits<Out>::min() || value > std::numeric_limits<Out>::max()) {
        return InvalidArgument(label + ": element " + std::to_string(i) + " (" +
                               std::to_string(value) + ") is out of range for " + datatype);
      }
    }
    const auto narrow = static_cast<Out>(value);
    std::memcpy(out + static_cast<size_t>(i) * sizeof(Out), &narrow, sizeof(Out));
  }
  return Status::Ok();
}

// An input's data from its typed contents, into owned bytes of its datatype.
Status ReadContents(const InferTensorContents& contents, DType dtype, uint64_t count,
                    const std::string& label, TensorData& data) {
  const ContentsField field = FieldFor(dtype);
  const std::string datatype = DatatypeString(dtype);
  if (field == ContentsField::kNone) {
    return InvalidArgument(label + ": " + datatype +
                           " data has no typed field in 'contents'; send it in raw_input_contents");
  }
  for (ContentsField other : kAllFields) {
    if (other != field && FieldSize(contents, other) > 0) {
      return InvalidArgument(label + ": datatype " + datatype + " takes its data in contents." +
                             FieldName(field) + ", not contents." + FieldName(other));
    }
  }
  const auto given = static_cast<uint64_t>(FieldSize(contents, field));
  if (given != count) {
    return InvalidArgument(label + ": contents." + FieldName(field) + " has " +
                           std::to_string(given) + " elements but the shape needs " +
                           std::to_string(count));
  }
  std::vector<std::byte> bytes;
  const char* name = datatype.c_str();
  switch (dtype) {
    case DType::kBool: {
      bytes.resize(count);
      for (int i = 0; i < contents.bool_contents_size(); ++i) {
        bytes[static_cast<size_t>(i)] =
            std::byte{contents.bool_contents(i) ? uint8_t{1} : uint8_t{0}};
      }
      break;
    }
    case DType::kI8:
      RETURN_IF_ERROR(CopyNarrowed<int8_t>(contents.int_contents(), label, name, bytes));
      break;
    case DType::kI16:
      RETURN_IF_ERROR(CopyNarrowed<int16_t>(contents.int_contents(), label, name, bytes));
      break;
    case DType::kI32:
      RETURN_IF_ERROR(CopyNarrowed<int32_t>(contents.int_contents(), label, name, bytes));
      break;
    case DType::kI64:
      RETURN_IF_ERROR(CopyNarrowed<int64_t>(contents.int64_contents(), label, name, bytes));
      break;
    case DType::kU8:
      RETURN_IF_ERROR(CopyNarrowed<uint8_t>(contents.uint_contents(), label, name, bytes));
      break;
    case DType::kU16:
      RETURN_IF_ERROR(CopyNarrowed<uint16_t>(contents.uint_contents(), label, name, bytes));
      break;
    case DType::kU32:
      RETURN_IF_ERROR(CopyNarrowed<uint32_t>(contents.uint_contents(), label, name, bytes));
      break;
    case DType::kU64:
      RETURN_IF_ERROR(CopyNarrowed<uint64_t>(contents.uint64_contents(), label, name, bytes));
      break;
    case DType::kF32:
      RETURN_IF_ERROR(CopyNarrowed<float>(contents.fp32_contents(), label, name, bytes));
      break;
    case DType::kF64:
      RETURN_IF_ERROR(CopyNarrowed<double>(contents.fp64_contents(), label, name, bytes));
      break;
    case DType::kBytes: {
      uint64_t total = 0;
      for (const std::string& element : contents.bytes_contents()) {
        total += BytesElementSize(element.size());
      }
      bytes.reserve(total);
      for (int i = 0; i < contents.bytes_contents_size(); ++i) {
        RETURN_IF_ERROR(AppendBytesElement(bytes, contents.bytes_contents(i),
                                           label + ": element " + std::to_string(i)));
      }
      break;
    }
    default:
      return InvalidArgument(label + ": unsupported datatype " + datatype);
  }
  data = std::move(bytes);
  return Status::Ok();
}

// A parameter as the service takes it (Parameter).
Parameter Neutral(const std::string& key, const InferParameter& value) {
  Parameter p;
  p.name = key;
  switch (value.parameter_choice_case()) {
    case InferParameter::kBoolParam:
      p.value = value.bool_param();
      break;
    case InferParameter::kInt64Param:
      p.value = value.int64_param();
      break;
    case InferParameter::kUint64Param:
      p.value = value.uint64_param();
      break;
    case InferParameter::kDoubleParam:
      p.value = value.double_param();
      break;
    case InferParameter::kStringParam:
      p.value = value.string_param();
      break;
    case InferParameter::PARAMETER_CHOICE_NOT_SET:
      break;
  }
  return p;
}

// triton_enable_empty_final_response is the front-end's (binary_data and
// binary_data_output mean nothing here: gRPC outputs are always raw); every
// other parameter goes to the service as it came, in the order of the map's
// keys, so that the model's parameters read the same from one request to the
// next.
template <typename Map>
Parameters NeutralParameters(const Map& parameters) {
  std::vector<const typename Map::value_type*> sorted;
  for (const auto& entry : parameters) sorted.push_back(&entry);
  std::sort(sorted.begin(), sorted.end(),
            [](const auto* a, const auto* b) { return a->first < b->first; });
  Parameters out;
  for (const auto* entry : sorted) {
    if (entry->first == kEmptyFinalParameter || entry->first == "binary_data" ||
        entry->first == "binary_data_output")
      continue;
    out.push_back(Neutral(entry->first, entry->second));
  }
  return out;
}

Status RequestParameters(const ModelInferRequest& proto, GrpcInferRequest& out) {
  if (const auto empty_final = proto.parameters().find(std::string(kEmptyFinalParameter));
      empty_final != proto.parameters().end()) {
    if (empty_final->second.parameter_choice_case() != InferParameter::kBoolParam) {
      return InvalidArgument("request: parameter '" + std::string(kEmptyFinalParameter) +
                             "' must be a bool_param");
    }
    out.empty_final_response = empty_final->second.bool_param();
  }
  out.request.parameters = NeutralParameters(proto.parameters());
  return Status::Ok();
}

bool InSharedMemory(const ModelInferRequest::InferInputTensor& input) {
  return input.parameters().count(std::string(kRegionParameter)) > 0;
}

// Reads one input; `raw` is its entry of raw_input_contents, or null when
// its data is in typed contents or shared memory.
Status ReadInput(const ModelInferRequest::InferInputTensor& input, const std::string* raw,
                 const std::shared_ptr<const void>& owner, InferTensor& tensor) {
  tensor.name = input.name();
  const std::string label = InputLabel(tensor.name);
  tensor.parameters = NeutralParameters(input.parameters());
  const std::optional<DType> dtype = ParseKserveDatatype(input.datatype());
  if (!dtype.has_value()) {
    return InvalidArgument(label + ": unsupported datatype " + Quote(input.datatype()));
  }
  tensor.dtype = *dtype;
  if (static_cast<size_t>(input.shape_size()) > kMaxTensorRank) {
    return InvalidArgument(label + ": shape has " + std::to_string(input.shape_size()) +
                           " dimensions; at most " + std::to_string(kMaxTensorRank) +
                           " are supported");
  }
  tensor.shape.assign(input.shape().begin(), input.shape().end());
  for (int64_t dim : tensor.shape) {
    if (dim < 0) {
      return InvalidArgument(label + ": 'shape' must be an array of non-negative integers, got " +
                             ShapeString(tensor.shape));
    }
  }
  ASSIGN_OR_RETURN(const uint64_t count, ShapeElements(tensor.shape, label));
  const bool has_contents = input.has_contents() && input.contents().ByteSizeLong() > 0;
  if (InSharedMemory(input)) {
    // The service reads the region and checks the parameters (request_admission.h).
    if (has_contents) {
      return InvalidArgument(label +
                             " is in shared memory and has data in 'contents' too; give "
                             "it once");
    }
    return Status::Ok();
  }
  if (raw == nullptr)
    return ReadContents(input.contents(), tensor.dtype, count, label, tensor.data);
  // Parse refused contents beside raw_input_contents, in Triton's words.
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(raw->data()),
                                         raw->size());
  if (tensor.dtype == DType::kBytes) {
    RETURN_IF_ERROR(ValidateBytesTensor(bytes, count, label));
  } else {
    ASSIGN_OR_RETURN(const uint64_t expected, ShapeBytes(tensor.dtype, tensor.shape, label));
    if (raw->size() != expected) {
      return InvalidArgument(label + ": raw_input_contents has " + std::to_string(raw->size()) +
                             " bytes but shape " + ShapeString(tensor.shape) + " of " +
                             DatatypeString(tensor.dtype) + " needs " + std::to_string(expected));
    }
  }
  tensor.data = owner != nullptr ? TensorData::Shared(bytes, owner) : TensorData::Borrowed(bytes);
  return Status::Ok();
}

RequestedOutput ReadRequestedOutput(const ModelInferRequest::InferRequestedOutputTensor& output) {
  // Every output of a gRPC response is raw.
  RequestedOutput requested(output.name(), true);
  requested.parameters = NeutralParameters(output.parameters());
  return requested;
}

Result<GrpcInferRequest> Parse(const ModelInferRequest& proto,
                               const std::shared_ptr<const void>& owner) {
  GrpcInferRequest out;
  InferRequest& request = out.request;
  request.model = proto.model_name();
  request.version = proto.model_version();
  request.id = proto.id();
  RETURN_IF_ERROR(RequestParameters(proto, out));
  // raw_input_contents holds the data of the inputs that are not in shared
  // memory, in input order (as tritonclient sends it), or is empty.
  int outside = 0;
  for (const auto& input : proto.inputs()) outside += InSharedMemory(input) ? 0 : 1;
  const int raw_count = proto.raw_input_contents_size();
  // Worded as Triton's, which its clients match; checked per input before
  // the counts, as Triton does.
  for (const auto& input : proto.inputs()) {
    if (raw_count > 0 && !InSharedMemory(input) && input.has_contents() &&
        input.contents().ByteSizeLong() > 0) {
      return InvalidArgument(
          "contents field must not be specified when using raw_input_contents for '" +
          input.name() + "' for model '" + proto.model_name() + "'");
    }
  }
  if (raw_count > 0 && raw_count != outside) {
    return InvalidArgument(
        "the request has " + std::to_string(raw_count) + " raw_input_contents for " +
        std::to_string(outside) +
        (outside == proto.inputs_size()
             ? " inputs: give every input's data there, in input order, or none"
             : " inputs not in shared memory: give each of their data there, in input order, "
               "or none"));
  }
  request.inputs.resize(static_cast<size_t>(proto.inputs_size()));
  int next_raw = 0;
  for (int i = 0; i < proto.inputs_size(); ++i) {
    const auto& input = proto.inputs(i);
    const std::string* raw = nullptr;
    if (raw_count > 0 && !InSharedMemory(input)) raw = &proto.raw_input_contents(next_raw++);
    RETURN_IF_ERROR(ReadInput(input, raw, owner, request.inputs[static_cast<size_t>(i)]));
  }
  for (const ModelInferRequest::InferRequestedOutputTensor& output : proto.outputs()) {
    request.outputs.push_back(ReadRequestedOutput(output));
  }
  request.binary_data_output = true;
  return out;
}

}  // namespace

Result<GrpcInferRequest> ParseModelInferRequest(const inference::ModelInferRequest& proto,
                                                std::shared_ptr<const void> owner) {
  try {
    return Parse(proto, owner);
  } catch (const std::bad_alloc&) {
    return ResourceExhausted("out of memory parsing the request");
  }
}

Status EncodeModelInferResponse(const InferResponse& response,
                                const std::vector<RequestedOutput>& requested,
                                inference::ModelInferResponse* out) {
  std::vector<const InferTensor*> chosen;
  if (requested.empty()) {
    for (const InferTensor& output : response.outputs) chosen.push_back(&output);
  } else {
    for (const RequestedOutput& want : requested) {
      const InferTensor* found = nullptr;
      for (const InferTensor& output : response.outputs) {
        if (output.name == want.name) found = &output;
      }
      if (found == nullptr) {
        return Internal("the model did not return requested output " + Quote(want.name));
      }
      chosen.push_back(found);
    }
  }
  try {
    out->set_model_name(response.model);
    out->set_model_version(response.version);
    out->set_id(response.id);
    for (const InferTensor* tensor : chosen) {
      const std::string label = "output " + Quote(tensor->name);
      const std::string_view datatype = KserveDatatypeName(tensor->dtype);
      if (datatype.empty()) {
        return Internal(label + " has datatype " + std::string(DTypeName(tensor->dtype)) +
                        ", which KServe cannot name");
      }
      // Internal: the service, not the client, made this output.
      const Result<uint64_t> count = ShapeElements(tensor->shape, label);
      if (!count.ok()) return Internal(count.status().message());
      // An output in shared memory has no bytes here: its size is what the
      // service wrote (BYTES: not checked, the bytes are the client's now).
      const uint64_t size = tensor->shm.has_value() ? tensor->shm->byte_size : tensor->data.size();
      if (tensor->shm.has_value() && !tensor->data.empty()) {
        return Internal(label + " is in shared memory and has bytes in the response too");
      }
      if (tensor->dtype == DType::kBytes) {
        if (!tensor->shm.has_value()) {
          if (Status valid = ValidateBytesTensor(tensor->data.bytes(), *count, label);
              !valid.ok()) {
            return Internal(valid.message());
          }
        }
      } else {
        const Result<uint64_t> bytes = ShapeBytes(tensor->dtype, tensor->shape, label);
        if (!bytes.ok()) return Internal(bytes.status().message());
        if (size != *bytes) {
          return Internal(label + " has " + std::to_string(size) +
                          " bytes, which does not match shape " + ShapeString(tensor->shape) +
                          " of " + std::string(datatype));
        }
      }
      inference::ModelInferResponse::InferOutputTensor* output = out->add_outputs();
      output->set_name(tensor->name);
      output->set_datatype(std::string(datatype));
      for (int64_t dim : tensor->shape) output->add_shape(dim);
      if (tensor->shm.has_value()) {
        // In the region the request named: where and how much, and an
        // empty raw_output_contents entry, which keeps the entries in step
        // with the outputs (tritonclient finds an output's bytes by index).
        auto& parameters = *output->mutable_parameters();
        parameters[std::string(kRegionParameter)].set_string_param(tensor->shm->region);
        parameters[std::string(kOffsetParameter)].set_int64_param(
            static_cast<int64_t>(tensor->shm->offset));
        parameters[std::string(kByteSizeParameter)].set_int64_param(
            static_cast<int64_t>(tensor->shm->byte_size));
        out->add_raw_output_contents();
        continue;
      }
      out->add_raw_output_contents()->assign(reinterpret_cast<const char*>(tensor->data.data()),
                                             tensor->data.size());
    }
  } catch (const std::bad_alloc&) {
    return ResourceExhausted("out of memory encoding the response");
  }
  return Status::Ok();
}

void EncodeModelMetadata(const ModelMetadata& metadata, inference::ModelMetadataResponse* out) {
  out->set_name(metadata.name);
  for (const std::string& version : metadata.versions) out->add_versions(version);
  out->set_platform(metadata.platform);
  auto tensors = [](const std::vector<TensorMetadata>& from, auto* to) {
    for (const TensorMetadata& t : from) {
      inference::ModelMetadataResponse::TensorMetadata* m = to->Add();
      m->set_name(t.name);
      m->set_datatype(DatatypeString(t.dtype));
      for (int64_t dim : t.shape) m->add_shape(dim);
    }
  };
  tensors(metadata.inputs, out->mutable_inputs());
  tensors(metadata.outputs, out->mutable_outputs());
}

Status ModelConfigFromJson(std::string_view json, inference::ModelConfig* out) {
  // Triton's JSON config is protobuf's JSON mapping of its ModelConfig, so
  // protobuf's own parser reads it; what this subset of the message leaves
  // out is dropped rather than refused, so that a config field the server
  // learns to report never breaks this RPC.
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = true;
  const google::protobuf::util::Status parsed = google::protobuf::util::JsonStringToMessage(
      google::protobuf::StringPiece(json.data(), json.size()), out, options);
  if (!parsed.ok()) {
    return Internal("the model's config does not fit ModelConfig: " +
                    std::string(parsed.message()));
  }
  return Status::Ok();
}

void EncodeModelStatistics(const std::vector<ModelStatistics>& statistics,
                           inference::ModelStatisticsResponse* out) {
  auto duration = [](const DurationStatistics& from, inference::StatisticDuration* to) {
    to->set_count(from.count);
    to->set_ns(from.ns);
  };
  for (const ModelStatistics& s : statistics) {
    inference::ModelStatistics* m = out->add_model_stats();
    m->set_name(s.name);
    m->set_version(s.version);
    m->set_last_inference(s.last_inference_ms);
    m->set_inference_count(s.inference_count);
    m->set_execution_count(s.execution_count);
    inference::InferStatistics* infer = m->mutable_inference_stats();
    duration(s.success, infer->mutable_success());
    duration(s.fail, infer->mutable_fail());
    duration(s.queue, infer->mutable_queue());
    duration(s.compute_input, infer->mutable_compute_input());
    duration(s.compute_infer, infer->mutable_compute_infer());
    duration(s.compute_output, infer->mutable_compute_output());
    // hearth has no response cache: cache_hit and cache_miss stay zero, as
    // Triton reports them for a model without one.
    infer->mutable_cache_hit();
    infer->mutable_cache_miss();
    for (const BatchStatistics& b : s.batch_stats) {
      inference::InferBatchStatistics* batch = m->add_batch_stats();
      batch->set_batch_size(static_cast<uint64_t>(b.batch_size));
      duration(b.compute_input, batch->mutable_compute_input());
      duration(b.compute_infer, batch->mutable_compute_infer());
      duration(b.compute_output, batch->mutable_compute_output());
    }
    if (s.streams.has_value()) {
      inference::HearthStreamStatistics* t = m->mutable_hearth_streams();
      for (uint64_t n : s.streams->in_flight) t->add_in_flight(n);
      t->set_opened(s.streams->opened);
      t->set_resumed(s.streams->resumed);
      t->set_responses(s.streams->responses);
      t->set_tokens(s.streams->tokens);
    }
  }
}

void EncodeRepositoryIndex(const std::vector<RepositoryEntry>& entries,
                           inference::RepositoryIndexResponse* out) {
  for (const RepositoryEntry& e : entries) {
    inference::RepositoryIndexResponse::ModelIndex* m = out->add_models();
    m->set_name(e.name);
    m->set_version(e.version);
    m->set_state(e.state);
    m->set_reason(e.reason);
  }
}

void EncodeSystemSharedMemoryStatus(const std::vector<SharedMemoryRegion>& regions,
                                    inference::SystemSharedMemoryStatusResponse* out) {
  for (const SharedMemoryRegion& r : regions) {
    inference::SystemSharedMemoryStatusResponse::RegionStatus& status =
        (*out->mutable_regions())[r.name];
    status.set_name(r.name);
    status.set_key(r.key);
    status.set_offset(r.offset);
    status.set_byte_size(r.byte_size);
  }
}

grpc::StatusCode GrpcCodeFor(StatusCode code) {
  return static_cast<grpc::StatusCode>(ProtocolCodesFor(code).grpc);
}

grpc::Status ToGrpcStatus(const Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(GrpcCodeFor(status.code()), status.message());
}

Result<LogSettingsUpdate> ParseLogSettingsRequest(const inference::LogSettingsRequest& request) {
  using Value = inference::LogSettingsRequest::SettingValue;
  LogSettingsUpdate update;
  for (const auto& [key, value] : request.settings()) {
    auto expect = [&key = key, &value = value](Value::ParameterChoiceCase want,
                                               const char* kind) -> Status {
      if (value.parameter_choice_case() == want) return Status::Ok();
      return InvalidArgument("log settings: '" + key + "' must be a " + kind);
    };
    if (key == "log_verbose_level") {
      RETURN_IF_ERROR(expect(Value::kUint32Param, "uint32_param"));
      update.verbose_level = value.uint32_param();
    } else if (key == "log_info" || key == "log_warning" || key == "log_error") {
      RETURN_IF_ERROR(expect(Value::kBoolParam, "bool_param"));
      (key == "log_info"      ? update.info
       : key == "log_warning" ? update.warning
                              : update.error) = value.bool_param();
    } else if (key == "log_format" || key == "log_file") {
      RETURN_IF_ERROR(expect(Value::kStringParam, "string_param"));
      (key == "log_format" ? update.format : update.file) = value.string_param();
    } else {
      return InvalidArgument("log settings: unknown setting '" + key +
                             "' (Triton's: log_file, log_info, log_warning, log_error, "
                             "log_verbose_level, log_format)");
    }
  }
  return update;
}

void EncodeLogSettings(const LogSettings& settings, inference::LogSettingsResponse* out) {
  auto& map = *out->mutable_settings();
  map["log_file"].set_string_param(settings.file);
  map["log_info"].set_bool_param(settings.info);
  map["log_warning"].set_bool_param(settings.warning);
  map["log_error"].set_bool_param(settings.error);
  map["log_verbose_level"].set_uint32_param(settings.verbose_level);
  map["log_format"].set_string_param(settings.format);
}

Status CheckTraceSettingRequest(const inference::TraceSettingRequest& request) {
  for (const auto& [key, value] : request.settings()) {
    const std::vector<std::string> values(value.value().begin(), value.value().end());
    RETURN_IF_ERROR(CheckTraceSettingUpdate(key, values, values.empty()));
  }
  return Status::Ok();
}

void EncodeTraceSettings(const std::vector<TraceSetting>& settings,
                         inference::TraceSettingResponse* out) {
  for (const TraceSetting& s : settings) {
    auto& value = (*out->mutable_settings())[s.name];
    for (const std::string& v : s.value) value.add_value(v);
  }
}

}  // namespace hearth
