// PlanCache: entries kept across opens, one holder at a time, and a file or
// folder that others could write refused.
#include "backends/llm/plan_cache.h"

#include <gtest/gtest.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace hearth::llm {
namespace {

namespace fs = std::filesystem;

class PlanCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/plan-cache-XXXXXX";
    ASSERT_NE(::mkdtemp(pattern), nullptr);
    root_ = pattern;
  }
  void TearDown() override { fs::remove_all(root_); }
  std::string Read(const std::string& path) {
    std::ifstream in(path);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }
  fs::path root_;
};

TEST_F(PlanCacheTest, KeepsEntriesAcrossOpensInItsOwnFolder) {
  const std::string path = (root_ / "new" / "gemm-plans").string();
  {
    auto cache = PlanCache::Open(path);
    ASSERT_TRUE(cache.ok()) << cache.status().ToString();
    EXPECT_EQ(cache->Get("a"), std::nullopt);
    ASSERT_TRUE(cache->Put("H200 q_proj 2048x2048", "0123abcd").ok());
    ASSERT_TRUE(cache->Put("H200 k_proj 512x2048", "ff").ok());
    ASSERT_TRUE(cache->Save().ok());
  }
  struct stat st {};
  ASSERT_EQ(::stat((root_ / "new").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(Read(path), "H200 k_proj 512x2048\tff\nH200 q_proj 2048x2048\t0123abcd\n");
  auto again = PlanCache::Open(path);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->Get("H200 q_proj 2048x2048"), "0123abcd");
  EXPECT_EQ(again->Get("H200 k_proj 512x2048"), "ff");
  EXPECT_TRUE(again->notes().empty());
}

TEST_F(PlanCacheTest, RefusesBadEntriesAndDropsBadLinesSayingSo) {
  const std::string path = (root_ / "plans").string();
  {
    std::ofstream out(path);
    out << "good\tvalue\nno tab here\n\tempty key\nkey\t\nlast\twithout newline";
  }
  ::chmod(path.c_str(), 0600);
  auto cache = PlanCache::Open(path);
  ASSERT_TRUE(cache.ok()) << cache.status().ToString();
  EXPECT_EQ(cache->Get("good"), "value");
  EXPECT_EQ(cache->Get("last"), std::nullopt);
  ASSERT_EQ(cache->notes().size(), 4u);
  EXPECT_EQ(cache->notes()[0], path + " line 2 is not a key<TAB>value entry: dropped");
  EXPECT_EQ(cache->Put("a\tb", "v").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->Put("a", "v\n").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->Put("", "v").code(), StatusCode::kInvalidArgument);
  // Saving rewrites the file without the dropped lines.
  ASSERT_TRUE(cache->Save().ok());
  EXPECT_EQ(Read(path), "good\tvalue\n");
}

TEST_F(PlanCacheTest, RefusesWhatOthersCouldWrite) {
  const fs::path open_dir = root_ / "shared";
  ASSERT_EQ(::mkdir(open_dir.c_str(), 0777), 0);
  ASSERT_EQ(::chmod(open_dir.c_str(), 0777), 0);
  auto in_open_dir = PlanCache::Open((open_dir / "plans").string());
  EXPECT_EQ(in_open_dir.status().code(), StatusCode::kPermissionDenied);
  EXPECT_NE(in_open_dir.status().message().find("is writable by others"), std::string::npos);

  const std::string file = (root_ / "plans").string();
  { std::ofstream(file) << "k\tv\n"; }
  ASSERT_EQ(::chmod(file.c_str(), 0666), 0);
  auto open_file = PlanCache::Open(file);
  EXPECT_EQ(open_file.status().code(), StatusCode::kPermissionDenied);

  // A link is not followed.
  const std::string link = (root_ / "link").string();
  ASSERT_EQ(::symlink(file.c_str(), link.c_str()), 0);
  EXPECT_FALSE(PlanCache::Open(link).ok());
  // Nor is a file that is too large read.
  const std::string big = (root_ / "big").string();
  { std::ofstream(big) << std::string(PlanCache::kMaxFileBytes + 1, 'x'); }
  ASSERT_EQ(::chmod(big.c_str(), 0600), 0);
  EXPECT_EQ(PlanCache::Open(big).status().code(), StatusCode::kFailedPrecondition);
}

TEST_F(PlanCacheTest, OneHolderAtATime) {
  const std::string path = (root_ / "plans").string();
  auto cache = PlanCache::Open(path);
  ASSERT_TRUE(cache.ok()) << cache.status().ToString();
  // Another process cannot take the lock while this one holds it, and can
  // once it is released.
  const auto try_lock = [&] {
    const pid_t child = ::fork();
    if (child == 0) {
      const int fd = ::open(path.c_str(), O_RDWR);
      ::_exit(fd >= 0 && ::flock(fd, LOCK_EX | LOCK_NB) == 0 ? 0 : 1);
    }
    int status = 0;
    ::waitpid(child, &status, 0);
    return WIFEXITED(status) && WEXITSTATUS(status) == 0;
  };
  EXPECT_FALSE(try_lock());
  { PlanCache released = std::move(*cache); }
  EXPECT_TRUE(try_lock());
}

TEST(DefaultPlanCachePath, FollowsTheEnvironment) {
  const auto set = [](const char* key, const char* value) {
    if (value == nullptr) {
      ::unsetenv(key);
    } else {
      ::setenv(key, value, 1);
    }
  };
  const char* saved_home = std::getenv("HOME");
  const std::string home = saved_home != nullptr ? saved_home : "";
  set("HEARTH_CACHE_DIR", "/c");
  EXPECT_EQ(DefaultPlanCachePath("gemm"), "/c/gemm");
  set("HEARTH_CACHE_DIR", "off");
  EXPECT_EQ(DefaultPlanCachePath("gemm"), std::nullopt);
  set("HEARTH_CACHE_DIR", nullptr);
  set("XDG_CACHE_HOME", "/x");
  EXPECT_EQ(DefaultPlanCachePath("gemm"), "/x/hearth/gemm");
  set("XDG_CACHE_HOME", nullptr);
  set("HOME", "/h");
  EXPECT_EQ(DefaultPlanCachePath("gemm"), "/h/.cache/hearth/gemm");
  set("HOME", nullptr);
  EXPECT_EQ(DefaultPlanCachePath("gemm"), std::nullopt);
  if (saved_home != nullptr) set("HOME", home.c_str());
}

}  // namespace
}  // namespace hearth::llm
