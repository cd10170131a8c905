#include <boost/asio/post.hpp>
#include <exception>
#include <memory>
#include <string>
#include <system_error>
#include <thread>
#include <utility>

#include "http/endpoints.h"
#include "http/server_core.h"
#include "http/session.h"
#include "http/triton_json.h"

namespace hearth::rest {
namespace {

// Repository loads and unloads at once; past it they are answered 503.
constexpr int kMaxControlCalls = 4;

// Runs a repository load or unload on a thread of its own (LoadModel waits
// for the new workers; the I/O thread serves on meanwhile) and answers it
// on this connection's strand. The thread is detached: it touches nothing
// of the server once its InFlightInfer is gone, and Stop() waits for that.
void RunControl(Session& session, bool load, std::string model, unsigned version, bool keep_alive) {
  ServerCore* const core = session.core();
  if (core->control_calls.fetch_add(1) >= kMaxControlCalls) {
    core->control_calls.fetch_sub(1);
    return session.Send(ErrorResponse(503,
                                      "too many repository loads and unloads at once (at most " +
                                          std::to_string(kMaxControlCalls) +
                                          "): try again when one has finished",
                                      version, keep_alive));
  }
  auto in_flight = std::make_shared<InFlightInfer>(core);
  try {
    std::thread([self = session.shared_from_this(), load, model = std::move(model), version,
                 keep_alive, in_flight]() mutable {
      Status status;
      try {
        status = load ? self->core()->service->LoadModel(model)
                      : self->core()->service->UnloadModel(model);
      } catch (const std::exception& e) {
        status = Internal(std::string("repository control failed: ") + e.what());
      }
      self->core()->control_calls.fetch_sub(1);
      {
        auto executor = self->executor();
        net::post(executor,
                  [self = std::move(self), status = std::move(status), version, keep_alive]() {
                    self->Send(EmptyOrError(status, version, keep_alive));
                  });
      }
      in_flight.reset();
    }).detach();
  } catch (const std::system_error& e) {
    core->control_calls.fetch_sub(1);
    return session.Send(
        ErrorResponse(503, std::string("cannot start a thread: ") + e.what(), version, keep_alive));
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
  // Triton's unload_dependents: hearth has no ensembles, nothing depends
  // on another model.
  if (Status valid = CheckRepositoryControlBody(request.body(), load ? "" : "unload_dependents");
      !valid.ok()) {
    return session.Send(StatusResponse(valid, version, keep_alive));
  }
  return RunControl(session, load, route.model, version, keep_alive);
}

}  // namespace hearth::rest
