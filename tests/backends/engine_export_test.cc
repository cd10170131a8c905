// The export side of the engine ABI (backends/engine_export.h) against its
// import side (WrapCEngine, backends/c_engine.h), in one process: an engine
// exported into the C table and wrapped back behaves as itself (the count
// engine's numbers, resume, cancel, errors from Add), exceptions thrown
// inside it arrive as errors, the worker's sink errors come back from Step
// as they were, and the views of a request outlive the add call. Then
// CreateExportedEngine, the body of a library's hearth_create_engine: its
// checks of the caller's ABI version, the kind, the device and the weights,
// and what its factories get.
#include "backends/engine_export.h"

#include <gtest/gtest.h>

#include <array>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "backends/c_engine.h"
#include "engine_test_support.h"

namespace hearth {
namespace {

using testing::CountRequest;
using testing::RecordingSink;

// `engine` exported into the C table and wrapped back.
std::unique_ptr<Engine> RoundTrip(std::unique_ptr<Engine> engine, std::string_view name) {
  const HearthEngineTable* table = nullptr;
  void* handle = nullptr;
  const Status exported = ExportEngine(std::move(engine), name, &table, &handle);
  EXPECT_TRUE(exported.ok()) << exported.ToString();
  if (!exported.ok()) return nullptr;
  auto wrapped = WrapCEngine(table, handle);
  EXPECT_TRUE(wrapped.ok()) << wrapped.status().ToString();
  return wrapped.ok() ? std::move(wrapped).value() : nullptr;
}

std::unique_ptr<Engine> Count(uint32_t max_streams, bool batching = false) {
  EngineOptions options;
  options.max_streams = max_streams;
  options.batching = batching;
  auto count = CreateCountEngine(options);
  EXPECT_TRUE(count.ok()) << count.status().ToString();
  return count.ok() ? RoundTrip(std::move(count).value(), "count") : nullptr;
}

// An engine whose every member is what the test says: to throw, to fail,
// to keep its requests' views.
class ScriptedEngine final : public Engine {
 public:
  std::vector<IoSpec> in = {{"x", DType::kI64, {-1}}}, out = {{"y", DType::kI64, {-1}}};
  bool inputs_throw = false;
  std::function<uint32_t()> on_capacity = [] { return 4u; };
  std::function<uint64_t()> on_device_memory = [] { return uint64_t{77}; };
  std::function<bool()> on_busy = [] { return false; };
  std::function<Status(uint64_t, const EngineRequest&)> on_add =
      [](uint64_t, const EngineRequest&) { return Status::Ok(); };
  std::function<void(uint64_t)> on_cancel = [](uint64_t) {};
  std::function<Status(ResponseSink&)> on_step = [](ResponseSink&) { return Status::Ok(); };

  const std::vector<IoSpec>& inputs() const override {
    if (inputs_throw) throw std::runtime_error("no inputs today");
    return in;
  }
  const std::vector<IoSpec>& outputs() const override { return out; }
  uint32_t capacity() const override { return on_capacity(); }
  uint64_t device_memory_bytes() const override { return on_device_memory(); }
  bool busy() const override { return on_busy(); }
  Status Add(uint64_t id, const EngineRequest& r) override { return on_add(id, r); }
  void Cancel(uint64_t id) override { on_cancel(id); }
  Status Step(ResponseSink& sink) override { return on_step(sink); }
};

TEST(EngineExport, TheCountEngineRoundTrips) {
  auto e = Count(3);
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->inputs(), (std::vector<IoSpec>{{"n", DType::kI64, {1}}}));
  EXPECT_EQ(e->outputs(), (std::vector<IoSpec>{{"token_ids", DType::kI64, {-1}}}));
  EXPECT_EQ(e->capacity(), 3u);
  EXPECT_EQ(e->device_memory_bytes(), 0u);
  EXPECT_FALSE(e->busy());

