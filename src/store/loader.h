// Streams a checkpoint (a safetensors file, or a checkpoint directory: every
// shard into the one arena) into a new arena.
//
// The tensors of all shards are packed in name order at kArenaAlignment,
// whichever shard holds them; the manifest lists them in that order, and the
// checksum is that of one file holding the same tensors. The work is cut
// into checksum blocks (16 MiB pieces of one tensor); `threads` workers take
// blocks from a shared counter, pread each into the buffer the ArenaWriter
// hands out (the arena itself on host memory; a pinned staging buffer on
// CUDA, whose copy to the device overlaps the next read), hash it while it is
// hot in cache, and hand it back. Blocks are taken in file order (shard by
// shard, each front to back). The checksum falls out of the block hashes.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "hearth/arena.h"
#include "hearth/checkpoint.h"
#include "hearth/manifest.h"
#include "hearth/status.h"

namespace hearth {

struct LoadOptions {
  // Reader threads; 0 picks min(hardware threads, 8): on the H200 host more
  // threads contend (16 loaded at half the rate of 8).
  int threads = 0;
  // Called from one thread, about every 100 ms and once at the end, with the
  // bytes of all shards together.
  std::function<void(uint64_t done_bytes, uint64_t total_bytes)> progress;
  // When set, read between blocks (16 MiB at most): once it holds true the
  // load stops within one block per thread and fails with kUnavailable
  // ("interrupted"), freeing the partial arena. A signal handler may set it.
  const std::atomic<bool>* cancel = nullptr;
};

struct LoadedModel {
  std::unique_ptr<Arena> arena;  // sealed
  Manifest manifest;             // model name and version left empty for the caller
  double seconds = 0;            // from open to sealed
  // Checkpoint::Fingerprint() of the files read, as they were opened: a
  // later open of the same path with the same fingerprint holds these bytes.
  std::string fingerprint;
};

Result<LoadedModel> LoadCheckpoint(const std::string& path, Device device,
                                   const LoadOptions& options = {});
// The same, of a checkpoint the caller has opened (and may have looked at:
// its fingerprint, say); `seconds` then counts from this call.
Result<LoadedModel> LoadCheckpoint(const Checkpoint& checkpoint, Device device,
                                   const LoadOptions& options = {});

// A progress callback that redraws one line on stderr ("NAME: 1.20/1.86 GiB
// 14.1 GB/s 0.1 s left") when stderr is a terminal, and does nothing otherwise.
std::function<void(uint64_t, uint64_t)> TerminalProgress(std::string label);

}  // namespace hearth
