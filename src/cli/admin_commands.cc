// The store's administration: `hearth list`, `status`, `load` and `unload`,
// each on the store of --socket, or on every store of --device; and
// `hearth status --url`, a running `hearth serve`'s worker processes.
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "cli/cli_common.h"
#include "cli/commands.h"
#include "common/run_together.h"
#include "hearth/attach.h"
#include "hearth/checksum.h"
#ifndef _WIN32
#include "http/workers_json.h"
#include "loadgen/load_generator.h"
#endif

namespace hearth::cli {
namespace {

std::string TimeText(int64_t unix_ms) {
  const time_t t = static_cast<time_t>(unix_ms / 1000);
  tm local{};
#ifdef _WIN32
  localtime_s(&local, &t);
#else
  localtime_r(&t, &local);
#endif
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%d %H:%M:%S", &local);
  return text;
}

int ListModels(const AttachOptions& store) {
  auto models = AttachClient(store).ListModels();
  if (!models.ok()) return Fail(models.status());
  std::printf("%-20s %8s %-8s %8s %14s %8s  %-16s  %s\n", "model", "version", "device", "tensors",
              "bytes", "attached", "checksum", "path");
  for (const ModelSummary& m : *models) {
    std::printf("%-20s %8llu %-8s %8u %14llu %8u  %s  %s\n", m.name.c_str(),
                static_cast<unsigned long long>(m.version), m.device.ToString().c_str(),
                m.tensor_count, static_cast<unsigned long long>(m.tensor_bytes), m.attached,
                ChecksumHex(m.checksum).c_str(), m.path.c_str());
  }
  return 0;
}

int ShowStatus(const AttachOptions& store) {
  auto status = AttachClient(store).GetStatus();
  if (!status.ok()) return Fail(status.status());
  std::printf("store pid %d on %s, %u connections\n", status->pid,
              status->device.ToString().c_str(), status->connections);
  uint64_t held_bytes = 0;
  for (const ArenaInfo& a : status->arenas) held_bytes += a.bytes;
  std::printf("holds %zu arenas, %llu bytes; %llu leases\n", status->arenas.size(),
              static_cast<unsigned long long>(held_bytes),
              static_cast<unsigned long long>(status->lease_total));
  std::printf("arenas:\n");
  for (const ArenaInfo& a : status->arenas) {
    std::printf("  %s@%llu  %llu bytes  %s  attached %u\n", a.model.c_str(),
                static_cast<unsigned long long>(a.version),
                static_cast<unsigned long long>(a.bytes), a.registered ? "registered" : "unloaded",
                a.attached);
  }
  std::printf("attached clients:\n");
  for (const LeaseInfo& l : status->leases) {
    std::printf("  pid %d uid %u  %s@%llu  since %s\n", l.pid, l.uid, l.model.c_str(),
                static_cast<unsigned long long>(l.version), TimeText(l.since_ms).c_str());
  }
  if (status->lease_total > status->leases.size())
    std::printf("  ... %llu leases in all, %zu listed\n",
                static_cast<unsigned long long>(status->lease_total), status->leases.size());
  if (!status->counters.empty()) {
    std::printf("counters:\n");
    for (const auto& [name, value] : status->counters)
      std::printf("  %s %llu\n", name.c_str(), static_cast<unsigned long long>(value));
  }
  return 0;
}

#ifndef _WIN32
std::string MemoryText(uint64_t bytes) {
  char text[32];
  if (bytes < (1u << 20)) {
    std::snprintf(text, sizeof text, "%llu B", static_cast<unsigned long long>(bytes));
  } else {
    std::snprintf(text, sizeof text, "%.1f MiB", static_cast<double>(bytes) / (1 << 20));
  }
  return text;
}

#endif

#ifdef _WIN32
// hearth serve runs on Linux only (docs/windows.md).
int ShowServerWorkers(const std::string&) {
  return Fail(Unavailable("status --url asks a hearth serve, which runs on Linux only"));
}
#else
// `hearth status --url`: a table of the served models' worker processes,
// standbys and hot spares, a line each, from GET /v2/hearth/workers: the
// device memory each reported of its own buffers, and what the NVIDIA
// driver accounts to its process ("-" where the server does not know).
int ShowServerWorkers(const std::string& url) {
  Result<std::string> body = HttpGet(url, "/v2/hearth/workers");
  if (!body.ok()) return Fail(body.status());
  Result<std::vector<ModelWorkers>> models = ParseWorkersJson(*body);
  if (!models.ok())
    return Fail(models.status().WithContext("the answer of " + url + "/v2/hearth/workers"));
  if (models->empty()) {
    std::printf("%s serves no model\n", url.c_str());
    return 0;
  }
  struct Row {
    std::string model, device, process, pid, ready, restarts, memory, driver_memory, warm_up;
  };
  std::vector<Row> rows = {{"MODEL", "DEVICE", "PROCESS", "PID", "READY", "RESTARTS", "OWN BUFFERS",
                            "GPU MEMORY (DRIVER)", "WARM-UP"}};
  auto driver_text = [](const std::optional<uint64_t>& bytes) {
    return bytes.has_value() ? MemoryText(*bytes) : std::string("-");
  };
  for (const ModelWorkers& m : *models) {
    const std::string model = m.name + " v" + m.version;
    for (const PlacementWorkers& p : m.placements) {
      for (const WorkerInfo& w : p.workers)
        rows.push_back({model, p.device, "worker " + std::to_string(w.index),
                        w.pid > 0 ? std::to_string(w.pid) : "-", w.ready ? "yes" : "no",
                        std::to_string(w.restarts), MemoryText(w.device_memory_bytes),
                        driver_text(w.driver_device_memory_bytes), "-"});
      for (const StandbyInfo& sb : p.standbys)
        rows.push_back(
            {model, p.device, "standby", std::to_string(sb.pid), "-", "-", "-", "-", "-"});
      for (const HotSpareInfo& h : p.hot_spares) {
        char warm_up[32];
        std::snprintf(warm_up, sizeof warm_up, "%.1f ms", h.warm_up_us / 1e3);
        rows.push_back({model, p.device, "hot spare", std::to_string(h.pid), "-", "-",
                        MemoryText(h.device_memory_bytes),
                        driver_text(h.driver_device_memory_bytes), warm_up});
      }
    }
  }
  std::vector<size_t> width(9, 0);
  for (const Row& r : rows) {
    const std::string* cells[] = {&r.model,    &r.device, &r.process,       &r.pid,    &r.ready,
                                  &r.restarts, &r.memory, &r.driver_memory, &r.warm_up};
    for (size_t i = 0; i < 9; ++i) width[i] = std::max(width[i], cells[i]->size());
  }
  for (const Row& r : rows) {
    std::printf("%-*s  %-*s  %-*s  %*s  %-*s  %*s  %*s  %*s  %*s\n", static_cast<int>(width[0]),
                r.model.c_str(), static_cast<int>(width[1]), r.device.c_str(),
                static_cast<int>(width[2]), r.process.c_str(), static_cast<int>(width[3]),
                r.pid.c_str(), static_cast<int>(width[4]), r.ready.c_str(),
                static_cast<int>(width[5]), r.restarts.c_str(), static_cast<int>(width[6]),
                r.memory.c_str(), static_cast<int>(width[7]), r.driver_memory.c_str(),
                static_cast<int>(width[8]), r.warm_up.c_str());
  }
  return 0;
}
#endif

// `hearth load` into each device's store, all at once (each store reads the
// checkpoint into its own staging); one line per device, in order.
int LoadEverywhere(const NamedStores& stores, const std::string& arg) {
  const size_t eq = arg.find('=');
  if (eq == std::string::npos || eq == 0 || eq + 1 == arg.size())
    return Fail(InvalidArgument("'" + arg + "' is not NAME=PATH"));
  std::string path = arg.substr(eq + 1);
#ifdef _WIN32
  char resolved[_MAX_PATH];
  if (::_fullpath(resolved, path.c_str(), sizeof resolved) != nullptr) path = resolved;
#else
  char resolved[PATH_MAX];
  if (::realpath(path.c_str(), resolved) != nullptr) path = resolved;
#endif
  std::vector<Result<ModelSummary>> loaded(stores.size(), Internal("not loaded"));
  std::vector<std::function<void()>> loads;
  for (size_t i = 0; i < stores.size(); ++i)
    loads.push_back(
        [&, i] { loaded[i] = AttachClient(stores[i].second).Load(arg.substr(0, eq), path); });
  RunTogether(loads);
  int rc = 0;
  for (size_t i = 0; i < stores.size(); ++i) {
    const std::string on = stores[i].first.empty() ? "" : " on " + stores[i].first;
    if (!loaded[i].ok()) {
      rc = Fail(stores[i].first.empty() ? loaded[i].status()
                                        : loaded[i].status().WithContext(stores[i].first));
      continue;
    }
    const ModelSummary& m = *loaded[i];
    std::printf("loaded %s@%llu%s (%u tensors, %llu bytes, checksum %s)\n", m.name.c_str(),
                static_cast<unsigned long long>(m.version), on.c_str(), m.tensor_count,
                static_cast<unsigned long long>(m.tensor_bytes), ChecksumHex(m.checksum).c_str());
  }
  return rc;
}

int UnloadModel(const AttachOptions& store, const std::string& model_text) {
  Result<ModelRef> ref = ModelRef::Parse(model_text);
  if (!ref.ok()) return Fail(ref.status());
  auto removed = AttachClient(store).Unload(ref->name, ref->version);
  if (!removed.ok()) return Fail(removed.status());
  std::printf("unloaded %u version(s) of %s\n", *removed, ref->name.c_str());
  return 0;
}

// Runs `command` on each device's store (a heading before each when there
// are several); fails if any fails.
int OnEach(const NamedStores& stores, const std::function<int(const AttachOptions&)>& command) {
  int rc = 0;
  for (size_t i = 0; i < stores.size(); ++i) {
    const auto& [name, options] = stores[i];
    if (stores.size() > 1)
      std::printf("%s== %s: %s\n", i == 0 ? "" : "\n", name.c_str(), options.socket_path.c_str());
    std::fflush(stdout);
    rc = std::max(rc, command(options));
  }
  return rc;
}

// What the command line sets.
struct AdminFlags {
  StoreClientFlags client;
  std::string model;  // load: NAME=PATH; unload: NAME[@VERSION]
  std::string url;    // status: a running hearth serve's instead of a store's
};

using AdminRun = std::function<int(const NamedStores& stores, const std::string& model)>;

// `cmd`, run on the stores its options name.
Subcommand Bind(CLI::App* cmd, std::shared_ptr<AdminFlags> flags, AdminRun run) {
  return {cmd, [flags, run] {
            Result<NamedStores> stores = StoresOf(flags->client);
            if (!stores.ok()) return Fail(stores.status());
            return run(*stores, flags->model);
          }};
}

}  // namespace

std::vector<Subcommand> AddAdminCommands(CLI::App& app) {
  std::vector<Subcommand> commands;

  auto* list = app.add_subcommand("list", "list the models a store holds");
  auto list_flags = std::make_shared<AdminFlags>();
  AddStoreClientOptions(list, &list_flags->client);
  commands.push_back(Bind(list, list_flags, [](const NamedStores& stores, const std::string&) {
    return OnEach(stores, ListModels);
  }));

  auto* status = app.add_subcommand(
      "status",
      "show a store's attached clients and arenas, or (--url) a running hearth serve's workers");
  auto status_flags = std::make_shared<AdminFlags>();
  AddStoreClientOptions(status, &status_flags->client);
  status
      ->add_option("--url", status_flags->url,
                   "http://HOST:PORT of a running `hearth serve` (its REST port): list its "
                   "models' workers, standby workers and hot spares instead of a store's state")
      ->excludes("--socket", "--device", "--store-uid");
  commands.push_back({status, [status_flags] {
                        if (!status_flags->url.empty()) return ShowServerWorkers(status_flags->url);
                        Result<NamedStores> stores = StoresOf(status_flags->client);
                        if (!stores.ok()) return Fail(stores.status());
                        return OnEach(*stores, ShowStatus);
                      }});

  auto* load =
      app.add_subcommand("load", "load a checkpoint into a running store as a new version");
  auto load_flags = std::make_shared<AdminFlags>();
  AddStoreClientOptions(load, &load_flags->client);
  load->add_option("model", load_flags->model,
                   "NAME=PATH: a safetensors file or a checkpoint directory (model.safetensors, "
                   "or shards with model.safetensors.index.json)")
      ->required();
  commands.push_back(Bind(load, load_flags, LoadEverywhere));

  auto* unload = app.add_subcommand("unload", "remove a model (all versions, or NAME@VERSION)");
  auto unload_flags = std::make_shared<AdminFlags>();
  AddStoreClientOptions(unload, &unload_flags->client);
  unload->add_option("model", unload_flags->model, "NAME[@VERSION]")->required();
  commands.push_back(
      Bind(unload, unload_flags, [](const NamedStores& stores, const std::string& model) {
        return OnEach(stores, [&](const AttachOptions& o) { return UnloadModel(o, model); });
      }));

  return commands;
}

}  // namespace hearth::cli
