// Routes: which endpoint a request's target names, and the dispatch of a
// request to its endpoint's handler.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "http/responses.h"

namespace hearth::rest {

// The routing table: every endpoint, its method, and which error format it
// answers in (OpenAI's for /v1, KServe's {"error": "..."} for the rest).
struct Route {
  enum class Kind {
    kNone,
    kLive,
    kReady,
    kServer,
    kModel,
    kModelReady,
    kInfer,
    kGenerate,
    kGenerateStream,
    kMetrics,
    kCompletions,
    kChatCompletions,
    kOpenAiModels,
    kModelConfig,
    kModelStats,  // model empty: every model
    kRepositoryIndex,
    kRepositoryLoad,
    kRepositoryUnload,
    kShmRegister,
    kShmUnregister,  // region empty: every region
    kShmStatus,      // likewise
    kCudaShmRegister,
    kCudaShmUnregister,
    kCudaShmStatus,
    kTraceSetting,  // Triton's trace settings (GET or POST): tracing off
    kLogging,       // Triton's log settings (GET or POST)
    kWorkers,       // hearth's own (/v2/hearth/workers): the worker processes
  };
  Kind kind = Kind::kNone;
  std::string model;
  std::string version;
  std::string region;  // shared memory
  http::verb method() const {
    switch (kind) {
      case Kind::kCudaShmRegister:
      case Kind::kCudaShmUnregister:
      case Kind::kRepositoryIndex:
      case Kind::kRepositoryLoad:
      case Kind::kRepositoryUnload:
      case Kind::kShmRegister:
      case Kind::kShmUnregister:
      case Kind::kInfer:
      case Kind::kGenerate:
      case Kind::kGenerateStream:
      case Kind::kCompletions:
      case Kind::kChatCompletions:
        return http::verb::post;
      default:
        return http::verb::get;
    }
  }
  bool openai() const {
    return kind == Kind::kCompletions || kind == Kind::kChatCompletions ||
           kind == Kind::kOpenAiModels;
  }
};

// nullopt: the path is not percent-encoded correctly.
std::optional<Route> ParseRoute(std::string_view target);

class Session;

// Answers `request` on `session`, on its strand: 400 for a path that is not
// percent-encoded correctly, 404 for no endpoint, 405 for the wrong method,
// 501 for Triton's settings hearth does not have; else its endpoint's
// handler (endpoints.h) answers it.
void Dispatch(Session& session, Request request);

}  // namespace hearth::rest
