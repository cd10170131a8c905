// Engines from plug-in libraries through the loader (backends/plugin.h):
// OpenPlugin dlopen()s a test library (engine_plugin.cc, built by this
// directory's CMake) that exports hearth_create_engine through
// backends/engine_export.h, and a build of it without that symbol. A kind
// registered on the first gets its engine from the library; a kind of the
// second has none, and the error names it. A caller of another build is
// refused.
#include <gtest/gtest.h>

#include <array>
#include <string>

#include "backends/plugin.h"
#include "backends/registry.h"
#include "engine_test_support.h"

namespace hearth {
namespace {

using testing::CountRequest;
using testing::RecordingSink;

constexpr const char* kEntry = "hearth_test_plugin_name";

Plugin MustOpen(const char* name, const char* build_path) {
  auto plugin = OpenPlugin(name, build_path, {kEntry});
  EXPECT_TRUE(plugin.ok()) << plugin.status().ToString();
  return plugin.ok() ? std::move(plugin).value() : Plugin{};
}

const Plugin& Engines() {
  static const Plugin plugin =
      MustOpen("libhearth_test_engine_plugin.so", HEARTH_TEST_ENGINE_PLUGIN);
  return plugin;
}

const Plugin& Plain() {
  static const Plugin plugin = MustOpen("libhearth_test_plain_plugin.so", HEARTH_TEST_PLAIN_PLUGIN);
  return plugin;
}

const char* Name(const Plugin& p) { return reinterpret_cast<const char* (*)()>(p.entry.at(0))(); }

// The kind `name`, whose engine is the one of that name in `plugin` (as the
// CUDA library's kinds are registered).
void Register(const std::string& name, const Plugin& plugin) {
  BackendKind kind;
  kind.name = name;
  kind.create_engine = [&plugin, name](const std::vector<TensorView>& weights, Device device,
                                       const EngineOptions& options) {
    return CreatePluginEngine(plugin, name, weights, device, options);
  };
  ASSERT_TRUE(RegisterBackendKind(std::move(kind)).ok());
}

TEST(PluginEngines, ALibraryWithTheSymbolProvidesEngines) {
  const Plugin& p = Engines();
  ASSERT_EQ(p.entry.size(), 1u);
  EXPECT_STREQ(Name(p), "engines");
  ASSERT_NE(p.create_engine, nullptr);

  Register("plugin_count", p);
  EngineOptions options;
  options.max_streams = 2;
  options.batching = false;
  auto e = CreateEngine("plugin_count", {}, Device::Host(), options);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  Engine& engine = **e;
  EXPECT_EQ(engine.inputs(), (std::vector<IoSpec>{{"n", DType::kI64, {1}}}));
  EXPECT_EQ(engine.capacity(), 2u);
  CountRequest a(4, R"({"start": 100})", {100}), b(3), zero(0);
  ASSERT_TRUE(engine.Add(1, a.view()).ok());
  Status refused = engine.Add(3, zero.view());
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("input n"), std::string::npos) << refused.message();
  ASSERT_TRUE(engine.Add(2, b.view()).ok());
  RecordingSink sink;
  ASSERT_TRUE(engine.Step(sink).ok());
  engine.Cancel(2);
  while (engine.busy()) ASSERT_TRUE(engine.Step(sink).ok());
  EXPECT_EQ(sink.streams[1].numbers, (std::vector<int64_t>{101, 102, 103}));
  EXPECT_TRUE(sink.streams[1].final);
  EXPECT_EQ(sink.streams[2].numbers, (std::vector<int64_t>{0}));
  EXPECT_FALSE(sink.streams[2].final);

  // An exception in the library's factory arrives as an error.
  Register("plugin_throws", p);
  Status st = CreateEngine("plugin_throws", {}, Device::Host(), options).status();
  EXPECT_EQ(st.code(), StatusCode::kInternal);
  EXPECT_EQ(st.message(),
            "libhearth_test_engine_plugin.so: creating engine 'plugin_throws' threw: thrown in "
            "the plug-in");
  // The config's inputs and outputs reach the library's factory.
  Register("plugin_signature", p);
  options.inputs = {{"text_input", DType::kBytes, {1}}, {"messages", DType::kBytes, {1}}};
  options.outputs = {{"token_ids", DType::kI64, {-1}}};
  st = CreateEngine("plugin_signature", {}, Device::Host(), options).status();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(),
            "inputs: text_input BYTES [1] messages BYTES [1]; outputs: token_ids I64 [-1]");
  // A kind the library does not have.
  st = CreatePluginEngine(p, "llm", {}, Device::Host(), options).status();
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(st.message(),
            "libhearth_test_engine_plugin.so has no engine 'llm' (its engines: plugin_count, "
            "plugin_throws, plugin_signature)");
}

TEST(PluginEngines, ALibraryWithoutTheSymbolServesItsKindsWithoutEngines) {
  const Plugin& p = Plain();
  ASSERT_EQ(p.entry.size(), 1u);
  EXPECT_STREQ(Name(p), "plain");  // its entry points still serve
  EXPECT_EQ(p.create_engine, nullptr);

  Register("plain_count", p);
  Status st = CreateEngine("plain_count", {}, Device::Host(), EngineOptions{}).status();
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("backend kind 'plain_count' has no engine on cpu: "),
            std::string::npos)
      << st.message();
  EXPECT_NE(st.message().find("libhearth_test_plain_plugin.so exports no hearth_create_engine"),
            std::string::npos)
      << st.message();
}

TEST(PluginEngines, ALibraryRefusesACallerOfAnotherBuild) {
  const Plugin& p = Engines();
  ASSERT_NE(p.create_engine, nullptr);
  HearthEngineOptions options{};
  const HearthEngineTable* table = nullptr;
  void* engine = nullptr;
  std::array<char, 512> error{};
  const int code = p.create_engine(HEARTH_ENGINE_ABI_VERSION + 1, "plugin_count", nullptr, 0,
                                   static_cast<int32_t>(DeviceKind::kHost), 0, &options, &table,
                                   &engine, error.data(), error.size());
  EXPECT_EQ(code, static_cast<int>(StatusCode::kFailedPrecondition));
  EXPECT_EQ(std::string(error.data()),
            "libhearth_test_engine_plugin.so speaks engine ABI version " +
                std::to_string(HEARTH_ENGINE_ABI_VERSION) + ", the caller " +
                std::to_string(HEARTH_ENGINE_ABI_VERSION + 1) + ": it comes from another build");
  EXPECT_EQ(table, nullptr);
  EXPECT_EQ(engine, nullptr);
}

// A library without a required entry point is not taken, whatever else it
// exports.
TEST(PluginEngines, ALibraryWithoutARequiredEntryPointIsSkipped) {
  auto p = OpenPlugin("libhearth_test_engine_plugin.so", HEARTH_TEST_ENGINE_PLUGIN,
                      {kEntry, "hearth_no_such_entry"});
  EXPECT_EQ(p.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(p.status().message().find("missing hearth entry points"), std::string::npos)
      << p.status().message();
}

}  // namespace
}  // namespace hearth
