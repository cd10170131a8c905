#include "server/ensemble.h"
#include "server/response_assembly.h"
#include "server/server_impl.h"

namespace hearth {

// A model a step of `ensemble` names, as served now. A model still on its
// first attempt (at start-up, when the models come up together) defers the
// ensemble, unless that model is an ensemble deferred itself (which would
// never end if the two named each other: the ensemble then fails, and is
// tried again later like any model).
Result<ComposingModel> Server::Impl::FindComposing(const std::string& model,
                                                   ModelEntry& ensemble) const {
  bool loading = false;
  {
    std::shared_lock entries_lock(entries_mu_);
    auto it = entries_.find(model);
    if (it == entries_.end()) return NotFound("the repository has no such model");
    const ModelEntry& entry = *it->second;
    std::lock_guard lock(entry.mu);
    loading =
        entry.served.load() == nullptr && !entry.settled && !entry.unloaded && !entry.deferred;
  }
  if (loading) {
    // Not under the other entry's lock: two ensembles may look at each other.
    std::lock_guard own(ensemble.mu);
    ensemble.deferred = true;
    return Unavailable("it is being loaded");
  }
  ASSIGN_OR_RETURN(std::shared_ptr<ModelRuntime> m, Find(model, ""));
  if (!m->serving())
    return Unavailable("it has no worker ready" +
                       (m->LastWorkerError().empty() ? "" : ": " + m->LastWorkerError()));
  return ComposingModel{m->metadata(), m->ensemble_reaches};
}

// An ensemble's runtime: no store, no workers; published once every model
// its steps name is served and agrees with them (CheckEnsembleSteps). With
// `load_chain` (a repository load), the models its steps name that are not
// served are loaded first, as Triton does in its explicit model control.
Result<std::unique_ptr<ModelRuntime>> Server::Impl::BuildEnsemble(
    ModelEntry& entry, ModelConfig config, std::vector<std::string>* load_chain) {
  {
    std::lock_guard lock(entry.mu);
    entry.deferred = false;
  }
  const std::vector<EnsembleStep>& steps = *config.ensemble;
  if (load_chain != nullptr) {
    for (size_t i = 0; i < steps.size(); ++i) {
      const std::string& model = steps[i].model;
      const std::string field =
          config.config_path + ": ensemble_scheduling.step[" + std::to_string(i) + "].model_name";
      if (std::find(load_chain->begin(), load_chain->end(), model) != load_chain->end())
        return InvalidArgument(field + ": model '" + model +
                               "' is an ensemble being loaded for this one (a cycle)");
      if (Find(model, "").ok()) continue;
      if (Status loaded = LoadModel(model, nullptr, load_chain); !loaded.ok())
        return loaded.WithContext(field + ": loading model '" + model + "' for the ensemble");
    }
  }
  Result<std::vector<std::string>> reaches = CheckEnsembleSteps(
      config, [&](const std::string& model) { return FindComposing(model, entry); });
  if (!reaches.ok()) return reaches.status();
  auto m = std::make_unique<ModelRuntime>();
  m->name = entry.dir.name;
  m->config_ = std::move(config);
  m->ensemble_reaches = std::move(reaches).value();
  m->worker_count = 0;
  // Never used (its requests run its steps), but there for what reads
  // every model's queue (metrics, shutdown).
  m->queue = std::make_unique<JobQueue>(1);
  m->shared_memory = &shared_memory_;
  m->hangups = &hangups_;
  for (const IoConfig& io : m->config().inputs) m->inputs.push_back({io.name, io.dtype, io.dims});
  for (const IoConfig& io : m->config().outputs) m->outputs.push_back({io.name, io.dtype, io.dims});
  m->signature_known = true;
  m->stats.max_batch = m->max_batch();
  {
    std::lock_guard lock(entry.mu);
    if (stopping_) return Unavailable("the server is shutting down");
  }
  return m;
}

// The labels that classify ensemble output `name`: the ensemble's own
// label_filename's, else those of the output of the step's model that
// produces it; null when none. They live in the runtime returned with them
// (held while they are used), so that no request copies them.
EnsembleLabels Server::Impl::EnsembleOutputLabels(const std::shared_ptr<ModelRuntime>& ensemble,
                                                  const std::string& name) const {
  const ModelConfig& config = ensemble->config();
  for (const IoConfig& io : config.outputs)
    if (io.name == name && !io.labels.empty()) return {ensemble, &io.labels};
  if (!config.ensemble) return {};
  for (const EnsembleStep& step : *config.ensemble) {
    for (const auto& [step_tensor, tensor] : step.outputs) {
      if (tensor != name) continue;
      const std::string version = step.version > 0 ? std::to_string(step.version) : "";
      Result<std::shared_ptr<ModelRuntime>> m = Find(step.model, version);
      if (!m.ok()) return {};
      for (const IoConfig& io : (*m)->config().outputs)
        if (io.name == step_tensor && !io.labels.empty()) return {*m, &io.labels};
      return {};
    }
  }
  return {};
}

// An admitted request of an ensemble (InferOn's checks made against the
// ensemble's own inputs and outputs): its steps run, each through InferOn
// as a client's request would.
void Server::Impl::RunEnsembleRequest(const std::shared_ptr<ModelRuntime>& runtime,
                                      InferRequest request,
                                      std::function<void(Result<InferResponse>)> done) {
  const std::string model = "ensemble '" + runtime->name + "'";
  for (const InferTensor& in : request.inputs)
    if (in.shm && in.shm->cuda)
      return done(InvalidArgument("input '" + in.name + "': " + model +
                                  " takes its inputs in the request or in system shared memory, "
                                  "not in CUDA shared memory"));
  // Outputs asked for as classes are classified once the ensemble answers,
  // with the labels of the ensemble's output, else those of the step's model
  // output that produced it (as Triton's ensembles answer them).
  struct Classified {
    std::string name;
    uint32_t count;
    EnsembleLabels labels;
  };
  std::vector<Classified> classified;
  for (RequestedOutput& o : request.outputs) {
    if (o.shm)
      return done(InvalidArgument("output '" + o.name + "': " + model +
                                  " answers its outputs in the response, not in shared memory"));
    if (o.class_count == 0) continue;
    classified.push_back({o.name, o.class_count, EnsembleOutputLabels(runtime, o.name)});
    o.class_count = 0;
  }
  // Of batch 1 as its steps are, when it does not batch.
  const uint64_t rows =
      runtime->batching() && !request.inputs.empty() && !request.inputs[0].shape.empty()
          ? static_cast<uint64_t>(request.inputs[0].shape[0])
          : 1;
  request.on_response = nullptr;
  auto original = std::make_shared<std::function<void(Result<InferResponse>)>>(std::move(done));
  std::function<void(Result<InferResponse>)> counted = Counted(runtime, original);
  InferDone answer = [runtime, rows, classified = std::move(classified),
                      counted = std::move(counted)](Result<InferResponse> r) {
    if (r.ok()) {
      for (const Classified& c : classified)
        for (InferTensor& t : r->outputs)
          if (t.name == c.name) t = Classify(t, c.count, runtime->batching(), c.labels.labels);
      runtime->stats.rows += rows;
      runtime->stats.requests += 1;
      runtime->stats.batches += 1;
    }
    counted(std::move(r));
  };
  RunEnsemble(runtime->config(), std::move(request), std::move(answer),
              [this](InferRequest step, InferDone step_done) {
                InferOn(std::move(step), std::move(step_done), 0);
              });
}

}  // namespace hearth
