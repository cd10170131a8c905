// The server process's log settings, read and changed while it runs:
// Triton's log settings extension (REST /v2/logging, gRPC LogSettings)
// mapped onto spdlog's default logger.
//
// spdlog filters by one threshold, so Triton's fields map onto it thus:
//   log_verbose_level > 0   debug (1) or trace (2 and above)
//   log_info                info and above
//   log_warning             warn and above
//   log_error               error and above
// An update that asks for a combination no threshold gives (log_info on
// with log_warning off, say) is refused, naming the fields. log_format
// "default" is hearth's usual line; "ISO8601" puts the time first in ISO
// 8601 form, in UTC. log_file: hearth logs to its standard error only;
// setting a file over the API is refused (a client could otherwise make the
// server write wherever its user may).
//
// Only this process is affected: worker processes keep the level they were
// started with. Thread-safe: updates are serialised; a reader sees one
// update whole or not at all.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "hearth/status.h"

namespace hearth {

// spdlog's pattern for log_format "default" (what `hearth` starts with).
inline constexpr const char* kDefaultLogPattern = "[%Y-%m-%d %H:%M:%S.%e] [%n %P] [%l] %v";
// log_format "ISO8601": UTC time first, as Triton's ISO8601 lines.
inline constexpr const char* kIso8601LogPattern = "%Y-%m-%dT%H:%M:%S.%fZ [%n %P] [%l] %v";

struct LogSettings {
  uint32_t verbose_level = 0;
  bool info = true;
  bool warning = true;
  bool error = true;
  std::string format = "default";  // "default" or "ISO8601"
  std::string file;                // empty: standard error (the only one)
};

// The fields an update sets; those left empty keep their value.
struct LogSettingsUpdate {
  std::optional<uint32_t> verbose_level;
  std::optional<bool> info, warning, error;
  std::optional<std::string> format;
  std::optional<std::string> file;
};

// The settings now, read from spdlog's default logger.
LogSettings CurrentLogSettings();

// Applies `update` whole, or changes nothing and says why (InvalidArgument
// naming the field and value).
Status UpdateLogSettings(const LogSettingsUpdate& update);

}  // namespace hearth
