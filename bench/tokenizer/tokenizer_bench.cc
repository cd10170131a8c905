// The tokenizer of backend: llm (src/backends/llm/tokenizer.h): how long a
// worker takes to load a Llama 3-sized tokenizer.json, and how fast it
// encodes and decodes.
//
//   tokenizer_bench [--file tokenizer.json] [--repeat 7] [--string-merges]
//
// Without --file it generates one of Llama 3's size and shape (128,000
// tokens, 280,000 merges, 256 special tokens; tests/backends/llm/
// synthetic_tokenizer.h), writes it to a temporary file and measures that.
// Load is the whole Tokenizer::Load (read + parse + tables) from a hot page
// cache; Parse is the same from memory. Encode runs over ~200 KB of text
// (words, punctuation, digits, accents, CJK, whitespace runs); Decode and
// the Detokenizer over its ids. Prints a table of min / median.
#include <malloc.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "backends/llm/synthetic_tokenizer.h"
#include "backends/llm/tokenizer.h"

namespace {

using Clock = std::chrono::steady_clock;
using hearth::llm::Tokenizer;

template <typename F>
std::vector<double> TimeMs(int repeat, F&& f) {
  std::vector<double> ms;
  for (int i = 0; i < repeat; ++i) {
    const auto start = Clock::now();
    f();
    ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms;
}

// Resident memory now, after returning freed heap to the system.
long RssKiB() {
  malloc_trim(0);
  long pages = 0;
  long resident = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  return resident * (sysconf(_SC_PAGESIZE) / 1024);
}

std::string SampleText(size_t bytes) {
  static const char* kPieces[] = {
      "the",    "model", "worker", "loads",    "weights", "once",    "and",      "serves",
      "tokens", "to",    "many",   "clients",  "while",   "it's",    "running,", "quickly.",
      "12345",  "3.14",  "café",   "naïve",    "日本語",  "你好",    "😀",        "\n\n",
      "    ",   "(x)",   "a->b",   "HTTP/1.1", "JSON",    "{\"k\":", "1}",       "--flag"};
  std::mt19937 rng(5);
  std::string text;
  while (text.size() < bytes) {
    text += kPieces[rng() % (sizeof(kPieces) / sizeof(kPieces[0]))];
    text += ' ';
  }
  return text;
}

void Row(const char* what, const std::vector<double>& ms, const std::string& extra = "") {
  std::printf("| %-34s | %9.2f | %9.2f | %s |\n", what, ms.front(), ms[ms.size() / 2],
              extra.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tokenizer load / encode / decode benchmark"};
  std::string file;
  int repeat = 7;
  app.add_option("--file", file, "a tokenizer.json (default: a generated Llama 3-sized one)");
  app.add_option("--repeat", repeat, "timed runs of each measure")->check(CLI::Range(1, 1000));
  bool string_merges = false;
  app.add_flag("--string-merges", string_merges,
               "generated merges as \"a b\" strings (Llama 3's file) rather than pairs");
  CLI11_PARSE(app, argc, argv);

  std::string temp;
  if (file.empty()) {
    const auto start = Clock::now();
    const auto generated =
        hearth::llm::synthetic::MakeSyntheticTokenizer(128000, 280000, 1, string_merges);
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    char path[] = "/tmp/tokenizer_bench_XXXXXX";
    const int fd = mkstemp(path);
    if (fd < 0) {
      std::perror("mkstemp");
      return 1;
    }
    close(fd);
    temp = file = path;
    std::ofstream(file, std::ios::binary) << generated.json;
    std::printf("generated %s: %zu tokens, %zu merges, %zu added, %.1f MB (%.0f ms)\n",
                file.c_str(), generated.vocab, generated.merges, generated.added,
                generated.json.size() / 1e6, ms);
  }
  std::ifstream in(file, std::ios::binary);
  const std::string json((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::printf("file: %s, %.1f MB; %d runs each\n\n", file.c_str(), json.size() / 1e6, repeat);

  std::unique_ptr<Tokenizer> tokenizer;
  bool failed = false;
  std::printf("| %-34s | %9s | %9s | %s |\n", "measure", "min ms", "median ms", "");
  std::printf("|%s|%s|%s|---|\n", std::string(36, '-').c_str(), std::string(11, '-').c_str(),
              std::string(11, '-').c_str());
  // Each load is kept until all are timed: freeing the previous one is not
  // part of a load.
  std::vector<std::unique_ptr<Tokenizer>> loads;
  const auto load = TimeMs(repeat, [&] {
    auto loaded = Tokenizer::Load(file);
    if (!loaded.ok()) {
      std::fprintf(stderr, "%s\n", loaded.status().ToString().c_str());
      failed = true;
      return;
    }
    loads.push_back(std::move(loaded).value());
  });
  if (!failed) tokenizer = std::move(loads.back());
  loads.clear();
  if (failed) return 1;
  Row("Load (read + parse + tables)", load,
      "vocab_size " + std::to_string(tokenizer->vocab_size()));
  {
    // What one more loaded tokenizer keeps resident (the parser's buffers
    // are gone by then).
    const long before = RssKiB();
    auto second = Tokenizer::Load(file);
    const long after = RssKiB();
    std::printf("| %-34s | %9s | %9s | %.1f MiB |\n", "resident size of one tokenizer", "", "",
                (after - before) / 1024.0);
  }
  std::vector<std::unique_ptr<Tokenizer>> parses;
  Row("Parse (from memory)", TimeMs(repeat, [&] {
        auto parsed = Tokenizer::Parse(json, file);
        failed |= !parsed.ok();
        if (parsed.ok()) parses.push_back(std::move(parsed).value());
      }));
  parses.clear();

  const std::string text = SampleText(200000);
  std::vector<int32_t> ids;
  const auto encode = TimeMs(repeat, [&] {
    auto encoded = tokenizer->Encode(text, true, false);
    failed |= !encoded.ok();
    if (encoded.ok()) ids = std::move(encoded).value();
  });
  char extra[128];
  std::snprintf(extra, sizeof(extra), "%zu bytes -> %zu ids: %.1f MB/s", text.size(), ids.size(),
                text.size() / 1e3 / encode[encode.size() / 2]);
  Row("Encode", encode, extra);
  const auto decode = TimeMs(repeat, [&] { failed |= !tokenizer->Decode(ids, true).ok(); });
  std::snprintf(extra, sizeof(extra), "%.0f ns per id",
                decode[decode.size() / 2] * 1e6 / std::max<size_t>(ids.size(), 1));
  Row("Decode", decode, extra);
  const auto stream = TimeMs(repeat, [&] {
    auto detokenizer = tokenizer->NewDetokenizer(true);
    size_t bytes = 0;
    for (const int32_t id : ids) {
      auto piece = detokenizer.Push(id);
      failed |= !piece.ok();
      if (piece.ok()) bytes += piece->size();
    }
    bytes += detokenizer.Flush().size();
    failed |= bytes == 0;
  });
  std::snprintf(extra, sizeof(extra), "%.0f ns per id",
                stream[stream.size() / 2] * 1e6 / std::max<size_t>(ids.size(), 1));
  Row("Detokenizer (Push each id)", stream, extra);
  if (!temp.empty()) unlink(temp.c_str());
  if (failed) {
    std::fprintf(stderr, "a measured call failed\n");
    return 1;
  }
  return 0;
}
