// `hearth store`: loads models once, one store per device, and shares them
// with the processes that attach them until SIGTERM or SIGINT.
#include <spdlog/spdlog.h>

#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include "cli/cli_common.h"
#include "cli/commands.h"
#include "common/run_together.h"
#include "hearth/store.h"

namespace hearth::cli {
namespace {

// The devices of --device: the default one when it is empty.
Result<std::vector<StoreDevice>> StoreDevicesOf(const std::string& device_text) {
  if (!device_text.empty()) return ParseStoreDevices(device_text);
  std::string why;
  if (!CudaAvailable(&why)) spdlog::info("no usable GPU ({}); using host memory", why);
  const Device d = DefaultDevice();
  return std::vector<StoreDevice>{{d.ToString(), d}};
}

// Exits 0 after SIGTERM or SIGINT once serving; a signal during the initial
// load stops it and exits 128 + the signal's number (143, 130), like a shell.
// With several devices, one store per device, each at DeviceSocketPath(
// socket, device), all loading the --models at once (each from its own
// staging) and all stopped by one signal.
int RunStore(const std::string& socket, const std::vector<std::string>& model_args,
             const std::string& device_text, const std::string& mode_text,
             const std::vector<uint32_t>& allow_uids, const std::vector<uint32_t>& allow_gids,
             int load_threads, const StoreOptions& limits) {
  StoreOptions options = limits;
  options.socket_path = socket;
  options.load_threads = load_threads;
  options.cancel = &StopRequested();
#ifdef _WIN32
  // The pipe admits this user only (docs/windows.md): nothing to widen.
  (void)mode_text;
  (void)allow_uids;
  (void)allow_gids;
#else
  options.allow_uids.assign(allow_uids.begin(), allow_uids.end());
  options.allow_gids.assign(allow_gids.begin(), allow_gids.end());
  unsigned mode = 0;
  auto [ptr, ec] = std::from_chars(mode_text.data(), mode_text.data() + mode_text.size(), mode, 8);
  if (ec != std::errc() || ptr != mode_text.data() + mode_text.size() || mode > 0777)
    return Fail(
        InvalidArgument("--socket-mode '" + mode_text + "' is not an octal mode like 0660"));
  options.socket_mode = mode;
#endif
  Result<std::vector<StoreDevice>> devices = StoreDevicesOf(device_text);
  if (!devices.ok()) return Fail(devices.status());
  for (const std::string& arg : model_args) {
    const size_t eq = arg.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == arg.size())
      return Fail(InvalidArgument("--model '" + arg + "' is not NAME=PATH"));
    options.models.emplace_back(arg.substr(0, eq), arg.substr(eq + 1));
  }
  const bool several = devices->size() > 1;
  std::vector<StoreOptions> each;
  for (const StoreDevice& d : *devices) {
    StoreOptions o = options;
    o.device = d.memory;
    if (several) {
      o.socket_path = DeviceSocketPath(socket, d.name);
      // Progress lines of loads at once would overwrite each other.
      o.show_progress = false;
    }
    each.push_back(std::move(o));
  }
  InstallStopHandlers();
  std::vector<Result<std::unique_ptr<Store>>> made;
  for (size_t i = 0; i < each.size(); ++i) made.emplace_back(Internal("not started"));
  std::vector<std::function<void()>> creates;
  for (size_t i = 0; i < each.size(); ++i)
    creates.push_back([&, i] { made[i] = Store::Create(std::move(each[i])); });
  RunTogether(creates);
  for (size_t i = 0; i < made.size(); ++i) {
    if (made[i].ok()) continue;
    const Status why =
        several ? made[i].status().WithContext((*devices)[i].name) : made[i].status();
    if (StopRequested().load()) {
      const int sig = StopSignalNumber();
      std::fprintf(stderr, "hearth store: %s before the store was ready: %s\n",
                   StopSignalName(sig).c_str(), why.message().c_str());
      return 128 + sig;
    }
    return Fail(why);  // the stores made are destroyed, removing their sockets
  }
  std::string ready;
  for (size_t i = 0; i < made.size(); ++i) {
    SetStopTarget(i, made[i]->get());
    const std::string path = several ? DeviceSocketPath(socket, (*devices)[i].name) : socket;
#ifdef _WIN32
    const std::string kind = "pipe ";
#else
    const std::string kind = "socket ";
#endif
    ready +=
        (ready.empty() ? "" : ", ") + (kind + path) + (several ? " for " + (*devices)[i].name : "");
  }
  if (StopRequested().load())  // a signal that came before SetStopTarget
    for (auto& m : made) (*m)->Stop();
  spdlog::info("store ready: {} ({} models)", ready, model_args.size());
  std::printf("hearth store ready: %s\n", ready.c_str());
  std::fflush(stdout);
  std::vector<Status> ran(made.size(), Status::Ok());
  std::vector<std::function<void()>> runs;
  for (size_t i = 0; i < made.size(); ++i) {
    runs.push_back([&, i] {
      ran[i] = (*made[i])->Run();
      // One store that cannot go on stops the others: the process is one service.
      if (!ran[i].ok())
        for (auto& m : made) (*m)->Stop();
    });
  }
  RunTogether(runs);
  for (size_t i = 0; i < made.size(); ++i) SetStopTarget(i, nullptr);
  for (size_t i = 0; i < ran.size(); ++i)
    if (!ran[i].ok()) return Fail(several ? ran[i].WithContext((*devices)[i].name) : ran[i]);
  return 0;
}

// What the command line sets.
struct StoreFlags {
  std::string socket = AttachClient::DefaultSocketPath();
  std::vector<std::string> models;
  std::string device, socket_mode = "0660";
  std::vector<uint32_t> allow_uids, allow_gids;
  int load_threads = 0;
  StoreOptions limits;
  int64_t unread_timeout_ms = limits.unread_timeout.count();
  int64_t attach_wait_timeout_ms = limits.attach_wait_timeout.count();
};

int RunStoreCommand(StoreFlags& f) {
  if (f.models.empty())
    std::fprintf(stderr, "hearth store: no --model given; load models later with `hearth load`\n");
  f.limits.unread_timeout = std::chrono::milliseconds(f.unread_timeout_ms);
  f.limits.attach_wait_timeout = std::chrono::milliseconds(f.attach_wait_timeout_ms);
  return RunStore(f.socket, f.models, f.device, f.socket_mode, f.allow_uids, f.allow_gids,
                  f.load_threads, f.limits);
}

}  // namespace

