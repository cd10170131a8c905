// `hearth bench`'s core against a real `hearth serve` on a real socket: a
// one-model repository (scale, 16 floats in, one out, batches up to 4), the
// server (REST and, when built with it, gRPC) started once per suite and
// stopped with SIGTERM. Shared-memory runs check the model's answers in
// the region against the checkpoint's weights, that no object of the run is
// left in /dev/shm and no region left registered. CUDA shared memory: where
// no GPU is (no driver, the toolkit's stub libcuda, a build without CUDA) a
// run fails before it asks the server anything, saying why; the
// registration calls reach the server's CUDA routes; on a GPU, a run's
// answers are checked in device memory.
#include "loadgen/load_generator.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "loadgen/bench_common.h"
#include "loadgen/cuda_shm.h"
#include "support/eventually.h"

extern char** environ;

namespace hearth {
namespace {

namespace fs = std::filesystem;

std::string ReadFile(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// Runs a command, returns its exit status and (via `out`) its stdout.
int RunCommand(const std::string& command, std::string* out = nullptr) {
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return -1;
  char buffer[4096];
  size_t n;
  std::string text;
  while ((n = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0) text.append(buffer, n);
  const int status = ::pclose(pipe);
  if (out != nullptr) *out = text;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// The names in /dev/shm that a run of process `pid` would make
// (bench_common.cc: RunTag).
std::vector<std::string> BenchObjectsOf(pid_t pid) {
  std::vector<std::string> names;
  const std::string prefix = "hearth-bench-" + std::to_string(pid) + "-";
  for (const auto& entry : fs::directory_iterator("/dev/shm")) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(prefix, 0) == 0) names.push_back(name);
  }
  return names;
}

// One HTTP/1.1 exchange on a connection of its own; returns the status and
// (via `body`) the body. -1 when the server could not be reached.
int HttpExchange(int port, const std::string& method, const std::string& path,
                 const std::string& request_body, std::string* body = nullptr) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return -1;
  }
  const std::string request = method + " " + path +
                              " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                              "Content-Type: application/json\r\nContent-Length: " +
                              std::to_string(request_body.size()) + "\r\n\r\n" + request_body;
  for (size_t sent = 0; sent < request.size();) {
    const ssize_t n = ::send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) {
      ::close(fd);
      return -1;
    }
    sent += static_cast<size_t>(n);
  }
  std::string response;
  char buffer[4096];
  ssize_t n;
  while ((n = ::recv(fd, buffer, sizeof(buffer), 0)) > 0) response.append(buffer, n);
  ::close(fd);
  const size_t head_end = response.find("\r\n\r\n");
  if (response.rfind("HTTP/1.1 ", 0) != 0 || head_end == std::string::npos) return -1;
  if (body != nullptr) *body = response.substr(head_end + 4);
  return std::stoi(response.substr(9, 3));
}

// The scale model's weight vector, read from its safetensors file.
std::vector<float> ReadScaleWeights(const fs::path& path) {
  const std::string file = ReadFile(path);
  uint64_t header_length = 0;
  std::memcpy(&header_length, file.data(), 8);
  const nlohmann::json header = nlohmann::json::parse(file.substr(8, header_length));
  const auto offsets = header.at("weight").at("data_offsets").get<std::vector<size_t>>();
  std::vector<float> weights((offsets[1] - offsets[0]) / 4);
  std::memcpy(weights.data(), file.data() + 8 + header_length + offsets[0],
              offsets[1] - offsets[0]);
  return weights;
}

class BenchTest : public ::testing::Test {
 protected:
  // Where a CUDA driver works, the server and its model are on GPU 0, so
  // that CUDA shared memory runs for real; elsewhere on the host.
  static bool OnGpu() { return bench::CudaShmUsable(0).ok(); }