  CountRequest a(3, R"({"start": 5})"), b(4, R"({"start": "-2"})", {-2, -1}), c(9), zero(0);
  ASSERT_TRUE(e->Add(1, a.view()).ok());
  ASSERT_TRUE(e->Add(2, b.view()).ok());  // resumed after the two its client has
  Status refused = e->Add(4, zero.view());
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("input n: 0 is not from 1"), std::string::npos)
      << refused.message();
  CountRequest wrong(5, "", {0, 2});
  refused = e->Add(5, wrong.view());
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("token 1 is 2, not 1"), std::string::npos) << refused.message();
  ASSERT_TRUE(e->Add(3, c.view()).ok());
  EXPECT_EQ(e->Add(6, zero.view()).code(), StatusCode::kResourceExhausted);  // 3 held
  EXPECT_TRUE(e->busy());

  RecordingSink sink;
  ASSERT_TRUE(e->Step(sink).ok());
  EXPECT_EQ(sink.responses, 3);
  e->Cancel(3);
  e->Cancel(99);  // not held: ignored
  while (e->busy()) ASSERT_TRUE(e->Step(sink).ok());
  EXPECT_EQ(sink.streams[1].numbers, (std::vector<int64_t>{5, 6, 7}));
  EXPECT_EQ(sink.streams[2].numbers, (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(sink.streams[3].numbers, (std::vector<int64_t>{0}));
  EXPECT_TRUE(sink.streams[1].final && sink.streams[2].final);
  EXPECT_FALSE(sink.streams[3].final);
  for (const auto& shape : sink.streams[1].shapes) EXPECT_EQ(shape, (std::vector<int64_t>{1}));

  // A request the worker no longer holds (End: false) is dropped.
  CountRequest d(5);
  ASSERT_TRUE(e->Add(7, d.view()).ok());
  sink.closed[7] = true;
  ASSERT_TRUE(e->Step(sink).ok());
  EXPECT_FALSE(e->busy());
}

TEST(EngineExport, BatchingShapesKeepTheLeadingOne) {
  auto e = Count(1, /*batching=*/true);
  ASSERT_NE(e, nullptr);
  CountRequest a(2);
  a.shape = {1, 1};
  ASSERT_TRUE(e->Add(1, a.view()).ok());
  RecordingSink sink;
  while (e->busy()) ASSERT_TRUE(e->Step(sink).ok());
  EXPECT_EQ(sink.streams[1].numbers, (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(sink.streams[1].shapes, (std::vector<std::vector<int64_t>>{{1, 1}, {1, 1}}));
}

TEST(EngineExport, ExceptionsInsideTheEngineBecomeErrors) {
  auto scripted = std::make_unique<ScriptedEngine>();
  ScriptedEngine& s = *scripted;
  auto e = RoundTrip(std::move(scripted), "thrower");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->capacity(), 4u);
  EXPECT_EQ(e->device_memory_bytes(), 77u);

  s.on_add = [](uint64_t, const EngineRequest&) -> Status {
    throw std::runtime_error("add broke");
  };
  CountRequest a(1);
  Status st = e->Add(1, a.view());
  EXPECT_EQ(st.code(), StatusCode::kInternal);
  EXPECT_EQ(st.message(), "engine 'thrower': add threw: add broke");

  s.on_step = [](ResponseSink&) -> Status { throw 42; };
  RecordingSink sink;
  st = e->Step(sink);
  EXPECT_EQ(st.code(), StatusCode::kInternal);
  EXPECT_EQ(st.message(), "engine 'thrower': step threw: an exception that is no std::exception");
  EXPECT_EQ(sink.responses, 0);

  // The functions without an error to return fail safe.
  s.on_capacity = []() -> uint32_t { throw std::logic_error("capacity"); };
  s.on_device_memory = []() -> uint64_t { throw std::logic_error("memory"); };
  s.on_busy = []() -> bool { throw std::logic_error("busy"); };
  bool cancelled = false;
  s.on_cancel = [&](uint64_t) {
    cancelled = true;
    throw std::logic_error("cancel");
  };
  EXPECT_EQ(e->capacity(), 0u);
  EXPECT_EQ(e->device_memory_bytes(), 0u);
  EXPECT_TRUE(e->busy());  // so that a step reports what is wrong
  e->Cancel(1);
  EXPECT_TRUE(cancelled);

  // An engine whose inputs throw is not exported, and is released.
  auto broken = std::make_unique<ScriptedEngine>();
  broken->inputs_throw = true;
  const HearthEngineTable* table = nullptr;
  void* handle = nullptr;
  st = ExportEngine(std::move(broken), "broken", &table, &handle);
  EXPECT_EQ(st.code(), StatusCode::kInternal);
  EXPECT_NE(st.message().find("engine 'broken': its inputs or outputs threw: no inputs today"),
            std::string::npos)
      << st.message();
  EXPECT_EQ(table, nullptr);
  EXPECT_EQ(handle, nullptr);
}

// The worker's sink fails (its channel to the server broke): Step returns
// that error, code and message, through both sides of the ABI. A request
// the engine ends with its own error reaches the sink with it.
TEST(EngineExport, TheSinksErrorsAndARequestsErrorPassThrough) {
  class BrokenSink final : public ResponseSink {
   public:
    bool fail_output = true;
    Result<std::byte*> Output(uint64_t, size_t, std::span<const int64_t>, uint64_t) override {
      if (fail_output) return Unavailable("the worker's channel to the server is closed");
      return reinterpret_cast<std::byte*>(&room);
    }
    Result<bool> End(uint64_t, bool, const Status&) override {
      return DeviceLost("the response ring is gone");
    }
    int64_t room = 0;
  };
  auto e = Count(2);
  ASSERT_NE(e, nullptr);
  CountRequest a(3);
  ASSERT_TRUE(e->Add(1, a.view()).ok());
  BrokenSink broken;
  Status st = e->Step(broken);
  EXPECT_EQ(st.code(), StatusCode::kUnavailable);
  EXPECT_EQ(st.message(), "the worker's channel to the server is closed");
  broken.fail_output = false;
  st = e->Step(broken);
  EXPECT_EQ(st.code(), StatusCode::kDeviceLost);
  EXPECT_EQ(st.message(), "the response ring is gone");

  auto scripted = std::make_unique<ScriptedEngine>();
  scripted->on_step = [](ResponseSink& sink) -> Status {
    ASSIGN_OR_RETURN(const bool sent, sink.End(8, true, InvalidArgument("token 3 is not text")));
    return sent ? Status::Ok() : Internal("not sent");
  };
  auto ends = RoundTrip(std::move(scripted), "ends");
  ASSERT_NE(ends, nullptr);
  RecordingSink sink;
  ASSERT_TRUE(ends->Step(sink).ok());
  EXPECT_EQ(sink.streams[8].error.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(sink.streams[8].error.message(), "token 3 is not text");
  EXPECT_TRUE(sink.streams[8].final);
}

// The engine keeps views (EngineRequest), so the array of inputs it was
// given must outlive the add call: its step reads them and sends input x
// back as output y.
TEST(EngineExport, ARequestsViewsOutliveTheAddCall) {
  auto scripted = std::make_unique<ScriptedEngine>();
  std::map<uint64_t, EngineRequest> kept;
  scripted->on_add = [&](uint64_t id, const EngineRequest& r) {
    kept[id] = r;
    return Status::Ok();
  };
  scripted->on_busy = [&] { return !kept.empty(); };
  scripted->on_step = [&](ResponseSink& sink) -> Status {
    for (auto& [id, r] : kept) {
      if (r.inputs.size() != 1) return InvalidArgument("echo: one input");
      const EngineInput& x = r.inputs[0];
      ASSIGN_OR_RETURN(std::byte * room, sink.Output(id, 0, x.shape, x.bytes.size()));
      std::memcpy(room, x.bytes.data(), x.bytes.size());
      RETURN_IF_ERROR(sink.End(id, true).status());
    }
    kept.clear();
    return Status::Ok();
  };
  auto e = RoundTrip(std::move(scripted), "echo");
  ASSERT_NE(e, nullptr);
  CountRequest a(41), b(42);
  ASSERT_TRUE(e->Add(1, a.view()).ok());
  ASSERT_TRUE(e->Add(2, b.view()).ok());
  RecordingSink sink;
  ASSERT_TRUE(e->Step(sink).ok());
  EXPECT_EQ(sink.streams[1].numbers, (std::vector<int64_t>{41}));
  EXPECT_EQ(sink.streams[2].numbers, (std::vector<int64_t>{42}));
  EXPECT_FALSE(e->busy());
}

TEST(EngineExport, ATableOfAnotherVersionIsRefused) {
  EngineOptions options;
  const HearthEngineTable* table = nullptr;
  void* handle = nullptr;
  ASSERT_TRUE(
      ExportEngine(std::move(CreateCountEngine(options)).value(), "count", &table, &handle).ok());
  HearthEngineTable other = *table;
  other.abi_version = HEARTH_ENGINE_ABI_VERSION + 1;
  Status st = WrapCEngine(&other, handle).status();
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("ABI version " + std::to_string(HEARTH_ENGINE_ABI_VERSION + 1) +
                              ", this worker's is " + std::to_string(HEARTH_ENGINE_ABI_VERSION)),
            std::string::npos)
      << st.message();
  table->destroy(handle);  // a table it cannot trust is not called
}

// ---- CreateExportedEngine ----------------------------------------------------

EngineOptions probed;  // what the "probe" factory was given

constexpr ExportedEngineKind kKinds[] = {
    {"count", [](const std::vector<TensorView>&, Device,
                 const EngineOptions& o) { return CreateCountEngine(o); }},
    {"probe",
     [](const std::vector<TensorView>& weights, Device device, const EngineOptions& o) {
       probed = o;
       if (weights.size() != 1 || weights[0].name != "w" || weights[0].device != device ||
           weights[0].shape != std::vector<int64_t>{2, 3} || weights[0].nbytes != 24)
         return Result<std::unique_ptr<Engine>>(InvalidArgument("probe: not the weights sent"));
       return CreateCountEngine(o);
     }},
    {"throws",
     [](const std::vector<TensorView>&, Device, const EngineOptions&)
         -> Result<std::unique_ptr<Engine>> { throw std::runtime_error("no such model here"); }},
    {"null",
     [](const std::vector<TensorView>&, Device, const EngineOptions&) {
       return Result<std::unique_ptr<Engine>>(std::unique_ptr<Engine>());
     }},
};

struct Call {
  ExportedEngines engines{"libtest.so", kKinds};
  uint32_t abi_version = HEARTH_ENGINE_ABI_VERSION;
  int32_t device_kind = static_cast<int32_t>(DeviceKind::kHost), device_index = 0;
  std::vector<HearthCudaTensor> weights;
  HearthEngineOptions options{};
  const HearthEngineTable* table = nullptr;
  void* engine = nullptr;
  std::array<char, 512> error{};

  Status Run(const char* kind) {
    const int code = CreateExportedEngine(engines, abi_version, kind, weights.data(),
                                          weights.size(), device_kind, device_index, &options,
                                          &table, &engine, error.data(), error.size());
    return code == 0 ? Status::Ok() : Status(static_cast<StatusCode>(code), error.data());
  }
  std::unique_ptr<Engine> Wrapped() {
    auto e = WrapCEngine(table, engine);
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    return e.ok() ? std::move(e).value() : nullptr;
  }
};

TEST(CreateExportedEngine, BuildsTheKindWithTheCallersOptions) {
  Call call;
  const std::array<int64_t, 2> shape = {2, 3};
  const std::array<float, 6> data{};
  call.device_kind = static_cast<int32_t>(DeviceKind::kCuda);
  call.device_index = 2;
  call.weights = {{"w", static_cast<int32_t>(DType::kF32), 2, shape.data(), data.data(), 24,
                   static_cast<int32_t>(DeviceKind::kCuda), 2}};
  const std::array<const char*, 2> keys = {"capacity", "other"}, values = {"2", "x"};
  call.options.common = {4, 1, 2, keys.data(), values.data()};
  call.options.version_dir = "/models/m/3";
  call.options.batching = 1;
  call.options.max_streams = 9;
  const std::vector<IoSpec> inputs = {{"text_input", DType::kBytes, {1}},
                                      {"messages", DType::kBytes, {1}}};
  const std::vector<IoSpec> outputs = {{"token_ids", DType::kI64, {-1}}};
  const std::vector<HearthEngineSpec> c_inputs = EngineSpecs(inputs),
                                      c_outputs = EngineSpecs(outputs);
  call.options.inputs = c_inputs.data();
  call.options.num_inputs = c_inputs.size();
  call.options.outputs = c_outputs.data();
  call.options.num_outputs = c_outputs.size();
  ASSERT_TRUE(call.Run("probe").ok()) << call.error.data();
  EXPECT_EQ(probed.inputs, inputs);
  EXPECT_EQ(probed.outputs, outputs);
  EXPECT_EQ(probed.max_batch_size, 4);
  EXPECT_TRUE(probed.allow_tf32);
  EXPECT_EQ(probed.parameters,
            (std::map<std::string, std::string>{{"capacity", "2"}, {"other", "x"}}));
  EXPECT_EQ(probed.version_dir, "/models/m/3");
  EXPECT_TRUE(probed.batching);
  EXPECT_EQ(probed.max_streams, 9u);
  auto e = call.Wrapped();
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->capacity(), 2u);  // parameters.capacity
  CountRequest a(2, R"({"start": 3})");
  a.shape = {1, 1};
  ASSERT_TRUE(e->Add(1, a.view()).ok());
  RecordingSink sink;
  while (e->busy()) ASSERT_TRUE(e->Step(sink).ok());
  EXPECT_EQ(sink.streams[1].numbers, (std::vector<int64_t>{3, 4}));
}

TEST(CreateExportedEngine, RefusesAnotherBuildsCaller) {
  Call call;
  call.abi_version = HEARTH_ENGINE_ABI_VERSION + 1;
  Status st = call.Run("count");
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(st.message(), "libtest.so speaks engine ABI version " +
                              std::to_string(HEARTH_ENGINE_ABI_VERSION) + ", the caller " +
                              std::to_string(HEARTH_ENGINE_ABI_VERSION + 1) +
                              ": it comes from another build");
  EXPECT_EQ(call.table, nullptr);
  EXPECT_EQ(call.engine, nullptr);
}

TEST(CreateExportedEngine, NamesWhatIsWrong) {
  Call call;
  Status st = call.Run("nope");
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(st.message(),
            "libtest.so has no engine 'nope' (its engines: count, probe, throws, null)");

  st = call.Run("throws");
  EXPECT_EQ(st.code(), StatusCode::kInternal);
  EXPECT_EQ(st.message(), "libtest.so: creating engine 'throws' threw: no such model here");
  EXPECT_EQ(call.table, nullptr);
  st = call.Run("null");
  EXPECT_EQ(st.code(), StatusCode::kInternal);

  // A device the library does not build on, or none at all.
  call.engines.on_host = false;
  st = call.Run("count");
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("libtest.so builds no engine on device kind 0"), std::string::npos)
      << st.message();
  call.engines.on_host = true;
  call.device_kind = 7;
  EXPECT_EQ(call.Run("count").code(), StatusCode::kInvalidArgument);
  call.device_kind = static_cast<int32_t>(DeviceKind::kHost);

  // Weights on another device than the engine's, or malformed.
  const std::array<int64_t, 1> shape = {1};
  const float one = 1;
  call.weights = {{"w", static_cast<int32_t>(DType::kF32), 1, shape.data(), &one, 4,
                   static_cast<int32_t>(DeviceKind::kCuda), 0}};
  st = call.Run("count");
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), "weight 'w' is on cuda:0, but the engine runs on cpu");
  call.weights[0].device_kind = static_cast<int32_t>(DeviceKind::kHost);
  call.weights[0].shape = nullptr;
  st = call.Run("count");
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), "malformed weight #0");
  call.weights[0].shape = shape.data();

  // The config's inputs, malformed.
  HearthEngineSpec bad{"x", static_cast<int32_t>(DType::kF32), 2, nullptr};
  call.options.inputs = &bad;
  call.options.num_inputs = 1;
  st = call.Run("count");
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), "hearth_create_engine: input #0 is malformed");
  call.options.inputs = nullptr;
  st = call.Run("count");
  EXPECT_EQ(st.message(), "hearth_create_engine: null inputs");
  call.options.num_inputs = 0;

  ASSERT_TRUE(call.Run("count").ok()) << call.error.data();
  call.table->destroy(call.engine);

  // Null arguments.
  std::array<char, 256> error{};
  EXPECT_EQ(
      CreateExportedEngine(call.engines, HEARTH_ENGINE_ABI_VERSION, nullptr, nullptr, 0, 0, 0,
                           &call.options, &call.table, &call.engine, error.data(), error.size()),
      static_cast<int>(StatusCode::kInvalidArgument));
  EXPECT_EQ(CreateExportedEngine(call.engines, HEARTH_ENGINE_ABI_VERSION, "count", nullptr, 0, 0, 0,
                                 nullptr, &call.table, &call.engine, error.data(), error.size()),
            static_cast<int>(StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace hearth
