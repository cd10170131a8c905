// The shared-memory session of `hearth bench` (loadgen/bench_common.h) over
// regions of any kind: a fake region in host memory that calls itself a
// CUDA one and a fake control record what the session does with them
// (layout, inputs, poison, registration by handle, checks of answers,
// unregistration before a region is freed, failures at each step); the
// REST control's registration calls as a real HTTP server receives them
// (Triton's CUDA form: the IPC handle in base64); and CudaShmRegion itself,
// which refuses clearly where no GPU is and, on a GPU, round-trips bytes.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "loadgen/bench_common.h"
#include "loadgen/cuda_shm.h"

namespace hearth::bench {
namespace {

constexpr unsigned char kPoison = 0xff;  // bench_common.cc's

// What happened, in order, across the fake regions and the fake control.
struct Log {
  std::mutex mu;
  std::vector<std::string> events;
  void Add(std::string event) {
    std::lock_guard lock(mu);
    events.push_back(std::move(event));
  }
  // Index of `event`, or -1.
  int Find(const std::string& event) {
    std::lock_guard lock(mu);
    const auto it = std::find(events.begin(), events.end(), event);
    return it == events.end() ? -1 : static_cast<int>(it - events.begin());
  }
};

class FakeRegion : public ShmRegion {
 public:
  FakeRegion(std::string name, uint64_t bytes, Log* log)
      : name_(std::move(name)), bytes_(bytes, std::byte{0}), log_(log) {}
  ~FakeRegion() override { log_->Add("free " + name_); }

  uint64_t size() const override { return bytes_.size(); }
  RegionHandle Handle() const override {
    RegionHandle handle;
    handle.kind = BenchSharedMemory::kCuda;
    for (int i = 0; i < 64; ++i) handle.ipc_handle += static_cast<char>(i);
    handle.device_id = 3;
    handle.byte_size = bytes_.size();
    return handle;
  }
  std::string Describe() const override { return "fake " + name_; }
  void Registered() override { log_->Add("registered " + name_); }
  Status Write(uint64_t offset, const void* data, uint64_t bytes) override {
    RETURN_IF_ERROR(CheckRange(offset, bytes, "a write"));
    std::memcpy(bytes_.data() + offset, data, bytes);
    return Status::Ok();
  }
  Status Fill(uint64_t offset, unsigned char value, uint64_t bytes) override {
    if (fail_fill) return Internal("fake fill failure");
    RETURN_IF_ERROR(CheckRange(offset, bytes, "a fill"));
    std::memset(bytes_.data() + offset, value, bytes);
    return Status::Ok();
  }
  Status Read(uint64_t offset, void* out, uint64_t bytes) const override {
    if (fail_read) return Internal("fake read failure");
    RETURN_IF_ERROR(CheckRange(offset, bytes, "a read"));
    std::memcpy(out, bytes_.data() + offset, bytes);
    return Status::Ok();
  }

  std::byte* data() { return bytes_.data(); }
  bool fail_fill = false;
  bool fail_read = false;

 private:
  std::string name_;
  std::vector<std::byte> bytes_;
  Log* log_;
};

class FakeControl : public RegionControl {
 public:
  explicit FakeControl(Log* log) : log_(log) {}
  Status Register(const std::string& name, const RegionHandle& handle) override {
    if (++calls_ == fail_at) return Unimplemented("fake refusal");
    handles.push_back(handle);
    log_->Add("register " + name);
    return Status::Ok();
  }
  Status Unregister(BenchSharedMemory kind, const std::string& name) override {
    log_->Add(std::string("unregister ") +
              (kind == BenchSharedMemory::kCuda ? "cuda " : "system ") + name);
    return Status::Ok();
  }
  int fail_at = 0;  // the n-th Register fails (1-based); 0: none
  std::vector<RegionHandle> handles;

