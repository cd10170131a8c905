#include "server/batch_layout.h"

#include <algorithm>
#include <set>
#include <string>

#include "server/shared_memory.h"

namespace hearth {
namespace {

uint64_t Align64(uint64_t v) { return (v + 63) / 64 * 64; }

const InferTensor* InputNamed(const Job& job, const std::string& name) {
  for (const InferTensor& in : job.request.inputs)
    if (in.name == name) return &in;
  return nullptr;
}

// The output `name` as the request asks for it in a CUDA region, or null.
const RequestedOutput* CudaOutput(const Job& job, const std::string& name) {
  for (const RequestedOutput& o : job.request.outputs)
    if (o.name == name && o.shm && o.shm->cuda) return &o;
  return nullptr;
}

// The CUDA regions a job names (their ids) and the copies it needs.
struct CudaUse {
  std::set<uint64_t> ids;
  size_t copies = 0;
};

CudaUse CudaUseOf(const Job& job) {
  CudaUse use;
  for (const InferTensor& in : job.request.inputs) {
    if (!in.shm || !in.shm->cuda) continue;
    use.ids.insert(in.shm->cuda->id);
    ++use.copies;
  }
  for (const RequestedOutput& o : job.request.outputs) {
    if (!o.shm || !o.shm->cuda) continue;
    use.ids.insert(o.shm->cuda->id);
    ++use.copies;
  }
  return use;
}

}  // namespace

uint64_t SlotBytesOf(const InferTensor& input) {
  return input.shm && input.shm->cuda ? input.shm->byte_size : input.data.size();
}

size_t JobsThatFit(std::span<const std::shared_ptr<Job>> jobs, uint64_t max_input_bytes,
                   uint64_t max_region_bytes) {
  std::set<uint64_t> ids;
  size_t copies = 0;
  uint64_t input_bytes = 0, region_bytes = 0;
  size_t n = 0;
  // Sums of the client's sizes (up to its regions'), each term bounded
  // first, so that they never wrap.
  auto add = [](uint64_t sum, uint64_t v, uint64_t limit) {
    return std::min(limit + 1, sum + std::min(limit + 1, v));
  };
  for (const auto& job : jobs) {
    CudaUse use = CudaUseOf(*job);
    size_t new_ids = 0;
    for (uint64_t id : use.ids) new_ids += ids.count(id) == 0 ? 1 : 0;
    uint64_t bytes = 0, in_regions = 0;
    for (const InferTensor& in : job->request.inputs) {
      bytes = add(bytes, SlotBytesOf(in), max_input_bytes);
      if (in.shm && in.shm->cuda) in_regions = add(in_regions, in.shm->byte_size, max_region_bytes);
    }
    for (const RequestedOutput& o : job->request.outputs)
      if (o.shm && o.shm->cuda) in_regions = add(in_regions, o.shm->byte_size, max_region_bytes);
    if (n > 0 && (ids.size() + new_ids > control::kMaxRunRegions ||
                  copies + use.copies > control::kMaxDeviceCopies ||
                  bytes > max_input_bytes - std::min(max_input_bytes, input_bytes) ||
                  add(region_bytes, in_regions, max_region_bytes) > max_region_bytes))
      break;
    ids.insert(use.ids.begin(), use.ids.end());
    copies += use.copies;
    input_bytes = add(input_bytes, bytes, max_input_bytes);
    region_bytes = add(region_bytes, in_regions, max_region_bytes);
    ++n;
  }
  return std::max<size_t>(n, jobs.empty() ? 0 : 1);
}

Result<BatchLayout> LayOutBatch(const BatchModel& model, std::span<const std::shared_ptr<Job>> jobs,
                                bool compact) {
  BatchLayout layout;
  control::Run& run = layout.run;
  run.compact = compact;
  if (jobs.empty()) return layout;
  int64_t rows = 0;
  for (const auto& job : jobs) rows += job->batch;
  run.rows = rows;
  if (model.decoupled) run.parameters_json = jobs[0]->request.parameters_json;

  // Each region once, by registration id (a name may have been registered
  // again since a request found it: the ids tell the two apart).
  std::vector<uint64_t> region_ids;
  auto region_index = [&](const CudaSharedMemoryEntry& entry) -> uint32_t {
    auto it = std::find(region_ids.begin(), region_ids.end(), entry.id);
    if (it != region_ids.end()) return static_cast<uint32_t>(it - region_ids.begin());
    region_ids.push_back(entry.id);
    control::DeviceRegion region;
    region.id = entry.id;
    region.name = entry.info.name.substr(0, control::kMaxDeviceRegionNameBytes);
    region.handle = entry.handle;
    region.device = static_cast<int32_t>(entry.info.device_id);
    region.byte_size = entry.info.byte_size;
    run.regions.push_back(std::move(region));
    return static_cast<uint32_t>(run.regions.size() - 1);
  };

  // Each input's rows from every request, one after the other; `room`: the
  // bytes of them in the slot (compact: not those in CUDA regions).
  uint64_t at = 0;
  for (size_t i = 0; i < model.inputs.size(); ++i) {
    const TensorSpec& spec = model.inputs[i];
    control::SlotTensor t;
    t.offset = Align64(at);
    uint64_t room = 0;
    const InferTensor* first = nullptr;
    for (const auto& job : jobs) {
      const InferTensor* in = InputNamed(*job, spec.name);
      if (in == nullptr)
        return InvalidArgument("a request of the batch has no input '" + spec.name + "'");
      if (first == nullptr) first = in;
      const uint64_t bytes = SlotBytesOf(*in);
      // Never wraps: every size a request gives is checked against what a
      // run may hold before it is added.
      if (bytes >= control::kMaxSlotBytes - t.bytes)
        return ResourceExhausted("input '" + spec.name + "' of the batch comes to more than " +
                                 std::to_string(control::kMaxSlotBytes) + " bytes");
      const bool in_region = in->shm && in->shm->cuda;
      if (in_region) {
        if (bytes > 0)
          run.copies.push_back({region_index(*in->shm->cuda), false, static_cast<uint32_t>(i),
                                t.bytes, bytes, in->shm->offset});
      } else if (bytes > 0) {
        layout.host_copies.push_back({t.offset + room, in->data.bytes()});
      }
      t.bytes += bytes;
      if (!in_region || !compact) room += bytes;
    }
    if (model.batching) t.shape.push_back(rows);
    t.shape.insert(t.shape.end(), first->shape.begin() + (model.batching ? 1 : 0),
                   first->shape.end());
    at = t.offset + room;
    run.inputs.push_back(std::move(t));
  }

  // Then each output whose size is known now; the worker places the others
  // in the room after them.
  layout.output_in_cuda.assign(jobs.size(), std::vector<bool>(model.outputs.size(), false));
  layout.output_shares.assign(jobs.size(), std::vector<OutputShare>(model.outputs.size()));
  for (size_t i = 0; i < model.outputs.size(); ++i) {
    const TensorSpec& spec = model.outputs[i];
    control::SlotTensor t;
    std::vector<int64_t> shape;
    if (model.batching) shape.push_back(rows);
    shape.insert(shape.end(), spec.dims.begin(), spec.dims.end());
    ASSIGN_OR_RETURN(std::optional<uint64_t> fixed,
                     control::FixedBytes(spec.dtype, shape, "output '" + spec.name + "'"));
    // A decoupled model's responses vary: the worker places each.
    const bool placed = fixed.has_value() && !model.decoupled;
    if (placed) {
      t.offset = Align64(at);
      t.bytes = *fixed;
      t.shape = std::move(shape);
    }
    // A request's share of the output: its rows (a model that does not
    // batch runs one request).
    const uint64_t row_bytes = rows > 0 ? t.bytes / static_cast<uint64_t>(rows) : 0;
    uint64_t within = 0, room = 0;
    for (size_t j = 0; j < jobs.size(); ++j) {
      const Job& job = *jobs[j];
      const uint64_t bytes =
          model.batching ? row_bytes * static_cast<uint64_t>(job.batch) : t.bytes;
      if (const RequestedOutput* o = CudaOutput(job, spec.name)) {
        if (!placed)
          return InvalidArgument("output '" + spec.name +
                                 "' has no size known before it runs: it cannot go to a CUDA "
                                 "shared-memory region");
        if (bytes > o->shm->byte_size)
          return InvalidArgument("output '" + spec.name + "': its " + std::to_string(bytes) +
                                 " bytes do not fit in the " + std::to_string(o->shm->byte_size) +
                                 " bytes of CUDA region '" + o->shm->region + "' it was given");
        layout.output_in_cuda[j][i] = true;
        if (bytes > 0)
          run.copies.push_back({region_index(*o->shm->cuda), true, static_cast<uint32_t>(i), within,
                                bytes, o->shm->offset});
        layout.output_shares[j][i] = {t.offset + room, bytes};
        if (!compact) room += bytes;
      } else if (placed) {
        layout.output_shares[j][i] = {t.offset + room, bytes};
        room += bytes;
      }
      within += bytes;
    }
    if (placed) at = t.offset + room;
    run.outputs.push_back(std::move(t));
    run.output_placed.push_back(placed ? 1 : 0);
  }
  run.free_offset = Align64(at);
  if (run.regions.size() > control::kMaxRunRegions || run.copies.size() > control::kMaxDeviceCopies)
    return InvalidArgument("the batch names " + std::to_string(run.regions.size()) +
                           " CUDA shared-memory regions in " + std::to_string(run.copies.size()) +
                           " copies, over the limits of one run (" +
                           std::to_string(control::kMaxRunRegions) + " regions, " +
                           std::to_string(control::kMaxDeviceCopies) + " copies)");
  // What the worker will check, checked first: a bad layout fails its
  // requests here, never the worker that would refuse it.
  RETURN_IF_ERROR(control::CheckDeviceCopies(run));
  return layout;
}

uint64_t InitialSlotBytes(const control::Run& run) {
  const bool worker_places =
      std::find(run.output_placed.begin(), run.output_placed.end(), 0) != run.output_placed.end();
  const uint64_t room = worker_places ? std::max<uint64_t>(run.free_offset / 2, 64u << 10) : 0;
  return std::max<uint64_t>(run.free_offset + room, 1);
}

}  // namespace hearth
