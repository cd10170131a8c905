// Attachment (hearth/attach.h): the tensors of a mapped arena, and how an
// AttachClient is made, on every system; what connects and maps is
// attach_client.cc (Linux) and attach_client_windows.cc.
#include <algorithm>
#include <utility>
#include <vector>

#include "hearth/attach.h"
#include "hearth/checksum.h"
#ifdef _WIN32
#include "platform/local_channel.h"
#endif

namespace hearth {

AttachClient::AttachClient(std::string socket_path)
    : AttachClient(AttachOptions{std::move(socket_path), {}}) {}

AttachClient::AttachClient(AttachOptions options)
    : socket_path_(options.socket_path.empty() ? DefaultSocketPath()
                                               : std::move(options.socket_path)),
      trusted_uids_(std::move(options.trusted_store_uids)),
      receive_timeout_(options.receive_timeout) {
  Result<std::vector<uint32_t>> env = StoreUidsFromEnvironment();
  if (!env.ok()) {
    environment_ = env.status();
    return;
  }
  trusted_uids_.insert(trusted_uids_.end(), env->begin(), env->end());
  environment_ = CheckTrustedStoreUids(trusted_uids_);
}

Attachment::Attachment(Connection connection, std::unique_ptr<ArenaMapping> mapping,
                       Manifest manifest)
    : connection_(std::move(connection)),
      mapping_(std::move(mapping)),
      manifest_(std::move(manifest)) {
  const auto* base = static_cast<const std::byte*>(mapping_->data());
  tensors_.reserve(manifest_.tensors.size());
  for (const ManifestTensor& t : manifest_.tensors) {
    tensors_.push_back(
        {t.name, t.dtype, t.shape, base + t.offset, t.offset, t.nbytes, manifest_.device});
  }
}

// The mapping goes before the lease: the store must never see a client
// detached while it still maps the arena.
Attachment::~Attachment() {
  mapping_.reset();
  connection_ = Connection();
}

const TensorView* Attachment::Find(std::string_view name) const {
  auto it = std::lower_bound(tensors_.begin(), tensors_.end(), name,
                             [](const TensorView& t, std::string_view n) { return t.name < n; });
  return it != tensors_.end() && it->name == name ? &*it : nullptr;
}

Status Attachment::CopyToHost(const TensorView& tensor, uint64_t offset,
                              std::span<std::byte> out) const {
  if (offset > tensor.nbytes || out.size() > tensor.nbytes - offset)
    return InvalidArgument("tensor '" + tensor.name + "': range past its " +
                           std::to_string(tensor.nbytes) + " bytes");
  return mapping_->CopyToHost(tensor.offset + offset, out);
}

Result<uint64_t> Attachment::ComputeChecksum() const {
  std::vector<uint64_t> digests;
  std::vector<std::byte> staging;
  for (const TensorView& t : tensors_) {
    for (uint64_t off = 0; off < t.nbytes; off += kChecksumBlockBytes) {
      const uint64_t len = std::min(kChecksumBlockBytes, t.nbytes - off);
      if (t.device.is_cuda()) {
        staging.resize(len);
        RETURN_IF_ERROR(CopyToHost(t, off, staging));
        digests.push_back(BlockDigest(staging));
      } else {
        digests.push_back(BlockDigest(std::span(static_cast<const std::byte*>(t.data) + off, len)));
      }
    }
  }
  return CombineBlockDigests(digests);
}

}  // namespace hearth