 private:
  Log* log_;
  int calls_ = 0;
};

// x: 16 FP32 (64 bytes) in, y: one FP32 out, as the scale model's.
ModelSpec ScaleModel() {
  ModelSpec model;
  model.label = "model 'scale'";
  TensorSpec x;
  x.name = "x";
  x.datatype = "FP32";
  x.shape = {1, 16};
  x.elements = 16;
  x.bytes = 64;
  model.inputs.push_back(x);
  TensorSpec y;
  y.name = "y";
  y.datatype = "FP32";
  y.shape = {1, 1};
  y.elements = 1;
  y.bytes = 4;
  model.outputs.push_back(y);
  return model;
}

class ShmSessionTest : public ::testing::Test {
 protected:
  ShmSessionTest() : control_(&log_) {
    options_.shared_memory = BenchSharedMemory::kCuda;
    options_.model = "scale";
  }

  RegionFactory Factory(int fail_at = 0) {
    return [this, fail_at](const std::string& name,
                           uint64_t bytes) -> Result<std::unique_ptr<ShmRegion>> {
      if (++made_ == fail_at) return ResourceExhausted("fake out of device memory");
      auto region = std::make_unique<FakeRegion>(name, bytes, &log_);
      regions_.push_back(region.get());
      return std::unique_ptr<ShmRegion>(std::move(region));
    };
  }

  Result<std::unique_ptr<ShmSession>> Create(int slots, int fail_factory_at = 0) {
    return ShmSession::Create(model_, options_, slots, &control_, Factory(fail_factory_at), rng_);
  }

  // Every name the log registered was unregistered (as CUDA) before its
  // region was freed.
  void ExpectUnregisteredBeforeFreed(const std::vector<std::string>& names) {
    for (const std::string& name : names) {
      const int unregistered = log_.Find("unregister cuda " + name);
      const int freed = log_.Find("free " + name);
      ASSERT_GE(unregistered, 0) << name;
      ASSERT_GE(freed, 0) << name;
      EXPECT_LT(unregistered, freed) << name;
    }
  }

  // An answer that says y was written where the request asked (REST's form).
  static std::vector<OutputPlacement> Answer(uint64_t byte_size = 4) {
    OutputPlacement y;
    y.name = "y";
    y.where_asked = true;
    y.byte_size = byte_size;
    return {y};
  }

  static std::vector<std::string> Names(ShmSession& session) {
    std::vector<std::string> names;
    for (size_t i = 0; i < session.size(); ++i) names.push_back(session.slot(i).region);
    return names;
  }

  Log log_;
  FakeControl control_;
  BenchOptions options_;
  ModelSpec model_ = ScaleModel();
  std::mt19937_64 rng_{7};
  int made_ = 0;
  std::vector<FakeRegion*> regions_;  // owned by the session's slots
};

TEST_F(ShmSessionTest, FillsRegistersByHandleAndUnregistersBeforeFreeing) {
  Result<std::unique_ptr<ShmSession>> session = Create(3);
  ASSERT_TRUE(session.ok()) << session.status().ToString();
  ASSERT_EQ((*session)->size(), 3u);
  ASSERT_EQ(control_.handles.size(), 3u);
  ASSERT_EQ(regions_.size(), 3u);
  const std::vector<std::string> names = Names(**session);
  for (size_t i = 0; i < 3; ++i) {
    const ShmSlot& slot = (*session)->slot(i);
    EXPECT_EQ(control_.handles[i].kind, BenchSharedMemory::kCuda);
    EXPECT_EQ(control_.handles[i].ipc_handle.size(), 64u);
    EXPECT_EQ(control_.handles[i].device_id, 3);
    // x at 0 (64 bytes), y's room at the next 64-byte boundary.
    ASSERT_EQ(slot.inputs.size(), 1u);
    ASSERT_EQ(slot.outputs.size(), 1u);
    EXPECT_EQ(slot.inputs[0].offset, 0u);
    EXPECT_EQ(slot.outputs[0].offset, 64u);
    EXPECT_EQ(control_.handles[i].byte_size, 68u);
    // Told it was registered, after the registration.
    EXPECT_LT(log_.Find("register " + slot.region), log_.Find("registered " + slot.region));
    // The inputs are random normal floats, not zeros and not poison; y's room is poison.
    const std::byte* data = regions_[i]->data();
    float x[16];
    std::memcpy(x, data, sizeof(x));
    EXPECT_TRUE(std::any_of(x, x + 16, [](float v) { return v != 0 && std::isfinite(v); }));
    EXPECT_TRUE(
        std::all_of(data + 64, data + 68, [](std::byte b) { return b == std::byte{kPoison}; }));
  }
  EXPECT_NE(names[0], names[1]);
  session->reset();
  ExpectUnregisteredBeforeFreed(names);
}

TEST_F(ShmSessionTest, AnAnswerThatLeftThePoisonFailsAndOneThatWroteIsTheSample) {
  Result<std::unique_ptr<ShmSession>> session = Create(1);
  ASSERT_TRUE(session.ok()) << session.status().ToString();
  ShmSlot& slot = (*session)->slot(0);
  RunRecord record(options_, nullptr);

  (*session)->BeforeRequest(slot);
  Status s = (*session)->AfterResponse(slot, Answer(), &record);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("still hold the poison"), std::string::npos) << s.message();

