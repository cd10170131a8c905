// cuda_write_probe MODE FD SIZE DEVICE
//
// A stand-in worker for memory_cuda_test: maps the exported CUDA arena that
// it inherited as descriptor FD (SIZE bytes on cuda:DEVICE) read-only with
// ArenaMapping::Map, then
//   write: launches a kernel that writes through the mapping; prints the
//          error and exits 3 when the driver stops it (the expected outcome),
//          exits 0 if the write went through;
//   sum:   launches a kernel that sums the bytes; prints "sum=N" and the
//          context's per-thread stack size "stack=N", exits 0.
// Exit 2: bad arguments or the mapping failed.
#include <charconv>
#include <cstdio>
#include <string>
#include <string_view>

#include "cuda_write_probe_kernels.h"
#include "hearth/arena.h"

namespace {

template <typename T>
bool ParseNumber(std::string_view text, T* out) {
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), *out);
  return ec == std::errc() && end == text.data() + text.size();
}

int Fail(int code, const std::string& message) {
  std::fprintf(stderr, "cuda_write_probe: %s\n", message.c_str());
  std::fflush(stderr);
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  int fd = -1;
  uint64_t size = 0;
  int device = -1;
  if (argc != 5 || !ParseNumber(argv[2], &fd) || !ParseNumber(argv[3], &size) ||
      !ParseNumber(argv[4], &device)) {
    return Fail(2, "usage: cuda_write_probe write|sum FD SIZE DEVICE");
  }
  const std::string_view mode = argv[1];
  if (mode != "write" && mode != "sum") return Fail(2, "unknown mode " + std::string(mode));

  auto mapping =
      hearth::ArenaMapping::Map(hearth::UniqueFd(fd), hearth::Device::Cuda(device), size);
  if (!mapping.ok()) return Fail(2, "map failed: " + mapping.status().ToString());

  if (mode == "write") {
    std::string error = hearth::probe::WriteThroughMapping(device, (*mapping)->data(), size);
    if (error.empty()) {
      std::printf("write went through the read-only mapping\n");
      std::fflush(stdout);
      return 0;
    }
    std::printf("write failed: %s\n", error.c_str());
    std::fflush(stdout);
    return 3;
  }
  uint64_t sum = 0;
  std::string error = hearth::probe::SumThroughMapping(device, (*mapping)->data(), size, &sum);
  if (!error.empty()) return Fail(3, "sum failed: " + error);
  uint64_t stack = 0;
  error = hearth::probe::StackSizeLimit(device, &stack);
  if (!error.empty()) return Fail(3, error);
  std::printf("sum=%llu\nstack=%llu\n", static_cast<unsigned long long>(sum),
              static_cast<unsigned long long>(stack));
  std::fflush(stdout);
  return 0;
}
