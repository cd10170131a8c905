// platform::Section on Linux: a sealed memfd, shared as a read-only
// descriptor that nothing in this process can write through, and whose
// writer faults alone. (section_windows_test.cc is its Windows twin, run
// under Wine by `make windows`.)
#include "platform/section.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>

namespace hearth::platform {
namespace {

uint64_t Checksum(std::span<const std::byte> b) {
  uint64_t h = 1469598103934665603ull;
  for (std::byte x : b) h = (h ^ static_cast<uint64_t>(x)) * 1099511628211ull;
  return h;
}

constexpr uint64_t kBytes = (uint64_t{1} << 20) + 123;

TEST(Section, SharedReadOnlyWithTheSameBytes) {
  auto made = Section::Create(kBytes, "hearth-test");
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  Section& s = *made;
  ASSERT_EQ(s.writable().size(), kBytes);
  for (uint64_t i = 0; i < kBytes; ++i) s.writable()[i] = static_cast<std::byte>(i * 7 + 3);
  const uint64_t expected = Checksum(s.writable());
  EXPECT_EQ(s.ShareReadOnly(0).status().code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(s.Seal().ok());
  EXPECT_TRUE(s.writable().empty());

  for (int peer = 0; peer < 2; ++peer) {
    auto h = s.ShareReadOnly(static_cast<uint32_t>(::getpid()));
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    auto view = ReadOnlyView::Map(*h, kBytes);
    ASSERT_TRUE(view.ok()) << view.status().ToString();
    EXPECT_EQ(Checksum(view->bytes()), expected);
    const ReadOnlyView::WriteAttempts tried = view->TryToWrite();
    EXPECT_FALSE(tried.mapped_writable);
    EXPECT_FALSE(tried.protection_raised);
    EXPECT_FALSE(tried.handle_upgraded);
  }
}

TEST(Section, AWriteThroughTheViewFaultsInThatProcessAlone) {
  auto made = Section::Create(4096, "hearth-test");
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  made->writable()[7] = std::byte{1};
  ASSERT_TRUE(made->Seal().ok());
  auto h = made->ShareReadOnly(0);
  ASSERT_TRUE(h.ok());
  auto view = ReadOnlyView::Map(*h, 4096);
  ASSERT_TRUE(view.ok());
  const pid_t child = ::fork();
  if (child == 0) {
    const_cast<volatile std::byte*>(view->bytes().data())[7] = std::byte{2};
    ::_exit(0);  // not reached
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status));
  EXPECT_EQ(WTERMSIG(status), SIGSEGV);
  EXPECT_EQ(view->bytes()[7], std::byte{1});
}

TEST(Section, AViewLargerThanTheSectionIsRefused) {
  auto made = Section::Create(100, "hearth-test");
  ASSERT_TRUE(made.ok());
  ASSERT_TRUE(made->Seal().ok());
  auto h = made->ShareReadOnly(0);
  ASSERT_TRUE(h.ok());
  auto view = ReadOnlyView::Map(*h, 101);
  EXPECT_EQ(view.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(view.status().message(), "the section holds 100 bytes, fewer than the 101 expected");
  EXPECT_EQ(ReadOnlyView::Map(kNoHandle, 1).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace hearth::platform
