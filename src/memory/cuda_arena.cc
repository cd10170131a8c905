// CUDA arenas: one cuMemCreate allocation, exportable as a POSIX descriptor
// (or, on Windows, as an NT handle: cuda_shareable.h).
//
// The store maps it read-write (cuMemAddressReserve + cuMemMap +
// cuMemSetAccess(READWRITE)) only while loading; writers stage chunks in
// pinned host buffers and copy them with cuMemcpyHtoDAsync on one stream per
// thread slot. Seal() waits for every copy, unmaps the store's mapping and
// frees its address range, keeping only the allocation handle, which each
// Export() turns into a new descriptor.
#include <spdlog/spdlog.h>

#ifndef _WIN32
#include <fcntl.h>
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "memory/arena_kinds.h"
#include "memory/cuda_driver.h"
#include "memory/cuda_shareable.h"

namespace hearth {
namespace {

// Three buffers per slot: one being filled by its thread, one being copied,
// one spare, so a thread reading the next chunk rarely waits for a copy.
constexpr int kStagingBuffersPerSlot = 3;
constexpr int kMaxWriterThreads = 256;
// Pinned memory is a scarce, unswappable resource: 3 x threads x max_chunk.
constexpr uint64_t kMaxStagingChunk = uint64_t{1} << 30;

std::string DeviceName(int device) { return "cuda:" + std::to_string(device); }

class CudaArenaWriter;

// Pinned staging buffers outlive the writers that use them: pinning host
// memory costs about as much time as the copies it speeds up, and a store
// loads many checkpoints over its life. Up to HEARTH_PINNED_CACHE_MIB
// (default 512) MiB are kept for the next writer; the rest is freed.
class PinnedCache {
 public:
  static PinnedCache& Get() {
    static PinnedCache* cache = new PinnedCache();  // never destroyed: outlives static writers
    return *cache;
  }
  void* Take(uint64_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < buffers_.size(); ++i) {
      if (buffers_[i].second == bytes) {
        void* p = buffers_[i].first;
        buffers_.erase(buffers_.begin() + static_cast<long>(i));
        cached_ -= bytes;
        return p;
      }
    }
    return nullptr;
  }
  // False when the cache is full: the caller frees the buffer.
  bool Give(void* p, uint64_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    if (cached_ + bytes > limit_) return false;
    buffers_.emplace_back(p, bytes);
    cached_ += bytes;
    return true;
  }

 private:
  PinnedCache() {
    const char* env = std::getenv("HEARTH_PINNED_CACHE_MIB");
    limit_ = (env != nullptr ? std::strtoull(env, nullptr, 10) : 512ull) << 20;
  }
  std::mutex mu_;
  std::vector<std::pair<void*, uint64_t>> buffers_;
  uint64_t cached_ = 0;
  uint64_t limit_ = 0;
};

// What writers share with their arena. `base` is mapped read-write while
// `closed` is false; the arena sets `closed` and waits for every registered
// writer's copies (under `mu`) before it unmaps.
struct CudaArenaShared {
  int device = 0;
  CUdeviceptr base = 0;
  uint64_t size = 0;
  std::atomic<bool> closed{false};
  std::mutex mu;
  std::vector<CudaArenaWriter*> writers;  // guarded by mu
};

class CudaArenaWriter final : public ArenaWriter {
 public:
  CudaArenaWriter(const CudaDriver* cu, std::shared_ptr<CudaArenaShared> shared, int threads,
                  uint64_t max_chunk)
      : cu_(cu), shared_(std::move(shared)), max_chunk_(max_chunk), slots_(threads) {}

  ~CudaArenaWriter() override {
    {
      std::lock_guard<std::mutex> lock(shared_->mu);
      auto& writers = shared_->writers;
      writers.erase(std::remove(writers.begin(), writers.end(), this), writers.end());
    }
    bool made_any = false;
    for (const Slot& slot : slots_) {
      made_any = made_any || slot.stream != nullptr;
      for (const Staging& buffer : slot.buffers) {
        made_any = made_any || buffer.host != nullptr || buffer.done != nullptr;
      }
    }
    if (!made_any) return;
    Status status = MakeContextCurrent(shared_->device);
    if (!status.ok()) {
      spdlog::error("CUDA arena writer cannot release its streams and pinned buffers: {}",
                    status.ToString());
      return;
    }
    for (Slot& slot : slots_) {
      // A copy still in flight reads its staging buffer: wait before freeing.
      if (slot.stream != nullptr) {
        CuLogIfError(*cu_, cu_->StreamSynchronize(slot.stream), "cuStreamSynchronize");
      }
      for (Staging& buffer : slot.buffers) {
        if (buffer.done != nullptr) {
          CuLogIfError(*cu_, cu_->EventDestroy(buffer.done), "cuEventDestroy");
        }
        if (buffer.host != nullptr && !PinnedCache::Get().Give(buffer.host, max_chunk_)) {
          CuLogIfError(*cu_, cu_->MemFreeHost(buffer.host), "cuMemFreeHost");
        }
      }
      if (slot.stream != nullptr) {
        CuLogIfError(*cu_, cu_->StreamDestroy(slot.stream), "cuStreamDestroy");
      }
    }
  }

