#include "http/http_server.h"

#include <memory>
#include <string>
#include <utility>

#include "http/listener.h"

namespace hearth {

class HttpServer::Impl : public rest::Listener {
 public:
  using Listener::Listener;
};

HttpServer::HttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

HttpServer::~HttpServer() = default;

Result<std::unique_ptr<HttpServer>> HttpServer::Create(InferenceService* service,
                                                       HttpOptions options) {
  if (service == nullptr) return InvalidArgument("HttpServer needs a service");
  if (options.threads < 1 || options.threads > 1024) {
    return InvalidArgument("HttpOptions.threads must be 1..1024, got " +
                           std::to_string(options.threads));
  }
  if (options.max_body_bytes == 0) return InvalidArgument("HttpOptions.max_body_bytes is 0");
  if (options.max_inflight_bytes == 0) {
    return InvalidArgument("HttpOptions.max_inflight_bytes is 0");
  }
  if (options.max_stream_buffer_bytes == 0) {
    return InvalidArgument("HttpOptions.max_stream_buffer_bytes is 0");
  }
  if (options.max_connections < 1) {
    return InvalidArgument("HttpOptions.max_connections must be at least 1, got " +
                           std::to_string(options.max_connections));
  }
  if (options.reserved_descriptors < 0) {
    return InvalidArgument("HttpOptions.reserved_descriptors must not be negative");
  }
  for (const auto& [name, value] : {std::pair{"idle_timeout", options.idle_timeout},
                                    std::pair{"head_timeout", options.head_timeout},
                                    std::pair{"body_timeout", options.body_timeout}}) {
    if (value.count() <= 0) {
      return InvalidArgument(std::string("HttpOptions.") + name + " must be positive");
    }
  }
  if (options.drain_timeout.count() < 0) {
    return InvalidArgument("HttpOptions.drain_timeout must not be negative");
  }
  return std::unique_ptr<HttpServer>(
      new HttpServer(std::make_unique<Impl>(service, std::move(options))));
}

Status HttpServer::Bind() { return impl_->Bind(); }
Status HttpServer::Start() { return impl_->Start(); }

void HttpServer::Stop() { impl_->Stop(); }

uint16_t HttpServer::port() const { return impl_->port(); }

HttpStats HttpServer::stats() const { return impl_->stats(); }

}  // namespace hearth
