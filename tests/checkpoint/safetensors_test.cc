#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "checkpoint/safetensors_format.h"
#include "hearth/checkpoint.h"
#include "platform/file_io.h"
#include "temp_dir.h"

namespace hearth {
namespace {

using ::testing::HasSubstr;
using testing_util::TempDir;

std::vector<std::byte> Pattern(size_t size, uint8_t salt) {
  std::vector<std::byte> bytes(size);
  for (size_t i = 0; i < size; ++i) bytes[i] = static_cast<std::byte>(i * 31 + salt);
  return bytes;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void WriteFile(const std::string& path, std::string_view contents) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
}

std::string SafetensorsFile(std::string_view header, std::string_view data) {
  unsigned char length[8];
  StoreLittleEndian64(header.size(), length);
  return std::string(reinterpret_cast<char*>(length), 8) + std::string(header) + std::string(data);
}

std::vector<std::byte> ReadTensor(const Checkpoint& checkpoint, const TensorInfo& tensor) {
  std::vector<std::byte> bytes(tensor.nbytes);
  Status status = checkpoint.Read(tensor, 0, bytes);
  EXPECT_TRUE(status.ok()) << status.ToString();
  return bytes;
}

TEST(CheckpointRoundTrip, EveryDTypeZeroSizeTensorsAndMetadata) {
  TempDir dir;
  struct Added {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    std::vector<std::byte> bytes;
  };
  std::vector<Added> added;
  for (int d = kDTypeLimit - 1; d >= 0; --d) {
    if (!IsStoredDType(d)) continue;
    const auto dtype = static_cast<DType>(d);
    added.push_back({"t." + std::string(DTypeName(dtype)),
                     dtype,
                     {3, 5},
                     Pattern(15 * DTypeSize(dtype), static_cast<uint8_t>(d))});
  }
  added.push_back({"empty", DType::kF32, {0, 7}, {}});
  added.push_back({"Empty.second", DType::kI8, {4, 0}, {}});
  added.push_back({"scalar", DType::kF64, {}, Pattern(8, 99)});

  CheckpointWriter writer;
  writer.SetMetadata("format", "pt");
  writer.SetMetadata("alpha", "1");
  writer.SetMetadata("format", "hearth");
  for (const Added& a : added)
    ASSERT_TRUE(writer.AddTensor(a.name, a.dtype, a.shape, a.bytes).ok());
  const std::string path = dir.File("model.safetensors");
  ASSERT_TRUE(writer.Write(path).ok());
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));

  Result<Checkpoint> checkpoint = Checkpoint::Open(path);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  EXPECT_EQ(checkpoint->path(), path);
  EXPECT_EQ(checkpoint->data_start() % 8, 0u);
  const auto expected_metadata =
      std::vector<std::pair<std::string, std::string>>{{"alpha", "1"}, {"format", "hearth"}};
  EXPECT_EQ(checkpoint->metadata(), expected_metadata);

  ASSERT_EQ(checkpoint->tensors().size(), added.size());
  for (size_t i = 1; i < checkpoint->tensors().size(); ++i) {
    EXPECT_LT(checkpoint->tensors()[i - 1].name, checkpoint->tensors()[i].name);
  }
  uint64_t expected_offset = 0;
  for (const Added& a : added) {
    const TensorInfo* info = checkpoint->Find(a.name);
    ASSERT_NE(info, nullptr) << a.name;
    EXPECT_EQ(info->dtype, a.dtype);
    EXPECT_EQ(info->shape, a.shape);
    EXPECT_EQ(info->nbytes, a.bytes.size());
    EXPECT_EQ(info->numel() * DTypeSize(a.dtype), a.bytes.size());
    EXPECT_EQ(info->offset, expected_offset) << "data is laid out in insertion order";
    expected_offset += a.bytes.size();
    EXPECT_EQ(ReadTensor(*checkpoint, *info), a.bytes) << a.name;
  }
  EXPECT_EQ(checkpoint->tensor_bytes(), expected_offset);
  EXPECT_EQ(checkpoint->file_size(), checkpoint->data_start() + expected_offset);
  EXPECT_EQ(checkpoint->Find("missing"), nullptr);
  EXPECT_EQ(checkpoint->Find("t"), nullptr);
  EXPECT_EQ(checkpoint->Find("scalar")->numel(), 1u);
}

