// Feeds ParseSafetensorsHeader arbitrary headers and checks every header it
// accepts against the guarantees checkpoint.h makes.
//
// Input: an 8-byte little-endian data section size, then the header JSON.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string_view>

#include "checkpoint/safetensors_format.h"
#include "hearth/checkpoint.h"

namespace {

void Require(bool condition, const char* what) {
  if (!condition) {
    std::fprintf(stderr, "broken guarantee: %s\n", what);
    __builtin_trap();
  }
}

void CheckAccepted(const hearth::SafetensorsHeader& header, uint64_t data_size) {
  const auto& tensors = header.tensors;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const hearth::TensorInfo& t = tensors[i];
    Require(!t.name.empty() && t.name != "__metadata__", "tensor name");
    Require(i == 0 || tensors[i - 1].name < t.name, "tensors sorted by unique name");
    const std::optional<uint64_t> nbytes = hearth::TensorBytes(t.dtype, t.shape);
    Require(nbytes && *nbytes == t.nbytes, "nbytes == numel * dtype size");
    Require(t.nbytes == t.numel() * hearth::DTypeSize(t.dtype), "numel agrees");
    Require(t.offset <= data_size && t.nbytes <= data_size - t.offset, "inside the data section");
  }
  std::vector<const hearth::TensorInfo*> by_offset;
  for (const hearth::TensorInfo& t : tensors) {
    if (t.nbytes > 0) by_offset.push_back(&t);
  }
  std::sort(by_offset.begin(), by_offset.end(),
            [](const auto* a, const auto* b) { return a->offset < b->offset; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    Require(by_offset[i - 1]->offset + by_offset[i - 1]->nbytes <= by_offset[i]->offset,
            "tensors do not overlap");
  }
  for (size_t i = 1; i < header.metadata.size(); ++i) {
    Require(header.metadata[i - 1].first < header.metadata[i].first, "metadata sorted by key");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 8) return 0;
  const uint64_t data_size = hearth::LoadLittleEndian64(data);
  const std::string_view json(reinterpret_cast<const char*>(data) + 8, size - 8);
  hearth::Result<hearth::SafetensorsHeader> header =
      hearth::ParseSafetensorsHeader(json, data_size, "fuzz");
  if (header.ok()) {
    CheckAccepted(*header, data_size);
  } else {
    Require(header.status().code() == hearth::StatusCode::kInvalidArgument, "InvalidArgument");
    Require(header.status().message().starts_with("fuzz: "), "message names the origin");
  }
  return 0;
}
