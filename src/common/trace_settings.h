// Triton's trace settings extension (REST /v2/trace/setting and
// /v2/models/{m}/trace/setting, gRPC TraceSetting) as hearth has it:
// hearth records no request traces (it has neither trace points in its
// request path nor a trace writer), so its settings read as tracing off,
// with Triton's fields, and an update may only leave it so. Pure functions;
// thread-safe.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "hearth/status.h"

namespace hearth {

struct TraceSetting {
  std::string name;
  std::vector<std::string> value;  // Triton's form: a list of strings
};

// trace_level ["OFF"], trace_rate "1000", trace_count "-1", log_frequency
// "0", trace_file "", trace_mode "triton", in that order.
std::vector<TraceSetting> CurrentTraceSettings();

// Checks one setting of an update: OK when it leaves tracing as it is
// (trace_level ["OFF"]; any setting cleared, `clear`; a value equal to the
// current one), else InvalidArgument saying what is missing. Unknown names
// are InvalidArgument too, naming Triton's.
Status CheckTraceSettingUpdate(std::string_view name, const std::vector<std::string>& value,
                               bool clear);

}  // namespace hearth
