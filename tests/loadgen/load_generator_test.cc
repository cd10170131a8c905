// `hearth bench`'s core against a real `hearth serve` on a real socket: a
// one-model repository (scale, 16 floats in, one out, batches up to 4), the
// server started once per suite and stopped with SIGTERM.
#include "loadgen/load_generator.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

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

class BenchTest : public ::testing::Test {
 protected:
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
  - {count: 1, kind: KIND_CPU}
)";
    const std::string log = (*dir_ / "serve.log").string();
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, 1, 2);
    const std::string repo = (*dir_ / "repo").string();
    std::vector<std::string> args = {cli,           "serve", "--model-repository", repo,
                                     "--http-port", "0",     "--device",           "cpu"};
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
  }

  static void TearDownTestSuite() {
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

}  // namespace
}  // namespace hearth
