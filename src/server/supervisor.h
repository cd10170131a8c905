// The supervisor of one worker process of a served model (its runtime:
// server/model_runtime.h), and a standby worker started ahead of need.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/tensor_spec.h"
#include "hearth/device.h"
#include "hearth/status.h"
#include "protocol/life_lock.h"
#include "protocol/worker_protocol.h"
#include "server/job_queue.h"
#include "server/model_config.h"
#include "server/placement.h"
#include "server/request_slot.h"
#include "server/server_options.h"
#include "server/shared_memory.h"
#include "server/stream_runner.h"
#include "server/worker_exchange.h"
#include "server/worker_process.h"
#include "server/zygote.h"

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
  // SIGKILL for the worker process whatever it is doing: a stop that must
  // not wait for the request it runs (the drain's deadline has passed).
  void Kill() { process_.Kill(); }
  pid_t pid() const { return process_.pid(); }
  int index() const { return index_; }
  const ModelPlacement& placement() const { return placement_; }
  bool ready() const { return ready_.load(); }
  uint64_t restarts() const { return restarts_.load(); }
  uint64_t device_memory_bytes() const { return device_memory_bytes_.load(); }
  // A decoupled model's worker: the streams it holds now.
  uint64_t streams_in_flight() const { return streams_in_flight_.load(); }
  // The blocks of its engine's KV cache in use and in all (0 without one).
  uint64_t kv_blocks_used() const { return kv_blocks_used_.load(); }
  uint64_t kv_blocks_total() const { return kv_blocks_total_.load(); }

 private:
  void Loop();
  // Starts this supervisor's worker process: a hot spare of its placement
  // if one is ready (then `adopted` is its kReady, already accepted), else a
  // cold standby if one waits, else a fresh process.
  // `ring`: a hot spare's stream ring (a decoupled model's), given it in
  // its warm-up.
  Status Spawn(UniqueFd* control, std::optional<control::Message>* adopted,
               std::optional<control::Ring>* ring);
  // Runs one batch of requests on the live worker; false if the worker is
  // gone (or was killed for a malformed answer).
  bool RunBatch(WorkerExchange& exchange, const std::vector<std::shared_ptr<Job>>& jobs);
  // Keeps this worker's placement's standby workers at their number, once
  // all the model's first starts are over (a standby's loading would slow
  // theirs).
  void Replenish();
  // A decoupled model's live worker: streams opened while it has room,
  // their responses to their clients, until the queue closes and the last
  // stream ends (true), or the worker is gone (false, `death` says how; its
  // streams go on elsewhere or end). `answered`: a response came.
  bool ServeStreams(int control, const control::Ready& ready, std::optional<control::Ring> ring,
                    std::string* death, bool* answered);
  // Whether no other ready worker of the model holds fewer streams: new
  // streams go to the least busy worker first.
  bool FewestStreams(uint64_t mine) const;
  // Tells the model how this worker's first start ended (once).
  void Settle();
  // The placement's health: a death of this worker (any kind), and a batch
  // it answered; each logs the placement failing or coming back.
  void NoteDeath(const std::string& why);
  // The dead worker a hot spare replaced before its exit was waited for
  // (its death already noted): reaped now if it has exited, or, with
  // `wait`, once it has.
  void ReapDying(bool wait);
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
  std::atomic<uint64_t> restarts_{0}, device_memory_bytes_{0}, streams_in_flight_{0};
  std::atomic<uint64_t> kv_blocks_used_{0}, kv_blocks_total_{0};
  bool settled_ = false;  // supervisor thread only
  WorkerProcess dying_;   // see ReapDying; supervisor thread only
  RequestSlot slot_;
  // The serving worker's life lock, watched (protocol/life_lock.h): its
  // death is known before its end-of-file.
  std::unique_ptr<control::LifeWatch> life_;
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
  bool ReleaseRegionsIfUnregistered(WorkerExchange& exchange);
};

// The zygote that forks `model`'s workers (server/zygote.h), not yet
// started; null where its workers are exec'd (its backend is not python, or
// parameters.zygote is false).
std::unique_ptr<WorkerZygote> MakeZygote(const ModelRuntime& model, const ServerOptions& options);

// What a StreamRunner needs of a decoupled model: its name, version and
// signature, and its token_ids output (kept for a resume where it is
// resumable, counted wherever it is INT64).
StreamModel StreamModelOf(const ModelRuntime& model);

// The most a slot may grow to for one batch's inputs and outputs.
inline constexpr uint64_t kMaxSlotBytes = 16ull << 30;

// The wait before starting a worker again after `failures` deaths in a row
// with no batch answered in between: none for the first, then 100 ms
// doubling up to 5 s.
std::chrono::milliseconds RestartBackoff(int failures);

// Starts a hot spare's process (server/hot_spares.h) on `placement`: a
// worker like a supervisor's own (no standby), which attaches and builds its
// backend at once.
Status StartHotSpareProcess(const ModelRuntime& model, const ModelPlacement& placement,
                            const ServerOptions& options, WorkerProcess& process, RequestSlot& slot,
                            UniqueFd* control);

}  // namespace hearth
