// `hearth inspect`: a checkpoint's tensors and checksum, read from its
// files, or a store's model's, attached as a worker would.
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cli/cli_common.h"
#include "cli/commands.h"
#include "hearth/attach.h"
#include "hearth/checkpoint.h"
#include "hearth/checksum.h"

namespace hearth::cli {
namespace {

template <typename T>
void PrintTensorTable(const std::vector<T>& tensors) {
  size_t width = 6;
  for (const auto& t : tensors) width = std::max(width, t.name.size());
  std::printf("%-*s  %-7s  %-22s  %14s  %14s\n", static_cast<int>(width), "tensor", "dtype",
              "shape", "offset", "bytes");
  for (const auto& t : tensors) {
    std::printf("%-*s  %-7s  %-22s  %14llu  %14llu\n", static_cast<int>(width), t.name.c_str(),
                std::string(DTypeName(t.dtype)).c_str(), ShapeString(t.shape).c_str(),
                static_cast<unsigned long long>(t.offset),
                static_cast<unsigned long long>(t.nbytes));
  }
}

// A checkpoint's tensors, with the shard each lies in when there are several.
void PrintCheckpointTable(const Checkpoint& ckpt) {
  if (ckpt.shards().size() == 1) return PrintTensorTable(ckpt.tensors());
  size_t width = 6;
  for (const TensorInfo& t : ckpt.tensors()) width = std::max(width, t.name.size());
  std::printf("%-*s  %-7s  %-22s  %14s  %14s  %s\n", static_cast<int>(width), "tensor", "dtype",
              "shape", "offset", "bytes", "shard");
  for (const TensorInfo& t : ckpt.tensors()) {
    std::printf("%-*s  %-7s  %-22s  %14llu  %14llu  %s\n", static_cast<int>(width), t.name.c_str(),
                std::string(DTypeName(t.dtype)).c_str(), ShapeString(t.shape).c_str(),
                static_cast<unsigned long long>(t.offset),
                static_cast<unsigned long long>(t.nbytes), ckpt.shards()[t.shard].name.c_str());
  }
}

int InspectCheckpoint(const std::string& path) {
  Result<Checkpoint> ckpt = Checkpoint::Open(path);
  if (!ckpt.ok()) return Fail(ckpt.status());
  for (const std::string& warning : ckpt->warnings())
    std::fprintf(stderr, "warning: %s\n", warning.c_str());
  std::vector<uint64_t> digests;
  std::vector<std::byte> block;
  for (const TensorInfo& t : ckpt->tensors()) {
    for (uint64_t off = 0; off < t.nbytes; off += kChecksumBlockBytes) {
      block.resize(std::min(kChecksumBlockBytes, t.nbytes - off));
      if (Status s = ckpt->Read(t, off, block); !s.ok()) return Fail(s);
      digests.push_back(BlockDigest(block));
    }
  }
  if (ckpt->is_directory()) std::printf("checkpoint: %s (a directory)\n", path.c_str());
  if (!ckpt->index_path().empty()) {
    std::printf("index: %s\n", ckpt->index_path().c_str());
    for (size_t i = 0; i < ckpt->shards().size(); ++i) {
      const CheckpointFile& shard = ckpt->shards()[i];
      std::printf("shard %zu: %s (%llu tensor%s, %llu bytes)\n", i + 1, shard.name.c_str(),
                  static_cast<unsigned long long>(shard.tensor_count),
                  shard.tensor_count == 1 ? "" : "s", static_cast<unsigned long long>(shard.size));
      for (const auto& [k, v] : shard.metadata)
        std::printf("shard %zu: metadata: %s = %s\n", i + 1, k.c_str(), v.c_str());
    }
  } else {
    std::printf("file: %s\n", ckpt->shards().front().path.c_str());
    for (const auto& [k, v] : ckpt->metadata())
      std::printf("metadata: %s = %s\n", k.c_str(), v.c_str());
  }
  std::printf("tensors: %zu, %llu bytes\n", ckpt->tensors().size(),
              static_cast<unsigned long long>(ckpt->tensor_bytes()));
  PrintCheckpointTable(*ckpt);
  std::printf("checksum: %s\n", ChecksumHex(CombineBlockDigests(digests)).c_str());
  return 0;
}

// Sums the Rss and Pss of this process's mappings of the arena, in KiB.
void PrintMappingMemory(const Attachment& a) {
  if (a.device().is_cuda() || a.tensors().empty()) return;
  const auto base =
      reinterpret_cast<uintptr_t>(a.tensors().front().data) - a.tensors().front().offset;
  FILE* f = std::fopen("/proc/self/smaps", "r");
  if (f == nullptr) return;
  char line[512];
  bool in_arena = false;
  unsigned long long rss = 0, pss = 0;
  while (std::fgets(line, sizeof line, f) != nullptr) {
    unsigned long long lo, hi;
    if (std::sscanf(line, "%llx-%llx ", &lo, &hi) == 2 &&
        std::strchr(line, '-') < std::strchr(line, ' ')) {
      in_arena = lo == base;
      continue;
    }
    unsigned long long kb;
    if (in_arena && std::sscanf(line, "Rss: %llu kB", &kb) == 1) rss += kb;
    if (in_arena && std::sscanf(line, "Pss: %llu kB", &kb) == 1) pss += kb;
  }
  std::fclose(f);
  std::printf("mapping: rss %llu KiB, pss %llu KiB\n", rss, pss);
}

int InspectStore(const AttachOptions& store, const std::string& model_text, bool verify,
                 bool hold) {
  Result<ModelRef> ref = ModelRef::Parse(model_text);
  if (!ref.ok()) return Fail(ref.status());
  AttachClient client(store);
  auto attached = client.Attach(ref->name, ref->version);
  if (!attached.ok()) return Fail(attached.status());
  const Attachment& a = **attached;
  std::printf("model: %s@%llu on %s (pid %d)\n", a.model().c_str(),
              static_cast<unsigned long long>(a.version()), a.device().ToString().c_str(),
              ::getpid());
  std::printf("tensors: %zu, arena %llu bytes\n", a.tensors().size(),
              static_cast<unsigned long long>(a.manifest().arena_size));
  PrintTensorTable(a.tensors());
  Result<uint64_t> mapped = a.ComputeChecksum();
  if (!mapped.ok()) return Fail(mapped.status());
  std::printf("checksum: %s\n", ChecksumHex(*mapped).c_str());
  if (verify) {
    const bool ok = *mapped == a.checksum();
    std::printf("checksum %s: mapped bytes %s, store's manifest %s\n", ok ? "ok" : "MISMATCH",
                ChecksumHex(*mapped).c_str(), ChecksumHex(a.checksum()).c_str());
    if (!ok) return 2;
  }
  PrintMappingMemory(a);
  std::fflush(stdout);
  if (hold) {
    InstallStopHandlers();
    WaitForStopSignal();
  }
  return 0;
}

// What the command line sets.
struct InspectFlags {
  std::string checkpoint, model;
  bool verify = false, hold = false;
  StoreClientFlags client;
};

int RunInspectCommand(const InspectFlags& f) {
  Result<NamedStores> stores = StoresOf(f.client);
  if (!stores.ok()) return Fail(stores.status());
  if (!f.checkpoint.empty() && !f.model.empty())
    return Fail(InvalidArgument("give either a CHECKPOINT or --model, not both"));
  if (!f.checkpoint.empty()) return InspectCheckpoint(f.checkpoint);
  if (!f.model.empty()) {
    if (stores->size() > 1)
      return Fail(InvalidArgument("inspect --model attaches from one store: give one --device"));
    return InspectStore(stores->front().second, f.model, f.verify, f.hold);
  }
  return Fail(InvalidArgument("inspect needs a CHECKPOINT (file or directory) or --model NAME"));
}

}  // namespace

Subcommand AddInspectCommand(CLI::App& app) {
  auto* inspect = app.add_subcommand(
      "inspect",
      "print a checkpoint's (file or directory) or a store's model's tensors and checksum");
  auto flags = std::make_shared<InspectFlags>();
  InspectFlags& f = *flags;
  inspect->add_option("checkpoint", f.checkpoint,
                      "a safetensors file, or a checkpoint directory (model.safetensors, or "
                      "shards with model.safetensors.index.json): lists every shard's tensors");
  AddStoreClientOptions(inspect, &f.client);
  inspect->add_option("--model", f.model, "NAME[@VERSION] to attach from the store");
  inspect->add_flag("--verify", f.verify,
                    "with --model: check the mapped bytes against the checksum in the store's "
                    "manifest. This proves only that the bytes are what the store claims: that "
                    "the store is the real one is the peer check's job (a store of another uid "
                    "is refused unless trusted with --store-uid); compare with `hearth inspect "
                    "CHECKPOINT` to check against a checkpoint");
  inspect->add_flag("--hold", f.hold, "with --model: stay attached until SIGTERM or SIGINT");
  return {inspect, [flags] { return RunInspectCommand(*flags); }};
}

}  // namespace hearth::cli
