#include "server/zygote.h"

#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstring>

namespace hearth {
namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kMaxMessage = 64 << 10;
// Starts in a row that end before the zygote is ready (or within
// kSteadyAfter of it) before its model turns to exec'd workers.
constexpr int kMaxFailures = 5;
constexpr auto kSteadyAfter = std::chrono::seconds(10);

Status SendFork(int sock, const std::vector<std::string>& args, int control, int slot) {
  std::string text = "fork";
  for (const std::string& a : args) {
    if (a.find('\0') != std::string::npos)
      return InvalidArgument("a worker's argument holds a NUL byte");
    text.push_back('\0');
    text += a;
  }
  if (text.size() > kMaxMessage)
    return InvalidArgument("a worker's arguments come to more than " + std::to_string(kMaxMessage) +
                           " bytes");
  iovec iov{text.data(), text.size()};
  alignas(cmsghdr) char space[CMSG_SPACE(2 * sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = space;
  msg.msg_controllen = sizeof space;
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(2 * sizeof(int));
  const int fds[2] = {control, slot};
  std::memcpy(CMSG_DATA(c), fds, sizeof fds);
  for (;;) {
    if (::sendmsg(sock, &msg, MSG_NOSIGNAL) >= 0) return Status::Ok();
    if (errno == EINTR) continue;
    if (errno == EPIPE || errno == ECONNRESET) return Unavailable("the zygote is gone");
    return ErrnoError("sending a fork request to the zygote", errno);
  }
}

// One message from the zygote, its NUL-separated fields; Unavailable at its
// end-of-file or once `wake` is readable (the keeper stops), DeadlineExceeded
// after `timeout`.
Result<std::vector<std::string>> Receive(int sock, int wake, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0)
      return DeadlineExceeded("no answer within " + std::to_string(timeout.count()) + " ms");
    pollfd fds[2] = {{sock, POLLIN, 0}, {wake, POLLIN, 0}};
    const int n = ::poll(fds, 2, static_cast<int>(std::min<int64_t>(left, 60000)));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoError("poll", errno);
    if (fds[1].revents != 0) return Unavailable("the model stops");
    if (fds[0].revents == 0) continue;
    std::string buffer(kMaxMessage, '\0');
    const ssize_t got = ::recv(sock, buffer.data(), buffer.size(), MSG_DONTWAIT | MSG_TRUNC);
    if (got < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (got < 0 && errno == ECONNRESET) return Unavailable("the zygote is gone");
    if (got < 0) return ErrnoError("reading from the zygote", errno);
    if (got == 0) return Unavailable("the zygote is gone");
    if (static_cast<size_t>(got) > buffer.size())
      return InvalidArgument("a message of " + std::to_string(got) + " bytes from the zygote");
    buffer.resize(static_cast<size_t>(got));
    std::vector<std::string> fields;
    size_t at = 0;
    for (;;) {
      const size_t nul = buffer.find('\0', at);
      fields.push_back(buffer.substr(at, nul == std::string::npos ? std::string::npos : nul - at));
      if (nul == std::string::npos) break;
      at = nul + 1;
    }
    return fields;
  }
}

// What a field from the zygote says, fit for a log line.
std::string Printable(const std::string& text) {
  std::string out;
  for (char c : text.substr(0, 2000)) out.push_back(c >= 0x20 && c < 0x7f ? c : ' ');
  return out;
}

std::string Describe(const std::vector<std::string>& message) {
  std::string out;
  for (size_t i = 1; i < message.size(); ++i) out += (i > 1 ? " " : "") + Printable(message[i]);
  return out;
}

// The ready message's "imports=1.234" fields, for the log: "imports 1.234
// s"; "threads=2": "2 native threads".
std::string PhasesText(const std::vector<std::string>& message) {
  std::string out;
  for (size_t i = 1; i < message.size(); ++i) {
    const size_t eq = message[i].find('=');
    if (eq == std::string::npos) continue;
    const std::string name = Printable(message[i].substr(0, eq));
    const std::string value = Printable(message[i].substr(eq + 1, 8));
    out += (out.empty() ? "" : ", ") +
           (name == "threads" ? value + " native threads" : name + " " + value + " s");
  }
  return out;
}

}  // namespace

WorkerZygote::WorkerZygote(std::string model, Starter start,
                           std::chrono::milliseconds ready_timeout)
    : model_(std::move(model)), start_(std::move(start)), ready_timeout_(ready_timeout) {}

Status WorkerZygote::Start() {
  RETURN_IF_ERROR(BecomeSubreaper());
  wake_.Reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake_) return ErrnoError("eventfd", errno);
  try {
    thread_ = std::thread([this] { Keep(); });
  } catch (const std::system_error& e) {
    return ResourceExhausted("starting the zygote's thread: " + std::string(e.what()));
  }
  return Status::Ok();
}

