#include "store/loader.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

#include "hearth/checkpoint.h"
#include "hearth/checksum.h"
#include "spdlog/spdlog.h"

namespace hearth {
namespace {

struct Block {
  size_t tensor;    // index into the checkpoint's (name-sorted) tensors, of every shard
  uint64_t offset;  // inside the tensor
  uint64_t len;
};

// A test seam: with $HEARTH_TEST_HOLD_LOAD set to exactly this checkpoint's
// path, a cancellable load waits here, before it reads anything, until it is
// cancelled. A test of stopping a store during its load then needs no
// checkpoint big enough to outlast the signal: the load cannot finish first.
void HoldForTests(const std::string& path, const std::atomic<bool>* cancel) {
  const char* held = std::getenv("HEARTH_TEST_HOLD_LOAD");
  if (cancel == nullptr || held == nullptr || path != held) return;
  spdlog::warn("loading {} is held by HEARTH_TEST_HOLD_LOAD until the store stops", path);
  while (!cancel->load()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
}

}  // namespace

Result<LoadedModel> LoadCheckpoint(const std::string& path, Device device,
                                   const LoadOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(Checkpoint checkpoint, Checkpoint::Open(path));
  ASSIGN_OR_RETURN(LoadedModel loaded, LoadCheckpoint(checkpoint, device, options));
  loaded.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return loaded;
}

Result<LoadedModel> LoadCheckpoint(const Checkpoint& checkpoint, Device device,
                                   const LoadOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  const std::string& path = checkpoint.path();
  auto cancelled = [&] {
    return options.cancel != nullptr && options.cancel->load(std::memory_order_relaxed);
  };
  for (const std::string& warning : checkpoint.warnings()) spdlog::warn("{}", warning);
  const std::vector<TensorInfo>& tensors = checkpoint.tensors();

  std::vector<uint64_t> sizes;
  sizes.reserve(tensors.size());
  for (const TensorInfo& t : tensors) sizes.push_back(t.nbytes);
  uint64_t arena_size = 0;
  ASSIGN_OR_RETURN(std::vector<uint64_t> offsets, PackOffsets(sizes, kArenaAlignment, &arena_size));

  LoadedModel loaded;
  loaded.fingerprint = checkpoint.Fingerprint();
  loaded.manifest.device = device;
  loaded.manifest.arena_size = arena_size;
  for (size_t i = 0; i < tensors.size(); ++i) {
    loaded.manifest.tensors.push_back(
        {tensors[i].name, tensors[i].dtype, tensors[i].shape, offsets[i], tensors[i].nbytes});
  }

  std::vector<Block> blocks;
  for (size_t i = 0; i < tensors.size(); ++i) {
    for (uint64_t off = 0; off < tensors[i].nbytes; off += kChecksumBlockBytes) {
      blocks.push_back({i, off, std::min(kChecksumBlockBytes, tensors[i].nbytes - off)});
    }
  }
  std::vector<uint64_t> digests(blocks.size());
  // Blocks are numbered in checksum order (tensors by name); they are read
  // file by file, each front to back, which is what readahead and a disk
  // serve best, whatever the names.
  std::vector<size_t> schedule(blocks.size());
  for (size_t b = 0; b < blocks.size(); ++b) schedule[b] = b;
  auto file_position = [&](size_t b) {
    const TensorInfo& t = tensors[blocks[b].tensor];
    return std::pair(t.shard, t.offset + blocks[b].offset);
  };
  std::sort(schedule.begin(), schedule.end(),
            [&](size_t a, size_t b) { return file_position(a) < file_position(b); });

  HoldForTests(path, options.cancel);
  if (cancelled()) return Unavailable("loading " + path + ": interrupted: the store is stopping");
  ASSIGN_OR_RETURN(loaded.arena, Arena::Create(device, arena_size));
  int threads = options.threads > 0
                    ? options.threads
                    : static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 8u));
  threads = std::max(1, std::min<int>(threads, static_cast<int>(blocks.size())));
  ASSIGN_OR_RETURN(std::unique_ptr<ArenaWriter> writer,
                   loaded.arena->OpenWriter(threads, kChecksumBlockBytes));

  std::atomic<size_t> next{0};
  std::atomic<uint64_t> done_bytes{0};
  std::atomic<bool> failed{false};
  std::mutex error_mu;
  Status first_error;
  auto fail = [&](Status s) {
    std::lock_guard lock(error_mu);
    if (first_error.ok()) first_error = std::move(s);
    failed = true;
  };

  auto work = [&](int t) {
    for (size_t n = next++; n < schedule.size() && !failed; n = next++) {
      if (cancelled()) return fail(Unavailable("interrupted: the store is stopping"));
      const size_t b = schedule[n];
      const Block& block = blocks[b];
      const TensorInfo& tensor = tensors[block.tensor];
      auto buffer = writer->Begin(t, offsets[block.tensor] + block.offset, block.len);
      if (!buffer.ok()) return fail(buffer.status());
      if (Status s = checkpoint.Read(tensor, block.offset, *buffer); !s.ok()) return fail(s);
      digests[b] = BlockDigest(*buffer);
      if (Status s = writer->End(t); !s.ok()) return fail(s);
      done_bytes += block.len;
    }
  };

  const uint64_t total = checkpoint.tensor_bytes();
  std::mutex progress_mu;
  std::condition_variable progress_cv;
  bool workers_done = false;
  std::thread reporter;
  if (options.progress) {
    reporter = std::thread([&] {
      std::unique_lock lock(progress_mu);
      while (!progress_cv.wait_for(lock, std::chrono::milliseconds(100),
                                   [&] { return workers_done; })) {
        options.progress(done_bytes.load(), total);
      }
    });
  }
  {
    std::vector<std::thread> pool;
    for (int t = 1; t < threads; ++t) pool.emplace_back(work, t);
    work(0);
    for (std::thread& th : pool) th.join();
  }
  Status finish = writer->Finish();
  writer.reset();
  if (reporter.joinable()) {
    {
      std::lock_guard lock(progress_mu);
      workers_done = true;
    }
    progress_cv.notify_all();
    reporter.join();
    options.progress(done_bytes.load(), total);
  }
  if (!first_error.ok()) return first_error.WithContext("loading " + path);
  RETURN_IF_ERROR(finish.WithContext("loading " + path));
  RETURN_IF_ERROR(loaded.arena->Seal());
  loaded.manifest.checksum = CombineBlockDigests(digests);
  loaded.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return loaded;
}

std::function<void(uint64_t, uint64_t)> TerminalProgress(std::string label) {
  if (!::isatty(STDERR_FILENO)) return {};
  const auto start = std::chrono::steady_clock::now();
  return
      [label = std::move(label), start, finished = false](uint64_t done, uint64_t total) mutable {
        if (finished) return;
        finished = done == total;
        const double s =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        const double rate = s > 0 ? static_cast<double>(done) / s : 0;
        const double left = rate > 0 ? static_cast<double>(total - done) / rate : 0;
        std::fprintf(stderr, "\r%s: %.2f/%.2f GiB  %.1f GB/s  %.1f s left   %s", label.c_str(),
                     static_cast<double>(done) / (1 << 30), static_cast<double>(total) / (1 << 30),
                     rate / 1e9, left, done == total ? "\n" : "");
        std::fflush(stderr);
      };
}

}  // namespace hearth
