#include "hearth/manifest.h"

#include <charconv>
#include <limits>
#include <optional>
#include <string>

namespace hearth {

Status ValidateManifest(const Manifest& m) {
  const std::string where = "manifest of '" + m.model + "'";
  if (m.model.empty()) return InvalidArgument("manifest: empty model name");
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    const ManifestTensor& t = m.tensors[i];
    const std::string at = where + ": tensor '" + t.name + "'";
    if (t.name.empty())
      return InvalidArgument(where + ": tensor " + std::to_string(i) + " has no name");
    if (i > 0 && !(m.tensors[i - 1].name < t.name))
      return InvalidArgument(at + ": names are not unique and sorted");
    if (!IsStoredDType(static_cast<int>(t.dtype))) return InvalidArgument(at + ": unknown dtype");
    for (int64_t d : t.shape) {
      if (d < 0) return InvalidArgument(at + ": negative dimension");
    }
    const std::optional<uint64_t> bytes = TensorBytes(t.dtype, t.shape);
    if (!bytes) return InvalidArgument(at + ": shape overflows");
    if (*bytes != t.nbytes)
      return InvalidArgument(at + ": " + std::to_string(t.nbytes) +
                             " bytes do not match its shape and dtype");
    if (t.offset % kArenaAlignment != 0)
      return InvalidArgument(at + ": offset " + std::to_string(t.offset) + " is not aligned to " +
                             std::to_string(kArenaAlignment));
    if (t.offset > m.arena_size || t.nbytes > m.arena_size - t.offset)
      return InvalidArgument(at + ": bytes [" + std::to_string(t.offset) + ", +" +
                             std::to_string(t.nbytes) + ") lie outside the arena of " +
                             std::to_string(m.arena_size) + " bytes");
  }
  return Status::Ok();
}

Result<ModelRef> ModelRef::Parse(std::string_view text) {
  ModelRef ref;
  const size_t at = text.rfind('@');
  ref.name = std::string(text.substr(0, at));
  if (ref.name.empty()) return InvalidArgument("model '" + std::string(text) + "': empty name");
  if (at != std::string_view::npos) {
    std::string_view digits = text.substr(at + 1);
    auto [ptr, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), ref.version);
    if (ec != std::errc() || ptr != digits.data() + digits.size() || ref.version == 0)
      return InvalidArgument("model '" + std::string(text) +
                             "': the version after '@' must be a positive integer");
  }
  return ref;
}

std::string ModelRef::ToString() const {
  return version == 0 ? name : name + "@" + std::to_string(version);
}

}  // namespace hearth