  static void SetUpTestSuite() {
    dir_ = new fs::path(fs::temp_directory_path() /
                        ("hearth-bench-test-" + std::to_string(::getpid())));
    fs::create_directories(*dir_ / "repo" / "scale" / "1");
    const std::string cli = HEARTH_CLI_PATH;
    ASSERT_EQ(RunCommand(cli + " make-model scale --dims 16 --out " +
                         (*dir_ / "repo" / "scale" / "1" / "model.safetensors").string() +
                         " >/dev/null 2>&1"),
              0);
    std::ofstream(*dir_ / "repo" / "scale" / "config.yaml") << R"(backend: scale
max_batch_size: 4
input:
  - {name: x, data_type: TYPE_FP32, dims: [16]}
output:
  - {name: y, data_type: TYPE_FP32, dims: [1]}
instance_group:
  - {count: 1, kind: )" << (OnGpu() ? "KIND_GPU" : "KIND_CPU")
                                                            << R"(}
)";
    const std::string log = (*dir_ / "serve.log").string();
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, 1, 2);
    const std::string repo = (*dir_ / "repo").string();
    std::vector<std::string> args = {
        cli,           "serve", "--model-repository", repo,
        "--http-port", "0",     "--device",           OnGpu() ? "cuda:0" : "cpu"};
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ASSERT_EQ(posix_spawn(&server_pid_, cli.c_str(), &actions, nullptr, argv.data(), environ), 0);
    posix_spawn_file_actions_destroy(&actions);
    const std::regex ready(R"(ready on http://127\.0\.0\.1:(\d+))");
    for (int i = 0; i < 600 && port_ == 0; ++i) {
      std::smatch match;
      const std::string text = ReadFile(log);
      if (std::regex_search(text, match, ready))
        port_ = std::stoi(match[1]);
      else
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      ASSERT_EQ(::waitpid(server_pid_, nullptr, WNOHANG), 0) << "hearth serve exited:\n" << text;
    }
    ASSERT_NE(port_, 0) << "hearth serve never became ready:\n" << ReadFile(log);
    // Logged before "ready on", when it serves gRPC at all.
    std::smatch match;
    const std::string text = ReadFile(log);
    if (std::regex_search(text, match, std::regex(R"(KServe v2 gRPC on 127\.0\.0\.1:(\d+))")))
      grpc_port_ = std::stoi(match[1]);
    weights_ = new std::vector<float>(
        ReadScaleWeights(*dir_ / "repo" / "scale" / "1" / "model.safetensors"));
  }

  static void TearDownTestSuite() {
    delete weights_;
    weights_ = nullptr;
    if (server_pid_ > 0) {
      ::kill(server_pid_, SIGTERM);
      int status = 0;
      ::waitpid(server_pid_, &status, 0);
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << ReadFile(*dir_ / "serve.log");
    }
    std::error_code ignored;
    fs::remove_all(*dir_, ignored);
    delete dir_;
  }

  void SetUp() override {
    if (port_ == 0) GTEST_SKIP() << "no server";
  }

  static std::string Url() { return "http://127.0.0.1:" + std::to_string(port_); }

  static BenchOptions Options() {
    BenchOptions options;
    options.url = Url();
    options.model = "scale";
    options.seconds = 1;
    options.warmup = 0.2;
    return options;
  }

  static void ExpectHealthy(const BenchReport& report) {
    EXPECT_GT(report.requests, 0u);
    EXPECT_EQ(report.errors, 0u) << (report.first_errors.empty() ? ""
                                                                 : report.first_errors.front());
    EXPECT_LE(report.latency_ms.p50, report.latency_ms.p90);
    EXPECT_LE(report.latency_ms.p90, report.latency_ms.p99);
    EXPECT_LE(report.latency_ms.p99, report.latency_ms.max);
    EXPECT_GT(report.latency_ms.mean, 0);
    EXPECT_LE(report.latency_ms.mean, report.latency_ms.max);
    EXPECT_DOUBLE_EQ(report.inferences_per_s, report.requests_per_s * report.batch);
  }

  static inline fs::path* dir_ = nullptr;
  static inline pid_t server_pid_ = 0;
  static inline int port_ = 0;
  static inline int grpc_port_ = 0;
  static inline std::vector<float>* weights_ = nullptr;

  static std::string GrpcUrl() { return "127.0.0.1:" + std::to_string(grpc_port_); }
  void SkipWithoutGrpc() {
    if (!BenchHasGrpc()) GTEST_SKIP() << "this hearth was built without gRPC";
    if (grpc_port_ == 0) GTEST_SKIP() << "the server serves no gRPC";
  }

  // The regions the server has registered now.
  static nlohmann::json Regions() {
    std::string body;
    EXPECT_EQ(HttpExchange(port_, "GET", "/v2/systemsharedmemory/status", "", &body), 200) << body;
    return nlohmann::json::parse(body);
  }

  static nlohmann::json CudaRegions() {
    std::string body;
    EXPECT_EQ(HttpExchange(port_, "GET", "/v2/cudasharedmemory/status", "", &body), 200) << body;
    return nlohmann::json::parse(body);
  }

  // A shared-memory run's sample: y[b] = x[b] . w for every row of the batch.
  static void ExpectScaleAnswers(const BenchReport& report) {
    ASSERT_TRUE(report.shm_sample.has_value());
    const BenchShmSample& sample = *report.shm_sample;
    ASSERT_EQ(sample.inputs.size(), 1u);
    ASSERT_EQ(sample.outputs.size(), 1u);
    EXPECT_EQ(sample.inputs[0].name, "x");
    EXPECT_EQ(sample.outputs[0].name, "y");
    const size_t n = weights_->size();
    const size_t rows = static_cast<size_t>(report.batch);
    ASSERT_EQ(sample.inputs[0].bytes.size(), rows * n * 4);
    ASSERT_EQ(sample.outputs[0].bytes.size(), rows * 4);
    for (size_t b = 0; b < rows; ++b) {
      double expected = 0;
      for (size_t i = 0; i < n; ++i) {
        float x;
        std::memcpy(&x, sample.inputs[0].bytes.data() + (b * n + i) * 4, 4);
        expected += static_cast<double>(x) * (*weights_)[i];
      }
      float y;
      std::memcpy(&y, sample.outputs[0].bytes.data() + b * 4, 4);
      EXPECT_NEAR(y, expected, 1e-4 * (1 + std::fabs(expected))) << "row " << b;
    }
  }

  // Nothing of a shared-memory run is left: no object, no region.
  static void ExpectNothingLeft(pid_t pid) {
    EXPECT_EQ(BenchObjectsOf(pid), std::vector<std::string>());
    EXPECT_EQ(Regions(), nlohmann::json::array());
    EXPECT_EQ(CudaRegions(), nlohmann::json::array());
  }

  static std::vector<BenchTransport> Transports() {
    std::vector<BenchTransport> transports = {BenchTransport::kRest};
    if (BenchHasGrpc() && grpc_port_ != 0) transports.push_back(BenchTransport::kGrpc);
    return transports;
  }
  static void UseTransport(BenchTransport transport, BenchOptions& options) {
    options.transport = transport;
    if (transport == BenchTransport::kGrpc) options.url = GrpcUrl();
  }
};

