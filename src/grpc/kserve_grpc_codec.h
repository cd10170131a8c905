// The KServe v2 gRPC encoding of hearth's request API (proto/grpc_service.proto):
// infer requests from their protobuf form, responses, metadata, model
// configuration and statistics into it, and Status codes as gRPC codes.
//
// Pure functions: no sockets, no service, no shared state; they never throw
// (out of memory is ResourceExhausted). Every failure is a Status whose
// message names the input, output, parameter or field, worded as the REST
// front-end words the same fault. Thread-safe.
#pragma once

#include <grpcpp/support/status.h>

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/log_settings.h"
#include "common/trace_settings.h"
#include "grpc_service.pb.h"
#include "hearth/status.h"
#include "server/inference_api.h"

namespace hearth {

// The request parameter that the front-end itself acts on; every other one
// goes to the service (InferRequest::parameters, whose rules are in
// server/request_admission.h):
//   triton_enable_empty_final_response    bool: on a stream, answer a
//                                         decoupled request's end even when
//                                         its last response has no outputs
inline constexpr std::string_view kEmptyFinalParameter = "triton_enable_empty_final_response";
// Set on each response of a stream: true on the last one of its request.
inline constexpr std::string_view kFinalResponseParameter = "triton_final_response";

struct GrpcInferRequest {
  InferRequest request;
  bool empty_final_response = false;  // triton_enable_empty_final_response
};

// Converts a ModelInferRequest, checking what ParseInferRequest checks for
// REST: each input's datatype known, shape of non-negative dimensions (at
// most kMaxTensorRank), and data of exactly the shape's size, from one of
//   - raw_input_contents: one entry per input that is not in shared memory
//     (has no shared_memory_region parameter), in input order, for all of
//     them or for none (BYTES serialised as common/bytes_tensor.h);
//   - the typed field of its datatype in `contents` (values range-checked
//     for INT8, INT16, UINT8, UINT16, UINT32; FP16 and BF16 only raw);
//   - a registered system shared-memory region: the input has no data, and
//     the service reads the region its parameters name.
// The request's, inputs' and outputs' parameters go to the service as they
// came (InferRequest::parameters), but for triton_enable_empty_final_response
// and binary_data (gRPC outputs are always raw): the service applies
// KServe's rules to them and checks the request against the model
// (server/request_admission.h).
//
// Raw inputs become views into `proto`'s raw_input_contents, not copies:
// shared with `owner` when it is set (it must keep `proto` alive), else
// borrowed, in which case the caller keeps `proto` alive and unchanged until
// the service is done with the request (calls `done`). Typed contents are
// copied into owned bytes.
Result<GrpcInferRequest> ParseModelInferRequest(const inference::ModelInferRequest& proto,
                                                std::shared_ptr<const void> owner);

// Writes `response` into `out`: model, version, id, and each output the
// request asked for (`requested`, its names; empty: every output the service
// returned) with its datatype and shape, its bytes copied into
// raw_output_contents in the same order (BYTES serialised, as tritonclient
// reads them). An output the service wrote to shared memory (`shm` set)
// carries shared_memory_region, shared_memory_offset and
// shared_memory_byte_size (what was written) as parameters, and an empty
// raw_output_contents entry, as Triton answers. Reads the outputs' bytes, so
// it runs before Infer's `done` returns. Internal when the service left out
// a requested output or returned one whose bytes do not match its shape and
// datatype.
Status EncodeModelInferResponse(const InferResponse& response,
                                const std::vector<RequestedOutput>& requested,
                                inference::ModelInferResponse* out);

void EncodeModelMetadata(const ModelMetadata& metadata, inference::ModelMetadataResponse* out);

// Triton's JSON form of a model's config (InferenceService::ModelConfigJson)
// as a ModelConfig message; fields the message does not define are dropped.
// Internal when the JSON does not fit the message.
Status ModelConfigFromJson(std::string_view json, inference::ModelConfig* out);

void EncodeModelStatistics(const std::vector<ModelStatistics>& statistics,
                           inference::ModelStatisticsResponse* out);

void EncodeRepositoryIndex(const std::vector<RepositoryEntry>& entries,
                           inference::RepositoryIndexResponse* out);

// Triton's status map: region name -> {name, key, offset, byte_size}.
void EncodeSystemSharedMemoryStatus(const std::vector<SharedMemoryRegion>& regions,
                                    inference::SystemSharedMemoryStatusResponse* out);

// As the REST front-end maps codes to HTTP: InvalidArgument INVALID_ARGUMENT,
// Triton's log settings: log_verbose_level a uint32_param, log_info,
// log_warning and log_error bool_params, log_format and log_file
// string_params; InvalidArgument naming an unknown setting or a value of
// another kind.
Result<LogSettingsUpdate> ParseLogSettingsRequest(const inference::LogSettingsRequest& request);
void EncodeLogSettings(const LogSettings& settings, inference::LogSettingsResponse* out);

// Triton's trace settings: each setting's values checked by
// CheckTraceSettingUpdate (a setting with no values is cleared).
Status CheckTraceSettingRequest(const inference::TraceSettingRequest& request);
void EncodeTraceSettings(const std::vector<TraceSetting>& settings,
                         inference::TraceSettingResponse* out);

// FailedPrecondition FAILED_PRECONDITION, NotFound NOT_FOUND, ResourceExhausted
// RESOURCE_EXHAUSTED, Unavailable UNAVAILABLE, DeadlineExceeded
// DEADLINE_EXCEEDED, Unimplemented UNIMPLEMENTED, AlreadyExists
// ALREADY_EXISTS, PermissionDenied PERMISSION_DENIED, anything else INTERNAL.
grpc::StatusCode GrpcCodeFor(StatusCode code);
grpc::Status ToGrpcStatus(const Status& status);

}  // namespace hearth
