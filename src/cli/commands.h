// The subcommands of `hearth`, a file each. Each Add*Command adds its
// subcommand and options to the app, bound to values it owns, and returns
// what runs it once the command line has been parsed.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <vector>

namespace hearth::cli {

struct Subcommand {
  CLI::App* command;         // parsed() once the command line has chosen it
  std::function<int()> run;  // returns the exit status
};

Subcommand AddStoreCommand(CLI::App& app);
Subcommand AddServeCommand(CLI::App& app);
Subcommand AddInspectCommand(CLI::App& app);
Subcommand AddMakeModelCommand(CLI::App& app);
// The store's administration: list, status, load and unload, in that order.
std::vector<Subcommand> AddAdminCommands(CLI::App& app);
Subcommand AddBenchCommand(CLI::App& app);

}  // namespace hearth::cli