TEST_F(BenchTest, ClosedLoopBinary) {
  BenchOptions options = Options();
  options.concurrency = 2;
  Result<BenchReport> report = RunBench(options, nullptr);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  ExpectHealthy(*report);
  EXPECT_EQ(report->mode, "concurrency");
  EXPECT_EQ(report->concurrency, 2);
  EXPECT_EQ(report->protocol, "binary");
}

TEST_F(BenchTest, ClosedLoopJsonBatchedWithOutput) {
  BenchOptions options = Options();
  options.concurrency = 2;
  options.protocol = BenchProtocol::kJson;
  options.batch = 4;
  options.outputs = {"y"};
  Result<BenchReport> report = RunBench(options, nullptr);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  ExpectHealthy(*report);
  EXPECT_EQ(report->protocol, "json");
  EXPECT_DOUBLE_EQ(report->inferences_per_s, 4 * report->requests_per_s);
}

TEST_F(BenchTest, RequestRateConstantBinaryAndJson) {
  for (BenchProtocol protocol : {BenchProtocol::kBinary, BenchProtocol::kJson}) {
    BenchOptions options = Options();
    options.request_rate = 50;
    options.arrival = BenchArrival::kConstant;
    options.protocol = protocol;
    Result<BenchReport> report = RunBench(options, nullptr);
    ASSERT_TRUE(report.ok()) << report.status().ToString();
    ExpectHealthy(*report);
    EXPECT_EQ(report->mode, "request_rate");
    // Loose on purpose (not a timing test): unthrottled, this server takes thousands per second.
    EXPECT_NEAR(report->requests_per_s, 50, 25) << report->protocol;
    EXPECT_GE(report->concurrency, 1);
  }
}

TEST_F(BenchTest, RequestRatePoisson) {
  BenchOptions options = Options();
  options.request_rate = 50;
  options.seconds = 2;
  Result<BenchReport> report = RunBench(options, nullptr);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  ExpectHealthy(*report);
  EXPECT_EQ(report->arrival, "poisson");
  EXPECT_NEAR(report->requests_per_s, 50, 25);
}

TEST_F(BenchTest, FailedRequestsAreCountedAndKept) {
  BenchOptions options = Options();
  options.seconds = 0.3;
  options.warmup = 0;
  options.outputs = {"no_such_output"};
  Result<BenchReport> report = RunBench(options, nullptr);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_EQ(report->requests, 0u);
  EXPECT_GT(report->errors, 0u);
  ASSERT_EQ(report->first_errors.size(), 3u);
  EXPECT_NE(report->first_errors[0].find("HTTP 400"), std::string::npos) << report->first_errors[0];
  EXPECT_NE(report->first_errors[0].find("no_such_output"), std::string::npos)
      << report->first_errors[0];
}