TEST(CheckpointRoundTrip, HeaderHasSortedKeysMetadataFirstAndSpacePadding) {
  TempDir dir;
  CheckpointWriter writer;
  const std::vector<std::byte> bytes = Pattern(4, 0);
  ASSERT_TRUE(writer.AddTensor("b", DType::kF32, {1}, bytes).ok());
  ASSERT_TRUE(writer.AddTensor("A", DType::kF32, {1}, bytes).ok());
  ASSERT_TRUE(writer.AddTensor("a", DType::kU8, {4}, bytes).ok());
  writer.SetMetadata("k", "v");
  const std::string path = dir.File("m.safetensors");
  ASSERT_TRUE(writer.Write(path).ok());

  const std::string file = ReadFile(path);
  ASSERT_GE(file.size(), 8u);
  const uint64_t length = LoadLittleEndian64(reinterpret_cast<const unsigned char*>(file.data()));
  EXPECT_EQ((8 + length) % 8, 0u);
  std::string header = file.substr(8, length);
  const size_t end = header.find_last_not_of(' ');
  EXPECT_EQ(header[end], '}');
  EXPECT_LT(header.size() - end - 1, 8u) << "padding is shorter than the alignment";
  header.resize(end + 1);
  EXPECT_EQ(header, R"({"__metadata__":{"k":"v"},)"
                    R"("A":{"data_offsets":[4,8],"dtype":"F32","shape":[1]},)"
                    R"("a":{"data_offsets":[8,12],"dtype":"U8","shape":[4]},)"
                    R"("b":{"data_offsets":[0,4],"dtype":"F32","shape":[1]}})");
}

TEST(CheckpointRoundTrip, ManyChunksOnManyThreads) {
  TempDir dir;
  constexpr uint64_t kBytes = (40ull << 20) + 3;  // three 16 MiB chunks, the last one short
  std::atomic<int> calls{0};
  auto fill = [&](uint64_t offset, std::span<std::byte> out) {
    ++calls;
    for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<std::byte>((offset + i) % 251);
    return Status::Ok();
  };
  const std::vector<std::byte> small = Pattern(4, 1);
  CheckpointWriter writer;
  ASSERT_TRUE(writer.AddTensor("small", DType::kI16, {2}, small).ok());
  ASSERT_TRUE(writer.AddTensor("big", DType::kU8, {static_cast<int64_t>(kBytes)}, fill).ok());
  const std::string path = dir.File("big.safetensors");
  ASSERT_TRUE(writer.Write(path, 4).ok());
  EXPECT_EQ(calls.load(), 3);

  Result<Checkpoint> checkpoint = Checkpoint::Open(path);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  const std::vector<std::byte> big = ReadTensor(*checkpoint, *checkpoint->Find("big"));
  ASSERT_EQ(big.size(), kBytes);
  size_t mismatch = 0;
  while (mismatch < big.size() && big[mismatch] == static_cast<std::byte>(mismatch % 251)) {
    ++mismatch;
  }
  EXPECT_EQ(mismatch, big.size()) << "first wrong byte";
  EXPECT_EQ(ReadTensor(*checkpoint, *checkpoint->Find("small")), small);
}

TEST(CheckpointOpen, DescriptorIsCloseOnExec) {
  TempDir dir;
  CheckpointWriter writer;
  const std::string path = dir.File("m.safetensors");
  ASSERT_TRUE(writer.Write(path).ok());
  Result<Checkpoint> checkpoint = Checkpoint::Open(path);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  EXPECT_TRUE(checkpoint->tensors().empty());
  const int flags = ::fcntl(checkpoint->fd(), F_GETFD);
  ASSERT_GE(flags, 0);
  EXPECT_TRUE(flags & FD_CLOEXEC);
}

