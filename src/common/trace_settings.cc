#include "common/trace_settings.h"

namespace hearth {

std::vector<TraceSetting> CurrentTraceSettings() {
  return {{"trace_level", {"OFF"}}, {"trace_rate", {"1000"}}, {"trace_count", {"-1"}},
          {"log_frequency", {"0"}}, {"trace_file", {""}},     {"trace_mode", {"triton"}}};
}

Status CheckTraceSettingUpdate(std::string_view name, const std::vector<std::string>& value,
                               bool clear) {
  for (const TraceSetting& setting : CurrentTraceSettings()) {
    if (setting.name != name) continue;
    if (clear || value == setting.value) return Status::Ok();
    std::string asked;
    for (const std::string& v : value) asked += (asked.empty() ? "\"" : ", \"") + v + "\"";
    return InvalidArgument(
        std::string(name) + " [" + asked +
        "]: hearth does not trace requests (it has no trace points in its request path and no "
        "trace writer), so tracing stays off: only trace_level [\"OFF\"] and the current "
        "values can be set");
  }
  return InvalidArgument("unknown trace setting '" + std::string(name) +
                         "': Triton's are trace_level, trace_rate, trace_count, log_frequency, "
                         "trace_file and trace_mode");
}

}  // namespace hearth
