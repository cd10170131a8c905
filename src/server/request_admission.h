// KServe's rules for a request, applied once, by the service, whatever
// front-end the request came through: its parameters (timeout, priority,
// sequences, shared memory, classification, the model's own) and its
// tensors against the model's metadata. Part of the server's request API:
// a front-end converts its syntax into an InferRequest and hands it on; a
// service made for a test applies the same rules by calling
// AdmitInferRequest.
#pragma once

#include <cstddef>
#include <string>

#include "hearth/status.h"
#include "server/inference_api.h"

namespace hearth {

// Tensors of a request may have at most this many dimensions (the REST
// front-end walks nested `data` recursively, one level per dimension).
inline constexpr size_t kMaxTensorRank = 32;

// Request parameters the service acts on; every other one goes to the model
// (InferRequest::parameters_json).
//   timeout    a non-negative integer: microseconds (InferRequest::timeout_us)
//   priority   a non-negative integer: the level (InferRequest::priority;
//              checked against the model's priority_levels when it runs)
//   sequence_id     a non-negative integer or a string of at most
//                   kMaxSequenceIdBytes (0 and "": none)
//   sequence_start, sequence_end   true or false
//                   (InferRequest::sequence_*; the service refuses them for
//                   a model without sequence_batching)
// A tensor's parameters: shared_memory_region (a string), _offset (a
// non-negative integer, default 0) and _byte_size (one, required) put it in
// a registered region (InferTensor::shm, RequestedOutput::shm); an output's
// `classification`, an integer in [1, 2^32-1], answers its top classes
// (RequestedOutput::class_count). Others of a tensor are not used.
inline constexpr std::string_view kTimeoutParameter = "timeout";
inline constexpr std::string_view kPriorityParameter = "priority";
inline constexpr std::string_view kClassificationParameter = "classification";
inline constexpr std::string_view kSequenceIdParameter = "sequence_id";
inline constexpr std::string_view kSequenceStartParameter = "sequence_start";
inline constexpr std::string_view kSequenceEndParameter = "sequence_end";
inline constexpr size_t kMaxSequenceIdBytes = 256;
inline constexpr std::string_view kRegionParameter = "shared_memory_region";
inline constexpr std::string_view kOffsetParameter = "shared_memory_offset";
inline constexpr std::string_view kByteSizeParameter = "shared_memory_byte_size";

// Applies the parameters' rules above to `request` (and its tensors): sets
// timeout_us, priority, parameters_json (appending the model's parameters
// to what a front-end set there), each tensor's shm and each output's
// class_count. An input in shared memory must have no data and, unless
// BYTES, a byte size of exactly its shape's. InvalidArgument naming the
// parameter and what it must be otherwise. The parameters applied are
// cleared: admitting a request again changes nothing.
Status AdmitParameters(InferRequest& request);

// Every input known, present once, of the model's datatype and shape (the
// batch dimension first when max_batch_size > 0, 1..max_batch_size and the
// same for every input; a -1 among the model's dims takes any size, the
// others must match exactly), and every requested output known and named
// once. InvalidArgument naming what is wrong otherwise. The inputs' bytes
// are not looked at (an input may be in shared memory, read later).
Status ValidateInferRequest(const InferRequest& request, const ModelMetadata& metadata);

// AdmitParameters, then ValidateInferRequest: what the service checks of
// every request before it is queued.
Status AdmitInferRequest(InferRequest& request, const ModelMetadata& metadata);

// The bytes the service will read from system shared memory for
// `request`'s inputs and hold while it runs, as their parameters say
// (saturating; a parameter that is not a count counts nothing, and is
// refused by AdmitParameters).
uint64_t SharedMemoryInputBytes(const InferRequest& request);

// How a parameter's value reads in an error: 5, true, "text", [1] (at most 40
// characters).
std::string DescribeParameter(const Parameter& parameter);

}  // namespace hearth
