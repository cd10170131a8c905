#include "common/log_settings.h"

#include <spdlog/spdlog.h>

#include <mutex>

namespace hearth {
namespace {

std::mutex& SettingsMutex() {
  static std::mutex mu;
  return mu;
}

// The format last set; spdlog cannot say which pattern it uses.
std::string& FormatName() {
  static std::string name = "default";
  return name;
}

}  // namespace

LogSettings CurrentLogSettings() {
  std::lock_guard lock(SettingsMutex());
  LogSettings s;
  const spdlog::level::level_enum level = spdlog::get_level();
  s.verbose_level = level == spdlog::level::trace ? 2 : level == spdlog::level::debug ? 1 : 0;
  s.info = level <= spdlog::level::info;
  s.warning = level <= spdlog::level::warn;
  s.error = level <= spdlog::level::err;
  s.format = FormatName();
  return s;
}

Status UpdateLogSettings(const LogSettingsUpdate& update) {
  std::lock_guard lock(SettingsMutex());
  const spdlog::level::level_enum now = spdlog::get_level();
  // Fields left out follow those given where one threshold demands it
  // (log_info true turns warnings and errors on; log_warning false turns
  // info and verbose messages off), else keep their value.
  std::optional<uint32_t> verbose_given = update.verbose_level;
  std::optional<bool> info_given = update.info, warning_given = update.warning,
                      error_given = update.error;
  const bool up =
      verbose_given.value_or(0) > 0 || info_given.value_or(false) || warning_given.value_or(false);
  const bool down =
      !error_given.value_or(true) || !warning_given.value_or(true) || !info_given.value_or(true);
  if (up) {
    if (!error_given.has_value()) error_given = true;
    if (!warning_given.has_value() && (verbose_given.value_or(0) > 0 || info_given.value_or(false)))
      warning_given = true;
    if (!info_given.has_value() && verbose_given.value_or(0) > 0) info_given = true;
  }
  if (down) {
    if (!verbose_given.has_value()) verbose_given = 0;
    if (!info_given.has_value() && (!error_given.value_or(true) || !warning_given.value_or(true)))
      info_given = false;
    if (!warning_given.has_value() && !error_given.value_or(true)) warning_given = false;
  }
  const uint32_t verbose = verbose_given.value_or(now == spdlog::level::trace   ? 2
                                                  : now == spdlog::level::debug ? 1
                                                                                : 0);
  const bool info = info_given.value_or(now <= spdlog::level::info);
  const bool warning = warning_given.value_or(now <= spdlog::level::warn);
  const bool error = error_given.value_or(now <= spdlog::level::err);
  // One threshold: each kind on implies every more severe one on.
  if (verbose > 0 && !info) {
    return InvalidArgument("log_verbose_level " + std::to_string(verbose) +
                           " with log_info false: hearth logs by severity threshold, and verbose "
                           "messages are below info; set log_info true or log_verbose_level 0");
  }
  if (info && !warning) {
    return InvalidArgument(
        "log_info true with log_warning false: hearth logs by severity threshold, so warnings "
        "are logged whenever info messages are; set log_warning true or log_info false");
  }
  if (warning && !error) {
    return InvalidArgument(
        "log_warning true with log_error false: hearth logs by severity threshold, so errors are "
        "logged whenever warnings are; set log_error true or log_warning false");
  }
  if (update.format.has_value() && *update.format != "default" && *update.format != "ISO8601") {
    return InvalidArgument("log_format '" + *update.format +
                           "' is not one of hearth's: \"default\" or \"ISO8601\"");
  }
  if (update.file.has_value() && !update.file->empty()) {
    return InvalidArgument("log_file '" + *update.file +
                           "' cannot be set over the API: hearth logs to its standard error; "
                           "redirect that when starting the server");
  }
  spdlog::level::level_enum level = spdlog::level::off;
  if (verbose >= 2) {
    level = spdlog::level::trace;
  } else if (verbose == 1) {
    level = spdlog::level::debug;
  } else if (info) {
    level = spdlog::level::info;
  } else if (warning) {
    level = spdlog::level::warn;
  } else if (error) {
    level = spdlog::level::err;
  }
  spdlog::set_level(level);
  if (update.format.has_value() && *update.format != FormatName()) {
    if (*update.format == "ISO8601") {
      spdlog::set_pattern(kIso8601LogPattern, spdlog::pattern_time_type::utc);
    } else {
      spdlog::set_pattern(kDefaultLogPattern);
    }
    FormatName() = *update.format;
  }
  return Status::Ok();
}

}  // namespace hearth
