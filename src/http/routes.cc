#include "http/routes.h"

#include <utility>
#include <vector>

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

}  // namespace hearth::rest
