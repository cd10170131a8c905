// hearth serve: a model repository served by exec'd worker processes that
// all map one read-only copy of each model's weights from the store.
//
// Threading: one supervisor thread per worker process; it restarts its
// process when it dies (with backoff) and feeds it requests from the model's
// queue. Infer() may be called from any thread.
#pragma once

#include <memory>
#include <string>

#include "hearth/device.h"
#include "hearth/status.h"
#include "server/inference_api.h"

namespace hearth {

struct ServerOptions {
  std::string repository;
  Device device;  // cpu, or cuda:N for models with KIND_GPU
  int workers = 0;  // > 0 overrides every instance_group.count
  std::string worker_path;  // the hearth-worker executable
  std::string run_dir;  // sockets live here (created 0750)
  int exec_timeout_ms = 60000;  // a batch running longer kills its worker
  int ready_timeout_ms = 300000;
};

class Server : public InferenceService {
 public:
  static Result<std::unique_ptr<Server>> Create(ServerOptions options);
  ~Server() override;

  // Starts the store, loads every valid model, starts the workers and waits
  // until each served model has all its workers ready (or gave up on them).
  Status Start();
  // Stops taking requests, finishes those in flight, stops workers and the store.
  void Shutdown();

  bool Live() const override;
  bool Ready() const override;
  std::string ServerName() const override { return "hearth"; }
  std::string ServerVersion() const override;
  std::vector<std::string> Extensions() const override;
  Result<ModelMetadata> Metadata(const std::string& model, const std::string& version) const override;
  Result<bool> ModelReady(const std::string& model, const std::string& version) const override;
  void Infer(InferRequest request, std::function<void(Result<InferResponse>)> done) override;
  std::string MetricsText() const override;

  // Pids of a model's live worker processes (tests, metrics).
  std::vector<int> WorkerPids(const std::string& model) const;

 private:
  class Impl;
  explicit Server(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace hearth