TEST_F(BenchTest, UnknownModelIsNamed) {
  BenchOptions options = Options();
  options.model = "no_such_model";
  Result<BenchReport> report = RunBench(options, nullptr);
  ASSERT_FALSE(report.ok());
  EXPECT_EQ(report.status().code(), StatusCode::kNotFound);
  EXPECT_NE(report.status().message().find("no_such_model"), std::string::npos)
      << report.status().message();
}

TEST_F(BenchTest, BatchAboveMaxBatchSizeIsRefused) {
  BenchOptions options = Options();
  options.batch = 5;
  Result<BenchReport> report = RunBench(options, nullptr);
  ASSERT_FALSE(report.ok());
  EXPECT_NE(report.status().message().find("max_batch_size 4"), std::string::npos)
      << report.status().message();
}

TEST_F(BenchTest, ClosedPortIsNamed) {
  // A port that was free a moment ago: bound, read back, closed.
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const int port = ntohs(addr.sin_port);
  ::close(fd);
  BenchOptions options = Options();
  options.url = "http://127.0.0.1:" + std::to_string(port);
  Result<BenchReport> report = RunBench(options, nullptr);
  ASSERT_FALSE(report.ok());
  EXPECT_EQ(report.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(report.status().message().find("127.0.0.1:" + std::to_string(port)), std::string::npos)
      << report.status().message();
}

TEST_F(BenchTest, BadUrlsAreRefused) {
  for (const char* url :
       {"ftp://127.0.0.1:1", "https://127.0.0.1:1", "http://127.0.0.1:0", "http://127.0.0.1:x",
        "http://127.0.0.1:8000/v2", "127.0.0.1:8000", "http://:80"}) {
    BenchOptions options = Options();
    options.url = url;
    Result<BenchReport> report = RunBench(options, nullptr);
    ASSERT_FALSE(report.ok()) << url;
    EXPECT_EQ(report.status().code(), StatusCode::kInvalidArgument) << url;
    EXPECT_NE(report.status().message().find(url), std::string::npos) << report.status().message();
  }
}

TEST_F(BenchTest, CliPrintsOneJsonObject) {
  std::string out;
  const int rc =
      RunCommand(std::string(HEARTH_CLI_PATH) + " bench --url " + Url() +
                     " --model scale --concurrency 2 --batch 2 --seconds 0.5 --warmup 0.1 --json",
                 &out);
  ASSERT_EQ(rc, 0) << out;
  const nlohmann::json report = nlohmann::json::parse(out);
  EXPECT_EQ(report["model"], "scale");
  EXPECT_EQ(report["mode"], "concurrency");
  EXPECT_EQ(report["batch"], 2);
  EXPECT_GT(report["requests"].get<uint64_t>(), 0u);
  EXPECT_EQ(report["errors"], 0);
  EXPECT_LE(report["latency_ms"]["p50"].get<double>(), report["latency_ms"]["max"].get<double>());
}

TEST_F(BenchTest, CliFailsOnUnknownModel) {
  std::string out;
  const int rc = RunCommand(std::string(HEARTH_CLI_PATH) + " bench --url " + Url() +
                                " --model nope --seconds 0.2 --warmup 0 2>&1",
                            &out);
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("'nope'"), std::string::npos) << out;
}

// ---- system shared memory and gRPC ----------------------------------------------

TEST_F(BenchTest, SharedMemoryRestAnswersAreInTheRegion) {
  BenchOptions options = Options();
  options.concurrency = 4;
  options.batch = 3;
  options.shared_memory = BenchSharedMemory::kSystem;
  options.verify = true;
  Result<BenchReport> report = RunBench(options, nullptr);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  ExpectHealthy(*report);
  EXPECT_EQ(report->transport, "rest");
  EXPECT_EQ(report->shared_memory, "system");
  // --verify: every answer (warm-up ones too) was checked in its region.
  EXPECT_GE(report->shm_checked, report->requests);
  ExpectScaleAnswers(*report);
  ExpectNothingLeft(::getpid());
}

TEST_F(BenchTest, SharedMemoryRestOpenLoopWithOutputRoom) {
  BenchOptions options = Options();
  options.request_rate = 50;
  options.arrival = BenchArrival::kConstant;
  options.max_connections = 8;
  options.shared_memory = BenchSharedMemory::kSystem;
  options.output_shared_memory_size = 64;  // more than the 4 bytes of y
  Result<BenchReport> report = RunBench(options, nullptr);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  ExpectHealthy(*report);
  EXPECT_GE(report->shm_checked, 1u);  // each used slot's first answer
  ExpectScaleAnswers(*report);
  ExpectNothingLeft(::getpid());
}

