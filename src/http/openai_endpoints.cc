#include <atomic>
#include <ctime>
#include <memory>
#include <string>
#include <utility>

#include "http/endpoints.h"
#include "http/event_stream.h"
#include "http/server_core.h"
#include "http/session.h"

namespace hearth::rest {

void ServeOpenAi(Session& session, Request request, OpenAiEndpoint endpoint) {
  const unsigned version = request.version();
  const bool keep_alive = request.keep_alive();
  std::string param;
  Result<OpenAiRequest> parsed = ParseOpenAiRequest(request.body(), endpoint, &param);
  request = {};
  session.ReleaseBody();
  if (!parsed.ok()) {
    return session.Send(
        OpenAiErrorResponse(OpenAiErrorFor(parsed.status(), param), version, keep_alive));
  }
  Result<ModelMetadata> metadata = session.core()->service->Metadata(parsed->model, "");
  if (!metadata.ok()) {
    return session.Send(
        OpenAiErrorResponse(OpenAiErrorFor(metadata.status(), "model"), version, keep_alive));
  }
  std::string id = NewCompletionId(endpoint);
  Result<InferRequest> infer = OpenAiInferRequest(*parsed, *metadata, id);
  if (!infer.ok()) {
    return session.Send(
        OpenAiErrorResponse(OpenAiErrorFor(infer.status(), "model"), version, keep_alive));
  }
  const auto created = static_cast<int64_t>(std::time(nullptr));
  if (parsed->stream) {
    return session.StartStream(std::move(*infer),
                               std::make_unique<OpenAiStreamCodec>(*parsed, std::move(id), created),
                               metadata->decoupled, version, keep_alive);
  }
  infer->cancelled = std::make_shared<std::atomic<bool>>(false);
  auto completion = std::make_shared<OpenAiCompletion>(*parsed, std::move(id), created);
  session.Submit(
      std::move(*infer),
      [completion = std::move(completion), version,
       keep_alive](const Result<InferResponse>& result) {
        if (!result.ok()) {
          return OpenAiErrorResponse(OpenAiErrorFor(result.status()), version, keep_alive);
        }
        Result<std::string> body = completion->Answer(*result);
        if (!body.ok()) {
          return OpenAiErrorResponse(OpenAiErrorFor(body.status()), version, keep_alive);
        }
        return MakeResponse(http::status::ok, version, keep_alive, std::move(*body),
                            "application/json");
      },
      version, keep_alive);
}

void ServeOpenAiModels(Session& session, const Request& request) {
  return session.Send(MakeResponse(http::status::ok, request.version(), request.keep_alive(),
                                   OpenAiModelListJson(session.core()->service->ModelNames()),
                                   "application/json"));
}

}  // namespace hearth::rest
