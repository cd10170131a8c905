#include "cli/cli_common.h"

#ifdef _WIN32
#include <windows.h>
#else
#include <pwd.h>
#include <unistd.h>
#endif
#include <signal.h>
#include <string.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <system_error>

#include "hearth/store.h"

namespace hearth::cli {
namespace {

// What a SIGTERM or SIGINT reaches: the loads in Store::Create (g_stop),
// then the running stores (g_stores: one per device). The handler sets g_stop
// before it looks at g_stores and RunStore sets each g_stores entry
// (SetStopTarget) before it looks at g_stop (StopRequested), so a signal at any moment is seen by
// one of them (the atomics are lock-free, as a signal handler needs).
std::atomic<bool> g_stop{false};
std::atomic<Store*> g_stores[kMaxStoreDevices];
volatile sig_atomic_t g_stop_signal = 0;
volatile sig_atomic_t g_hold_done = 0;
static_assert(std::atomic<bool>::is_always_lock_free && std::atomic<Store*>::is_always_lock_free);

void OnStopSignal(int signal_number) {
  g_stop_signal = signal_number;
  g_stop.store(true);
  for (auto& slot : g_stores)
    if (Store* store = slot.load(); store != nullptr) store->Stop();
  g_hold_done = 1;
}

}  // namespace

int Fail(const Status& s) {
  std::fprintf(stderr, "hearth: error: %s\n", s.message().c_str());
  return 1;
}

#ifdef _WIN32
namespace {
HANDLE g_hold_event = ::CreateEventA(nullptr, TRUE, FALSE, nullptr);

// Runs in a thread of its own, which Windows starts for the event.
BOOL WINAPI OnConsoleControl(DWORD) {
  OnStopSignal(SIGINT);
  ::SetEvent(g_hold_event);
  return TRUE;
}
}  // namespace

void InstallStopHandlers() { ::SetConsoleCtrlHandler(OnConsoleControl, TRUE); }

void WaitForStopSignal() { ::WaitForSingleObject(g_hold_event, INFINITE); }

std::string StopSignalName(int signal_number) {
  return signal_number == SIGINT ? "Interrupt" : "Terminated";
}
#else
std::string StopSignalName(int signal_number) { return strsignal(signal_number); }

void InstallStopHandlers() {
  struct sigaction sa {};
  sa.sa_handler = OnStopSignal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);
}

#endif

std::atomic<bool>& StopRequested() { return g_stop; }

int StopSignalNumber() { return g_stop_signal; }

void SetStopTarget(size_t slot, Store* store) { g_stores[slot].store(store); }

#ifndef _WIN32
void WaitForStopSignal() {
  while (!g_hold_done) ::pause();
}

Result<std::vector<uid_t>> ParseUsers(const std::string& text) {
  std::vector<uid_t> users;
  if (text == "none") return users;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    const std::string item = text.substr(start, comma - start);
    start = comma + 1;
    if (item.empty())
      return InvalidArgument("--shared-memory-users '" + text + "': an empty entry");
    uid_t uid = 0;
    const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), uid);
    if (ec == std::errc() && end == item.data() + item.size()) {
      users.push_back(uid);
      continue;
    }
    std::vector<char> buffer(16384);
    struct passwd entry {};
    struct passwd* found = nullptr;
    if (::getpwnam_r(item.c_str(), &entry, buffer.data(), buffer.size(), &found) != 0 || !found)
      return InvalidArgument("--shared-memory-users: no user named '" + item + "'");
    users.push_back(found->pw_uid);
  }
  return users;
}

#endif

CLI::Validator AtLeast(long long min) {
  return CLI::Validator(
      [min](std::string& text) -> std::string {
        long long value = 0;
        const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
        if (error != std::errc() || end != text.data() + text.size() || value < min)
          return "must be a whole number, at least " + std::to_string(min) + ", not " + text;
        return "";
      },
      "INT>=" + std::to_string(min));
}

void AddSocketOption(CLI::App* cmd, std::string* socket) {
#ifdef _WIN32
  cmd->add_option("--socket", *socket, "the store's pipe name ($HEARTH_SOCKET)")
#else
  cmd->add_option("--socket", *socket, "the store's Unix socket ($HEARTH_SOCKET)")
#endif
      ->capture_default_str();
}

void AddStoreClientOptions(CLI::App* cmd, StoreClientFlags* flags) {
  AddSocketOption(cmd, &flags->socket);
  cmd->add_option("--store-uid", flags->store_uids,
                  "also trust a store running as this uid (default: only ours and root; "
                  "$HEARTH_STORE_UID adds a comma-separated list); repeatable");
  cmd->add_option("--device", flags->devices,
                  "the stores of these devices (cpu, cuda:N, hostN; comma-separated), each at "
                  "SOCKET-<device>.sock, as `hearth store --device A,B` binds them");
}

Result<NamedStores> StoresOf(const StoreClientFlags& flags) {
  NamedStores stores;
  if (flags.devices.empty()) {
    stores.emplace_back("", AttachOptions{flags.socket, flags.store_uids});
    return stores;
  }
  Result<std::vector<StoreDevice>> devices = ParseStoreDevices(flags.devices);
  if (!devices.ok()) return devices.status();
  for (const StoreDevice& d : *devices)
    stores.emplace_back(d.name,
                        AttachOptions{DeviceSocketPath(flags.socket, d.name), flags.store_uids});
  return stores;
}

}  // namespace hearth::cli
