// Device names of stores (hearth store --device, hearth.attach(device=)) and
// the socket path each device's store takes among several.
#include <charconv>

#include "hearth/store.h"

namespace hearth {

Result<StoreDevice> ParseStoreDevice(std::string_view text) {
  constexpr std::string_view kHost = "host";
  if (text.substr(0, kHost.size()) == kHost && text.size() > kHost.size()) {
    const std::string_view digits = text.substr(kHost.size());
    int index = -1;
    auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), index);
    // "host01" would name the same store as "host1" under another socket.
    if (ec == std::errc() && end == digits.data() + digits.size() && index >= 0 && index < 1024 &&
        (digits.size() == 1 || digits[0] != '0'))
      return StoreDevice{"host" + std::to_string(index), Device::Host()};
    return InvalidArgument("device '" + std::string(text) +
                           "' is not one of cpu, cuda, cuda:N, hostN (N from 0 to 1023)");
  }
  Result<Device> device = Device::Parse(text);
  if (!device.ok())
    return InvalidArgument("device '" + std::string(text) +
                           "' is not one of cpu, cuda, cuda:N, hostN (host memory standing in "
                           "for GPU N)");
  return StoreDevice{device->ToString(), *device};
}

Result<std::vector<StoreDevice>> ParseStoreDevices(std::string_view list) {
  std::vector<StoreDevice> out;
  size_t start = 0;
  for (;;) {
    const size_t comma = list.find(',', start);
    const std::string_view item = list.substr(
        start, comma == std::string_view::npos ? std::string_view::npos : comma - start);
    ASSIGN_OR_RETURN(StoreDevice d, ParseStoreDevice(item));
    for (const StoreDevice& seen : out)
      if (seen.name == d.name)
        return InvalidArgument("device list '" + std::string(list) + "' names " + d.name +
                               " twice");
    out.push_back(std::move(d));
    if (out.size() > kMaxStoreDevices)
      return InvalidArgument("device list '" + std::string(list.substr(0, 200)) +
                             "' names more than " + std::to_string(kMaxStoreDevices) + " devices");
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return out;
}

std::string DeviceSocketPath(std::string_view base, std::string_view device_name) {
  std::string suffix = "-";
  for (char c : device_name)
    if (c != ':') suffix += c;
  constexpr std::string_view kSock = ".sock";
  std::string out(base);
  // Only the last path component's ".sock" (not a directory's).
  const size_t slash = out.rfind('/');
  const size_t name_start = slash == std::string::npos ? 0 : slash + 1;
  if (out.size() >= name_start + kSock.size() + 1 &&
      std::string_view(out).substr(out.size() - kSock.size()) == kSock) {
    out.insert(out.size() - kSock.size(), suffix);
  } else {
    out += suffix;
  }
  return out;
}

}  // namespace hearth
