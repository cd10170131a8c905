// The engine interface (backends/engine.h) through its reference, the
// built-in "count" engine: requests added, stepped together, cancelled and
// resumed, with a sink that records what a worker would send; and the
// registry's view of kinds with an engine, a backend or both.
#include "backends/engine.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <map>
#include <vector>

#include "backends/c_engine.h"
#include "backends/registry.h"
#include "engine_test_support.h"

namespace hearth {
namespace {

using testing::CountRequest;
using testing::RecordingSink;

std::unique_ptr<Engine> MustCount(uint32_t max_streams = 8,
                                  std::map<std::string, std::string> parameters = {}) {
  EngineOptions options;
  options.max_streams = max_streams;
  options.batching = false;
  options.parameters = std::move(parameters);
  auto engine = CreateEngine("count", {}, Device::Host(), options);
  EXPECT_TRUE(engine.ok()) << engine.status().ToString();
  return engine.ok() ? std::move(engine).value() : nullptr;
}

TEST(CountEngine, SaysItsSignatureAndCapacity) {
  auto e = MustCount(5);
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->inputs(), (std::vector<IoSpec>{{"n", DType::kI64, {1}}}));
  EXPECT_EQ(e->outputs(), (std::vector<IoSpec>{{"token_ids", DType::kI64, {-1}}}));
  EXPECT_EQ(e->capacity(), 5u);
  EXPECT_EQ(e->device_memory_bytes(), 0u);
  EXPECT_FALSE(e->busy());
  EXPECT_EQ(MustCount(5, {{"capacity", "2"}})->capacity(), 2u);
  EngineOptions bad;
  bad.parameters = {{"capacity", "two"}};
  EXPECT_EQ(CreateEngine("count", {}, Device::Host(), bad).status().code(),
            StatusCode::kInvalidArgument);
}

// Every request held gets one response a step, the last final; requests
// added between steps join the next one.
TEST(CountEngine, StepsEveryRequestItHoldsTogether) {
  auto e = MustCount();
  CountRequest a(3), b(1, R"({"start": 10})"), c(2, R"({"start": "-4", "other": [1]})");
  ASSERT_TRUE(e->Add(1, a.view()).ok());
  ASSERT_TRUE(e->Add(2, b.view()).ok());
  RecordingSink sink;
  ASSERT_TRUE(e->Step(sink).ok());
  EXPECT_EQ(sink.responses, 2);
  EXPECT_TRUE(sink.streams[2].final);
  EXPECT_FALSE(sink.streams[1].final);
  ASSERT_TRUE(e->Add(3, c.view()).ok());
  while (e->busy()) ASSERT_TRUE(e->Step(sink).ok());
  EXPECT_EQ(sink.streams[1].numbers, (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(sink.streams[2].numbers, (std::vector<int64_t>{10}));
  EXPECT_EQ(sink.streams[3].numbers, (std::vector<int64_t>{-4, -3}));
  for (auto& [id, s] : sink.streams) {
    EXPECT_TRUE(s.final) << id;
    EXPECT_TRUE(s.error.ok()) << id;
    for (const auto& shape : s.shapes) EXPECT_EQ(shape, (std::vector<int64_t>{1})) << id;
  }
  EXPECT_EQ(sink.responses, 6);
  // Nothing held: a step sends nothing.
  ASSERT_TRUE(e->Step(sink).ok());
  EXPECT_EQ(sink.responses, 6);
}

TEST(CountEngine, ACancelledRequestGetsNothingMore) {
  auto e = MustCount();
  CountRequest a(5), b(5);
  ASSERT_TRUE(e->Add(1, a.view()).ok());
  ASSERT_TRUE(e->Add(2, b.view()).ok());
  RecordingSink sink;
  ASSERT_TRUE(e->Step(sink).ok());
  e->Cancel(1);
  e->Cancel(99);  // not held: ignored
  while (e->busy()) ASSERT_TRUE(e->Step(sink).ok());
  EXPECT_EQ(sink.streams[1].numbers, (std::vector<int64_t>{0}));
  EXPECT_FALSE(sink.streams[1].final);
  EXPECT_EQ(sink.streams[2].numbers, (std::vector<int64_t>{0, 1, 2, 3, 4}));
  // A request its worker no longer holds (End: false) is dropped.
  CountRequest c(5);
  ASSERT_TRUE(e->Add(3, c.view()).ok());
  sink.closed[3] = true;
  ASSERT_TRUE(e->Step(sink).ok());
  EXPECT_FALSE(e->busy());
}

// A resumed request goes on after the tokens its client has, which must be
// the count's first.
TEST(CountEngine, AResumedRequestGoesOnAfterItsTokens) {
  auto e = MustCount();
  CountRequest a(5, R"({"start": 7})", {7, 8, 9});
  ASSERT_TRUE(e->Add(1, a.view()).ok());
  RecordingSink sink;
  while (e->busy()) ASSERT_TRUE(e->Step(sink).ok());
  EXPECT_EQ(sink.streams[1].numbers, (std::vector<int64_t>{10, 11}));
  EXPECT_TRUE(sink.streams[1].final);

  CountRequest wrong(5, "", {0, 2});
  Status s = e->Add(2, wrong.view());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("token 1 is 2, not 1"), std::string::npos) << s.message();
  CountRequest over(2, "", {0, 1});
  EXPECT_EQ(e->Add(3, over.view()).code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(e->busy());  // refused requests are not held
}

TEST(CountEngine, RefusesBadRequestsAndChangesNothing) {
  auto e = MustCount(2);
  CountRequest zero(0), huge(int64_t{1} << 40), params(3, "[1]"), start(3, R"({"start": 1.5})");
  EXPECT_EQ(e->Add(1, zero.view()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(e->Add(2, huge.view()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(e->Add(3, params.view()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(e->Add(4, start.view()).code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(e->busy());
  CountRequest a(1), b(1), c(1);
  ASSERT_TRUE(e->Add(5, a.view()).ok());
  EXPECT_EQ(e->Add(5, b.view()).code(), StatusCode::kInvalidArgument);  // held already
  ASSERT_TRUE(e->Add(6, b.view()).ok());
  EXPECT_EQ(e->Add(7, c.view()).code(), StatusCode::kResourceExhausted);  // past capacity
}

// With a batching config the shapes have the leading 1.
TEST(CountEngine, BatchingShapesHaveTheLeadingOne) {
  EngineOptions options;
  options.batching = true;
  auto e = CreateEngine("count", {}, Device::Host(), options);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  CountRequest a(2);
  a.shape = {1, 1};
  ASSERT_TRUE((*e)->Add(1, a.view()).ok());
  RecordingSink sink;
  while ((*e)->busy()) ASSERT_TRUE((*e)->Step(sink).ok());
  EXPECT_EQ(sink.streams[1].shapes, (std::vector<std::vector<int64_t>>{{1, 1}, {1, 1}}));
}

TEST(EngineRegistry, KindsProvideAnEngineABackendOrBoth) {
  const BackendKind* count = FindBackendKind("count");
  ASSERT_NE(count, nullptr);
  EXPECT_TRUE(count->create_engine);
  EXPECT_FALSE(count->create);
  BackendOptions options;
  Status s = CreateBackend("count", {}, Device::Host(), options).status();
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("decoupled models only"), std::string::npos) << s.message();

  s = CreateEngine("scale", {}, Device::Host(), EngineOptions{}).status();
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("'scale' has no engine"), std::string::npos) << s.message();
  EXPECT_EQ(CreateEngine("nope", {}, Device::Host(), EngineOptions{}).status().code(),
            StatusCode::kInvalidArgument);

  BackendKind both;
  both.name = "engine_test_both";
  both.create = [](const std::vector<TensorView>&, Device, const BackendOptions&) {
    return Result<std::unique_ptr<Backend>>(Unimplemented("not in this test"));
  };
  both.create_engine = [](const std::vector<TensorView>&, Device, const EngineOptions& o) {
    return CreateCountEngine(o);
  };
  ASSERT_TRUE(RegisterBackendKind(both).ok());
  EXPECT_TRUE(CreateEngine("engine_test_both", {}, Device::Host(), EngineOptions{}).ok());
  BackendKind neither;
  neither.name = "engine_test_neither";
  EXPECT_FALSE(RegisterBackendKind(neither).ok());
  BackendKind program_and_engine = both;
  program_and_engine.name = "engine_test_program";
  program_and_engine.program = [](const BackendOptions&) {
    return Result<ProgramLaunch>(ProgramLaunch{});
  };
  EXPECT_FALSE(RegisterBackendKind(program_and_engine).ok());
}

// A plug-in's engine through the C table (backends/engine_abi.h): this
// "library" forwards every C call to a count engine of its own, lending it a
// ResponseSink over the C sink, so that what comes out of the wrapped engine
// went through both directions of the ABI.
namespace plugin {

struct Handle {
  std::unique_ptr<Engine> count;
  std::vector<HearthEngineSpec> in, out;
  bool* destroyed;
};

class CSink final : public ResponseSink {
 public:
  explicit CSink(const HearthEngineSink* c) : c_(c) {}
  Result<std::byte*> Output(uint64_t id, size_t i, std::span<const int64_t> shape,
                            uint64_t bytes) override {
    void* room = nullptr;
    char error[256] = {};
    const int code =
        c_->output(c_->context, id, i, shape.data(), static_cast<int32_t>(shape.size()), bytes,
                   &room, error, sizeof error);
    if (code != 0) return Status(static_cast<StatusCode>(code), error);
    return static_cast<std::byte*>(room);
  }
  Result<bool> End(uint64_t id, bool final, const Status& status) override {
    int32_t sent = 0;
    char error[256] = {};
    const int code = c_->end(c_->context, id, final ? 1 : 0, static_cast<int32_t>(status.code()),
                             status.message().c_str(), &sent, error, sizeof error);
    if (code != 0) return Status(static_cast<StatusCode>(code), error);
    return sent != 0;
  }

 private:
  const HearthEngineSink* c_;
};

Handle& H(void* h) { return *static_cast<Handle*>(h); }
int Answer(const Status& s, char* error, size_t size) {
  if (s.ok()) return 0;
  std::snprintf(error, size, "%s", s.message().c_str());
  return static_cast<int>(s.code());
}

const HearthEngineTable kTable = {
    HEARTH_ENGINE_ABI_VERSION,
    sizeof(HearthEngineTable),
    [](void* h) {
      *H(h).destroyed = true;
      delete &H(h);
    },
    [](void* h, const HearthEngineSpec** specs, size_t* n) {
      *specs = H(h).in.data();
      *n = H(h).in.size();
    },
    [](void* h, const HearthEngineSpec** specs, size_t* n) {
      *specs = H(h).out.data();
      *n = H(h).out.size();
    },
    [](void* h) { return H(h).count->capacity(); },
    [](void*) { return uint64_t{12345}; },
    [](void* h, uint64_t id, const HearthEngineRequest* r, char* error, size_t size) {
      std::vector<EngineInput> inputs;
      for (size_t i = 0; i < r->num_inputs; ++i)
        inputs.push_back({{static_cast<const std::byte*>(r->inputs[i].data), r->inputs[i].bytes},
                          {r->inputs[i].shape, static_cast<size_t>(r->inputs[i].rank)}});
      const EngineRequest request{
          inputs, {r->parameters_json, r->parameters_bytes}, {r->resume, r->num_resume}};
      return Answer(H(h).count->Add(id, request), error, size);
    },
    [](void* h, uint64_t id) { H(h).count->Cancel(id); },
    [](void* h, const HearthEngineSink* sink, char* error, size_t size) {
      CSink s(sink);
      return Answer(H(h).count->Step(s), error, size);
    },
    [](void* h) { return H(h).count->busy() ? 1 : 0; },
    [](void*, uint64_t* used, uint64_t* total, uint64_t* preemptions) {
      *used = 3;
      *total = 64;
      *preemptions = 1;
    },
};

void* Create(bool* destroyed) {
  EngineOptions options;
  options.max_streams = 3;
  auto* h = new Handle{std::move(CreateCountEngine(options)).value(), {}, {}, destroyed};
  for (const IoSpec& s : h->count->inputs())
    h->in.push_back({s.name.c_str(), static_cast<int32_t>(s.dtype),
                     static_cast<int32_t>(s.dims.size()), s.dims.data()});
  for (const IoSpec& s : h->count->outputs())
    h->out.push_back({s.name.c_str(), static_cast<int32_t>(s.dtype),
                      static_cast<int32_t>(s.dims.size()), s.dims.data()});
  return h;
}

}  // namespace plugin

TEST(CEngine, APluginsEngineServesThroughTheCTable) {
  bool destroyed = false;
  {
    auto e = WrapCEngine(&plugin::kTable, plugin::Create(&destroyed));
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    Engine& engine = **e;
    EXPECT_EQ(engine.inputs(), (std::vector<IoSpec>{{"n", DType::kI64, {1}}}));
    EXPECT_EQ(engine.outputs(), (std::vector<IoSpec>{{"token_ids", DType::kI64, {-1}}}));
    EXPECT_EQ(engine.capacity(), 3u);
    EXPECT_EQ(engine.device_memory_bytes(), 12345u);
    EXPECT_EQ(engine.counters(), (EngineCounters{3, 64, 1}));
    CountRequest a(3, R"({"start": 5})"), b(4, "", {0, 1}), c(9), bad(0);
    ASSERT_TRUE(engine.Add(1, a.view()).ok());
    ASSERT_TRUE(engine.Add(2, b.view()).ok());
    Status refused = engine.Add(4, bad.view());
    EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(refused.message().find("input n"), std::string::npos) << refused.message();
    ASSERT_TRUE(engine.Add(3, c.view()).ok());
    EXPECT_EQ(engine.Add(5, bad.view()).code(), StatusCode::kResourceExhausted);
    RecordingSink sink;
    ASSERT_TRUE(engine.Step(sink).ok());
    engine.Cancel(3);
    while (engine.busy()) ASSERT_TRUE(engine.Step(sink).ok());
    EXPECT_EQ(sink.streams[1].numbers, (std::vector<int64_t>{5, 6, 7}));
    EXPECT_EQ(sink.streams[2].numbers, (std::vector<int64_t>{2, 3}));
    EXPECT_EQ(sink.streams[3].numbers, (std::vector<int64_t>{0}));
    EXPECT_TRUE(sink.streams[1].final && sink.streams[2].final);
    EXPECT_FALSE(destroyed);
  }
  EXPECT_TRUE(destroyed);

  // Another version's table is refused, and its engine released.
  HearthEngineTable old = plugin::kTable;
  old.size = sizeof(HearthEngineTable) - sizeof(void*);
  destroyed = false;
  void* handle = plugin::Create(&destroyed);
  EXPECT_EQ(WrapCEngine(&old, handle).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_FALSE(destroyed);  // a table too short to trust is not called
  plugin::kTable.destroy(handle);
  HearthEngineTable missing = plugin::kTable;
  missing.step = nullptr;
  destroyed = false;
  EXPECT_EQ(WrapCEngine(&missing, plugin::Create(&destroyed)).status().code(),
            StatusCode::kFailedPrecondition);
  EXPECT_TRUE(destroyed);
}

}  // namespace
}  // namespace hearth
