// Shutting the server down while it starts, and the store's cancelling of
// loads that lets it do so promptly. Real processes: a store on a real
// socket, and a server whose workers are exec'd scripts.
#include <signal.h>
#include <sys/stat.h>

#include <cerrno>
#include <chrono>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "hearth/attach.h"
#include "hearth/store.h"
#include "server/server.h"
#include "support/test_store.h"

namespace hearth {
namespace {

std::vector<std::string> Lines(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> out;
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

// A store told to cancel its loads answers every later load kUnavailable
// without reading the checkpoint, and keeps serving otherwise.
TEST(StoreCancelLoads, LaterLoadsAreAnsweredUnavailable) {
  testing::TempDir tmp;
  const std::string checkpoint = tmp.File("m.safetensors");
  testing::WriteTestCheckpoint(checkpoint, 2, 1024, 7);
  StoreOptions options;
  options.socket_path = tmp.File("run/store.sock");
  auto store = Store::Create(options);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  std::thread loop([&] { EXPECT_TRUE((*store)->Run().ok()); });
  AttachClient client(options.socket_path);
  auto before = client.Load("before", checkpoint);
  EXPECT_TRUE(before.ok()) << before.status().ToString();
  (*store)->CancelLoads();
  auto after = client.Load("after", checkpoint);
  ASSERT_FALSE(after.ok());
  EXPECT_EQ(after.status().code(), StatusCode::kUnavailable) << after.status().ToString();
  EXPECT_NE(after.status().message().find("the store is stopping"), std::string::npos)
      << after.status().ToString();
  (*store)->Stop();
  loop.join();
}

// Shutdown() from another thread while WaitForModels() waits for workers
// that never say ready (the ready timeout is 300 s): Start() has returned at
// once, WaitForModels() returns kUnavailable, the starting workers are killed
// and reaped, and Shutdown() returns.
TEST(ServerShutdown, FromAnotherThreadEndsAWaitForWorkersThatNeverStart) {
  testing::TempDir tmp;
  const std::string repo = tmp.File("repo");
  ASSERT_EQ(::mkdir(repo.c_str(), 0700), 0);
  ASSERT_EQ(::mkdir((repo + "/scale").c_str(), 0700), 0);
  ASSERT_EQ(::mkdir((repo + "/scale/1").c_str(), 0700), 0);
  std::string out;
  ASSERT_EQ(testing::Run({testing::CliPath(), "make-model", "scale", "--dims", "8", "--seed", "1",
                          "--out", repo + "/scale/1/model.safetensors"},
                         &out),
            0)
      << out;
  std::ofstream(repo + "/scale/config.yaml")
      << "backend: scale\nmax_batch_size: 1\n"
         "input:\n  - {name: x, data_type: TYPE_FP32, dims: [8]}\n"
         "output:\n  - {name: y, data_type: TYPE_FP32, dims: [1]}\n"
         "instance_group:\n  - {count: 2, kind: KIND_CPU}\n";
  // A worker that starts and never says ready.
  const std::string started = tmp.File("started");
  const std::string worker = tmp.File("worker.sh");
  std::ofstream(worker) << "#!/bin/sh\necho $$ >> " << started << "\nexec sleep 100000\n";
  ASSERT_EQ(::chmod(worker.c_str(), 0755), 0);

  ServerOptions options;
  options.repository = repo;
  options.device = Device::Host();
  options.worker_path = worker;
  options.run_dir = tmp.File("run");
  auto server = Server::Create(options);
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  ASSERT_TRUE((*server)->Start().ok());
  EXPECT_FALSE((*server)->Ready());
  Status wait_status;
  std::thread waiter([&] { wait_status = (*server)->WaitForModels(); });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (Lines(started).size() < 2 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));  // polling, with a deadline
  const std::vector<std::string> pids = Lines(started);
  ASSERT_EQ(pids.size(), 2u) << "the workers did not start within 60 s";
  (*server)->Shutdown();
  waiter.join();
  EXPECT_EQ(wait_status.code(), StatusCode::kUnavailable) << wait_status.ToString();
  for (const std::string& pid : pids) {
    errno = 0;
    EXPECT_EQ(::kill(std::stoi(pid), 0), -1) << "worker " << pid << " outlived Shutdown()";
    EXPECT_EQ(errno, ESRCH);
  }
}

}  // namespace
}  // namespace hearth
