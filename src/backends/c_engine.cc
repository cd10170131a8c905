#include "backends/c_engine.h"

#include <array>
#include <cstring>
#include <string>

namespace hearth {
namespace {

using ErrorText = std::array<char, 4096>;

Status FromC(int code, const ErrorText& error) {
  if (code == 0) return Status::Ok();
  return Status(static_cast<StatusCode>(code),
                std::string(error.data(), strnlen(error.data(), error.size())));
}

// Writes `s` as a C function of the ABI answers it.
int ToC(const Status& s, char* error, size_t error_size) {
  if (s.ok()) return 0;
  if (error != nullptr && error_size > 0) {
    const size_t n = std::min(error_size - 1, s.message().size());
    std::memcpy(error, s.message().data(), n);
    error[n] = '\0';
  }
  return static_cast<int>(s.code());
}

std::vector<IoSpec> Specs(void (*list)(void*, const HearthEngineSpec**, size_t*), void* handle) {
  const HearthEngineSpec* specs = nullptr;
  size_t count = 0;
  list(handle, &specs, &count);
  std::vector<IoSpec> out;
  for (size_t i = 0; i < count; ++i) {
    const HearthEngineSpec& s = specs[i];
    out.push_back({s.name != nullptr ? s.name : "", static_cast<DType>(s.dtype),
                   std::vector<int64_t>(s.dims, s.dims + std::max(s.rank, 0))});
  }
  return out;
}

// The worker's ResponseSink as the C sink a step is lent.
struct SinkContext {
  ResponseSink* sink;
};

int SinkOutput(void* context, uint64_t id, size_t index, const int64_t* shape, int32_t rank,
               uint64_t bytes, void** room, char* error, size_t error_size) {
  ResponseSink& sink = *static_cast<SinkContext*>(context)->sink;
  if (rank < 0 || (rank > 0 && shape == nullptr) || room == nullptr)
    return ToC(InvalidArgument("output: a negative rank, or no shape or room"), error, error_size);
  auto r =
      sink.Output(id, index, std::span<const int64_t>(shape, static_cast<size_t>(rank)), bytes);
  if (!r.ok()) return ToC(r.status(), error, error_size);
  *room = *r;
  return 0;
}

int SinkEnd(void* context, uint64_t id, int32_t final, int32_t status_code, const char* message,
            int32_t* sent, char* error, size_t error_size) {
  ResponseSink& sink = *static_cast<SinkContext*>(context)->sink;
  const Status status = status_code == 0 ? Status::Ok()
                                         : Status(static_cast<StatusCode>(status_code),
                                                  message != nullptr ? message : "");
  auto r = sink.End(id, final != 0, status);
  if (!r.ok()) return ToC(r.status(), error, error_size);
  if (sent != nullptr) *sent = *r ? 1 : 0;
  return 0;
}

class CEngine final : public Engine {
 public:
  CEngine(const HearthEngineTable* table, void* handle) : table_(table), handle_(handle) {
    inputs_ = Specs(table_->inputs, handle_);
    outputs_ = Specs(table_->outputs, handle_);
  }
  ~CEngine() override { table_->destroy(handle_); }
  CEngine(const CEngine&) = delete;
  CEngine& operator=(const CEngine&) = delete;

  const std::vector<IoSpec>& inputs() const override { return inputs_; }
  const std::vector<IoSpec>& outputs() const override { return outputs_; }
  uint32_t capacity() const override { return table_->capacity(handle_); }
  uint64_t device_memory_bytes() const override { return table_->device_memory_bytes(handle_); }
  bool busy() const override { return table_->busy(handle_) != 0; }
  EngineCounters counters() const override {
    EngineCounters c;
    table_->counters(handle_, &c.kv_blocks_used, &c.kv_blocks_total, &c.preemptions);
    return c;
  }
  void Cancel(uint64_t id) override { table_->cancel(handle_, id); }

  Status Add(uint64_t id, const EngineRequest& r) override {
    std::vector<HearthEngineInput> inputs;
    for (const EngineInput& in : r.inputs)
      inputs.push_back({in.bytes.data(), in.bytes.size(), in.shape.data(),
                        static_cast<int32_t>(in.shape.size())});
    const HearthEngineRequest c{
        inputs.data(),   inputs.size(),  r.parameters_json.data(), r.parameters_json.size(),
        r.resume.data(), r.resume.size()};
    ErrorText error{};
    return FromC(table_->add(handle_, id, &c, error.data(), error.size()), error);
  }

  Status Step(ResponseSink& sink) override {
    SinkContext context{&sink};
    const HearthEngineSink c{&context, SinkOutput, SinkEnd};
    ErrorText error{};
    return FromC(table_->step(handle_, &c, error.data(), error.size()), error);
  }

 private:
  const HearthEngineTable* table_;
  void* handle_;
  std::vector<IoSpec> inputs_, outputs_;
};

}  // namespace

Result<std::unique_ptr<Engine>> WrapCEngine(const HearthEngineTable* table, void* handle) {
  if (table == nullptr) return FailedPrecondition("the plug-in gave no engine table");
  auto refuse = [&](std::string why) {
    if (table->abi_version == HEARTH_ENGINE_ABI_VERSION && table->size >= sizeof *table &&
        table->destroy != nullptr)
      table->destroy(handle);
    return FailedPrecondition("the plug-in's engine table: " + why);
  };
  if (table->abi_version != HEARTH_ENGINE_ABI_VERSION)
    return refuse("ABI version " + std::to_string(table->abi_version) + ", this worker's is " +
                  std::to_string(HEARTH_ENGINE_ABI_VERSION));
  if (table->size < sizeof *table)
    return refuse(std::to_string(table->size) + " bytes, fewer than version " +
                  std::to_string(HEARTH_ENGINE_ABI_VERSION) + "'s " +
                  std::to_string(sizeof *table));
  if (table->destroy == nullptr || table->inputs == nullptr || table->outputs == nullptr ||
      table->capacity == nullptr || table->device_memory_bytes == nullptr ||
      table->add == nullptr || table->cancel == nullptr || table->step == nullptr ||
      table->busy == nullptr || table->counters == nullptr)
    return refuse("a function is missing");
  return std::unique_ptr<Engine>(new CEngine(table, handle));
}

}  // namespace hearth
