// How a Status is answered by the front-ends: one table for REST and gRPC,
// so that both speak of the same failure the same way.
#pragma once

#include "hearth/status.h"

namespace hearth {

struct ProtocolCodes {
  int http;  // the HTTP status
  int grpc;  // the gRPC status code (grpc::StatusCode's value)
};

// kInvalidArgument, kFailedPrecondition, kAlreadyExists: 400; kNotFound: 404;
// kResourceExhausted, kUnavailable: 503 (a limit or a model that is not up:
// retry later); kDeadlineExceeded: 504; kUnimplemented: 501; the rest 500
// (kPermissionDenied included: the server's own files or peers refused it;
// a front-end that refuses a client answers 403 itself). gRPC: its code of
// the same name, INTERNAL for kInternal and kDeviceLost.
ProtocolCodes ProtocolCodesFor(StatusCode code);

}  // namespace hearth
