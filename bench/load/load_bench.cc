// Load throughput: a checkpoint from a hot page cache into an arena.
//
//   load_bench --file F [--make-gib 2] [--device cpu|cuda:0] [--threads N] [--repeat 3]
//
// --make-gib writes F first (8 F32 tensors of equal size, like
// ../shared/baselines/st_load.py) when it does not exist. The file is read
// once before timing so the page cache is hot. Prints one line per repeat and
// a summary line "load device=... best_gbps=...".
#include <fcntl.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "hearth/checksum.h"

#include "hearth/checkpoint.h"
#include "store/loader.h"

using namespace hearth;

int main(int argc, char** argv) {
  CLI::App app{"hearth load benchmark"};
  std::string file, device_text = "cpu";
  double make_gib = 0;
  int threads = 0, repeat = 3;
  app.add_option("--file", file, "safetensors checkpoint")->required();
  app.add_option("--make-gib", make_gib, "write a checkpoint of this many GiB first if missing");
  app.add_option("--device", device_text, "cpu or cuda:N");
  app.add_option("--threads", threads, "reader threads (0 = automatic)");
  app.add_option("--repeat", repeat, "timed loads");
  bool read_only = false;
  app.add_flag("--read-only", read_only, "measure only the parallel preads (and hashing) of the file");
  CLI11_PARSE(app, argc, argv);

  auto device = Device::Parse(device_text);
  if (!device.ok()) return std::fprintf(stderr, "%s\n", device.status().ToString().c_str()), 1;
  if (make_gib > 0 && !std::filesystem::exists(file)) {
    const int64_t floats = static_cast<int64_t>(make_gib * (1 << 30) / 4 / 8);
    const int64_t rows = floats / 8192;
    CheckpointWriter w;
    for (int i = 0; i < 8; ++i) {
      Status s = w.AddTensor("layer" + std::to_string(i) + ".weight", DType::kF32, {rows, 8192},
                             [i](uint64_t offset, std::span<std::byte> out) {
                               for (size_t k = 0; k < out.size(); ++k)
                                 out[k] = std::byte((offset + k) * 131 + i);
                               return Status::Ok();
                             });
      if (!s.ok()) return std::fprintf(stderr, "%s\n", s.ToString().c_str()), 1;
    }
    if (Status s = w.Write(file, 8); !s.ok()) return std::fprintf(stderr, "%s\n", s.ToString().c_str()), 1;
  }
  {
    // Warm the page cache.
    const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return std::perror(file.c_str()), 1;
    std::vector<char> buf(64 << 20);
    while (::read(fd, buf.data(), buf.size()) > 0) {
    }
    ::close(fd);
  }
  if (read_only) {
    // The ceiling of the read side alone: the same threads pread the file
    // into private 16 MiB buffers (and hash them), copying nowhere.
    auto ckpt = Checkpoint::Open(file);
    if (!ckpt.ok()) return 1;
    const int n = threads > 0 ? threads : 8;
    for (int hash = 0; hash < 2; ++hash) {
      std::atomic<uint64_t> next{0};
      const uint64_t total = ckpt->file_size();
      const auto t0 = std::chrono::steady_clock::now();
      std::vector<std::thread> pool;
      for (int t = 0; t < n; ++t) {
        pool.emplace_back([&] {
          std::vector<std::byte> buf(16 << 20);
          const int fd = ckpt->fd();
          for (uint64_t off = next.fetch_add(buf.size()); off < total; off = next.fetch_add(buf.size())) {
            const ssize_t got = ::pread(fd, buf.data(), std::min<uint64_t>(buf.size(), total - off), static_cast<off_t>(off));
            if (got > 0 && hash) BlockDigest(std::span(buf.data(), static_cast<size_t>(got)));
          }
        });
      }
      for (auto& th : pool) th.join();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::printf("read-only threads=%d hash=%d %.2f GB/s\n", n, hash, static_cast<double>(total) / s / 1e9);
    }
    return 0;
  }
  double best = 0;
  for (int r = 0; r < repeat; ++r) {
    LoadOptions options;
    options.threads = threads;
    auto loaded = LoadCheckpoint(file, *device, options);
    if (!loaded.ok()) return std::fprintf(stderr, "%s\n", loaded.status().ToString().c_str()), 1;
    uint64_t bytes = 0;
    for (const auto& t : loaded->manifest.tensors) bytes += t.nbytes;
    const double gbps = static_cast<double>(bytes) / loaded->seconds / 1e9;
    best = std::max(best, gbps);
    std::printf("load device=%s threads=%d %.2f GiB in %.0f ms = %.2f GB/s\n",
                device->ToString().c_str(), threads, static_cast<double>(bytes) / (1 << 30),
                loaded->seconds * 1e3, gbps);
  }
  std::printf("load device=%s best_gbps=%.2f\n", device->ToString().c_str(), best);
  return 0;
}
