// Checkpoint directories: model.safetensors alone, or shards with
// model.safetensors.index.json, as transformers' save_pretrained writes them.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>

#include "checkpoint/synthetic.h"
#include "hearth/checkpoint.h"
#include "hearth/checksum.h"
#include "temp_dir.h"

namespace hearth {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using testing_util::TempDir;

constexpr char kShard1[] = "model-00001-of-00003.safetensors";
constexpr char kShard2[] = "model-00002-of-00003.safetensors";
constexpr char kShard3[] = "model-00003-of-00003.safetensors";

std::vector<std::byte> Pattern(size_t size, uint8_t salt) {
  std::vector<std::byte> bytes(size);
  for (size_t i = 0; i < size; ++i) bytes[i] = static_cast<std::byte>(i * 7 + salt);
  return bytes;
}

void WriteFile(const std::string& path, std::string_view contents) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
}

struct Tensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<std::byte> bytes;
};

// One shard, written by the real writer.
void WriteShard(const std::string& path, const std::vector<const Tensor*>& tensors) {
  CheckpointWriter writer;
  writer.SetMetadata("format", "pt");
  for (const Tensor* t : tensors)
    ASSERT_TRUE(writer.AddTensor(t->name, t->dtype, t->shape, t->bytes).ok()) << t->name;
  Status status = writer.Write(path);
  ASSERT_TRUE(status.ok()) << status.ToString();
}

uint64_t TreeChecksum(const Checkpoint& checkpoint) {
  std::vector<uint64_t> digests;
  for (const TensorInfo& tensor : checkpoint.tensors()) {
    for (uint64_t offset = 0; offset < tensor.nbytes; offset += kChecksumBlockBytes) {
      std::vector<std::byte> block(std::min(kChecksumBlockBytes, tensor.nbytes - offset));
      EXPECT_TRUE(checkpoint.Read(tensor, offset, block).ok());
      digests.push_back(BlockDigest(block));
    }
  }
  return CombineBlockDigests(digests);
}

// A checkpoint of three shards whose tensors' names interleave across them,
// with an index written by hand so that each test can spoil it.
class ShardedCheckpointTest : public ::testing::Test {
 protected:
  ShardedCheckpointTest()
      : tensors_{
            {"model.embed_tokens.weight", DType::kBF16, {8, 4}, Pattern(64, 1)},
            {"model.layers.1.mlp.weight", DType::kF32, {3, 5}, Pattern(60, 2)},
            {"model.layers.0.attn.q.weight", DType::kF16, {4, 4}, Pattern(32, 3)},
            {"model.layers.0.attn.k.weight", DType::kF16, {2, 4}, Pattern(16, 4)},
            {"model.norm.weight", DType::kF32, {4}, Pattern(16, 5)},
            {"model.empty", DType::kI64, {0}, {}},
        } {}

  void SetUp() override {
    dir_ = tmp_.File("llama");
    ASSERT_TRUE(fs::create_directory(dir_));
    WriteShard(File(kShard1), {&tensors_[0], &tensors_[1]});
    WriteShard(File(kShard2), {&tensors_[2], &tensors_[3]});
    WriteShard(File(kShard3), {&tensors_[4], &tensors_[5]});
    WriteIndex(Index());
    // What save_pretrained writes beside the weights: never read.
    WriteFile(File("config.json"), "{\"architectures\": [\"LlamaForCausalLM\"]}");
    WriteFile(File("tokenizer.json"), "not json at all");
  }

  std::string File(std::string_view name) const { return dir_ + "/" + std::string(name); }
  std::string IndexPath() const { return File(kSafetensorsIndexFileName); }

  uint64_t TotalBytes() const {
    uint64_t total = 0;
    for (const Tensor& t : tensors_) total += t.bytes.size();
    return total;
  }

  // The true weight_map, as a map from tensor name to shard.
  std::map<std::string, std::string> WeightMap() const {
    return {{tensors_[0].name, kShard1}, {tensors_[1].name, kShard1}, {tensors_[2].name, kShard2},
            {tensors_[3].name, kShard2}, {tensors_[4].name, kShard3}, {tensors_[5].name, kShard3}};
  }