Subcommand AddStoreCommand(CLI::App& app) {
  auto* store =
      app.add_subcommand("store", "load models once and share them with attaching processes");
  auto flags = std::make_shared<StoreFlags>();
  StoreOptions& store_limits = flags->limits;
  AddSocketOption(store, &flags->socket);
  store->add_option("--model", flags->models,
                    "NAME=PATH: a safetensors file, or a checkpoint directory (model.safetensors, "
                    "or shards with model.safetensors.index.json, as save_pretrained writes "
                    "them); repeatable");
  store->add_option("--device", flags->device,
                    "cpu or cuda:N (default: cuda:0 if a GPU is usable, else cpu)");
#ifndef _WIN32
  store->add_option("--socket-mode", flags->socket_mode, "permissions of the socket file (octal)")
      ->capture_default_str();
  store->add_option("--allow-uid", flags->allow_uids,
                    "also accept peers with this uid; repeatable");
  store->add_option("--allow-gid", flags->allow_gids,
                    "also accept peers with this gid; repeatable");
#endif
  store
      ->add_option("--load-threads", flags->load_threads, "reader threads per load (0 = automatic)")
      ->capture_default_str()
      ->check(CLI::Range(0, 256));
  store
      ->add_option("--max-leases-per-connection", store_limits.max_leases_per_connection,
                   "attaches one connection may hold; more are refused")
      ->capture_default_str();
  store
      ->add_option("--max-queued-bytes", store_limits.max_queued_bytes,
                   "bytes of replies queued across all connections; at it no requests are read")
      ->capture_default_str();
  store
      ->add_option("--max-unread-descriptors", store_limits.max_unread_descriptors,
                   "descriptors sent and not yet read, all connections (0 = from the "
                   "descriptor limit)")
      ->capture_default_str();
  store
      ->add_option("--unread-timeout-ms", flags->unread_timeout_ms,
                   "while others wait, close a connection that read nothing for this long")
      ->capture_default_str();
  store
      ->add_option("--attach-wait-timeout-ms", flags->attach_wait_timeout_ms,
                   "answer an attach waiting for the descriptor cap RESOURCE_EXHAUSTED after this")
      ->capture_default_str();
  store
      ->add_option("--max-status-leases", store_limits.max_status_leases,
                   "leases listed in a status reply (all are counted)")
      ->capture_default_str();
  store
      ->add_option("--max-connections", store_limits.max_connections,
                   "connections served at once; more are refused (0 = from the descriptor "
                   "limit: half of it less a reserve of 64, at most 4096)")
      ->capture_default_str();
  store
      ->add_option("--max-partial-bytes", store_limits.max_partial_bytes,
                   "bytes of unfinished messages buffered across all connections; a peer "
                   "taking it past this is closed")
      ->capture_default_str();
  return {store, [flags] { return RunStoreCommand(*flags); }};
}

}  // namespace hearth::cli
