// CUDA arenas: load through the writer, seal, export, map read-only, in this
// process and in a separate worker-like process (cuda_write_probe) that must
// not be able to write. Every test skips when no CUDA device can be used.
//
// This process initialises CUDA, so it never forks: the probe is started
// with posix_spawn (an exec), as hearth starts its workers.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "hearth/arena.h"
#include "memory/cuda_driver.h"

extern char** environ;

namespace hearth {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr int kDevice = 0;

std::byte PatternByte(uint64_t i, uint8_t seed) {
  return static_cast<std::byte>(((i * 131) ^ (i >> 9) ^ seed) & 0xff);
}

std::vector<std::byte> Pattern(uint64_t size, uint8_t seed) {
  std::vector<std::byte> bytes(size);
  for (uint64_t i = 0; i < size; ++i) bytes[i] = PatternByte(i, seed);
  return bytes;
}

uint64_t ByteSum(const std::vector<std::byte>& bytes) {
  uint64_t sum = 0;
  for (std::byte b : bytes) sum += static_cast<uint8_t>(b);
  return sum;
}

class CudaArenaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!CudaAvailable(&why)) GTEST_SKIP() << "no CUDA device: " << why;
  }

  // Fills `arena` with Pattern(size, seed): `threads` slots on as many
  // threads, chunks of `chunk` bytes dealt round-robin.
  static void Fill(Arena& arena, int threads, uint64_t chunk, uint8_t seed) {
    auto writer = arena.OpenWriter(threads, chunk);
    ASSERT_TRUE(writer.ok()) << writer.status().ToString();
    const uint64_t size = arena.size();
    const uint64_t chunks = (size + chunk - 1) / chunk;
    std::vector<std::string> errors(static_cast<size_t>(threads));
    std::vector<std::thread> workers;
    for (int t = 0; t < threads; ++t) {
      workers.emplace_back([&, t] {
        for (uint64_t c = static_cast<uint64_t>(t); c < chunks;
             c += static_cast<uint64_t>(threads)) {
          uint64_t offset = c * chunk;
          uint64_t len = std::min(chunk, size - offset);
          auto buffer = (*writer)->Begin(t, offset, len);
          if (!buffer.ok()) {
            errors[static_cast<size_t>(t)] = buffer.status().ToString();
            return;
          }
          for (uint64_t i = 0; i < len; ++i) (*buffer)[i] = PatternByte(offset + i, seed);
          Status ended = (*writer)->End(t);
          if (!ended.ok()) {
            errors[static_cast<size_t>(t)] = ended.ToString();
            return;
          }
        }
      });
    }
    for (auto& worker : workers) worker.join();
    for (const auto& error : errors) EXPECT_EQ(error, "");
    Status finished = (*writer)->Finish();
    EXPECT_TRUE(finished.ok()) << finished.ToString();
  }

  static std::unique_ptr<Arena> SealedArena(uint64_t size, uint8_t seed, int threads = 4,
                                            uint64_t chunk = 4 * kMiB) {
    auto arena = Arena::Create(Device::Cuda(kDevice), size);
    EXPECT_TRUE(arena.ok()) << arena.status().ToString();
    if (!arena.ok()) return nullptr;
    Fill(**arena, threads, chunk, seed);
    Status sealed = (*arena)->Seal();
    EXPECT_TRUE(sealed.ok()) << sealed.ToString();
    return std::move(arena).value();
  }

  static void ExpectContents(const ArenaMapping& mapping, const std::vector<std::byte>& expected) {
    std::vector<std::byte> copy(expected.size());
    Status copied = mapping.CopyToHost(0, copy);
    ASSERT_TRUE(copied.ok()) << copied.ToString();
    EXPECT_TRUE(copy == expected) << "arena bytes differ from what was written";
  }
};

struct ProbeRun {
  int exit_code = -1;   // when it exited
  int term_signal = 0;  // when a signal killed it
  std::string output;   // stdout and stderr
};

