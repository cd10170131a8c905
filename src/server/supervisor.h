// A served model version at run time (ModelRuntime: its queue, its workers,
// its signature and totals) and the supervisors of its worker processes.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/tensor_spec.h"
#include "hearth/device.h"
#include "hearth/status.h"
#include "protocol/worker_protocol.h"
#include "server/job_queue.h"
#include "server/model_config.h"
#include "server/placement.h"
#include "server/request_slot.h"
#include "server/server.h"
#include "server/shared_memory.h"
#include "server/worker_process.h"

namespace hearth {

struct ModelRuntime;
struct ModelPlacement;

// A worker process started ahead of need (parameters.standby_workers): it
// has read its setup, loaded its program and libraries, and waits, with no
// device context and no weights, for kStart on its control socket.
// Destroying it closes that socket (the process exits) and kills and reaps it.
struct StandbyWorker {
  WorkerProcess process;
  UniqueFd control;
  RequestSlot slot;
};

// One worker process and the thread that supervises it: starts it on its
// placement (attached to that device's copy of the weights), checks what it
// says it takes and gives, feeds it batches from the model's queue (the one
// queue of all the model's workers, whatever their device), and replaces it
// when it dies (with back-off). A worker of a failed placement takes no
// batch while another placement serves, but the placement's probes.
class WorkerSupervisor {
 public:
  WorkerSupervisor(ModelRuntime& model, ModelPlacement& placement, int index,
                   const ServerOptions& options)
      : model_(model), placement_(placement), index_(index), options_(options) {}
  ~WorkerSupervisor() { Join(); }
  Status Init();
  // Starts the supervisor thread; ResourceExhausted if the system has no
  // thread to give (RLIMIT_NPROC, pids.max), and then nothing was started.
  Status Start();
  void Join() {
    if (thread_.joinable()) thread_.join();
  }
  // The supervisor thread has returned (or was never started): Join() no
  // longer waits.
  bool finished() const { return finished_.load(); }
  // SIGKILL for a worker process that is still starting (it holds no
  // request): stopping must not wait out --ready-timeout for it. Call after
  // setting the model's stopping flag.
  void KillIfStarting() {
    if (starting_) process_.Kill();
  }
  pid_t pid() const { return process_.pid(); }
  int index() const { return index_; }
  const ModelPlacement& placement() const { return placement_; }
  bool ready() const { return ready_.load(); }
  uint64_t restarts() const { return restarts_.load(); }
  uint64_t device_memory_bytes() const { return device_memory_bytes_.load(); }

 private:
  void Loop();
  Status Spawn(UniqueFd* control);
  // Runs one batch of requests on the live worker; false if the worker is
  // gone (or was killed for a malformed answer).
  bool RunBatch(int control, const std::vector<std::shared_ptr<Job>>& jobs);
  // Keeps this worker's placement's standby workers at their number, once
  // all the model's first starts are over (a standby's loading would slow
  // theirs).
  void Replenish();
  // A decoupled model's run (one request), once its run message is sent:
  // each response to the request's on_response (or joined for one answer),
  // acknowledged with a cancel when the request is over. False as RunBatch.
  bool RunStream(int control, const std::shared_ptr<Job>& job, const control::Run& run,
                 Clock::time_point handed_over);
  // Tells the model how this worker's first start ended (once).
  void Settle();
  // The placement's health: a death of this worker (any kind), and a batch
  // it answered; each logs the placement failing or coming back.
  void NoteDeath(const std::string& why);
  void NoteAnswered(bool probe);

