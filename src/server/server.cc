#include "server/server.h"

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
#include <set>
#include <shared_mutex>
#include <system_error>
#include <thread>

#include "common/bytes_tensor.h"
#include "common/checked_size.h"
#include "common/run_together.h"
#include "common/trusted_path.h"
#include "hearth/arena.h"
#include "hearth/attach.h"
#include "hearth/checkpoint.h"
#include "hearth/store.h"
#include "protocol/worker_protocol.h"
#include "server/batch_layout.h"
#include "server/metrics.h"
#include "server/model_config.h"
#include "server/model_config_json.h"
#include "server/model_runtime.h"
#include "server/placement.h"
#include "server/shared_memory.h"

// A model's parameters must fit in the one control message that carries them.
static_assert(4 + 8 * hearth::kMaxModelParameters + hearth::kMaxModelParameterBytes <
              hearth::control::kMaxSetupBytes / 2);

namespace hearth {
namespace {

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
  // name: a retry with an unchanged checkpoint reuses it instead of reading
  // it again.
  struct Loaded {
    std::string key;  // path, device, inode, size, mtime of the files loaded
    std::string socket;
    uint64_t version = 0;
    uint64_t arena_bytes = 0;
    friend bool operator==(const Loaded&, const Loaded&) = default;
  };
  std::map<std::string, Loaded> loaded;
};

// Wait between attempts to bring up a model that failed: 1, 2, 4, then every 5 s.
std::chrono::milliseconds RetryDelay(int attempt) {
  return std::chrono::milliseconds(std::min(1000 << std::min(attempt, 3), 5000));
}

}  // namespace

class Server::Impl {
 public:
  explicit Impl(ServerOptions options)
      : options_(std::move(options)),
        shared_memory_(SharedMemoryAccess{
            options_.shared_memory_users.value_or(std::vector<uid_t>{::geteuid()})}) {}
  ~Impl() { Shutdown(); }