void WorkerZygote::Stop() {
  if (stopping_.exchange(true)) return;
  if (wake_) {
    const uint64_t one = 1;
    (void)!::write(wake_.get(), &one, sizeof one);
  }
  {
    std::lock_guard lock(mu_);  // a Fork waiting on cv_ sees stopping_
  }
  cv_.notify_all();
}

WorkerZygote::~WorkerZygote() {
  Stop();
  if (thread_.joinable()) thread_.join();
}

std::string WorkerZygote::off_reason() const {
  std::lock_guard lock(mu_);
  return off_reason_;
}

void WorkerZygote::TurnOff(const std::string& why) {
  {
    std::lock_guard lock(mu_);
    if (state_ == State::kOff) return;
    state_ = State::kOff;
    off_reason_ = why;
  }
  ready_pid_ = 0;
  cv_.notify_all();
  spdlog::warn("{}: its workers are exec'd, not forked from a zygote: {}", model_, why);
}

Result<pid_t> WorkerZygote::Fork(const std::vector<std::string>& args, int control, int slot) {
  {
    std::unique_lock lock(mu_);
    if (!cv_.wait_for(lock, ready_timeout_,
                      [&] { return state_ != State::kStarting || stopping(); }))
      return Unavailable("the zygote was not ready within " +
                         std::to_string(ready_timeout_.count()) + " ms");
    if (stopping()) return Unavailable("the model stops");
    if (state_ == State::kOff) return Unavailable(off_reason_);
  }
  std::lock_guard forking(fork_mu_);
  {
    std::lock_guard lock(mu_);
    if (state_ != State::kReady) return Unavailable("the zygote is being replaced");
  }
  RETURN_IF_ERROR(SendFork(control_.get(), args, control, slot));
  auto reply = Receive(control_.get(), wake_.get(), ready_timeout_);
  if (!reply.ok()) {
    // Hung, or talking nonsense: killed; the keeper sees its end and
    // starts another.
    if (reply.status().code() != StatusCode::kUnavailable) process_.Kill();
    return Unavailable("the zygote did not answer a fork request: " + reply.status().message());
  }
  const std::vector<std::string>& m = *reply;
  if (m[0] == "forked" && m.size() == 2) {
    int64_t pid = 0;
    const auto [end, ec] = std::from_chars(m[1].data(), m[1].data() + m[1].size(), pid);
    if (ec == std::errc() && end == m[1].data() + m[1].size() && pid > 1 && pid <= INT32_MAX) {
      forks_ += 1;
      return static_cast<pid_t>(pid);
    }
  }
  if (m[0] == "refused" && m.size() == 2) {
    TurnOff("the zygote refused to fork a worker: " + Printable(m[1]));
    return Unavailable(off_reason());
  }
  if (m[0] == "error") return Internal("the zygote could not fork a worker: " + Describe(m));
  process_.Kill();
  return Unavailable("the zygote answered a fork request with '" + Printable(m[0]) + "'");
}

