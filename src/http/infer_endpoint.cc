#include <optional>
#include <string>
#include <utility>

#include "http/endpoints.h"
#include "http/kserve_codec.h"
#include "http/server_core.h"
#include "http/session.h"

namespace hearth::rest {
namespace {

// The HTTP response to an infer; reads the outputs' bytes, so it runs
// inside `done`.
Response InferResponseMessage(const Result<InferResponse>& result, const OutputSelection& selection,
                              unsigned version, bool keep_alive) {
  if (!result.ok()) return StatusResponse(result.status(), version, keep_alive);
  Result<EncodedInferResponse> encoded = EncodeInferResponse(*result, selection);
  if (!encoded.ok()) return StatusResponse(encoded.status(), version, keep_alive);
  const bool binary = encoded->json_length.has_value();
  Response response = MakeResponse(http::status::ok, version, keep_alive, std::move(encoded->body),
                                   binary ? "application/octet-stream" : "application/json");
  if (binary) {
    response.set("Inference-Header-Content-Length", std::to_string(*encoded->json_length));
  }
  return response;
}

}  // namespace

void ServeInfer(Session& session, Request request, const Route& route) {
  const unsigned version = request.version();
  const bool keep_alive = request.keep_alive();
  std::optional<uint64_t> json_length;
  if (const auto it = request.find("Inference-Header-Content-Length"); it != request.end()) {
    Result<uint64_t> parsed = ParseJsonLength(it->value());
    if (!parsed.ok()) return session.Send(StatusResponse(parsed.status(), version, keep_alive));
    json_length = *parsed;
  }
  // The body moves into the parsed request: its binary inputs are views
  // into it, which keep it alive until the service is done with them.
  Result<InferRequest> infer =
      ParseInferRequest(std::move(request.body()), json_length, route.model, route.version);
  request = {};
  if (!infer.ok()) return session.Send(StatusResponse(infer.status(), version, keep_alive));
  OutputSelection selection = SelectionOf(*infer);
  session.Submit(
      std::move(*infer),
      [selection = std::move(selection), version, keep_alive](const Result<InferResponse>& result) {
        return InferResponseMessage(result, selection, version, keep_alive);
      },
      version, keep_alive);
}

}  // namespace hearth::rest
