#include "backends/llm/stop_strings.h"

#include <algorithm>
#include <utility>

namespace hearth::llm {

StopStrings::StopStrings(std::vector<std::string> stops) {
  for (std::string& s : stops)
    if (!s.empty()) stops_.push_back(std::move(s));
}

std::string StopStrings::Push(std::string_view text) {
  if (stopped_) return {};
  pending_.append(text);
  if (stops_.empty()) return std::exchange(pending_, {});
  size_t first = std::string::npos;
  for (const std::string& s : stops_) first = std::min(first, pending_.find(s));
  if (first != std::string::npos) {
    stopped_ = true;
    std::string out = pending_.substr(0, first);
    pending_.clear();
    return out;
  }
  // Hold back the longest tail that is the start of a stop string.
  size_t hold = 0;
  for (const std::string& s : stops_) {
    for (size_t k = std::min(s.size() - 1, pending_.size()); k > hold; --k) {
      if (std::string_view(pending_).substr(pending_.size() - k) ==
          std::string_view(s).substr(0, k)) {
        hold = k;
        break;
      }
    }
  }
  std::string out = pending_.substr(0, pending_.size() - hold);
  pending_.erase(0, pending_.size() - hold);
  return out;
}

std::string StopStrings::Flush() {
  if (stopped_) return {};
  return std::exchange(pending_, {});
}

}  // namespace hearth::llm