TEST(CheckpointOpen, MissingFileIsNotFound) {
  TempDir dir;
  Result<Checkpoint> checkpoint = Checkpoint::Open(dir.File("absent.safetensors"));
  ASSERT_FALSE(checkpoint.ok());
  EXPECT_EQ(checkpoint.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(checkpoint.status().message(), HasSubstr("absent.safetensors"));
}

// A directory is read as a checkpoint directory (checkpoint_directory_test.cc);
// one without a checkpoint in it is an error saying what was looked for.
TEST(CheckpointOpen, DirectoryWithoutACheckpointIsRejected) {
  TempDir dir;
  Result<Checkpoint> checkpoint = Checkpoint::Open(dir.path());
  ASSERT_FALSE(checkpoint.ok());
  EXPECT_EQ(checkpoint.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(checkpoint.status().message(),
              HasSubstr(dir.path() + ": is a directory without model.safetensors or "
                                     "model.safetensors.index.json"));
}

// None of these may block or be opened at all (a FIFO with no writer would
// hang open() for good); each error names the path and what it is.
TEST(CheckpointOpen, FifosDevicesSocketsAndLinkLoopsAreRefusedWithoutBlocking) {
  TempDir dir;
  const std::string fifo = dir.File("fifo.safetensors");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const std::string loop = dir.File("loop.safetensors");
  std::filesystem::create_symlink("loop.safetensors", loop);
  const std::string sock = dir.File("sock.safetensors");
  UniqueFd listener(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  ASSERT_LT(sock.size(), sizeof addr.sun_path);
  std::memcpy(addr.sun_path, sock.c_str(), sock.size() + 1);
  ASSERT_EQ(::bind(listener.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  const std::pair<std::string, std::string> cases[] = {
      {fifo, fifo + ": is a FIFO, not a regular file"},
      {"/dev/null", "/dev/null: is a character device, not a regular file"},
      {sock, sock + ": is a socket, not a regular file"},
      {loop, loop + ": a loop of symbolic links"},
  };
  for (const auto& [path, message] : cases) {
    Result<Checkpoint> checkpoint = Checkpoint::Open(path);
    ASSERT_FALSE(checkpoint.ok()) << path;
    EXPECT_EQ(checkpoint.status().code(), StatusCode::kInvalidArgument) << path;
    EXPECT_THAT(checkpoint.status().message(), HasSubstr(message));
  }
}

TEST(CheckpointOpen, FollowsSymlinksToRegularFilesAndLeavesTheDescriptorBlocking) {
  TempDir dir;
  CheckpointWriter writer;
  const std::string path = dir.File("blob");
  ASSERT_TRUE(writer.Write(path).ok());
  const std::string link = dir.File("model.safetensors");
  std::filesystem::create_symlink("blob", link);
  Result<Checkpoint> checkpoint = Checkpoint::Open(link);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  const int flags = ::fcntl(checkpoint->fd(), F_GETFL);
  ASSERT_GE(flags, 0);
  EXPECT_FALSE(flags & O_NONBLOCK);
}

TEST(CheckpointOpen, AcceptsHandWrittenFileWithPaddingHolesAndSharedEmptyOffsets) {
  TempDir dir;
  const std::string path = dir.File("hand.safetensors");
  WriteFile(path, SafetensorsFile(R"({"w":{"dtype":"I16","shape":[2],"data_offsets":[2,6]},)"
                                  R"("z":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}}   )",
                                  "\x01\x02\x03\x04\x05\x06\x07\x08"));
  Result<Checkpoint> checkpoint = Checkpoint::Open(path);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  ASSERT_EQ(checkpoint->tensors().size(), 2u);
  const TensorInfo& w = checkpoint->tensors()[0];
  EXPECT_EQ(w.offset, 2u);
  std::vector<std::byte> bytes = ReadTensor(*checkpoint, w);
  EXPECT_EQ(std::memcmp(bytes.data(), "\x03\x04\x05\x06", 4), 0);
}

TEST(CheckpointRead, PartialRangesAndBounds) {
  TempDir dir;
  const std::vector<std::byte> bytes = Pattern(1000, 5);
  const std::vector<std::byte> first = Pattern(3, 9);
  CheckpointWriter writer;
  ASSERT_TRUE(writer.AddTensor("first", DType::kU8, {3}, first).ok());
  ASSERT_TRUE(writer.AddTensor("w", DType::kU8, {1000}, bytes).ok());
  const std::string path = dir.File("m.safetensors");
  ASSERT_TRUE(writer.Write(path).ok());
  Result<Checkpoint> checkpoint = Checkpoint::Open(path);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  const TensorInfo& w = *checkpoint->Find("w");

  struct Range {
    uint64_t offset, size;
  };
  for (Range r : {Range{0, 1}, Range{10, 100}, Range{999, 1}, Range{0, 1000}, Range{1000, 0}}) {
    std::vector<std::byte> out(r.size);
    ASSERT_TRUE(checkpoint->Read(w, r.offset, out).ok()) << r.offset << "+" << r.size;
    EXPECT_TRUE(std::equal(out.begin(), out.end(), bytes.begin() + r.offset));
  }
  for (Range r : {Range{990, 11}, Range{1001, 0}, Range{0, 1001}, Range{~0ull, 2}}) {
    std::vector<std::byte> out(r.size);
    Status status = checkpoint->Read(w, r.offset, out);
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << r.offset << "+" << r.size;
    EXPECT_THAT(status.message(), HasSubstr("tensor 'w': read of"));
  }

  TensorInfo foreign = w;
  foreign.offset = 1ull << 40;
  std::vector<std::byte> out(1);
  EXPECT_EQ(checkpoint->Read(foreign, 0, out).code(), StatusCode::kInvalidArgument);
}

TEST(CheckpointRead, FileThatShrankIsReportedAsTruncated) {
  TempDir dir;
  const std::vector<std::byte> bytes = Pattern(1024, 0);
  CheckpointWriter writer;
  ASSERT_TRUE(writer.AddTensor("w", DType::kF32, {256}, bytes).ok());
  const std::string path = dir.File("m.safetensors");
  ASSERT_TRUE(writer.Write(path).ok());
  Result<Checkpoint> checkpoint = Checkpoint::Open(path);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(checkpoint->data_start() + 100)), 0);

  std::vector<std::byte> out(1024);
  Status status = checkpoint->Read(*checkpoint->Find("w"), 0, out);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr(path + ": tensor 'w': file is truncated"));
  std::vector<std::byte> head(100);
  EXPECT_TRUE(checkpoint->Read(*checkpoint->Find("w"), 0, head).ok());
}

TEST(ParseSafetensorsHeader, ErrorsNameTheOrigin) {
  Result<SafetensorsHeader> header = ParseSafetensorsHeader(
      R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4, "origin.safetensors");
  ASSERT_FALSE(header.ok());
  EXPECT_EQ(header.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(header.status().message(),
            "origin.safetensors: tensor 'x': data_offsets [0, 8] run past the end of the data "
            "section (4 bytes)");
}

TEST(ParseSafetensorsHeader, AcceptsAdjacentTensorsZeroSizeAnywhereAndNegativeZero) {
  Result<SafetensorsHeader> header =
      ParseSafetensorsHeader(R"({"b":{"dtype":"U8","shape":[4],"data_offsets":[4,8]},)"
                             R"("a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                             R"("e":{"dtype":"F64","shape":[-0,3],"data_offsets":[2,2]},)"
                             R"("__metadata__":{"z":"1","y":""}})",
                             8, "t");
  ASSERT_TRUE(header.ok()) << header.status().ToString();
  ASSERT_EQ(header->tensors.size(), 3u);
  EXPECT_EQ(header->tensors[0].name, "a");
  EXPECT_EQ(header->tensors[2].name, "e");
  EXPECT_EQ(header->tensors[2].shape, (std::vector<int64_t>{0, 3}));
  EXPECT_EQ(header->metadata,
            (std::vector<std::pair<std::string, std::string>>{{"y", ""}, {"z", "1"}}));
}

TEST(ParseSafetensorsHeader, NamesDuplicateKeysWhereverTheyAre) {
  Result<SafetensorsHeader> header = ParseSafetensorsHeader(
      R"({"w":{"dtype":"F32","shape":[],"data_offsets":[0,4],"shape":[1]}})", 4, "t");
  ASSERT_FALSE(header.ok());
  EXPECT_EQ(header.status().message(), "t: tensor 'w': duplicate key 'shape'");
}

TEST(ParseSafetensorsHeader, LimitsNestingDepth) {
  auto header_with_shape_depth = [](int arrays) {
    return R"({"t":{"dtype":"F32","data_offsets":[0,4],"shape":)" + std::string(arrays, '[') +
           std::string(arrays, ']') + "}}";
  };
  // The header object and the tensor entry are two levels; 62 arrays make 64.
  Result<SafetensorsHeader> header = ParseSafetensorsHeader(header_with_shape_depth(62), 4, "t");
  ASSERT_FALSE(header.ok());
  EXPECT_EQ(header.status().message(), "t: tensor 't': shape[0] is not an integer");
  header = ParseSafetensorsHeader(header_with_shape_depth(63), 4, "t");
  ASSERT_FALSE(header.ok());
  EXPECT_EQ(header.status().message(), "t: header: JSON nests deeper than 64 levels");
}

TEST(CheckpointWriter, RejectsBadTensors) {
  CheckpointWriter writer;
  const std::vector<std::byte> bytes = Pattern(8, 0);
  ASSERT_TRUE(writer.AddTensor("w", DType::kF32, {2}, bytes).ok());

  struct Case {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    size_t size;
    std::string error;
  };
  const std::vector<Case> cases = {
      {"w", DType::kF32, {2}, 8, "tensor 'w': added twice"},
      {"", DType::kF32, {2}, 8, "tensor name is empty"},
      {"__metadata__", DType::kF32, {2}, 8, "name is reserved"},
      {"v", DType::kF32, {3}, 8, "8 bytes given but F32 [3] needs 12"},
      {"v", DType::kF32, {-2}, 8, "shape [-2] has a negative dimension"},
      {"v", DType::kF64, {1ll << 31, 1ll << 31, 1ll << 31}, 8, "overflows"},
      {"v", DType::kBytes, {2}, 8, "invalid dtype"},
      {"v", static_cast<DType>(kDTypeLimit), {2}, 8, "invalid dtype"},
  };
  for (const Case& c : cases) {
    Status status = writer.AddTensor(c.name, c.dtype, c.shape, std::span(bytes).first(c.size));
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << c.error;
    EXPECT_THAT(status.message(), HasSubstr(c.error));
  }
  EXPECT_FALSE(writer.AddTensor("f", DType::kF32, {2}, CheckpointWriter::FillFn()).ok());
}

TEST(CheckpointWriter, FailedFillLeavesTheOldFileAndNoTemporary) {
  TempDir dir;
  const std::string path = dir.File("m.safetensors");
  WriteFile(path, "old contents");
  const std::vector<std::byte> bytes = Pattern(4, 0);
  CheckpointWriter writer;
  ASSERT_TRUE(writer.AddTensor("ok", DType::kU8, {4}, bytes).ok());
  ASSERT_TRUE(
      writer
          .AddTensor("bad", DType::kF32, {4},
                     [](uint64_t, std::span<std::byte>) { return Internal("generator exploded"); })
          .ok());
  for (int threads : {1, 3}) {
    Status status = writer.Write(path, threads);
    EXPECT_EQ(status.code(), StatusCode::kInternal);
    EXPECT_EQ(status.message(), path + ": tensor 'bad': generator exploded");
    EXPECT_EQ(ReadFile(path), "old contents");
    EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
  }
}

// The names in a directory.
std::vector<std::string> Names(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// A writer killed part way (SIGKILL, which nothing can clean up after) leaves
// nothing in the directory: the file being written has no name until it is
// complete. Skipped where the file system has no such files.
TEST(CheckpointWriter, AWriterKilledPartWayLeavesNothing) {
  TempDir dir;
  const int probe = platform::OpenUnnamed(dir.path().c_str());
  if (probe < 0 && platform::NoUnnamedFiles(errno)) {
    GTEST_SKIP() << "the file system of " << dir.path()
                 << " has no unnamed files (O_TMPFILE); writes go to PATH.tmp";
  }
  ASSERT_GE(probe, 0) << std::strerror(errno);
  ::close(probe);
  const std::string path = dir.File("m.safetensors");
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    CheckpointWriter writer;
    // 40 MiB: the first 16 MiB chunk is written, the second kills the writer.
    const Status added = writer.AddTensor("t", DType::kU8, {int64_t{40} << 20},
                                          [](uint64_t offset, std::span<std::byte> out) {
                                            if (offset > 0) ::raise(SIGKILL);
                                            std::memset(out.data(), 7, out.size());
                                            return Status::Ok();
                                          });
    if (added.ok()) (void)writer.Write(path, 1);
    ::_exit(3);  // not reached: the fill kills the process
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status;
  EXPECT_THAT(Names(dir.path()), ::testing::IsEmpty());
}

// A PATH.tmp left by an older write (a writer killed between naming and
// renaming, or one of a file system without unnamed files) is replaced.
TEST(CheckpointWriter, ALeftoverTemporaryIsReplaced) {
  TempDir dir;
  const std::string path = dir.File("m.safetensors");
  WriteFile(path + ".tmp", "an older write's leftover");
  const std::vector<std::byte> bytes = Pattern(64, 3);
  CheckpointWriter writer;
  ASSERT_TRUE(writer.AddTensor("t", DType::kU8, {64}, bytes).ok());
  ASSERT_TRUE(writer.Write(path).ok());
  EXPECT_EQ(Names(dir.path()), std::vector<std::string>{"m.safetensors"});
  Result<Checkpoint> checkpoint = Checkpoint::Open(path);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
}

TEST(CheckpointWriter, MissingDirectoryIsReported) {
  TempDir dir;
  CheckpointWriter writer;
  Status status = writer.Write(dir.File("no/such/dir/m.safetensors"));
  EXPECT_EQ(status.code(), StatusCode::kNotFound);
  EXPECT_THAT(status.message(), HasSubstr("m.safetensors.tmp"));
}

TEST(CheckpointWriter, InvalidUtf8IsRejectedAtWrite) {
  TempDir dir;
  CheckpointWriter writer;
  writer.SetMetadata("key", "\xff\xfe");
  const std::string path = dir.File("m.safetensors");
  Status status = writer.Write(path);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("not valid UTF-8"));
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
}

}  // namespace
}  // namespace hearth