TEST_F(BenchTest, SharedMemoryOutputRoomTooSmallIsTheServersError) {
  for (BenchTransport transport : {BenchTransport::kRest, BenchTransport::kGrpc}) {
    if (transport == BenchTransport::kGrpc && (!BenchHasGrpc() || grpc_port_ == 0)) continue;
    BenchOptions options = Options();
    options.transport = transport;
    if (transport == BenchTransport::kGrpc) options.url = GrpcUrl();
    options.seconds = 0.3;
    options.warmup = 0;
    options.shared_memory = BenchSharedMemory::kSystem;
    options.output_shared_memory_size = 2;
    Result<BenchReport> report = RunBench(options, nullptr);
    ASSERT_TRUE(report.ok()) << report.status().ToString();
    EXPECT_EQ(report->requests, 0u);
    EXPECT_GT(report->errors, 0u);
    ASSERT_FALSE(report->first_errors.empty());
    EXPECT_NE(report->first_errors[0].find("do not fit in the 2 bytes"), std::string::npos)
        << report->first_errors[0];
    ExpectNothingLeft(::getpid());
  }
}

TEST_F(BenchTest, RegionTheServerRefusesIsNamedAndNothingIsLeft) {
  // Fill the server's region table (kept to a limit) with regions of the
  // test's own object, then free two: the bench's third slot is refused.
  const std::string key = "/hearth-bench-test-" + std::to_string(::getpid());
  const int fd = ::shm_open(key.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  ASSERT_EQ(::ftruncate(fd, 4096), 0);
  ::close(fd);
  const std::string body = R"({"key":")" + key + R"(","offset":0,"byte_size":64})";
  std::vector<std::string> mine;
  for (int i = 0; i < 5000; ++i) {
    const std::string name = "test-fill-" + std::to_string(i);
    const int status =
        HttpExchange(port_, "POST", "/v2/systemsharedmemory/region/" + name + "/register", body);
    if (status != 200) break;
    mine.push_back(name);
  }
  ::shm_unlink(key.c_str());
  ASSERT_GE(mine.size(), 2u);
  ASSERT_LT(mine.size(), 5000u) << "the server registers regions without a limit";
  for (int i = 0; i < 2; ++i) {
    ASSERT_EQ(HttpExchange(port_, "POST",
                           "/v2/systemsharedmemory/region/" + mine.back() + "/unregister", ""),
              200);
    mine.pop_back();
  }
  for (BenchTransport transport : {BenchTransport::kRest, BenchTransport::kGrpc}) {
    if (transport == BenchTransport::kGrpc && (!BenchHasGrpc() || grpc_port_ == 0)) continue;
    BenchOptions options = Options();
    options.transport = transport;
    if (transport == BenchTransport::kGrpc) options.url = GrpcUrl();
    options.concurrency = 4;
    options.shared_memory = BenchSharedMemory::kSystem;
    Result<BenchReport> report = RunBench(options, nullptr);
    ASSERT_FALSE(report.ok());
    const std::string& message = report.status().message();
    EXPECT_NE(message.find("registering shared-memory region"), std::string::npos) << message;
    EXPECT_NE(message.find("slot 3 of 4"), std::string::npos) << message;
    EXPECT_NE(message.find("regions are registered"), std::string::npos) << message;
    EXPECT_EQ(BenchObjectsOf(::getpid()), std::vector<std::string>());
    EXPECT_EQ(Regions().size(), mine.size()) << "the bench left regions registered";
  }
  for (const std::string& name : mine)
    HttpExchange(port_, "POST", "/v2/systemsharedmemory/region/" + name + "/unregister", "");
  EXPECT_EQ(Regions(), nlohmann::json::array());
}

TEST_F(BenchTest, GrpcClosedAndOpenLoop) {
  SkipWithoutGrpc();
  if (IsSkipped()) return;
  BenchOptions options = Options();
  options.transport = BenchTransport::kGrpc;
  options.url = "grpc://" + GrpcUrl();
  options.concurrency = 3;
  options.batch = 2;
  Result<BenchReport> report = RunBench(options, nullptr);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  ExpectHealthy(*report);
  EXPECT_EQ(report->transport, "grpc");
  EXPECT_EQ(report->protocol, "protobuf");
  EXPECT_EQ(report->shared_memory, "none");
  EXPECT_FALSE(report->shm_sample.has_value());

  options.request_rate = 50;
  options.arrival = BenchArrival::kConstant;
  options.max_connections = 8;
  report = RunBench(options, nullptr);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  ExpectHealthy(*report);
  EXPECT_EQ(report->mode, "request_rate");
  EXPECT_NEAR(report->requests_per_s, 50, 25);
  EXPECT_LE(report->concurrency, 8);
}

TEST_F(BenchTest, SharedMemoryGrpcAnswersAreInTheRegion) {
  SkipWithoutGrpc();
  if (IsSkipped()) return;
  for (bool open_loop : {false, true}) {
    BenchOptions options = Options();
    options.transport = BenchTransport::kGrpc;
    options.url = GrpcUrl();
    options.concurrency = 4;
    options.batch = 4;
    if (open_loop) {
      options.request_rate = 50;
      options.max_connections = 8;
    }
    options.shared_memory = BenchSharedMemory::kSystem;
    options.verify = true;
    Result<BenchReport> report = RunBench(options, nullptr);
    ASSERT_TRUE(report.ok()) << report.status().ToString();
    ExpectHealthy(*report);
    EXPECT_EQ(report->transport, "grpc");
    EXPECT_EQ(report->shared_memory, "system");
    EXPECT_GE(report->shm_checked, report->requests);
    ExpectScaleAnswers(*report);
    ExpectNothingLeft(::getpid());
  }
}

TEST_F(BenchTest, GrpcErrorsAreClear) {
  if (!BenchHasGrpc()) {
    BenchOptions options = Options();
    options.transport = BenchTransport::kGrpc;
    options.url = "127.0.0.1:1";
    Result<BenchReport> report = RunBench(options, nullptr);
    ASSERT_FALSE(report.ok());
    EXPECT_EQ(report.status().code(), StatusCode::kUnimplemented);
    EXPECT_NE(report.status().message().find("built without gRPC"), std::string::npos)
        << report.status().message();
    return;
  }
  // The REST port speaks no gRPC, as a server without gRPC would not.
  BenchOptions options = Options();
  options.transport = BenchTransport::kGrpc;
  options.url = "127.0.0.1:" + std::to_string(port_);
  options.timeout_seconds = 5;
  Result<BenchReport> report = RunBench(options, nullptr);
  ASSERT_FALSE(report.ok());
  EXPECT_EQ(report.status().code(), StatusCode::kUnavailable) << report.status().ToString();
  EXPECT_NE(report.status().message().find(options.url), std::string::npos)
      << report.status().message();
  EXPECT_NE(report.status().message().find("--grpc-port"), std::string::npos)
      << report.status().message();
  for (const char* url :
       {"http://127.0.0.1:8001", "127.0.0.1", "grpc://127.0.0.1:0", "127.0.0.1:8001/v2"}) {
    options.url = url;
    report = RunBench(options, nullptr);
    ASSERT_FALSE(report.ok()) << url;
    EXPECT_EQ(report.status().code(), StatusCode::kInvalidArgument) << url;
    EXPECT_NE(report.status().message().find(url), std::string::npos) << report.status().message();
  }
  if (grpc_port_ != 0) {
    options.url = GrpcUrl();
    options.model = "no_such_model";
    report = RunBench(options, nullptr);
    ASSERT_FALSE(report.ok());
    EXPECT_EQ(report.status().code(), StatusCode::kNotFound) << report.status().ToString();
    EXPECT_NE(report.status().message().find("no_such_model"), std::string::npos);
  }
}

TEST_F(BenchTest, CliSharedMemoryJsonNamesTransportAndMode) {
  std::vector<std::string> transports = {"rest"};
  if (BenchHasGrpc() && grpc_port_ != 0) transports.push_back("grpc");
  for (const std::string& transport : transports) {
    std::string out;
    const std::string url = transport == "grpc" ? GrpcUrl() : Url();
    const int rc = RunCommand(std::string(HEARTH_CLI_PATH) + " bench --url " + url +
                                  " --transport " + transport +
                                  " --shared-memory system --model scale --concurrency 2 "
                                  "--seconds 0.5 --warmup 0.1 --verify --json",
                              &out);
    ASSERT_EQ(rc, 0) << out;
    const nlohmann::json report = nlohmann::json::parse(out);
    EXPECT_EQ(report["transport"], transport);
    EXPECT_EQ(report["shared_memory"], "system");
    EXPECT_EQ(report["errors"], 0);
    EXPECT_GT(report["shm_checked"].get<uint64_t>(), 0u);
  }
  EXPECT_EQ(Regions(), nlohmann::json::array());
}

TEST_F(BenchTest, CliKilledBySignalLeavesNoObject) {
  const std::string cli = HEARTH_CLI_PATH;
  std::vector<std::string> args = {
      cli, "bench",           "--url",  Url(),       "--model", "scale", "--concurrency",
      "2", "--shared-memory", "system", "--seconds", "120"};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addopen(&actions, 2, "/dev/null", O_WRONLY, 0);
  pid_t pid = 0;
  ASSERT_EQ(posix_spawn(&pid, cli.c_str(), &actions, nullptr, argv.data(), environ), 0);
  posix_spawn_file_actions_destroy(&actions);
  // Running: both slots registered (then their objects' names are gone).
  EXPECT_TRUE(Eventually([] { return Regions().size() == 2; }, std::chrono::seconds(30)))
      << Regions().dump();
  ASSERT_EQ(::kill(pid, SIGTERM), 0);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM) << status;
  EXPECT_EQ(BenchObjectsOf(pid), std::vector<std::string>());
  // A killed bench cannot unregister: the server keeps the regions (and
  // their memory) until told otherwise.
  for (const nlohmann::json& region : Regions())
    HttpExchange(
        port_, "POST",
        "/v2/systemsharedmemory/region/" + region["name"].get<std::string>() + "/unregister", "");
  EXPECT_EQ(Regions(), nlohmann::json::array());
}

