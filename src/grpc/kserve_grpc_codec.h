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

#include "grpc_service.pb.h"
#include "hearth/status.h"
#include "server/inference_api.h"

namespace hearth {

// Request parameters that the front-end itself acts on; every other one goes
// to the model (InferRequest::parameters_json).
//   timeout                               int64 or uint64 >= 0: microseconds
//   triton_enable_empty_final_response    bool: on a stream, answer a
//                                         decoupled request's end even when
//                                         its last response has no outputs
// Refused (InvalidArgument): sequence_id, sequence_start, sequence_end
// (hearth has no sequence batching) and priority (not honoured yet), so that
// a client never believes they took effect.
inline constexpr std::string_view kTimeoutParameter = "timeout";
inline constexpr std::string_view kEmptyFinalParameter = "triton_enable_empty_final_response";
// Set on each response of a stream: true on the last one of its request.
inline constexpr std::string_view kFinalResponseParameter = "triton_final_response";

struct GrpcInferRequest {
  InferRequest request;
  bool empty_final_response = false;  // triton_enable_empty_final_response
};

// Converts a ModelInferRequest, checking what ParseInferRequest checks for
// REST: each input's datatype known, shape of non-negative dimensions (at
// most kMaxTensorRank), and data of exactly the shape's size, from either
// raw_input_contents (one entry per input, for every input or for none;
// BYTES serialised as common/bytes_tensor.h) or the typed field of its
// datatype in `contents` (values range-checked for INT8, INT16, UINT8; FP16
// and BF16 only raw). Requested outputs come back as named; their
// `binary_data` parameter is accepted and means nothing here (gRPC outputs
// are always raw). Refused with InvalidArgument: shared-memory parameters
// and class_count, which hearth does not implement yet, and the parameters
// listed above. Checking the request against the model is
// ValidateInferRequest's (http/kserve_codec.h).
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
// reads them). Reads the outputs' bytes, so it runs before Infer's `done`
// returns. Internal when the service left out a requested output or returned
// one whose bytes do not match its shape and datatype.
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

// As the REST front-end maps codes to HTTP: InvalidArgument INVALID_ARGUMENT,
// FailedPrecondition FAILED_PRECONDITION, NotFound NOT_FOUND, ResourceExhausted
// RESOURCE_EXHAUSTED, Unavailable UNAVAILABLE, DeadlineExceeded
// DEADLINE_EXCEEDED, Unimplemented UNIMPLEMENTED, AlreadyExists
// ALREADY_EXISTS, PermissionDenied PERMISSION_DENIED, anything else INTERNAL.
grpc::StatusCode GrpcCodeFor(StatusCode code);
grpc::Status ToGrpcStatus(const Status& status);

}  // namespace hearth
