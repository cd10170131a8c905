#include "hearth/device.h"

#include <charconv>

namespace hearth {

std::string Device::ToString() const {
  if (kind == DeviceKind::kHost) return "cpu";
  return "cuda:" + std::to_string(index);
}

Result<Device> Device::Parse(std::string_view text) {
  if (text == "cpu" || text == "host") return Device::Host();
  if (text == "cuda") return Device::Cuda(0);
  constexpr std::string_view kPrefix = "cuda:";
  if (text.substr(0, kPrefix.size()) == kPrefix) {
    std::string_view digits = text.substr(kPrefix.size());
    int index = -1;
    auto [ptr, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), index);
    if (ec == std::errc() && ptr == digits.data() + digits.size() && index >= 0 && index < 1024) {
      return Device::Cuda(index);
    }
  }
  return InvalidArgument("device '" + std::string(text) + "' is not one of cpu, cuda, cuda:N");
}

}  // namespace hearth
