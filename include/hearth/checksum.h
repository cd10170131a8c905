// hearth's checksum of a model's tensor bytes ("xxh3-tree"):
//
//   Each tensor's bytes are cut into blocks of kChecksumBlockBytes (16 MiB; the
//   last block may be shorter; an empty tensor has no block). Each block's
//   digest is XXH3-64 (seed 0) of its bytes. The checksum is XXH3-64 (seed 0)
//   of all block digests, written as 8-byte little-endian integers, tensors in
//   name order (byte-wise), blocks in order.
//
// Blocks make it parallel: a loader hashes each block as it streams it, on
// any thread. Printed as 16 lowercase hex digits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace hearth {

inline constexpr uint64_t kChecksumBlockBytes = 16ull << 20;

// Number of blocks a tensor of `nbytes` bytes is cut into.
inline uint64_t ChecksumBlockCount(uint64_t nbytes) {
  return (nbytes + kChecksumBlockBytes - 1) / kChecksumBlockBytes;
}
// XXH3-64 of one block.
uint64_t BlockDigest(std::span<const std::byte> block);
// Combines block digests, already in checksum order (tensors by name, blocks in order).
uint64_t CombineBlockDigests(std::span<const uint64_t> digests);
std::string ChecksumHex(uint64_t checksum);

}  // namespace hearth