  std::string Index(const std::map<std::string, std::string>& weight_map,
                    const std::string& metadata) const {
    std::string json = "{\"metadata\": " + metadata + ", \"weight_map\": {";
    bool first = true;
    for (const auto& [tensor, shard] : weight_map) {
      if (!first) json += ", ";
      first = false;
      json += "\"" + tensor + "\": \"" + shard + "\"";
    }
    return json + "}}";
  }
  std::string Index(const std::map<std::string, std::string>& weight_map) const {
    return Index(weight_map, "{\"total_size\": " + std::to_string(TotalBytes()) + "}");
  }
  std::string Index() const { return Index(WeightMap()); }

  void WriteIndex(std::string_view json) const { WriteFile(IndexPath(), json); }

  // Open must fail, with `code`, and its message must hold `message`.
  void ExpectError(std::string_view message, StatusCode code = StatusCode::kInvalidArgument) const {
    Result<Checkpoint> checkpoint = Checkpoint::Open(dir_);
    ASSERT_FALSE(checkpoint.ok()) << "opened a broken checkpoint";
    EXPECT_EQ(checkpoint.status().code(), code) << checkpoint.status().ToString();
    EXPECT_THAT(checkpoint.status().message(), HasSubstr(std::string(message)));
  }

  TempDir tmp_;
  std::string dir_;
  std::vector<Tensor> tensors_;
};

TEST_F(ShardedCheckpointTest, HoldsEveryTensorOfEveryShardWithItsBytesSortedByName) {
  Result<Checkpoint> checkpoint = Checkpoint::Open(dir_);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  EXPECT_TRUE(checkpoint->is_directory());
  EXPECT_EQ(checkpoint->path(), dir_);
  EXPECT_EQ(checkpoint->index_path(), IndexPath());
  EXPECT_EQ(checkpoint->index_total_size(), TotalBytes());
  EXPECT_EQ(checkpoint->tensor_bytes(), TotalBytes());
  EXPECT_TRUE(checkpoint->metadata().empty()) << "metadata belongs to each shard";

  ASSERT_EQ(checkpoint->shards().size(), 3u);
  const char* names[] = {kShard1, kShard2, kShard3};
  for (size_t i = 0; i < 3; ++i) {
    const CheckpointFile& shard = checkpoint->shards()[i];
    EXPECT_EQ(shard.name, names[i]);
    EXPECT_EQ(shard.path, File(names[i]));
    EXPECT_EQ(shard.tensor_count, 2u);
    EXPECT_EQ(shard.metadata, (std::vector<std::pair<std::string, std::string>>{{"format", "pt"}}));
    EXPECT_EQ(shard.fd.valid(), i == 0) << "only the first shard's descriptor is held";
  }
  EXPECT_EQ(checkpoint->fd(), checkpoint->shards()[0].fd.get());
  const int flags = ::fcntl(checkpoint->fd(), F_GETFD);
  ASSERT_GE(flags, 0);
  EXPECT_TRUE(flags & FD_CLOEXEC);

  const std::vector<TensorInfo>& tensors = checkpoint->tensors();
  ASSERT_EQ(tensors.size(), tensors_.size());
  for (size_t i = 1; i < tensors.size(); ++i) EXPECT_LT(tensors[i - 1].name, tensors[i].name);
  const std::map<std::string, std::string> weight_map = WeightMap();
  for (const Tensor& want : tensors_) {
    const TensorInfo* info = checkpoint->Find(want.name);
    ASSERT_NE(info, nullptr) << want.name;
    EXPECT_EQ(checkpoint->shards()[info->shard].name, weight_map.at(want.name)) << want.name;
    EXPECT_EQ(info->dtype, want.dtype);
    EXPECT_EQ(info->shape, want.shape);
    std::vector<std::byte> bytes(info->nbytes);
    Status status = checkpoint->Read(*info, 0, bytes);
    ASSERT_TRUE(status.ok()) << status.ToString();
    EXPECT_EQ(bytes, want.bytes) << want.name;
  }
}

TEST_F(ShardedCheckpointTest, ChecksumIsThatOfOneFileWithTheSameTensors) {
  std::vector<const Tensor*> all;
  for (const Tensor& t : tensors_) all.push_back(&t);
  WriteShard(tmp_.File("one.safetensors"), all);
  Result<Checkpoint> one = Checkpoint::Open(tmp_.File("one.safetensors"));
  ASSERT_TRUE(one.ok()) << one.status().ToString();
  Result<Checkpoint> sharded = Checkpoint::Open(dir_);
  ASSERT_TRUE(sharded.ok()) << sharded.status().ToString();
  EXPECT_EQ(TreeChecksum(*sharded), TreeChecksum(*one));
}

