#include <atomic>
#include <memory>
#include <string>
#include <utility>

#include "http/endpoints.h"
#include "http/event_stream.h"
#include "http/generate.h"
#include "http/server_core.h"
#include "http/session.h"

namespace hearth::rest {

void ServeGenerate(Session& session, Request request, const Route& route, bool stream) {
  const unsigned version = request.version();
  const bool keep_alive = request.keep_alive();
  Result<ModelMetadata> metadata = session.core()->service->Metadata(route.model, route.version);
  if (!metadata.ok()) return session.Send(StatusResponse(metadata.status(), version, keep_alive));
  Result<InferRequest> infer = ParseGenerateRequest(request.body(), *metadata, route.version);
  request = {};
  session.ReleaseBody();  // parsed: nothing refers to the body any more
  if (!infer.ok()) return session.Send(StatusResponse(infer.status(), version, keep_alive));
  std::string id = infer->id;
  if (stream) {
    return session.StartStream(std::move(*infer),
                               std::make_unique<GenerateStreamCodec>(std::move(id)),
                               metadata->decoupled, version, keep_alive);
  }
  // A decoupled model's pieces are joined by the service: no on_response.
  infer->cancelled = std::make_shared<std::atomic<bool>>(false);
  session.Submit(
      std::move(*infer),
      [id = std::move(id), version, keep_alive](const Result<InferResponse>& result) {
        if (!result.ok()) return StatusResponse(result.status(), version, keep_alive);
        Result<std::string> body = GenerateResponseJson(*result, id);
        if (!body.ok()) return StatusResponse(body.status(), version, keep_alive);
        return MakeResponse(http::status::ok, version, keep_alive, std::move(*body),
                            "application/json");
      },
      version, keep_alive);
}

}  // namespace hearth::rest