// cuda_write_probe sits next to this test binary (the build puts both in
// one folder); the path compiled in is the fallback.
std::string ProbePath() {
  char self[4096];
  ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
  if (n > 0) {
    std::string path(self, static_cast<size_t>(n));
    path = path.substr(0, path.rfind('/') + 1) + "cuda_write_probe";
    if (::access(path.c_str(), X_OK) == 0) return path;
  }
  return HEARTH_CUDA_WRITE_PROBE;
}

// Runs cuda_write_probe MODE with a copy of `fd` as its descriptor (the only
// one it inherits besides stdio), and collects its output and exit status.
ProbeRun RunProbe(const char* mode, const UniqueFd& fd, uint64_t size,
                  const std::vector<std::string>& extra_env = {}) {
  ProbeRun run;
  int out[2];
  if (::pipe2(out, O_CLOEXEC) != 0) {
    run.output = std::string("pipe2: ") + std::strerror(errno);
    return run;
  }
  UniqueFd read_end(out[0]);
  UniqueFd write_end(out[1]);
  // dup2 to another number clears FD_CLOEXEC on the child's copy only.
  const int child_fd = fd.get() == 10 ? 11 : 10;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, write_end.get(), STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, write_end.get(), STDERR_FILENO);
  posix_spawn_file_actions_adddup2(&actions, fd.get(), child_fd);
  std::string fd_arg = std::to_string(child_fd);
  std::string size_arg = std::to_string(size);
  std::string device_arg = std::to_string(kDevice);
  const std::string probe_path = ProbePath();
  const char* probe = probe_path.c_str();
  char* argv[] = {const_cast<char*>(probe), const_cast<char*>(mode), fd_arg.data(),
                  size_arg.data(),          device_arg.data(),       nullptr};
  std::vector<std::string> env_strings = extra_env;
  std::vector<char*> env;
  for (std::string& entry : env_strings) env.push_back(entry.data());
  for (char** entry = environ; *entry != nullptr; ++entry) env.push_back(*entry);
  env.push_back(nullptr);
  pid_t pid = -1;
  int spawned = ::posix_spawn(&pid, probe, &actions, nullptr, argv, env.data());
  posix_spawn_file_actions_destroy(&actions);
  write_end.Reset();
  if (spawned != 0) {
    run.output = std::string("posix_spawn ") + probe + ": " + std::strerror(spawned);
    return run;
  }
  char buffer[4096];
  for (;;) {
    ssize_t n = ::read(read_end.get(), buffer, sizeof buffer);
    if (n > 0) {
      run.output.append(buffer, static_cast<size_t>(n));
    } else if (n == 0 || errno != EINTR) {
      break;
    }
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(status)) run.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) run.term_signal = WTERMSIG(status);
  return run;
}

TEST_F(CudaArenaTest, RoundTrip64MiB) {
  constexpr uint64_t kSize = 64 * kMiB;
  auto arena = Arena::Create(Device::Cuda(kDevice), kSize);
  ASSERT_TRUE(arena.ok()) << arena.status().ToString();
  EXPECT_EQ((*arena)->device(), Device::Cuda(kDevice));
  EXPECT_EQ((*arena)->size(), kSize);
  EXPECT_GE((*arena)->allocation_size(), kSize);
  Fill(**arena, 4, 4 * kMiB, 11);
  ASSERT_TRUE((*arena)->Seal().ok());

  auto fd = (*arena)->Export();
  ASSERT_TRUE(fd.ok()) << fd.status().ToString();
  EXPECT_NE(::fcntl(fd->get(), F_GETFD) & FD_CLOEXEC, 0);
  auto mapping = ArenaMapping::Map(std::move(fd).value(), Device::Cuda(kDevice), kSize);
  ASSERT_TRUE(mapping.ok()) << mapping.status().ToString();
  EXPECT_NE((*mapping)->data(), nullptr);
  EXPECT_EQ((*mapping)->size(), kSize);
  EXPECT_EQ((*mapping)->device(), Device::Cuda(kDevice));
  ExpectContents(**mapping, Pattern(kSize, 11));

  std::vector<std::byte> tail(100);
  ASSERT_TRUE((*mapping)->CopyToHost(kSize - 100, tail).ok());
  EXPECT_EQ(std::memcmp(tail.data(), Pattern(kSize, 11).data() + kSize - 100, 100), 0);
  EXPECT_EQ((*mapping)->CopyToHost(kSize - 99, tail).code(), StatusCode::kInvalidArgument);
}

