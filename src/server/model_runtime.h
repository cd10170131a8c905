// A served model version at run time: ModelRuntime (its queue, its workers,
// its signature, its totals) and ModelPlacement (its share on one device).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/tensor_spec.h"
#include "hearth/device.h"
#include "hearth/status.h"
#include "protocol/worker_protocol.h"
#include "server/device_process_memory.h"
#include "server/hangup_watcher.h"
#include "server/hot_spares.h"
#include "server/inference_api.h"
#include "server/job_queue.h"
#include "server/model_config.h"
#include "server/model_stats.h"
#include "server/placement.h"
#include "server/sequences.h"
#include "server/shared_memory.h"
#include "server/supervisor.h"

namespace hearth {

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
  // Set before the workers start when config().standby_mode is hot (then
  // `standbys` stays empty): the keeper of its hot spares, started once the
  // model's first starts are over.
  std::unique_ptr<HotSpareKeeper> hot_spares;
  // Serving: a ready worker and not failed.
  bool serving() const { return ready_workers.load() > 0 && !health.failed(); }
};

// One served model version: its queue, its workers and their totals. Built
// and started by the model's builder thread, published to requests once a
// worker is ready. Shared (std::shared_ptr) by the server's entry for the
// model and by every request that found it; once replaced or unloaded it
// drains, its supervisor threads are joined, and it is freed with the last
// of those references.
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
  // The config lists input `name` as optional (a request may leave it out).
  bool IsOptionalInput(const std::string& input) const {
    for (const IoConfig& io : config().inputs)
      if (io.name == input) return io.optional;
    return false;
  }
  bool signature_known = false;
  std::unique_ptr<JobQueue> queue;
  // A model with sequence_batching: its live sequences, through which its
  // requests reach the queue (server/sequences.h).
  std::shared_ptr<SequenceTable> sequences;
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
  // Of every placement: hot spares ready, their device memory (the
  // driver's figure for each where `driver` has it, else what each
  // reported: HotSpareDeviceMemory), and how many took a dead worker's place.
  int HotSpareCount() const;
  uint64_t HotSpareDeviceMemoryBytes(const DriverMemory& driver) const;
  uint64_t HotSpareTakeovers() const;
  // Starts every placement's keeper of hot spares (once; later calls do
  // nothing). From a supervisor thread, once the first starts are over.
  void StartHotSpareKeepers();
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
  // Called from each supervisor thread and keeper of hot spares as it
  // returns (no lock held); set before the workers start.
  std::function<void()> on_worker_finished;
  // Starts `thread` (a supervisor's, a keeper's) running `body`: `finished`
  // is false until `body` returns, then on_worker_finished is called.
  // ResourceExhausted naming `what` if the system has no thread to give.
  Status StartThread(std::thread& thread, std::atomic<bool>& finished, std::function<void()> body,
                     const std::string& what);
  // Every worker's supervisor thread and every keeper of hot spares has
  // returned: JoinWorkers waits no more.
  bool WorkersFinished() const {
    for (const auto& w : workers)
      if (!w->finished()) return false;
    for (const auto& p : placements)
      if (p->hot_spares != nullptr && !p->hot_spares->finished()) return false;
    return true;
  }
  // Joins the supervisor threads, then the keepers of hot spares (which
  // the supervisors start); they return once stopping is set (RequestStop).
  void JoinWorkers() {
    for (auto& w : workers) w->Join();
    for (auto& p : placements)
      if (p->hot_spares != nullptr) p->hot_spares->Join();
  }
  // Its totals (/metrics, Triton's statistics, the summary at shutdown).
  ModelStats stats;
  BatchPolicy policy;
  // Where outputs asked for in shared memory are written (the server's).
  const SharedMemoryRegistry* shared_memory = nullptr;
  // Tells a supervisor at once that its idle worker died (the server's).
  HangupWatcher* hangups = nullptr;

  // Forks the workers of a `backend: python` model (server/zygote.h); null
  // where they are exec'd. Last: destroyed (its thread joined) first.
  std::unique_ptr<WorkerZygote> zygote;

  const ModelConfig& config() const { return config_; }
  // platform: ensemble: no placements, workers or weights (its queue stays
  // empty and its worker_count 0); its requests run its steps
  // (server/ensemble.h). Every model its steps reach, sorted, fixed before
  // it is published.
  bool is_ensemble() const { return config().ensemble.has_value(); }
  std::vector<std::string> ensemble_reaches;
  // Can take requests: with a ready worker, or an ensemble (its steps'
  // models answer for themselves).
  bool serving() const { return is_ensemble() || ready_workers.load() > 0; }
  // What the request API tells of it (InferenceService::Metadata).
  ModelMetadata metadata() const;
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

}  // namespace hearth
