// The server's implementation (Server::Impl), private to src/server: its
// state, and its methods in four files by what they do:
//   server.cc             its life: start, the builders that bring models up,
//                         the reaper of replaced runtimes, shutdown;
//   server_admission.cc   a request's checks against its model, and its way
//                         into the model's queue;
//   server_repository.cc  what the request API asks of the models (metadata,
//                         statistics, readiness, the index, /metrics) and
//                         repository loads and unloads;
//   server_stores.cc      the run directory, the stores that hold the
//                         weights, and a model's placements on devices;
//   server_ensembles.cc   ensembles: building one against the models its
//                         steps name, and handing its requests to its
//                         scheduler (server/ensemble.h).
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <shared_mutex>
#include <system_error>
#include <thread>

#include "common/bytes_tensor.h"
#include "common/checked_size.h"
#include "common/run_together.h"
#include "common/task_pool.h"
#include "common/trusted_path.h"
#include "hearth/arena.h"
#include "hearth/attach.h"
#include "hearth/store.h"
#include "protocol/worker_protocol.h"
#include "server/batch_layout.h"
#include "server/ensemble_config.h"
#include "server/hangup_watcher.h"
#include "server/load_overrides.h"
#include "server/metrics.h"
#include "server/model_config.h"
#include "server/model_config_json.h"
#include "server/model_runtime.h"
#include "server/placement.h"
#include "server/server.h"
#include "server/shared_memory.h"

namespace hearth {

// A model directory and what the server has made of it. A builder (one of
// the server's pool) reads the directory, config and checkpoint, starts the
// workers, and either publishes the model (once one worker is ready) or
// records why not and queues it to be tried again later, until the server
// stops.
struct ModelEntry {
  ModelDirectory dir;
  // Builder only (one builder works on an entry at a time): failed attempts so
  // far, and the last failure logged (each distinct one is logged once).
  int failed_attempts = 0;
  std::string logged;
  // The version directories passed over, as last said on the log (under
  // build_mu, which every attempt holds): said again only when they or the
  // version loaded change, not on every retry of a failing model.
  std::string passed_over_said;
  // The served model, once published; every request that finds it shares
  // it until it is answered. A repository load replaces it (a new version,
  // or the same files with a new config) and an unload clears it; the
  // runtime it pointed to is then `retired`: it takes no new requests, its
  // workers run what it had queued and exit, and the reaper joins their
  // threads and lets it go (it is freed when the last request holding it
  // has been answered).
  std::atomic<std::shared_ptr<ModelRuntime>> served;
  // Held by whoever builds, swaps or drops this model's runtime: a
  // builder's attempt, LoadModel, UnloadModel; one at a time.
  std::mutex build_mu;

  mutable std::mutex mu;  // guards the members below
  std::vector<std::shared_ptr<ModelRuntime>> retired;
  // UnloadModel: not served and not retried until a LoadModel.
  bool unloaded = false;
  ModelRuntime* building = nullptr;  // being started by the builder, not yet published
  Status status = Unavailable("it is being loaded");  // while not served: why
  // The first attempt has ended: published with every worker's first start
  // over, or failed. WaitForModels() waits for this.
  bool settled = false;

  // What the stores hold for this model (builder thread only), by device
  // name: a retry or a repository load asks the store to reuse it, which it
  // does if the checkpoint's files are those it read it from.
  struct Loaded {
    std::string socket;
    uint64_t version = 0;
    uint64_t arena_bytes = 0;
    friend bool operator==(const Loaded&, const Loaded&) = default;
  };
  std::map<std::string, Loaded> loaded;

  // An ensemble whose attempt found a model it uses still on its first
  // attempt: tried again shortly, neither settled nor counted as failed
  // (under mu: other ensembles' builders read it, and do not wait on it).
  bool deferred = false;

  // A repository load's overrides (Triton's config and file: parameters),
  // under build_mu: the config as config.pbtxt text, in place of the
  // directory's config file; the directory made of the files, in place of
  // the model's (and the one before it, which a draining runtime may still
  // read). Empty: none; the next load without overrides clears them.
  std::optional<std::string> config_override;
  std::string override_dir, previous_override_dir;
};

// Labels of a classified ensemble output, and the runtime that holds them.
struct EnsembleLabels {
  std::shared_ptr<const ModelRuntime> owner;
  const std::vector<std::string>* labels = nullptr;
};

class Server::Impl {
 public:
  explicit Impl(ServerOptions options)
      : options_(std::move(options)),
        shared_memory_(SharedMemoryAccess{
            options_.shared_memory_users.value_or(std::vector<uid_t>{::geteuid()})}) {}
  ~Impl() { Shutdown(); }