TEST_F(CudaArenaTest, OddSizeSmallChunksOneSlot) {
  // 1 slot, many more chunks than its 3 staging buffers: Begin must wait for
  // each buffer's previous copy before handing it out again.
  constexpr uint64_t kSize = 5 * kMiB + 12345;
  auto arena = SealedArena(kSize, 4, /*threads=*/1, /*chunk=*/64 * 1024 + 7);
  ASSERT_NE(arena, nullptr);
  EXPECT_GT(arena->allocation_size(), kSize);
  auto fd = arena->Export();
  ASSERT_TRUE(fd.ok());
  auto mapping = ArenaMapping::Map(std::move(fd).value(), Device::Cuda(kDevice), kSize);
  ASSERT_TRUE(mapping.ok()) << mapping.status().ToString();
  ExpectContents(**mapping, Pattern(kSize, 4));
}

TEST_F(CudaArenaTest, EachExportMapsTheSameBytes) {
  constexpr uint64_t kSize = 3 * kMiB;
  auto arena = SealedArena(kSize, 8);
  ASSERT_NE(arena, nullptr);
  auto a = arena->Export();
  auto b = arena->Export();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(a->get(), b->get());
  auto ma = ArenaMapping::Map(std::move(a).value(), Device::Cuda(kDevice), kSize);
  auto mb = ArenaMapping::Map(std::move(b).value(), Device::Cuda(kDevice), kSize);
  ASSERT_TRUE(ma.ok()) << ma.status().ToString();
  ASSERT_TRUE(mb.ok()) << mb.status().ToString();
  ExpectContents(**ma, Pattern(kSize, 8));
  ExpectContents(**mb, Pattern(kSize, 8));
}

TEST_F(CudaArenaTest, MappingsOutliveTheArena) {
  constexpr uint64_t kSize = 6 * kMiB;
  auto arena = SealedArena(kSize, 21);
  ASSERT_NE(arena, nullptr);
  auto early = arena->Export();
  auto late = arena->Export();
  ASSERT_TRUE(early.ok() && late.ok());
  auto mapped = ArenaMapping::Map(std::move(early).value(), Device::Cuda(kDevice), kSize);
  ASSERT_TRUE(mapped.ok()) << mapped.status().ToString();
  arena.reset();  // the store drops its handle
  ExpectContents(**mapped, Pattern(kSize, 21));
  auto mapped_late = ArenaMapping::Map(std::move(late).value(), Device::Cuda(kDevice), kSize);
  ASSERT_TRUE(mapped_late.ok()) << mapped_late.status().ToString();
  ExpectContents(**mapped_late, Pattern(kSize, 21));
}