  CudaArenaWriter(const CudaArenaWriter&) = delete;
  CudaArenaWriter& operator=(const CudaArenaWriter&) = delete;

  Result<std::span<std::byte>> Begin(int t, uint64_t offset, uint64_t len) override {
    if (shared_->closed.load(std::memory_order_acquire)) {
      return FailedPrecondition("CUDA arena writer used after the arena was sealed");
    }
    RETURN_IF_ERROR(CheckSlot(t));
    RETURN_IF_ERROR(CheckWriterChunk(offset, len, max_chunk_, shared_->size, "CUDA arena"));
    Slot& slot = slots_[static_cast<size_t>(t)];
    if (slot.active >= 0) {
      return FailedPrecondition("writer thread slot " + std::to_string(t) +
                                ": Begin called again before End");
    }
    RETURN_IF_ERROR(MakeContextCurrent(shared_->device));
    RETURN_IF_ERROR(InitSlot(slot).WithContext("writer thread slot " + std::to_string(t)));
    Staging& buffer = slot.buffers[static_cast<size_t>(slot.next)];
    if (buffer.pending) {
      RETURN_IF_ERROR(CuCheck(*cu_, cu_->EventSynchronize(buffer.done),
                              "waiting for an earlier staging copy (cuEventSynchronize)"));
      buffer.pending = false;
    }
    slot.active = slot.next;
    slot.offset = offset;
    slot.len = len;
    return std::span<std::byte>(static_cast<std::byte*>(buffer.host), static_cast<size_t>(len));
  }

  Status End(int t) override {
    RETURN_IF_ERROR(CheckSlot(t));
    Slot& slot = slots_[static_cast<size_t>(t)];
    if (slot.active < 0) {
      return FailedPrecondition("writer thread slot " + std::to_string(t) +
                                ": End called without Begin");
    }
    Staging& buffer = slot.buffers[static_cast<size_t>(slot.active)];
    const uint64_t offset = slot.offset;
    const uint64_t len = slot.len;
    slot.active = -1;
    slot.next = (slot.next + 1) % kStagingBuffersPerSlot;
    if (shared_->closed.load(std::memory_order_acquire)) {
      return FailedPrecondition("CUDA arena writer used after the arena was sealed");
    }
    if (len == 0) return Status::Ok();
    RETURN_IF_ERROR(MakeContextCurrent(shared_->device));
    RETURN_IF_ERROR(
        CuCheck(*cu_, cu_->MemcpyHtoDAsync(shared_->base + offset, buffer.host, len, slot.stream),
                "queueing a " + std::to_string(len) + "-byte copy to arena offset " +
                    std::to_string(offset) + " (cuMemcpyHtoDAsync)"));
    CUresult recorded = cu_->EventRecord(buffer.done, slot.stream);
    if (recorded != CUDA_SUCCESS) {
      // Without the event a later Begin could not tell when the copy has
      // read the buffer; wait for it here instead.
      CuLogIfError(*cu_, cu_->StreamSynchronize(slot.stream), "cuStreamSynchronize");
      return CuCheck(*cu_, recorded, "cuEventRecord after a staging copy");
    }
    buffer.pending = true;
    return Status::Ok();
  }

  Status Finish() override {
    Status first = SyncAll();
    for (size_t t = 0; t < slots_.size() && first.ok(); ++t) {
      if (slots_[t].active >= 0) {
        first = FailedPrecondition("writer thread slot " + std::to_string(t) +
                                   " has a Begin without End");
      }
    }
    return first;
  }

