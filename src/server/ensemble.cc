#include "server/ensemble.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace hearth {
namespace {

// One request of an ensemble, shared by the steps it runs (each holds it
// until its model answers) and freed with the last of them.
class EnsembleRun : public std::enable_shared_from_this<EnsembleRun> {
 public:
  EnsembleRun(const ModelConfig& config, InferRequest request, InferDone done, StepRunner run_step)
      : config_(config),
        steps_(*config.ensemble),
        request_(std::move(request)),
        done_(std::move(done)),
        run_step_(std::move(run_step)),
        started_(steps_.size(), false) {
    cancel_ = request_.cancelled ? request_.cancelled : std::make_shared<std::atomic<bool>>(false);
    for (InferTensor& in : request_.inputs) {
      const std::string name = in.name;
      tensors_.emplace(name, std::move(in));
    }
    request_.inputs.clear();
  }

  // Starts every step whose tensors all exist, or answers once nothing
  // runs and nothing more can start.
  void Advance() {
    std::vector<std::pair<size_t, InferRequest>> ready;
    std::optional<Result<InferResponse>> answer;
    {
      std::lock_guard lock(mu_);
      if (failed_.ok() && cancel_->load())
        failed_ = Unavailable("request '" + request_.id + "' to ensemble '" + config_.name +
                              "' was cancelled: its client went away");
      if (failed_.ok()) {
        for (size_t i = 0; i < steps_.size(); ++i) {
          if (started_[i] || !Ready(steps_[i])) continue;
          started_[i] = true;
          ++running_;
          ready.emplace_back(i, StepRequest(i));
        }
      }
      answer = AnswerIfOver();
    }
    if (answer) return done_(std::move(*answer));
    for (auto& [i, step_request] : ready) {
      {
        // A step that failed meanwhile stops the ones not yet handed on.
        std::lock_guard lock(mu_);
        if (!failed_.ok()) {
          --running_;
          answer = AnswerIfOver();
        }
      }
      if (answer) return done_(std::move(*answer));
      if (!failed_ok()) continue;
      run_step_(std::move(step_request), [self = shared_from_this(), i](Result<InferResponse> r) {
        self->StepDone(i, std::move(r));
      });
    }
  }

 private:
  bool failed_ok() {
    std::lock_guard lock(mu_);
    return failed_.ok();
  }

  bool Ready(const EnsembleStep& step) const {
    return std::all_of(step.inputs.begin(), step.inputs.end(),
                       [&](const auto& in) { return tensors_.count(in.second) > 0; });
  }

  std::string StepName(size_t i) const {
    return "ensemble '" + config_.name + "' step " + std::to_string(i) + " (model '" +
           steps_[i].model + "')";
  }

  // mu_ held. The step's inputs are views of the ensemble's tensors, which
  // this run keeps (a map's elements stay where they are).
  InferRequest StepRequest(size_t i) {
    const EnsembleStep& step = steps_[i];
    InferRequest r;
    r.model = step.model;
    if (step.version > 0) r.version = std::to_string(step.version);
    r.id = request_.id;
    r.timeout_us = request_.timeout_us;
    r.priority = request_.priority;
    r.parameters_json = request_.parameters_json;
    r.cancelled = cancel_;
    const std::shared_ptr<const void> owner = shared_from_this();
    for (const auto& [step_tensor, tensor] : step.inputs) {
      const InferTensor& t = tensors_.at(tensor);
      r.inputs.emplace_back(step_tensor, t.dtype, t.shape,
                            TensorData::Shared(t.data.bytes(), owner));
    }
    for (const auto& [step_tensor, tensor] : step.outputs)
      r.outputs.emplace_back(step_tensor, true);
    return r;
  }

  void StepDone(size_t i, Result<InferResponse> r) {
    // Outside the lock: the outputs may be borrowed, valid only until this returns.
    std::vector<InferTensor> produced;
    Status failure = r.status();
    if (r.ok()) {
      for (const auto& [step_tensor, tensor] : steps_[i].outputs) {
        auto out = std::find_if(r->outputs.begin(), r->outputs.end(),
                                [&](const InferTensor& t) { return t.name == step_tensor; });
        if (out == r->outputs.end()) {
          failure = Internal("its answer lacks output '" + step_tensor + "'");
          break;
        }
        const auto bytes = out->data.bytes();
        produced.emplace_back(tensor, out->dtype, out->shape,
                              std::vector<std::byte>(bytes.begin(), bytes.end()));
      }
    }
    {
      std::lock_guard lock(mu_);
      --running_;
      if (!failure.ok()) {
        if (failed_.ok()) {
          failed_ = failure.WithContext(StepName(i));
          cancel_->store(true);  // its siblings stop too
        }
      } else {
        for (InferTensor& t : produced) {
          const std::string name = t.name;
          tensors_.emplace(name, std::move(t));
        }
      }
    }
    Advance();
  }

  // mu_ held. The answer, once no step runs and none can start; once only.
  std::optional<Result<InferResponse>> AnswerIfOver() {
    if (answered_ || running_ > 0) return std::nullopt;
    if (failed_.ok())
      for (size_t i = 0; i < steps_.size(); ++i)
        if (!started_[i] && Ready(steps_[i])) return std::nullopt;
    answered_ = true;
    if (!failed_.ok()) return Result<InferResponse>(failed_);
    InferResponse response;
    response.model = config_.name;
    response.version = std::to_string(config_.version);
    response.id = request_.id;
    std::vector<std::string> names;
    if (request_.outputs.empty()) {
      for (const IoConfig& o : config_.outputs) names.push_back(o.name);
    } else {
      for (const RequestedOutput& o : request_.outputs) names.push_back(o.name);
    }
    for (const std::string& name : names) {
      auto it = tensors_.find(name);
      if (it == tensors_.end())
        return Result<InferResponse>(
            Internal("ensemble '" + config_.name + "': output '" + name + "' was not produced"));
      response.outputs.push_back(std::move(it->second));
      tensors_.erase(it);
    }
    return Result<InferResponse>(std::move(response));
  }

  const ModelConfig& config_;
  const std::vector<EnsembleStep>& steps_;
  InferRequest request_;  // its inputs moved into tensors_
  InferDone done_;
  StepRunner run_step_;
  std::shared_ptr<std::atomic<bool>> cancel_;
  std::mutex mu_;
  // Guarded by mu_.
  std::map<std::string, InferTensor> tensors_;
  std::vector<bool> started_;
  int running_ = 0;
  Status failed_;
  bool answered_ = false;
};

}  // namespace

void RunEnsemble(const ModelConfig& ensemble, InferRequest request, InferDone done,
                 StepRunner run_step) {
  auto run = std::make_shared<EnsembleRun>(ensemble, std::move(request), std::move(done),
                                           std::move(run_step));
  run->Advance();
}

}  // namespace hearth