  Status Start() {
    const auto started = Clock::now();
    {
      // Shutdown() waits for this block, so that it never sees the entries or
      // the builders half made.
      std::lock_guard lifecycle(lifecycle_mu_);
      if (stopping_) return Unavailable("the server was shut down before it started");
      RETURN_IF_ERROR(SetUpRunDirectory());
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

  Status WaitForModels() {
    if (!started_) return FailedPrecondition("the server has not been started");
    {
      std::unique_lock lock(events_mu_);
      events_cv_.wait_until(lock, settle_deadline_, [&] { return AllSettled(); });
    }
    if (stopping_) return Unavailable("the server was shut down while its models were loading");
    std::shared_lock entries_lock(entries_mu_);
    for (auto& [name, entry] : entries_) {
      const std::shared_ptr<ModelRuntime> m = entry->served.load();
      if (m == nullptr) continue;
      spdlog::info("model {}: {} of {} workers ready {:.3f} s after start-up began", name,
                   m->ready_workers.load(), m->worker_count,
                   std::chrono::duration<double>(Clock::now() - started_at_).count());
    }
    return Status::Ok();
  }

  void Shutdown() {
    if (shut_down_.exchange(true)) return;
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
    for (std::thread& b : builders_) b.join();
    builders_.clear();
    for (auto& [name, entry] : entries_) {
      for (auto& r : entry->retired)
        for (auto& w : r->workers) w->Join();
      const std::shared_ptr<ModelRuntime> m = entry->served.load();
      if (m == nullptr) continue;
      for (auto& w : m->workers) w->Join();
      m->queue->FailAll(Unavailable("the server is shutting down"));
      if (const uint64_t n = m->stats.batches.load(), r = m->stats.requests.load();
          n > 0 && r > 0) {
        spdlog::info(
            "model {}: {} requests in {} batches; mean {:.3f} ms per batch in the backend, "
            "{:.3f} ms from request to answer in the server",
            name, r, n, m->stats.run_us.load() / 1e3 / n, m->stats.request_us.load() / 1e3 / r);
      }
    }
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
    if (made_run_dir_ && ::rmdir(run_dir_.c_str()) != 0)
      spdlog::warn("cannot remove the run directory {}: {}", run_dir_, std::strerror(errno));
  }

  bool Ready() const {
    if (!started_ || shut_down_) return false;
    // Until every model's first attempt is over (or the ready timeout has
    // passed), whatever the readiness policy: a model still loading may yet
    // be served.
    const bool loading = Clock::now() < settle_deadline_;
    std::shared_lock entries_lock(entries_mu_);
    for (const auto& [name, entry] : entries_) {
      const std::shared_ptr<ModelRuntime> m = entry->served.load();
      if (m != nullptr && m->ready_workers.load() == 0) return false;
      if (m == nullptr && (options_.strict_readiness || loading)) {
        std::lock_guard lock(entry->mu);
        if (options_.strict_readiness && !entry->unloaded) return false;  // configured, not serving
        if (loading && !entry->settled && !entry->unloaded) return false;
      }
    }
    return true;
  }
  bool Live() const { return !shut_down_; }

  // The served model, or why there is none: NotFound for an unknown model or
  // a version other than the served one, Unavailable naming the path and the
  // reason for a model whose directory, config, checkpoint or workers fail.
  Result<std::shared_ptr<ModelRuntime>> Find(const std::string& model,
                                             const std::string& version) const {
    std::shared_lock entries_lock(entries_mu_);
    auto it = entries_.find(model);
    if (it == entries_.end()) return NotFound("unknown model '" + model + "'");
    const ModelEntry& entry = *it->second;
    std::shared_ptr<ModelRuntime> m = entry.served.load();
    if (m == nullptr) {
      std::lock_guard lock(entry.mu);
      return Unavailable("model '" + model + "' is not served: " + entry.status.message());
    }
    if (!version.empty() && version != std::to_string(m->config().version))
      return NotFound("model '" + model + "' has no served version '" + version + "'");
    return m;
  }

  Result<ModelMetadata> Metadata(const std::string& model, const std::string& version) const {
    ASSIGN_OR_RETURN(std::shared_ptr<ModelRuntime> m, Find(model, version));
    ModelMetadata md;
    md.name = model;
    md.versions = {std::to_string(m->config().version)};
    md.platform = "hearth_" + m->config().backend;
    md.max_batch_size = m->config().max_batch_size;
    auto convert = [&](const std::vector<TensorSpec>& specs, std::vector<TensorMetadata>* out) {
      for (const TensorSpec& s : specs) {
        TensorMetadata t{s.name, s.dtype, {}};
        if (md.max_batch_size > 0) t.shape.push_back(-1);
        t.shape.insert(t.shape.end(), s.dims.begin(), s.dims.end());
        out->push_back(std::move(t));
      }
    };
    convert(m->inputs, &md.inputs);
    convert(m->outputs, &md.outputs);
    md.decoupled = m->config().decoupled;
    return md;
  }

  Result<std::string> ModelConfigJsonOf(const std::string& model,
                                        const std::string& version) const {
    ASSIGN_OR_RETURN(std::shared_ptr<ModelRuntime> m, Find(model, version));
    return hearth::ModelConfigJson(m->config());
  }

  Result<std::vector<ModelStatistics>> Statistics(const std::string& model,
                                                  const std::string& version) const {
    std::vector<std::shared_ptr<ModelRuntime>> runtimes;
    if (model.empty()) {
      if (!version.empty()) return InvalidArgument("a version without a model");
      std::shared_lock entries_lock(entries_mu_);
      for (const auto& [name, entry] : entries_)
        if (std::shared_ptr<ModelRuntime> m = entry->served.load())
          runtimes.push_back(std::move(m));
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
      out.push_back(std::move(st));
    }
    return out;
  }

  std::vector<RepositoryEntry> RepositoryIndex(bool ready_only) const {
    std::vector<RepositoryEntry> out;
    std::shared_lock entries_lock(entries_mu_);
    for (const auto& [name, entry] : entries_) {
      RepositoryEntry e;
      e.name = name;
      const std::shared_ptr<ModelRuntime> m = entry->served.load();
      if (m != nullptr && m->ready_workers.load() > 0) {
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

  SharedMemoryRegistry& shared_memory() { return shared_memory_; }
  const SharedMemoryRegistry& shared_memory() const { return shared_memory_; }

  // The GPUs that CUDA shared-memory regions may be on: the server's
  // device and every GPU a served model runs on or its config names. None
  // for a server on the host.
  std::vector<int> GpusInUse() const {
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
  bool has_gpu() const { return options_.device.is_cuda(); }

  std::vector<std::string> ModelNames() const {
    std::vector<std::string> names;
    std::shared_lock entries_lock(entries_mu_);
    for (const auto& [name, entry] : entries_) names.push_back(name);
    std::sort(names.begin(), names.end());
    return names;
  }

  Result<bool> ModelReady(const std::string& model, const std::string& version) const {
    ASSIGN_OR_RETURN(std::shared_ptr<ModelRuntime> m, Find(model, version));
    if (shut_down_) return Unavailable("the server is shutting down");
    if (m->ready_workers.load() == 0) {
      const std::string last = m->LastWorkerError();
      return Unavailable("model '" + model + "' has no worker ready" +
                         (last.empty() ? "" : ": " + last));
    }
    return true;
  }

  void Infer(InferRequest request, std::function<void(Result<InferResponse>)> done) {
    InferOn(std::move(request), std::move(done), 0);
  }

  // `attempt`: how many runtimes of this model turned the request away
  // because a repository load or unload retired them after it was found.
  void InferOn(InferRequest request, std::function<void(Result<InferResponse>)> done_once,
               int attempt) {
    auto found = Find(request.model, request.version);
    if (!found.ok()) return done_once(found.status());
    // Held until the request is answered (its `done` keeps it).
    const std::shared_ptr<ModelRuntime> runtime = std::move(found).value();
    ModelRuntime& m = *runtime;
    if (Status s = ResolveCudaSharedMemory(m, request); !s.ok()) return done_once(s);
    // Inputs in system shared memory are read now: from here on they are
    // bytes like any other, checked against their shapes.
    for (InferTensor& in : request.inputs) {
      if (!in.shm || in.shm->cuda || !in.data.empty()) continue;
      Result<std::vector<std::byte>> bytes = shared_memory_.Read(*in.shm);
      if (!bytes.ok()) return done_once(bytes.status().WithContext("input '" + in.name + "'"));
      in.data = std::move(bytes).value();
    }
    for (const RequestedOutput& o : request.outputs)
      if (o.shm && o.class_count == 0 && m.config().decoupled)
        return done_once(InvalidArgument("output '" + o.name +
                                         "': a decoupled model's outputs cannot go to shared "
                                         "memory (each response has its own)"));
    ++m.stats.pending;
    auto original =
        std::make_shared<std::function<void(Result<InferResponse>)>>(std::move(done_once));
    std::function<void(Result<InferResponse>)> done = [runtime, original, arrived = Clock::now()](
                                                          Result<InferResponse> r) {
      ModelRuntime& model = *runtime;
      (r.ok() ? model.stats.success : model.stats.failure) += 1;
      (r.ok() ? model.stats.success_us : model.stats.failure_us) += static_cast<uint64_t>(
          std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - arrived).count());
      model.stats.last_inference_ms =
          static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                    std::chrono::system_clock::now().time_since_epoch())
                                    .count());
      --model.stats.pending;
      (*original)(std::move(r));
    };
    auto job = std::make_shared<Job>();
    // Never trust sizes: every input's bytes must be what its shape says
    // (BYTES: exactly that many well-formed elements).
    int64_t batch = 1;
    const bool batching = m.batching();
    for (size_t i = 0; i < m.inputs.size(); ++i) {
      const TensorSpec& spec = m.inputs[i];
      auto it = std::find_if(request.inputs.begin(), request.inputs.end(),
                             [&](const InferTensor& t) { return t.name == spec.name; });
      if (it == request.inputs.end())
        return done(InvalidArgument("missing input '" + spec.name + "'"));
      const std::string what = "input '" + spec.name + "'";
      if (it->dtype != spec.dtype) return done(InvalidArgument(what + " has the wrong datatype"));
      const int64_t b = batching && !it->shape.empty() ? it->shape[0] : 1;
      if (i == 0) batch = b;
      if (b != batch || b < 1 || b > m.max_batch())
        return done(InvalidArgument(what + ": batch " + std::to_string(b) + " is not valid"));
      if (Status s = control::CheckShape(spec, batching, b, it->shape, what); !s.ok())
        return done(s);
      control::SlotTensor t{0, SlotBytesOf(*it), it->shape};
      if (Status s =
              control::CheckSlotTensor(t, spec.dtype, 0, control::kMaxSlotBytes, nullptr, what);
          !s.ok())
        return done(s);
      if (spec.dtype == DType::kBytes) {
        Result<uint64_t> count = ShapeElements(it->shape, what);
        if (!count.ok()) return done(count.status());
        if (Status s = ValidateBytesTensor(it->data.bytes(), *count, what); !s.ok()) return done(s);
      }
      job->shape_key.insert(job->shape_key.end(), it->shape.begin() + (batching ? 1 : 0),
                            it->shape.end());
      job->shape_key.push_back(-1);  // separates the inputs' dims
    }
    if (request.inputs.size() != m.inputs.size())
      return done(InvalidArgument("model '" + m.name + "' takes " +
                                  std::to_string(m.inputs.size()) + " inputs"));
    if (m.config().decoupled) {
      if (batch != 1)
        return done(InvalidArgument("model '" + m.name +
                                    "' is decoupled: each request is one stream, of batch 1, not " +
                                    std::to_string(batch)));
      if (request.parameters_json.size() > control::kMaxParametersBytes)
        return done(InvalidArgument(
            "the request's parameters come to " + std::to_string(request.parameters_json.size()) +
            " bytes, over the limit of " + std::to_string(control::kMaxParametersBytes)));
    } else if (request.on_response) {
      // One response, as any model's: a stream of one.
      request.on_response = nullptr;
    }
    for (const RequestedOutput& o : request.outputs) {
      if (o.class_count == 0) continue;
      auto spec = std::find_if(m.outputs.begin(), m.outputs.end(),
                               [&](const TensorSpec& t) { return t.name == o.name; });
      if (spec == m.outputs.end())
        return done(InvalidArgument("model '" + m.name + "' has no output '" + o.name + "'"));
      if (spec->dtype == DType::kBytes || m.config().decoupled)
        return done(InvalidArgument("output '" + o.name +
                                    "': classification needs a numeric output of a model that is "
                                    "not decoupled"));
    }
    job->batch = batch;
    if (Status s = CheckCudaPlacement(m, request, batch); !s.ok()) return done(s);
    const ModelConfig& c = m.config();
    if (c.priority_levels > 0 && request.priority > c.priority_levels)
      return done(InvalidArgument("priority " + std::to_string(request.priority) +
                                  " is outside model '" + m.name + "''s levels [1, " +
                                  std::to_string(c.priority_levels) + "] (0: its default)"));
    job->priority = request.priority > 0           ? request.priority
                    : c.default_priority_level > 0 ? c.default_priority_level
                                                   : UINT64_MAX;
    const uint64_t timeout_us =
        request.timeout_us > 0 ? request.timeout_us : m.config().default_timeout_us;
    // Saturating: a timeout too large to represent is no deadline, not one in the past.
    if (timeout_us > 0) job->deadline = SaturatingDeadline<Clock>(job->received, timeout_us);
    job->done = std::move(done);
    job->request = std::move(request);
    if (Status s = m.queue->Push(job); !s.ok()) {
      // Retired between Find() and here: the model's new runtime takes it
      // (a bounded number of times: loads do not come that fast).
      if (m.stopping && !stopping_ && attempt < 3) {
        --m.stats.pending;
        return InferOn(std::move(job->request), std::move(*original), attempt + 1);
      }
      job->done(s);
    }
  }

  // Inputs and outputs that name a CUDA shared-memory region (Triton's
  // cudasharedmemory extension): each is given the region it names
  // (SharedMemoryRef::cuda, which the request then holds) once it is
  // checked against the region and its tensor; CheckCudaPlacement checks
  // the rest once the batch is known. An input's data stays empty: the
  // worker copies it device to device. Names of system regions are left
  // alone.
  Status ResolveCudaSharedMemory(const ModelRuntime& m, InferRequest& request) const {
    // A request handed on to a model's new runtime (InferOn's `attempt`)
    // keeps the regions it found; it is checked again against the model.
    auto resolve =
        [&](const SharedMemoryRef& ref,
            const std::string& what) -> Result<std::shared_ptr<const CudaSharedMemoryEntry>> {
      if (ref.cuda) return ref.cuda;
      return shared_memory_.FindCuda(ref, what);
    };
    std::set<uint64_t> regions;
    for (InferTensor& in : request.inputs) {
      if (!in.shm) continue;
      const std::string what = "input '" + in.name + "'";
      ASSIGN_OR_RETURN(std::shared_ptr<const CudaSharedMemoryEntry> entry, resolve(*in.shm, what));
      if (entry == nullptr) continue;
      if (in.dtype == DType::kBytes)
        return InvalidArgument(what +
                               ": a BYTES input cannot be in CUDA shared memory (the server cannot "
                               "read its elements there to check them)");
      if (!in.data.empty())
        return InvalidArgument(what + " is in a CUDA shared-memory region and has data too");
      ASSIGN_OR_RETURN(uint64_t needed, ShapeBytes(in.dtype, in.shape, what));
      if (in.shm->byte_size != needed)
        return InvalidArgument(
            what + ": shared_memory_byte_size is " + std::to_string(in.shm->byte_size) +
            " but shape " + ShapeString(in.shape) + " of " +
            std::string(KserveDatatypeName(in.dtype)) + " needs " + std::to_string(needed));
      regions.insert(entry->id);
      in.shm->cuda = std::move(entry);
    }
    for (RequestedOutput& o : request.outputs) {
      if (!o.shm) continue;
      const std::string what = "output '" + o.name + "'";
      ASSIGN_OR_RETURN(std::shared_ptr<const CudaSharedMemoryEntry> entry, resolve(*o.shm, what));
      if (entry == nullptr) continue;
      auto spec = std::find_if(m.outputs.begin(), m.outputs.end(),
                               [&](const TensorSpec& t) { return t.name == o.name; });
      if (spec == m.outputs.end())
        return InvalidArgument("model '" + m.name + "' has no output '" + o.name + "'");
      const char* why = m.config().decoupled ? "the model is decoupled (each response has its own)"
                        : o.class_count > 0  ? "classification answers BYTES of no fixed size"
                        : !spec->fixed_size()
                            ? "its size is known only once the model has run (BYTES, or a -1 "
                              "dimension)"
                            : nullptr;
      if (why != nullptr)
        return InvalidArgument(what + " cannot go to CUDA shared-memory region '" + o.shm->region +
                               "': " + why);
      regions.insert(entry->id);
      o.shm->cuda = std::move(entry);
    }
    if (regions.size() > control::kMaxRunRegions)
      return InvalidArgument("the request names " + std::to_string(regions.size()) +
                             " CUDA shared-memory regions, over the limit of " +
                             std::to_string(control::kMaxRunRegions));
    return Status::Ok();
  }

  // Each output bound to a CUDA region has room there for its `batch` rows,
  // and the model runs on a GPU (its workers are the ones that copy).
  static Status CheckCudaPlacement(const ModelRuntime& m, const InferRequest& request,
                                   int64_t batch) {
    const SharedMemoryRef* first = nullptr;
    std::string first_what;
    for (const InferTensor& in : request.inputs) {
      if (in.shm && in.shm->cuda && first == nullptr) {
        first = &*in.shm;
        first_what = "input '" + in.name + "'";
      }
    }
    for (const RequestedOutput& o : request.outputs) {
      if (!o.shm || !o.shm->cuda) continue;
      if (first == nullptr) {
        first = &*o.shm;
        first_what = "output '" + o.name + "'";
      }
      auto spec = std::find_if(m.outputs.begin(), m.outputs.end(),
                               [&](const TensorSpec& t) { return t.name == o.name; });
      ASSIGN_OR_RETURN(uint64_t per_sample, spec->bytes_per_sample());
      ASSIGN_OR_RETURN(uint64_t bytes, CountBytes(m.batching() ? static_cast<uint64_t>(batch) : 1,
                                                  per_sample, "output '" + o.name + "'"));
      if (bytes > o.shm->byte_size)
        return InvalidArgument("output '" + o.name + "': its " + std::to_string(bytes) +
                               " bytes do not fit in the " + std::to_string(o.shm->byte_size) +
                               " bytes of CUDA shared-memory region '" + o.shm->region +
                               "' it was given");
    }
    // Workers on the host copy through their request slot with a context of the
    // region's GPU; a model with no worker on a GPU at all is refused.
    std::string devices;
    bool on_gpu = false;
    for (const auto& p : m.placements) {
      on_gpu = on_gpu || p->memory.is_cuda();
      devices += (devices.empty() ? "" : ", ") + p->device_name;
    }
    if (first != nullptr && !on_gpu)
      return InvalidArgument(first_what + " is in CUDA shared-memory region '" + first->region +
                             "', but model '" + m.name + "' runs its workers on the host (" +
                             devices +
                             "): CUDA shared memory is for models on a GPU; use system shared "
                             "memory or the request body");
    return Status::Ok();
  }

  // ---- repository control ----------------------------------------------

  Status LoadModel(const std::string& name) {
    if (stopping_ || !started_) return Unavailable("the server is not serving");
    ASSIGN_OR_RETURN(ModelEntry * entry, EntryFor(name));
    std::lock_guard build(entry->build_mu);
    {
      std::lock_guard lock(entry->mu);
      entry->unloaded = false;
    }
    const std::shared_ptr<ModelRuntime> old = entry->served.load();
    const std::map<std::string, ModelEntry::Loaded> previous = entry->loaded;
    Result<std::unique_ptr<ModelRuntime>> built = [&]() -> Result<std::unique_ptr<ModelRuntime>> {
      try {
        return TryBuild(*entry, /*keep_loaded=*/old != nullptr);
      } catch (const std::exception& e) {
        return Internal("model '" + name + "': " + e.what());
      }
    }();
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
      return built.status();
    }
    if (old == nullptr) {
      Publish(*entry, std::move(built).value());
      return entry->served.load() != nullptr ? Status::Ok()
                                             : Unavailable("the server is shutting down");
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
      return Unavailable("the server is shutting down");
    }
    old->RequestStop(false);
    DropChanged(name, previous, entry->loaded);  // its arenas go with the old workers' leases
    spdlog::info("model {}: version {} replaces version {} ({} workers); the old workers drain",
                 name, fresh->config().version, old->config().version, fresh->worker_count);
    if (fresh->AllSettled()) NotifySettled(*entry);
    return Status::Ok();
  }

  Status UnloadModel(const std::string& name) {
    if (stopping_ || !started_) return Unavailable("the server is not serving");
    ModelEntry* entry = nullptr;
    {
      std::shared_lock lock(entries_mu_);
      auto it = entries_.find(name);
      if (it == entries_.end()) return NotFound("unknown model '" + name + "'");
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

  std::string MetricsText() const {
    // Served models only: one that is not served has no workers or counters.
    std::vector<std::shared_ptr<ModelRuntime>> runtimes;  // alive while their text is written
    std::vector<std::pair<std::string, const ModelRuntime*>> served;
    std::shared_lock entries_lock(entries_mu_);
    for (const auto& [name, entry] : entries_) {
      if (std::shared_ptr<ModelRuntime> m = entry->served.load()) {
        served.emplace_back(name, m.get());
        runtimes.push_back(std::move(m));
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
    std::string text = PrometheusText(served, stores);
    uint64_t retired = 0;
    for (const auto& [name, entry] : entries_) {
      std::lock_guard lock(entry->mu);
      retired += entry->retired.size();
    }
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

  std::vector<int> WorkerPids(const std::string& model) const {
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

 private:
  struct RunningStore {
    std::unique_ptr<Store> store;
    std::thread thread;
    std::string socket;
  };

  // events_mu_ held.
  bool AllSettled() const {
    if (stopping_) return true;
    std::shared_lock entries_lock(entries_mu_);
    for (const auto& [name, entry] : entries_) {
      std::lock_guard lock(entry->mu);
      if (!entry->settled) return false;
    }
    return true;
  }

  void NotifySettled(ModelEntry& entry) {
    {
      std::lock_guard lock(entry.mu);
      entry.settled = true;
    }
    {
      std::lock_guard lock(events_mu_);  // AllSettled reads under it
    }
    events_cv_.notify_all();
  }

  // The sockets' directory: private (0700, ours, no symlink, trusted
  // ancestors), so that no other local user can replace the store's socket
  // and hand workers impostor weights. A new mkdtemp directory unless the
  // options name one, which is then checked (and created if missing).
  Status SetUpRunDirectory() {
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

  // A store's socket path, "<run dir>/store-cuda<N>.sock", must fit
  // sockaddr_un's sun_path with its NUL: the run directory may take what the
  // longest name leaves.
  static constexpr size_t kLongestSocketName = sizeof("/store-cuda4294967295.sock") - 1;
  static constexpr size_t kMaxRunDirLength = sizeof(sockaddr_un::sun_path) - 1 - kLongestSocketName;

  // The socket of `device`'s store, started on first use.
  Result<std::string> StoreFor(const StoreDevice& device) {
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
  Result<std::vector<Placement>> Place(const ModelConfig& c) {
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
          count.ok()
              ? std::string("the CUDA driver") +
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
  StoreDevice DeviceOf(const Placement& p) const {
    if (p.gpu < 0) return {"cpu", Device::Host()};
    if (options_.stand_in_gpus > 0) return {"host" + std::to_string(p.gpu), Device::Host()};
    return {"cuda:" + std::to_string(p.gpu), Device::Cuda(p.gpu)};
  }

  // The driver's count, asked once (it cannot change in a process).
  Result<int> VisibleGpus() {
    std::call_once(gpus_once_, [&] { visible_gpus_ = CudaDeviceCount(); });
    return visible_gpus_;
  }

  // Prepares what each worker is told (the setup message), places the
  // instances, and has each placement's store hold the weights (reusing
  // what it holds if the files are unchanged): the loads of all devices at
  // once, each store reading the checkpoint into its own staging. The
  // signature comes from the workers, checked against the config's.
  // `keep_loaded`: what the stores held for the entry is still served (a
  // repository load): the caller drops it once the new runtime replaced it.
  Status Prepare(ModelEntry& entry, ModelRuntime& m, bool keep_loaded) {
    const ModelConfig& c = m.config();
    ASSIGN_OR_RETURN(Checkpoint ckpt, Checkpoint::Open(c.checkpoint_path));
    auto specs = [](const std::vector<IoConfig>& ios) {
      std::vector<TensorSpec> out;
      for (const IoConfig& io : ios) out.push_back({io.name, io.dtype, io.dims});
      return out;
    };
    m.setup.max_batch_size = c.max_batch_size;
    m.setup.parameters = c.parameters;
    m.setup.inputs = specs(c.inputs);
    m.setup.outputs = specs(c.outputs);
    m.setup.config_json = hearth::ModelConfigJson(c);
    m.setup.version_dir = c.version_dir;
    m.setup.decoupled = c.decoupled;
    ASSIGN_OR_RETURN(std::vector<Placement> placed, Place(c));
    std::error_code ec;
    const std::string absolute = std::filesystem::absolute(c.checkpoint_path, ec).string();
    if (ec) return InvalidArgument(c.checkpoint_path + ": " + ec.message());
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
    // What the stores hold of an earlier attempt that is not wanted now (the
    // files changed, or the device is no longer placed) goes, unless it is
    // still served; each placement not held is loaded.
    std::map<std::string, ModelEntry::Loaded> wanted;
    std::vector<ModelPlacement*> to_load;
    for (const auto& p : m.placements) {
      // Every file the checkpoint is made of (one, or the index and each shard).
      const std::string key = absolute + "|" + p->device_name + "|" + ckpt.Fingerprint();
      auto held = entry.loaded.find(p->device_name);
      if (held != entry.loaded.end() && held->second.key == key &&
          held->second.socket == p->store_socket) {
        wanted.insert(*held);
        continue;
      }
      wanted[p->device_name].key = key;
      to_load.push_back(p.get());
    }
    for (auto it = entry.loaded.begin(); it != entry.loaded.end();) {
      auto w = wanted.find(it->first);
      if (w != wanted.end() && w->second == it->second) {
        ++it;
        continue;
      }
      if (!keep_loaded) DropFromStore(c.name, it->second);
      it = entry.loaded.erase(it);
    }
    std::vector<Result<ModelSummary>> results(to_load.size(), Internal("not loaded"));
    std::vector<std::function<void()>> loads;
    for (size_t i = 0; i < to_load.size(); ++i)
      loads.push_back(
          [&, i] { results[i] = AttachClient(to_load[i]->store_socket).Load(c.name, absolute); });
    const auto load_started = Clock::now();
    RunTogether(loads);
    Status failed = Status::Ok();
    for (size_t i = 0; i < to_load.size(); ++i) {
      ModelPlacement& p = *to_load[i];
      if (!results[i].ok()) {
        if (failed.ok())
          failed = results[i].status().WithContext(c.checkpoint_path + " on " + p.device_name);
        continue;
      }
      // Kept even when another device failed: a retry reuses it.
      entry.loaded[p.device_name] = {wanted[p.device_name].key, p.store_socket, results[i]->version,
                                     results[i]->arena_size};
    }
    RETURN_IF_ERROR(failed);
    if (!to_load.empty()) {
      std::string devices;
      for (const ModelPlacement* p : to_load)
        devices += (devices.empty() ? "" : ", ") + p->device_name;
      spdlog::info("model {}: weights loaded on {} in {:.3f} s{}", c.name, devices,
                   std::chrono::duration<double>(Clock::now() - load_started).count(),
                   to_load.size() > 1 ? " (at once)" : "");
    }
    for (const auto& p : m.placements) {
      const ModelEntry::Loaded& l = entry.loaded.at(p->device_name);
      p->store_version = l.version;
      p->arena_bytes = l.arena_bytes;
    }
    m.shared_memory = &shared_memory_;
    m.queue = std::make_unique<JobQueue>(std::max<uint64_t>(1, c.max_queue_size));
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
  void DropChanged(const std::string& name, const std::map<std::string, ModelEntry::Loaded>& from,
                   const std::map<std::string, ModelEntry::Loaded>& keep) {
    for (const auto& [device, loaded] : from) {
      auto k = keep.find(device);
      if (k == keep.end() || k->second != loaded) DropFromStore(name, loaded);
    }
  }

  void DropFromStore(const std::string& name, const ModelEntry::Loaded& loaded) {
    if (auto dropped = AttachClient(loaded.socket).Unload(name, loaded.version); !dropped.ok())
      spdlog::warn("model {}: dropping version {} from the store: {}", name, loaded.version,
                   dropped.status().message());
  }

  // The entry of a model directory of the repository: the one made at
  // start-up, or a new one for a directory that appeared since.
  Result<ModelEntry*> EntryFor(const std::string& name) {
    {
      std::shared_lock lock(entries_mu_);
      if (auto it = entries_.find(name); it != entries_.end()) return it->second.get();
    }
    ASSIGN_OR_RETURN(std::vector<ModelDirectory> dirs, ListModelDirectories(options_.repository));
    auto d = std::find_if(dirs.begin(), dirs.end(),
                          [&](const ModelDirectory& e) { return e.name == name; });
    if (d == dirs.end())
      return NotFound("no model directory '" + name + "' in the repository " + options_.repository);
    std::unique_lock lock(entries_mu_);
    auto [it, added] = entries_.try_emplace(name);
    if (added) {
      it->second = std::make_unique<ModelEntry>();
      it->second->dir = std::move(*d);
    }
    return it->second.get();
  }

  // ---- freeing replaced runtimes ----------------------------------------

  // A supervisor thread returned: a retired runtime may be done.
  void WakeReaper() {
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
  void ReaperLoop() {
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
        for (auto& w : r->workers) w->Join();
        // Anything its workers left (they all died): answered, and the
        // requests' references to the runtime go with them.
        r->queue->FailAll(
            Unavailable("model '" + r->name + "' was replaced or unloaded before the request ran"));
      }
      runtimes_freed_ += finished.size();
      finished.clear();
      lock.lock();
    }
  }

  // Stops a runtime that was never published, and frees it.
  void Discard(ModelEntry& entry, std::shared_ptr<ModelRuntime> m) {
    {
      std::lock_guard lock(entry.mu);
      if (entry.building == m.get()) entry.building = nullptr;
    }
    m->RequestStop(true);
    for (auto& w : m->workers) w->Join();
  }

  // One attempt: config, checkpoint, store, workers. Returns the runtime once
  // one of its workers is ready (its other workers may still be starting);
  // an error naming the path and the reason otherwise.
  Result<std::unique_ptr<ModelRuntime>> TryBuild(ModelEntry& entry, bool keep_loaded = false) {
    RETURN_IF_ERROR(entry.dir.status);
    ASSIGN_OR_RETURN(ModelConfig config, LoadModelConfig(entry.dir.path));
    auto m = std::make_unique<ModelRuntime>();
    m->name = entry.dir.name;
    m->config_ = std::move(config);
    RETURN_IF_ERROR(Prepare(entry, *m, keep_loaded));
    int index = 0;
    for (const auto& p : m->placements) {
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
  void BuilderLoop() {
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
      lock.unlock();
      const bool again = BuildOnce(*entry);
      lock.lock();
      if (again && !stopping_) {
        build_queue_.emplace(Clock::now() + RetryDelay(entry->failed_attempts - 1), entry);
        events_cv_.notify_all();  // it may be due before what the others wait for
      }
    }
  }

  // One attempt at a model: publishes it, or records and logs (once per
  // distinct reason) why not. True if it is to be tried again. Nothing it
  // throws (no thread to be had, no memory) escapes to the builder: that is
  // this model's failure, retried like any other.
  bool BuildOnce(ModelEntry& entry) {
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
  void Publish(ModelEntry& entry, std::unique_ptr<ModelRuntime> built) {
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
    spdlog::info("model {} version {}: {} on {}{}", c.name, c.version, c.backend,
                 m->DescribePlacements(),
                 entry.failed_attempts > 0
                     ? ", served after " + std::to_string(entry.failed_attempts + 1) + " attempts"
                     : "");
    // The workers that settled before `published` was set did not notify.
    if (m->AllSettled()) NotifySettled(entry);
  }

  ServerOptions options_;
  SharedMemoryRegistry shared_memory_;
  std::string run_dir_;
  bool made_run_dir_ = false;
  // Held by Start() while it makes the run directory, the entries and the
  // builders, and by Shutdown() from the moment it has set stopping_.
  std::mutex lifecycle_mu_;
  // Made when Start() lists the repository; LoadModel adds the entries of
  // directories that appeared since (under entries_mu_, exclusive). Entries are
  // never removed.
  mutable std::shared_mutex entries_mu_;
  std::map<std::string, std::unique_ptr<ModelEntry>> entries_;
  static constexpr size_t kMaxBuilders = 8;
  std::vector<std::thread> builders_;
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
  std::mutex reap_mu_;
  std::condition_variable reap_cv_;
  bool reap_due_ = false;     // guarded by reap_mu_
  bool reaper_quit_ = false;  // guarded by reap_mu_
  std::atomic<uint64_t> runtimes_freed_{0};
  // Set by Start() before started_: when it began, and when WaitForModels()
  // and Ready() stop waiting for models still on their first attempt.
  Clock::time_point started_at_{}, settle_deadline_{};
};

Server::Server(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Server::~Server() = default;

Result<std::unique_ptr<Server>> Server::Create(ServerOptions options) {
  if (options.worker_path.empty() || ::access(options.worker_path.c_str(), X_OK) != 0)
    return NotFound("worker executable '" + options.worker_path + "' not found");
  return std::unique_ptr<Server>(new Server(std::make_unique<Impl>(std::move(options))));
}

Status Server::Start() { return impl_->Start(); }
Status Server::WaitForModels() { return impl_->WaitForModels(); }
void Server::Shutdown() { impl_->Shutdown(); }
bool Server::Live() const { return impl_->Live(); }
bool Server::Ready() const { return impl_->Ready(); }
std::string Server::ServerVersion() const { return "0.1.0"; }
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
Status Server::LoadModel(const std::string& m) { return impl_->LoadModel(m); }
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
void Server::Infer(InferRequest r, std::function<void(Result<InferResponse>)> done) {
  impl_->Infer(std::move(r), std::move(done));
}
std::vector<int> Server::WorkerPids(const std::string& model) const {
  return impl_->WorkerPids(model);
}
std::string Server::MetricsText() const { return impl_->MetricsText(); }

}  // namespace hearth
