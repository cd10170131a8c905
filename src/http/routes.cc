#include "http/routes.h"

#include <string>
#include <utility>
#include <vector>

#include "http/endpoints.h"
#include "http/session.h"

namespace hearth::rest {
namespace {

std::optional<std::string> PercentDecode(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] != '%') {
      out += text[i];
      continue;
    }
    if (i + 2 >= text.size()) return std::nullopt;
    auto hex = [](char c) -> int {
      if (c >= '0' && c <= '9') return c - '0';
      if (c >= 'a' && c <= 'f') return c - 'a' + 10;
      if (c >= 'A' && c <= 'F') return c - 'A' + 10;
      return -1;
    };
    const int high = hex(text[i + 1]);
    const int low = hex(text[i + 2]);
    if (high < 0 || low < 0) return std::nullopt;
    out += static_cast<char>(high * 16 + low);
    i += 2;
  }
  return out;
}

}  // namespace

std::optional<Route> ParseRoute(std::string_view target) {
  target = target.substr(0, target.find('?'));
  std::vector<std::string> segments;
  while (!target.empty()) {
    const size_t slash = target.find('/');
    const std::string_view segment = target.substr(0, slash);
    if (!segment.empty()) {
      std::optional<std::string> decoded = PercentDecode(segment);
      if (!decoded.has_value()) return std::nullopt;
      segments.push_back(std::move(*decoded));
    }
    if (slash == std::string_view::npos) break;
    target.remove_prefix(slash + 1);
  }
  Route route;
  const size_t n = segments.size();
  if (n == 1 && segments[0] == "metrics") {
    route.kind = Route::Kind::kMetrics;
    return route;
  }
  if (n >= 2 && segments[0] == "v1") {
    if (n == 2 && segments[1] == "completions") route.kind = Route::Kind::kCompletions;
    if (n == 2 && segments[1] == "models") route.kind = Route::Kind::kOpenAiModels;
    if (n == 3 && segments[1] == "chat" && segments[2] == "completions") {
      route.kind = Route::Kind::kChatCompletions;
    }
    return route;
  }
  if (n == 0 || segments[0] != "v2") return route;
  if (n == 1) {
    route.kind = Route::Kind::kServer;
  } else if (n == 3 && segments[1] == "health") {
    if (segments[2] == "live") route.kind = Route::Kind::kLive;
    if (segments[2] == "ready") route.kind = Route::Kind::kReady;
  } else if (n == 3 && segments[1] == "trace" && segments[2] == "setting") {
    route.kind = Route::Kind::kTraceSetting;
  } else if (n == 2 && segments[1] == "logging") {
    route.kind = Route::Kind::kLogging;
  } else if (n == 3 && segments[1] == "hearth" && segments[2] == "workers") {
    route.kind = Route::Kind::kWorkers;
  } else if (n == 3 && segments[1] == "models" && segments[2] == "stats") {
    // Triton's route wins over a model named "stats".
    route.kind = Route::Kind::kModelStats;
  } else if (n >= 3 && segments[1] == "repository") {
    if (n == 3 && segments[2] == "index") route.kind = Route::Kind::kRepositoryIndex;
    if (n == 5 && segments[2] == "models" && segments[4] == "load") {
      route.kind = Route::Kind::kRepositoryLoad;
    }
    if (n == 5 && segments[2] == "models" && segments[4] == "unload") {
      route.kind = Route::Kind::kRepositoryUnload;
    }
    route.model = n == 5 ? segments[3] : "";
  } else if (n >= 3 && (segments[1] == "systemsharedmemory" || segments[1] == "cudasharedmemory")) {
    // /v2/{system,cuda}sharedmemory[/region/{r}]/{register,unregister,status}
    size_t rest = 2;
    if (n >= 4 && segments[2] == "region") {
      route.region = segments[3];
      rest = 4;
    }
    if (n != rest + 1) return route;
    const std::string& action = segments[rest];
    const bool known =
        action == "status" || action == "unregister" || (action == "register" && rest == 4);
    if (!known) return route;
    if (segments[1] == "cudasharedmemory") {
      route.kind = action == "status"       ? Route::Kind::kCudaShmStatus
                   : action == "unregister" ? Route::Kind::kCudaShmUnregister
                                            : Route::Kind::kCudaShmRegister;
    } else {
      route.kind = action == "status"       ? Route::Kind::kShmStatus
                   : action == "unregister" ? Route::Kind::kShmUnregister
                                            : Route::Kind::kShmRegister;
    }
  } else if (n >= 3 && segments[1] == "models") {
    route.model = segments[2];
    size_t rest = 3;
    if (n >= 5 && segments[3] == "versions") {
      route.version = segments[4];
      rest = 5;
    }
    if (n == rest) {
      route.kind = Route::Kind::kModel;
    } else if (n == rest + 1 && segments[rest] == "ready") {
      route.kind = Route::Kind::kModelReady;
    } else if (n == rest + 1 && segments[rest] == "infer") {
      route.kind = Route::Kind::kInfer;
    } else if (n == rest + 1 && segments[rest] == "generate") {
      route.kind = Route::Kind::kGenerate;
    } else if (n == rest + 1 && segments[rest] == "generate_stream") {
      route.kind = Route::Kind::kGenerateStream;
    } else if (n == rest + 1 && segments[rest] == "config") {
      route.kind = Route::Kind::kModelConfig;
    } else if (n == rest + 1 && segments[rest] == "stats") {
      route.kind = Route::Kind::kModelStats;
    } else if (n == rest + 2 && segments[rest] == "trace" && segments[rest + 1] == "setting") {
      route.kind = Route::Kind::kTraceSetting;
    }
  }
  return route;
}