// The single-file checksum is what it was before directories existed (the
// value main computed for this model), and a directory of the same model,
// sharded or not, gives it too.
TEST(CheckpointDirectory, GoldenChecksumOfOneFileAndOfItsShards) {
  TempDir dir;
  ASSERT_TRUE(WriteSyntheticMlp(8, 16, 4, DType::kF32, 7, dir.File("m.safetensors"), 1).ok());
  ASSERT_TRUE(WriteSyntheticMlp(8, 16, 4, DType::kF32, 7, dir.File("sharded"), 1, 300).ok());
  ASSERT_TRUE(WriteSyntheticMlp(8, 16, 4, DType::kF32, 7, dir.File("whole"), 1, 1 << 20).ok());
  EXPECT_TRUE(fs::exists(dir.File("sharded/model.safetensors.index.json")));
  EXPECT_FALSE(fs::exists(dir.File("whole/model.safetensors.index.json")));
  for (const char* name : {"m.safetensors", "sharded", "whole", "whole/model.safetensors"}) {
    Result<Checkpoint> checkpoint = Checkpoint::Open(dir.File(name));
    ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
    EXPECT_EQ(ChecksumHex(TreeChecksum(*checkpoint)), "e09b7b5ecc3a4add") << name;
  }
  Result<Checkpoint> sharded = Checkpoint::Open(dir.File("sharded"));
  ASSERT_TRUE(sharded.ok());
  EXPECT_GT(sharded->shards().size(), 1u);
}

TEST(CheckpointDirectory, WriteDirectoryShardsAsSavePretrainedDoes) {
  TempDir dir;
  const std::vector<std::byte> bytes = Pattern(100, 0);
  CheckpointWriter writer;
  ASSERT_TRUE(writer.AddTensor("b", DType::kU8, {100}, bytes).ok());
  ASSERT_TRUE(writer.AddTensor("a", DType::kU8, {60}, std::span(bytes).first(60)).ok());
  ASSERT_TRUE(writer.AddTensor("c", DType::kU8, {40}, std::span(bytes).first(40)).ok());
  ASSERT_TRUE(writer.AddTensor("big", DType::kU8, {100}, bytes).ok());
  // 100 fills the first; 60 + 40 the second; 100 the third.
  const std::string out = dir.File("out");
  Status status = writer.WriteDirectory(out, 100);
  ASSERT_TRUE(status.ok()) << status.ToString();
  Result<Checkpoint> checkpoint = Checkpoint::Open(out);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  ASSERT_EQ(checkpoint->shards().size(), 3u);
  EXPECT_EQ(checkpoint->shards()[1].name, "model-00002-of-00003.safetensors");
  EXPECT_EQ(checkpoint->shards()[checkpoint->Find("a")->shard].name,
            checkpoint->shards()[checkpoint->Find("c")->shard].name);
  EXPECT_EQ(checkpoint->index_total_size(), 300u);
  EXPECT_FALSE(fs::exists(out + "/model.safetensors.index.json.tmp"));
}

TEST(CheckpointDirectory, ModelSafetensorsAloneIsTheFile) {
  TempDir dir;
  ASSERT_TRUE(WriteSyntheticScale(64, 3, dir.File("model.safetensors"), 1).ok());
  WriteFile(dir.File("config.json"), "{}");
  Result<Checkpoint> checkpoint = Checkpoint::Open(dir.path() + "/");
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  EXPECT_TRUE(checkpoint->is_directory());
  EXPECT_TRUE(checkpoint->index_path().empty());
  ASSERT_EQ(checkpoint->shards().size(), 1u);
  EXPECT_EQ(checkpoint->shards()[0].path, dir.File("model.safetensors")) << "no doubled '/'";
  EXPECT_EQ(checkpoint->tensors().size(), 1u);
  EXPECT_FALSE(checkpoint->metadata().empty()) << "one file's metadata is the checkpoint's";
}

