// The store on a GPU: the same multi-process checks as on host memory, plus
// device-memory accounting. Skipped, with the reason, where no GPU is usable.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <thread>

#include "gtest/gtest.h"
#include "hearth/arena.h"
#include "hearth/attach.h"
#include "memory/cuda_driver.h"
#include "support/test_store.h"

namespace hearth {
namespace {

class StoreCudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!CudaAvailable(&why)) GTEST_SKIP() << "no CUDA device: " << why;
    ASSERT_TRUE(MakeContextCurrent(0).ok());
    cu_ = *CudaDriver::Get();
  }

  double UsedMiB() const {
    size_t free_b = 0, total_b = 0;
    cu_->MemGetInfo(&free_b, &total_b);
    return static_cast<double>(total_b - free_b) / (1 << 20);
  }

  // Device memory in use once it has stopped changing (a process that just
  // exited frees its context asynchronously).
  double SettledUsedMiB() const {
    double last = UsedMiB();
    for (int i = 0; i < 100; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      const double now = UsedMiB();
      if (std::fabs(now - last) < 1.0) return now;
      last = now;
    }
    return last;
  }

  template <typename Pred>
  StoreStatus WaitForStatus(const std::string& socket, Pred pred) {
    StoreStatus last;
    for (int i = 0; i < 3000; ++i) {
      auto s = AttachClient(socket).GetStatus();
      if (s.ok()) {
        last = *s;
        if (pred(last)) return last;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return last;
  }

  const CudaDriver* cu_ = nullptr;
  testing::TempDir dir_;
};

TEST_F(StoreCudaTest, EightProcessesReadTheDeviceArenaAsInTheFile) {
  const std::string model = dir_.File("m.safetensors");
  testing::WriteTestCheckpoint(model, 6, 1 << 20, 3);
  const std::string socket = dir_.File("s.sock");
  testing::StoreProcess store(socket, {"--device", "cuda:0", "--model", "m=" + model});
  ASSERT_EQ(store.startup_error(), "");
  auto a = AttachClient(socket).Attach("m");
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_TRUE((*a)->device().is_cuda());
  auto sum = (*a)->ComputeChecksum();
  ASSERT_TRUE(sum.ok()) << sum.status().ToString();
  EXPECT_EQ(*sum, (*a)->checksum());
  std::vector<pid_t> pids;
  for (int i = 0; i < 8; ++i)
    pids.push_back(testing::Spawn({testing::ProbePath(), "check", socket, "m", model}));
  for (pid_t pid : pids) {
    const int status = testing::Wait(pid);
    ASSERT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 0);
  }
}

TEST_F(StoreCudaTest, EightAttachedProcessesCostOneArenaPlusEightContexts) {
  const std::string model = dir_.File("big.safetensors");
  testing::WriteTestCheckpoint(model, 4, 64u << 20, 5);  // 4 x 256 MiB
  const std::string socket = dir_.File("s.sock");

  // One bare context, measured the same way as the attached processes.
  const double idle = SettledUsedMiB();
  const pid_t ctx = testing::Spawn({testing::ProbePath(), "context", "0"});
  double with_ctx = idle;
  for (int i = 0; i < 200 && with_ctx - idle < 50; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    with_ctx = SettledUsedMiB();
  }
  const double context_mib = with_ctx - idle;
  ::kill(ctx, SIGKILL);
  testing::Wait(ctx);
  ASSERT_GT(context_mib, 50) << "a CUDA context should cost device memory";

  const double before_store = SettledUsedMiB();
  testing::StoreProcess store(socket, {"--device", "cuda:0", "--model", "m=" + model});
  ASSERT_EQ(store.startup_error(), "");
  const double with_store = SettledUsedMiB();
  auto list = AttachClient(socket).ListModels();
  ASSERT_TRUE(list.ok());
  const double arena_mib = static_cast<double>((*list)[0].arena_size) / (1 << 20);
  EXPECT_NEAR(with_store - before_store, arena_mib + context_mib, 0.05 * (arena_mib + context_mib));

  std::vector<pid_t> holders;
  for (int i = 0; i < 8; ++i) holders.push_back(testing::Spawn({testing::ProbePath(), "hold", socket, "m"}));
  StoreStatus s = WaitForStatus(socket, [](const StoreStatus& st) { return st.leases.size() == 8; });
  ASSERT_EQ(s.leases.size(), 8u);
  // A lease starts when the store sends the manifest; each client then creates
  // its context and maps. Wait (up to 30 s) for that to finish.
  double eight = SettledUsedMiB() - with_store;
  for (int i = 0; i < 60 && eight < 0.95 * 8 * context_mib; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    eight = SettledUsedMiB() - with_store;
  }
  std::printf("context %.0f MiB, arena %.0f MiB, store %.0f MiB, 8 attached clients %.0f MiB\n",
              context_mib, arena_mib, with_store - before_store, eight);
  EXPECT_NEAR(eight, 8 * context_mib, 0.05 * 8 * context_mib)
      << "8 attached processes must add 8 contexts and no copy of the " << arena_mib << " MiB arena";
  for (pid_t pid : holders) {
    ::kill(pid, SIGKILL);
    testing::Wait(pid);
  }
  // Unload with no client left: the arena's device memory is released.
  WaitForStatus(socket, [](const StoreStatus& st) { return st.leases.empty(); });
  ASSERT_TRUE(AttachClient(socket).Unload("m").ok());
  const double after_unload = SettledUsedMiB();
  EXPECT_NEAR(after_unload, before_store + context_mib, 0.05 * context_mib + 64);
}

TEST_F(StoreCudaTest, WriteThroughTheMappingFailsInItsOwnProcessOnly) {
  const std::string model = dir_.File("m.safetensors");
  testing::WriteTestCheckpoint(model, 2, 1 << 16, 4);
  const std::string socket = dir_.File("s.sock");
  testing::StoreProcess store(socket, {"--device", "cuda:0", "--model", "m=" + model});
  ASSERT_EQ(store.startup_error(), "");
  // A host write to a device address faults in the writer; the kernel-level
  // write through a read-only mapping is covered by memory_cuda_test.
  const int status = testing::Wait(testing::Spawn({testing::ProbePath(), "write", socket, "m"}));
  EXPECT_TRUE(WIFSIGNALED(status));
  EXPECT_TRUE(store.alive());
  const int check = testing::Wait(testing::Spawn({testing::ProbePath(), "check", socket, "m", model}));
  EXPECT_TRUE(WIFEXITED(check) && WEXITSTATUS(check) == 0);
}

}  // namespace
}  // namespace hearth
