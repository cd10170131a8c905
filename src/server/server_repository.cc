#include <charconv>
#include <optional>

#include "server/device_process_memory.h"
#include "server/server_impl.h"

namespace hearth {
namespace {

// A request's version string: empty (the served version) or a decimal
// integer. Anything else is malformed (InvalidArgument), in Triton's words,
// which its clients match; Triton reads it before it looks for the model.
Result<std::optional<int64_t>> ParseRequestedVersion(const std::string& version) {
  if (version.empty()) return std::optional<int64_t>();
  int64_t number = 0;
  const char* end = version.data() + version.size();
  const auto [ptr, ec] = std::from_chars(version.data(), end, number);
  if (ec != std::errc() || ptr != end) {
    return InvalidArgument("failed to get model version from specified version string '" + version +
                           "'");
  }
  return std::optional<int64_t>(number);
}

}  // namespace

// The served model, or why there is none: InvalidArgument for a version
// that is not a number, NotFound for an unknown model or a version other
// than the served one, Unavailable naming the path and the reason for a
// model whose directory, config, checkpoint or workers fail.
Result<std::shared_ptr<ModelRuntime>> Server::Impl::Find(const std::string& model,
                                                         const std::string& version) const {
  ASSIGN_OR_RETURN(const std::optional<int64_t> wanted, ParseRequestedVersion(version));
  std::shared_lock entries_lock(entries_mu_);
  auto it = entries_.find(model);
  // Worded as Triton's, which its clients match.
  if (it == entries_.end())
    return NotFound("Request for unknown model: '" + model + "' is not found");
  const ModelEntry& entry = *it->second;
  std::shared_ptr<ModelRuntime> m = entry.served.load();
  if (m == nullptr) {
    // Published meanwhile (under the lock, with the status set OK): served.
    std::lock_guard lock(entry.mu);
    m = entry.served.load();
    if (m == nullptr)
      return Unavailable("model '" + model + "' is not served: " + entry.status.message());
  }
  if (wanted.has_value() && (*wanted < 0 || static_cast<uint64_t>(*wanted) != m->config().version))
    return NotFound("Request for unknown model: '" + model + "' version " + version +
                    " is not found (the served version is " + std::to_string(m->config().version) +
                    ")");
  return m;
}

Result<ModelMetadata> Server::Impl::Metadata(const std::string& model,
                                             const std::string& version) const {
  ASSIGN_OR_RETURN(std::shared_ptr<ModelRuntime> m, Find(model, version));
  return m->metadata();
}

Result<std::string> Server::Impl::ModelConfigJsonOf(const std::string& model,
                                                    const std::string& version) const {
  ASSIGN_OR_RETURN(std::shared_ptr<ModelRuntime> m, Find(model, version));
  const ModelConfig& config = m->config();
  if (!config.inputs.empty() || !config.outputs.empty() || config.sequence || m->is_ensemble())
    return hearth::ModelConfigJson(config);
  // A config that lists no input or output takes the backend's (a Triton
  // model's auto_complete_config, say): the served config says what they are.
  ModelConfig completed = config;
  for (const TensorSpec& t : m->inputs) completed.inputs.push_back({t.name, t.dtype, t.dims});
  for (const TensorSpec& t : m->outputs) completed.outputs.push_back({t.name, t.dtype, t.dims});
  return hearth::ModelConfigJson(completed);
}

Result<std::vector<ModelStatistics>> Server::Impl::Statistics(const std::string& model,
                                                              const std::string& version) const {
  std::vector<std::shared_ptr<ModelRuntime>> runtimes;
  if (model.empty()) {
    if (!version.empty()) return InvalidArgument("a version without a model");
    std::shared_lock entries_lock(entries_mu_);
    for (const auto& [name, entry] : entries_)
      if (std::shared_ptr<ModelRuntime> m = entry->served.load()) runtimes.push_back(std::move(m));
  } else {
    ASSIGN_OR_RETURN(std::shared_ptr<ModelRuntime> m, Find(model, version));
    runtimes.push_back(std::move(m));
  }
  std::vector<ModelStatistics> out;
  auto d = [](uint64_t count, uint64_t us) { return DurationStatistics{count, us * 1000}; };
  for (const std::shared_ptr<ModelRuntime>& m : runtimes) {
    ModelStatistics st;
    st.name = m->name;
    st.version = std::to_string(m->config().version);
    st.last_inference_ms = m->stats.last_inference_ms.load();
    st.inference_count = m->stats.rows.load();
    st.execution_count = m->stats.batches.load();
    const uint64_t answered = m->stats.requests.load();
    st.success = d(m->stats.success.load(), m->stats.success_us.load());
    st.fail = d(m->stats.failure.load(), m->stats.failure_us.load());
    st.queue = d(answered, m->stats.queue_us.load());
    st.compute_input = d(answered, m->stats.input_us.load());
    st.compute_infer = d(answered, m->stats.run_us.load());
    st.compute_output = d(answered, m->stats.output_us.load());
    for (int b = 1; m->stats.batch_totals != nullptr && b <= m->max_batch(); ++b) {
      const ModelStats::BatchTotals& t = m->stats.batch_totals[static_cast<size_t>(b)];
      const uint64_t n = t.count.load();
      if (n == 0) continue;
      st.batch_stats.push_back(
          {b, d(n, t.input_us.load()), d(n, t.infer_us.load()), d(n, t.output_us.load())});
    }
    if (m->config().decoupled) {
      ModelStatistics::Streams streams;
      for (const auto& w : m->workers) streams.in_flight.push_back(w->streams_in_flight());
      streams.opened = m->stats.streams_opened.load();
      streams.resumed = m->stats.streams_resumed.load();
      streams.responses = m->stats.stream_responses.load();
      streams.tokens = m->stats.stream_tokens.load();
      st.streams = std::move(streams);
    }
    out.push_back(std::move(st));
  }
  return out;
}

std::vector<RepositoryEntry> Server::Impl::RepositoryIndex(bool ready_only) const {
  std::vector<RepositoryEntry> out;
  std::shared_lock entries_lock(entries_mu_);
  for (const auto& [name, entry] : entries_) {
    RepositoryEntry e;
    e.name = name;
    const std::shared_ptr<ModelRuntime> m = entry->served.load();
    if (m != nullptr && m->serving()) {
      e.version = std::to_string(m->config().version);
      e.state = "READY";
    } else {
      if (ready_only) continue;
      if (m != nullptr) e.version = std::to_string(m->config().version);
      std::lock_guard lock(entry->mu);
      e.state = entry->settled || m != nullptr ? "UNAVAILABLE" : "LOADING";
      e.reason =
          m != nullptr ? "no worker is ready: " + m->LastWorkerError() : entry->status.message();
    }
    out.push_back(std::move(e));
  }
  return out;
}

std::vector<ModelWorkers> Server::Impl::Workers() const {
  std::vector<ModelWorkers> out;
  std::vector<std::pair<std::string, std::shared_ptr<ModelRuntime>>> served;
  std::vector<const ModelRuntime*> runtimes;
  {
    std::shared_lock entries_lock(entries_mu_);
    for (const auto& [name, entry] : entries_) {
      if (std::shared_ptr<ModelRuntime> m = entry->served.load()) {
        runtimes.push_back(m.get());
        served.emplace_back(name, std::move(m));
      }
    }
  }
  // Read with no lock held: it may wait for NVML.
  const DriverMemory driver = ReadDriverMemory(runtimes);
  for (const auto& [name, m] : served) {
    ModelWorkers model;
    model.name = name;
    model.version = std::to_string(m->config().version);
    model.standby_mode = m->config().standby_hot ? "hot" : "cold";
    model.standby_workers = m->config().standby_workers;
    for (const auto& p : m->placements) {
      PlacementWorkers placement;
      placement.device = p->device_name;
      for (const auto& w : m->workers) {
        if (&w->placement() != p.get()) continue;
        WorkerInfo info{w->index(), w->pid(), w->ready(), w->restarts(), w->device_memory_bytes()};
        info.streams = w->streams_in_flight();
        info.driver_device_memory_bytes = driver.Of(p->device_name, w->pid());
        placement.workers.push_back(info);
      }
      {
        std::lock_guard lock(p->standby_mu);
        for (const auto& s : p->standbys) placement.standbys.push_back({s->process.pid()});
      }
      if (p->hot_spares != nullptr) placement.hot_spares = p->hot_spares->Describe();
      for (HotSpareInfo& s : placement.hot_spares)
        s.driver_device_memory_bytes = driver.Of(p->device_name, s.pid);
      model.placements.push_back(std::move(placement));
    }
    out.push_back(std::move(model));
  }
  return out;
}

// The GPUs that CUDA shared-memory regions may be on: the server's
// device and every GPU a served model runs on or its config names. None
// for a server on the host.
std::vector<int> Server::Impl::GpusInUse() const {
  std::set<int> gpus;
  if (!options_.device.is_cuda()) return {};
  gpus.insert(options_.device.index);
  std::shared_lock entries_lock(entries_mu_);
  for (const auto& [name, entry] : entries_) {
    const std::shared_ptr<ModelRuntime> m = entry->served.load();
    if (m == nullptr) continue;
    for (const auto& p : m->placements)
      if (p->memory.is_cuda()) gpus.insert(p->memory.index);
    for (const InstanceGroup& g : m->config().instance_groups)
      if (g.kind_gpu) gpus.insert(g.gpus.begin(), g.gpus.end());
  }
  return {gpus.begin(), gpus.end()};
}

std::vector<std::string> Server::Impl::ModelNames() const {
  std::vector<std::string> names;
  std::shared_lock entries_lock(entries_mu_);
  for (const auto& [name, entry] : entries_) names.push_back(name);
  std::sort(names.begin(), names.end());
  return names;
}

Result<bool> Server::Impl::ModelReady(const std::string& model, const std::string& version) const {
  ASSIGN_OR_RETURN(std::shared_ptr<ModelRuntime> m, Find(model, version));
  if (shut_down_) return Unavailable("the server is shutting down");
  if (!m->serving()) {
    const std::string last = m->LastWorkerError();
    return Unavailable("model '" + model + "' has no worker ready" +
                       (last.empty() ? "" : ": " + last));
  }
  return true;
}

namespace {

// `text` with every `path` + "/" cut out, and `path` itself said as `as`.
// Then, past each cut of `path`, `skip` more path components (the serial
// directory of an override's files) go too.
std::string CutPath(std::string text, const std::string& path, const std::string& as,
                    int skip = 0) {
  if (path.empty()) return text;
  for (size_t at = text.find(path); at != std::string::npos; at = text.find(path, at)) {
    size_t end = at + path.size();
    if (end < text.size() && text[end] == '/') {
      ++end;
      for (int i = 0; i < skip; ++i) {
        const size_t slash = text.find('/', end);
        if (slash == std::string::npos) break;
        end = slash + 1;
      }
      text.replace(at, end - at, "");
    } else {
      text.replace(at, end - at, as);
      at += as.size();
    }
  }
  return text;
}

}  // namespace

Status Server::Impl::LoadFailureForClient(const std::string& name, Status status) const {
  if (status.ok()) return status;
  std::string message = status.message();
  message = CutPath(std::move(message), run_dir_ + "/overrides", "the load's files", 1);
  message = CutPath(std::move(message), run_dir_, "the server's run directory");
  std::string repository = options_.repository;
  while (repository.size() > 1 && repository.back() == '/') repository.pop_back();
  message = CutPath(std::move(message), repository, "the repository");
  return Status(status.code(), "failed to load '" + name + "': " + message);
}

Status Server::Impl::LoadModel(const std::string& name, const ModelLoadOverrides* overrides,
                               std::vector<std::string>* chain) {
  if (stopping_ || !started_) return Unavailable("the server is not serving");
  ASSIGN_OR_RETURN(ModelEntry * entry, EntryFor(name));
  std::lock_guard build(entry->build_mu);
  // This load's overrides (none: the model's directory as it is), checked
  // and written before anything changes; put back as they were if it fails.
  PreparedOverrides prepared;
  const bool overridden = overrides != nullptr && !overrides->empty();
  if (overridden) {
    Result<PreparedOverrides> made =
        PrepareLoadOverrides(*overrides, name, run_dir_ + "/overrides", ++override_serial_);
    if (!made.ok()) return made.status();
    prepared = std::move(made).value();
  }
  const std::optional<std::string> config_before = entry->config_override;
  const std::string dir_before = entry->override_dir;
  entry->config_override = overridden ? std::optional<std::string>(prepared.pbtxt) : std::nullopt;
  entry->override_dir = prepared.dir;
  // What is left of the overrides once this load is over: a failed one puts
  // back what was there; a served one keeps the directory served until now
  // (its runtime may still be draining, and a worker of it restarting reads
  // it) and removes the one before that.
  auto settle = [&](bool served) {
    if (!served) {
      if (!prepared.dir.empty()) RemoveOverrideDirectory(prepared.dir);
      entry->config_override = config_before;
      entry->override_dir = dir_before;
      return;
    }
    if (dir_before != entry->override_dir && !dir_before.empty()) {
      if (!entry->previous_override_dir.empty())
        RemoveOverrideDirectory(entry->previous_override_dir);
      entry->previous_override_dir = dir_before;
    }
  };
  {
    std::lock_guard lock(entry->mu);
    entry->unloaded = false;
  }
  const std::shared_ptr<ModelRuntime> old = entry->served.load();
  const std::map<std::string, ModelEntry::Loaded> previous = entry->loaded;
  std::vector<std::string> own_chain;
  if (chain == nullptr) chain = &own_chain;
  chain->push_back(name);
  Result<std::unique_ptr<ModelRuntime>> built = [&]() -> Result<std::unique_ptr<ModelRuntime>> {
    try {
      return TryBuild(*entry, /*keep_loaded=*/old != nullptr, chain);
    } catch (const std::exception& e) {
      return Internal("model '" + name + "': " + e.what());
    }
  }();
  chain->pop_back();
  if (!built.ok()) {
    if (old != nullptr) {
      // The served version goes on; what this attempt loaded goes.
      DropChanged(name, entry->loaded, previous);
      entry->loaded = previous;
    } else {
      std::lock_guard lock(entry->mu);
      entry->status = built.status();
      entry->settled = true;
    }
    spdlog::error("model {}: load failed: {}", name, built.status().message());
    settle(false);
    return built.status();
  }
  if (old == nullptr) {
    Publish(*entry, std::move(built).value());
    const bool served = entry->served.load() != nullptr;
    settle(served);
    return served ? Status::Ok() : Unavailable("the server is shutting down");
  }
  // The swap: new requests go to the new runtime at once; the old one
  // runs what it has queued and its workers exit.
  std::shared_ptr<ModelRuntime> fresh = std::move(built).value();
  bool swapped = false;
  {
    // Under the lock Shutdown() takes to find runtimes to stop: either it
    // finds this one served, or this sees stopping_ (as in Publish).
    std::lock_guard lock(entry->mu);
    entry->building = nullptr;
    if (!stopping_) {
      fresh->published = true;
      entry->retired.push_back(old);
      entry->status = Status::Ok();
      entry->served.store(fresh);
      swapped = true;
    }
  }
  if (!swapped) {
    Discard(*entry, std::move(fresh));
    DropChanged(name, entry->loaded, previous);
    entry->loaded = previous;
    settle(false);
    return Unavailable("the server is shutting down");
  }
  settle(true);
  old->RequestStop(false);
  DropChanged(name, previous, entry->loaded);  // its arenas go with the old workers' leases
  spdlog::info("model {}: version {} replaces version {} ({} workers); the old workers drain", name,
               fresh->config().version, old->config().version, fresh->worker_count);
  if (fresh->AllSettled()) NotifySettled(*entry);
  return Status::Ok();
}

Status Server::Impl::UnloadModel(const std::string& name) {
  if (stopping_ || !started_) return Unavailable("the server is not serving");
  ModelEntry* entry = nullptr;
  {
    std::shared_lock lock(entries_mu_);
    auto it = entries_.find(name);
    if (it == entries_.end())
      return NotFound("Request for unknown model: '" + name + "' is not found");
    entry = it->second.get();
  }
  std::lock_guard build(entry->build_mu);
  std::shared_ptr<ModelRuntime> old;
  {
    std::lock_guard lock(entry->mu);
    entry->unloaded = true;
    entry->status = Unavailable("it was unloaded (POST /v2/repository/models/" + name +
                                "/load serves it again)");
    old = entry->served.exchange(nullptr);
    if (old != nullptr) entry->retired.push_back(old);
  }
  if (old != nullptr) old->RequestStop(false);
  for (const auto& [device, loaded] : entry->loaded) DropFromStore(name, loaded);
  entry->loaded.clear();
  spdlog::info("model {}: unloaded{}", name, old != nullptr ? "; its workers drain" : "");
  return Status::Ok();
}

std::string Server::Impl::MetricsText() const {
  // Served models only: one that is not served has no workers or counters.
  std::vector<std::shared_ptr<ModelRuntime>> runtimes;  // alive while their text is written
  std::vector<std::pair<std::string, const ModelRuntime*>> served;
  std::vector<const ModelRuntime*> read;
  uint64_t retired = 0;
  {
    std::shared_lock entries_lock(entries_mu_);
    for (const auto& [name, entry] : entries_) {
      if (std::shared_ptr<ModelRuntime> m = entry->served.load()) {
        served.emplace_back(name, m.get());
        read.push_back(m.get());
        runtimes.push_back(std::move(m));
      }
      std::lock_guard lock(entry->mu);
      retired += entry->retired.size();
    }
  }
  std::vector<StoreSample> stores;
  {
    std::lock_guard lock(stores_mu_);
    for (const auto& [device, s] : stores_) {
      const Store::Held held = s.store->HeldArenas();
      stores.push_back({device, held.arenas, held.bytes});
    }
  }
  // Read with no lock held: it may wait for NVML.
  std::string text = PrometheusText(served, stores, ReadDriverMemory(read));
  text +=
      "# HELP hearth_retired_runtimes Models' runtimes that a repository load or unload "
      "replaced and whose workers have not all exited yet.\n"
      "# TYPE hearth_retired_runtimes gauge\nhearth_retired_runtimes " +
      std::to_string(retired) +
      "\n# HELP hearth_retired_runtimes_freed_total Replaced runtimes whose workers exited "
      "and were joined, and that were let go.\n"
      "# TYPE hearth_retired_runtimes_freed_total counter\n"
      "hearth_retired_runtimes_freed_total " +
      std::to_string(runtimes_freed_.load()) + "\n";
  return text;
}

std::vector<int> Server::Impl::WorkerPids(const std::string& model) const {
  std::vector<int> pids;
  std::shared_lock entries_lock(entries_mu_);
  auto it = entries_.find(model);
  if (it == entries_.end()) return pids;
  const std::shared_ptr<ModelRuntime> m = it->second->served.load();
  if (m == nullptr) return pids;
  for (const auto& w : m->workers)
    if (w->pid() > 0) pids.push_back(w->pid());
  return pids;
}

// The entry of a model directory of the repository: the one made at
// start-up, or a new one for a directory that appeared since.
Result<ModelEntry*> Server::Impl::EntryFor(const std::string& name) {
  {
    std::shared_lock lock(entries_mu_);
    if (auto it = entries_.find(name); it != entries_.end()) return it->second.get();
  }
  ASSIGN_OR_RETURN(std::vector<ModelDirectory> dirs, ListModelDirectories(options_.repository));
  auto d = std::find_if(dirs.begin(), dirs.end(),
                        [&](const ModelDirectory& e) { return e.name == name; });
  if (d == dirs.end()) return NotFound("no model directory '" + name + "' in the repository");
  std::unique_lock lock(entries_mu_);
  auto [it, added] = entries_.try_emplace(name);
  if (added) {
    it->second = std::make_unique<ModelEntry>();
    it->second->dir = std::move(*d);
  }
  return it->second.get();
}

}  // namespace hearth
