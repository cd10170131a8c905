// Arenas: one exportable memory region per model version, and the read-only
// mappings importers make of it.
//
// Two kinds, one interface:
//  - host: a memfd (MFD_CLOEXEC|MFD_ALLOW_SEALING), filled, then sealed with
//    F_SEAL_WRITE|F_SEAL_SHRINK|F_SEAL_GROW|F_SEAL_SEAL; exported as a fresh
//    O_RDONLY descriptor of it; importers mmap(PROT_READ, MAP_SHARED).
//  - cuda: cuMemCreate with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR (size
//    rounded up to the allocation granularity), mapped read-write in the store
//    only while loading; each Export() is one cuMemExportToShareableHandle;
//    importers cuMemImportFromShareableHandle + cuMemMap + cuMemSetAccess with
//    CU_MEM_ACCESS_FLAGS_PROT_READ.
//
// The CUDA driver is resolved at run time (dlopen of libcuda.so.1, or
// LoadLibrary of nvcuda.dll), so these binaries start on machines without a
// GPU or driver.
//
// On Windows (docs/windows.md) host arenas are pagefile-backed sections
// (platform/section.h) and an export is a handle duplicated into the
// importer's process with read access only: Export() and Map(UniqueFd) give
// way to ExportTo(pid) and MapHandle(). CUDA arenas there are created with
// CU_MEM_HANDLE_TYPE_WIN32 and exported as NT handles duplicated the same
// way (memory/cuda_shareable.h); importers map them with PROT_READ access.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "hearth/device.h"
#include "hearth/manifest.h"  // kArenaAlignment
#include "hearth/status.h"
#include "hearth/unique_fd.h"

namespace hearth {

// Packs `sizes` one after another, each at a multiple of `alignment` (a power
// of two). Returns the offsets; *total receives the packed size. Errors on
// overflow.
Result<std::vector<uint64_t>> PackOffsets(const std::vector<uint64_t>& sizes, uint64_t alignment,
                                          uint64_t* total);

// Whether CUDA devices can be used here; when not, *why says why (no driver,
// no device, built without CUDA). Probes once; thread-safe.
bool CudaAvailable(std::string* why = nullptr);
// How many CUDA devices this process sees: the driver's count, which
// CUDA_VISIBLE_DEVICES has already narrowed (and renumbered from 0). An
// error saying why where CUDA cannot be used (no driver, no device, built
// without CUDA).
Result<int> CudaDeviceCount();
// The PCI bus id of CUDA device `device` (an ordinal of this process, as
// CUDA_VISIBLE_DEVICES numbers them), "dddddddd:bb:dd.0" in hex: how NVML
// and nvidia-smi name that GPU. An error where CUDA cannot be used or
// `device` is not an ordinal here.
Result<std::string> CudaDevicePciBusId(int device);
// The device `hearth store` uses when none is named: cuda:0 if CUDA is
// available, else cpu.
Device DefaultDevice();

// Writes into an arena while it loads. Thread index t in [0, threads) must be
// used by one thread at a time; different indices may run concurrently.
class ArenaWriter {
 public:
  virtual ~ArenaWriter() = default;
  // Returns a buffer of `len` bytes (len <= max_chunk) that will land at
  // arena offset `offset` once End(t) is called. For host arenas this is the
  // arena itself; for CUDA a pinned staging buffer (waiting, if needed, until
  // its previous copy has finished).
  virtual Result<std::span<std::byte>> Begin(int t, uint64_t offset, uint64_t len) = 0;
  // Hands the buffer from Begin(t) over; for CUDA this queues the copy.
  virtual Status End(int t) = 0;
  // Waits for every queued copy.
  virtual Status Finish() = 0;
};

// Store side. Not thread-safe except where noted; Export() is thread-safe after Seal().
class Arena {
 public:
  virtual ~Arena() = default;

  // A new arena of `size` bytes on `device`, writable until Seal().
  static Result<std::unique_ptr<Arena>> Create(Device device, uint64_t size);

  virtual Device device() const = 0;
  // Bytes usable (as asked for).
  virtual uint64_t size() const = 0;
  // Bytes really allocated (CUDA rounds up to the allocation granularity).
  virtual uint64_t allocation_size() const = 0;

  // Opens a writer with `threads` thread slots and chunks of up to `max_chunk` bytes.
  virtual Result<std::unique_ptr<ArenaWriter>> OpenWriter(int threads, uint64_t max_chunk) = 0;
  // Ends loading: no writes afterwards (host: seals the memfd and unmaps it;
  // cuda: unmaps the store's read-write mapping).
  virtual Status Seal() = 0;
#ifdef _WIN32
  // A read-only handle to the arena made in the process `peer_pid` (the
  // importer's, as the kernel names it): its value, valid in that process
  // only, which the caller sends it. Only after Seal().
  virtual Result<uint64_t> ExportTo(uint32_t peer_pid) const = 0;
#else
  // One descriptor for one importer; the caller owns it. Only after Seal().
  virtual Result<UniqueFd> Export() const = 0;
#endif
};

// Importer side: a read-only mapping of an exported arena. Owns the mapping
// (and, for CUDA, the imported handle); the destructor unmaps and releases.
class ArenaMapping {
 public:
  virtual ~ArenaMapping() = default;

  // Maps `fd` read-only. `size` is the size the store claims; it is checked
  // against the real region before anything is mapped. For CUDA the calling
  // process gets (or reuses) the device's primary context.
#ifdef _WIN32
  // Maps the handle `handle` (a section's, or a CUDA allocation's NT handle:
  // a value valid in this process, which the store made with ExportTo;
  // taken: closed by the mapping, or on failure) read-only; `size` is
  // checked against the region first.
  static Result<std::unique_ptr<ArenaMapping>> MapHandle(uint64_t handle, Device device,
                                                         uint64_t size);
#else
  static Result<std::unique_ptr<ArenaMapping>> Map(UniqueFd fd, Device device, uint64_t size);
#endif

  // Host pointer, or the device address (a CUdeviceptr) for CUDA.
  virtual const void* data() const = 0;
  virtual uint64_t size() const = 0;
  virtual Device device() const = 0;
  // Copies bytes [offset, offset + out.size()) to host memory.
  virtual Status CopyToHost(uint64_t offset, std::span<std::byte> out) const = 0;
};

}  // namespace hearth
