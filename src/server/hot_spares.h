// Hot spares (parameters.standby_mode: hot): worker processes of one
// placement of a model started ahead of need and made fully ready (attached
// to the placement's copy of the weights, the backend built, one warm-up
// batch run), and the keeper thread that keeps standby_workers of them. A
// supervisor whose worker died takes one (Take) and serves with it at once.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "hearth/status.h"
#include "hearth/unique_fd.h"
#include "protocol/worker_protocol.h"
#include "server/inference_api.h"
#include "server/job_queue.h"
#include "server/request_slot.h"
#include "server/server_options.h"
#include "server/worker_process.h"

namespace hearth {

struct ModelRuntime;
struct ModelPlacement;

// A worker process that said ready, whose signature the model accepted and
// which ran one warm-up batch: what a supervisor adopts. Destroying it
// closes its control socket and kills and reaps the process.
struct HotSpare {
  WorkerProcess process;
  UniqueFd control;
  RequestSlot slot;
  control::Message ready;   // its kReady, accepted (ModelRuntime::AcceptSignature)
  uint64_t warm_up_us = 0;  // its warm-up batch, from the run sent to the answer
  // A decoupled model's spare: the stream ring its warm-up gave it.
  std::optional<control::Ring> ring;
};

// The keeper of one placement's hot spares: one thread that starts spares
// one at a time until config().standby_workers are ready, then waits (on
// their control sockets and an eventfd, never a timer) for one to be taken,
// one to die, or the model to stop. A spare that fails to start, hangs or
// dies in its warm-up, or dies while it waits is reaped, logged, and
// replaced after a back-off (RestartBackoff, from 100 ms, doubling up to
// 5 s, until a spare is taken again), so that a spare that cannot live
// never makes the keeper spin.
//
// Thread-safe: Take, Stop and the accessors from any thread. The runtime
// and the placement outlive the keeper; the runtime joins it with its
// supervisors (ModelRuntime::JoinWorkers).
class HotSpareKeeper {
 public:
  // ResourceExhausted or an errno error if the eventfd cannot be made.
  static Result<std::unique_ptr<HotSpareKeeper>> Create(ModelRuntime& model,
                                                        ModelPlacement& placement,
                                                        const ServerOptions& options);
  ~HotSpareKeeper();  // Stop(), Join(): no spare is left behind
  HotSpareKeeper(const HotSpareKeeper&) = delete;
  HotSpareKeeper& operator=(const HotSpareKeeper&) = delete;

  // Starts the keeper thread, the first time only (and never once stopped);
  // ResourceExhausted if the system has no thread to give.
  Status Start();
  // Makes the keeper wind down: the spare being started or warmed up is
  // killed (it holds no request), the thread is woken, and it releases
  // every spare as it returns. Any thread; returns at once.
  void Stop();
  void Join();
  // The thread has returned, or was never started.
  bool finished() const { return finished_.load(); }

  // A ready spare, if there is one and the keeper is not stopping; the
  // keeper is woken to start another. Counted as a takeover.
  std::unique_ptr<HotSpare> Take();

  int ready_count() const;
  // Summed over the ready spares, as each reported it in its kReady.
  uint64_t device_memory_bytes() const;
  uint64_t takeovers() const { return takeovers_.load(); }
  std::vector<HotSpareInfo> Describe() const;

 private:
  HotSpareKeeper(ModelRuntime& model, ModelPlacement& placement, const ServerOptions& options,
                 UniqueFd wake)
      : model_(model), placement_(placement), options_(options), wake_(std::move(wake)) {}
  void Loop();
  // Starts one spare and makes it ready: OK once it is (or once the keeper
  // stops), else why it is not (the spare then reaped).
  Status MakeOne();
  // Runs the warm-up batch on `spare`: an error if the spare died, hung or
  // answered what is no answer; an error answer of the model's is logged,
  // and the spare kept.
  Status WarmUp(HotSpare& spare);
  Status WarmUpStreams(HotSpare& spare, const std::shared_ptr<Job>& job);
  void Wake();
  bool stopping() const;

  ModelRuntime& model_;
  ModelPlacement& placement_;
  const ServerOptions& options_;
  UniqueFd wake_;  // eventfd: a spare taken, or Stop()
  std::thread thread_;
  std::atomic<bool> finished_{true};
  // Spares that failed in a row since the last one was taken: the back-off.
  std::atomic<int> failures_{0};
  std::atomic<uint64_t> takeovers_{0};

  mutable std::mutex mu_;  // guards the members below
  bool started_ = false;
  bool stopping_ = false;
  std::vector<std::unique_ptr<HotSpare>> ready_;
  // The process of the spare being started or warmed up (the keeper's
  // own, alive while set): Stop() kills it.
  WorkerProcess* starting_ = nullptr;
};

}  // namespace hearth
