// The KServe v2 REST encoding of hearth's request API: parsing infer requests
// (JSON and the binary tensor data extension), checking them against a
// model's metadata, and encoding responses, metadata and errors.
//
// Pure functions: no sockets, no service, no shared state (each thread keeps
// a JSON parser of its own to reuse); they never throw (every failure is a
// Status whose message names the input, output or field). Thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "hearth/status.h"
#include "server/inference_api.h"
#include "server/request_admission.h"

namespace hearth {

// Spare bytes that ParseInferRequest needs after the JSON of a body to parse
// it in place (simdjson reads up to this far past the end). Binary data after
// the JSON serves; otherwise a body whose capacity() leaves this much room
// after its size() is never copied. The HTTP front-end reserves it when it
// reads a body.
inline constexpr size_t kRequestBodyPadding = 64;

// Parses the body of POST /v2/models/{model}[/versions/{version}]/infer.
// `json_length` is the Inference-Header-Content-Length header: when present,
// the first json_length bytes of `body` are the JSON and the rest is the
// binary data of the inputs that carry parameters.binary_data_size, in input
// order. Requested outputs come back with `binary` resolved (their own
// binary_data parameter, else the request's binary_data_output). The
// request parameter binary_data_output, inputs' binary_data_size and
// outputs' binary_data are read here; every other parameter goes to the
// service as it came (InferRequest::parameters: booleans, integers and
// strings typed, any other value as its JSON text), which applies KServe's
// rules to them (server/request_admission.h). An input with a
// shared_memory_region parameter has no data: the service reads the region.
// InvalidArgument on any malformed request, with a message that names the
// input, output or field (malformed JSON: "invalid JSON in the request at
// byte N: ..." wherever it is); ResourceExhausted when out of memory.
//
// The request takes `body` over: binary inputs come back as views into it
// (TensorData::Shared, no copy), which keep it alive for as long as any of
// them lives. JSON inputs are decoded into owned bytes of their datatype
// (simdjson On-Demand: each number straight into its element, no tree);
// `data` may be flat or nested along the shape.
//
// BYTES inputs come back in the serialised form of common/bytes_tensor.h
// (a 4-byte little-endian length, then the bytes, per element), which is
// also the binary extension's: binary BYTES data is a view of the body,
// checked to be exactly the shape's number of elements; JSON BYTES data must
// be strings, each encoded unescaped (UTF-8). Any other value in BYTES data,
// or malformed binary BYTES data, is InvalidArgument naming the input.
Result<InferRequest> ParseInferRequest(std::string body, std::optional<uint64_t> json_length,
                                       std::string_view model, std::string_view version);

// The service checks a parsed request against the model it names
// (server/request_admission.h); the data itself was checked by
// ParseInferRequest, BYTES included.

// What a response must contain, kept from the request (whose inputs are gone
// by the time the response arrives).
struct OutputSelection {
  std::string id;
  std::vector<RequestedOutput> outputs;  // empty: all, each binary iff binary_data_output
  bool binary_data_output = false;
};
OutputSelection SelectionOf(const InferRequest& request);

struct EncodedInferResponse {
  std::string body;  // the JSON, then the binary outputs in output order
  // Set (to the JSON's length) when binary outputs follow the JSON; the
  // value of Inference-Header-Content-Length.
  std::optional<size_t> json_length;
};

// Encodes the service's response with the outputs `selection` asks for, in a
// body sized once: each binary output is copied into it once, from wherever
// its bytes are (outputs borrowed from the server's slot must be encoded
// before Infer's `done` returns). Each output is written with the shape the
// service gives it, whatever the model's dims. BYTES outputs (serialised as
// above) go into JSON as strings, where each byte that is not part of valid
// UTF-8 is written \u00XX, the Latin-1 character of that value, so that the
// JSON is always valid; binary BYTES outputs are their serialised bytes.
// Internal when the service left out a requested output or returned one
// whose bytes do not match its shape and datatype (for BYTES: are not
// exactly its shape's number of elements).
Result<EncodedInferResponse> EncodeInferResponse(const InferResponse& response,
                                                 const OutputSelection& selection);

// {"name", "versions", "platform", "inputs": [{"name", "datatype", "shape"}], "outputs": [...]}
std::string ModelMetadataJson(const ModelMetadata& metadata);
// {"name", "version", "extensions": [...]}
std::string ServerMetadataJson(std::string_view name, std::string_view version,
                               const std::vector<std::string>& extensions);
// {"error": message}; bytes that are not UTF-8 are replaced.
std::string ErrorJson(std::string_view message);

// InvalidArgument, FailedPrecondition and AlreadyExists 400, NotFound 404,
// ResourceExhausted and Unavailable 503, DeadlineExceeded 504, Unimplemented
// 501, everything else 500.
int HttpStatusFor(StatusCode code);

// Parses Inference-Header-Content-Length: decimal digits only.
Result<uint64_t> ParseJsonLength(std::string_view value);

}  // namespace hearth
