// Host arenas, PackOffsets, and the CUDA entry points on a machine without
// CUDA. The CUDA arenas themselves are tested in memory_cuda_test.cc.
//
// This process never initialises CUDA, so it may fork (death tests).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "hearth/arena.h"

namespace hearth {
namespace {

constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();

std::byte PatternByte(uint64_t i, uint8_t seed) {
  return static_cast<std::byte>(((i * 131) ^ (i >> 9) ^ seed) & 0xff);
}

std::vector<std::byte> Pattern(uint64_t size, uint8_t seed) {
  std::vector<std::byte> bytes(size);
  for (uint64_t i = 0; i < size; ++i) bytes[i] = PatternByte(i, seed);
  return bytes;
}

// Fills `arena` with Pattern(arena.size(), seed) through a writer of
// `threads` slots, each slot on its own thread, chunks dealt round-robin.
void FillArena(Arena& arena, int threads, uint64_t max_chunk, uint8_t seed) {
  auto writer = arena.OpenWriter(threads, max_chunk);
  ASSERT_TRUE(writer.ok()) << writer.status().ToString();
  const uint64_t size = arena.size();
  const uint64_t chunks = (size + max_chunk - 1) / max_chunk;
  std::vector<std::string> errors(static_cast<size_t>(threads));
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      for (uint64_t c = static_cast<uint64_t>(t); c < chunks; c += static_cast<uint64_t>(threads)) {
        uint64_t offset = c * max_chunk;
        uint64_t len = std::min(max_chunk, size - offset);
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

std::unique_ptr<Arena> SealedHostArena(uint64_t size, uint8_t seed) {
  auto arena = Arena::Create(Device::Host(), size);
  EXPECT_TRUE(arena.ok()) << arena.status().ToString();
  if (!arena.ok()) return nullptr;
  if (size > 0) FillArena(**arena, 2, 4096, seed);
  Status sealed = (*arena)->Seal();
  EXPECT_TRUE(sealed.ok()) << sealed.ToString();
  return std::move(arena).value();
}

// ---- PackOffsets -----------------------------------------------------------

TEST(PackOffsetsTest, AlignsEveryRegion) {
  uint64_t total = 0;
  auto offsets = PackOffsets({1, 256, 257, 3}, 256, &total);
  ASSERT_TRUE(offsets.ok()) << offsets.status().ToString();
  EXPECT_EQ(*offsets, (std::vector<uint64_t>{0, 256, 512, 1024}));
  EXPECT_EQ(total, 1027u);
}

TEST(PackOffsetsTest, ZeroSizesAndEmptyInput) {
  uint64_t total = 99;
  auto offsets = PackOffsets({0, 0, 5, 0}, 64, &total);
  ASSERT_TRUE(offsets.ok());
  EXPECT_EQ(*offsets, (std::vector<uint64_t>{0, 0, 0, 64}));
  EXPECT_EQ(total, 64u);

  auto none = PackOffsets({}, kArenaAlignment, &total);
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
  EXPECT_EQ(total, 0u);
}

TEST(PackOffsetsTest, AlignmentOfOneIsDense) {
  uint64_t total = 0;
  auto offsets = PackOffsets({3, 5, 7}, 1, &total);
  ASSERT_TRUE(offsets.ok());
  EXPECT_EQ(*offsets, (std::vector<uint64_t>{0, 3, 8}));
  EXPECT_EQ(total, 15u);
}

TEST(PackOffsetsTest, RejectsBadAlignment) {
  uint64_t total = 0;
  for (uint64_t alignment : {uint64_t{0}, uint64_t{3}, uint64_t{100}}) {
    auto offsets = PackOffsets({1}, alignment, &total);
    ASSERT_FALSE(offsets.ok()) << alignment;
    EXPECT_EQ(offsets.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(offsets.status().message().find("power of two"), std::string::npos);
  }
}

TEST(PackOffsetsTest, DetectsOverflow) {
  uint64_t total = 0;
  auto sum = PackOffsets({kMax - 10, 20}, 1, &total);
  ASSERT_FALSE(sum.ok());
  EXPECT_EQ(sum.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(sum.status().message().find("overflows"), std::string::npos);

  // The region fits, but aligning the next one past it does not.
  auto align = PackOffsets({kMax - 100, 0}, 256, &total);
  ASSERT_FALSE(align.ok());

  auto single = PackOffsets({kMax}, 256, &total);
  ASSERT_TRUE(single.ok());
  EXPECT_EQ(total, kMax);
}

// ---- CUDA entry points -----------------------------------------------------

TEST(CudaEntryPointsTest, UnavailableCudaIsExplained) {
  std::string why;
  if (CudaAvailable(&why)) {
    EXPECT_EQ(DefaultDevice(), Device::Cuda(0));
    GTEST_SKIP() << "CUDA is available here; memory_cuda_test covers it";
  }
  std::cout << "CudaAvailable() is false: " << why << "\n";
  EXPECT_FALSE(why.empty());
  EXPECT_EQ(DefaultDevice(), Device::Host());
  auto arena = Arena::Create(Device::Cuda(0), 1 << 20);
  ASSERT_FALSE(arena.ok());
  EXPECT_EQ(arena.status().code(), StatusCode::kUnavailable) << arena.status().ToString();

  int fd = ::memfd_create("not-an-arena", MFD_CLOEXEC);
  ASSERT_GE(fd, 0);
  auto mapping = ArenaMapping::Map(UniqueFd(fd), Device::Cuda(0), 1 << 20);
  ASSERT_FALSE(mapping.ok());
  EXPECT_EQ(mapping.status().code(), StatusCode::kUnavailable) << mapping.status().ToString();
}

// ---- Host arenas -----------------------------------------------------------

TEST(HostArenaTest, WriteSealExportMapRoundTrip) {
  constexpr uint64_t kSize = 1 << 20;
  auto arena = Arena::Create(Device::Host(), kSize);
  ASSERT_TRUE(arena.ok()) << arena.status().ToString();
  EXPECT_EQ((*arena)->device(), Device::Host());
  EXPECT_EQ((*arena)->size(), kSize);
  EXPECT_EQ((*arena)->allocation_size(), kSize);
  FillArena(**arena, 4, 64 * 1024 + 3, 7);
  ASSERT_TRUE((*arena)->Seal().ok());

  auto fd = (*arena)->Export();
  ASSERT_TRUE(fd.ok()) << fd.status().ToString();
  auto mapping = ArenaMapping::Map(std::move(fd).value(), Device::Host(), kSize);
  ASSERT_TRUE(mapping.ok()) << mapping.status().ToString();
  EXPECT_EQ((*mapping)->size(), kSize);
  EXPECT_EQ((*mapping)->device(), Device::Host());

  std::vector<std::byte> expected = Pattern(kSize, 7);
  EXPECT_EQ(std::memcmp((*mapping)->data(), expected.data(), kSize), 0);

  std::vector<std::byte> copy(1000);
  ASSERT_TRUE((*mapping)->CopyToHost(kSize - 1000, copy).ok());
  EXPECT_EQ(std::memcmp(copy.data(), expected.data() + kSize - 1000, 1000), 0);
  Status outside = (*mapping)->CopyToHost(kSize - 999, copy);
  EXPECT_EQ(outside.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*mapping)->CopyToHost(kMax, copy).code(), StatusCode::kInvalidArgument);
}

TEST(HostArenaTest, MappingOutlivesArenaAndDescriptor) {
  constexpr uint64_t kSize = 3 * 4096 + 17;
  auto arena = SealedHostArena(kSize, 3);
  ASSERT_NE(arena, nullptr);
  auto fd = arena->Export();
  ASSERT_TRUE(fd.ok());
  arena.reset();
  auto mapping = ArenaMapping::Map(std::move(fd).value(), Device::Host(), kSize);
  ASSERT_TRUE(mapping.ok()) << mapping.status().ToString();
  std::vector<std::byte> expected = Pattern(kSize, 3);
  EXPECT_EQ(std::memcmp((*mapping)->data(), expected.data(), kSize), 0);
}

TEST(HostArenaTest, EachExportIsANewDescriptor) {
  auto arena = SealedHostArena(4096, 1);
  ASSERT_NE(arena, nullptr);
  auto a = arena->Export();
  auto b = arena->Export();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(a->get(), b->get());
  auto ma = ArenaMapping::Map(std::move(a).value(), Device::Host(), 4096);
  auto mb = ArenaMapping::Map(std::move(b).value(), Device::Host(), 4096);
  ASSERT_TRUE(ma.ok() && mb.ok());
  EXPECT_EQ(std::memcmp((*ma)->data(), (*mb)->data(), 4096), 0);
}

TEST(HostArenaTest, ExportedDescriptorIsReadOnlyAndCloseOnExec) {
  auto arena = SealedHostArena(8192, 2);
  ASSERT_NE(arena, nullptr);
  auto fd = arena->Export();
  ASSERT_TRUE(fd.ok());
  int fl = ::fcntl(fd->get(), F_GETFL);
  ASSERT_GE(fl, 0);
  EXPECT_EQ(fl & O_ACCMODE, O_RDONLY);
  EXPECT_NE(::fcntl(fd->get(), F_GETFD) & FD_CLOEXEC, 0);

  errno = 0;
  void* writable = ::mmap(nullptr, 8192, PROT_READ | PROT_WRITE, MAP_SHARED, fd->get(), 0);
  EXPECT_EQ(writable, MAP_FAILED);
  EXPECT_EQ(errno, EACCES);
  if (writable != MAP_FAILED) ::munmap(writable, 8192);

  char byte = 1;
  EXPECT_EQ(::pwrite(fd->get(), &byte, 1, 0), -1);
  EXPECT_NE(::ftruncate(fd->get(), 0), 0);
  EXPECT_NE(::ftruncate(fd->get(), 1 << 20), 0);
}

TEST(HostArenaTest, SealsHoldEvenForAWritableDescription) {
  auto arena = SealedHostArena(8192, 2);
  ASSERT_NE(arena, nullptr);
  auto fd = arena->Export();
  ASSERT_TRUE(fd.ok());
  int seals = ::fcntl(fd->get(), F_GET_SEALS);
  ASSERT_GE(seals, 0);
  EXPECT_EQ(seals & F_SEAL_WRITE, F_SEAL_WRITE);
  EXPECT_EQ(seals & F_SEAL_SHRINK, F_SEAL_SHRINK);
  EXPECT_EQ(seals & F_SEAL_GROW, F_SEAL_GROW);
  EXPECT_EQ(seals & F_SEAL_SEAL, F_SEAL_SEAL);
  // F_SEAL_SEAL: nobody can lift or add seals.
  EXPECT_NE(::fcntl(fd->get(), F_ADD_SEALS, F_SEAL_FUTURE_WRITE), 0);

  // Reopen read-write, as a peer holding the descriptor could: the seals,
  // not the access mode, now refuse every change.
  std::string path = "/proc/self/fd/" + std::to_string(fd->get());
  UniqueFd rw(::open(path.c_str(), O_RDWR | O_CLOEXEC));
  ASSERT_TRUE(rw.valid()) << std::strerror(errno);
  char byte = 1;
  errno = 0;
  EXPECT_EQ(::pwrite(rw.get(), &byte, 1, 0), -1);
  EXPECT_EQ(errno, EPERM);
  errno = 0;
  EXPECT_NE(::ftruncate(rw.get(), 4096), 0);
  EXPECT_EQ(errno, EPERM);
  errno = 0;
  EXPECT_NE(::ftruncate(rw.get(), 1 << 20), 0);
  EXPECT_EQ(errno, EPERM);
  errno = 0;
  void* writable = ::mmap(nullptr, 8192, PROT_READ | PROT_WRITE, MAP_SHARED, rw.get(), 0);
  EXPECT_EQ(writable, MAP_FAILED);
  EXPECT_EQ(errno, EPERM);
  if (writable != MAP_FAILED) ::munmap(writable, 8192);
}

TEST(HostArenaDeathTest, WritingThroughTheMappingFaults) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto arena = SealedHostArena(4096, 5);
  ASSERT_NE(arena, nullptr);
  auto fd = arena->Export();
  ASSERT_TRUE(fd.ok());
  auto mapping = ArenaMapping::Map(std::move(fd).value(), Device::Host(), 4096);
  ASSERT_TRUE(mapping.ok());
  volatile std::byte* bytes =
      const_cast<volatile std::byte*>(static_cast<const volatile std::byte*>((*mapping)->data()));
  const std::byte before = bytes[10];
  EXPECT_EXIT(
      {
        bytes[10] = std::byte{0x5a};
        std::_Exit(0);
      },
      ::testing::KilledBySignal(SIGSEGV), "");
  const std::byte after = bytes[10];
  EXPECT_EQ(after, before);
}

TEST(HostArenaTest, MapRejectsAClaimLargerThanTheRegion) {
  auto arena = SealedHostArena(4096, 1);
  ASSERT_NE(arena, nullptr);
  auto fd = arena->Export();
  ASSERT_TRUE(fd.ok());
  auto mapping = ArenaMapping::Map(std::move(fd).value(), Device::Host(), 4097);
  ASSERT_FALSE(mapping.ok());
  EXPECT_EQ(mapping.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(mapping.status().message().find("4097"), std::string::npos)
      << mapping.status().message();
  EXPECT_NE(mapping.status().message().find("4096"), std::string::npos)
      << mapping.status().message();
}

TEST(HostArenaTest, MapOfASmallerClaimMapsOnlyThat) {
  auto arena = SealedHostArena(3 * 4096, 9);
  ASSERT_NE(arena, nullptr);
  auto fd = arena->Export();
  ASSERT_TRUE(fd.ok());
  auto mapping = ArenaMapping::Map(std::move(fd).value(), Device::Host(), 100);
  ASSERT_TRUE(mapping.ok());
  EXPECT_EQ((*mapping)->size(), 100u);
  std::vector<std::byte> out(101);
  EXPECT_EQ((*mapping)->CopyToHost(0, out).code(), StatusCode::kInvalidArgument);
}

TEST(HostArenaTest, MapRejectsUnsealedAndForeignDescriptors) {
  int memfd = ::memfd_create("unsealed", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_GE(memfd, 0);
  ASSERT_EQ(::ftruncate(memfd, 4096), 0);
  auto unsealed = ArenaMapping::Map(UniqueFd(memfd), Device::Host(), 4096);
  ASSERT_FALSE(unsealed.ok());
  EXPECT_EQ(unsealed.status().code(), StatusCode::kFailedPrecondition);

  int pipes[2];
  ASSERT_EQ(::pipe2(pipes, O_CLOEXEC), 0);
  UniqueFd write_end(pipes[1]);
  auto pipe = ArenaMapping::Map(UniqueFd(pipes[0]), Device::Host(), 1);
  ASSERT_FALSE(pipe.ok());
  EXPECT_EQ(pipe.status().code(), StatusCode::kInvalidArgument);

  auto invalid = ArenaMapping::Map(UniqueFd(), Device::Host(), 1);
  ASSERT_FALSE(invalid.ok());
  EXPECT_EQ(invalid.status().code(), StatusCode::kInvalidArgument);
}

TEST(HostArenaTest, EmptyArenaWorks) {
  auto arena = Arena::Create(Device::Host(), 0);
  ASSERT_TRUE(arena.ok()) << arena.status().ToString();
  auto writer = (*arena)->OpenWriter(1, 1);
  ASSERT_TRUE(writer.ok());
  auto empty = (*writer)->Begin(0, 0, 0);
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(empty->empty());
  EXPECT_TRUE((*writer)->End(0).ok());
  EXPECT_FALSE((*writer)->Begin(0, 0, 1).ok());
  EXPECT_TRUE((*writer)->Finish().ok());
  ASSERT_TRUE((*arena)->Seal().ok());
  auto fd = (*arena)->Export();
  ASSERT_TRUE(fd.ok()) << fd.status().ToString();
  auto mapping = ArenaMapping::Map(std::move(fd).value(), Device::Host(), 0);
  ASSERT_TRUE(mapping.ok()) << mapping.status().ToString();
  EXPECT_NE((*mapping)->data(), nullptr);
  EXPECT_EQ((*mapping)->size(), 0u);
  EXPECT_TRUE((*mapping)->CopyToHost(0, {}).ok());
}

TEST(HostArenaTest, ExportBeforeSealFails) {
  auto arena = Arena::Create(Device::Host(), 4096);
  ASSERT_TRUE(arena.ok());
  auto fd = (*arena)->Export();
  ASSERT_FALSE(fd.ok());
  EXPECT_EQ(fd.status().code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE((*arena)->Seal().ok());
  EXPECT_EQ((*arena)->Seal().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE((*arena)->Export().ok());
}

TEST(HostArenaTest, WriterRejectsBadArguments) {
  auto arena = Arena::Create(Device::Host(), 4096);
  ASSERT_TRUE(arena.ok());
  EXPECT_EQ((*arena)->OpenWriter(0, 1024).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*arena)->OpenWriter(1, 0).status().code(), StatusCode::kInvalidArgument);

  auto writer = (*arena)->OpenWriter(2, 1024);
  ASSERT_TRUE(writer.ok());
  ArenaWriter& w = **writer;
  EXPECT_EQ(w.Begin(-1, 0, 1).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(w.Begin(2, 0, 1).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(w.End(2).code(), StatusCode::kInvalidArgument);
  auto too_long = w.Begin(0, 0, 1025);
  ASSERT_FALSE(too_long.ok());
  EXPECT_EQ(too_long.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(too_long.status().message().find("1025"), std::string::npos);
  EXPECT_EQ(w.Begin(0, 3073, 1024).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(w.Begin(0, 4097, 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(w.Begin(0, kMax - 1, 2).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(w.Begin(0, kMax, 1).status().code(), StatusCode::kInvalidArgument);

  auto last = w.Begin(1, 3072, 1024);
  ASSERT_TRUE(last.ok());
  EXPECT_EQ(last->size(), 1024u);
  EXPECT_TRUE(w.End(1).ok());

  ASSERT_TRUE((*arena)->Seal().ok());
  EXPECT_EQ(w.Begin(0, 0, 1).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ((*arena)->OpenWriter(1, 1024).status().code(), StatusCode::kFailedPrecondition);
}

TEST(HostArenaTest, ArenaDescriptorsAreCloseOnExec) {
  // Every descriptor the arena holds itself is a memfd; after Create the
  // process must hold no new descriptor without FD_CLOEXEC.
  auto count_inheritable = [] {
    int n = 0;
    for (int fd = 0; fd < 1024; ++fd) {
      int flags = ::fcntl(fd, F_GETFD);
      if (flags >= 0 && (flags & FD_CLOEXEC) == 0) ++n;
    }
    return n;
  };
  int before = count_inheritable();
  auto arena = SealedHostArena(4096, 1);
  ASSERT_NE(arena, nullptr);
  auto fd = arena->Export();
  ASSERT_TRUE(fd.ok());
  EXPECT_EQ(count_inheritable(), before);
}

}  // namespace
}  // namespace hearth
