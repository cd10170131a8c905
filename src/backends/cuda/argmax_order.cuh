// The order of an argmax over float values with their indices, shared by the
// mlp backend's argmax output (kernels.cu) and the llm sampler's greedy pick
// (llm_sampling.cu): the largest value, a NaN above every number, the
// lowest index among equals (NaNs count as equal), as torch.argmax.
#pragma once

namespace hearth::cuda {

// Whether (a, ia) comes before (b, ib); an index of -1 is "none", after all.
template <typename Index>
__device__ __forceinline__ bool ArgmaxBefore(float a, Index ia, float b, Index ib) {
  if (ia < 0) return false;
  if (ib < 0) return true;
  const bool na = isnan(a), nb = isnan(b);
  if (na != nb) return na;
  if (na || a == b) return ia < ib;
  return a > b;
}

}  // namespace hearth::cuda
