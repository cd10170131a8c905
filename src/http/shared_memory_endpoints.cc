#include <vector>

#include "http/endpoints.h"
#include "http/server_core.h"
#include "http/session.h"
#include "http/triton_json.h"

namespace hearth::rest {
namespace {

// A shared-memory registration's answer. PermissionDenied is 500 elsewhere
// (the server's own files); here it is the client asking for memory it may
// not name: 403.
Response RegistrationResponse(const Status& status, unsigned version, bool keep_alive) {
  if (status.code() == StatusCode::kPermissionDenied)
    return ErrorResponse(403, status.message(), version, keep_alive);
  return EmptyOrError(status, version, keep_alive);
}

}  // namespace

void ServeSystemSharedMemoryRegister(Session& session, const Request& request, const Route& route) {
  const unsigned version = request.version();
  const bool keep_alive = request.keep_alive();
  Result<SystemSharedMemoryRegistration> body = ParseSystemSharedMemoryRegisterBody(request.body());
  if (!body.ok()) return session.Send(StatusResponse(body.status(), version, keep_alive));
  return session.Send(RegistrationResponse(
      session.core()->service->RegisterSystemSharedMemory(session.Client(), route.region, body->key,
                                                          body->offset, body->byte_size),
      version, keep_alive));
}

void ServeSystemSharedMemoryUnregister(Session& session, const Request& request,
                                       const Route& route) {
  return session.Send(
      EmptyOrError(session.core()->service->UnregisterSystemSharedMemory(route.region),
                   request.version(), request.keep_alive()));
}

void ServeSystemSharedMemoryStatus(Session& session, const Request& request, const Route& route) {
  const unsigned version = request.version();
  const bool keep_alive = request.keep_alive();
  Result<std::vector<SharedMemoryRegion>> regions =
      session.core()->service->SystemSharedMemoryStatus(route.region);
  if (!regions.ok()) return session.Send(StatusResponse(regions.status(), version, keep_alive));
  return session.Send(MakeResponse(http::status::ok, version, keep_alive,
                                   SystemSharedMemoryStatusJson(*regions), "application/json"));
}

void ServeCudaSharedMemoryRegister(Session& session, const Request& request, const Route& route) {
  const unsigned version = request.version();
  const bool keep_alive = request.keep_alive();
  Result<CudaSharedMemoryRegistration> body = ParseCudaSharedMemoryRegisterBody(request.body());
  if (!body.ok()) return session.Send(StatusResponse(body.status(), version, keep_alive));
  return session.Send(RegistrationResponse(
      session.core()->service->RegisterCudaSharedMemory(
          session.Client(), route.region, body->raw_handle, body->device_id, body->byte_size),
      version, keep_alive));
}

void ServeCudaSharedMemoryUnregister(Session& session, const Request& request, const Route& route) {
  return session.Send(
      EmptyOrError(session.core()->service->UnregisterCudaSharedMemory(route.region),
                   request.version(), request.keep_alive()));
}

void ServeCudaSharedMemoryStatus(Session& session, const Request& request, const Route& route) {
  const unsigned version = request.version();
  const bool keep_alive = request.keep_alive();
  Result<std::vector<CudaSharedMemoryRegion>> regions =
      session.core()->service->CudaSharedMemoryStatus(route.region);
  if (!regions.ok()) return session.Send(StatusResponse(regions.status(), version, keep_alive));
  return session.Send(MakeResponse(http::status::ok, version, keep_alive,
                                   CudaSharedMemoryStatusJson(*regions), "application/json"));
}

}  // namespace hearth::rest
