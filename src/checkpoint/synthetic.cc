#include "checkpoint/synthetic.h"

#include <bit>
#include <cmath>
#include <initializer_list>
#include <span>
#include <utility>
#include <vector>

#include "common/float16.h"
#include "hearth/checkpoint.h"

namespace hearth {
namespace {

uint64_t StreamBase(uint64_t seed, uint64_t tensor_index) {
  return seed ^ SplitMix64(tensor_index + 1);
}

float UniformValue(uint64_t stream_base, uint64_t element, float bound) {
  const uint64_t x = SplitMix64(stream_base + element);
  const float u = static_cast<float>(x >> 40) * 0x1p-24f;
  return (2.0f * u - 1.0f) * bound;
}

template <typename Bits>
void StoreLittleEndian(Bits bits, std::byte* out) {
  for (size_t i = 0; i < sizeof(Bits); ++i) out[i] = static_cast<std::byte>(bits >> (8 * i));
}

// `encode` turns a float into the little-endian bytes of one element.
template <typename Encode>
CheckpointWriter::FillFn UniformFill(uint64_t seed, uint64_t tensor_index, float bound,
                                     size_t element_size, Encode encode) {
  const uint64_t base = StreamBase(seed, tensor_index);
  return [=](uint64_t offset, std::span<std::byte> out) -> Status {
    if (offset % element_size != 0 || out.size() % element_size != 0) {
      return Internal("synthetic fill: byte range is not aligned to elements");
    }
    const uint64_t first = offset / element_size;
    const size_t count = out.size() / element_size;
    for (size_t j = 0; j < count; ++j) {
      encode(UniformValue(base, first + j, bound), out.data() + j * element_size);
    }
    return Status::Ok();
  };
}

CheckpointWriter::FillFn MakeFill(DType dtype, uint64_t seed, uint64_t tensor_index, float bound) {
  switch (dtype) {
    case DType::kF16:
      return UniformFill(seed, tensor_index, bound, 2,
                         [](float v, std::byte* out) { StoreLittleEndian(FloatToHalf(v), out); });
    case DType::kBF16:
      return UniformFill(seed, tensor_index, bound, 2, [](float v, std::byte* out) {
        StoreLittleEndian(FloatToBFloat16(v), out);
      });
    default:  // kF32: the callers allow nothing else
      return UniformFill(seed, tensor_index, bound, 4, [](float v, std::byte* out) {
        StoreLittleEndian(std::bit_cast<uint32_t>(v), out);
      });
  }
}

Status CheckPositive(std::string_view model,
                     std::initializer_list<std::pair<std::string_view, int64_t>> dims) {
  for (const auto& [name, value] : dims) {
    if (value <= 0) {
      return InvalidArgument("synthetic " + std::string(model) + ": " + std::string(name) +
                             " must be positive, got " + std::to_string(value));
    }
  }
  return Status::Ok();
}

struct SyntheticTensor {
  std::string name;
  std::vector<int64_t> shape;
  int64_t fan_in;
};

Status WriteSynthetic(std::string_view model, const std::vector<SyntheticTensor>& tensors,
                      DType dtype, uint64_t seed, const std::string& path, int threads,
                      uint64_t max_shard_bytes) {
  const std::string context = "synthetic " + std::string(model);
  CheckpointWriter writer;
  writer.SetMetadata("hearth.model", std::string(model));
  writer.SetMetadata("hearth.seed", std::to_string(seed));
  for (size_t k = 0; k < tensors.size(); ++k) {
    const SyntheticTensor& t = tensors[k];
    RETURN_IF_ERROR(
        writer.AddTensor(t.name, dtype, t.shape, MakeFill(dtype, seed, k, SyntheticBound(t.fan_in)))
            .WithContext(context));
  }
  if (max_shard_bytes > 0) {
    return writer.WriteDirectory(path, max_shard_bytes, threads).WithContext(context);
  }
  return writer.Write(path, threads).WithContext(context);
}

}  // namespace

float SyntheticBound(int64_t fan_in) { return 1.0f / std::sqrt(static_cast<float>(fan_in)); }

float SyntheticValue(uint64_t seed, uint64_t tensor_index, uint64_t element, float bound) {
  return UniformValue(StreamBase(seed, tensor_index), element, bound);
}

Status WriteSyntheticMlp(int64_t in, int64_t hidden, int64_t out, DType dtype, uint64_t seed,
                         const std::string& path, int threads, uint64_t max_shard_bytes) {
  if (dtype != DType::kF32 && dtype != DType::kF16 && dtype != DType::kBF16) {
    return InvalidArgument("synthetic mlp: dtype must be F32, F16 or BF16, got " +
                           std::string(DTypeName(dtype)));
  }
  RETURN_IF_ERROR(CheckPositive("mlp", {{"in", in}, {"hidden", hidden}, {"out", out}}));
  return WriteSynthetic("mlp",
                        {
                            {"encoder.weight", {hidden, in}, in},
                            {"encoder.bias", {hidden}, in},
                            {"head.weight", {out, hidden}, hidden},
                            {"head.bias", {out}, hidden},
                        },
                        dtype, seed, path, threads, max_shard_bytes);
}

Status WriteSyntheticScale(int64_t n, uint64_t seed, const std::string& path, int threads,
                           uint64_t max_shard_bytes) {
  RETURN_IF_ERROR(CheckPositive("scale", {{"n", n}}));
  return WriteSynthetic("scale", {{"weight", {n}, 1}}, DType::kF32, seed, path, threads,
                        max_shard_bytes);
}

}  // namespace hearth
