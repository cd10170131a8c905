// `hearth`: the command-line entry point. The subcommands (store, serve,
// inspect, make-model, the store administration commands list, status, load
// and unload, and bench) live in a file each (commands.h); main() holds the
// global flags and picks the one the command line names.
//
// On Windows (docs/windows.md) serve and bench are not built: they refuse,
// saying so, whatever follows them.
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "cli/commands.h"
#include "common/log_settings.h"

#ifdef _WIN32
namespace {
hearth::cli::Subcommand LinuxOnly(CLI::App& app, const std::string& name) {
  auto* cmd = app.add_subcommand(name, "(Linux only)");
  cmd->allow_extras();
  cmd->prefix_command();
  return {cmd, [name] {
            std::fprintf(stderr, "hearth: error: hearth %s runs on Linux only\n", name.c_str());
            return 1;
          }};
}
}  // namespace
#endif

int main(int argc, char** argv) {
  using namespace hearth::cli;
  CLI::App app{"hearth: one copy of a model's weights, shared read-only by many worker processes"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("hearth ") + HEARTH_VERSION);
  // --log-level may come after the subcommand too (hearth serve --log-level debug).
  app.fallthrough();
  std::string log_level = "info";
  app.add_option("--log-level", log_level,
                 "trace, debug, info, warn, error (before or after the command)")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error"}));

  // In this order in --help.
  std::vector<Subcommand> subcommands;
  subcommands.push_back(AddStoreCommand(app));
#ifdef _WIN32
  subcommands.push_back(LinuxOnly(app, "serve"));
#else
  subcommands.push_back(AddServeCommand(app));
#endif
  subcommands.push_back(AddInspectCommand(app));
  subcommands.push_back(AddMakeModelCommand(app));
  for (Subcommand& admin : AddAdminCommands(app)) subcommands.push_back(std::move(admin));
#ifdef _WIN32
  subcommands.push_back(LinuxOnly(app, "bench"));
#else
  subcommands.push_back(AddBenchCommand(app));
#endif

  CLI11_PARSE(app, argc, argv);
  spdlog::set_level(spdlog::level::from_str(log_level));
  spdlog::set_pattern(hearth::kDefaultLogPattern);

  for (const Subcommand& subcommand : subcommands)
    if (subcommand.command->parsed()) return subcommand.run();
  return 0;
}
