// `hearth make-model`: writes a deterministic synthetic checkpoint (an mlp
// or a scale model), for tests, demos and benchmarks.
#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "checkpoint/synthetic.h"
#include "cli/cli_common.h"
#include "cli/commands.h"
#include "hearth/dtype.h"

namespace hearth::cli {
namespace {

Result<std::vector<int64_t>> ParseDims(const std::string& text) {
  std::vector<int64_t> dims;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    int64_t v = 0;
    auto [ptr, ec] = std::from_chars(text.data() + start, text.data() + comma, v);
    if (ec != std::errc() || ptr != text.data() + comma || v <= 0)
      return InvalidArgument("--dims '" + text + "' must be positive integers separated by commas");
    dims.push_back(v);
    start = comma + 1;
  }
  return dims;
}

int MakeModel(const std::string& kind, const std::string& dims_text, const std::string& dtype_text,
              uint64_t seed, const std::string& out, int threads, uint64_t shard_bytes) {
  Result<std::vector<int64_t>> dims = ParseDims(dims_text);
  if (!dims.ok()) return Fail(dims.status());
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  Status s;
  if (kind == "mlp") {
    if (dims->size() != 3) return Fail(InvalidArgument("mlp needs --dims IN,HIDDEN,OUT"));
    std::string upper = dtype_text;
    std::transform(upper.begin(), upper.end(), upper.begin(), ::toupper);
    std::optional<DType> dtype = ParseDType(upper);
    if (!dtype || (*dtype != DType::kF32 && *dtype != DType::kF16 && *dtype != DType::kBF16))
      return Fail(InvalidArgument("--dtype '" + dtype_text + "' is not one of f32, f16, bf16"));
    s = WriteSyntheticMlp((*dims)[0], (*dims)[1], (*dims)[2], *dtype, seed, out, threads,
                          shard_bytes);
  } else {
    if (dims->size() != 1) return Fail(InvalidArgument("scale needs --dims N"));
    if (dtype_text != "f32") return Fail(InvalidArgument("scale models are f32 only"));
    s = WriteSyntheticScale((*dims)[0], seed, out, threads, shard_bytes);
  }
  if (!s.ok()) return Fail(s);
  std::printf("wrote %s\n", out.c_str());
  return 0;
}

// What the command line sets.
struct MakeModelFlags {
  std::string kind, dims, dtype = "f32", out;
  uint64_t seed = 0;
  int threads = 0;
  uint64_t shard_bytes = 0;
};

int RunMakeModelCommand(const MakeModelFlags& f) {
  return MakeModel(f.kind, f.dims, f.dtype, f.seed, f.out, f.threads, f.shard_bytes);
}

}  // namespace

Subcommand AddMakeModelCommand(CLI::App& app) {
  auto* make = app.add_subcommand("make-model", "write a deterministic synthetic checkpoint");
  auto flags = std::make_shared<MakeModelFlags>();
  MakeModelFlags& f = *flags;
  make->add_option("kind", f.kind, "mlp or scale")
      ->required()
      ->check(CLI::IsMember({"mlp", "scale"}));
  make->add_option("--dims", f.dims, "mlp: IN,HIDDEN,OUT; scale: N")->required();
  make->add_option("--dtype", f.dtype, "f32, f16 or bf16 (mlp only)")->capture_default_str();
  make->add_option("--seed", f.seed, "random seed")
      ->capture_default_str()
      ->check(CLI::Validator(
          [](std::string& text) -> std::string {
            uint64_t value = 0;
            const auto [end, error] =
                std::from_chars(text.data(), text.data() + text.size(), value);
            if (error != std::errc() || end != text.data() + text.size())
              return "must be an integer from 0 to 18446744073709551615, not " + text;
            return "";
          },
          "UINT64"));
  make->add_option("--out", f.out, "output file (with --shard-bytes: directory)")->required();
  make->add_option("--shard-bytes", f.shard_bytes,
                   "write a checkpoint directory as save_pretrained does: shards of at most "
                   "this many bytes and model.safetensors.index.json (model.safetensors alone "
                   "if one shard holds it all)")
      ->check(AtLeast(1));
  make->add_option("--threads", f.threads, "generator threads (0 = all cores)")
      ->check(CLI::Range(0, 4096));
  return {make, [flags] { return RunMakeModelCommand(*flags); }};
}

}  // namespace hearth::cli