bool WorkerZygote::StartOne(bool* fatal, std::string* why) {
  *fatal = false;
  const auto began = Clock::now();
  {
    std::lock_guard forking(fork_mu_);
    control_.Reset();
    if (Status started = start_(process_, &control_); !started.ok()) {
      *why = started.message();
      return false;
    }
  }
  auto first = Receive(control_.get(), wake_.get(), ready_timeout_);
  const pid_t pid = process_.pid();
  auto fail = [&](std::string text) {
    *why = std::move(text);
    std::lock_guard forking(fork_mu_);
    control_.Reset();
    const int status = process_.Reap(!*fatal);
    if (!*fatal && status != 0) *why += " (" + DescribeExit(status) + ")";
    return false;
  };
  if (!first.ok()) {
    if (first.status().code() == StatusCode::kDeadlineExceeded)
      return fail("no ready message within " + std::to_string(ready_timeout_.count()) + " ms");
    return fail(first.status().message());
  }
  const std::vector<std::string>& m = *first;
  if (m[0] == "refused" || m[0] == "failed") {
    *fatal = true;
    return fail(m[0] == "refused" ? "the zygote refused to fork workers: " + Describe(m)
                                  : "the zygote's start failed: " + Describe(m));
  }
  if (m[0] != "ready") return fail("its first message was '" + Printable(m[0]) + "', not ready");
  {
    std::lock_guard lock(mu_);
    state_ = State::kReady;
  }
  ready_pid_ = pid;
  cv_.notify_all();
  spdlog::info("{}: zygote ready: pid {} in {:.0f} ms ({}); its workers are forked from it", model_,
               pid, std::chrono::duration<double, std::milli>(Clock::now() - began).count(),
               PhasesText(m));
  return true;
}

void WorkerZygote::Watch() {
  for (;;) {
    // No POLLIN: answers to fork requests are Fork()'s to read; only the
    // socket's end (POLLHUP, reported whatever is asked) concerns the keeper.
    pollfd fds[2] = {{control_.get(), 0, 0}, {wake_.get(), POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0 && errno == EINTR) continue;
    if (fds[1].revents != 0 || stopping()) return;
    if (fds[0].revents != 0) return;
  }
}

void WorkerZygote::Keep() {
  int failures = 0;
  std::string last;
  while (!stopping()) {
    if (failures >= kMaxFailures) {
      TurnOff("the zygote failed " + std::to_string(failures) +
              " times in a row; the last: " + last);
      break;
    }
    if (failures > 0) {
      // 100 ms doubling, as a worker's restarts.
      pollfd wake{wake_.get(), POLLIN, 0};
      if (::poll(&wake, 1, 100 << std::min(failures - 1, 6)) > 0) break;
    }
    bool fatal = false;
    std::string why;
    if (!StartOne(&fatal, &why)) {
      if (stopping()) break;
      if (fatal) {
        TurnOff(why);
        break;
      }
      ++failures;
      last = why;
      spdlog::warn("{}: a zygote could not start: {}", model_, why);
      continue;
    }
    const auto ready_at = Clock::now();
    Watch();
    if (stopping()) break;
    const pid_t pid = process_.pid();
    {
      std::lock_guard lock(mu_);
      if (state_ == State::kOff) break;  // it refused a fork and left
      state_ = State::kStarting;
    }
    ready_pid_ = 0;
    int status = 0;
    {
      std::lock_guard forking(fork_mu_);
      control_.Reset();
      status = process_.Reap(false);
    }
    restarts_ += 1;
    failures = Clock::now() - ready_at >= kSteadyAfter ? 1 : failures + 1;
    last = "the zygote " + DescribeExit(status);
    spdlog::warn("{}: its zygote (pid {}) {}; starting another", model_, pid, DescribeExit(status));
  }
  {
    std::lock_guard lock(mu_);
    if (state_ != State::kOff) state_ = State::kOff;
    if (off_reason_.empty()) off_reason_ = "the model stops";
  }
  ready_pid_ = 0;
  cv_.notify_all();
  std::lock_guard forking(fork_mu_);
  control_.Reset();
  process_.Reap(true);
}

}  // namespace hearth