  // Waits for every copy this writer queued; the first error, if any.
  Status SyncAll() {
    bool any = false;
    for (const Slot& slot : slots_) any = any || slot.stream != nullptr;
    if (!any) return Status::Ok();
    RETURN_IF_ERROR(MakeContextCurrent(shared_->device));
    Status first;
    for (size_t t = 0; t < slots_.size(); ++t) {
      Slot& slot = slots_[t];
      if (slot.stream == nullptr) continue;
      Status status =
          CuCheck(*cu_, cu_->StreamSynchronize(slot.stream),
                  "copies of writer thread slot " + std::to_string(t) + " (cuStreamSynchronize)");
      if (status.ok()) {
        for (Staging& buffer : slot.buffers) buffer.pending = false;
      } else if (first.ok()) {
        first = status;
      }
    }
    return first;
  }

 private:
  struct Staging {
    void* host = nullptr;    // cuMemHostAlloc, max_chunk_ bytes
    CUevent done = nullptr;  // recorded after the copy that reads `host`
    bool pending = false;    // `done` recorded and not yet waited for
  };
  struct Slot {
    CUstream stream = nullptr;
    std::array<Staging, kStagingBuffersPerSlot> buffers;
    bool ready = false;
    int next = 0;     // buffer the next Begin returns
    int active = -1;  // buffer between Begin and End, or -1
    uint64_t offset = 0;
    uint64_t len = 0;
  };

  Status CheckSlot(int t) const {
    if (t < 0 || static_cast<size_t>(t) >= slots_.size()) {
      return InvalidArgument("writer thread index " + std::to_string(t) + " is not in [0, " +
                             std::to_string(slots_.size()) + ")");
    }
    return Status::Ok();
  }

