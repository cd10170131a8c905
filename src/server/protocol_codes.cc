#include "server/protocol_codes.h"

namespace hearth {

ProtocolCodes ProtocolCodesFor(StatusCode code) {
  // gRPC's canonical codes (grpc/impl/codegen/status.h), by number.
  constexpr int kGrpcOk = 0, kGrpcInvalidArgument = 3, kGrpcDeadlineExceeded = 4, kGrpcNotFound = 5,
                kGrpcAlreadyExists = 6, kGrpcPermissionDenied = 7, kGrpcResourceExhausted = 8,
                kGrpcFailedPrecondition = 9, kGrpcUnimplemented = 12, kGrpcInternal = 13,
                kGrpcUnavailable = 14;
  switch (code) {
    case StatusCode::kOk:
      return {200, kGrpcOk};
    case StatusCode::kInvalidArgument:
      return {400, kGrpcInvalidArgument};
    case StatusCode::kFailedPrecondition:
      return {400, kGrpcFailedPrecondition};
    case StatusCode::kAlreadyExists:
      return {400, kGrpcAlreadyExists};
    case StatusCode::kNotFound:
      return {404, kGrpcNotFound};
    case StatusCode::kResourceExhausted:
      return {503, kGrpcResourceExhausted};
    case StatusCode::kUnavailable:
      return {503, kGrpcUnavailable};
    case StatusCode::kDeadlineExceeded:
      return {504, kGrpcDeadlineExceeded};
    case StatusCode::kUnimplemented:
      return {501, kGrpcUnimplemented};
    case StatusCode::kPermissionDenied:
      return {500, kGrpcPermissionDenied};
    case StatusCode::kInternal:
    case StatusCode::kDeviceLost:
      break;
  }
  return {500, kGrpcInternal};
}

}  // namespace hearth