TEST(CheckpointDirectory, WithoutIndexOrModelSafetensorsIsAnErrorNamingTheDirectory) {
  TempDir dir;
  Result<Checkpoint> empty = Checkpoint::Open(dir.path());
  ASSERT_FALSE(empty.ok());
  EXPECT_THAT(empty.status().message(),
              HasSubstr(dir.path() + ": is a directory without model.safetensors or "
                                     "model.safetensors.index.json"));

  ASSERT_TRUE(WriteSyntheticScale(4, 1, dir.File("consolidated.safetensors"), 1).ok());
  Result<Checkpoint> other = Checkpoint::Open(dir.path());
  ASSERT_FALSE(other.ok());
  EXPECT_THAT(other.status().message(),
              HasSubstr(dir.path() + ": has no model.safetensors or model.safetensors.index.json "
                                     "(it holds 'consolidated.safetensors')"));
}

TEST(CheckpointDirectory, SeveralSafetensorsWithoutIndexIsAnErrorNamingTheDirectory) {
  TempDir dir;
  ASSERT_TRUE(WriteSyntheticScale(4, 1, dir.File("model.safetensors"), 1).ok());
  ASSERT_TRUE(WriteSyntheticScale(4, 2, dir.File("model-00001-of-00002.safetensors"), 1).ok());
  ASSERT_TRUE(WriteSyntheticScale(4, 3, dir.File("model-00002-of-00002.safetensors"), 1).ok());
  Result<Checkpoint> checkpoint = Checkpoint::Open(dir.path());
  ASSERT_FALSE(checkpoint.ok());
  EXPECT_EQ(checkpoint.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(checkpoint.status().message(),
              HasSubstr(dir.path() + ": holds model.safetensors and 2 other .safetensors files "
                                     "('model-00001-of-00002.safetensors', "
                                     "'model-00002-of-00002.safetensors') but no "
                                     "model.safetensors.index.json"));
}

TEST_F(ShardedCheckpointTest, MalformedIndexNamesTheIndex) {
  WriteIndex("{\"weight_map\": {\"a\": ");
  ExpectError(IndexPath() + ": invalid JSON");
  WriteIndex("[]");
  ExpectError(IndexPath() + ": is not a JSON object");
  WriteIndex("{\"metadata\": {}}");
  ExpectError(IndexPath() + ": no \"weight_map\"");
  WriteIndex("{\"weight_map\": [\"model.embed_tokens.weight\"]}");
  ExpectError(IndexPath() + ": weight_map is not an object");
  WriteIndex("{\"weight_map\": {}}");
  ExpectError(IndexPath() + ": weight_map lists no tensors");
  WriteIndex("{\"weight_map\": {\"model.norm.weight\": 3}}");
  ExpectError(IndexPath() + ": weight_map: tensor 'model.norm.weight': shard name is not a string");
  WriteIndex(Index(WeightMap(), "{\"total_size\": \"100\"}"));
  ExpectError(IndexPath() + ": metadata.total_size is not a non-negative integer");
  WriteIndex(Index(WeightMap(), "{\"total_size\": -4}"));
  ExpectError(IndexPath() + ": metadata.total_size is not a non-negative integer");
  WriteIndex(Index(WeightMap(), "[1]"));
  ExpectError(IndexPath() + ": metadata is not an object");
  std::string with_nul = "{\"weight_map\": {\"a\": \"x.safetensors\"}}";
  const size_t nul = with_nul.size();
  with_nul += '\0';
  with_nul += "junk";
  WriteIndex(with_nul);
  ExpectError(IndexPath() + ": invalid JSON: NUL byte at offset " + std::to_string(nul));
}

TEST_F(ShardedCheckpointTest, IndexListingATensorTwiceNamesIt) {
  std::string index = Index();
  // Before the weight_map's closing brace: the norm, again, for another shard.
  index.insert(index.rfind('}') - 1, ", \"model.norm.weight\": \"" + std::string(kShard1) + "\"");
  WriteIndex(index);
  ExpectError(IndexPath() + ": weight_map: tensor 'model.norm.weight': listed twice");
}

TEST_F(ShardedCheckpointTest, TensorListedButMissingFromItsShard) {
  auto map = WeightMap();
  map["lm_head.weight"] = kShard2;
  WriteIndex(Index(map));
  ExpectError(IndexPath() + ": tensor 'lm_head.weight' is listed for shard '" + kShard2 +
              "', but " + File(kShard2) + " does not hold it");
}

TEST_F(ShardedCheckpointTest, TensorOfAShardThatTheIndexDoesNotList) {
  auto map = WeightMap();
  map.erase("model.layers.0.attn.k.weight");
  WriteIndex(Index(map));
  ExpectError(File(kShard2) + ": tensor 'model.layers.0.attn.k.weight' is not listed in " +
              IndexPath());
}

TEST_F(ShardedCheckpointTest, TensorListedForAnotherShard) {
  auto map = WeightMap();
  map["model.norm.weight"] = kShard1;
  WriteIndex(Index(map));
  ExpectError(File(kShard3) + ": tensor 'model.norm.weight' is listed in " + IndexPath() +
              " for shard '" + kShard1 + "', not this one");
}

TEST_F(ShardedCheckpointTest, TensorInTwoShards) {
  // Shard 3 holds the norm and a second copy of the embedding.
  WriteShard(File(kShard3), {&tensors_[4], &tensors_[5], &tensors_[0]});
  ExpectError(File(kShard3) + ": tensor 'model.embed_tokens.weight' is also in shard '" + kShard1 +
              "': a tensor must be in one shard only");
}

TEST_F(ShardedCheckpointTest, MissingShardNamesTheIndexTheShardAndATensor) {
  ASSERT_TRUE(fs::remove(File(kShard3)));
  ExpectError(IndexPath() + ": shard '" + kShard3 +
                  "', listed for tensor 'model.empty' and 1 other: " + File(kShard3) +
                  ": No such file or directory",
              StatusCode::kNotFound);
}

TEST_F(ShardedCheckpointTest, ShardNamesAreFileNamesInTheDirectoryOnly) {
  // A real checkpoint one level up: a name that escaped would find it.
  ASSERT_TRUE(WriteSyntheticScale(4, 1, tmp_.File("outside.safetensors"), 1).ok());
  const std::pair<std::string, std::string> cases[] = {
      {"../outside.safetensors", "is not a file name: it holds '/'"},
      {tmp_.File("outside.safetensors"), "is not a file name: it holds '/'"},
      {"sub/model.safetensors", "is not a file name: it holds '/'"},
      {"..safetensors", "holds \"..\""},
      {"model-00001-of-00003.bin", "does not end in .safetensors"},
      {".safetensors", "does not end in .safetensors"},
      {"", "does not end in .safetensors"},
  };
  for (const auto& [shard, why] : cases) {
    auto map = WeightMap();
    map["model.norm.weight"] = shard;
    WriteIndex(Index(map));
    SCOPED_TRACE(shard);
    ExpectError(IndexPath() + ": weight_map: tensor 'model.norm.weight': shard '" + shard + "' " +
                why);
  }
  // JSON can spell a NUL inside a name, which would cut it short at open().
  WriteIndex(
      "{\"weight_map\": {\"model.norm.weight\": \"model-00003-of-00003.safetensors\\u0000."
      "safetensors\"}}");
  ExpectError(IndexPath() +
              ": weight_map: tensor 'model.norm.weight': shard "
              "'model-00003-of-00003.safetensors\\x00.safetensors' holds a NUL byte");
}

TEST_F(ShardedCheckpointTest, ATotalSizeThatIsNotTheSumOfTheTensorsIsAWarning) {
  WriteIndex(Index(WeightMap(), "{\"total_size\": 7}"));
  Result<Checkpoint> wrong = Checkpoint::Open(dir_);
  ASSERT_TRUE(wrong.ok()) << wrong.status().ToString();
  EXPECT_EQ(wrong->tensor_bytes(), TotalBytes());
  EXPECT_EQ(wrong->index_total_size(), 7u);
  ASSERT_EQ(wrong->warnings().size(), 1u);
  EXPECT_EQ(wrong->warnings()[0], IndexPath() +
                                      ": metadata.total_size is 7 bytes but the shards' tensors "
                                      "hold " +
                                      std::to_string(TotalBytes()) +
                                      " (the weight map and the shards' headers are what is used)");
  // Absent, null, or written as an integral float ("1.2e3"), it is accepted
  // without a word.
  for (const std::string& metadata :
       {std::string("{}"), std::string("null"), std::string("{\"total_size\": null}"),
        "{\"total_size\": " + std::to_string(TotalBytes()) + ".0, \"total_parameters\": 9}"}) {
    WriteIndex(Index(WeightMap(), metadata));
    Result<Checkpoint> checkpoint = Checkpoint::Open(dir_);
    ASSERT_TRUE(checkpoint.ok()) << metadata << ": " << checkpoint.status().ToString();
    EXPECT_TRUE(checkpoint->warnings().empty()) << metadata;
  }
}

TEST_F(ShardedCheckpointTest, FifoDeviceOrDirectoryInPlaceOfAShardFailsWithoutBlocking) {
  ASSERT_TRUE(fs::remove(File(kShard2)));
  ASSERT_EQ(::mkfifo(File(kShard2).c_str(), 0600), 0);
  ExpectError(IndexPath() + ": shard '" + kShard2 +
              "', listed for tensor 'model.layers.0.attn.k.weight' and 1 other: " + File(kShard2) +
              ": is a FIFO, not a regular file");
  ASSERT_TRUE(fs::remove(File(kShard2)));
  fs::create_symlink("/dev/zero", File(kShard2));
  ExpectError(File(kShard2) + ": is a character device, not a regular file");
  ASSERT_TRUE(fs::remove(File(kShard2)));
  ASSERT_TRUE(fs::create_directory(File(kShard2)));
  ExpectError(File(kShard2) + ": is a directory, not a regular file");
  ASSERT_TRUE(fs::remove(File(kShard2)));
  fs::create_symlink(kShard2, File(kShard2));
  ExpectError(File(kShard2) + ": a loop of symbolic links");
}

TEST_F(ShardedCheckpointTest, FifoInPlaceOfTheIndexFailsWithoutBlocking) {
  ASSERT_TRUE(fs::remove(IndexPath()));
  ASSERT_EQ(::mkfifo(IndexPath().c_str(), 0600), 0);
  ExpectError(IndexPath() + ": is a FIFO, not a regular file");
}

// The Hugging Face cache keeps a snapshot as links into its blobs.
TEST_F(ShardedCheckpointTest, ShardsThatAreLinksToRegularFilesAreFollowed) {
  const std::string blobs = tmp_.File("blobs");
  ASSERT_TRUE(fs::create_directory(blobs));
  for (const char* shard : {kShard1, kShard2, kShard3}) {
    fs::rename(File(shard), blobs + "/" + shard);
    fs::create_symlink("../blobs/" + std::string(shard), File(shard));
  }
  Result<Checkpoint> checkpoint = Checkpoint::Open(dir_);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  EXPECT_EQ(checkpoint->tensors().size(), tensors_.size());
}

TEST_F(ShardedCheckpointTest, ModelSafetensorsBesideAnIndexThatDoesNotListItIsAnError) {
  ASSERT_TRUE(WriteSyntheticScale(4, 1, File("model.safetensors"), 1).ok());
  ExpectError(File("model.safetensors") + ": is beside " + IndexPath() +
              ", which does not list it");
}

TEST_F(ShardedCheckpointTest, LimitsOnTheIndex) {
  // Larger than the limit: refused by its size, before it is read.
  {
    UniqueFd fd(::open(IndexPath().c_str(), O_WRONLY | O_TRUNC | O_CLOEXEC));
    ASSERT_TRUE(fd.valid());
    ASSERT_EQ(::ftruncate(fd.get(), static_cast<off_t>(kMaxCheckpointIndexBytes + 1)), 0);
  }
  ExpectError(IndexPath() + ": " + std::to_string(kMaxCheckpointIndexBytes + 1) +
              " bytes, more than the limit of " + std::to_string(kMaxCheckpointIndexBytes));

  std::map<std::string, std::string> many;
  for (size_t i = 0; i <= kMaxCheckpointShards; ++i)
    many["t" + std::to_string(i)] = "s" + std::to_string(i) + ".safetensors";
  WriteIndex(Index(many, "{}"));
  ExpectError(IndexPath() + ": weight_map names more than the limit of " +
              std::to_string(kMaxCheckpointShards) + " shards");
}

TEST_F(ShardedCheckpointTest, FingerprintCoversTheIndexAndEveryShard) {
  Result<Checkpoint> first = Checkpoint::Open(dir_);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  Result<Checkpoint> again = Checkpoint::Open(dir_);
  ASSERT_TRUE(again.ok());
  const std::string fingerprint = first->Fingerprint();
  EXPECT_EQ(again->Fingerprint(), fingerprint) << "unchanged files, same fingerprint";
  EXPECT_THAT(fingerprint, HasSubstr(std::string(kSafetensorsIndexFileName) + "="));
  for (const char* shard : {kShard1, kShard2, kShard3})
    EXPECT_THAT(fingerprint, HasSubstr(std::string(shard) + "="));

  // Touch one file at a time (a time no write could give it): each changes it.
  for (const std::string& path : {IndexPath(), File(kShard2), File(kShard3)}) {
    SCOPED_TRACE(path);
    const timespec times[2] = {{1000000000, 1}, {1000000000, 1}};
    ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), times, 0), 0);
    Result<Checkpoint> touched = Checkpoint::Open(dir_);
    ASSERT_TRUE(touched.ok()) << touched.status().ToString();
    EXPECT_NE(touched->Fingerprint(), fingerprint);
  }
  // A shard replaced by another file (a new inode).
  const std::string before = Checkpoint::Open(dir_)->Fingerprint();
  WriteShard(File(kShard1) + ".new", {&tensors_[0], &tensors_[1]});
  fs::rename(File(kShard1) + ".new", File(kShard1));
  Result<Checkpoint> replaced = Checkpoint::Open(dir_);
  ASSERT_TRUE(replaced.ok()) << replaced.status().ToString();
  EXPECT_NE(replaced->Fingerprint(), before);
}

