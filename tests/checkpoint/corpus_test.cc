// Every file in corpus/ (written by make_corpus.py) breaks one rule of the
// format; corpus/EXPECTED says which error Checkpoint::Open must give.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>

#include "hearth/checkpoint.h"

namespace hearth {
namespace {

using ::testing::HasSubstr;

const std::string kCorpusDir = HEARTH_CHECKPOINT_CORPUS_DIR;

// File name -> substring its error must contain.
std::map<std::string, std::string> ReadExpected() {
  std::map<std::string, std::string> expected;
  std::ifstream in(kCorpusDir + "/EXPECTED");
  EXPECT_TRUE(in) << "cannot read " << kCorpusDir << "/EXPECTED";
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    const size_t space = line.find(' ');
    EXPECT_NE(space, std::string::npos) << "malformed EXPECTED line: " << line;
    if (space == std::string::npos) continue;
    EXPECT_TRUE(expected.emplace(line.substr(0, space), line.substr(space + 1)).second)
        << "listed twice: " << line;
  }
  return expected;
}

TEST(CheckpointCorpus, EveryMalformedFileIsRejectedWithItsError) {
  const std::map<std::string, std::string> expected = ReadExpected();
  EXPECT_GE(expected.size(), 20u);
  for (const auto& [file, substring] : expected) {
    const std::string path = kCorpusDir + "/" + file;
    Result<Checkpoint> checkpoint = Checkpoint::Open(path);
    if (checkpoint.ok()) {
      ADD_FAILURE() << file << " was accepted";
      continue;
    }
    EXPECT_EQ(checkpoint.status().code(), StatusCode::kInvalidArgument)
        << file << ": " << checkpoint.status().ToString();
    EXPECT_THAT(checkpoint.status().message(), HasSubstr(path)) << file;
    EXPECT_THAT(checkpoint.status().message(), HasSubstr(substring)) << file;
  }
}

TEST(CheckpointCorpus, EveryFileIsListedInExpected) {
  const std::map<std::string, std::string> expected = ReadExpected();
  size_t files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(kCorpusDir)) {
    const std::string name = entry.path().filename().string();
    if (name == "EXPECTED") continue;
    ++files;
    EXPECT_TRUE(expected.count(name)) << name << " has no line in EXPECTED";
  }
  EXPECT_EQ(files, expected.size());
}

}  // namespace
}  // namespace hearth