TEST_F(CudaArenaTest, MapRejectsClaimsBeyondTheAllocation) {
  constexpr uint64_t kSize = 1000;
  auto arena = SealedArena(kSize, 2);
  ASSERT_NE(arena, nullptr);
  const uint64_t allocated = arena->allocation_size();

  // Up to the allocation (padding included) is the region.
  auto fd = arena->Export();
  ASSERT_TRUE(fd.ok());
  auto whole = ArenaMapping::Map(std::move(fd).value(), Device::Cuda(kDevice), allocated);
  ASSERT_TRUE(whole.ok()) << whole.status().ToString();

  fd = arena->Export();
  ASSERT_TRUE(fd.ok());
  auto beyond = ArenaMapping::Map(std::move(fd).value(), Device::Cuda(kDevice), allocated + 1);
  ASSERT_FALSE(beyond.ok());
  EXPECT_EQ(beyond.status().code(), StatusCode::kInvalidArgument) << beyond.status().ToString();
  EXPECT_NE(beyond.status().message().find(std::to_string(allocated + 1)), std::string::npos)
      << beyond.status().message();
  std::cout << "claim beyond the allocation: " << beyond.status().ToString() << "\n";

  fd = arena->Export();
  ASSERT_TRUE(fd.ok());
  auto absurd = ArenaMapping::Map(std::move(fd).value(), Device::Cuda(kDevice), uint64_t{1} << 50);
  ASSERT_FALSE(absurd.ok());
  EXPECT_EQ(absurd.status().code(), StatusCode::kInvalidArgument) << absurd.status().ToString();

  fd = arena->Export();
  ASSERT_TRUE(fd.ok());
  auto empty = ArenaMapping::Map(std::move(fd).value(), Device::Cuda(kDevice), 0);
  ASSERT_FALSE(empty.ok());
  EXPECT_EQ(empty.status().code(), StatusCode::kInvalidArgument);

  // The arena still maps correctly after the refused attempts.
  fd = arena->Export();
  ASSERT_TRUE(fd.ok());
  auto mapping = ArenaMapping::Map(std::move(fd).value(), Device::Cuda(kDevice), kSize);
  ASSERT_TRUE(mapping.ok()) << mapping.status().ToString();
  ExpectContents(**mapping, Pattern(kSize, 2));
}

TEST_F(CudaArenaTest, MapRejectsADescriptorThatIsNoCudaExport) {
  int memfd = ::memfd_create("not-a-cuda-arena", MFD_CLOEXEC);
  ASSERT_GE(memfd, 0);
  ASSERT_EQ(::ftruncate(memfd, 2 * kMiB), 0);
  auto mapping = ArenaMapping::Map(UniqueFd(memfd), Device::Cuda(kDevice), 2 * kMiB);
  ASSERT_FALSE(mapping.ok());
  EXPECT_EQ(mapping.status().code(), StatusCode::kInvalidArgument) << mapping.status().ToString();
  std::cout << "memfd mapped as a CUDA arena: " << mapping.status().ToString() << "\n";
}

