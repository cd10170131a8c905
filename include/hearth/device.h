// Where memory lives: host memory (a sealed memfd) or one CUDA device.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "hearth/status.h"

namespace hearth {

enum class DeviceKind : uint8_t { kHost = 0, kCuda = 1 };

struct Device {
  DeviceKind kind = DeviceKind::kHost;
  int index = 0;  // CUDA ordinal; 0 for host

  static Device Host() { return {DeviceKind::kHost, 0}; }
  static Device Cuda(int index) { return {DeviceKind::kCuda, index}; }

  bool is_cuda() const { return kind == DeviceKind::kCuda; }
  // "cpu" or "cuda:N".
  std::string ToString() const;
  // Accepts "cpu", "cuda" (= cuda:0) and "cuda:N".
  static Result<Device> Parse(std::string_view text);

  friend bool operator==(const Device&, const Device&) = default;
};

}  // namespace hearth