  ModelRuntime& model_;
  ModelPlacement& placement_;
  int index_;
  const ServerOptions& options_;
  std::thread thread_;
  std::atomic<bool> finished_{true};  // false from Start() until Loop() returns
  WorkerProcess process_;
  std::atomic<bool> ready_{false};
  // Between a spawn and its ready message (not once it has served: a
  // worker winding down after serving is left to finish, e.g. finalize()).
  std::atomic<bool> starting_{false};
  std::atomic<uint64_t> restarts_{0}, device_memory_bytes_{0};
  bool settled_ = false;  // supervisor thread only
  RequestSlot slot_;
  uint64_t seq_ = 0;
  // The registry's count of CUDA unregistrations when this worker's
  // regions were last looked at: when it moves on, they are looked at again.
  uint64_t told_unregistrations_ = 0;
  // The current worker's backend takes device addresses (Ready): its runs
  // are compact, giving bytes in CUDA regions no room in its slot.
  bool device_addresses_ = false;
  // The CUDA regions this worker's batches named since its last kRelease
  // (it may keep them open): one of them unregistered since is a release
  // too, however the count stands.
  std::map<uint64_t, std::shared_ptr<const CudaSharedMemoryEntry>> named_regions_;
  // A batch named a region already unregistered, or more than are tracked.
  bool look_at_named_ = false;
  // Sends kRelease naming the regions the worker may keep open that were
  // unregistered since the last time; false if the worker is gone.
  bool ReleaseRegionsIfUnregistered(int control);
};

// One device's share of a served model (server/placement.h): the copy of
// its weights in that device's store and the workers placed there. Made
// with its runtime, and fixed but for the counters once the workers start.
struct ModelPlacement {
  explicit ModelPlacement(int workers) : worker_count(workers), health(workers) {}
  int index = 0;  // in ModelRuntime::placements
  // "cpu", "cuda:N", or "hostN" (host memory standing in for GPU N): the
  // device label of /metrics, and the name of its store's socket.
  std::string device_name;
  Device memory;  // where its arena is
  std::string store_socket;
  uint64_t store_version = 0;
  uint64_t arena_bytes = 0;
  const int worker_count;
  std::atomic<int> ready_workers{0};
  std::atomic<uint64_t> batches{0};  // answered by its workers
  PlacementHealth health;
  // Standby workers (config().standby_workers per placement, once started):
  // taken by a supervisor of this placement whose worker died, made again
  // after its replacement is ready; all released when the runtime stops.
  mutable std::mutex standby_mu;
  std::vector<std::unique_ptr<StandbyWorker>> standbys;
  // Serving: a ready worker and not failed.
  bool serving() const { return ready_workers.load() > 0 && !health.failed(); }
};

// One served model version: its queue, its workers and their totals. Built
// and started by the model's builder thread, published to requests once a
// worker is ready, then never replaced or freed until the server is
// destroyed, so that requests may hold a plain pointer to it.
struct ModelRuntime {
  std::string name;
  ModelConfig config_;
  // One per device the model is on (host first, then GPUs by ordinal);
  // never empty once prepared.
  std::vector<std::unique_ptr<ModelPlacement>> placements;
  control::Setup setup;  // what each worker is told first
  // The signature: the config's, checked against what the first ready
  // worker reports, or that worker's where the config lists none. Fixed
  // (under state_mu) before the model is published; read freely after.
  std::vector<TensorSpec> inputs, outputs;
  bool signature_known = false;
  std::unique_ptr<JobQueue> queue;
  std::vector<std::unique_ptr<WorkerSupervisor>> workers;  // of every placement
  std::atomic<int> ready_workers{0};                       // of every placement
  std::atomic<bool> stopping{false};
  std::atomic<bool> abandoning{false};  // RequestStop(true): starting workers are not waited for
  // Set once requests can reach it; before that, worker start failures are
  // the builder's to report (once per reason).
  std::atomic<bool> published{false};
  int worker_count = 1;  // of every placement
  // Start-up: how many workers' first start has ended, and the last reason a
  // worker could not start. Guarded by state_mu; state_cv is notified on
  // each and when stopping is set (it also ends the supervisors' backoff).
  std::mutex state_mu;
  std::condition_variable state_cv;
  int settled_workers = 0;
  std::string last_worker_error;
  // Of every placement.
  int StandbyCount() const {
    int n = 0;
    for (const auto& p : placements) {
      std::lock_guard lock(p->standby_mu);
      n += static_cast<int>(p->standbys.size());
    }
    return n;
  }
  // One standby of `p`, if it keeps any and the runtime is not stopping.
  std::unique_ptr<StandbyWorker> TakeStandby(ModelPlacement& p);
  // Whether a placement other than `p` is serving (so that a failed `p`
  // holds its work back).
  bool ServedElsewhere(const ModelPlacement& p) const {
    for (const auto& q : placements)
      if (q.get() != &p && q->serving()) return true;
    return false;
  }
  // "cuda:0 (4 workers), cuda:1 (4 workers)".
  std::string DescribePlacements() const;
  // Called (from a supervisor thread, no lock held) when the last worker's
  // first start is over; set before the workers start.
  std::function<void()> on_all_settled;
  // Called from each supervisor thread as it returns (no lock held); set
  // before the workers start.
  std::function<void()> on_worker_finished;
  // Every worker's supervisor thread has returned: joining them waits no more.
  bool WorkersFinished() const {
    for (const auto& w : workers)
      if (!w->finished()) return false;
    return true;
  }
  // Totals for /metrics and the summary logged at shutdown.
  std::atomic<uint64_t> batches{0}, requests{0}, run_us{0}, request_us{0};
  std::atomic<uint64_t> success{0}, failure{0}, rows{0}, queue_us{0}, input_us{0}, output_us{0};
  // From handing a batch to a worker (the run message) to its answer, as
  // the server measures it: the backend's time plus the protocol's.
  std::atomic<uint64_t> exchange_us{0};
  std::atomic<int64_t> pending{0};
  // Triton's statistics: requests answered, by outcome, from arrival to
  // answer; when the last was; and per batch size (index: rows, 1 to
  // max_batch()) how many batches ran and their input, run and output times.
  std::atomic<uint64_t> success_us{0}, failure_us{0}, last_inference_ms{0};
  struct BatchTotals {
    std::atomic<uint64_t> count{0}, input_us{0}, infer_us{0}, output_us{0};
  };
  std::unique_ptr<BatchTotals[]> batch_totals;  // max_batch() + 1 entries
  void CountBatch(int64_t batch_rows, uint64_t in_us, uint64_t infer_us, uint64_t out_us) {
    if (batch_totals == nullptr || batch_rows < 1 || batch_rows > max_batch()) return;
    BatchTotals& t = batch_totals[static_cast<size_t>(batch_rows)];
    t.count += 1;
    t.input_us += in_us;
    t.infer_us += infer_us;
    t.output_us += out_us;
  }
  // The output time of a batch counted already (it is known only once its
  // answers are out).
  void AddBatchOutput(int64_t batch_rows, uint64_t out_us) {
    if (batch_totals == nullptr || batch_rows < 1 || batch_rows > max_batch()) return;
    batch_totals[static_cast<size_t>(batch_rows)].output_us += out_us;
  }
  static constexpr int64_t kBatchBuckets[] = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512};
  std::atomic<uint64_t> batch_bucket[std::size(kBatchBuckets)] = {};
  BatchPolicy policy;
  // Where outputs asked for in shared memory are written (the server's).
  const SharedMemoryRegistry* shared_memory = nullptr;

