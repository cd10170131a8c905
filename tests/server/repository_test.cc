// Repository control while requests are served: a load swaps in a new
// version with no request failing, the old workers drain and exit, an
// unload stops serving, a load of a broken model leaves the served one; the
// stores' copies follow the files (reused while unchanged) and the devices.
// Real processes: the server's store and exec'd hearth-worker processes.
#include <signal.h>
#include <sys/stat.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <iterator>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "hearth/attach.h"
#include "hearth/store.h"
#include "server/server.h"
#include "support/eventually.h"
#include "support/test_store.h"

namespace hearth {
namespace {

std::string WorkerPath() {
  const std::string cli = testing::CliPath();
  return cli.substr(0, cli.rfind('/')) + "/hearth-worker";
}

void MakeVersion(const std::string& dir, int seed) {
  ASSERT_EQ(::mkdir(dir.c_str(), 0700), 0) << dir;
  std::string out;
  ASSERT_EQ(testing::Run({testing::CliPath(), "make-model", "scale", "--dims", "8", "--seed",
                          std::to_string(seed), "--out", dir + "/model.safetensors"},
                         &out),
            0)
      << out;
}

void WriteConfig(const std::string& model_dir, const std::string& extra = "") {
  std::ofstream(model_dir + "/config.yaml")
      << "backend: scale\nmax_batch_size: 4\n"
         "input:\n  - {name: x, data_type: TYPE_FP32, dims: [8]}\n"
         "output:\n  - {name: y, data_type: TYPE_FP32, dims: [1]}\n"
         "instance_group:\n  - {count: 2, kind: KIND_CPU}\n"
      << extra;
}

// One request of ones; the answer's y, or the error.
Result<float> Ask(Server& server, const std::string& model) {
  InferRequest r;
  r.model = model;
  InferTensor x;
  x.name = "x";
  x.dtype = DType::kF32;
  x.shape = {1, 8};
  std::vector<std::byte> bytes(32);
  const float one = 1.0f;
  for (int i = 0; i < 8; ++i) std::memcpy(bytes.data() + 4 * i, &one, 4);
  x.data = std::move(bytes);
  r.inputs.push_back(std::move(x));
  std::promise<Result<float>> answer;
  server.Infer(std::move(r), [&](Result<InferResponse> got) {
    if (!got.ok()) return answer.set_value(got.status());
    float y = 0;
    std::memcpy(&y, got->outputs.at(0).data.data(), 4);
    answer.set_value(y);
  });
  return answer.get_future().get();
}

bool Gone(pid_t pid) { return ::kill(pid, 0) != 0 && errno == ESRCH; }

// A repository with version 1 of `scale`, served.
class ServedRepository : public ::testing::Test {
 protected:
  void SetUp() override {
    repo_ = tmp_.File("repo");
    ASSERT_EQ(::mkdir(repo_.c_str(), 0700), 0);
    ASSERT_EQ(::mkdir((repo_ + "/scale").c_str(), 0700), 0);
    MakeVersion(repo_ + "/scale/1", 1);
    WriteModelConfig();
    ServerOptions options;
    options.repository = repo_;
    options.worker_path = WorkerPath();
    Configure(options);
    auto made = Server::Create(options);
    ASSERT_TRUE(made.ok()) << made.status().ToString();
    server_ = std::move(made).value();
    ASSERT_TRUE(server_->Start().ok());
    ASSERT_TRUE(server_->WaitForModels().ok());
  }
  void TearDown() override {
    if (server_) server_->Shutdown();
  }
  virtual void WriteModelConfig() { WriteConfig(repo_ + "/scale"); }
  virtual void Configure(ServerOptions&) {}