  // Allocates the slot's stream, events and pinned buffers on its first use;
  // after a failure, what was made is kept and the rest retried next time.
  Status InitSlot(Slot& slot) {
    if (slot.ready) return Status::Ok();
    if (slot.stream == nullptr) {
      // Non-blocking: the copies must not serialise with the legacy default
      // stream, which other code in the process may use.
      RETURN_IF_ERROR(
          CuCheck(*cu_, cu_->StreamCreate(&slot.stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate"));
    }
    for (Staging& buffer : slot.buffers) {
      if (buffer.done == nullptr) {
        // Blocking sync: a thread waiting for a copy sleeps instead of
        // spinning on a core that another loader thread could read with.
        RETURN_IF_ERROR(CuCheck(
            *cu_, cu_->EventCreate(&buffer.done, CU_EVENT_DISABLE_TIMING | CU_EVENT_BLOCKING_SYNC),
            "cuEventCreate"));
      }
      if (buffer.host == nullptr) buffer.host = PinnedCache::Get().Take(max_chunk_);
      if (buffer.host == nullptr) {
        // Portable: cached buffers may serve a writer on another device's context.
        // Not write-combined: the loader may read staged bytes back (to
        // checksum them), and CPU reads of write-combined memory are uncached.
        RETURN_IF_ERROR(
            CuCheck(*cu_, cu_->MemHostAlloc(&buffer.host, max_chunk_, CU_MEMHOSTALLOC_PORTABLE),
                    "cuMemHostAlloc of a " + std::to_string(max_chunk_) + "-byte staging buffer"));
      }
    }
    slot.ready = true;
    return Status::Ok();
  }

  const CudaDriver* cu_;
  std::shared_ptr<CudaArenaShared> shared_;
  uint64_t max_chunk_;
  std::vector<Slot> slots_;
};

class CudaArena final : public Arena {
 public:
  CudaArena(const CudaDriver* cu, int device, uint64_t size)
      : cu_(cu), device_(device), size_(size), shared_(std::make_shared<CudaArenaShared>()) {
    shared_->device = device;
  }

  ~CudaArena() override {
    Status status = CloseWriters();
    if (!status.ok()) spdlog::error("destroying a CUDA arena: {}", status.ToString());
    if (!has_handle_ && !reserved_) return;  // Allocate() failed before making anything
    status = MakeContextCurrent(device_);
    if (!status.ok()) {
      spdlog::error("CUDA arena on {} cannot be released: {}", DeviceName(device_),
                    status.ToString());
      return;
    }
    UnmapReadWrite();
    if (has_handle_) CuLogIfError(*cu_, cu_->MemRelease(handle_), "cuMemRelease");
  }

  CudaArena(const CudaArena&) = delete;
  CudaArena& operator=(const CudaArena&) = delete;

  // Creates the allocation and maps it read-write for loading. On failure
  // the destructor releases whatever was made.
  Status Allocate() {
    RETURN_IF_ERROR(MakeContextCurrent(device_));
    CUdevice dev = 0;
    RETURN_IF_ERROR(CuCheck(*cu_, cu_->DeviceGet(&dev, device_), "cuDeviceGet"));
    int vmm = 0;
    int shareable = 0;
    RETURN_IF_ERROR(CuCheck(
        *cu_,
        cu_->DeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev),
        "cuDeviceGetAttribute"));
    RETURN_IF_ERROR(CuCheck(*cu_,
                            cu_->DeviceGetAttribute(&shareable, kCudaShareableHandleSupported, dev),
                            "cuDeviceGetAttribute"));
    if (vmm == 0) {
      return Unavailable(DeviceName(device_) +
                         " does not support CUDA virtual memory management (cuMemCreate)");
    }
    if (shareable == 0) {
      return Unavailable(DeviceName(device_) + " cannot export memory as " +
                         kCudaShareableHandleKind);
    }

    CUmemAllocationProp prop{};  // allocFlags must stay zero
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device_;
    prop.requestedHandleTypes = kCudaShareableHandleType;
#ifdef _WIN32
    ASSIGN_OR_RETURN(prop.win32HandleMetaData, CudaWin32HandleMetadata());
#endif
    size_t minimum = 0;
    size_t recommended = 0;
    RETURN_IF_ERROR(CuCheck(
        *cu_, cu_->MemGetAllocationGranularity(&minimum, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
        "cuMemGetAllocationGranularity(MINIMUM)"));
    RETURN_IF_ERROR(CuCheck(
        *cu_,
        cu_->MemGetAllocationGranularity(&recommended, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
        "cuMemGetAllocationGranularity(RECOMMENDED)"));
    if (minimum == 0) return Internal("the driver reports an allocation granularity of 0");
    // Sizes must be multiples of the minimum; the recommended one (if it is
    // a larger multiple of the minimum) is what the driver maps fastest.
    uint64_t granularity = minimum;
    if (recommended > minimum && recommended % minimum == 0) granularity = recommended;
    if (!RoundUpToMultiple(size_, granularity, &allocation_size_)) {
      return InvalidArgument("CUDA arena size " + std::to_string(size_) + " is too large");
    }

    RETURN_IF_ERROR(CuCheck(
        *cu_, cu_->MemCreate(&handle_, allocation_size_, &prop, 0),
        "cuMemCreate of " + std::to_string(allocation_size_) + " bytes on " + DeviceName(device_)));
    has_handle_ = true;
    RETURN_IF_ERROR(CuCheck(*cu_, cu_->MemAddressReserve(&va_, allocation_size_, 0, 0, 0),
                            "cuMemAddressReserve"));
    reserved_ = true;
    RETURN_IF_ERROR(CuCheck(*cu_, cu_->MemMap(va_, allocation_size_, 0, handle_, 0), "cuMemMap"));
    mapped_ = true;
    CUmemAccessDesc access{};
    access.location = prop.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    RETURN_IF_ERROR(CuCheck(*cu_, cu_->MemSetAccess(va_, allocation_size_, &access, 1),
                            "cuMemSetAccess(READWRITE)"));
    shared_->base = va_;
    shared_->size = size_;
    return Status::Ok();
  }

  Device device() const override { return Device::Cuda(device_); }
  uint64_t size() const override { return size_; }
  uint64_t allocation_size() const override { return allocation_size_; }

  Result<std::unique_ptr<ArenaWriter>> OpenWriter(int threads, uint64_t max_chunk) override {
    if (sealed_ || !mapped_ || shared_->closed.load()) {
      return FailedPrecondition("cannot open a writer on a sealed CUDA arena");
    }
    if (threads < 1 || threads > kMaxWriterThreads) {
      return InvalidArgument("a CUDA arena writer takes 1 to " + std::to_string(kMaxWriterThreads) +
                             " thread slots, not " + std::to_string(threads));
    }
    if (max_chunk == 0 || max_chunk > kMaxStagingChunk) {
      return InvalidArgument("a CUDA arena writer's max_chunk must be 1 byte to 1 GiB, not " +
                             std::to_string(max_chunk));
    }
    auto writer = std::make_unique<CudaArenaWriter>(cu_, shared_, threads, max_chunk);
    {
      std::lock_guard<std::mutex> lock(shared_->mu);
      shared_->writers.push_back(writer.get());
    }
    return std::unique_ptr<ArenaWriter>(std::move(writer));
  }

  Status Seal() override {
    if (sealed_) return FailedPrecondition("CUDA arena is already sealed");
    if (!load_error_.ok()) return load_error_;
    Status copies = CloseWriters();
    if (!copies.ok()) {
      // Some bytes may never have arrived: such an arena must not be exported.
      load_error_ = FailedPrecondition("a copy into this CUDA arena failed: " + copies.ToString());
    }
    RETURN_IF_ERROR(MakeContextCurrent(device_));
    UnmapReadWrite();
    if (!load_error_.ok()) return load_error_;
    if (mapped_ || reserved_) {
      return Internal("CUDA arena on " + DeviceName(device_) +
                      ": the loading mapping could not be removed (see the log)");
    }
    sealed_ = true;
    return Status::Ok();
  }

#ifdef _WIN32
  Result<uint64_t> ExportTo(uint32_t peer_pid) const override {
    if (!sealed_) return FailedPrecondition("cannot export a CUDA arena before Seal()");
    RETURN_IF_ERROR(MakeContextCurrent(device_));
    return ExportCudaAllocationTo(*cu_, handle_, peer_pid);
  }
#else
  Result<UniqueFd> Export() const override {
    if (!sealed_) return FailedPrecondition("cannot export a CUDA arena before Seal()");
    RETURN_IF_ERROR(MakeContextCurrent(device_));
    int fd = -1;
    RETURN_IF_ERROR(CuCheck(
        *cu_,
        cu_->MemExportToShareableHandle(&fd, handle_, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
        "cuMemExportToShareableHandle"));
    if (fd < 0) return Internal("cuMemExportToShareableHandle returned no descriptor");
    UniqueFd owned(fd);
    // The driver does not document the descriptor as close-on-exec; every
    // hearth descriptor must be.
    int flags = ::fcntl(owned.get(), F_GETFD);
    if (flags < 0 || ::fcntl(owned.get(), F_SETFD, flags | FD_CLOEXEC) != 0) {
      return ErrnoError("setting FD_CLOEXEC on an exported CUDA arena descriptor", errno);
    }
    return owned;
  }
#endif

 private:
  // Stops every writer and waits for its copies; the first copy error.
  Status CloseWriters() {
    shared_->closed.store(true, std::memory_order_release);
    std::lock_guard<std::mutex> lock(shared_->mu);
    Status first;
    for (CudaArenaWriter* writer : shared_->writers) {
      Status status = writer->SyncAll();
      if (first.ok() && !status.ok()) first = status;
    }
    return first;
  }

  // Removes the store's read-write mapping and its address range; logs
  // failures. Needs the device's context current.
  void UnmapReadWrite() noexcept {
    if (mapped_) {
      CUresult result = cu_->MemUnmap(va_, allocation_size_);
      CuLogIfError(*cu_, result, "cuMemUnmap of a CUDA arena's loading mapping");
      if (result == CUDA_SUCCESS) mapped_ = false;
    }
    if (reserved_ && !mapped_) {
      CUresult result = cu_->MemAddressFree(va_, allocation_size_);
      CuLogIfError(*cu_, result, "cuMemAddressFree of a CUDA arena's loading range");
      if (result == CUDA_SUCCESS) reserved_ = false;
    }
  }

  const CudaDriver* cu_;
  const int device_;
  const uint64_t size_;
  uint64_t allocation_size_ = 0;
  CUmemGenericAllocationHandle handle_ = 0;
  bool has_handle_ = false;
  CUdeviceptr va_ = 0;
  bool reserved_ = false;
  bool mapped_ = false;
  bool sealed_ = false;
  Status load_error_;
  std::shared_ptr<CudaArenaShared> shared_;
};

}  // namespace

Result<std::unique_ptr<Arena>> CreateCudaArena(int device, uint64_t size) {
  if (size == 0) {
    return InvalidArgument("a CUDA arena cannot be empty (size 0 on " + DeviceName(device) + ")");
  }
  ASSIGN_OR_RETURN(const CudaDriver* cu, CudaDriver::Get());
  auto arena = std::make_unique<CudaArena>(cu, device, size);
  RETURN_IF_ERROR(arena->Allocate());
  return std::unique_ptr<Arena>(std::move(arena));
}

}  // namespace hearth
