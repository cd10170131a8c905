// A repository load's overrides: the config as Triton's JSON becomes
// config.pbtxt text; files are checked (paths, counts, bytes) and written
// with it into a private directory; nothing is left behind when refused.
#include "server/load_overrides.h"

#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "gtest/gtest.h"
#include "support/test_store.h"

namespace hearth {
namespace {

constexpr const char* kConfig = R"({"name":"m","backend":"python","max_batch_size":4,)"
                                R"("input":[{"name":"x","data_type":"TYPE_FP32","dims":[2]}],)"
                                R"("output":[{"name":"y","data_type":"TYPE_FP32","dims":[2]}]})";

std::string Read(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

#ifdef HEARTH_HAVE_PROTOBUF

TEST(LoadOverrides, AConfigAloneBecomesPbtxtText) {
  testing::TempDir tmp;
  ModelLoadOverrides o;
  o.config_json = kConfig;
  auto p = PrepareLoadOverrides(o, "m", tmp.File("root"), 1);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_TRUE(p->dir.empty());
  EXPECT_NE(p->pbtxt.find("backend: \"python\""), std::string::npos) << p->pbtxt;
  EXPECT_NE(p->pbtxt.find("max_batch_size: 4"), std::string::npos) << p->pbtxt;
  EXPECT_FALSE(std::filesystem::exists(tmp.File("root"))) << "nothing written without files";
}

TEST(LoadOverrides, FilesAreWrittenPrivatelyWithTheConfig) {
  testing::TempDir tmp;
  ModelLoadOverrides o;
  o.config_json = kConfig;
  o.files = {{"1/model.py", "print('hi')\n"}, {"1/data/table.bin", std::string("\0\1\2", 3)}};
  auto p = PrepareLoadOverrides(o, "m", tmp.File("root"), 7);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->dir, tmp.File("root") + "/7/m");
  EXPECT_EQ(Read(p->dir + "/1/model.py"), "print('hi')\n");
  EXPECT_EQ(Read(p->dir + "/1/data/table.bin"), std::string("\0\1\2", 3));
  EXPECT_EQ(Read(p->dir + "/config.pbtxt"), p->pbtxt);
  struct stat st {};
  ASSERT_EQ(::stat(p->dir.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  ASSERT_EQ(::stat((p->dir + "/1/model.py").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  RemoveOverrideDirectory(p->dir);
  EXPECT_FALSE(std::filesystem::exists(tmp.File("root") + "/7"));
}

TEST(LoadOverrides, BadOverridesAreRefusedByNameLeavingNothing) {
  testing::TempDir tmp;
  const std::string root = tmp.File("root");
  struct Case {
    ModelLoadOverrides o;
    std::string says;
  };
  auto files = [](std::vector<std::pair<std::string, std::string>> f) {
    ModelLoadOverrides o;
    o.config_json = kConfig;
    o.files = std::move(f);
    return o;
  };
  ModelLoadOverrides no_config;
  no_config.files = {{"1/model.py", "x"}};
  ModelLoadOverrides bad_json;
  bad_json.config_json = R"({"backend":"python","optimization":{}})";
  ModelLoadOverrides not_json;
  not_json.config_json = "backend: python";
  std::vector<std::pair<std::string, std::string>> many;
  for (size_t i = 0; i <= kMaxOverrideFiles; ++i) many.push_back({"1/f" + std::to_string(i), ""});
  const std::vector<Case> cases = {
      {no_config, "file overrides need the model's config too"},
      {bad_json, "optimization"},
      {not_json, "the config override is not a model configuration hearth reads"},
      {files({{"../escape", "x"}}), "'..'"},
      {files({{"/etc/passwd", "x"}}), "must be relative"},
      {files({{"1//model.py", "x"}}), "empty, '.' or '..' component"},
      {files({{"1/./model.py", "x"}}), "empty, '.' or '..' component"},
      {files({{"", "x"}}), "empty path"},
      {files({{std::string("1/a\0b", 5), "x"}}), "NUL"},
      {files({{"config.pbtxt", "x"}}), "the config comes from the 'config' override"},
      {files({{"1/model.py", "a"}, {"1/model.py", "b"}}), "given twice"},
      {files({{"1", "a"}, {"1/model.py", "b"}}), "is also a directory of"},
      {files({{"1/big", std::string(kMaxOverrideBytes + 1, 'x')}}), "more than the limit"},
      {files(many), "more than 256 file overrides"},
  };
  for (const Case& c : cases) {
    auto p = PrepareLoadOverrides(c.o, "m", root, 1);
    ASSERT_FALSE(p.ok()) << c.says;
    EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument) << p.status().ToString();
    EXPECT_NE(p.status().message().find(c.says), std::string::npos)
        << "got: " << p.status().message() << "\nwant: " << c.says;
  }
  EXPECT_FALSE(std::filesystem::exists(root + "/1"));
}

#else

TEST(LoadOverrides, AConfigNeedsProtobuf) {
  testing::TempDir tmp;
  ModelLoadOverrides o;
  o.config_json = kConfig;
  auto p = PrepareLoadOverrides(o, "m", tmp.File("root"), 1);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("needs protobuf"), std::string::npos);
}

#endif

}  // namespace
}  // namespace hearth