  const ModelConfig& config() const { return config_; }
  int max_batch() const { return std::max(1, config().max_batch_size); }
  bool batching() const { return config().max_batch_size > 0; }

  // Checks a worker's reported signature against the config's (when it
  // lists inputs and outputs) and against the one fixed by the first worker;
  // the first OK report fixes it. The error names both sides.
  Status AcceptSignature(const std::vector<TensorSpec>& inputs,
                         const std::vector<TensorSpec>& outputs);

  // Stops taking requests and makes every supervisor wind down: queued
  // requests are still run by workers that are up. Workers still starting
  // are killed if `abandon_starting` (they hold no request; waiting for them
  // could take --ready-timeout), else left to start and help drain the queue.
  void RequestStop(bool abandon_starting);
  // Sleeps for `d` unless stopping is (or becomes) set; false if stopping.
  bool WaitUnlessStopping(std::chrono::milliseconds d) {
    std::unique_lock lock(state_mu);
    return !state_cv.wait_for(lock, d, [&] { return stopping.load(); });
  }
  std::string LastWorkerError() {
    std::lock_guard lock(state_mu);
    return last_worker_error;
  }
  bool AllSettled() {
    std::lock_guard lock(state_mu);
    return settled_workers == worker_count;
  }
};

// Triton's classification of an output tensor (RequestedOutput::class_count).
InferTensor Classify(const InferTensor& t, uint32_t count, bool batching);

// The most a slot may grow to for one batch's inputs and outputs.
inline constexpr uint64_t kMaxSlotBytes = 16ull << 30;

}  // namespace hearth
