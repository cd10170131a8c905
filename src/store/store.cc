// The public Store: checks the socket's name, loads the models given at
// start, binds the socket, and hands the rest to the event loop.
#include "hearth/store.h"

#include <spdlog/spdlog.h>

#include <string>
#include <utility>

#include "store/event_loop.h"
#include "store/loader.h"
#include "store/registry.h"
#include "store/socket_file.h"

namespace hearth {

class Store::Impl {
 public:
  explicit Impl(StoreOptions options) : options_(std::move(options)), loop_(options_, &registry_) {}

  Status Init() {
    RETURN_IF_ERROR(loop_.Init());
    // The directory and the name are checked before loading, so that a bad
    // directory or a store already serving there fails at once rather than
    // after minutes of loading; the socket is bound after loading.
    ASSIGN_OR_RETURN(socket_, store::OpenSocketFile(options_.socket_path));
    RETURN_IF_ERROR(store::CheckSocketName(socket_).status());
    for (const auto& [name, path] : options_.models) {
      if (name.empty() || name.find('@') != std::string::npos)
        return InvalidArgument("model name '" + name + "' is empty or contains '@'");
      LoadOptions load;
      load.threads = options_.load_threads;
      load.cancel = options_.cancel;
      if (options_.show_progress) load.progress = TerminalProgress(name);
      spdlog::info("loading {} from {}", name, path);
      Result<LoadedModel> loaded = LoadCheckpoint(path, options_.device, load);
      if (!loaded.ok()) return loaded.status();
      const double seconds = loaded->seconds;
      const auto& v = registry_.Register(name, path, std::move(loaded).value());
      spdlog::info("loaded {}@{} from {}: {} tensors, {:.1f} MiB on {} in {:.2f} s ({:.2f} GB/s)",
                   v.name, v.version, path, v.manifest.tensors.size(),
                   static_cast<double>(v.manifest.arena_size) / (1 << 20),
                   options_.device.ToString(), seconds,
                   seconds > 0 ? static_cast<double>(v.manifest.arena_size) / seconds / 1e9 : 0.0);
    }
    if (options_.cancel != nullptr && options_.cancel->load())
      return Unavailable("interrupted before the socket was bound: the store is stopping");
    ASSIGN_OR_RETURN(UniqueFd listener, store::BindSocket(socket_, options_.socket_mode));
    return loop_.Listen(std::move(listener));
  }

  Status Run() {
    RETURN_IF_ERROR(loop_.Run());
    spdlog::info("store shutting down");
    loop_.CancelLoads();
    store::RemoveSocketFile(socket_);
    loop_.CloseAll();
    registry_.Clear();
    return Status::Ok();
  }

  void Stop() { loop_.Stop(); }
  void RemoveSocket() { store::RemoveSocketFile(socket_); }
  void CancelLoads() { loop_.CancelLoads(); }
  Store::Held HeldArenas() const { return registry_.Held(); }

 private:
  StoreOptions options_;
  store::SocketFile socket_;
  store::Registry registry_;
  store::EventLoop loop_;  // last: it serves registry_
};

Store::Store(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Store::~Store() {
  if (impl_) impl_->RemoveSocket();
}

Result<std::unique_ptr<Store>> Store::Create(StoreOptions options) {
  auto impl = std::make_unique<Impl>(std::move(options));
  RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<Store>(new Store(std::move(impl)));
}

Status Store::Run() { return impl_->Run(); }

void Store::Stop() { impl_->Stop(); }

void Store::CancelLoads() { impl_->CancelLoads(); }
Store::Held Store::HeldArenas() const { return impl_->HeldArenas(); }

}  // namespace hearth