TEST_F(CudaArenaTest, LifecycleErrors) {
  auto zero = Arena::Create(Device::Cuda(kDevice), 0);
  ASSERT_FALSE(zero.ok());
  EXPECT_EQ(zero.status().code(), StatusCode::kInvalidArgument);
  auto missing = Arena::Create(Device::Cuda(1000), kMiB);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kInvalidArgument) << missing.status().ToString();

  constexpr uint64_t kSize = 2 * kMiB;
  auto arena = Arena::Create(Device::Cuda(kDevice), kSize);
  ASSERT_TRUE(arena.ok()) << arena.status().ToString();
  EXPECT_EQ((*arena)->Export().status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ((*arena)->OpenWriter(0, kMiB).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*arena)->OpenWriter(1, 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*arena)->OpenWriter(1, uint64_t{2} << 30).status().code(),
            StatusCode::kInvalidArgument);

  auto writer = (*arena)->OpenWriter(2, kMiB);
  ASSERT_TRUE(writer.ok());
  ArenaWriter& w = **writer;
  EXPECT_EQ(w.Begin(2, 0, 1).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(w.Begin(0, 0, kMiB + 1).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(w.Begin(0, kSize - 10, 11).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(w.Begin(0, UINT64_MAX, 2).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(w.End(0).code(), StatusCode::kFailedPrecondition);  // no Begin yet

  auto first = w.Begin(0, 0, 16);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_EQ(w.Begin(0, 16, 16).status().code(), StatusCode::kFailedPrecondition);
  std::memset(first->data(), 0x42, 16);
  EXPECT_TRUE(w.End(0).ok());
  EXPECT_TRUE(w.Finish().ok());

  ASSERT_TRUE((*arena)->Seal().ok());
  EXPECT_EQ((*arena)->Seal().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(w.Begin(0, 0, 16).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ((*arena)->OpenWriter(1, kMiB).status().code(), StatusCode::kFailedPrecondition);

  auto fd = (*arena)->Export();
  ASSERT_TRUE(fd.ok()) << fd.status().ToString();
  auto mapping = ArenaMapping::Map(std::move(fd).value(), Device::Cuda(kDevice), 16);
  ASSERT_TRUE(mapping.ok()) << mapping.status().ToString();
  ExpectContents(**mapping, std::vector<std::byte>(16, std::byte{0x42}));
}

TEST_F(CudaArenaTest, WriterOutlivingTheArenaIsRefused) {
  auto arena = Arena::Create(Device::Cuda(kDevice), kMiB);
  ASSERT_TRUE(arena.ok());
  auto writer = (*arena)->OpenWriter(1, 4096);
  ASSERT_TRUE(writer.ok());
  auto chunk = (*writer)->Begin(0, 0, 4096);
  ASSERT_TRUE(chunk.ok());
  EXPECT_TRUE((*writer)->End(0).ok());
  arena->reset();  // waits for the queued copy, then unmaps
  EXPECT_EQ((*writer)->Begin(0, 4096, 4096).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE((*writer)->Finish().ok());
}

TEST_F(CudaArenaTest, AnotherProcessReadsThroughItsReadOnlyMapping) {
  constexpr uint64_t kSize = 16 * kMiB + 3;
  auto arena = SealedArena(kSize, 33);
  ASSERT_NE(arena, nullptr);
  auto fd = arena->Export();
  ASSERT_TRUE(fd.ok());
  ProbeRun run = RunProbe("sum", *fd, kSize);
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_NE(run.output.find("sum=" + std::to_string(ByteSum(Pattern(kSize, 33)))),
            std::string::npos)
      << run.output;
}

TEST_F(CudaArenaTest, AnotherProcessCannotWriteAndTheArenaSurvives) {
  constexpr uint64_t kSize = 64 * kMiB;
  auto arena = SealedArena(kSize, 44);
  ASSERT_NE(arena, nullptr);
  const std::vector<std::byte> expected = Pattern(kSize, 44);
  auto own_fd = arena->Export();
  ASSERT_TRUE(own_fd.ok());
  auto own = ArenaMapping::Map(std::move(own_fd).value(), Device::Cuda(kDevice), kSize);
  ASSERT_TRUE(own.ok()) << own.status().ToString();

  auto fd = arena->Export();
  ASSERT_TRUE(fd.ok());
  ProbeRun writer = RunProbe("write", *fd, kSize);
  EXPECT_EQ(writer.term_signal, 0) << writer.output;
  EXPECT_EQ(writer.exit_code, 3) << writer.output;
  std::string lower = writer.output;
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  EXPECT_NE(lower.find("illegal"), std::string::npos) << writer.output;
  std::cout << "write probe said: " << writer.output;

  // This process's context is untouched, and so are the bytes.
  ExpectContents(**own, expected);
  ProbeRun reader = RunProbe("sum", *fd, kSize);
  EXPECT_EQ(reader.exit_code, 0) << reader.output;
  EXPECT_NE(reader.output.find("sum=" + std::to_string(ByteSum(expected))), std::string::npos)
      << reader.output;
}

uint64_t NumberAfter(const std::string& text, const std::string& key) {
  size_t at = text.find(key);
  if (at == std::string::npos) return 0;
  return std::stoull(text.substr(at + key.size()));
}

TEST_F(CudaArenaTest, StackSizeComesFromTheEnvironment) {
  constexpr uint64_t kSize = kMiB;
  auto arena = SealedArena(kSize, 1);
  ASSERT_NE(arena, nullptr);
  auto fd = arena->Export();
  ASSERT_TRUE(fd.ok());
  // An empty value counts as unset.
  ProbeRun by_default = RunProbe("sum", *fd, kSize, {"HEARTH_CUDA_STACK_SIZE="});
  ASSERT_EQ(by_default.exit_code, 0) << by_default.output;
  ProbeRun lowered = RunProbe("sum", *fd, kSize, {"HEARTH_CUDA_STACK_SIZE=256"});
  ASSERT_EQ(lowered.exit_code, 0) << lowered.output;
  uint64_t default_stack = NumberAfter(by_default.output, "stack=");
  uint64_t lowered_stack = NumberAfter(lowered.output, "stack=");
  std::cout << "stack size: default " << default_stack << ", with HEARTH_CUDA_STACK_SIZE=256 "
            << lowered_stack << "\n";
  EXPECT_GT(default_stack, 0u);
  EXPECT_LT(lowered_stack, default_stack);

  ProbeRun bad = RunProbe("sum", *fd, kSize, {"HEARTH_CUDA_STACK_SIZE=lots"});
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("HEARTH_CUDA_STACK_SIZE"), std::string::npos) << bad.output;
}

TEST_F(CudaArenaTest, NothingLeaksOnTheDevice) {
  auto cu = CudaDriver::Get();
  ASSERT_TRUE(cu.ok());
  ASSERT_TRUE(MakeContextCurrent(kDevice).ok());
  size_t free_before = 0;
  size_t total = 0;
  ASSERT_TRUE(CuCheck(**cu, (*cu)->MemGetInfo(&free_before, &total), "cuMemGetInfo").ok());
  constexpr uint64_t kSize = 512 * kMiB;
  for (int round = 0; round < 3; ++round) {
    auto arena = Arena::Create(Device::Cuda(kDevice), kSize);
    ASSERT_TRUE(arena.ok()) << arena.status().ToString();
    {
      auto writer = (*arena)->OpenWriter(2, 4 * kMiB);
      ASSERT_TRUE(writer.ok());
      auto chunk = (*writer)->Begin(1, kSize - 4 * kMiB, 4 * kMiB);
      ASSERT_TRUE(chunk.ok());
      std::memset(chunk->data(), round, chunk->size());
      ASSERT_TRUE((*writer)->End(1).ok());
    }
    ASSERT_TRUE((*arena)->Seal().ok());
    auto unused = (*arena)->Export();
    auto fd = (*arena)->Export();
    ASSERT_TRUE(unused.ok() && fd.ok());
    auto mapping = ArenaMapping::Map(std::move(fd).value(), Device::Cuda(kDevice), kSize);
    ASSERT_TRUE(mapping.ok()) << mapping.status().ToString();
    std::vector<std::byte> last(16);
    ASSERT_TRUE((*mapping)->CopyToHost(kSize - 16, last).ok());
    EXPECT_EQ(last, std::vector<std::byte>(16, static_cast<std::byte>(round)));
  }
  ASSERT_TRUE(MakeContextCurrent(kDevice).ok());
  size_t free_after = 0;
  ASSERT_TRUE(CuCheck(**cu, (*cu)->MemGetInfo(&free_after, &total), "cuMemGetInfo").ok());
  const int64_t lost = static_cast<int64_t>(free_before) - static_cast<int64_t>(free_after);
  std::cout << "device memory lost over 3 rounds of 512 MiB: " << lost << " bytes\n";
  EXPECT_LT(lost, int64_t{64} << 20);
}

TEST_F(CudaArenaTest, CuCheckNamesTheError) {
  auto cu = CudaDriver::Get();
  ASSERT_TRUE(cu.ok());
  EXPECT_TRUE(CuCheck(**cu, CUDA_SUCCESS, "nothing").ok());
  Status oom = CuCheck(**cu, CUDA_ERROR_OUT_OF_MEMORY, "cuMemCreate of 1 TiB");
  EXPECT_EQ(oom.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(oom.message().rfind("cuMemCreate of 1 TiB: CUDA_ERROR_OUT_OF_MEMORY (", 0), 0u)
      << oom.message();
  EXPECT_EQ(MakeContextCurrent(-1).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace hearth
