// The draw of llm_model.h's SamplingParams on the host: greedy, or top-k,
// then top-p, then Gumbel-max keyed by (seed, position, token).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "backends/llm/llm_model.h"

namespace hearth::llm {
namespace {

// First index of the largest value; a NaN counts as larger than any number
// (torch.argmax).
int32_t ArgMax(std::span<const float> v) {
  size_t best = 0;
  for (size_t j = 1; j < v.size(); ++j) {
    if (std::isnan(v[best])) break;
    if (std::isnan(v[j]) || v[j] > v[best]) best = j;
  }
  return static_cast<int32_t>(best);
}

}  // namespace

int32_t SampleToken(std::span<const float> logits, const SamplingParams& params, int64_t position) {
  if (logits.empty()) return -1;
  if (!(params.temperature > 0)) return ArgMax(logits);
  const size_t vocab = logits.size();

  // top_k: the k-th largest logit is the bar (ties with it are kept).
  float bar = -INFINITY;
  if (params.top_k > 0 && static_cast<size_t>(params.top_k) < vocab) {
    std::vector<float> sorted;
    sorted.reserve(vocab);
    for (float l : logits) {
      if (!std::isnan(l)) sorted.push_back(l);
    }
    const size_t k = static_cast<size_t>(params.top_k);
    if (k <= sorted.size()) {
      std::nth_element(sorted.begin(), sorted.begin() + static_cast<ptrdiff_t>(k - 1), sorted.end(),
                       std::greater<float>());
      bar = sorted[k - 1];
    }
  }
  std::vector<int32_t> kept;
  for (size_t j = 0; j < vocab; ++j) {
    if (logits[j] >= bar) kept.push_back(static_cast<int32_t>(j));  // never NaN
  }
  if (kept.empty()) return ArgMax(logits);

  std::vector<float> scaled(kept.size());
  for (size_t i = 0; i < kept.size(); ++i) {
    scaled[i] = logits[static_cast<size_t>(kept[i])] / params.temperature;
  }

  // top_p over what top_k kept: the probabilities (in double) sorted
  // largest first; the threshold is the first probability at which the
  // sum of all probabilities at least that large reaches top_p. Equal
  // probabilities are kept or dropped together.
  if (params.top_p < 1.0f) {
    double max = -INFINITY;
    for (float s : scaled) max = std::max(max, static_cast<double>(s));
    std::vector<double> prob(kept.size());
    double sum = 0;
    for (size_t i = 0; i < kept.size(); ++i) {
      prob[i] = std::exp(static_cast<double>(scaled[i]) - max);
      sum += prob[i];
    }
    for (double& p : prob) p /= sum;
    std::vector<double> order = prob;
    std::sort(order.begin(), order.end(), std::greater<double>());
    double threshold = order.back();  // all kept, if rounding never reaches top_p
    double total = 0;
    for (size_t i = 0; i < order.size();) {
      size_t j = i;
      while (j < order.size() && order[j] == order[i]) total += order[j++];
      if (total >= static_cast<double>(params.top_p)) {
        threshold = order[i];
        break;
      }
      i = j;
    }
    size_t n = 0;
    for (size_t i = 0; i < kept.size(); ++i) {
      if (prob[i] >= threshold) {
        kept[n] = kept[i];
        scaled[n] = scaled[i];
        ++n;
      }
    }
    kept.resize(n);
    scaled.resize(n);
  }

  int32_t best = kept[0];
  float best_score = -INFINITY;
  for (size_t i = 0; i < kept.size(); ++i) {
    const float u = GumbelUniform(params.seed, position, kept[i]);
    const float score = scaled[i] + -std::log(-std::log(u));
    if (i == 0 || score > best_score) {
      best = kept[i];
      best_score = score;
    }
  }
  return best;
}

}  // namespace hearth::llm
