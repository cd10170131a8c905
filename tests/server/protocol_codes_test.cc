// The one table from a Status to REST's and gRPC's codes.
#include "server/protocol_codes.h"

#include <gtest/gtest.h>

namespace hearth {
namespace {

TEST(ProtocolCodes, EachFailureIsAnsweredAlikeByBothProtocols) {
  // gRPC's canonical codes, by number: OK 0, INVALID_ARGUMENT 3,
  // DEADLINE_EXCEEDED 4, NOT_FOUND 5, ALREADY_EXISTS 6, PERMISSION_DENIED 7,
  // RESOURCE_EXHAUSTED 8, FAILED_PRECONDITION 9, UNIMPLEMENTED 12,
  // INTERNAL 13, UNAVAILABLE 14.
  struct Row {
    StatusCode code;
    int http;
    int grpc;
  };
  const Row rows[] = {
      {StatusCode::kOk, 200, 0},
      {StatusCode::kInvalidArgument, 400, 3},
      {StatusCode::kFailedPrecondition, 400, 9},
      {StatusCode::kAlreadyExists, 400, 6},
      {StatusCode::kNotFound, 404, 5},
      {StatusCode::kResourceExhausted, 503, 8},
      {StatusCode::kUnavailable, 503, 14},
      {StatusCode::kDeadlineExceeded, 504, 4},
      {StatusCode::kUnimplemented, 501, 12},
      {StatusCode::kPermissionDenied, 500, 7},
      {StatusCode::kInternal, 500, 13},
      {StatusCode::kDeviceLost, 500, 13},
  };
  for (const Row& row : rows) {
    const ProtocolCodes codes = ProtocolCodesFor(row.code);
    EXPECT_EQ(codes.http, row.http) << StatusCodeName(row.code);
    EXPECT_EQ(codes.grpc, row.grpc) << StatusCodeName(row.code);
  }
}

}  // namespace
}  // namespace hearth