// The files are open: renaming the directory and putting another checkpoint
// in its place changes nothing for reads of the one opened.
TEST_F(ShardedCheckpointTest, ReadsComeFromTheFilesOpenedWhateverHappensToTheDirectory) {
  Result<Checkpoint> checkpoint = Checkpoint::Open(dir_);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  fs::rename(dir_, dir_ + ".old");
  ASSERT_TRUE(fs::create_directory(dir_));
  Tensor other{"model.norm.weight", DType::kF32, {4}, Pattern(16, 99)};
  WriteShard(File(kShard3), {&other});
  const TensorInfo* norm = checkpoint->Find("model.norm.weight");
  ASSERT_NE(norm, nullptr);
  std::vector<std::byte> bytes(norm->nbytes);
  ASSERT_TRUE(checkpoint->Read(*norm, 0, bytes).ok());
  EXPECT_EQ(bytes, tensors_[4].bytes);
}

TEST_F(ShardedCheckpointTest, TruncatedShardNamesTheShardAndTheTensor) {
  Result<Checkpoint> checkpoint = Checkpoint::Open(dir_);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  const TensorInfo* embed = checkpoint->Find("model.embed_tokens.weight");
  ASSERT_NE(embed, nullptr);
  const CheckpointFile& shard = checkpoint->shards()[embed->shard];
  ASSERT_EQ(shard.name, kShard1);
  ASSERT_EQ(::truncate(shard.path.c_str(), static_cast<off_t>(shard.data_start)), 0);
  std::vector<std::byte> bytes(embed->nbytes);
  Status status = checkpoint->Read(*embed, 0, bytes);
  EXPECT_THAT(status.message(),
              HasSubstr(File(kShard1) + ": tensor 'model.embed_tokens.weight': file is truncated"));
}

