// A worker's request slot: a memfd that holds a batch's inputs and outputs,
// mapped by the server and by its worker. Only the server makes it larger;
// it is sealed against shrinking, so that no worker can truncate it under
// the server's mapping (which would make the server's reads fault). Its
// first control::kSlotHeaderBytes hold the worker's life lock
// (protocol/life_lock.h); the data, which every offset counts from, follow.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "hearth/status.h"
#include "hearth/unique_fd.h"

namespace hearth {

class RequestSlot {
 public:
  // An empty slot; `name` shows in /proc listings.
  static Result<RequestSlot> Create(const std::string& name);
  RequestSlot() = default;
  RequestSlot(RequestSlot&& other) noexcept;
  RequestSlot& operator=(RequestSlot&& other) noexcept;
  ~RequestSlot();

  // Grows to at least `bytes` (rounded up to a power of two of at least
  // 64 KiB, so that growing is rare), keeping its contents; at most `limit`.
  // ResourceExhausted naming both when `bytes` is past `limit`.
  Status Reserve(uint64_t bytes, uint64_t limit);

  std::byte* data() const { return data_; }
  uint64_t size() const { return size_; }
  int fd() const { return fd_.get(); }
  // The life lock's page, mapped for as long as a holder of it keeps it.
  const std::shared_ptr<void>& header() const { return header_; }

 private:
  void Unmap();
  UniqueFd fd_;
  std::byte* data_ = nullptr;  // the mapping starts kSlotHeaderBytes before
  uint64_t size_ = 0;
  std::shared_ptr<void> header_;
};

}  // namespace hearth
