// The host side of backend: llm's engine (llm_engine.h) with an executor that
// costs nothing: what one worker's thread spends per step on everything but
// the model (planning the step and the one queued behind it, the block
// tables, the tokens' text through the detokenizer and the stop strings,
// each stream's response), and so the most steps a second the engine could
// feed a device. On a GPU the step overlap hides this work behind the
// device's step as long as it is the shorter of the two (docs/llm.md, the
// engine's step).
//
//   engine_host_bench [--streams 1,16,64,256] [--prompt-tokens 128]
//                     [--max-tokens 128] [--repeats 3] [--data DIR]
//
// For each stream count: that many streams start at once, each a prompt of
// about --prompt-tokens tokens of English text (the Llama 3-shaped tokenizer
// of tests/data/llm) and --max-tokens tokens drawn from a cycle of ordinary
// words, with a stop string that never matches; the engine steps until all
// have ended. Prints, per count, the median of --repeats runs:
//   engine streams=64 prompt_tokens=129 steps=131 tokens=8192 us_per_step=23.3 ...
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "backends/llm/llm_engine.h"
#include "backends/llm/tokenizer.h"
#include "tiny_version.h"

namespace hearth::llm {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

[[noreturn]] void Fail(const std::string& why) {
  std::fprintf(stderr, "engine_host_bench: %s\n", why.c_str());
  std::exit(1);
}

// Draws tokens[draw position % size] for each sampled sequence, at once.
class InstantExecutor final : public Executor {
 public:
  InstantExecutor(const ExecutorOptions& o, std::vector<int32_t> tokens)
      : block_size_(o.block_size),
        blocks_(static_cast<int32_t>(o.kv_pool_bytes / 4096)),
        tokens_(std::move(tokens)) {}
  int32_t block_size() const override { return block_size_; }
  int32_t num_blocks() const override { return blocks_; }
  uint64_t device_memory_bytes() const override { return 0; }
  Status Step(const StepBatch& b, std::span<int32_t> next) override {
    for (size_t i = 0; i < b.num_seqs(); ++i) {
      next[i] = b.sample[i] != 0
                    ? tokens_[static_cast<size_t>(b.draw_positions[i]) % tokens_.size()]
                    : -1;
    }
    return Status::Ok();
  }
  Status StepLogits(const StepBatch&, std::span<float>) override {
    return Unimplemented("engine_host_bench draws tokens only");
  }

 private:
  int32_t block_size_, blocks_;
  std::vector<int32_t> tokens_;
};

// Each output written into a buffer of its own reused for every response, as
// the worker writes them into its response ring; counts the responses, the
// streams that ended, the tokens drawn (token_ids) and the prompt tokens the
// engine counted (prompt_tokens, on each stream's last response).
class ReusingSink final : public ResponseSink {
 public:
  explicit ReusingSink(const std::vector<IoSpec>& outputs) : room_(outputs.size()) {
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].name == "token_ids") token_ids_ = i;
      if (outputs[i].name == "prompt_tokens") prompt_tokens_ = i;
    }
  }
  Result<std::byte*> Output(uint64_t, size_t i, std::span<const int64_t>, uint64_t bytes) override {
    if (room_[i].size() < bytes) room_[i].resize(bytes);
    written_[i] = bytes;
    return room_[i].data();
  }
  Result<bool> End(uint64_t, bool final, const Status& status) override {
    if (!status.ok()) Fail("a stream failed: " + status.ToString());
    ++responses;
    if (final) ++ended;
    if (auto t = written_.find(token_ids_); t != written_.end()) tokens += t->second / 8;
    if (auto p = written_.find(prompt_tokens_); p != written_.end() && p->second == 8) {
      int64_t n = 0;
      std::memcpy(&n, room_[prompt_tokens_].data(), 8);
      prompt_tokens += static_cast<uint64_t>(n);
    }
    written_.clear();
    return true;
  }
  uint64_t responses = 0, ended = 0, tokens = 0, prompt_tokens = 0;

 private:
  std::vector<std::vector<std::byte>> room_;
  std::map<size_t, uint64_t> written_;
  size_t token_ids_ = SIZE_MAX, prompt_tokens_ = SIZE_MAX;
};

// A request's text_input (4-byte length, then the bytes) and its views.
struct Request {
  std::vector<std::byte> bytes;
  std::vector<int64_t> shape{1};
  std::vector<EngineInput> inputs;
  std::string parameters;
  Request(const std::string& text, std::string params) : parameters(std::move(params)) {
    const auto n = static_cast<uint32_t>(text.size());
    bytes.resize(4 + n);
    std::memcpy(bytes.data(), &n, 4);
    std::memcpy(bytes.data() + 4, text.data(), n);
    inputs.push_back({bytes, shape});
  }
  EngineRequest view() const { return {inputs, parameters, {}}; }
};

std::vector<int64_t> ParseList(const std::string& text) {
  std::vector<int64_t> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) {
    try {
      out.push_back(std::stoll(item));
    } catch (const std::exception&) {
      Fail("\"" + item + "\" is not a number");
    }
  }
  return out;
}

// The tiny version directory (tests/backends/llm/tiny_version.h) in a
// temporary folder, and its zero weights.
struct Version {
  fs::path dir;
  std::vector<std::vector<float>> storage;
  std::vector<TensorView> weights;

  explicit Version(const fs::path& data) {
    for (const fs::path& f : {data / "tokenizers" / "npm_llama3_style" / "tokenizer.json",
                              data / "templates" / "llama3.jinja"}) {
      std::error_code ec;
      if (!fs::is_regular_file(f, ec)) Fail("no " + f.string() + " (--data)");
    }
    dir = fs::temp_directory_path() / ("hearth-engine-host-bench-" + std::to_string(::getpid()));
    fs::remove_all(dir);
    fs::create_directories(dir);
    testing::WriteTinyVersion(dir, data, 4096);
    weights = testing::TinyWeights(storage);
  }
  ~Version() { fs::remove_all(dir); }
};

