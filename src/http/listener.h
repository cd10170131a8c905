// The listening socket and the I/O threads behind HttpServer.
#pragma once

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "hearth/status.h"
#include "http/http_server.h"
#include "http/server_core.h"
#include "http/session.h"
#include "server/inference_api.h"

namespace hearth::rest {

// Accepts connections, evicts silent ones at the limit, drains on Stop(), and
// runs the I/O threads.
class Listener {
 public:
  Listener(InferenceService* service, HttpOptions options);
  ~Listener();  // Stop()s

  // HttpServer's Bind, Start, Stop, port and stats (http_server.h says what
  // they do).
  Status Bind();
  Status Start();
  void Stop();
  uint16_t port() const;
  HttpStats stats() const;

 private:
  Result<uint64_t> ConnectionLimit() const;
  // Resolves, binds and listens on the configured address (Bind's work).
  Status BindAddress();
  void RunIo();

  // ---- accepting: all on the acceptor's strand -----------------------------

  void WaitForConnection();
  void AcceptReady();
  void OpenSession(int fd);
  void AcceptFailed(int error);
  bool BacklogWaiting() const;
  void MakeRoom();
  void LogEviction(bool kept_alive);
  void ResumeAccepting();
  void UpdatePaused();

  // ---- draining ------------------------------------------------------------

  void CloseListener();

  template <typename Predicate>
  bool WaitUntil(Clock::time_point deadline, Predicate done);
  void ForEachSession(void (Session::*what)());
  void Drain(Clock::time_point deadline);

  // The I/O context and what runs on it. Stop() destroys it after joining the
  // threads, which destroys the pending handlers and with them every session
  // and connection.
  struct Runtime {
    explicit Runtime(int threads)
        : io(threads),
          acceptor(net::make_strand(io)),
          accept_retry(acceptor.get_executor()),
          evict_retry(acceptor.get_executor()),
          work(net::make_work_guard(io)) {}
    net::io_context io;      // first: outlives the objects that use it
    tcp::acceptor acceptor;  // its handlers run on its own strand
    net::steady_timer accept_retry;
    net::steady_timer evict_retry;  // MakeRoom's next look
    net::executor_work_guard<net::io_context::executor_type> work;
  };

  ServerCore core_;  // outlives runtime_: handlers destroyed with it may refer to it
  std::unique_ptr<Runtime> runtime_;
  std::vector<std::thread> threads_;
  tcp protocol_ = tcp::v4();
  uint16_t port_ = 0;
  std::optional<Status> bound_;  // BindAddress's result, once tried
  bool started_ = false;
  bool stopped_ = false;
  // The acceptor's state, touched on its strand only (and by Start before
  // the threads run).
  bool waiting_ = false;  // an async_wait is pending
  bool paused_for_limit_ = false;
  bool backing_off_ = false;
  bool draining_ = false;
  bool evicting_ = false;  // an eviction was asked for and has not closed or refused
  uint64_t evictions_since_log_ = 0;
  Clock::time_point last_evict_log_{};
  uint64_t drain_connection_limit_ = 0;
  // Connections taken from the backlog since Start (on the acceptor's
  // strand; read by Stop once the threads are joined).
  uint64_t accepted_ = 0;
  std::chrono::milliseconds backoff_;
  Clock::time_point last_accept_log_{};
  uint64_t suppressed_accept_errors_ = 0;
};

}  // namespace hearth::rest