// The shards past the first are opened again for each read: one that is not
// the file checked at Open any more (rewritten, replaced, touched) is an
// error naming it, never other bytes.
TEST_F(ShardedCheckpointTest, AShardChangedAfterOpenFailsTheReadNamingIt) {
  Result<Checkpoint> checkpoint = Checkpoint::Open(dir_);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  const TensorInfo* q = checkpoint->Find("model.layers.0.attn.q.weight");
  const TensorInfo* norm = checkpoint->Find("model.norm.weight");
  ASSERT_TRUE(q != nullptr && norm != nullptr);
  std::vector<std::byte> bytes(q->nbytes);
  ASSERT_TRUE(checkpoint->Read(*q, 0, bytes).ok());

  // Replaced by a file holding the same tensors.
  WriteShard(File(kShard2) + ".new", {&tensors_[2], &tensors_[3]});
  fs::rename(File(kShard2) + ".new", File(kShard2));
  Status status = checkpoint->Read(*q, 0, bytes);
  EXPECT_EQ(status.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(status.message(),
              HasSubstr(File(kShard2) + ": changed since the checkpoint was opened"));

  // Touched.
  const timespec times[2] = {{1000000000, 1}, {1000000000, 1}};
  ASSERT_EQ(::utimensat(AT_FDCWD, File(kShard3).c_str(), times, 0), 0);
  bytes.resize(norm->nbytes);
  status = checkpoint->Read(*norm, 0, bytes);
  EXPECT_THAT(status.message(),
              HasSubstr(File(kShard3) + ": changed since the checkpoint was opened"));

  // Gone.
  ASSERT_TRUE(fs::remove(File(kShard3)));
  status = checkpoint->Read(*norm, 0, bytes);
  EXPECT_THAT(status.message(), HasSubstr(File(kShard3) + ": No such file or directory"));
}

int OpenDescriptors() {
  int count = 0;
  for ([[maybe_unused]] const auto& entry : fs::directory_iterator("/proc/self/fd")) ++count;
  return count;
}

// A checkpoint of hundreds of shards holds two descriptors, not one per
// shard: its shards cannot exhaust a process's descriptor limit.
TEST(CheckpointDirectory, ManyShardsHoldTwoDescriptors) {
  TempDir dir;
  constexpr int kShards = 300;
  std::vector<std::vector<std::byte>> bytes;
  for (int i = 0; i < kShards; ++i) bytes.push_back(Pattern(8, static_cast<uint8_t>(i)));
  CheckpointWriter writer;
  for (int i = 0; i < kShards; ++i)
    ASSERT_TRUE(writer.AddTensor("t" + std::to_string(i), DType::kU8, {8}, bytes[i]).ok());
  const std::string out = dir.File("many");
  ASSERT_TRUE(writer.WriteDirectory(out, 8).ok());

  const int before = OpenDescriptors();
  Result<Checkpoint> checkpoint = Checkpoint::Open(out);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  ASSERT_EQ(checkpoint->shards().size(), static_cast<size_t>(kShards));
  EXPECT_LE(OpenDescriptors() - before, 2);
  for (int i = 0; i < kShards; ++i) {
    const TensorInfo* t = checkpoint->Find("t" + std::to_string(i));
    ASSERT_NE(t, nullptr);
    std::vector<std::byte> read(8);
    ASSERT_TRUE(checkpoint->Read(*t, 0, read).ok()) << t->name;
    EXPECT_EQ(read, bytes[i]) << t->name;
  }
  EXPECT_LE(OpenDescriptors() - before, 2) << "a read closes what it opened";
}

TEST(ParseCheckpointIndex, SortsShardsAndTensorsAndIgnoresUnknownKeys) {
  Result<CheckpointIndex> index = ParseCheckpointIndex(
      R"({"format": "hf", "metadata": {"total_size": 12, "total_parameters": 3},
          "weight_map": {"z": "b.safetensors", "a": "c.safetensors", "m": "b.safetensors"}})",
      "idx");
  ASSERT_TRUE(index.ok()) << index.status().ToString();
  EXPECT_EQ(index->total_size, 12u);
  EXPECT_EQ(index->shards, (std::vector<std::string>{"b.safetensors", "c.safetensors"}));
  EXPECT_EQ(index->weight_map,
            (std::vector<std::pair<std::string, uint32_t>>{{"a", 1}, {"m", 0}, {"z", 0}}));
}

TEST(ParseCheckpointIndex, ErrorsNameTheOriginAndTheTensor) {
  const std::pair<std::string, std::string> cases[] = {
      {R"({"weight_map": {"": "a.safetensors"}})", "idx: weight_map: empty tensor name"},
      {R"({"weight_map": {"x\u0000y": "a.safetensors"}})",
       "idx: weight_map: tensor 'x\\x00y': the name holds a NUL byte"},
      {R"({"weight_map": {"w": "a.safetensors"}, "weight_map": {}})",
       "idx: duplicate key 'weight_map'"},
      {std::string(100, '[') + std::string(100, ']'), "idx: JSON nests deeper than 64 levels"},
      {R"({"metadata": {"total_size": 1.5}, "weight_map": {"w": "a.safetensors"}})",
       "idx: metadata.total_size is not a non-negative integer"},
  };
  for (const auto& [json, message] : cases) {
    Result<CheckpointIndex> index = ParseCheckpointIndex(json, "idx");
    ASSERT_FALSE(index.ok()) << json;
    EXPECT_EQ(index.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(index.status().message(), HasSubstr(message)) << json;
  }
}

}  // namespace
}  // namespace hearth
