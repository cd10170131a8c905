// Where a model's worker instances go, and when a device's share of them is
// taken for failed. Pure logic (no processes, no devices, no clock of its
// own), so that tests/server/placement_test.cc can drive every case.
//
// A placement is one device's share of a model: the server loads the
// model's weights once into that device's store and starts the
// placement's workers there, attached to that copy (server.cc).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "hearth/status.h"
#include "server/job_queue.h"
#include "server/model_config.h"

namespace hearth {

// The most workers one model may have, over all its placements.
inline constexpr int kMaxModelWorkers = 1024;

// What the server places instances on.
struct PlacementContext {
  // Whether KIND_GPU groups go to GPUs. False for a server that serves from
  // host memory (--device cpu, or no GPU): then every instance of every
  // group runs on the host, as many as the groups ask for in all.
  bool gpus = false;
  // GPU ordinals 0 to visible_gpus - 1 exist: as the CUDA driver counts them
  // (CUDA_VISIBLE_DEVICES has narrowed and renumbered them already), or
  // --stand-in-gpus.
  int visible_gpus = 0;
  // Where a KIND_GPU group that lists no gpus goes (--device cuda:N).
  int default_gpu = 0;
  // > 0: every placement gets this many workers, whatever the counts
  // (--workers: per GPU, and per host placement).
  int workers_per_placement = 0;
  // Where visible_gpus came from, for errors ("the CUDA driver's count").
  std::string gpu_source = "the CUDA driver";
};

struct Placement {
  int gpu = -1;  // the GPU ordinal; -1: host memory
  int workers = 0;
  friend bool operator==(const Placement&, const Placement&) = default;
};

// The placements of `groups`, each device once (groups that name the same
// device add up): the host first, if any group runs there, then the GPUs in
// ascending order. Triton's meaning: a KIND_GPU group puts `count` instances
// on each GPU it lists, or on the default GPU when it lists none; a
// KIND_CPU group puts `count` on the host. InvalidArgument, naming the
// group, the GPU and how many GPUs there are, for a GPU that does not exist
// (the default GPU included); and past kMaxModelWorkers workers in all.
Result<std::vector<Placement>> PlaceInstances(const std::vector<InstanceGroup>& groups,
                                              const PlacementContext& context);

// Whether one placement's workers keep dying: what a GPU that fails looks
// like from the server (a sticky CUDA error kills each worker at its next
// batch; a lost device kills every start). Deaths count in a row across all
// the placement's workers (a start that fails, a worker that dies serving or
// idle) until any of them answers a batch. At FailAfter(workers) deaths in a
// row the placement is failed: while another placement of the model serves,
// its workers take no batch but one probe, due 1 s after the failure, then
// 2, 4, ... up to 30 s after each death; an answered batch brings the
// placement back. Thread-safe.
class PlacementHealth {
 public:
  using Clock = std::chrono::steady_clock;
  enum class Change { kNone, kFailed, kRecovered };

  // Twice the placement's workers, and never as few as a poison request
  // takes down (kPoisonCrashes), which says nothing of the device.
  static int FailAfter(int workers) { return std::max(kPoisonCrashes + 1, 2 * workers); }
  static constexpr std::chrono::milliseconds kFirstProbe{1000};
  static constexpr std::chrono::milliseconds kMaxProbe{30000};

  explicit PlacementHealth(int workers) : fail_after_(FailAfter(workers)) {}

  // kFailed when this death fails the placement.
  Change OnDeath(Clock::time_point now);
  // A worker of the placement answered a batch: kRecovered if it was failed.
  Change OnAnswered();
  bool failed() const;
  // For a worker of a failed placement: true (the claim) if the probe is
  // due and no other worker holds it; the claimant runs one batch, whose
  // answer (OnAnswered) or death (OnDeath) settles the claim.
  bool ClaimProbe(Clock::time_point now);
  // The claimant found no batch to run: the probe may be claimed again.
  void ReleaseProbe();
  int deaths_in_a_row() const;
  uint64_t times_failed() const;

 private:
  const int fail_after_;
  mutable std::mutex mu_;
  int deaths_ = 0;
  bool failed_ = false;
  bool probing_ = false;
  uint64_t times_failed_ = 0;
  std::chrono::milliseconds probe_delay_ = kFirstProbe;
  Clock::time_point probe_at_;
};

}  // namespace hearth
