// A served model version's totals: what /metrics, Triton's statistics
// (ModelStatistics) and the summary logged at shutdown report. Counted by
// the server (requests, as they are answered) and by the supervisors
// (batches, as they run); read by anyone, at any time, without a lock (the
// start phases under their own).
#pragma once

#include <atomic>
#include <cstdint>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "protocol/worker_protocol.h"

namespace hearth {

struct ModelStats {
  // The model's largest batch (1 without batching): the last index of
  // batch_totals. Set before the workers start.
  int64_t max_batch = 1;
  // Requests and batches, and where their time went.
  std::atomic<uint64_t> batches{0}, requests{0}, run_us{0}, request_us{0};
  std::atomic<uint64_t> success{0}, failure{0}, rows{0}, queue_us{0}, input_us{0}, output_us{0};
  // From handing a batch to a worker (the run message) to its answer, as
  // the server measures it: the backend's time plus the protocol's.
  std::atomic<uint64_t> exchange_us{0};
  std::atomic<int64_t> pending{0};
  // Decoupled models' streams: requests opened on a worker (a resumed one
  // again), those that went on after their worker died, responses taken,
  // and token ids in them (the model's token_ids output).
  std::atomic<uint64_t> streams_opened{0}, streams_resumed{0}, stream_responses{0},
      stream_tokens{0};
  // Streams an engine preempted (gave their KV cache back, to go on later),
  // as the workers' engines report them (kEngineStats).
  std::atomic<uint64_t> preemptions{0};
  // Time from a stream's arrival to its first response (not a resumed
  // stream's), in seconds: cumulative buckets as Prometheus wants them.
  static constexpr double kFirstResponseBuckets[] = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                                     0.5,   1,    2.5,   5,    10,  30};
  std::atomic<uint64_t> first_response_bucket[std::size(kFirstResponseBuckets)] = {};
  std::atomic<uint64_t> first_response_count{0}, first_response_us{0};
  void CountFirstResponse(uint64_t us) {
    first_response_count += 1;
    first_response_us += us;
    for (size_t b = 0; b < std::size(kFirstResponseBuckets); ++b)
      if (static_cast<double>(us) <= kFirstResponseBuckets[b] * 1e6) first_response_bucket[b] += 1;
  }
  // Triton's statistics: requests answered, by outcome, from arrival to
  // answer; when the last was; and per batch size (index: rows, 1 to
  // max_batch) how many batches ran and their input, run and output times.
  std::atomic<uint64_t> success_us{0}, failure_us{0}, last_inference_ms{0};
  struct BatchTotals {
    std::atomic<uint64_t> count{0}, input_us{0}, infer_us{0}, output_us{0};
  };
  std::unique_ptr<BatchTotals[]> batch_totals;  // max_batch + 1 entries
  void CountBatch(int64_t batch_rows, uint64_t in_us, uint64_t infer_us, uint64_t out_us) {
    if (batch_totals == nullptr || batch_rows < 1 || batch_rows > max_batch) return;
    BatchTotals& t = batch_totals[static_cast<size_t>(batch_rows)];
    t.count += 1;
    t.input_us += in_us;
    t.infer_us += infer_us;
    t.output_us += out_us;
  }
  // The output time of a batch counted already (it is known only once its
  // answers are out).
  void AddBatchOutput(int64_t batch_rows, uint64_t out_us) {
    if (batch_totals == nullptr || batch_rows < 1 || batch_rows > max_batch) return;
    batch_totals[static_cast<size_t>(batch_rows)].output_us += out_us;
  }
  static constexpr int64_t kBatchBuckets[] = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512};
  std::atomic<uint64_t> batch_bucket[std::size(kBatchBuckets)] = {};

  // The phases of the workers' starts, from their ready messages: per
  // phase name, the starts that named it and their summed time. At most
  // kMaxStartPhaseNames names (a worker's phases past them are not counted).
  struct PhaseTotals {
    uint64_t count = 0, us = 0;
  };
  static constexpr size_t kMaxStartPhaseNames = 32;
  void CountStartPhases(const std::vector<control::StartPhase>& phases) {
    std::lock_guard lock(phases_mu_);
    for (const control::StartPhase& p : phases) {
      auto it = start_phases_.find(p.name);
      if (it == start_phases_.end()) {
        if (start_phases_.size() >= kMaxStartPhaseNames) continue;
        it = start_phases_.emplace(p.name, PhaseTotals{}).first;
      }
      it->second.count += 1;
      it->second.us += p.us;
    }
  }
  std::map<std::string, PhaseTotals> StartPhases() const {
    std::lock_guard lock(phases_mu_);
    return start_phases_;
  }

 private:
  mutable std::mutex phases_mu_;
  std::map<std::string, PhaseTotals> start_phases_;
};

}  // namespace hearth