int Main(int argc, char** argv) {
  std::string streams_text = "1,16,64,256";
  int prompt_tokens = 128, max_tokens = 128, repeats = 3;
  std::string data = HEARTH_LLM_TEST_DATA_DIR;
  CLI::App app{"engine_host_bench: backend llm's engine with an executor that costs nothing"};
  app.add_option("--streams", streams_text, "stream counts, each run in turn");
  app.add_option("--prompt-tokens", prompt_tokens, "about this many prompt tokens a stream")
      ->check(CLI::PositiveNumber);
  app.add_option("--max-tokens", max_tokens, "tokens drawn a stream")->check(CLI::PositiveNumber);
  app.add_option("--repeats", repeats, "runs per count (the median is printed)")
      ->check(CLI::PositiveNumber);
  app.add_option("--data", data, "tests/data/llm (the fixture tokenizer and chat template)");
  CLI11_PARSE(app, argc, argv);
  const std::vector<int64_t> counts = ParseList(streams_text);
  if (counts.empty() || *std::min_element(counts.begin(), counts.end()) < 1)
    Fail("--streams needs positive counts");

  const Version version{fs::path(data)};
  auto tokenizer = Tokenizer::Load((version.dir / "tokenizer.json").string());
  if (!tokenizer.ok()) Fail(tokenizer.status().ToString());
  // The drawn tokens: ordinary words, so that the detokenizer and the stop
  // strings work on text.
  const char* const words =
      " one copy of the weights is mapped by every worker process and each stream outlives its"
      " worker, resumed where it was with the same tokens";
  auto drawn = (*tokenizer)->Encode(words, false, false);
  if (!drawn.ok() || drawn->empty()) Fail("encoding the drawn words failed");
  const std::vector<int32_t> tokens(drawn->begin(), drawn->end());
  // The prompt: the words over and over, as many as keep the tokenizer's
  // count (the engine adds <|begin_of_text|>) under prompt_tokens.
  std::vector<std::string> pieces;
  for (std::stringstream in(words); !in.eof();) {
    std::string w;
    in >> w;
    if (!w.empty()) pieces.push_back(" " + w);
  }
  std::string prompt = "Request:";
  for (size_t i = 0;; ++i) {
    const std::string longer = prompt + pieces[i % pieces.size()];
    auto ids = (*tokenizer)->Encode(longer, false, false);
    if (!ids.ok()) Fail(ids.status().ToString());
    if (static_cast<int>(ids->size()) + 1 > prompt_tokens) break;
    prompt = longer;
  }

  for (const int64_t count : counts) {
    const auto streams = static_cast<uint32_t>(count);
    std::vector<double> seconds;
    uint64_t steps = 0, tokens_out = 0;
    double prompt_mean = 0;
    for (int rep = 0; rep < repeats; ++rep) {
      EngineOptions o;
      o.version_dir = version.dir.string();
      o.max_streams = streams;
      o.batching = false;
      // Room for every stream's prompt and tokens, in blocks of 16 tokens.
      const uint64_t blocks =
          streams * static_cast<uint64_t>((prompt_tokens + max_tokens) / 16 + 2) + 16;
      o.parameters = {{"kv_cache_bytes", std::to_string(blocks * 4096)},
                      {"max_tokens_per_step", "2048"}};
      o.inputs = {{"text_input", DType::kBytes, {1}}};
      auto engine = CreateLlmEngine(
          version.weights, o, false,
          [&](const ModelConfig&, const ModelWeights&, const ExecutorOptions& eo) {
            return Result<std::unique_ptr<Executor>>(std::make_unique<InstantExecutor>(eo, tokens));
          });
      if (!engine.ok()) Fail(engine.status().ToString());
      Engine& e = **engine;
      const std::string params = "{\"max_tokens\": " + std::to_string(max_tokens) +
                                 ", \"stop\": [\"no such stop string\"]}";
      std::vector<Request> requests;
      requests.reserve(streams);
      for (uint32_t i = 0; i < streams; ++i) requests.emplace_back(prompt, params);
      ReusingSink sink(e.outputs());
      const auto t0 = Clock::now();
      for (uint32_t i = 0; i < streams; ++i) {
        if (Status added = e.Add(i + 1, requests[i].view()); !added.ok())
          Fail("adding a stream: " + added.ToString());
      }
      uint64_t n = 0;
      while (e.busy()) {
        if (Status stepped = e.Step(sink); !stepped.ok()) Fail(stepped.ToString());
        ++n;
      }
      seconds.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      if (sink.ended != streams) Fail("not every stream ended");
      steps = n;
      tokens_out = sink.tokens;
      prompt_mean = static_cast<double>(sink.prompt_tokens) / streams;
    }
    std::sort(seconds.begin(), seconds.end());
    const double s = seconds[seconds.size() / 2];
    std::printf(
        "engine streams=%u prompt_tokens=%.0f steps=%llu tokens=%llu us_per_step=%.1f "
        "us_per_token=%.2f host_tokens_per_s=%.0f\n",
        streams, prompt_mean, static_cast<unsigned long long>(steps),
        static_cast<unsigned long long>(tokens_out), s * 1e6 / static_cast<double>(steps),
        s * 1e6 / static_cast<double>(tokens_out), static_cast<double>(tokens_out) / s);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace
}  // namespace hearth::llm

int main(int argc, char** argv) { return hearth::llm::Main(argc, argv); }