void Dispatch(Session& session, Request request) {
  const unsigned version = request.version();
  const bool keep_alive = request.keep_alive();
  const std::optional<Route> route = ParseRoute(request.target());
  if (!route.has_value()) {
    return session.Send(
        ErrorResponse(400, "bad percent-encoding in the path", version, keep_alive));
  }
  if (route->kind == Route::Kind::kNone) {
    return session.Send(ErrorResponse(404, "no such endpoint: " + std::string(request.target()),
                                      version, keep_alive));
  }
  // HEAD is GET without the body (Send leaves it out).
  session.ShapeResponseFor(request);
  const bool head = request.method() == http::verb::head;
  const http::verb method =
      head && route->method() == http::verb::get ? http::verb::get : request.method();
  const bool either = route->kind == Route::Kind::kTraceSetting ||
                      route->kind == Route::Kind::kLogging;  // GET reads, POST changes
  if (either && (method == http::verb::get || method == http::verb::post)) {
    return route->kind == Route::Kind::kTraceSetting ? ServeTraceSetting(session, request, *route)
                                                     : ServeLogging(session, request);
  }
  if (method != route->method()) {
    const std::string message = "method " + std::string(request.method_string()) +
                                " is not allowed on " + std::string(request.target());
    Response response =
        route->openai() ? OpenAiErrorResponse(OpenAiRequestError(405, message), version, keep_alive)
                        : ErrorResponse(405, message, version, keep_alive);
    response.set(http::field::allow, either                                ? "GET, POST"
                                     : route->method() == http::verb::post ? "POST"
                                                                           : "GET");
    return session.Send(std::move(response));
  }
  switch (route->kind) {
    case Route::Kind::kLive:
      return ServeLive(session, request);
    case Route::Kind::kReady:
      return ServeReady(session, request);
    case Route::Kind::kServer:
      return ServeServerMetadata(session, request);
    case Route::Kind::kModel:
      return ServeModelMetadata(session, request, *route);
    case Route::Kind::kModelReady:
      return ServeModelReady(session, request, *route);
    case Route::Kind::kInfer:
      return ServeInfer(session, std::move(request), *route);
    case Route::Kind::kGenerate:
      return ServeGenerate(session, std::move(request), *route, false);
    case Route::Kind::kGenerateStream:
      return ServeGenerate(session, std::move(request), *route, true);
    case Route::Kind::kCompletions:
      return ServeOpenAi(session, std::move(request), OpenAiEndpoint::kCompletions);
    case Route::Kind::kChatCompletions:
      return ServeOpenAi(session, std::move(request), OpenAiEndpoint::kChatCompletions);
    case Route::Kind::kOpenAiModels:
      return ServeOpenAiModels(session, request);
    case Route::Kind::kMetrics:
      return ServeMetrics(session, request);
    case Route::Kind::kWorkers:
      return ServeWorkers(session, request);
    case Route::Kind::kModelConfig:
      return ServeModelConfig(session, request, *route);
    case Route::Kind::kModelStats:
      return ServeModelStatistics(session, request, *route);
    case Route::Kind::kRepositoryIndex:
      return ServeRepositoryIndex(session, request);
    case Route::Kind::kRepositoryLoad:
      return ServeRepositoryControl(session, request, *route, true);
    case Route::Kind::kRepositoryUnload:
      return ServeRepositoryControl(session, request, *route, false);
    case Route::Kind::kShmRegister:
      return ServeSystemSharedMemoryRegister(session, request, *route);
    case Route::Kind::kShmUnregister:
      return ServeSystemSharedMemoryUnregister(session, request, *route);
    case Route::Kind::kShmStatus:
      return ServeSystemSharedMemoryStatus(session, request, *route);
    case Route::Kind::kCudaShmRegister:
      return ServeCudaSharedMemoryRegister(session, request, *route);
    case Route::Kind::kCudaShmUnregister:
      return ServeCudaSharedMemoryUnregister(session, request, *route);
    case Route::Kind::kCudaShmStatus:
      return ServeCudaSharedMemoryStatus(session, request, *route);
    case Route::Kind::kTraceSetting:
    case Route::Kind::kLogging:
      break;  // answered above
    case Route::Kind::kNone:
      break;
  }
}

}  // namespace hearth::rest
