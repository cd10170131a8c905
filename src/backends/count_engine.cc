// The built-in engine "count" (backends/engine.h): the reference of the
// Engine interface. Apart from engine.cc (CreateEngine, which needs the
// registry) so that a plug-in library can build it too: the CUDA library
// serves it for models on a GPU.
#include <cstring>
#include <map>
#include <string>

#include "backends/engine.h"
#include "nlohmann/json.hpp"

namespace hearth {
namespace {

constexpr int64_t kMaxCount = int64_t{1} << 20;

// The integer parameter `name` of a request: absent is `fallback`; a JSON
// integer or a string of one.
Result<int64_t> IntegerParameter(const nlohmann::json& parameters, const char* name,
                                 int64_t fallback) {
  auto it = parameters.find(name);
  if (it == parameters.end()) return fallback;
  if (it->is_number_integer()) return it->get<int64_t>();
  if (it->is_string()) {
    const std::string& text = it->get_ref<const std::string&>();
    size_t used = 0;
    try {
      const long long v = std::stoll(text, &used);
      if (used == text.size()) return static_cast<int64_t>(v);
    } catch (const std::exception&) {
    }
  }
  return InvalidArgument(std::string("parameter ") + name + ": " + it->dump().substr(0, 64) +
                         " is not an integer");
}

class CountEngine final : public Engine {
 public:
  CountEngine(uint32_t capacity, bool batching) : capacity_(capacity), batching_(batching) {
    inputs_ = {{"n", DType::kI64, {1}}};
    outputs_ = {{"token_ids", DType::kI64, {-1}}};
  }

  const std::vector<IoSpec>& inputs() const override { return inputs_; }
  const std::vector<IoSpec>& outputs() const override { return outputs_; }
  uint32_t capacity() const override { return capacity_; }
  uint64_t device_memory_bytes() const override { return 0; }
  bool busy() const override { return !held_.empty(); }
  void Cancel(uint64_t id) override { held_.erase(id); }

  Status Add(uint64_t id, const EngineRequest& r) override {
    if (held_.count(id) != 0) return InvalidArgument("request " + std::to_string(id) + " is held");
    if (held_.size() >= capacity_)
      return ResourceExhausted("the count engine holds " + std::to_string(capacity_) +
                               " requests already");
    if (r.inputs.size() != 1 || r.inputs[0].bytes.size() != sizeof(int64_t))
      return InvalidArgument("input n: one INT64 element");
    int64_t n = 0;
    std::memcpy(&n, r.inputs[0].bytes.data(), sizeof n);
    if (n < 1 || n > kMaxCount)
      return InvalidArgument("input n: " + std::to_string(n) + " is not from 1 to " +
                             std::to_string(kMaxCount));
    nlohmann::json parameters = nlohmann::json::object();
    if (!r.parameters_json.empty()) {
      parameters = nlohmann::json::parse(r.parameters_json, nullptr, false);
      if (!parameters.is_object()) return InvalidArgument("the parameters are not a JSON object");
    }
    ASSIGN_OR_RETURN(const int64_t start, IntegerParameter(parameters, "start", 0));
    if (start < -kMaxCount || start > kMaxCount)
      return InvalidArgument("parameter start: " + std::to_string(start) + " is not from " +
                             std::to_string(-kMaxCount) + " to " + std::to_string(kMaxCount));
    if (r.resume.size() >= static_cast<uint64_t>(n))
      return InvalidArgument("resume: the client has " + std::to_string(r.resume.size()) +
                             " tokens of a count of " + std::to_string(n) +
                             ", which ended with the last");
    for (size_t k = 0; k < r.resume.size(); ++k) {
      if (r.resume[k] != start + static_cast<int64_t>(k))
        return InvalidArgument("resume: token " + std::to_string(k) + " is " +
                               std::to_string(r.resume[k]) + ", not " +
                               std::to_string(start + static_cast<int64_t>(k)));
    }
    held_[id] = Count{start + static_cast<int64_t>(r.resume.size()), start + n};
    return Status::Ok();
  }

  Status Step(ResponseSink& sink) override {
    std::vector<int64_t> shape = batching_ ? std::vector<int64_t>{1, 1} : std::vector<int64_t>{1};
    for (auto it = held_.begin(); it != held_.end();) {
      Count& c = it->second;
      ASSIGN_OR_RETURN(std::byte * room, sink.Output(it->first, 0, shape, sizeof(int64_t)));
      std::memcpy(room, &c.next, sizeof c.next);
      ++c.next;
      const bool final = c.next == c.end;
      ASSIGN_OR_RETURN(const bool sent, sink.End(it->first, final));
      it = (final || !sent) ? held_.erase(it) : std::next(it);
    }
    return Status::Ok();
  }

 private:
  struct Count {
    int64_t next = 0, end = 0;  // the next number to send; one past the last
  };
  const uint32_t capacity_;
  const bool batching_;
  std::vector<IoSpec> inputs_, outputs_;
  std::map<uint64_t, Count> held_;  // by id
};

}  // namespace

Result<std::unique_ptr<Engine>> CreateCountEngine(const EngineOptions& options) {
  uint32_t capacity = options.max_streams;
  if (auto it = options.parameters.find("capacity"); it != options.parameters.end()) {
    const std::string& text = it->second;
    if (text.empty() || text.size() > 6 ||
        text.find_first_not_of("0123456789") != std::string::npos || std::stoul(text) < 1)
      return InvalidArgument("parameters.capacity '" + text.substr(0, 32) +
                             "' is not a whole number from 1 to 999999");
    capacity = static_cast<uint32_t>(std::stoul(text));
  }
  return std::unique_ptr<Engine>(new CountEngine(capacity, options.batching));
}

}  // namespace hearth
