// hearth serve: a model repository served by exec'd worker processes that
// all map one read-only copy of each model's weights from the store.
//
// Threading: a pool of at most 8 builder threads brings models up (and
// retries those that fail), off the caller's thread; one supervisor thread per worker process
// restarts its process when it dies (with backoff) and feeds it requests
// from the model's queue. Infer() may be called from any thread.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "hearth/device.h"
#include "hearth/status.h"
#include "server/inference_api.h"
#include "server/server_options.h"

namespace hearth {

class Server : public InferenceService {
 public:
  static Result<std::unique_ptr<Server>> Create(ServerOptions options);
  ~Server() override;

  // Makes the run directory, lists the repository and starts every model in
  // the background, and returns: no model, however slow or broken its
  // files, holds it up. A model not yet up is not served (ModelReady says
  // why: it is being loaded); one that fails (its directory, config,
  // checkpoint, or workers that cannot start) is not served, says why in the
  // log and in ModelReady, and is tried again every few seconds, so that
  // fixing its files brings it up. Fails if the run directory or the
  // repository itself is unusable, or (kUnavailable) if Shutdown() was
  // called before it ran.
  Status Start();
  // After Start(): returns once each model is up (every worker's first start
  // over) or has failed once, or ready_timeout_ms after Start(); until then
  // Ready() is false, whatever strict_readiness says. kUnavailable if
  // Shutdown() was called before or while it waited.
  Status WaitForModels();
  // Stops taking requests, answers everything queued, stops workers and the
  // stores, removes the run directory if it made it. Safe to call from
  // another thread while WaitForModels() waits (a signal's thread, say):
  // loads into the stores are cancelled, the models being built stop,
  // WaitForModels() returns kUnavailable, and this returns once all of it is
  // over. Idempotent.
  //
  // With `builder_grace`, a builder still in a model's attempt that long
  // after the stop (blocked in the kernel reading the model's files, on a
  // hung network filesystem say) is not waited for: it is named in the log,
  // the workers are still stopped, and false is returned. The server is then
  // fit only for the process to exit at once (std::_Exit): its stores and
  // that builder are left as they are, and its destructor must not run.
  bool Shutdown(std::optional<std::chrono::milliseconds> builder_grace = std::nullopt);
  // Stops every model and kills its workers at once (SIGKILL): the
  // requests they run fail, and what is queued is answered by Shutdown,
  // which no running request holds up then. For a stop whose drain's
  // deadline has passed.
  void KillWorkers();
  // After Start(): the run directory it made (its stores' sockets); empty
  // when ServerOptions::run_dir named one. For a process that must exit
  // without Shutdown (std::_Exit) and removes it first.
  std::string RunDirectory() const;

  bool Live() const override;
  bool Ready() const override;
  std::string ServerName() const override { return "hearth"; }
  std::string ServerVersion() const override;
  std::vector<std::string> Extensions() const override;
  Result<ModelMetadata> Metadata(const std::string& model,
                                 const std::string& version) const override;
  Result<bool> ModelReady(const std::string& model, const std::string& version) const override;
  std::vector<std::string> ModelNames() const override;
  void Infer(InferRequest request, std::function<void(Result<InferResponse>)> done) override;
  std::string MetricsText() const override;
  Result<std::string> ModelConfigJson(const std::string& model,
                                      const std::string& version) const override;
  Result<std::vector<ModelStatistics>> Statistics(const std::string& model,
                                                  const std::string& version) const override;
  std::vector<RepositoryEntry> RepositoryIndex(bool ready_only) const override;
  Result<std::vector<ModelWorkers>> Workers() const override;
  // On the server's pool of repository calls (at most 4 queued or running).
  void LoadModel(const std::string& model, std::function<void(Status)> done) override;
  void LoadModelWith(const std::string& model, ModelLoadOverrides overrides,
                     std::function<void(Status)> done) override;
  void UnloadModel(const std::string& model, std::function<void(Status)> done) override;
  // The same, on the caller's thread: returns when done.
  Status LoadModel(const std::string& model);
  Status UnloadModel(const std::string& model);
  Status RegisterSystemSharedMemory(const ClientConnection& client, const std::string& name,
                                    const std::string& key, uint64_t offset,
                                    uint64_t byte_size) override;
  Status UnregisterSystemSharedMemory(const std::string& name) override;
  Result<std::vector<SharedMemoryRegion>> SystemSharedMemoryStatus(
      const std::string& name) const override;
  // The GPUs this server uses are its --device and those that its served
  // models' instance groups name; a server on the host (--device cpu)
  // refuses every CUDA region.
  Status RegisterCudaSharedMemory(const ClientConnection& client, const std::string& name,
                                  std::span<const std::byte> raw_handle, int64_t device_id,
                                  uint64_t byte_size) override;
  Status UnregisterCudaSharedMemory(const std::string& name) override;
  Result<std::vector<CudaSharedMemoryRegion>> CudaSharedMemoryStatus(
      const std::string& name) const override;

  // Pids of a model's live worker processes (tests, metrics).
  std::vector<int> WorkerPids(const std::string& model) const;

 private:
  class Impl;
  explicit Server(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace hearth
