// Read-only mappings of host arenas on Windows: a section handle the store
// duplicated into this process with read access only (platform/section.h).
#include <cstdint>
#include <cstring>
#include <string>

#include "memory/arena_kinds.h"
#include "platform/section.h"

namespace hearth {
namespace {

class HostArenaMapping final : public ArenaMapping {
 public:
  explicit HostArenaMapping(platform::ReadOnlyView view) : view_(std::move(view)) {}

  const void* data() const override { return view_.bytes().data(); }
  uint64_t size() const override { return view_.bytes().size(); }
  Device device() const override { return Device::Host(); }

  Status CopyToHost(uint64_t offset, std::span<std::byte> out) const override {
    if (!RangeWithin(offset, out.size(), size())) {
      return InvalidArgument("bytes [" + std::to_string(offset) + ", +" +
                             std::to_string(out.size()) + ") lie outside the " +
                             std::to_string(size()) + "-byte mapping");
    }
    if (!out.empty()) std::memcpy(out.data(), view_.bytes().data() + offset, out.size());
    return Status::Ok();
  }

 private:
  platform::ReadOnlyView view_;
};

}  // namespace

Result<std::unique_ptr<ArenaMapping>> MapHostArena(uint64_t handle, uint64_t size) {
  // The view maps read-only whatever access the handle has; the store gave
  // it FILE_MAP_READ only, so that no writable view can be made of it here.
  Result<platform::ReadOnlyView> view = platform::ReadOnlyView::Map(
      reinterpret_cast<platform::NativeHandle>(static_cast<uintptr_t>(handle)), size);
  if (!view.ok()) return view.status().WithContext("mapping a host arena");
  return std::unique_ptr<ArenaMapping>(new HostArenaMapping(std::move(view).value()));
}

}  // namespace hearth
