#include "server/request_admission.h"
#include "server/server_impl.h"

namespace hearth {

void Server::Impl::Infer(InferRequest request, std::function<void(Result<InferResponse>)> done) {
  InferOn(std::move(request), std::move(done), 0);
}

// `attempt`: how many runtimes of this model turned the request away
// because a repository load or unload retired them after it was found.
void Server::Impl::InferOn(InferRequest request,
                           std::function<void(Result<InferResponse>)> done_once, int attempt) {
  auto found = Find(request.model, request.version);
  if (!found.ok()) return done_once(found.status());
  // Held until the request is answered (its `done` keeps it).
  const std::shared_ptr<ModelRuntime> runtime = std::move(found).value();
  ModelRuntime& m = *runtime;
  // KServe's rules, for every front-end (AdmitInferRequest's, with the
  // regions of CUDA shared memory looked up in between): parameters, then
  // names, datatypes and shapes against the model.
  if (Status s = AdmitParameters(request); !s.ok()) return done_once(s);
  if (Status s = ResolveCudaSharedMemory(m, request); !s.ok()) return done_once(s);
  if (Status s = ValidateInferRequest(request, m.metadata()); !s.ok()) return done_once(s);
  // Inputs in system shared memory are read now: from here on they are
  // bytes like any other, checked against their shapes.
  for (InferTensor& in : request.inputs) {
    if (!in.shm || in.shm->cuda || !in.data.empty()) continue;
    Result<std::vector<std::byte>> bytes = shared_memory_.Read(*in.shm);
    if (!bytes.ok()) return done_once(bytes.status().WithContext("input '" + in.name + "'"));
    in.data = std::move(bytes).value();
  }
  // An ensemble's request runs its steps, each through this way in again.
  if (m.is_ensemble()) return RunEnsembleRequest(runtime, std::move(request), std::move(done_once));
  for (const RequestedOutput& o : request.outputs)
    if (o.shm && o.class_count == 0 && m.config().decoupled)
      return done_once(InvalidArgument("output '" + o.name +
                                       "': a decoupled model's outputs cannot go to shared "
                                       "memory (each response has its own)"));
  if (m.sequences) {
    // Through its sequence, which adds the model's control and state
    // inputs and lets it run once the sequence's earlier requests have.
    if (m.batching() && !request.inputs.empty() && request.inputs[0].shape[0] != 1)
      return done_once(InvalidArgument(
          "model '" + m.name + "' serves sequences: each request is one step of one sequence, " +
          "of batch 1, not " + std::to_string(request.inputs[0].shape[0])));
    SequenceTable::Dispatch dispatch = [this, runtime](InferRequest r, SequenceTable::Done d) {
      Enqueue(runtime, std::move(r), std::move(d), -1);
    };
    if (Status s = m.sequences->Submit(request, done_once, dispatch); !s.ok()) done_once(s);
    return;
  }
  Enqueue(runtime, std::move(request), std::move(done_once), attempt);
}

// `done` counting the request in the model's statistics once it is
// answered (it is counted pending until then).
std::function<void(Result<InferResponse>)> Server::Impl::Counted(
    const std::shared_ptr<ModelRuntime>& runtime,
    std::shared_ptr<std::function<void(Result<InferResponse>)>> done) {
  ++runtime->stats.pending;
  return [runtime, done = std::move(done), arrived = Clock::now()](Result<InferResponse> r) {
    ModelRuntime& model = *runtime;
    (r.ok() ? model.stats.success : model.stats.failure) += 1;
    (r.ok() ? model.stats.success_us : model.stats.failure_us) += static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - arrived).count());
    model.stats.last_inference_ms =
        static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                  std::chrono::system_clock::now().time_since_epoch())
                                  .count());
    --model.stats.pending;
    (*done)(std::move(r));
  };
}

// The request, admitted, into the model's queue. `attempt` as InferOn's;
// -1: a request of a sequence, which a retired runtime fails (its
// sequence's state went with it).
void Server::Impl::Enqueue(const std::shared_ptr<ModelRuntime>& runtime, InferRequest request,
                           std::function<void(Result<InferResponse>)> done_once, int attempt) {
  ModelRuntime& m = *runtime;
  auto original =
      std::make_shared<std::function<void(Result<InferResponse>)>>(std::move(done_once));
  std::function<void(Result<InferResponse>)> done = Counted(runtime, original);
  auto job = std::make_shared<Job>();
  // Never trust sizes: every input's bytes must be what its shape says
  // (BYTES: exactly that many well-formed elements).
  int64_t batch = 1;
  const bool batching = m.batching();
  // AdmitInferRequest found each of the model's inputs once, of its
  // datatype and shape; their bytes are checked here.
  for (size_t i = 0; i < m.inputs.size(); ++i) {
    const TensorSpec& spec = m.inputs[i];
    auto it = std::find_if(request.inputs.begin(), request.inputs.end(),
                           [&](const InferTensor& t) { return t.name == spec.name; });
    const std::string what = "input '" + spec.name + "'";
    if (it == request.inputs.end()) {
      // An optional input left out (admission let nothing else through).
      job->shape_key.push_back(-2);
      continue;
    }
    if (i == 0) batch = batching ? it->shape[0] : 1;
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
    if (m.stopping && !stopping_ && attempt >= 0 && attempt < 3) {
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
Status Server::Impl::ResolveCudaSharedMemory(const ModelRuntime& m, InferRequest& request) const {
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
    if (m.config().decoupled)
      return InvalidArgument(what +
                             ": a decoupled model's inputs cannot be in CUDA shared memory (each "
                             "stream's inputs are copied into its worker's slot)");
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
Status Server::Impl::CheckCudaPlacement(const ModelRuntime& m, const InferRequest& request,
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

}  // namespace hearth
