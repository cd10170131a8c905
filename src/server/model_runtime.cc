#include "server/model_runtime.h"

#include <spdlog/spdlog.h>

#include <set>
#include <string>
#include <system_error>
#include <utility>

namespace hearth {

std::unique_ptr<StandbyWorker> ModelRuntime::TakeStandby(ModelPlacement& p) {
  std::lock_guard lock(p.standby_mu);
  if (p.standbys.empty() || stopping) return nullptr;
  std::unique_ptr<StandbyWorker> s = std::move(p.standbys.back());
  p.standbys.pop_back();
  return s;
}

int ModelRuntime::HotSpareCount() const {
  int n = 0;
  for (const auto& p : placements)
    if (p->hot_spares != nullptr) n += p->hot_spares->ready_count();
  return n;
}

uint64_t ModelRuntime::HotSpareDeviceMemoryBytes(const DriverMemory& driver) const {
  uint64_t bytes = 0;
  for (const auto& p : placements)
    if (p->hot_spares != nullptr)
      bytes += HotSpareDeviceMemory(driver, p->device_name, p->hot_spares->Describe());
  return bytes;
}

uint64_t ModelRuntime::HotSpareTakeovers() const {
  uint64_t n = 0;
  for (const auto& p : placements)
    if (p->hot_spares != nullptr) n += p->hot_spares->takeovers();
  return n;
}

void ModelRuntime::StartHotSpareKeepers() {
  for (const auto& p : placements) {
    if (p->hot_spares == nullptr) continue;
    // Not fatal: a worker that dies is then started afresh, as without spares.
    if (Status started = p->hot_spares->Start(); !started.ok())
      spdlog::warn("{}: the keeper of the hot spares on {} could not be started: {}", name,
                   p->device_name, started.message());
  }
}

Status ModelRuntime::StartThread(std::thread& thread, std::atomic<bool>& finished,
                                 std::function<void()> body, const std::string& what) {
  finished.store(false);
  try {
    thread = std::thread([this, &finished, body = std::move(body)] {
      body();
      finished.store(true);
      if (on_worker_finished) on_worker_finished();
    });
  } catch (const std::system_error& e) {
    finished.store(true);
    return ResourceExhausted("starting " + what + ": " + std::string(e.what()));
  }
  return Status::Ok();
}

std::string ModelRuntime::DescribePlacements() const {
  std::string out;
  for (const auto& p : placements)
    out += (out.empty() ? "" : ", ") + p->device_name + " (" + std::to_string(p->worker_count) +
           (p->worker_count == 1 ? " worker)" : " workers)");
  return out;
}

Status ModelRuntime::AcceptSignature(const std::vector<TensorSpec>& in,
                                     const std::vector<TensorSpec>& out) {
  auto describe = [](const std::vector<TensorSpec>& specs) {
    std::string s;
    for (const TensorSpec& t : specs) s += (s.empty() ? "" : ", ") + Describe(t);
    return s.empty() ? std::string("none") : s;
  };
  auto compare = [&](const std::vector<TensorSpec>& want, const std::vector<TensorSpec>& have,
                     const char* what, const std::string& whose) -> Status {
    if (want == have) return Status::Ok();
    return InvalidArgument(std::string(what) + ": " + whose + " " + describe(want) + "; the " +
                           config().backend + " backend reports " + describe(have) +
                           " (names, data_type and dims must agree)");
  };
  std::lock_guard lock(state_mu);
  if (signature_known) {
    RETURN_IF_ERROR(compare(inputs, in, "inputs", "the other workers take"));
    return compare(outputs, out, "outputs", "the other workers give");
  }
  if (!setup.inputs.empty() || !setup.outputs.empty()) {
    RETURN_IF_ERROR(compare(setup.inputs, in, "inputs", config().config_path + " lists"));
    RETURN_IF_ERROR(compare(setup.outputs, out, "outputs", config().config_path + " lists"));
  }
  std::set<std::string> names;
  for (const auto* specs : {&in, &out}) {
    for (const TensorSpec& t : *specs) {
      if (t.name.empty() || !names.insert(t.name).second)
        return InvalidArgument(
            "the " + config().backend + " backend reports " +
            (t.name.empty() ? std::string("a tensor without a name") : "'" + t.name + "' twice"));
      if (t.dims.size() + (batching() ? 1 : 0) > control::kMaxRank)
        return InvalidArgument("tensor " + Describe(t) + " has more dimensions than " +
                               std::to_string(control::kMaxRank));
    }
  }
  inputs = in;
  outputs = out;
  signature_known = true;
  return Status::Ok();
}

void ModelRuntime::RequestStop(bool abandon_starting) {
  {
    std::lock_guard lock(state_mu);
    if (abandon_starting) abandoning = true;
    stopping = true;
  }
  state_cv.notify_all();
  if (queue) queue->Close();
  if (zygote) zygote->Stop();
  if (abandon_starting)
    for (auto& w : workers) w->KillIfStarting();
  // Standbys and hot spares hold nothing: released now (not when the
  // runtime is freed).
  for (auto& p : placements)
    if (p->hot_spares != nullptr) p->hot_spares->Stop();
  std::vector<std::unique_ptr<StandbyWorker>> released;
  for (auto& p : placements) {
    std::lock_guard lock(p->standby_mu);
    for (auto& s : p->standbys) released.push_back(std::move(s));
    p->standbys.clear();
  }
}

ModelMetadata ModelRuntime::metadata() const {
  ModelMetadata md;
  md.name = name;
  md.versions = {std::to_string(config().version)};
  md.platform = is_ensemble() ? "ensemble" : "hearth_" + config().backend;
  md.max_batch_size = config().max_batch_size;
  auto convert = [&](const std::vector<TensorSpec>& specs, std::vector<TensorMetadata>* out) {
    for (const TensorSpec& s : specs) {
      TensorMetadata t{s.name, s.dtype, {}, out == &md.inputs && IsOptionalInput(s.name)};
      if (md.max_batch_size > 0) t.shape.push_back(-1);
      t.shape.insert(t.shape.end(), s.dims.begin(), s.dims.end());
      out->push_back(std::move(t));
    }
  };
  convert(inputs, &md.inputs);
  convert(outputs, &md.outputs);
  md.decoupled = config().decoupled;
  // A sequence model's control and state tensors are the server's to give
  // and take, not a request's.
  if (const auto& sequence = config().sequence) {
    md.sequence = true;
    auto implicit = [&](const TensorMetadata& t) {
      for (const SequenceControl& c : sequence->controls)
        if (c.input == t.name) return true;
      for (const SequenceState& s : sequence->states)
        if (s.input == t.name || s.output == t.name) return true;
      return false;
    };
    std::erase_if(md.inputs, implicit);
    std::erase_if(md.outputs, implicit);
  }
  return md;
}

}  // namespace hearth
