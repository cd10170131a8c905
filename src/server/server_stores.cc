#include "server/server_impl.h"

namespace hearth {

// The sockets' directory: private (0700, ours, no symlink, trusted
// ancestors), so that no other local user can replace the store's socket
// and hand workers impostor weights. A new mkdtemp directory unless the
// options name one, which is then checked (and created if missing).
Status Server::Impl::SetUpRunDirectory() {
  if (options_.run_dir.empty()) {
    ASSIGN_OR_RETURN(run_dir_, MakePrivateDirectory("serve-", kMaxRunDirLength));
    made_run_dir_ = true;
  } else {
    if (options_.run_dir.size() > kMaxRunDirLength)
      return InvalidArgument("run directory " + options_.run_dir + ": " +
                             std::to_string(options_.run_dir.size()) +
                             " bytes, too long for its sockets' paths (at most " +
                             std::to_string(kMaxRunDirLength) + ")");
    struct stat st {};
    const bool existed = ::lstat(options_.run_dir.c_str(), &st) == 0;
    RETURN_IF_ERROR(EnsureTrustedDirectory(options_.run_dir, 0700));
    run_dir_ = options_.run_dir;
    made_run_dir_ = !existed;
  }
  spdlog::info("run directory {}", run_dir_);
  return Status::Ok();
}

// The socket of `device`'s store, started on first use.
Result<std::string> Server::Impl::StoreFor(const StoreDevice& device) {
  std::lock_guard lock(stores_mu_);
  auto it = stores_.find(device.name);
  if (it != stores_.end()) return it->second.socket;
  if (stopping_) return Unavailable("the server is shutting down");
  StoreOptions so;
  so.socket_path = DeviceSocketPath(run_dir_ + "/store.sock", device.name);
  so.device = device.memory;
  so.load_threads = options_.load_threads;
  so.show_progress = true;
  const std::string socket = so.socket_path;
  ASSIGN_OR_RETURN(std::unique_ptr<Store> store, Store::Create(std::move(so)));
  Store* raw = store.get();
  std::thread thread;
  try {
    thread = std::thread([raw] {
      if (Status s = raw->Run(); !s.ok()) spdlog::error("store: {}", s.ToString());
    });
  } catch (const std::system_error& e) {
    return ResourceExhausted("starting the store's thread: " + std::string(e.what()));
  }
  RunningStore& rs = stores_[device.name];
  rs.socket = socket;
  rs.store = std::move(store);
  rs.thread = std::move(thread);
  return rs.socket;
}

// Where the model's instances go (server/placement.h), on what the
// server has: --stand-in-gpus, else the GPUs the CUDA driver sees when it
// serves from a GPU, else the host alone.
Result<std::vector<Placement>> Server::Impl::Place(const ModelConfig& c) {
  PlacementContext context;
  context.workers_per_placement = options_.workers;
  if (options_.stand_in_gpus > 0) {
    context.gpus = true;
    context.visible_gpus = options_.stand_in_gpus;
    context.default_gpu = options_.device.is_cuda() ? options_.device.index : 0;
    context.gpu_source = "--stand-in-gpus";
  } else if (options_.device.is_cuda()) {
    context.gpus = true;
    context.default_gpu = options_.device.index;
    Result<int> count = VisibleGpus();
    context.visible_gpus = count.ok() ? *count : 0;
    const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
    context.gpu_source =
        count.ok() ? std::string("the CUDA driver") +
                         (visible != nullptr
                              ? " (CUDA_VISIBLE_DEVICES=" + std::string(visible).substr(0, 64) + ")"
                              : "")
                   : "the CUDA driver: " + count.status().message();
  }
  Result<std::vector<Placement>> placed = PlaceInstances(c.instance_groups, context);
  if (!placed.ok()) return placed.status().WithContext(c.config_path);
  return placed;
}

// The store device of a placement: the host, a GPU, or host memory
// standing in for a GPU.
StoreDevice Server::Impl::DeviceOf(const Placement& p) const {
  if (p.gpu < 0) return {"cpu", Device::Host()};
  if (options_.stand_in_gpus > 0) return {"host" + std::to_string(p.gpu), Device::Host()};
  return {"cuda:" + std::to_string(p.gpu), Device::Cuda(p.gpu)};
}

// The driver's count, asked once (it cannot change in a process).
Result<int> Server::Impl::VisibleGpus() {
  std::call_once(gpus_once_, [&] { visible_gpus_ = CudaDeviceCount(); });
  return visible_gpus_;
}

// Prepares what each worker is told (the setup message) and places the
// instances, each placement with its device's store.
Status Server::Impl::PlaceModel(ModelRuntime& m) {
  const ModelConfig& c = m.config();
  auto specs = [](const std::vector<IoConfig>& ios) {
    std::vector<TensorSpec> out;
    for (const IoConfig& io : ios) out.push_back({io.name, io.dtype, io.dims});
    return out;
  };
  m.setup.max_batch_size = c.max_batch_size;
  m.setup.parameters = c.parameters;
  m.setup.inputs = specs(WorkerInputs(c));
  m.setup.outputs = specs(WorkerOutputs(c));
  m.setup.config_json = hearth::ModelConfigJson(c);
  m.setup.version_dir = c.version_dir;
  m.setup.decoupled = c.decoupled;
  ASSIGN_OR_RETURN(std::vector<Placement> placed, Place(c));
  m.worker_count = 0;
  for (const Placement& where : placed) {
    auto p = std::make_unique<ModelPlacement>(where.workers);
    const StoreDevice device = DeviceOf(where);
    p->index = static_cast<int>(m.placements.size());
    p->device_name = device.name;
    p->memory = device.memory;
    ASSIGN_OR_RETURN(p->store_socket, StoreFor(device));
    m.worker_count += where.workers;
    m.placements.push_back(std::move(p));
  }
  return Status::Ok();
}

// Has each placement's store hold the weights: the loads of all devices at
// once, each store reading the checkpoint into its own staging. A store
// that holds a version for this entry is asked to reuse it; the store
// decides, comparing the files it finds at the path with those it read that
// version from (the server never opens the checkpoint). The signature comes
// from the workers, checked against the config's. `keep_loaded`: what the
// stores held for the entry is still served (a repository load): the caller
// drops it once the new runtime replaced it. Then the model's queue.
Status Server::Impl::LoadWeights(ModelEntry& entry, ModelRuntime& m, bool keep_loaded) {
  const ModelConfig& c = m.config();
  // A version without weights (backend: python, model.py alone): the stores
  // hold nothing for it, and its workers attach nothing.
  const bool weightless = c.checkpoint_path.empty();
  std::error_code ec;
  const std::string absolute =
      weightless ? std::string() : std::filesystem::absolute(c.checkpoint_path, ec).string();
  if (ec) return InvalidArgument(c.checkpoint_path + ": " + ec.message());
  // What the stores hold of an earlier attempt on a device no longer placed
  // (or placed on another store) goes, unless it is still served.
  for (auto it = entry.loaded.begin(); it != entry.loaded.end();) {
    const bool placed_there =
        !weightless && std::any_of(m.placements.begin(), m.placements.end(), [&](const auto& p) {
          return p->device_name == it->first && p->store_socket == it->second.socket;
        });
    if (placed_there) {
      ++it;
      continue;
    }
    if (!keep_loaded) DropFromStore(c.name, it->second);
    it = entry.loaded.erase(it);
  }
  // Not served: each store holding an earlier attempt's version is asked
  // first whether it is still what the files hold (reuse only); a version
  // whose files changed goes before its replacement is loaded.
  if (!keep_loaded) {
    std::vector<ModelPlacement*> held;
    for (const auto& p : m.placements)
      if (entry.loaded.count(p->device_name) != 0) held.push_back(p.get());
    std::vector<Result<StoreLoad>> checks(held.size(), Internal("not asked"));
    std::vector<std::function<void()>> asks;
    for (size_t i = 0; i < held.size(); ++i)
      asks.push_back([&, i] {
        checks[i] =
            AttachClient(held[i]->store_socket)
                .LoadOrReuse(c.name, absolute, entry.loaded.at(held[i]->device_name).version,
                             /*reuse_only=*/true);
      });
    RunTogether(asks);
    for (size_t i = 0; i < held.size(); ++i) {
      if (checks[i].ok()) continue;
      if (checks[i].status().code() != StatusCode::kFailedPrecondition)
        return checks[i].status().WithContext(c.checkpoint_path + " on " + held[i]->device_name);
      DropFromStore(c.name, entry.loaded.at(held[i]->device_name));
      entry.loaded.erase(held[i]->device_name);
    }
  }
  // Every placement the stores hold no version for is loaded; one that
  // still has a version (a repository load) has it reused if its files are
  // unchanged, else a new version is loaded beside it.
  std::vector<ModelPlacement*> to_load;
  std::vector<uint64_t> reuse;
  for (const auto& p : m.placements) {
    if (weightless) break;
    auto held = entry.loaded.find(p->device_name);
    if (!keep_loaded && held != entry.loaded.end()) continue;  // reused above
    to_load.push_back(p.get());
    reuse.push_back(held != entry.loaded.end() ? held->second.version : 0);
  }
  std::vector<Result<StoreLoad>> results(to_load.size(), Internal("not loaded"));
  std::vector<std::function<void()>> loads;
  for (size_t i = 0; i < to_load.size(); ++i)
    loads.push_back([&, i] {
      results[i] = AttachClient(to_load[i]->store_socket).LoadOrReuse(c.name, absolute, reuse[i]);
    });
  const auto load_started = Clock::now();
  RunTogether(loads);
  Status failed = Status::Ok();
  std::string devices;  // where weights were read
  size_t read = 0;
  for (size_t i = 0; i < to_load.size(); ++i) {
    ModelPlacement& p = *to_load[i];
    if (!results[i].ok()) {
      if (failed.ok())
        failed = results[i].status().WithContext(c.checkpoint_path + " on " + p.device_name);
      // The version held (still served) is not known to be current.
      entry.loaded.erase(p.device_name);
      continue;
    }
    if (results[i]->reused) continue;
    devices += (devices.empty() ? "" : ", ") + p.device_name;
    ++read;
    // Kept even when another device failed: a retry reuses it. A version it
    // replaces is still served: the caller drops it.
    entry.loaded[p.device_name] = {p.store_socket, results[i]->model.version,
                                   results[i]->model.arena_size};
  }
  RETURN_IF_ERROR(failed);
  if (read > 0)
    spdlog::info("model {}: weights loaded on {} in {:.3f} s{}", c.name, devices,
                 std::chrono::duration<double>(Clock::now() - load_started).count(),
                 read > 1 ? " (at once)" : "");
  for (const auto& p : m.placements) {
    if (weightless) break;  // store_version 0, arena_bytes 0
    const ModelEntry::Loaded& l = entry.loaded.at(p->device_name);
    p->store_version = l.version;
    p->arena_bytes = l.arena_bytes;
  }
  m.shared_memory = &shared_memory_;
  m.hangups = &hangups_;
  m.queue = std::make_unique<JobQueue>(std::max<uint64_t>(1, c.max_queue_size));
  if (c.sequence)
    m.sequences =
        std::make_shared<SequenceTable>(m.name, *c.sequence, c.max_sequences, c.max_batch_size > 0);
  // A decoupled model's worker serves one request (one stream) at a time.
  m.policy.max_batch = c.decoupled ? 1 : m.max_batch();
  m.stats.max_batch = m.max_batch();
  m.stats.batch_totals =
      std::make_unique<ModelStats::BatchTotals[]>(static_cast<size_t>(m.max_batch()) + 1);
  m.policy.max_delay = std::chrono::microseconds(c.max_queue_delay_us);
  m.policy.preferred.assign(c.preferred_batch_sizes.begin(), c.preferred_batch_sizes.end());
  std::sort(m.policy.preferred.begin(), m.policy.preferred.end());
  return Status::Ok();
}

// Drops each version of `from` that `keep` does not hold for its device.
void Server::Impl::DropChanged(const std::string& name,
                               const std::map<std::string, ModelEntry::Loaded>& from,
                               const std::map<std::string, ModelEntry::Loaded>& keep) {
  for (const auto& [device, loaded] : from) {
    auto k = keep.find(device);
    if (k == keep.end() || k->second != loaded) DropFromStore(name, loaded);
  }
}

void Server::Impl::DropFromStore(const std::string& name, const ModelEntry::Loaded& loaded) {
  if (auto dropped = AttachClient(loaded.socket).Unload(name, loaded.version); !dropped.ok())
    spdlog::warn("model {}: dropping version {} from the store: {}", name, loaded.version,
                 dropped.status().message());
}

}  // namespace hearth