  // ---- its life (server.cc) ------------------------------------------------
  Status Start();
  Status WaitForModels();
  bool Shutdown(std::optional<std::chrono::milliseconds> builder_grace = std::nullopt);
  std::string RunDirectory() const { return made_run_dir_ ? run_dir_ : std::string(); }
  void KillWorkers();
  bool Ready() const;
  bool Live() const { return !shut_down_; }

  // ---- a request's way in (server_admission.cc) ----------------------------
  void Infer(InferRequest request, std::function<void(Result<InferResponse>)> done);

  // ---- what the request API asks of the models (server_repository.cc) ------
  Result<std::shared_ptr<ModelRuntime>> Find(const std::string& model,
                                             const std::string& version) const;
  Result<ModelMetadata> Metadata(const std::string& model, const std::string& version) const;
  Result<std::string> ModelConfigJsonOf(const std::string& model, const std::string& version) const;
  Result<std::vector<ModelStatistics>> Statistics(const std::string& model,
                                                  const std::string& version) const;
  std::vector<RepositoryEntry> RepositoryIndex(bool ready_only) const;
  std::vector<ModelWorkers> Workers() const;
  std::vector<int> GpusInUse() const;
  std::vector<std::string> ModelNames() const;
  Result<bool> ModelReady(const std::string& model, const std::string& version) const;
  // Runs `call` on the pool of repository calls, answering `done` with
  // what it returns (or with why the pool refused it).
  void OnRepositoryPool(std::function<Status(Impl&)> call, std::function<void(Status)> done) {
    auto answer = std::make_shared<std::function<void(Status)>>(std::move(done));
    Status queued = repository_calls_.Submit(
        [this, call = std::move(call)]() -> Status {
          try {
            return call(*this);
          } catch (const std::exception& e) {
            return Internal(std::string("repository call failed: ") + e.what());
          }
        },
        [answer](Status status) { (*answer)(std::move(status)); });
    if (!queued.ok()) (*answer)(std::move(queued));
  }

  // `chain`: the ensembles whose loads asked for this one (loading an
  // ensemble loads the models its steps name that are not served).
  // A repository load's failure as its client is told it: Triton's prefix
  // ("failed to load 'NAME': "), which Triton's clients match, and no path
  // of the server's (the repository's and the run directory's are cut to
  // the part inside them). OK stays OK.
  Status LoadFailureForClient(const std::string& name, Status status) const;
  Status LoadModel(const std::string& name, const ModelLoadOverrides* overrides = nullptr,
                   std::vector<std::string>* chain = nullptr);
  Status UnloadModel(const std::string& name);
  std::string MetricsText() const;
  std::vector<int> WorkerPids(const std::string& model) const;

  SharedMemoryRegistry& shared_memory() { return shared_memory_; }
  const SharedMemoryRegistry& shared_memory() const { return shared_memory_; }
  bool has_gpu() const { return options_.device.is_cuda(); }

 private:
  struct RunningStore {
    std::unique_ptr<Store> store;
    std::thread thread;
    std::string socket;
  };

  // ---- its life (server.cc) ------------------------------------------------
  bool AllSettled() const;
  void NotifySettled(ModelEntry& entry);
  void WakeReaper();
  void ReaperLoop();
  void Discard(ModelEntry& entry, std::shared_ptr<ModelRuntime> m);
  Result<std::unique_ptr<ModelRuntime>> TryBuild(ModelEntry& entry, bool keep_loaded = false,
                                                 std::vector<std::string>* load_chain = nullptr);
  void BuilderLoop();
  bool BuildOnce(ModelEntry& entry);
  void Publish(ModelEntry& entry, std::unique_ptr<ModelRuntime> built);

  // ---- a request's way in (server_admission.cc) ----------------------------
  void InferOn(InferRequest request, std::function<void(Result<InferResponse>)> done_once,
               int attempt);
  void Enqueue(const std::shared_ptr<ModelRuntime>& runtime, InferRequest request,
               std::function<void(Result<InferResponse>)> done_once, int attempt);
  static std::function<void(Result<InferResponse>)> Counted(
      const std::shared_ptr<ModelRuntime>& runtime,
      std::shared_ptr<std::function<void(Result<InferResponse>)>> done);
  Status ResolveCudaSharedMemory(const ModelRuntime& m, InferRequest& request) const;

