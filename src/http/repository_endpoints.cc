#include <boost/asio/post.hpp>
#include <memory>
#include <string>
#include <utility>

#include "http/endpoints.h"
#include "http/server_core.h"
#include "http/session.h"
#include "http/triton_json.h"

namespace hearth::rest {
namespace {

// Asks the service for a repository load or unload, which runs on the
// service's own pool (LoadModel waits for the new workers; the I/O thread
// serves on meanwhile), and answers it on this connection's strand. Stop()
// waits for the answer (the InFlightInfer).
void RunControl(Session& session, bool load, const std::string& model, unsigned version,
                bool keep_alive, ModelLoadOverrides overrides = {}) {
  auto in_flight = std::make_shared<InFlightInfer>(session.core());
  auto answer = [self = session.shared_from_this(), version, keep_alive,
                 in_flight](Status status) mutable {
    auto executor = self->executor();
    net::post(executor, [self = std::move(self), status = std::move(status), version,
                         keep_alive]() { self->Send(EmptyOrError(status, version, keep_alive)); });
    in_flight.reset();
  };
  if (load) {
    session.core()->service->LoadModelWith(model, std::move(overrides), std::move(answer));
  } else {
    session.core()->service->UnloadModel(model, std::move(answer));
  }
}

}  // namespace

void ServeRepositoryIndex(Session& session, const Request& request) {
  const unsigned version = request.version();
  const bool keep_alive = request.keep_alive();
  Result<bool> ready_only = ParseRepositoryIndexBody(request.body());
  if (!ready_only.ok()) {
    return session.Send(StatusResponse(ready_only.status(), version, keep_alive));
  }
  return session.Send(
      MakeResponse(http::status::ok, version, keep_alive,
                   RepositoryIndexJson(session.core()->service->RepositoryIndex(*ready_only)),
                   "application/json"));
}

void ServeRepositoryControl(Session& session, const Request& request, const Route& route,
                            bool load) {
  const unsigned version = request.version();
  const bool keep_alive = request.keep_alive();
  if (load) {
    Result<ModelLoadOverrides> overrides = ParseRepositoryLoadBody(request.body());
    if (!overrides.ok())
      return session.Send(StatusResponse(overrides.status(), version, keep_alive));
    return RunControl(session, load, route.model, version, keep_alive, std::move(*overrides));
  }
  // Triton's unload_dependents: accepted; an ensemble's unload leaves the
  // models its steps name served, with it or without it.
  if (Status valid = CheckRepositoryControlBody(request.body(), "unload_dependents"); !valid.ok())
    return session.Send(StatusResponse(valid, version, keep_alive));
  return RunControl(session, load, route.model, version, keep_alive);
}

}  // namespace hearth::rest
