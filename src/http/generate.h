// The generate extension (Triton's): the bodies of
// POST /v2/models/{m}[/versions/{v}]/generate and .../generate_stream, and
// their answers. docs/generate.md describes the mapping.
//
// Pure functions: no sockets, no service; thread-safe; they never throw.
#pragma once

#include <string>
#include <string_view>

#include "hearth/status.h"
#include "server/inference_api.h"

namespace hearth {

// Parses a generate body for the model `metadata` describes (its version
// `version`, empty for the served one) into a request for the service,
// which checks it against the model (server/request_admission.h). The body is a JSON object (see
// ParseJsonBody for what is refused): "id" (a string) is the request's id,
// "parameters" (an object) goes to parameters_json as its text in the body,
// and every other key names an input: a string is a BYTES element, a number
// or a boolean one element of the input's datatype, a list its elements
// (one dimension, one kind); the shape is [n], or [1, n] when the model
// batches. InvalidArgument naming the key or input otherwise (an unknown
// input, a missing one, a value of the wrong type or out of its datatype's
// range). The request gets no on_response and no cancelled flag.
Result<InferRequest> ParseGenerateRequest(std::string_view body, const ModelMetadata& metadata,
                                          std::string_view version);

// {"model_name", "model_version", "id"? (the response's, else `id`), then
// each output by name: a one-element output as its value (a BYTES element
// as a string), any other as the flat list of its elements}. Reads the
// outputs' bytes, which may be borrowed: call it inside `done` or
// on_response. Internal when an output does not match its shape and
// datatype. (Keys "model_name", "model_version" and "id" are the
// response's own: an output of one of those names is left out.)
Result<std::string> GenerateResponseJson(const InferResponse& response, std::string_view id);

}  // namespace hearth