// ---- CUDA shared memory ---------------------------------------------------------

TEST_F(BenchTest, CudaSharedMemoryWithoutAGpuFailsBeforeAskingTheServer) {
  const Status usable = bench::CudaShmUsable(0);
  if (usable.ok()) GTEST_SKIP() << "a GPU is here (see CudaSharedMemoryAnswersAreInTheRegion)";
  for (BenchTransport transport : Transports()) {
    for (bool server : {true, false}) {
      BenchOptions options = Options();
      UseTransport(transport, options);
      // Nothing listens on port 1: a run that tried to reach it would say so instead.
      if (!server)
        options.url = transport == BenchTransport::kGrpc ? "127.0.0.1:1" : "http://127.0.0.1:1";
      options.concurrency = 4;
      options.shared_memory = BenchSharedMemory::kCuda;
      Result<BenchReport> report = RunBench(options, nullptr);
      ASSERT_FALSE(report.ok());
      const std::string& message = report.status().message();
      EXPECT_EQ(report.status().code(), usable.code()) << message;
      EXPECT_EQ(message.rfind("--shared-memory cuda on cuda:0: ", 0), 0u) << message;
      EXPECT_NE(message.find(usable.message()), std::string::npos) << message;
      EXPECT_EQ(message.find(options.url), std::string::npos) << message;
    }
  }
  ExpectNothingLeft(::getpid());
}

