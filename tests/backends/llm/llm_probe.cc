// llm_probe: runs the CPU executor on a checkpoint directory (config.json
// and safetensors, read by hearth's checkpoint reader into host memory) for
// test_llm_reference.py, which compares what it writes with torch.
//
//   llm_probe DIR OUT --prompt 1,2,3 [--prompt 4,5 ...] [--chunk N]
//             [--block-size N] [--scatter] [--generate N] [--drawn N]
//             [--temperature T] [--top-k K] [--top-p P] [--seed S]
//
// All prompts are one batch. Each step, every sequence feeds the next
// --chunk tokens of its prompt (0: all of it), or, once its prompt is fed
// and with --generate, the token it drew last.
// Without --generate: every step is StepLogits with every sequence of the
// step sampled; OUT gets, step after step, the float32 logits of the last
// token each sequence fed ([sequences in the step][vocab]).
// With --generate N: Step draws N tokens per sequence (the first from the
// end of its prompt); OUT gets them as int32, [sequence][N].
// --scatter deals the KV blocks out shuffled and interleaved between the
// sequences instead of in order.
// --drawn N: the last N tokens of every prompt are tokens its stream drew
// before it was interrupted (a resumed stream): its draws are numbered from
// N, not 0.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "backends/llm/llm_model.h"
#include "hearth/checkpoint.h"

namespace hearth::llm {
namespace {

struct Args {
  std::string dir, out;
  std::vector<std::vector<int32_t>> prompts;
  int32_t chunk = 0, block_size = 4, generate = 0, drawn = 0;
  bool scatter = false;
  SamplingParams params;
};

Result<std::vector<int32_t>> ParseIds(const std::string& text) {
  std::vector<int32_t> ids;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    char* end = nullptr;
    const long v = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0') return InvalidArgument("--prompt: not an id: " + item);
    ids.push_back(static_cast<int32_t>(v));
  }
  if (ids.empty()) return InvalidArgument("--prompt: empty");
  return ids;
}

Result<Args> Parse(int argc, char** argv) {
  if (argc < 3) return InvalidArgument("usage: llm_probe DIR OUT --prompt IDS ...");
  Args a;
  a.dir = argv[1];
  a.out = argv[2];
  for (int i = 3; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--scatter") {
      a.scatter = true;
      continue;
    }
    if (i + 1 >= argc) return InvalidArgument(flag + ": needs a value");
    const std::string v = argv[++i];
    if (flag == "--prompt") {
      ASSIGN_OR_RETURN(std::vector<int32_t> ids, ParseIds(v));
      a.prompts.push_back(std::move(ids));
    } else if (flag == "--chunk") {
      a.chunk = std::stoi(v);
    } else if (flag == "--block-size") {
      a.block_size = std::stoi(v);
    } else if (flag == "--generate") {
      a.generate = std::stoi(v);
    } else if (flag == "--drawn") {
      a.drawn = std::stoi(v);
    } else if (flag == "--temperature") {
      a.params.temperature = std::stof(v);
    } else if (flag == "--top-k") {
      a.params.top_k = std::stoi(v);
    } else if (flag == "--top-p") {
      a.params.top_p = std::stof(v);
    } else if (flag == "--seed") {
      a.params.seed = std::stoull(v);
    } else {
      return InvalidArgument("unknown flag " + flag);
    }
  }
  if (a.prompts.empty()) return InvalidArgument("no --prompt");
  return a;
}

// A sequence's progress through the steps.
struct Sequence {
  std::vector<int32_t> prompt;
  std::vector<int32_t> blocks;
  int32_t fed = 0;  // positions in the cache
  std::vector<int32_t> drawn;
};

