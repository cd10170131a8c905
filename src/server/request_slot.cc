#include "server/request_slot.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <utility>

#include "protocol/life_lock.h"

namespace hearth {

using control::kSlotHeaderBytes;

Result<RequestSlot> RequestSlot::Create(const std::string& name) {
  // memfd names are at most 249 bytes; the name is only for /proc listings.
  const int fd = ::memfd_create(name.substr(0, 200).c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return ErrnoError("memfd_create for a request slot", errno);
  RequestSlot slot;
  slot.fd_.Reset(fd);
  if (::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_SEAL) != 0)
    return ErrnoError("sealing a request slot", errno);
  if (::ftruncate(fd, static_cast<off_t>(kSlotHeaderBytes)) != 0)
    return ErrnoError("sizing a request slot's header", errno);
  void* header = ::mmap(nullptr, kSlotHeaderBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (header == MAP_FAILED) return ErrnoError("mapping a request slot's header", errno);
  slot.header_ = std::shared_ptr<void>(header, [](void* p) { ::munmap(p, kSlotHeaderBytes); });
  return slot;
}

RequestSlot::RequestSlot(RequestSlot&& other) noexcept
    : fd_(std::move(other.fd_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      header_(std::move(other.header_)) {}

RequestSlot& RequestSlot::operator=(RequestSlot&& other) noexcept {
  if (this != &other) {
    Unmap();
    fd_ = std::move(other.fd_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    header_ = std::move(other.header_);
  }
  return *this;
}

RequestSlot::~RequestSlot() { Unmap(); }

void RequestSlot::Unmap() {
  if (data_ != nullptr) ::munmap(data_ - kSlotHeaderBytes, kSlotHeaderBytes + size_);
  data_ = nullptr;
  size_ = 0;
}

Status RequestSlot::Reserve(uint64_t bytes, uint64_t limit) {
  if (bytes <= size_) return Status::Ok();
  if (bytes > limit)
    return ResourceExhausted("a batch needs a slot of " + std::to_string(bytes) +
                             " bytes, over the limit of " + std::to_string(limit));
  uint64_t want = std::max<uint64_t>(64u << 10, std::bit_ceil(bytes));
  if (want > limit) want = limit;
  // The worker holds the memfd too and may have grown it: never shrink it
  // (the seal would refuse), map what is there.
  struct stat st {};
  if (::fstat(fd_.get(), &st) != 0) return ErrnoError("fstat of a request slot", errno);
  const uint64_t file = kSlotHeaderBytes + want;
  if (static_cast<uint64_t>(st.st_size) < file &&
      ::ftruncate(fd_.get(), static_cast<off_t>(file)) != 0)
    return ErrnoError("growing a request slot to " + std::to_string(want) + " bytes", errno);
  void* p = ::mmap(nullptr, file, PROT_READ | PROT_WRITE, MAP_SHARED, fd_.get(), 0);
  if (p == MAP_FAILED) return ErrnoError("mapping a request slot", errno);
  Unmap();
  data_ = static_cast<std::byte*>(p) + kSlotHeaderBytes;
  size_ = want;
  return Status::Ok();
}

}  // namespace hearth
