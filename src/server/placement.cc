#include "server/placement.h"

#include <algorithm>
#include <map>

namespace hearth {

Result<std::vector<Placement>> PlaceInstances(const std::vector<InstanceGroup>& groups,
                                              const PlacementContext& context) {
  // Keyed by GPU ordinal, -1 (the host) first.
  std::map<int, int64_t> workers;
  auto there_are = [&] {
    const int n = context.visible_gpus;
    std::string s = std::to_string(n) + (n == 1 ? " GPU is" : " GPUs are") + " visible";
    if (n > 0)
      s += " (" + (n == 1 ? std::string("GPU 0") : "GPUs 0 to " + std::to_string(n - 1)) + ")";
    return s + ", by " + context.gpu_source;
  };
  for (size_t i = 0; i < groups.size(); ++i) {
    const InstanceGroup& g = groups[i];
    const std::string which = "instance_group[" + std::to_string(i) + "]";
    if (!context.gpus || !g.kind_gpu) {
      // A server without GPUs runs a KIND_GPU group's instances on the host,
      // as many as it would have put on its GPUs.
      const int64_t devices =
          g.kind_gpu ? std::max<int64_t>(1, static_cast<int64_t>(g.gpus.size())) : 1;
      workers[-1] += g.count * devices;
      continue;
    }
    if (g.gpus.empty()) {
      if (context.default_gpu < 0 || context.default_gpu >= context.visible_gpus)
        return InvalidArgument(which + " lists no gpus, so it goes to the server's default GPU " +
                               std::to_string(context.default_gpu) + " (--device), but " +
                               there_are());
      workers[context.default_gpu] += g.count;
      continue;
    }
    for (int gpu : g.gpus) {
      if (gpu < 0 || gpu >= context.visible_gpus)
        return InvalidArgument(which + ".gpus names GPU " + std::to_string(gpu) + ", but " +
                               there_are());
      workers[gpu] += g.count;
    }
  }
  std::vector<Placement> out;
  int64_t total = 0;
  for (const auto& [gpu, count] : workers) {
    const int64_t n = context.workers_per_placement > 0 ? context.workers_per_placement : count;
    total += n;
    if (total > kMaxModelWorkers)
      return InvalidArgument("instance_group asks for more than " +
                             std::to_string(kMaxModelWorkers) + " workers in all");
    out.push_back({gpu, static_cast<int>(n)});
  }
  return out;
}

PlacementHealth::Change PlacementHealth::OnDeath(Clock::time_point now) {
  std::lock_guard lock(mu_);
  ++deaths_;
  if (failed_) {
    // A probe that died, or another worker: the next probe waits longer.
    probing_ = false;
    probe_delay_ = std::min(probe_delay_ * 2, kMaxProbe);
    probe_at_ = now + probe_delay_;
    return Change::kNone;
  }
  if (deaths_ < fail_after_) return Change::kNone;
  failed_ = true;
  ++times_failed_;
  probing_ = false;
  probe_delay_ = kFirstProbe;
  probe_at_ = now + probe_delay_;
  return Change::kFailed;
}

PlacementHealth::Change PlacementHealth::OnAnswered() {
  std::lock_guard lock(mu_);
  deaths_ = 0;
  if (!failed_) return Change::kNone;
  failed_ = false;
  probing_ = false;
  probe_delay_ = kFirstProbe;
  return Change::kRecovered;
}

bool PlacementHealth::failed() const {
  std::lock_guard lock(mu_);
  return failed_;
}

bool PlacementHealth::ClaimProbe(Clock::time_point now) {
  std::lock_guard lock(mu_);
  if (!failed_ || probing_ || now < probe_at_) return false;
  probing_ = true;
  return true;
}

void PlacementHealth::ReleaseProbe() {
  std::lock_guard lock(mu_);
  probing_ = false;
}

int PlacementHealth::deaths_in_a_row() const {
  std::lock_guard lock(mu_);
  return deaths_;
}

uint64_t PlacementHealth::times_failed() const {
  std::lock_guard lock(mu_);
  return times_failed_;
}

}  // namespace hearth
