// What several of `hearth`'s subcommands share: how they fail, how SIGTERM
// and SIGINT stop them, and the options by which a store's clients find it.
#pragma once

#include <sys/types.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "hearth/attach.h"
#include "hearth/status.h"

namespace hearth {
class Store;
}

namespace hearth::cli {

// Prints "hearth: error: MESSAGE" on stderr and returns 1, the exit status.
int Fail(const Status& s);

#ifndef _WIN32
// --shared-memory-users: "none", or users by name or uid, comma-separated.
Result<std::vector<uid_t>> ParseUsers(const std::string& text);
#endif

// ---- SIGTERM and SIGINT ----------------------------------------------------
//
// For `hearth store` and `hearth inspect --hold`: one handler, installed by
// InstallStopHandlers, sets StopRequested(), stops the stores given to
// SetStopTarget and ends WaitForStopSignal.

// Installs the handler for SIGTERM and SIGINT; ignores SIGPIPE. On Windows:
// a console control handler (Ctrl+C, Ctrl+Break, the console closing), which
// reports SIGINT.
void InstallStopHandlers();

// Set by the handler; the loads in Store::Create watch it (StoreOptions::cancel).
std::atomic<bool>& StopRequested();

// The signal that set StopRequested(): 0 before one.
int StopSignalNumber();
// Its name for messages ("Terminated", "Interrupt").
std::string StopSignalName(int signal_number);

// The running store of `slot` (< kMaxStoreDevices, one per device), which
// the handler stops; nullptr: none. Set it before looking at StopRequested()
// (see cli_common.cc).
void SetStopTarget(size_t slot, Store* store);

// Sleeps until the handler has run.
void WaitForStopSignal();

// A check for an integer option: at least `min` (named in the message,
// with the value given), and a whole number.
CLI::Validator AtLeast(long long min);

// ---- a store's clients -----------------------------------------------------

// Adds --socket, the store's Unix socket (default: $HEARTH_SOCKET, else the
// default path); on Windows, the store's pipe name.
void AddSocketOption(CLI::App* cmd, std::string* socket);

// The options of the commands that talk to a running store (inspect --model,
// list, status, load, unload).
struct StoreClientFlags {
  std::string socket = AttachClient::DefaultSocketPath();
  // Clients of a store check who listens on its socket before they send or
  // believe anything: its uid must be ours, root, or one of these.
  std::vector<uint32_t> store_uids;
  // The stores of `hearth store --device A,B` (or of hearth serve's run
  // directory, with --socket RUN_DIR/store.sock) are one per device.
  std::string devices;
};

// Adds --socket, --store-uid and --device, bound to `flags`.
void AddStoreClientOptions(CLI::App* cmd, StoreClientFlags* flags);

// One AttachOptions per device of --device, with the device's name (just
// --socket, named "", without it).
using NamedStores = std::vector<std::pair<std::string, AttachOptions>>;
Result<NamedStores> StoresOf(const StoreClientFlags& flags);

}  // namespace hearth::cli