  const float y = 2.5f;
  std::memcpy(regions_[0]->data() + 64, &y, 4);
  (*session)->BeforeRequest(slot);
  s = (*session)->AfterResponse(slot, Answer(), &record);
  ASSERT_TRUE(s.ok()) << s.ToString();
  BenchReport report;
  record.Summarize({}, {}, &report);
  EXPECT_EQ(report.shm_checked, 1u);
  ASSERT_TRUE(report.shm_sample.has_value());
  ASSERT_EQ(report.shm_sample->inputs.size(), 1u);
  EXPECT_EQ(report.shm_sample->inputs[0].bytes,
            std::string(reinterpret_cast<const char*>(regions_[0]->data()), 64));
  ASSERT_EQ(report.shm_sample->outputs.size(), 1u);
  EXPECT_EQ(report.shm_sample->outputs[0].bytes, std::string(reinterpret_cast<const char*>(&y), 4));

  // Past the first answer, without --verify nothing is poisoned or checked again.
  (*session)->BeforeRequest(slot);
  EXPECT_EQ(std::memcmp(regions_[0]->data() + 64, &y, 4), 0);
  EXPECT_TRUE((*session)->AfterResponse(slot, Answer(), &record).ok());
}

TEST_F(ShmSessionTest, VerifyPoisonsEveryRequestAndItsFailuresAreTheRequestsErrors) {
  options_.verify = true;
  Result<std::unique_ptr<ShmSession>> session = Create(1);
  ASSERT_TRUE(session.ok()) << session.status().ToString();
  ShmSlot& slot = (*session)->slot(0);
  FakeRegion& region = *regions_[0];
  RunRecord record(options_, nullptr);
  const float y = 1.0f;
  std::memcpy(region.data() + 64, &y, 4);
  (*session)->BeforeRequest(slot);
  ASSERT_TRUE((*session)->AfterResponse(slot, Answer(), &record).ok());

  // Poisoned again before the next request: an answer that writes nothing fails.
  (*session)->BeforeRequest(slot);
  EXPECT_TRUE(std::all_of(region.data() + 64, region.data() + 68,
                          [](std::byte b) { return b == std::byte{kPoison}; }));
  EXPECT_FALSE((*session)->AfterResponse(slot, Answer(), &record).ok());

  region.fail_fill = true;
  (*session)->BeforeRequest(slot);
  Status s = (*session)->AfterResponse(slot, Answer(), &record);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("writing the poison"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("fake fill failure"), std::string::npos) << s.message();
  region.fail_fill = false;

  region.fail_read = true;
  (*session)->BeforeRequest(slot);
  std::memcpy(region.data() + 64, &y, 4);
  s = (*session)->AfterResponse(slot, Answer(), &record);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("reading output 'y' back"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("fake read failure"), std::string::npos) << s.message();
}

TEST_F(ShmSessionTest, AnswersElsewhereOrTooLargeOrInlineFail) {
  Result<std::unique_ptr<ShmSession>> session = Create(1);
  ASSERT_TRUE(session.ok()) << session.status().ToString();
  ShmSlot& slot = (*session)->slot(0);
  RunRecord record(options_, nullptr);
  std::vector<OutputPlacement> elsewhere = Answer();
  elsewhere[0].where_asked = false;
  elsewhere[0].in_region = true;
  elsewhere[0].region = "another";
  elsewhere[0].offset = 64;
  Status s = (*session)->AfterResponse(slot, elsewhere, &record);
  EXPECT_NE(s.message().find("names region 'another'"), std::string::npos) << s.message();
  s = (*session)->AfterResponse(slot, Answer(8), &record);
  EXPECT_NE(s.message().find("claims 8 bytes in its room of 4"), std::string::npos) << s.message();
  std::vector<OutputPlacement> inline_answer = Answer();
  inline_answer[0].inline_data = true;
  s = (*session)->AfterResponse(slot, inline_answer, &record);
  EXPECT_NE(s.message().find("came back inline"), std::string::npos) << s.message();
}

TEST_F(ShmSessionTest, ARefusedRegistrationLeavesNothingRegisteredOrAllocated) {
  control_.fail_at = 3;
  Result<std::unique_ptr<ShmSession>> session = Create(4);
  ASSERT_FALSE(session.ok());
  const std::string& message = session.status().message();
  EXPECT_EQ(session.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(message.find("registering shared-memory region"), std::string::npos) << message;
  EXPECT_NE(message.find("slot 3 of 4"), std::string::npos) << message;
  EXPECT_NE(message.find("fake refusal"), std::string::npos) << message;
  ASSERT_EQ(control_.handles.size(), 2u);
  ASSERT_EQ(made_, 3);
  std::vector<std::string> registered;
  for (const std::string& event : log_.events)
    if (event.rfind("register ", 0) == 0) registered.push_back(event.substr(9));
  ASSERT_EQ(registered.size(), 2u);
  ExpectUnregisteredBeforeFreed(registered);
  // The third was made, never registered, and freed; nothing else is alive.
  EXPECT_EQ(std::count_if(log_.events.begin(), log_.events.end(),
                          [](const std::string& e) { return e.rfind("free ", 0) == 0; }),
            3);
  EXPECT_EQ(std::count_if(log_.events.begin(), log_.events.end(),
                          [](const std::string& e) { return e.rfind("unregister ", 0) == 0; }),
            2);
}

TEST_F(ShmSessionTest, ARegionThatCannotBeMadeIsNamed) {
  Result<std::unique_ptr<ShmSession>> session = Create(3, /*fail_factory_at=*/2);
  ASSERT_FALSE(session.ok());
  const std::string& message = session.status().message();
  EXPECT_EQ(session.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(message.find("making shared-memory region"), std::string::npos) << message;
  EXPECT_NE(message.find("slot 2 of 3"), std::string::npos) << message;
  EXPECT_NE(message.find("fake out of device memory"), std::string::npos) << message;
  ASSERT_EQ(control_.handles.size(), 1u);
  EXPECT_GE(log_.Find("unregister cuda " + log_.events.front().substr(9)), 0);
}

// ---- the wire: Triton's CUDA registration over REST -------------------------------

TEST(CudaRegisterBody, IsTritonsForm) {
  RegionHandle handle;
  handle.kind = BenchSharedMemory::kCuda;
  for (int i = 0; i < 64; ++i) handle.ipc_handle += static_cast<char>(i);
  handle.device_id = 1;
  handle.byte_size = 4096;
  const nlohmann::json body = nlohmann::json::parse(CudaRegisterBody(handle));
  // python3 -c "import base64; print(base64.b64encode(bytes(range(64))).decode())"
  EXPECT_EQ(body["raw_handle"]["b64"],
            "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8gISIjJCUmJygpKissLS4vMDEyMzQ1Njc4OTo7PD0+"
            "Pw==");
  EXPECT_EQ(body["device_id"], 1);
  EXPECT_EQ(body["byte_size"], 4096);
  EXPECT_EQ(body.size(), 3u);
  handle.ipc_handle = std::string(
      "\xff\x00"
      "a",
      3);
  EXPECT_EQ(nlohmann::json::parse(CudaRegisterBody(handle))["raw_handle"]["b64"], "/wBh");
  handle.ipc_handle = std::string("\xff\x00", 2);
  EXPECT_EQ(nlohmann::json::parse(CudaRegisterBody(handle))["raw_handle"]["b64"], "/wA=");
}

// An HTTP/1.1 server on loopback that answers each request on its one
// keep-alive connection with the next canned answer, recording the request.
class RecordingServer {
 public:
  struct Request {
    std::string method, path, body;
  };

  explicit RecordingServer(std::vector<std::string> answers) : answers_(std::move(answers)) {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        ::listen(listen_fd_, 4) != 0)
      return;
    socklen_t len = sizeof(addr);
    ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    thread_ = std::thread([this] { Serve(); });
  }
  ~RecordingServer() {
    ::shutdown(listen_fd_, SHUT_RDWR);
    if (thread_.joinable()) thread_.join();
    ::close(listen_fd_);
  }
  int port() const { return port_; }
  std::vector<Request> requests() {
    std::lock_guard lock(mu_);
    return requests_;
  }

 private:
  void Serve() {
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) return;
    std::string in;
    char buffer[4096];
    for (const std::string& answer : answers_) {
      size_t head_end;
      while ((head_end = in.find("\r\n\r\n")) == std::string::npos) {
        const ssize_t n = ::recv(fd, buffer, sizeof(buffer), 0);
        if (n <= 0) return (void)::close(fd);
        in.append(buffer, static_cast<size_t>(n));
      }
      const std::string head = in.substr(0, head_end);
      size_t length = 0;
      std::string lower = head;
      std::transform(lower.begin(), lower.end(), lower.begin(), ::tolower);
      if (const size_t at = lower.find("content-length:"); at != std::string::npos)
        length = std::stoul(head.substr(at + 15));
      while (in.size() < head_end + 4 + length) {
        const ssize_t n = ::recv(fd, buffer, sizeof(buffer), 0);
        if (n <= 0) return (void)::close(fd);
        in.append(buffer, static_cast<size_t>(n));
      }
      Request request;
      const size_t space = head.find(' ');
      request.method = head.substr(0, space);
      request.path = head.substr(space + 1, head.find(' ', space + 1) - space - 1);
      request.body = in.substr(head_end + 4, length);
      in.erase(0, head_end + 4 + length);
      {
        std::lock_guard lock(mu_);
        requests_.push_back(std::move(request));
      }
      ::send(fd, answer.data(), answer.size(), MSG_NOSIGNAL);
    }
    ::close(fd);
  }

  std::vector<std::string> answers_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::thread thread_;
  std::mutex mu_;
  std::vector<Request> requests_;
};

std::string HttpAnswer(int status, const std::string& body) {
  return "HTTP/1.1 " + std::to_string(status) + " X\r\nContent-Type: application/json\r\n" +
         "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
}

TEST(RestRegionControl, SendsTritonsRegistrationCallsForEachKind) {
  RecordingServer server({HttpAnswer(200, ""), HttpAnswer(200, ""), HttpAnswer(200, ""),
                          HttpAnswer(501, R"({"error":"no CUDA shared memory here"})")});
  ASSERT_NE(server.port(), 0);
  BenchOptions options;
  options.url = "http://127.0.0.1:" + std::to_string(server.port());
  Result<std::unique_ptr<RegionControl>> control = MakeRegionControl(options);
  ASSERT_TRUE(control.ok()) << control.status().ToString();

  RegionHandle cuda;
  cuda.kind = BenchSharedMemory::kCuda;
  cuda.ipc_handle = std::string(64, '\x07');
  cuda.device_id = 2;
  cuda.byte_size = 4160;
  RegionHandle system;
  system.key = "/hearth-bench-x";
  system.byte_size = 128;
  ASSERT_TRUE((*control)->Register("slot-a", cuda).ok());
  ASSERT_TRUE((*control)->Unregister(BenchSharedMemory::kCuda, "slot-a").ok());
  ASSERT_TRUE((*control)->Register("slot-b", system).ok());
  const Status refused = (*control)->Register("slot-c", cuda);
  EXPECT_EQ(refused.code(), StatusCode::kUnimplemented);
  EXPECT_NE(refused.message().find("HTTP 501: no CUDA shared memory here"), std::string::npos)
      << refused.message();

  const std::vector<RecordingServer::Request> requests = server.requests();
  ASSERT_EQ(requests.size(), 4u);
  EXPECT_EQ(requests[0].method, "POST");
  EXPECT_EQ(requests[0].path, "/v2/cudasharedmemory/region/slot-a/register");
  const nlohmann::json body = nlohmann::json::parse(requests[0].body);
  // python3 -c "import base64; print(base64.b64encode(b'\x07' * 64).decode())"
  std::string sevens;
  for (int i = 0; i < 21; ++i) sevens += "BwcH";
  EXPECT_EQ(body["raw_handle"]["b64"], sevens + "Bw==");
  EXPECT_EQ(body["device_id"], 2);
  EXPECT_EQ(body["byte_size"], 4160);
  EXPECT_EQ(requests[1].method, "POST");
  EXPECT_EQ(requests[1].path, "/v2/cudasharedmemory/region/slot-a/unregister");
  EXPECT_EQ(requests[2].path, "/v2/systemsharedmemory/region/slot-b/register");
  const nlohmann::json system_body = nlohmann::json::parse(requests[2].body);
  EXPECT_EQ(system_body["key"], "/hearth-bench-x");
  EXPECT_EQ(system_body["offset"], 0);
  EXPECT_EQ(system_body["byte_size"], 128);
}

// ---- CudaShmRegion ----------------------------------------------------------------

TEST(CudaShmRegion, WithoutAGpuEveryWayInSaysWhy) {
  const Status usable = CudaShmUsable(0);
  if (usable.ok()) GTEST_SKIP() << "a GPU is here (see RoundTripsOnAGpu)";
  // The build, the driver or its stub, said in words.
  EXPECT_TRUE(usable.code() == StatusCode::kUnimplemented ||
              usable.code() == StatusCode::kUnavailable)
      << usable.ToString();
  EXPECT_TRUE(usable.message().find("built without CUDA") != std::string::npos ||
              usable.message().find("libcuda.so.1") != std::string::npos ||
              usable.message().find("cuInit") != std::string::npos)
      << usable.message();
  Result<std::unique_ptr<CudaShmRegion>> region = CudaShmRegion::Create(0, 64);
  ASSERT_FALSE(region.ok());
  EXPECT_EQ(region.status().code(), usable.code());
  BenchOptions options;
  options.shared_memory = BenchSharedMemory::kCuda;
  Result<std::unique_ptr<ShmRegion>> made = DefaultRegionFactory(options)("r", 64);
  ASSERT_FALSE(made.ok());
  EXPECT_EQ(made.status().message(), usable.message());
}

TEST(CudaShmRegion, RoundTripsOnAGpu) {
  if (Status usable = CudaShmUsable(0); !usable.ok()) GTEST_SKIP() << usable.ToString();
  Result<std::unique_ptr<CudaShmRegion>> region = CudaShmRegion::Create(0, 1 << 21);
  ASSERT_TRUE(region.ok()) << region.status().ToString();
  CudaShmRegion& r = **region;
  const RegionHandle handle = r.Handle();
  EXPECT_EQ(handle.kind, BenchSharedMemory::kCuda);
  EXPECT_EQ(handle.ipc_handle.size(), 64u);
  EXPECT_NE(handle.ipc_handle, std::string(64, '\0'));
  EXPECT_EQ(handle.byte_size, uint64_t{1} << 21);
  std::string bytes(1000, '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i * 7);
  ASSERT_TRUE(r.Write(4096, bytes.data(), bytes.size()).ok());
  // A fill longer than the host chunk it is copied from (1 MiB).
  ASSERT_TRUE(r.Fill(8192, 0xab, (1 << 21) - 8192).ok());
  std::string back(bytes.size(), '\0');
  ASSERT_TRUE(r.Read(4096, back.data(), back.size()).ok());
  EXPECT_EQ(back, bytes);
  std::string filled((1 << 21) - 8192, '\0');
  ASSERT_TRUE(r.Read(8192, filled.data(), filled.size()).ok());
  EXPECT_EQ(filled, std::string(filled.size(), '\xab'));
  const Status outside = r.Write((1 << 21) - 4, bytes.data(), 8);
  EXPECT_EQ(outside.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(outside.message().find("outside"), std::string::npos) << outside.message();
  const Status no_device = CudaShmUsable(4096);
  EXPECT_EQ(no_device.code(), StatusCode::kInvalidArgument) << no_device.ToString();
}

}  // namespace
}  // namespace hearth::bench
