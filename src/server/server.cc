#include "server/server_impl.h"

// A model's parameters must fit in the one control message that carries them.
static_assert(4 + 8 * hearth::kMaxModelParameters + hearth::kMaxModelParameterBytes <
              hearth::control::kMaxSetupBytes / 2);

namespace hearth {
namespace {

// A test seam: with $HEARTH_TEST_BLOCK_BUILD set to exactly this model's
// name, its builder blocks in a read() that never returns, as one reading
// the model's files from a hung network filesystem would. A test of
// stopping the server past such a builder then needs no such filesystem.
void BlockForTests(const std::string& model) {
  const char* blocked = std::getenv("HEARTH_TEST_BLOCK_BUILD");
  if (blocked == nullptr || model != blocked) return;
  spdlog::warn("model {}: its builder is blocked by HEARTH_TEST_BLOCK_BUILD", model);
  int fds[2];
  if (::pipe(fds) != 0) return;
  char byte;
  while (::read(fds[0], &byte, 1) < 0 && errno == EINTR) {
  }
}

// Wait between attempts to bring up a model that failed: 1, 2, 4, then every 5 s.
std::chrono::milliseconds RetryDelay(int attempt) {
  return std::chrono::milliseconds(std::min(1000 << std::min(attempt, 3), 5000));
}

}  // namespace

Status Server::Impl::Start() {
  const auto started = Clock::now();
  {
    // Shutdown() waits for this block, so that it never sees the entries or
    // the builders half made.
    std::lock_guard lifecycle(lifecycle_mu_);
    if (stopping_) return Unavailable("the server was shut down before it started");
    RETURN_IF_ERROR(SetUpRunDirectory());
    if (Status watching = hangups_.Start(); !watching.ok())
      spdlog::warn("workers that die while idle are noticed within 100 ms, not at once: {}",
                   watching.message());
    ASSIGN_OR_RETURN(std::vector<ModelDirectory> dirs, ListModelDirectories(options_.repository));
    if (dirs.empty())
      spdlog::warn("model repository {} holds no model directories", options_.repository);
    std::vector<ModelEntry*> made;
    {
      std::unique_lock entries_lock(entries_mu_);
      for (ModelDirectory& d : dirs) {
        auto entry = std::make_unique<ModelEntry>();
        entry->dir = std::move(d);
        const std::string name = entry->dir.name;
        made.push_back(entry.get());
        entries_.emplace(name, std::move(entry));
      }
    }
    {
      std::lock_guard lock(events_mu_);
      for (ModelEntry* entry : made) build_queue_.emplace(started, entry);
    }
    // A bounded pool, however many models: a thread per model would meet
    // the pids or RLIMIT_NPROC limit with a large repository.
    // At least one: models loaded later through the repository API are
    // retried in the background like the others.
    const size_t want = std::min(kMaxBuilders, std::max<size_t>(1, made.size()));
    for (size_t i = 0; i < want; ++i) {
      try {
        builders_.emplace_back([this] { BuilderLoop(); });
      } catch (const std::system_error& e) {
        if (builders_.empty())
          return ResourceExhausted("starting the threads that load models: " +
                                   std::string(e.what()));
        spdlog::warn("loading models with {} threads instead of {}: {}", builders_.size(), want,
                     e.what());
        break;
      }
    }
  }
  try {
    reaper_ = std::thread([this] { ReaperLoop(); });
  } catch (const std::system_error& e) {
    return ResourceExhausted("starting the thread that frees replaced models: " +
                             std::string(e.what()));
  }
  started_at_ = started;
  settle_deadline_ = started + std::chrono::milliseconds(options_.ready_timeout_ms);
  started_ = true;
  return Status::Ok();
}

Status Server::Impl::WaitForModels() {
  if (!started_) return FailedPrecondition("the server has not been started");
  {
    std::unique_lock lock(events_mu_);
    events_cv_.wait_until(lock, settle_deadline_, [&] { return AllSettled(); });
  }
  if (stopping_) return Unavailable("the server was shut down while its models were loading");
  std::shared_lock entries_lock(entries_mu_);
  for (auto& [name, entry] : entries_) {
    const std::shared_ptr<ModelRuntime> m = entry->served.load();
    if (m == nullptr || m->is_ensemble()) continue;
    spdlog::info("model {}: {} of {} workers ready {:.3f} s after start-up began", name,
                 m->ready_workers.load(), m->worker_count,
                 std::chrono::duration<double>(Clock::now() - started_at_).count());
  }
  return Status::Ok();
}

void Server::Impl::KillWorkers() {
  std::shared_lock entries_lock(entries_mu_);
  for (auto& [name, entry] : entries_) {
    std::lock_guard lock(entry->mu);
    std::vector<std::shared_ptr<ModelRuntime>> runtimes(entry->retired.begin(),
                                                        entry->retired.end());
    if (std::shared_ptr<ModelRuntime> m = entry->served.load()) runtimes.push_back(std::move(m));
    for (const std::shared_ptr<ModelRuntime>& m : runtimes) {
      m->RequestStop(true);
      for (auto& w : m->workers) w->Kill();
    }
  }
}

bool Server::Impl::Shutdown(std::optional<std::chrono::milliseconds> builder_grace) {
  if (shut_down_.exchange(true)) return true;
  {
    std::lock_guard lock(events_mu_);
    stopping_ = true;
  }
  events_cv_.notify_all();
  // What the reaper has not freed yet is joined below.
  {
    std::lock_guard lock(reap_mu_);
    reaper_quit_ = true;
  }
  reap_cv_.notify_all();
  if (reaper_.joinable()) reaper_.join();
  // First, so that a builder reading a large checkpoint into a store
  // returns now instead of at the end of the load.
  {
    std::lock_guard lock(stores_mu_);
    for (auto& [device, s] : stores_) s.store->CancelLoads();
  }
  // Repository calls: a load in progress ends with the model it builds,
  // those still queued are answered Unavailable (they see stopping_).
  {
    std::shared_lock entries_lock(entries_mu_);
    for (auto& [name, entry] : entries_) {
      std::lock_guard lock(entry->mu);
      if (entry->building != nullptr) entry->building->RequestStop(true);
    }
  }
  repository_calls_.Stop();
  std::lock_guard lifecycle(lifecycle_mu_);
  std::shared_lock entries_lock(entries_mu_);
  for (auto& [name, entry] : entries_) {
    std::lock_guard lock(entry->mu);
    if (entry->building != nullptr) entry->building->RequestStop(true);
    // A served model's starting workers are needed only if none is up to
    // run what is queued.
    if (const std::shared_ptr<ModelRuntime> m = entry->served.load())
      m->RequestStop(m->ready_workers.load() > 0 || m->queue->size() == 0);
    for (auto& r : entry->retired) r->RequestStop(true);
  }
  // Every builder returns once its attempt sees the stop, unless the kernel
  // holds it in a read of the model's files; with a grace, such a one is left.
  std::set<std::thread::id> stuck;
  if (builder_grace.has_value()) {
    std::unique_lock lock(events_mu_);
    if (!events_cv_.wait_for(lock, *builder_grace, [&] { return builder_work_.empty(); })) {
      for (const auto& [id, model] : builder_work_) {
        spdlog::error(
            "model {}: its loader did not return within {} ms of the stop (blocked reading the "
            "model's files?); the server stops without it",
            model, builder_grace->count());
        stuck.insert(id);
      }
    }
  }
  for (std::thread& b : builders_) {
    if (stuck.count(b.get_id()) > 0) {
      b.detach();
    } else {
      b.join();
    }
  }
  builders_.clear();
  for (auto& [name, entry] : entries_) {
    for (auto& r : entry->retired) r->JoinWorkers();
    const std::shared_ptr<ModelRuntime> m = entry->served.load();
    if (m == nullptr) continue;
    m->JoinWorkers();
    if (m->sequences) m->sequences->FailAll(Unavailable("the server is shutting down"));
    m->queue->FailAll(Unavailable("the server is shutting down"));
    if (const uint64_t n = m->stats.batches.load(), r = m->stats.requests.load();
        n > 0 && r > 0 && !m->is_ensemble()) {
      spdlog::info(
          "model {}: {} requests in {} batches; mean {:.3f} ms per batch in the backend, "
          "{:.3f} ms from request to answer in the server",
          name, r, n, m->stats.run_us.load() / 1e3 / n, m->stats.request_us.load() / 1e3 / r);
    }
  }
  // A builder left behind may be inside a store's load: the stores stay as
  // they are, for the process to exit.
  if (!stuck.empty()) return false;
  {
    std::lock_guard lock(stores_mu_);
    for (auto& [device, s] : stores_) {
      s.store->Stop();
      if (s.thread.joinable()) s.thread.join();
    }
    stores_.clear();  // each store removes its socket
  }
  // Only what this server made: the directory, if it created it, and only
  // once it is empty.
  if (!run_dir_.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(run_dir_ + "/overrides", ec);
  }
  if (made_run_dir_ && ::rmdir(run_dir_.c_str()) != 0)
    spdlog::warn("cannot remove the run directory {}: {}", run_dir_, std::strerror(errno));
  return true;
}

bool Server::Impl::Ready() const {
  if (!started_ || shut_down_) return false;
  // Until every model's first attempt is over (or the ready timeout has
  // passed), whatever the readiness policy: a model still loading may yet
  // be served.
  const bool loading = Clock::now() < settle_deadline_;
  std::shared_lock entries_lock(entries_mu_);
  for (const auto& [name, entry] : entries_) {
    const std::shared_ptr<ModelRuntime> m = entry->served.load();
    if (m != nullptr && !m->serving()) return false;
    if (m == nullptr && (options_.strict_readiness || loading)) {
      std::lock_guard lock(entry->mu);
      if (options_.strict_readiness && !entry->unloaded) return false;  // configured, not serving
      if (loading && !entry->settled && !entry->unloaded) return false;
    }
  }
  return true;
}

// events_mu_ held.
bool Server::Impl::AllSettled() const {
  if (stopping_) return true;
  std::shared_lock entries_lock(entries_mu_);
  for (const auto& [name, entry] : entries_) {
    std::lock_guard lock(entry->mu);
    if (!entry->settled) return false;
  }
  return true;
}

void Server::Impl::NotifySettled(ModelEntry& entry) {
  {
    std::lock_guard lock(entry.mu);
    entry.settled = true;
  }
  {
    std::lock_guard lock(events_mu_);  // AllSettled reads under it
  }
  events_cv_.notify_all();
}

// A supervisor thread returned: a retired runtime may be done.
void Server::Impl::WakeReaper() {
  {
    std::lock_guard lock(reap_mu_);
    reap_due_ = true;
  }
  reap_cv_.notify_all();
}

// The reaper: once every worker of a retired runtime has exited, joins
// their threads and lets the entry's reference go, so that what a client
// loads and unloads does not pile up. Requests still holding the runtime
// (answered, not yet let go by their front-end) keep it until they do.
void Server::Impl::ReaperLoop() {
  std::unique_lock lock(reap_mu_);
  while (true) {
    reap_cv_.wait(lock, [&] { return reap_due_ || reaper_quit_; });
    if (reaper_quit_) return;
    reap_due_ = false;
    lock.unlock();
    std::vector<std::shared_ptr<ModelRuntime>> finished;
    {
      std::shared_lock entries_lock(entries_mu_);
      for (auto& [name, entry] : entries_) {
        std::lock_guard entry_lock(entry->mu);
        std::erase_if(entry->retired, [&](std::shared_ptr<ModelRuntime>& r) {
          if (!r->WorkersFinished()) return false;
          finished.push_back(std::move(r));
          return true;
        });
      }
    }
    for (const auto& r : finished) {
      r->JoinWorkers();
      // Anything its workers left (they all died): answered, and the
      // requests' references to the runtime go with them.
      const Status gone =
          Unavailable("model '" + r->name + "' was replaced or unloaded before the request ran");
      if (r->sequences) r->sequences->FailAll(gone);
      r->queue->FailAll(gone);
    }
    runtimes_freed_ += finished.size();
    finished.clear();
    lock.lock();
  }
}

// Stops a runtime that was never published, and frees it.
void Server::Impl::Discard(ModelEntry& entry, std::shared_ptr<ModelRuntime> m) {
  {
    std::lock_guard lock(entry.mu);
    if (entry.building == m.get()) entry.building = nullptr;
  }
  m->RequestStop(true);
  m->JoinWorkers();
}

// One attempt: config, checkpoint, store, workers. Returns the runtime once
// one of its workers is ready (its other workers may still be starting);
// an error naming the path and the reason otherwise.
Result<std::unique_ptr<ModelRuntime>> Server::Impl::TryBuild(ModelEntry& entry, bool keep_loaded,
                                                             std::vector<std::string>* load_chain) {
  RETURN_IF_ERROR(entry.dir.status);
  // A load's overrides, when it gave some, stand for the directory's config
  // and files.
  const std::string& dir = entry.override_dir.empty() ? entry.dir.path : entry.override_dir;
  ASSIGN_OR_RETURN(ModelConfig config, entry.config_override
                                           ? ParseModelConfigOverride(dir, *entry.config_override)
                                           : LoadModelConfig(dir));
  std::string passed_over;
  if (!config.passed_over_versions.empty()) {
    std::string dirs;
    for (const std::string& v : config.passed_over_versions) dirs += (dirs.empty() ? "" : ", ") + v;
    const bool several = config.passed_over_versions.size() > 1;
    passed_over = fmt::format(
        "model {}: version director{} {} hold{} no model.safetensors or "
        "model.safetensors.index.json{}: version {} is loaded",
        entry.dir.name, several ? "ies" : "y", dirs, several ? "" : "s",
        config.backend == "python" ? ", nor model.py" : "", config.version);
    if (passed_over != entry.passed_over_said) spdlog::warn("{}", passed_over);
  }
  entry.passed_over_said = std::move(passed_over);
  if (config.ensemble) return BuildEnsemble(entry, std::move(config), load_chain);
  auto m = std::make_unique<ModelRuntime>();
  m->name = entry.dir.name;
  m->config_ = std::move(config);
  RETURN_IF_ERROR(PlaceModel(*m));
  // The zygote (backend: python) imports torch and the model's code while
  // the stores read the weights: neither needs the other.
  m->zygote = MakeZygote(*m, options_);
  if (m->zygote != nullptr) {
    if (Status started = m->zygote->Start(); !started.ok()) {
      spdlog::warn("{}: its workers are exec'd, not forked from a zygote: {}", m->name,
                   started.message());
      m->zygote.reset();
    }
  }
  RETURN_IF_ERROR(LoadWeights(entry, *m, keep_loaded));
  int index = 0;
  for (const auto& p : m->placements) {
    if (m->config().standby_hot) {
      Result<std::unique_ptr<HotSpareKeeper>> keeper = HotSpareKeeper::Create(*m, *p, options_);
      if (!keeper.ok()) return keeper.status().WithContext("model '" + entry.dir.name + "'");
      p->hot_spares = std::move(*keeper);
    }
    for (int i = 0; i < p->worker_count; ++i) {
      auto w = std::make_unique<WorkerSupervisor>(*m, *p, index++, options_);
      RETURN_IF_ERROR(w->Init().WithContext("model '" + entry.dir.name + "'"));
      m->workers.push_back(std::move(w));
    }
  }
  // Once published, the entry is settled when every worker's first start
  // is over (Publish covers the workers that settled before it).
  m->on_all_settled = [this, &entry, runtime = m.get()] {
    if (runtime->published) NotifySettled(entry);
  };
  m->on_worker_finished = [this] { WakeReaper(); };
  {
    // From here Shutdown() can stop it (the workers list is complete).
    std::lock_guard lock(entry.mu);
    if (stopping_) return Unavailable("the server is shutting down");
    entry.building = m.get();
  }
  for (auto& w : m->workers) {
    if (Status started = w->Start(); !started.ok()) {
      Discard(entry, std::move(m));  // stops the workers already started
      return started.WithContext("model '" + entry.dir.name + "'");
    }
  }
  {
    std::unique_lock lock(m->state_mu);
    m->state_cv.wait(lock, [&] {
      return m->stopping.load() || m->ready_workers.load() > 0 ||
             m->settled_workers == m->worker_count;
    });
  }
  if (m->ready_workers.load() > 0 && !m->stopping) return m;
  const bool stopping = m->stopping.load();
  const std::string why = m->LastWorkerError();
  Discard(entry, std::move(m));
  if (stopping) return Unavailable("the server is shutting down");
  return Unavailable("no worker could start; " + why);
}

// One builder of the pool: takes the model due first, makes one attempt
// at it, and queues it again for later if that failed, until the server
// stops.
void Server::Impl::BuilderLoop() {
  std::unique_lock lock(events_mu_);
  while (!stopping_) {
    if (build_queue_.empty()) {
      events_cv_.wait(lock, [&] { return stopping_ || !build_queue_.empty(); });
      continue;
    }
    auto first = build_queue_.begin();
    if (first->first > Clock::now()) {
      events_cv_.wait_until(lock, first->first);
      continue;
    }
    ModelEntry* entry = first->second;
    build_queue_.erase(first);
    builder_work_[std::this_thread::get_id()] = entry->dir.name;
    lock.unlock();
    const bool again = BuildOnce(*entry);
    bool deferred = false;
    {
      std::lock_guard entry_lock(entry->mu);
      deferred = entry->deferred;
    }
    lock.lock();
    builder_work_.erase(std::this_thread::get_id());
    events_cv_.notify_all();  // Shutdown() may wait for the builders' work to end
    if (again && !stopping_) {
      // An ensemble waits for the first attempts of the models it uses.
      const auto delay =
          deferred ? std::chrono::milliseconds(100) : RetryDelay(entry->failed_attempts - 1);
      build_queue_.emplace(Clock::now() + delay, entry);
      events_cv_.notify_all();  // it may be due before what the others wait for
    }
  }
}

// One attempt at a model: publishes it, or records and logs (once per
// distinct reason) why not. True if it is to be tried again. Nothing it
// throws (no thread to be had, no memory) escapes to the builder: that is
// this model's failure, retried like any other.
bool Server::Impl::BuildOnce(ModelEntry& entry) {
  BlockForTests(entry.dir.name);
  std::lock_guard build(entry.build_mu);
  {
    // A repository load served it meanwhile, or an unload took it away.
    std::lock_guard lock(entry.mu);
    if (entry.unloaded || entry.served.load() != nullptr) {
      entry.settled = true;
      return false;
    }
  }
  Result<std::unique_ptr<ModelRuntime>> built = [&]() -> Result<std::unique_ptr<ModelRuntime>> {
    try {
      return TryBuild(entry);
    } catch (const std::exception& e) {
      return Internal("model '" + entry.dir.name + "': " + e.what());
    }
  }();
  if (built.ok()) {
    Publish(entry, std::move(built).value());
    return false;
  }
  {
    std::lock_guard lock(entry.mu);
    if (entry.deferred && !stopping_) return true;
  }
  if (stopping_) {
    NotifySettled(entry);
    return false;
  }
  ++entry.failed_attempts;
  {
    std::lock_guard lock(entry.mu);
    entry.status = built.status();
  }
  NotifySettled(entry);
  if (built.status().message() != entry.logged) {
    entry.logged = built.status().message();
    spdlog::error("model {} is not served: {} (retried in the background until it can be)",
                  entry.dir.name, entry.logged);
  }
  return true;
}

// Makes a runtime with a ready worker reachable by requests, unless the
// server is stopping (then it is discarded).
void Server::Impl::Publish(ModelEntry& entry, std::unique_ptr<ModelRuntime> built) {
  std::shared_ptr<ModelRuntime> owned = std::move(built);
  ModelRuntime* m = owned.get();
  {
    // Under the lock that Shutdown() takes to find runtimes to stop:
    // either it finds this one published, or this sees stopping_.
    std::lock_guard lock(entry.mu);
    if (!stopping_) {
      entry.building = nullptr;
      m->published = true;
      entry.status = Status::Ok();
      entry.served.store(std::move(owned));
    }
  }
  if (owned) {
    Discard(entry, std::move(owned));
    NotifySettled(entry);
    return;
  }
  const ModelConfig& c = m->config();
  spdlog::info("model {} version {}: {}{}", c.name, c.version,
               m->is_ensemble() ? "an ensemble of " + std::to_string(c.ensemble->size()) + " steps"
                                : c.backend + " on " + m->DescribePlacements(),
               entry.failed_attempts > 0
                   ? ", served after " + std::to_string(entry.failed_attempts + 1) + " attempts"
                   : "");
  // The workers that settled before `published` was set did not notify.
  if (m->AllSettled()) NotifySettled(entry);
}

Server::Server(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Server::~Server() = default;

Result<std::unique_ptr<Server>> Server::Create(ServerOptions options) {
  if (options.worker_path.empty() || ::access(options.worker_path.c_str(), X_OK) != 0)
    return NotFound("worker executable '" + options.worker_path + "' not found");
  return std::unique_ptr<Server>(new Server(std::make_unique<Impl>(std::move(options))));
}

Status Server::Start() { return impl_->Start(); }
Status Server::WaitForModels() { return impl_->WaitForModels(); }
std::string Server::RunDirectory() const { return impl_->RunDirectory(); }
void Server::KillWorkers() { impl_->KillWorkers(); }
bool Server::Shutdown(std::optional<std::chrono::milliseconds> builder_grace) {
  return impl_->Shutdown(builder_grace);
}
bool Server::Live() const { return impl_->Live(); }
bool Server::Ready() const { return impl_->Ready(); }
std::string Server::ServerVersion() const { return HEARTH_VERSION; }
std::vector<std::string> Server::Extensions() const {
  // Triton's names for what this server does.
  std::vector<std::string> out = {"binary_tensor_data", "classification", "model_configuration",
                                  "model_repository",   "parameters",     "system_shared_memory",
                                  "statistics",         "generate"};
  if (impl_->has_gpu()) out.push_back("cuda_shared_memory");
  return out;
}
Result<ModelMetadata> Server::Metadata(const std::string& m, const std::string& v) const {
  return impl_->Metadata(m, v);
}
Result<bool> Server::ModelReady(const std::string& m, const std::string& v) const {
  return impl_->ModelReady(m, v);
}
std::vector<std::string> Server::ModelNames() const { return impl_->ModelNames(); }
Result<std::string> Server::ModelConfigJson(const std::string& m, const std::string& v) const {
  return impl_->ModelConfigJsonOf(m, v);
}
Result<std::vector<ModelStatistics>> Server::Statistics(const std::string& m,
                                                        const std::string& v) const {
  return impl_->Statistics(m, v);
}
std::vector<RepositoryEntry> Server::RepositoryIndex(bool ready_only) const {
  return impl_->RepositoryIndex(ready_only);
}
Result<std::vector<ModelWorkers>> Server::Workers() const { return impl_->Workers(); }
Status Server::LoadModel(const std::string& m) {
  return impl_->LoadFailureForClient(m, impl_->LoadModel(m));
}
void Server::LoadModel(const std::string& m, std::function<void(Status)> done) {
  impl_->OnRepositoryPool(
      [m](Server::Impl& impl) { return impl.LoadFailureForClient(m, impl.LoadModel(m)); },
      std::move(done));
}
void Server::LoadModelWith(const std::string& m, ModelLoadOverrides overrides,
                           std::function<void(Status)> done) {
  auto shared = std::make_shared<ModelLoadOverrides>(std::move(overrides));
  impl_->OnRepositoryPool(
      [m, shared](Server::Impl& impl) {
        return impl.LoadFailureForClient(m, impl.LoadModel(m, shared.get()));
      },
      std::move(done));
}
namespace {

// Logs a refused registration: a client pointing the server at memory that
// is not its own is worth a line whatever it gets back.
Status Logged(Status status, const ClientConnection& client, const std::string& what) {
  if (!status.ok() &&
      (status.code() == StatusCode::kPermissionDenied || status.code() == StatusCode::kNotFound)) {
    spdlog::warn("{} refused for {} port {}: {}", what,
                 client.address.empty() ? "an unknown client" : client.address, client.port,
                 status.message());
  }
  return status;
}

}  // namespace

Status Server::RegisterSystemSharedMemory(const ClientConnection& client, const std::string& name,
                                          const std::string& key, uint64_t offset,
                                          uint64_t byte_size) {
  const std::string what = "system shared-memory region '" + name + "' (" + key + ")";
  Result<uid_t> uid = LocalPeerUid(client);
  if (!uid.ok()) return Logged(uid.status(), client, what);
  return Logged(impl_->shared_memory().Register(name, key, offset, byte_size, *uid), client,
                what + " from uid " + std::to_string(*uid));
}
Status Server::UnregisterSystemSharedMemory(const std::string& name) {
  return impl_->shared_memory().Unregister(name);
}
Result<std::vector<SharedMemoryRegion>> Server::SystemSharedMemoryStatus(
    const std::string& name) const {
  return impl_->shared_memory().List(name);
}
Status Server::RegisterCudaSharedMemory(const ClientConnection& client, const std::string& name,
                                        std::span<const std::byte> raw_handle, int64_t device_id,
                                        uint64_t byte_size) {
  const std::string what = "CUDA shared-memory region '" + name + "'";
  Result<uid_t> uid = LocalPeerUid(client);
  if (!uid.ok()) return Logged(uid.status(), client, what);
  const std::vector<int> gpus = impl_->GpusInUse();
  return Logged(
      impl_->shared_memory().RegisterCuda(name, raw_handle, device_id, byte_size, gpus, *uid),
      client, what + " from uid " + std::to_string(*uid));
}
Status Server::UnregisterCudaSharedMemory(const std::string& name) {
  return impl_->shared_memory().UnregisterCuda(name);
}
Result<std::vector<CudaSharedMemoryRegion>> Server::CudaSharedMemoryStatus(
    const std::string& name) const {
  return impl_->shared_memory().ListCuda(name);
}
Status Server::UnloadModel(const std::string& m) { return impl_->UnloadModel(m); }
void Server::UnloadModel(const std::string& m, std::function<void(Status)> done) {
  impl_->OnRepositoryPool([m](Server::Impl& impl) { return impl.UnloadModel(m); }, std::move(done));
}
void Server::Infer(InferRequest r, std::function<void(Result<InferResponse>)> done) {
  impl_->Infer(std::move(r), std::move(done));
}
std::vector<int> Server::WorkerPids(const std::string& model) const {
  return impl_->WorkerPids(model);
}
std::string Server::MetricsText() const { return impl_->MetricsText(); }

}  // namespace hearth