Status Run(const Args& a) {
  // The checkpoint, read whole into host memory.
  ASSIGN_OR_RETURN(Checkpoint checkpoint, Checkpoint::Open(a.dir));
  std::vector<std::vector<std::byte>> buffers;
  std::vector<TensorView> views;
  for (const TensorInfo& t : checkpoint.tensors()) {
    buffers.emplace_back(t.nbytes);
    RETURN_IF_ERROR(checkpoint.Read(t, 0, buffers.back()));
  }
  for (size_t i = 0; i < checkpoint.tensors().size(); ++i) {
    const TensorInfo& t = checkpoint.tensors()[i];
    views.push_back(
        TensorView{t.name, t.dtype, t.shape, buffers[i].data(), 0, t.nbytes, Device::Host()});
  }
  ASSIGN_OR_RETURN(ModelConfig config, ReadModelConfig(a.dir));
  for (const std::string& note : config.notes) std::cerr << "note: " << note << "\n";
  ASSIGN_OR_RETURN(ModelWeights weights, BindWeights(config, views));

  std::vector<Sequence> seqs;
  int32_t max_positions = 0, tokens_per_step = 0, total_blocks = 0;
  for (const std::vector<int32_t>& p : a.prompts) {
    const int32_t positions = static_cast<int32_t>(p.size()) + a.generate;
    max_positions = std::max(max_positions, positions);
    tokens_per_step += a.chunk > 0 ? std::min<int32_t>(a.chunk, static_cast<int32_t>(p.size()))
                                   : static_cast<int32_t>(p.size());
    const int32_t blocks = (positions + a.block_size - 1) / a.block_size;
    total_blocks += blocks;
    seqs.push_back(Sequence{p, std::vector<int32_t>(static_cast<size_t>(blocks)), 0, {}});
  }
  // Block ids: in order, or a shuffled pool (with spares) dealt round-robin.
  std::vector<int32_t> ids(static_cast<size_t>(total_blocks + (a.scatter ? 7 : 0)));
  std::iota(ids.begin(), ids.end(), 0);
  if (a.scatter) std::shuffle(ids.begin(), ids.end(), std::mt19937(12345));
  size_t next_id = 0;
  if (a.scatter) {
    for (size_t j = 0;; ++j) {
      bool any = false;
      for (Sequence& s : seqs) {
        if (j >= s.blocks.size()) continue;
        s.blocks[j] = ids[next_id++];
        any = true;
      }
      if (!any) break;
    }
  } else {
    for (Sequence& s : seqs) {
      for (int32_t& b : s.blocks) b = ids[next_id++];
    }
  }

  ExecutorOptions options;
  options.max_seqs = static_cast<int32_t>(seqs.size());
  options.max_tokens_per_step = tokens_per_step;
  options.block_size = a.block_size;
  options.max_positions = max_positions;
  const uint64_t block_bytes =
      static_cast<uint64_t>(config.num_layers) * 2 *
      static_cast<uint64_t>(config.num_kv_heads * a.block_size * config.head_dim) * sizeof(float);
  options.kv_pool_bytes = block_bytes * ids.size();
  ASSIGN_OR_RETURN(std::unique_ptr<Executor> executor, CreateCpuExecutor(config, weights, options));

  std::ofstream out(a.out, std::ios::binary);
  int steps = 0;
  for (;;) {
    // This step's part of each sequence.
    std::vector<int32_t> tokens, offsets{0}, starts, tables;
    std::vector<uint8_t> sample;
    std::vector<SamplingParams> params;
    std::vector<int64_t> draws;
    std::vector<size_t> in_step;
    int32_t max_blocks = 0;
    for (const Sequence& s : seqs) max_blocks = std::max(max_blocks, int32_t(s.blocks.size()));
    for (size_t i = 0; i < seqs.size(); ++i) {
      Sequence& s = seqs[i];
      const auto prompt_len = static_cast<int32_t>(s.prompt.size());
      std::vector<int32_t> feed;
      if (s.fed < prompt_len) {
        const int32_t n = a.chunk > 0 ? std::min(a.chunk, prompt_len - s.fed) : prompt_len;
        feed.assign(s.prompt.begin() + s.fed, s.prompt.begin() + s.fed + n);
      } else if (a.generate > 0 && static_cast<int32_t>(s.drawn.size()) < a.generate) {
        feed = {s.drawn.back()};
      } else {
        continue;
      }
      in_step.push_back(i);
      starts.push_back(s.fed);
      tokens.insert(tokens.end(), feed.begin(), feed.end());
      offsets.push_back(static_cast<int32_t>(tokens.size()));
      std::vector<int32_t> row = s.blocks;
      row.resize(static_cast<size_t>(max_blocks), -1);
      tables.insert(tables.end(), row.begin(), row.end());
      s.fed += static_cast<int32_t>(feed.size());
      sample.push_back(a.generate == 0 || s.fed >= prompt_len);
      params.push_back(a.params);
      draws.push_back(static_cast<int64_t>(a.drawn + s.drawn.size()));
    }
    if (in_step.empty()) break;
    StepBatch b;
    b.tokens = tokens;
    b.offsets = offsets;
    b.starts = starts;
    b.block_tables = tables;
    b.max_blocks = max_blocks;
    b.sample = sample;
    b.params = params;
    b.draw_positions = draws;
    if (a.generate == 0) {
      std::vector<float> logits(in_step.size() * static_cast<size_t>(config.vocab_size));
      RETURN_IF_ERROR(executor->StepLogits(b, logits));
      out.write(reinterpret_cast<const char*>(logits.data()),
                static_cast<std::streamsize>(logits.size() * sizeof(float)));
    } else {
      std::vector<int32_t> next(in_step.size());
      RETURN_IF_ERROR(executor->Step(b, next));
      for (size_t j = 0; j < in_step.size(); ++j) {
        if (sample[j]) seqs[in_step[j]].drawn.push_back(next[j]);
      }
    }
    ++steps;
  }
  for (const Sequence& s : seqs) {
    out.write(reinterpret_cast<const char*>(s.drawn.data()),
              static_cast<std::streamsize>(s.drawn.size() * sizeof(int32_t)));
  }
  out.close();
  if (!out) return Internal("writing " + a.out + " failed");
  std::cerr << "llm_probe: " << steps << " steps, " << executor->num_blocks() << " blocks of "
            << a.block_size << "\n";
  return Status::Ok();
}

}  // namespace
}  // namespace hearth::llm

int main(int argc, char** argv) {
  auto args = hearth::llm::Parse(argc, argv);
  if (!args.ok()) {
    std::cerr << "llm_probe: " << args.status().ToString() << "\n";
    return 2;
  }
  const hearth::Status s = hearth::llm::Run(*args);
  if (!s.ok()) {
    std::cerr << "llm_probe: " << s.ToString() << "\n";
    return 1;
  }
  return 0;
}