  testing::TempDir tmp_;
  std::string repo_;
  std::unique_ptr<Server> server_;
};

class RepositoryControl : public ServedRepository {};

TEST_F(RepositoryControl, ANewVersionReplacesTheOldOneWithNoRequestFailing) {
  auto first = Ask(*server_, "scale");
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  const std::vector<int> old_pids = server_->WorkerPids("scale");
  ASSERT_EQ(old_pids.size(), 2u);
  MakeVersion(repo_ + "/scale/2", 2);

  // Four clients asking all the time, each one request after another; the
  // load starts once each has had an answer (on a busy machine a thread may
  // not run at all before a quick load is over).
  std::atomic<bool> stop{false};
  std::atomic<int> answered{0};
  std::vector<std::vector<Result<float>>> answers(4);
  std::vector<std::thread> clients;
  for (auto& mine : answers)
    clients.emplace_back([&] {
      while (!stop) {
        mine.push_back(Ask(*server_, "scale"));
        if (mine.size() == 1) ++answered;
      }
    });
  EXPECT_TRUE(Eventually([&] { return answered == 4; }));
  Status loaded = server_->LoadModel("scale");
  auto after = Ask(*server_, "scale");
  stop = true;
  for (auto& c : clients) c.join();
  ASSERT_TRUE(loaded.ok()) << loaded.ToString();
  ASSERT_TRUE(after.ok()) << after.status().ToString();
  // The same version's answer differs in its last bits with the batch it ran
  // in (the rows' sums are ordered differently): versions are told apart
  // within a tolerance far below their difference.
  const auto same = [](float x, float y) { return std::fabs(x - y) <= 1e-5f * (1 + std::fabs(y)); };
  ASSERT_FALSE(same(*after, *first)) << "version 2 has other weights";
  // Every request was answered; each client saw version 1, then version 2.
  size_t total = 0;
  for (const auto& mine : answers) {
    bool switched = false;
    for (const auto& a : mine) {
      ASSERT_TRUE(a.ok()) << a.status().ToString();
      if (same(*a, *after)) switched = true;
      EXPECT_TRUE(same(*a, switched ? *after : *first))
          << "an answer from neither version, or from version 1 after version 2";
    }
    total += mine.size();
  }
  ASSERT_GT(total, 0u);
  auto index = server_->RepositoryIndex(false);
  ASSERT_EQ(index.size(), 1u);
  EXPECT_EQ(index[0].state, "READY");
  EXPECT_EQ(index[0].version, "2");
  auto metadata = server_->Metadata("scale", "");
  ASSERT_TRUE(metadata.ok());
  EXPECT_EQ(metadata->versions, std::vector<std::string>{"2"});
  // The old workers drain and exit; the new ones serve.
  for (int pid : old_pids) EXPECT_TRUE(Eventually([&] { return Gone(pid); })) << pid;
  EXPECT_EQ(server_->WorkerPids("scale").size(), 2u);
}

TEST_F(RepositoryControl, UnloadStopsServingAndALoadServesAgain) {
  ASSERT_TRUE(Ask(*server_, "scale").ok());
  const std::vector<int> pids = server_->WorkerPids("scale");
  ASSERT_TRUE(server_->UnloadModel("scale").ok());
  auto refused = Ask(*server_, "scale");
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(refused.status().message().find("unloaded"), std::string::npos)
      << refused.status().ToString();
  auto index = server_->RepositoryIndex(false);
  ASSERT_EQ(index.size(), 1u);
  EXPECT_EQ(index[0].state, "UNAVAILABLE");
  EXPECT_TRUE(server_->RepositoryIndex(true).empty());
  for (int pid : pids) EXPECT_TRUE(Eventually([&] { return Gone(pid); })) << pid;
  ASSERT_TRUE(server_->LoadModel("scale").ok());
  auto again = Ask(*server_, "scale");
  EXPECT_TRUE(again.ok()) << again.status().ToString();
}

TEST_F(RepositoryControl, ABrokenLoadLeavesTheServedVersionAndNewDirectoriesCanBeLoaded) {
  auto before = Ask(*server_, "scale");
  ASSERT_TRUE(before.ok());
  WriteConfig(repo_ + "/scale", "no_such_field: 1\n");
  Status broken = server_->LoadModel("scale");
  ASSERT_FALSE(broken.ok());
  EXPECT_NE(broken.message().find("no_such_field"), std::string::npos) << broken.ToString();
  auto still = Ask(*server_, "scale");
  ASSERT_TRUE(still.ok()) << still.status().ToString();
  EXPECT_EQ(*still, *before);

  EXPECT_EQ(server_->LoadModel("nothing").code(), StatusCode::kNotFound);
  ASSERT_EQ(::mkdir((repo_ + "/later").c_str(), 0700), 0);
  MakeVersion(repo_ + "/later/1", 3);
  WriteConfig(repo_ + "/later");
  EXPECT_EQ(Ask(*server_, "later").status().code(), StatusCode::kNotFound);
  ASSERT_TRUE(server_->LoadModel("later").ok());
  EXPECT_TRUE(Ask(*server_, "later").ok());
  EXPECT_EQ(server_->ModelNames(), (std::vector<std::string>{"later", "scale"}));
}

// A model on two (stand-in) GPUs: each device's store holds one copy, a new
// version replaces the old one in both, a config that leaves a GPU out
// drops that GPU's copy, and an unload empties both stores.
class RepositoryOnDevices : public ServedRepository {
 protected:
  void WriteModelConfig() override { WriteGroups("[0, 1]"); }
  void Configure(ServerOptions& options) override {
    options.stand_in_gpus = 2;
    options.device = Device::Cuda(0);
    options.run_dir = tmp_.File("run");
  }
  void WriteGroups(const std::string& gpus) {
    std::ofstream(repo_ + "/scale/config.yaml")
        << "backend: scale\nmax_batch_size: 4\n"
           "input:\n  - {name: x, data_type: TYPE_FP32, dims: [8]}\n"
           "output:\n  - {name: y, data_type: TYPE_FP32, dims: [1]}\n"
           "instance_group:\n  - {count: 1, kind: KIND_GPU, gpus: "
        << gpus << "}\n";
  }
  // The versions of `scale` a device's store lists, and the arenas it holds
  // (listed or not: unloaded ones still attached count), as it says.
  std::vector<uint64_t> Versions(const std::string& device) {
    auto models = AttachClient(Socket(device)).ListModels();
    EXPECT_TRUE(models.ok()) << models.status().ToString();
    std::vector<uint64_t> out;
    for (const ModelSummary& m : models.ok() ? *models : std::vector<ModelSummary>{})
      if (m.name == "scale") out.push_back(m.version);
    return out;
  }
  size_t Arenas(const std::string& device) {
    auto status = AttachClient(Socket(device)).GetStatus();
    return status.ok() ? status->arenas.size() : 999;
  }
  std::string Socket(const std::string& device) {
    return DeviceSocketPath(tmp_.File("run/store.sock"), device);
  }
};

TEST_F(RepositoryOnDevices, EachDevicesCopyFollowsTheServedVersionAndPlacement) {
  ASSERT_TRUE(Ask(*server_, "scale").ok());
  ASSERT_EQ(server_->WorkerPids("scale").size(), 2u);
  EXPECT_EQ(Versions("host0"), (std::vector<uint64_t>{1}));
  EXPECT_EQ(Versions("host1"), (std::vector<uint64_t>{1}));

  // A new version: loaded on both, the old one dropped from both once its
  // workers have gone.
  const std::vector<int> old_pids = server_->WorkerPids("scale");
  MakeVersion(repo_ + "/scale/2", 2);
  ASSERT_TRUE(server_->LoadModel("scale").ok());
  EXPECT_EQ(Versions("host0"), (std::vector<uint64_t>{2}));
  EXPECT_EQ(Versions("host1"), (std::vector<uint64_t>{2}));
  EXPECT_TRUE(Eventually([&] {
    for (int pid : old_pids)
      if (!Gone(pid)) return false;
    return Arenas("host0") == 1 && Arenas("host1") == 1;
  })) << "host0 "
      << Arenas("host0") << ", host1 " << Arenas("host1");

  // GPU 0 left out: its copy goes, GPU 1's stays (the same files: not read again).
  WriteGroups("[1]");
  ASSERT_TRUE(server_->LoadModel("scale").ok());
  ASSERT_TRUE(Ask(*server_, "scale").ok());
  EXPECT_EQ(server_->WorkerPids("scale").size(), 1u);
  EXPECT_EQ(Versions("host0"), (std::vector<uint64_t>{}));
  EXPECT_EQ(Versions("host1"), (std::vector<uint64_t>{2}));
  EXPECT_TRUE(Eventually([&] { return Arenas("host0") == 0; }));

  ASSERT_TRUE(server_->UnloadModel("scale").ok());
  EXPECT_EQ(Versions("host1"), (std::vector<uint64_t>{}));
  EXPECT_TRUE(Eventually([&] { return Arenas("host0") == 0 && Arenas("host1") == 0; }));
}

// The files unchanged, a load reuses what each store holds (no new store
// version); the checkpoint rewritten in place (the same version directory),
// a load reads it again on each device and the old copies go once replaced.
TEST_F(RepositoryOnDevices, ALoadReusesUnchangedFilesAndReadsRewrittenOnes) {
  auto first = Ask(*server_, "scale");
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  ASSERT_TRUE(server_->LoadModel("scale").ok());
  EXPECT_EQ(Versions("host0"), (std::vector<uint64_t>{1}));
  EXPECT_EQ(Versions("host1"), (std::vector<uint64_t>{1}));

  std::string out;
  ASSERT_EQ(testing::Run({testing::CliPath(), "make-model", "scale", "--dims", "8", "--seed", "9",
                          "--out", repo_ + "/scale/1/model.safetensors"},
                         &out),
            0)
      << out;
  const std::vector<int> old_pids = server_->WorkerPids("scale");
  ASSERT_TRUE(server_->LoadModel("scale").ok());
  EXPECT_EQ(Versions("host0"), (std::vector<uint64_t>{2}));
  EXPECT_EQ(Versions("host1"), (std::vector<uint64_t>{2}));
  auto rewritten = Ask(*server_, "scale");
  ASSERT_TRUE(rewritten.ok()) << rewritten.status().ToString();
  EXPECT_NE(*rewritten, *first) << "the rewritten weights are served";
  EXPECT_TRUE(Eventually([&] {
    for (int pid : old_pids)
      if (!Gone(pid)) return false;
    return Arenas("host0") == 1 && Arenas("host1") == 1;
  })) << "host0 "
      << Arenas("host0") << ", host1 " << Arenas("host1");

  ASSERT_TRUE(server_->LoadModel("scale").ok());
  EXPECT_EQ(Versions("host0"), (std::vector<uint64_t>{2}));
  EXPECT_EQ(Versions("host1"), (std::vector<uint64_t>{2}));
}

// A model whose workers cannot start (its config's dims are not its
// weights'): its first attempt loaded the weights, kept for the retries.
// A retry with the files unchanged reuses them; rewritten, the old copy goes
// and the new one is loaded; once the config is fixed, that copy is served.
class RetriedModel : public ServedRepository {
 protected:
  void SetUp() override {
    repo_ = tmp_.File("repo");
    ASSERT_EQ(::mkdir(repo_.c_str(), 0700), 0);
    ASSERT_EQ(::mkdir((repo_ + "/scale").c_str(), 0700), 0);
    MakeVersion(repo_ + "/scale/1", 1);
    WriteDims(9);
    ServerOptions options;
    options.repository = repo_;
    options.worker_path = WorkerPath();
    options.run_dir = tmp_.File("run");
    auto made = Server::Create(options);
    ASSERT_TRUE(made.ok()) << made.status().ToString();
    server_ = std::move(made).value();
    ASSERT_TRUE(server_->Start().ok());
    static_cast<void>(server_->WaitForModels());
  }
  void WriteDims(int dims) {
    std::ofstream(repo_ + "/scale/config.yaml")
        << "backend: scale\nmax_batch_size: 4\n"
           "input:\n  - {name: x, data_type: TYPE_FP32, dims: ["
        << dims
        << "]}\n"
           "output:\n  - {name: y, data_type: TYPE_FP32, dims: [1]}\n"
           "instance_group:\n  - {count: 1, kind: KIND_CPU}\n";
  }
  uint64_t LoadsReused() {
    auto status = AttachClient(DeviceSocketPath(tmp_.File("run/store.sock"), "cpu")).GetStatus();
    return status.ok() ? status->counters["loads_reused"] : 0;
  }
  std::vector<uint64_t> Versions() {
    auto models = AttachClient(DeviceSocketPath(tmp_.File("run/store.sock"), "cpu")).ListModels();
    EXPECT_TRUE(models.ok()) << models.status().ToString();
    std::vector<uint64_t> out;
    for (const ModelSummary& m : models.ok() ? *models : std::vector<ModelSummary>{})
      if (m.name == "scale") out.push_back(m.version);
    return out;
  }
};

TEST_F(RetriedModel, RetriesReuseUnchangedWeightsAndReplaceRewrittenOnes) {
  EXPECT_FALSE(Ask(*server_, "scale").ok());
  EXPECT_EQ(Versions(), (std::vector<uint64_t>{1}));
  // A retry (the first comes 1 s after the first attempt) reuses the weights.
  EXPECT_TRUE(Eventually([&] { return LoadsReused() >= 1; })) << LoadsReused() << " reused";
  EXPECT_EQ(Versions(), (std::vector<uint64_t>{1}));

  std::string out;
  ASSERT_EQ(testing::Run({testing::CliPath(), "make-model", "scale", "--dims", "8", "--seed", "9",
                          "--out", repo_ + "/scale/1/model.safetensors"},
                         &out),
            0)
      << out;
  EXPECT_TRUE(Eventually([&] { return Versions() == std::vector<uint64_t>{2}; }))
      << Versions().size() << " versions";
  WriteDims(8);
  ASSERT_TRUE(server_->LoadModel("scale").ok());
  EXPECT_TRUE(Ask(*server_, "scale").ok());
  EXPECT_EQ(Versions(), (std::vector<uint64_t>{2}));
}

// The layering (docs/architecture.md): the server uses the store, the
// protocol and common, never the checkpoint module; whether the files of a
// model changed is the store's to say. Every file of src/server, and every
// header it reaches through its quoted includes, is looked at.
TEST(ServerLayering, NothingTheServerIncludesReachesTheCheckpointModule) {
  namespace fs = std::filesystem;
  const std::string here = __FILE__;
  const size_t tests = here.rfind("/tests/server/");
  ASSERT_NE(tests, std::string::npos) << "cannot find the source tree from " << here;
  const fs::path root = here.substr(0, tests);
  auto resolve = [&](const std::string& name) -> std::optional<fs::path> {
    for (const char* dir : {"src", "include"})
      if (fs::exists(root / dir / name)) return (root / dir / name).lexically_normal();
    return std::nullopt;
  };
  std::vector<std::pair<fs::path, std::string>> queue;  // (file, how it was reached)
  for (const auto& e : fs::directory_iterator(root / "src" / "server"))
    if (e.path().extension() == ".h" || e.path().extension() == ".cc")
      queue.emplace_back(e.path().lexically_normal(), e.path().filename().string());
  ASSERT_FALSE(queue.empty());
  std::set<fs::path> seen;
  while (!queue.empty()) {
    auto [file, chain] = std::move(queue.back());
    queue.pop_back();
    if (!seen.insert(file).second) continue;
    std::ifstream in(file);
    ASSERT_TRUE(in) << file;
    for (std::string line; std::getline(in, line);) {
      const size_t open = line.find("#include \"");
      if (open == std::string::npos) continue;
      const size_t start = open + 10, end = line.find('"', start);
      const std::string name = line.substr(start, end - start);
      EXPECT_TRUE(name != "hearth/checkpoint.h" && name.rfind("checkpoint/", 0) != 0)
          << chain << " includes " << name;
      if (std::optional<fs::path> next = resolve(name))
        queue.emplace_back(*next, chain + " -> " + name);
    }
  }
  std::ifstream cmake(root / "src" / "server" / "CMakeLists.txt");
  const std::string text((std::istreambuf_iterator<char>(cmake)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text.find("hearth_checkpoint"), std::string::npos)
      << "src/server/CMakeLists.txt links the checkpoint library";
}

}  // namespace
}  // namespace hearth