TEST_F(BenchTest, CudaSharedMemoryOptionsAreChecked) {
  BenchOptions options = Options();
  options.shared_memory = BenchSharedMemory::kSystem;
  options.shared_memory_device = 1;
  Result<BenchReport> report = RunBench(options, nullptr);
  ASSERT_FALSE(report.ok());
  EXPECT_EQ(report.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(report.status().message().find("--shared-memory-device needs --shared-memory cuda"),
            std::string::npos)
      << report.status().message();
  options.shared_memory = BenchSharedMemory::kCuda;
  options.shared_memory_device = -1;
  report = RunBench(options, nullptr);
  ASSERT_FALSE(report.ok());
  EXPECT_EQ(report.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(report.status().message().find("CUDA ordinal"), std::string::npos)
      << report.status().message();
  options.shared_memory = BenchSharedMemory::kNone;
  options.shared_memory_device = 0;
  options.verify = true;
  report = RunBench(options, nullptr);
  ASSERT_FALSE(report.ok());
  EXPECT_NE(report.status().message().find("--verify needs --shared-memory system or cuda"),
            std::string::npos)
      << report.status().message();
}

TEST_F(BenchTest, CliCudaSharedMemoryWithoutAGpuSaysWhy) {
  const std::string command = std::string(HEARTH_CLI_PATH) + " bench --url " + Url() +
                              " --model scale --shared-memory cuda --shared-memory-device 0 "
                              "--seconds 0.2 --warmup 0 2>&1";
  if (bench::CudaShmUsable(0).ok()) {
    GTEST_SKIP() << "a GPU is here";
  }
  std::string out;
  EXPECT_EQ(RunCommand(command, &out), 1) << out;
  EXPECT_NE(out.find("--shared-memory cuda on cuda:0: "), std::string::npos) << out;
  EXPECT_NE(out.find(bench::CudaShmUsable(0).message()), std::string::npos) << out;
  EXPECT_EQ(CudaRegions(), nlohmann::json::array());
}

TEST_F(BenchTest, CliCudaSharedMemoryOnTheToolkitsStubDriverNamesIt) {
#ifndef HEARTH_CUDA_STUB_LIBCUDA
  GTEST_SKIP() << "this hearth was built without CUDA";
#else
  const fs::path stub = HEARTH_CUDA_STUB_LIBCUDA;
  if (!fs::exists(stub)) GTEST_SKIP() << stub << " is not here";
  // The stub under the driver's name, first on the library path: what a
  // machine with the toolkit's stubs/ on LD_LIBRARY_PATH and no driver has.
  const fs::path dir = *dir_ / "stub-driver";
  fs::create_directories(dir);
  std::error_code ignored;
  fs::remove(dir / "libcuda.so.1", ignored);
  fs::create_symlink(stub, dir / "libcuda.so.1");
  for (const char* transport : {"rest", "grpc"}) {
    if (std::string(transport) == "grpc" && (!BenchHasGrpc() || grpc_port_ == 0)) continue;
    const std::string url = std::string(transport) == "grpc" ? GrpcUrl() : Url();
    std::string out;
    const int rc = RunCommand("LD_LIBRARY_PATH=" + dir.string() + " " + HEARTH_CLI_PATH +
                                  " bench --url " + url + " --transport " + transport +
                                  " --model scale --shared-memory cuda --seconds 0.2 --warmup 0 "
                                  "2>&1",
                              &out);
    EXPECT_EQ(rc, 1) << out;
    EXPECT_NE(out.find("--shared-memory cuda on cuda:0: cuInit failed: CUDA_ERROR_STUB_LIBRARY"),
              std::string::npos)
        << out;
    EXPECT_NE(out.find("stub library, not an NVIDIA driver"), std::string::npos) << out;
  }
  EXPECT_EQ(CudaRegions(), nlohmann::json::array());
#endif
}

TEST_F(BenchTest, CudaRegistrationReachesTheServersCudaCalls) {
  // A handle no driver made: whatever the server makes of it (hearth before
  // CUDA shared memory: not implemented; with it: a handle it cannot open),
  // the call must have reached its CUDA registration, not a missing route.
  bench::RegionHandle handle;
  handle.kind = BenchSharedMemory::kCuda;
  handle.ipc_handle = std::string(64, '\x5a');
  handle.byte_size = 64;
  for (BenchTransport transport : Transports()) {
    BenchOptions options = Options();
    UseTransport(transport, options);
    Result<std::unique_ptr<bench::RegionControl>> control = bench::MakeRegionControl(options);
    ASSERT_TRUE(control.ok()) << control.status().ToString();
    const Status registered = (*control)->Register("bench-test-forged", handle);
    if (OnGpu()) {
      // A server on a GPU takes the handle as it is (its workers open it,
      // and refuse it, when a request uses it): it is listed, and goes.
      ASSERT_TRUE(registered.ok()) << registered.ToString();
      EXPECT_EQ(CudaRegions().size(), 1u);
      ASSERT_TRUE((*control)->Unregister(BenchSharedMemory::kCuda, "bench-test-forged").ok());
      EXPECT_EQ(CudaRegions(), nlohmann::json::array());
      continue;
    }
    ASSERT_FALSE(registered.ok()) << "a server on the host registered a CUDA IPC handle";
    EXPECT_NE(registered.code(), StatusCode::kNotFound) << registered.ToString();
    std::string lower = registered.message();
    std::transform(lower.begin(), lower.end(), lower.begin(), ::tolower);
    EXPECT_NE(lower.find("cuda"), std::string::npos) << registered.ToString();
    EXPECT_EQ(CudaRegions(), nlohmann::json::array());
  }
}

TEST_F(BenchTest, CudaSharedMemoryAnswersAreInTheRegion) {
  if (Status usable = bench::CudaShmUsable(0); !usable.ok()) GTEST_SKIP() << usable.ToString();
  for (BenchTransport transport : Transports()) {
    BenchOptions options = Options();
    UseTransport(transport, options);
    options.concurrency = 4;
    options.batch = 3;
    options.shared_memory = BenchSharedMemory::kCuda;
    options.verify = true;
    Result<BenchReport> report = RunBench(options, nullptr);
    if (!report.ok() && report.status().code() == StatusCode::kUnimplemented &&
        report.status().message().find("registering shared-memory region") != std::string::npos)
      GTEST_SKIP() << "this server has no CUDA shared memory: " << report.status().message();
    ASSERT_TRUE(report.ok()) << report.status().ToString();
    ExpectHealthy(*report);
    EXPECT_EQ(report->shared_memory, "cuda");
    EXPECT_EQ(report->shared_memory_device, 0);
    EXPECT_GE(report->shm_checked, report->requests);
    ExpectScaleAnswers(*report);
    ExpectNothingLeft(::getpid());
  }
}

}  // namespace
}  // namespace hearth