  // ---- ensembles (server_ensembles.cc) -------------------------------------
  Result<std::unique_ptr<ModelRuntime>> BuildEnsemble(ModelEntry& entry, ModelConfig config,
                                                      std::vector<std::string>* load_chain);
  Result<ComposingModel> FindComposing(const std::string& model, ModelEntry& ensemble) const;
  EnsembleLabels EnsembleOutputLabels(const std::shared_ptr<ModelRuntime>& ensemble,
                                      const std::string& name) const;
  void RunEnsembleRequest(const std::shared_ptr<ModelRuntime>& runtime, InferRequest request,
                          std::function<void(Result<InferResponse>)> done);
  static Status CheckCudaPlacement(const ModelRuntime& m, const InferRequest& request,
                                   int64_t batch);

  // ---- the models' entries (server_repository.cc) --------------------------
  Result<ModelEntry*> EntryFor(const std::string& name);

  // ---- stores and placements (server_stores.cc) ----------------------------
  Status SetUpRunDirectory();
  Result<std::string> StoreFor(const StoreDevice& device);
  Result<std::vector<Placement>> Place(const ModelConfig& c);
  StoreDevice DeviceOf(const Placement& p) const;
  Result<int> VisibleGpus();
  Status PlaceModel(ModelRuntime& m);
  Status LoadWeights(ModelEntry& entry, ModelRuntime& m, bool keep_loaded);
  void DropChanged(const std::string& name, const std::map<std::string, ModelEntry::Loaded>& from,
                   const std::map<std::string, ModelEntry::Loaded>& keep);
  void DropFromStore(const std::string& name, const ModelEntry::Loaded& loaded);

  // A store's socket path, "<run dir>/store-cuda<N>.sock", must fit
  // sockaddr_un's sun_path with its NUL: the run directory may take what the
  // longest name leaves.
  static constexpr size_t kLongestSocketName = sizeof("/store-cuda4294967295.sock") - 1;
  static constexpr size_t kMaxRunDirLength = sizeof(sockaddr_un::sun_path) - 1 - kLongestSocketName;

  ServerOptions options_;
  SharedMemoryRegistry shared_memory_;
  std::string run_dir_;
  bool made_run_dir_ = false;
  // Load overrides' files go under run_dir_/overrides, one directory per load.
  std::atomic<uint64_t> override_serial_{0};
  // Held by Start() while it makes the run directory, the entries and the
  // builders, and by Shutdown() from the moment it has set stopping_.
  std::mutex lifecycle_mu_;
  // Made when Start() lists the repository; LoadModel adds the entries of
  // directories that appeared since (under entries_mu_, exclusive). Entries are
  // never removed.
  mutable std::shared_mutex entries_mu_;
  // Before the entries: outlives every runtime whose workers it watches.
  HangupWatcher hangups_;
  std::map<std::string, std::unique_ptr<ModelEntry>> entries_;
  static constexpr size_t kMaxBuilders = 8;
  std::vector<std::thread> builders_;
  // The model each builder is making an attempt at (guarded by events_mu_).
  std::map<std::thread::id, std::string> builder_work_;
  // Models due for an attempt, by when (guarded by events_mu_).
  std::multimap<Clock::time_point, ModelEntry*> build_queue_;
  mutable std::mutex stores_mu_;
  std::map<std::string, RunningStore> stores_;  // by device name
  std::once_flag gpus_once_;
  Result<int> visible_gpus_ = 0;
  // Start()'s wait for the models to settle, and the builders' waits for
  // work; stopping_ ends both.
  mutable std::mutex events_mu_;
  std::condition_variable events_cv_;
  std::atomic<bool> stopping_{false};
  std::atomic<bool> started_{false}, shut_down_{false};
  // The reaper's thread and its wake-ups (a supervisor thread returned).
  std::thread reaper_;
  // Repository loads and unloads asked through the request API: at most
  // kMaxRepositoryCalls queued or running, off the front-ends' threads.
  static constexpr size_t kMaxRepositoryCalls = 4;
  TaskPool repository_calls_{kMaxRepositoryCalls, "repository loads and unloads"};
  std::mutex reap_mu_;
  std::condition_variable reap_cv_;
  bool reap_due_ = false;     // guarded by reap_mu_
  bool reaper_quit_ = false;  // guarded by reap_mu_
  std::atomic<uint64_t> runtimes_freed_{0};
  // Set by Start() before started_: when it began, and when WaitForModels()
  // and Ready() stop waiting for models still on their first attempt.
  Clock::time_point started_at_{}, settle_deadline_{};
};

}  // namespace hearth
